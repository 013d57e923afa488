#include "harness.h"

#include <mha/parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>

namespace mha::test {

Strides padded_strides(Layout layout, std::int64_t batch, std::int64_t len, std::int64_t heads,
                       std::int64_t dim, std::int64_t pad) {
  (void)batch;
  Strides s;
  if (layout == Layout::token_major) {
    s.head = dim + pad;
    s.seq = heads * s.head + pad;
    s.batch = len * s.seq + pad;
  } else {
    s.seq = dim + pad;
    s.head = len * s.seq + pad;
    s.batch = heads * s.head + pad;
  }
  return s;
}

Guarded::Guarded(std::int64_t elements, std::int64_t misalign)
    : elements_(elements), misalign_(misalign) {
  float pattern;
  std::memcpy(&pattern, &kPattern, sizeof pattern);
  storage_.assign(static_cast<std::size_t>(2 * kGuard + misalign + elements), pattern);
}

bool Guarded::same_as(const std::vector<float>& snap) const {
  return snap.size() == storage_.size() &&
         std::memcmp(snap.data(), storage_.data(), snap.size() * sizeof(float)) == 0;
}

std::string Guarded::untouched_outside(const std::vector<bool>& is_element) const {
  const auto bits = [](float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  const std::int64_t begin = -(kGuard + misalign_);
  const std::int64_t end = elements_ + kGuard;
  const float* base = data();
  for (std::int64_t i = begin; i < end; ++i) {
    const bool element = i >= 0 && i < elements_ && is_element[static_cast<std::size_t>(i)];
    if (!element && bits(base[i]) != kPattern) {
      std::ostringstream os;
      os << "offset " << i << " (tensor has " << elements_ << " floats) was written: " << base[i];
      return os.str();
    }
  }
  return std::string();
}

Inputs make_inputs(const Case& c) {
  Inputs in;
  Problem& p = in.p;
  p = c.p;
  const std::int64_t B = p.batch, H = p.q_heads, Hkv = p.kv_heads, D = p.head_dim;
  p.q = padded_strides(c.q_layout, B, p.q_len, H, D, c.pad);
  p.k = p.v = padded_strides(c.kv_layout, B, p.kv_len, Hkv, D, c.pad);
  p.o = padded_strides(c.o_layout, B, p.q_len, H, D, c.pad);
  p.lse = {H * (p.q_len + c.pad) + c.pad, p.q_len + c.pad};

  // Offsets of q, k, v in one arena, 32 pattern floats apart.
  std::int64_t q_off = 0, k_off = 0, v_off = 0, total = 0;
  constexpr std::int64_t kGap = 32;
  switch (c.storage) {
    case Storage::fused_qkv: {
      const std::int64_t head = D + c.pad;
      const std::int64_t row = (H + 2 * Hkv) * head + c.pad;
      p.q = p.k = p.v = {p.q_len * row + c.pad, row, head};
      k_off = H * head;
      v_off = (H + Hkv) * head;
      total = v_off + v_extent(p);  // v's columns end each row
      break;
    }
    case Storage::shared_kv:
      k_off = v_off = q_extent(p) + kGap;
      total = k_off + k_extent(p);
      break;
    case Storage::broadcast_batch:
      p.k.batch = p.v.batch = 0;
      [[fallthrough]];
    case Storage::separate:
      k_off = q_extent(p) + kGap;
      v_off = k_off + k_extent(p) + kGap;
      total = v_off + v_extent(p);
      break;
  }
  in.arena = Guarded(total, c.misalign);
  float* base = in.arena.data();
  float* q = base + q_off;
  float* k = base + k_off;
  float* v = base + v_off;
  in.q = q;
  in.k = k;
  in.v = v;

  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const float a = static_cast<float>(c.values == Values::large_logits ? c.value_scale : 1.0);
  // Per (batch, kv head, column) values for equal keys and constant v.
  std::vector<float> row_k(static_cast<std::size_t>(B * Hkv * D)),
      row_v(static_cast<std::size_t>(B * Hkv * D));
  for (auto& x : row_k) x = unit(rng);
  for (auto& x : row_v) x = unit(rng);
  const auto at = [&](const std::vector<float>& t, std::int64_t b, std::int64_t h, std::int64_t d) {
    return t[static_cast<std::size_t>((b * Hkv + h) * D + d)];
  };
  const std::int64_t dominant =
      static_cast<std::int64_t>(c.seed % static_cast<std::uint64_t>(p.kv_len));

  for_each_element(B, p.q_len, H, D, [&](auto b, auto l, auto h, auto d) {
    float x = a * unit(rng);
    if (c.values == Values::dominant_key && d == 0) x = 1.0f;
    q[b * p.q.batch + l * p.q.seq + h * p.q.head + d] = x;
  });
  for_each_element(B, p.kv_len, Hkv, D, [&](auto b, auto l, auto h, auto d) {
    float x = a * unit(rng);
    if (c.values == Values::equal_keys) x = at(row_k, b, h, d);
    if (c.values == Values::dominant_key && l == dominant && d == 0) x = 50.0f / p.scale;
    k[b * p.k.batch + l * p.k.seq + h * p.k.head + d] = x;
  });
  if (c.storage != Storage::shared_kv) {
    for_each_element(B, p.kv_len, Hkv, D, [&](auto b, auto l, auto h, auto d) {
      const float x = c.values == Values::constant_v ? at(row_v, b, h, d) : unit(rng);
      v[b * p.v.batch + l * p.v.seq + h * p.v.head + d] = x;
    });
  }
  in.before = in.arena.snapshot();
  return in;
}

namespace {

std::vector<bool> element_mask(std::int64_t size, const Strides& s, std::int64_t batch,
                               std::int64_t len, std::int64_t heads, std::int64_t dim) {
  std::vector<bool> mask(static_cast<std::size_t>(size), false);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t l = 0; l < len; ++l)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t row = b * s.batch + l * s.seq + h * s.head;
        std::fill_n(mask.begin() + row, dim, true);
      }
  return mask;
}

}  // namespace

Outputs run(const KernelInfo& kernel, const Inputs& in, std::int64_t misalign) {
  return run(kernel, in.p, in, in.q, in.k, in.v, misalign);
}

namespace {
// The driver as a kernel: a stateless function reading the kernel and thread count set
// just before the call (tests run properties on one thread).
Kernel g_driver_kernel = nullptr;
int g_driver_threads = 1;
void driver(const Problem& p, const float* q, const float* k, const float* v, float* o,
            float* lse) {
  parallel_attention(g_driver_kernel, p, q, k, v, o, lse, g_driver_threads);
}
}  // namespace

Outputs run_driver(const KernelInfo& kernel, const Inputs& in, int threads) {
  g_driver_kernel = kernel.fn;
  g_driver_threads = threads;
  KernelInfo as_kernel = kernel;
  as_kernel.fn = &driver;
  return run(as_kernel, in);
}

Tolerance merged_tolerance(Tolerance tol, double parts) {
  for (std::size_t r = 0; r < tol.o.size(); ++r) {
    const double eta = std::exp(2.0 * tol.lse[r]) * (1.0 + 2.0 * std::ldexp(1.0, -24)) - 1.0;
    tol.o[r] += (ref::weight_shift(eta) + accumulation_factor(parts)) * tol.v_max[r];
    tol.lse[r] += std::log1p(eta) + accumulation_factor(parts);
  }
  return tol;
}

Outputs run(const KernelInfo& kernel, const Problem& p, const Inputs& in, const float* q,
            const float* k, const float* v, std::int64_t misalign) {
  Outputs out;
  out.o = Guarded(o_extent(p), misalign);
  out.lse = Guarded(lse_extent(p), (misalign + 3) % 16);
  kernel.fn(p, q, k, v, out.o.data(), out.lse.data());

  RC_ASSERT_FALSE(!in.arena.same_as(in.before));  // a kernel wrote into its inputs
  const std::string o_guard = out.o.untouched_outside(
      element_mask(out.o.size(), p.o, p.batch, p.q_len, p.q_heads, p.head_dim));
  if (!o_guard.empty()) RC_FAIL(std::string(kernel.name) + " wrote outside o: " + o_guard);
  const Strides lse_as_tensor{p.lse.batch, 1, p.lse.head};  // [b][i][h] with d = 1
  const std::string lse_guard = out.lse.untouched_outside(
      element_mask(out.lse.size(), lse_as_tensor, p.batch, p.q_len, p.q_heads, 1));
  if (!lse_guard.empty()) RC_FAIL(std::string(kernel.name) + " wrote outside lse: " + lse_guard);
  return out;
}

namespace {

void fail(const std::string& what, const char* quantity, std::int64_t b, std::int64_t h,
          std::int64_t i, std::int64_t d, double got, double want, double bound) {
  std::ostringstream os;
  os << std::setprecision(9) << what << ": " << quantity << "[b=" << b << "][h=" << h << "][i=" << i
     << "]";
  if (d >= 0) os << "[d=" << d << "]";
  os << " = " << got << ", expected " << want << " (|diff| " << std::fabs(got - want) << ", bound "
     << bound << ")";
  RC_FAIL(os.str());
}

// `got` must equal `want` within `bound`, with non-finite values exactly where expected.
bool close(double got, double want, double bound) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return !std::isfinite(got);
  return std::isfinite(got) && std::fabs(got - want) <= bound;
}

}  // namespace

namespace {

// Rows [row0, row0 + rows) of p, every head and column: got_* against want_* (indexed by
// p's row) within scale times the row's tolerance. A row that sees no key must be exactly
// zeros with lse = -inf on both sides; an infinite expected lse must be matched exactly.
template <typename GotO, typename GotLse, typename WantO, typename WantLse>
void compare_rows(const Problem& p, std::int64_t row0, std::int64_t rows, const Tolerance& tol,
                  double scale, const std::string& what, GotO got_o, GotLse got_lse, WantO want_o,
                  WantLse want_lse) {
  const double neg_inf = -std::numeric_limits<double>::infinity();
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      for (std::int64_t i = row0; i < row0 + rows; ++i) {
        const bool masked = visible_keys(p, i) == 0;
        const std::size_t r = tol.row(b, h, i);
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          const double got = got_o(b, h, i, d), want = want_o(b, h, i, d);
          const bool ok = masked ? got == 0.0 && want == 0.0 : close(got, want, scale * tol.o[r]);
          if (!ok) fail(what, "o", b, h, i, d, got, want, scale * tol.o[r]);
        }
        const double got = got_lse(b, h, i), want = want_lse(b, h, i);
        const bool ok =
            masked ? got == neg_inf && want == neg_inf
                   : (std::isinf(want) ? got == want : close(got, want, scale * tol.lse[r]));
        if (!ok) fail(what, "lse", b, h, i, -1, got, want, scale * tol.lse[r]);
      }
    }
  }
}

}  // namespace

void expect_close(const Problem& p, const Outputs& out, const ref::Result& expected,
                  const Tolerance& tol, double scale, const std::string& what) {
  compare_rows(
      p, 0, p.q_len, tol, scale, what,
      [&](auto b, auto h, auto i, auto d) { return out.o_at(p, b, h, i, d); },
      [&](auto b, auto h, auto i) { return out.lse_at(p, b, h, i); },
      [&](auto b, auto h, auto i, auto d) { return expected.o_at(b, h, i, d); },
      [&](auto b, auto h, auto i) { return expected.lse_at(b, h, i); });
}

void expect_close(const Problem& p, const Outputs& out, const Problem& p2, const Outputs& out2,
                  const Tolerance& tol, const std::string& what, std::int64_t row0) {
  // Both sides are within tol of the exact result, so within 2 tol of each other.
  compare_rows(
      p, row0, p2.q_len, tol, 2.0, what,
      [&](auto b, auto h, auto i, auto d) { return out2.o_at(p2, b, h, i - row0, d); },
      [&](auto b, auto h, auto i) { return out2.lse_at(p2, b, h, i - row0); },
      [&](auto b, auto h, auto i, auto d) { return out.o_at(p, b, h, i, d); },
      [&](auto b, auto h, auto i) { return out.lse_at(p, b, h, i); });
}

Dense gather(const float* t, const Strides& s, std::int64_t batch, std::int64_t len,
             std::int64_t heads, std::int64_t dim) {
  Dense out;
  out.batch = batch;
  out.len = len;
  out.heads = heads;
  out.dim = dim;
  out.x.resize(static_cast<std::size_t>(batch * len * heads * dim));
  for_each_element(batch, len, heads, dim, [&](auto b, auto l, auto h, auto d) {
    out.at(b, l, h, d) = t[b * s.batch + l * s.seq + h * s.head + d];
  });
  return out;
}

Inputs dense_inputs(const Problem& shape, const Dense& q, const Dense& k, const Dense& v,
                    std::int64_t misalign) {
  Inputs in;
  Problem& p = in.p;
  p = shape;
  p.q = p.o = dense_strides(Layout::token_major, p.q_len, p.q_heads, p.head_dim);
  p.k = p.v = dense_strides(Layout::token_major, p.kv_len, p.kv_heads, p.head_dim);
  p.lse = {p.q_heads * p.q_len, p.q_len};
  constexpr std::int64_t kGap = 32;
  const std::int64_t k_off = static_cast<std::int64_t>(q.x.size()) + kGap;
  const std::int64_t v_off = k_off + static_cast<std::int64_t>(k.x.size()) + kGap;
  in.arena = Guarded(v_off + static_cast<std::int64_t>(v.x.size()), misalign);
  in.q = in.arena.data();
  in.k = in.q + k_off;
  in.v = in.q + v_off;
  std::copy(q.x.begin(), q.x.end(), in.q);
  std::copy(k.x.begin(), k.x.end(), in.k);
  std::copy(v.x.begin(), v.x.end(), in.v);
  in.before = in.arena.snapshot();
  return in;
}

void check_equivalence(const KernelInfo& kernel, const Case& c) {
  const Inputs in = make_inputs(c);
  const Outputs out = run(kernel, in, (c.misalign + 5) % 16);
  const ref::Result expected = ref::attention(in.p, in.q, in.k, in.v);
  const Tolerance tol = tolerance(in.p, in.q, in.k, in.v, kernel.exp_ulp);
  expect_close(in.p, out, expected, tol, 1.0, std::string(kernel.name) + " vs reference");
}

}  // namespace mha::test

#include "harness.h"

#include <mha/parallel.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

namespace mha::test {

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

void check_equivalence(const KernelInfo& kernel, const Case& c) {
  const Inputs in = make_inputs(c);
  const Outputs out = run(kernel, in, (c.misalign + 5) % 16);
  const ref::Result expected = ref::attention(in.p, in.q, in.k, in.v);
  const Tolerance tol = tolerance(in.p, in.q, in.k, in.v, kernel.exp_ulp);
  expect_close(in.p, out, expected, tol, 1.0, std::string(kernel.name) + " vs reference");
}

}  // namespace mha::test

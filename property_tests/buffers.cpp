// Guarded buffers and the inputs of a case, laid out, filled and snapshotted.
#include "buffers.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "sensitive.h"

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

namespace {

// NaN in every row past a ragged sequence's lengths, so that a kernel reading padding shows
// it in the output. Keys shared by every sequence (batch stride 0) are left as they are.
void poison_padding(const Case& c, Inputs& in) {
  const Problem& p = in.p;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t l = q_len_of(p, b); l < p.q_len; ++l)
      for (std::int64_t h = 0; h < p.q_heads; ++h)
        std::fill_n(in.q + b * p.q.batch + l * p.q.seq + h * p.q.head, p.head_dim, nan);
    if (c.storage == Storage::broadcast_batch) continue;
    for (std::int64_t l = kv_len_of(p, b); l < p.kv_len; ++l)
      for (std::int64_t h = 0; h < p.kv_heads; ++h) {
        std::fill_n(in.k + b * p.k.batch + l * p.k.seq + h * p.k.head, p.head_dim, nan);
        std::fill_n(in.v + b * p.v.batch + l * p.v.seq + h * p.v.head, p.head_dim, nan);
      }
  }
}

}  // namespace

Inputs make_inputs(const Case& c) {
  Inputs in;
  Problem& p = in.p;
  p = c.p;
  // One per query head, repeating the drawn ones when a test changed q_heads after drawing.
  for (std::int64_t h = 0; h < p.q_heads && !c.sinks.empty(); ++h) {
    in.sinks.push_back(c.sinks[static_cast<std::size_t>(h) % c.sinks.size()]);
  }
  p.sinks = in.sinks.empty() ? nullptr : in.sinks.data();  // the buffer moves with Inputs
  for (std::int64_t h = 0; h < p.q_heads && !c.alibi.empty(); ++h) {
    in.alibi.push_back(c.alibi[static_cast<std::size_t>(h) % c.alibi.size()]);
  }
  p.alibi = in.alibi.empty() ? nullptr : in.alibi.data();
  // Per-sequence lengths, repeated and cut to the tensors' when a test changed the shape.
  const auto lens = [&](const std::vector<std::int64_t>& drawn, std::int64_t most,
                        std::vector<std::int64_t>& out) -> const std::int64_t* {
    for (std::int64_t b = 0; b < p.batch && !drawn.empty(); ++b) {
      out.push_back(std::min(drawn[static_cast<std::size_t>(b) % drawn.size()], most));
    }
    return out.empty() ? nullptr : out.data();
  };
  p.q_lens = lens(c.q_lens, p.q_len, in.q_lens);
  p.kv_lens = lens(c.kv_lens, p.kv_len, in.kv_lens);
  const std::int64_t B = p.batch, H = p.q_heads, Hkv = p.kv_heads, D = p.head_dim;
  p.q = padded_strides(c.q_layout, B, p.q_len, H, D, c.pad);
  p.k = padded_strides(c.kv_layout, B, p.kv_len, Hkv, D, c.k_pad);
  p.v = padded_strides(c.v_layout, B, p.kv_len, Hkv, D, c.v_pad);
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

  if (c.values == Values::sensitive) {  // reference/sensitive.h, written through p's strides
    const ref::SensitiveInputs values(p, c.seed);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t l = 0; l < p.q_len; ++l) {
        for (std::int64_t h = 0; h < H; ++h) {
          values.q_row(b, l, h, q + b * p.q.batch + l * p.q.seq + h * p.q.head);
        }
      }
      for (std::int64_t l = 0; l < p.kv_len; ++l) {
        for (std::int64_t h = 0; h < Hkv; ++h) {
          values.k_row(b, l, h, k + b * p.k.batch + l * p.k.seq + h * p.k.head);
          if (c.storage != Storage::shared_kv) {
            values.v_row(b, l, h, v + b * p.v.batch + l * p.v.seq + h * p.v.head);
          }
        }
      }
    }
    poison_padding(c, in);
    in.before = in.arena.snapshot();
    return in;
  }
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
  poison_padding(c, in);
  in.before = in.arena.snapshot();
  return in;
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

}  // namespace mha::test

// The oracle: multi-head attention in double precision, two-pass softmax, straight loops,
// no tiling. Used by the tests and by the benchmarks' output checks; never for speed.
#pragma once

#include <mha/attention.h>
#include <mha/kv_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace mha::ref {

/// Outputs in double, dense: o [batch][q_heads][q_len][head_dim], lse [batch][q_heads][q_len].
struct Result {
  std::int64_t q_heads = 0, q_len = 0, head_dim = 0;
  std::vector<double> o, lse;

  double o_at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t d) const {
    return o[static_cast<std::size_t>(((b * q_heads + h) * q_len + i) * head_dim + d)];
  }
  double lse_at(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return lse[static_cast<std::size_t>((b * q_heads + h) * q_len + i)];
  }
};

/// One row of K or V (batch b, token j, KV head h) as exact doubles: element d's stored
/// number times, for i8, the row's scale (a product exact in double).
struct KvRow {
  KvType type = KvType::f32;
  const void* data = nullptr;
  double scale = 1.0;
  double at(std::int64_t d) const {
    return static_cast<double>(kv::stored_at(type, data, d)) * scale;
  }
};
inline KvRow kv_row(const Problem& p, const KvView& x, const Strides& st, const Strides& scale_st,
                    std::int64_t b, std::int64_t j, std::int64_t h) {
  const KvView row = mha::kv_row(x, p.kv_type, st, scale_st, b, j, h);
  return {p.kv_type, row.data, p.kv_type == KvType::i8 ? static_cast<double>(*row.scale) : 1.0};
}
inline KvRow k_row(const Problem& p, const KvView& k, std::int64_t b, std::int64_t j,
                   std::int64_t h) {
  return kv_row(p, k, p.k, p.k_scale, b, j, h);
}
inline KvRow v_row(const Problem& p, const KvView& v, std::int64_t b, std::int64_t j,
                   std::int64_t h) {
  return kv_row(p, v, p.v, p.v_scale, b, j, h);
}

/// Sequence b's query rows (Problem::q_lens) and the keys its row i sees, [first, end) of
/// its own kv_lens[b] keys: bottom-right causal on its own lengths, then the window's most
/// recent of them (Problem::window). Written here from the contract, apart from
/// mha::sequence and mha::first_key, which the kernels and the driver use.
inline std::int64_t rows_of(const Problem& p, std::int64_t b) {
  return p.q_lens != nullptr ? p.q_lens[b] : p.q_len;
}
struct KeyRange {
  std::int64_t first, end;
};
inline KeyRange key_range(const Problem& p, std::int64_t b, std::int64_t i) {
  const std::int64_t keys = p.kv_lens != nullptr ? p.kv_lens[b] : p.kv_len;
  std::int64_t end = keys;
  if (p.causal) {
    const std::int64_t last = i + keys - rows_of(p, b);  // the last key row i sees
    end = std::clamp<std::int64_t>(last + 1, 0, keys);
  }
  const std::int64_t first = p.window > 0 ? std::max<std::int64_t>(0, end - p.window) : 0;
  return {first, end};
}
/// How many keys row i of sequence b sees.
inline std::int64_t keys_seen(const Problem& p, std::int64_t b, std::int64_t i) {
  const KeyRange r = key_range(p, b, i);
  return r.end - r.first;
}

/// Head h's sink logit (Problem::sinks) in double, -inf when p has none.
inline double sink_logit(const Problem& p, std::int64_t h) {
  return p.sinks != nullptr ? static_cast<double>(p.sinks[h])
                            : -std::numeric_limits<double>::infinity();
}

/// Logit s after p's soft-cap (Problem::softcap): c tanh(s / c) for a finite cap c > 0, s
/// itself without one (0 or +inf). tanh(+-inf) is +-1, tanh(NaN) NaN.
inline double capped_logit(const Problem& p, double s) {
  const double c = static_cast<double>(p.softcap);
  return c > 0.0 && std::isfinite(c) ? c * std::tanh(s / c) : s;
}

/// ALiBi's bias of query row i and key j of sequence b for head h (Problem::alibi), in
/// double: -alibi[h] |i + kv_len - q_len + alibi_offset - j| on the sequence's own lengths; 0
/// without ALiBi.
inline double alibi_bias(const Problem& p, std::int64_t b, std::int64_t h, std::int64_t i,
                         std::int64_t j) {
  if (p.alibi == nullptr) return 0.0;
  const std::int64_t keys = p.kv_lens != nullptr ? p.kv_lens[b] : p.kv_len;
  const std::int64_t position = i + keys - rows_of(p, b) + p.alibi_offset;
  return -static_cast<double>(p.alibi[h]) * std::fabs(static_cast<double>(position - j));
}

/// Attention of the problem p (strides as p says) over the inputs, K and V of p.kv_type
/// taken at their exact values (kv_row), its logits soft-capped (capped_logit) and then biased
/// by ALiBi (alibi_bias), with p's sinks (each one more logit in the max and the sum). Rows
/// that see no key are zeros with lse -inf (the sink, with one); NaN in the inputs propagates.
/// Runs only the query rows [row_begin, row_end) of every head when given (others are left
/// zero), so a caller can check a sample of rows of a large problem.
Result attention(const Problem& p, const float* q, KvView k, KvView v, std::int64_t row_begin = 0,
                 std::int64_t row_end = -1);

}  // namespace mha::ref

// naive: multi-head attention straight from the formula, in fp32, over K and V of any
// KvType (each element widened to fp32 as it is read: mha/kv_types.h's value_at).
//
// For each (batch, query head, query row): the full score row s = scale * q K^T over the
// keys it sees (its sliding window's, with one), soft-capped with one (c tanh(s / c), in
// double), ALiBi's bias added with slopes (-slope |pos_i - j|, in double), a stable softmax
// (subtract the row max, exp, sum; the head's sink joins the sum: mha::sink_row_end), then o =
// softmax(s) V. Layout: any strides mha::check accepts; reads only the elements the strides
// address, writes only o's and lse's elements. Workspace: one score row, kv_len floats (the
// caller's; the kernel allocates nothing; SIZE_MAX when kv_len floats overflow size_t).
// Floating-point environment: the default one for the call (mha::FpEnvGuard), whatever the
// caller's. ISA: portable C++ (the compiler may vectorize). Depends on mha/attention.h and
// mha/kv_types.h only.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "mha/attention.h"
#include "mha/kv_types.h"

std::size_t mha_f32_attention_naive_workspace(const mha::Problem& p) {
  return mha::detail::bytes_of(p.kv_len, sizeof(float));  // SIZE_MAX past size_t
}

void mha_f32_attention_naive(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v,
                             float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(p)) return mha::each_sequence(mha_f32_attention_naive, p, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;  // the caller's FTZ or rounding mode would change o
  const mha::KvType type = p.kv_type;
  const bool i8 = type == mha::KvType::i8;
  const std::int64_t group = p.q_heads / p.kv_heads;  // query heads per KV head
  const bool capped = mha::soft_capped(p);
  const double cap = p.softcap;
  const bool alibi = mha::has_alibi(p);
  float* const score = static_cast<float*>(ws.data);  // [kv_len]
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const std::int64_t kv_head = h / group;
      const double slope = alibi ? p.alibi[h] : 0.0;
      // Row j of K: its elements and, for i8, its scale.
      const auto k_row = [&](std::int64_t j) {
        return mha::kv_row(k, type, p.k, p.k_scale, b, j, kv_head);
      };
      const auto v_row = [&](std::int64_t j) {
        return mha::kv_row(v, type, p.v, p.v_scale, b, j, kv_head);
      };
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        float* o_row = o + b * p.o.batch + i * p.o.seq + h * p.o.head;
        // The row's keys [first, first + n): its window's, or all it sees.
        const std::int64_t first = mha::first_key(p, i);
        const std::int64_t n = mha::visible_keys(p, i) - first;
        // The row's position among the keys, for ALiBi (Problem::alibi).
        const std::int64_t position = i + p.kv_len - p.q_len + p.alibi_offset;

        // s[j] = scale * q.k_j, soft-capped (Problem::softcap), plus ALiBi's bias
        // (Problem::alibi); m = max_j s[j]. A NaN logit is not
        // the max, but exp(NaN - m) below is NaN, so it still reaches the output.
        float m = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < n; ++j) {
          const mha::KvView row = k_row(first + j);
          const float row_scale = i8 ? *row.scale : 1.0f;
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            dot += q_row[d] * mha::kv::value_at(type, row.data, d, row_scale);
          }
          score[j] = p.scale * dot;
          if (capped) {  // in double, rounded once: within u c of c tanh(s / c)
            score[j] = static_cast<float>(cap * std::tanh(static_cast<double>(score[j]) / cap));
          }
          if (alibi) {  // -slope |pos_i - key|, in double, rounded once
            const auto d = static_cast<double>(position - (first + j));
            score[j] += static_cast<float>(-slope * std::fabs(d));
          }
          m = score[j] > m ? score[j] : m;
        }

        // With a sink, weights relative to 0 when every logit is -inf, so that they are 0 and
        // the sink alone weighs (mha::sink_row_end); without one, exp(-inf - -inf) is NaN, as
        // the contract has it.
        const float sink = mha::sink_of(p, h);
        const float inf = std::numeric_limits<float>::infinity();
        const float shift = m == -inf && sink != -inf ? 0.0f : m;
        float sum = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          score[j] = std::exp(score[j] - shift);
          sum += score[j];
        }
        const mha::RowEnd end = sink == -inf ? mha::RowEnd{sum, m + std::log(sum)}
                                             : mha::sink_row_end(shift, sum, sink);

        for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          const mha::KvView row = v_row(first + j);
          const float row_scale = i8 ? *row.scale : 1.0f;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            o_row[d] += score[j] * mha::kv::value_at(type, row.data, d, row_scale);
          }
        }
        if (n > 0) {
          for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] /= end.divisor;
        }
        if (lse != nullptr) lse[b * p.lse.batch + h * p.lse.head + i] = n > 0 ? end.lse : sink;
      }
    }
  }
}

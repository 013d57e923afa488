// naive: multi-head attention straight from the formula, in fp32.
//
// For each (batch, query head, query row): the full score row s = scale * q K^T over the
// visible keys, a stable softmax (subtract the row max, exp, sum), then o = softmax(s) V.
// Layout: any strides mha::check accepts; reads only the elements the strides address,
// writes only o's and lse's elements. Workspace: one score row, kv_len floats (the
// caller's; the kernel allocates nothing; SIZE_MAX when kv_len floats overflow size_t).
// Floating-point environment: the default one for the call (mha::FpEnvGuard), whatever the
// caller's. ISA: portable C++ (the compiler may vectorize). Depends on mha/attention.h only.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "mha/attention.h"

std::size_t mha_f32_attention_naive_workspace(const mha::Problem& p) {
  return mha::detail::bytes_of(p.kv_len, sizeof(float));  // SIZE_MAX past size_t
}

void mha_f32_attention_naive(const mha::Problem& p, const float* q, const float* k, const float* v,
                             float* o, float* lse, mha::Workspace ws) {
  const mha::FpEnvGuard default_fp_env;  // the caller's FTZ or rounding mode would change o
  const std::int64_t group = p.q_heads / p.kv_heads;  // query heads per KV head
  float* const score = static_cast<float*>(ws.data);  // [kv_len]
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const std::int64_t kv_head = h / group;
      const float* k_head = k + b * p.k.batch + kv_head * p.k.head;
      const float* v_head = v + b * p.v.batch + kv_head * p.v.head;
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        float* o_row = o + b * p.o.batch + i * p.o.seq + h * p.o.head;
        const std::int64_t n = mha::visible_keys(p, i);

        // s[j] = scale * q.k_j; m = max_j s[j]. A NaN logit is not the max, but exp(NaN - m)
        // below is NaN, so it still reaches the output.
        float m = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < n; ++j) {
          const float* k_row = k_head + j * p.k.seq;
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.head_dim; ++d) dot += q_row[d] * k_row[d];
          score[j] = p.scale * dot;
          m = score[j] > m ? score[j] : m;
        }

        float sum = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          score[j] = std::exp(score[j] - m);
          sum += score[j];
        }

        for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          const float* v_row = v_head + j * p.v.seq;
          for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] += score[j] * v_row[d];
        }
        if (n > 0) {
          for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] /= sum;
        }
        if (lse != nullptr) {
          lse[b * p.lse.batch + h * p.lse.head + i] =
              n > 0 ? m + std::log(sum) : -std::numeric_limits<float>::infinity();
        }
      }
    }
  }
}

#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace mha::ref {

Result attention(const Problem& p, const float* q, KvView k, KvView v, std::int64_t row_begin,
                 std::int64_t row_end) {
  if (row_end < 0) row_end = p.q_len;
  Result r;
  r.q_heads = p.q_heads;
  r.q_len = p.q_len;
  r.head_dim = p.head_dim;
  r.o.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_len * p.head_dim), 0.0);
  r.lse.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_len),
               -std::numeric_limits<double>::infinity());
  const std::int64_t group = p.q_heads / p.kv_heads;
  std::vector<double> score(static_cast<std::size_t>(p.kv_len));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const std::int64_t kv_head = h / group;
      // Rows past the sequence's own length stay zeros and -inf: they are not outputs.
      for (std::int64_t i = row_begin; i < std::min(row_end, rows_of(p, b)); ++i) {
        const KeyRange keys = key_range(p, b, i);
        const std::int64_t n = keys.end - keys.first;
        // Head h's sink: one more logit in the max and the sum, with no value.
        const double sink = sink_logit(p, h);
        if (n == 0) {
          r.lse[static_cast<std::size_t>((b * p.q_heads + h) * p.q_len + i)] = sink;
          continue;
        }
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        // Pass 1: logits (products of a float and a K value are exact in double, but for
        // an i8 value q s times a float: 8 + 24 + 24 bits, rounded once, 2^-53) and their max.
        double m = -std::numeric_limits<double>::infinity();
        bool nan = false;
        for (std::int64_t j = 0; j < n; ++j) {
          const KvRow key = k_row(p, k, b, keys.first + j, kv_head);
          double dot = 0.0;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            dot += static_cast<double>(q_row[d]) * key.at(d);
          }
          score[static_cast<std::size_t>(j)] = capped_logit(p, static_cast<double>(p.scale) * dot) +
                                               alibi_bias(p, b, h, i, keys.first + j);
          nan |= std::isnan(score[static_cast<std::size_t>(j)]);
          m = std::fmax(m, score[static_cast<std::size_t>(j)]);
        }
        m = nan ? std::numeric_limits<double>::quiet_NaN() : std::fmax(m, sink);
        // Pass 2: weights, their sum (the sink's weight included), and the weighted sum of
        // values.
        double sum = sink == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(sink - m);
        for (std::int64_t j = 0; j < n; ++j) {
          score[static_cast<std::size_t>(j)] = std::exp(score[static_cast<std::size_t>(j)] - m);
          sum += score[static_cast<std::size_t>(j)];
        }
        double* o_row =
            &r.o[static_cast<std::size_t>(((b * p.q_heads + h) * p.q_len + i) * p.head_dim)];
        for (std::int64_t j = 0; j < n; ++j) {
          const KvRow value = v_row(p, v, b, keys.first + j, kv_head);
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            o_row[d] += score[static_cast<std::size_t>(j)] * value.at(d);
          }
        }
        for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] /= sum;
        r.lse[static_cast<std::size_t>((b * p.q_heads + h) * p.q_len + i)] = m + std::log(sum);
      }
    }
  }
  return r;
}

}  // namespace mha::ref

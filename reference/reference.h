// The oracle: multi-head attention in double precision, two-pass softmax, straight loops,
// no tiling. Used by the tests and by the benchmarks' output checks; never for speed.
#pragma once

#include <mha/attention.h>

#include <cstdint>
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

/// Attention of the problem p (strides as p says) over the fp32 inputs. Rows that see no key
/// are zeros with lse -inf; NaN in the inputs propagates. Runs only the query rows
/// [row_begin, row_end) of every head when given (others are left zero), so a caller can
/// check a sample of rows of a large problem.
Result attention(const Problem& p, const float* q, const float* k, const float* v,
                 std::int64_t row_begin = 0, std::int64_t row_end = -1);

}  // namespace mha::ref

#include "mutants.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace mha::test {

namespace {

template <Mutation M>
void mutant(const Problem& p, const float* q, KvView k_view, KvView v_view, float* o, float* lse,
            Workspace) {
  const auto* k = static_cast<const float*>(k_view.data);  // fp32 K and V (kKvF32 below)
  const auto* v = static_cast<const float*>(v_view.data);
  const std::int64_t group = p.q_heads / p.kv_heads;
  const float scale = M == Mutation::scale_doubled ? 2.0f * p.scale : p.scale;
  const std::int64_t dot_dim =
      M == Mutation::dim_tail_dropped && p.head_dim > 8 ? p.head_dim - p.head_dim % 8 : p.head_dim;
  std::vector<float> score(static_cast<std::size_t>(p.kv_len));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const std::int64_t kv_head = M == Mutation::wrong_gqa_mapping ? h % p.kv_heads : h / group;
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        float* o_row = o + b * p.o.batch + i * p.o.seq + h * p.o.head;
        std::int64_t n = visible_keys(p, i);
        if (M == Mutation::causal_off_by_one && p.causal && n < p.kv_len) ++n;
        if (M == Mutation::key_skipped && n > 1) --n;
        float m = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < n; ++j) {
          const float* k_row = k + b * p.k.batch + j * p.k.seq + kv_head * p.k.head;
          float dot = 0.0f;
          for (std::int64_t d = 0; d < dot_dim; ++d) dot += q_row[d] * k_row[d];
          score[static_cast<std::size_t>(j)] = scale * dot;
          m = std::fmax(m, score[static_cast<std::size_t>(j)]);
        }
        if (M == Mutation::no_max_subtraction) m = 0.0f;
        float sum = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          score[static_cast<std::size_t>(j)] = std::exp(score[static_cast<std::size_t>(j)] - m);
          sum += score[static_cast<std::size_t>(j)];
        }
        for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] = 0.0f;
        for (std::int64_t j = 0; j < n; ++j) {
          const float* v_row = v + b * p.v.batch + j * p.v.seq + kv_head * p.v.head;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            o_row[d] += score[static_cast<std::size_t>(j)] * v_row[d];
          }
        }
        if (n > 0) {
          for (std::int64_t d = 0; d < p.head_dim; ++d) o_row[d] /= sum;
        }
        float l = n > 0 ? m + std::log(sum) : -std::numeric_limits<float>::infinity();
        if (M == Mutation::lse_base2) l /= std::log(2.0f);
        if (lse != nullptr) lse[b * p.lse.batch + h * p.lse.head + i] = l;
      }
    }
  }
}

// The mutants allocate their own score rows: test code, never timed.
std::size_t no_workspace(const Problem&) { return 0; }

}  // namespace

const std::vector<KernelInfo>& mutants() {
  static const std::vector<KernelInfo> list = {
      {"causal_off_by_one", Isa::scalar, &mutant<Mutation::causal_off_by_one>, &no_workspace, 1.0,
       false, kKvF32},
      {"no_max_subtraction", Isa::scalar, &mutant<Mutation::no_max_subtraction>, &no_workspace, 1.0,
       false, kKvF32},
      {"wrong_gqa_mapping", Isa::scalar, &mutant<Mutation::wrong_gqa_mapping>, &no_workspace, 1.0,
       false, kKvF32},
      {"scale_doubled", Isa::scalar, &mutant<Mutation::scale_doubled>, &no_workspace, 1.0, false,
       kKvF32},
      {"key_skipped", Isa::scalar, &mutant<Mutation::key_skipped>, &no_workspace, 1.0, false,
       kKvF32},
      {"dim_tail_dropped", Isa::scalar, &mutant<Mutation::dim_tail_dropped>, &no_workspace, 1.0,
       false, kKvF32},
      {"lse_base2", Isa::scalar, &mutant<Mutation::lse_base2>, &no_workspace, 1.0, false, kKvF32},
  };
  return list;
}

}  // namespace mha::test

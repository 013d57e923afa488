// Mutant kernels: the naive kernel with one deliberate bug each. They live outside the
// registry; the mutant tests assert that the equivalence property catches every one of
// them within the default case count, which is what shows the tolerance is tight.
#pragma once

#include <mha/registry.h>

#include <vector>

namespace mha::test {

enum class Mutation {
  causal_off_by_one,   ///< each causal row sees one key too many
  no_max_subtraction,  ///< softmax without subtracting the row max (overflows)
  wrong_gqa_mapping,   ///< query head h reads KV head h % kv_heads instead of h / g
  scale_doubled,       ///< logits use 2 * scale
  key_skipped,         ///< the last visible key of every row is left out (when n > 1)
  dim_tail_dropped,    ///< q.k ignores the last head_dim % 8 columns
  lse_base2,           ///< lse in base 2 instead of natural log
};

/// Every mutant as a registry-like entry (name, scalar ISA, function, 1 ulp exp).
const std::vector<KernelInfo>& mutants();

}  // namespace mha::test

// Every registry kernel against the double-precision reference, on generated problems.
#include <rapidcheck.h>

#include "cases.h"
#include "kernel_test.h"
#include "run.h"

namespace mha::test {
namespace {

class Equivalence : public KernelTest {};

TEST_P(Equivalence, MatchesReference) {
  CaseOptions options;
  options.any_ragged = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

TEST_P(Equivalence, GroupedQueryHeads) {
  CaseOptions options;
  options.grouped = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

TEST_P(Equivalence, CausalWithMoreQueriesThanKeys) {
  CaseOptions options;
  options.causal = 1;
  options.q_longer = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

TEST_P(Equivalence, CausalPrefill) {  // Lq == Lk, the usual lower triangle
  CaseOptions options;
  options.causal = 1;
  options.equal_lengths = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

// Every case with a sliding window that cuts some row's keys (1 key, a few, one off a KV
// tile, any), every case soft-capped, every case with ALiBi: the variants' edges in every
// case rather than one in four (a window's start one key off in a kernel's masked pass shows
// in a few cases in a hundred of MatchesReference).
TEST_P(Equivalence, SlidingWindow) {
  CaseOptions options;
  options.only_windows = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

TEST_P(Equivalence, SoftCapped) {
  CaseOptions options;
  options.only_softcaps = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

TEST_P(Equivalence, Alibi) {
  CaseOptions options;
  options.only_alibi = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); });
}

// ALiBi slopes steep enough for the reach (support::AlibiReach) to drop keys: the kernels skip
// them as a window's tiles, and still equal the reference; a NaN in V among the dropped keys
// still reaches its rows.
TEST_P(Equivalence, AlibiReach) {
  check_property([&] { check_alibi_reach(kernel()); });
}

// Decodes of 16k to 128k keys on values where every row hangs on a few hundred keys: a
// kernel that drops a KV tile or 1% of the keys there fails (reference/sensitive.h). 25
// cases (about 1.5 s natively): the planted long-decode bugs (mutants/CMakeLists.txt) fail
// the first or second.
TEST_P(Equivalence, LongDecode) {
  CaseOptions options;
  options.long_decode = true;
  check_property([&] { check_equivalence(kernel(), *gen_case(options)); }, 25);
}

MHA_INSTANTIATE_FOR_KERNELS(Equivalence);

}  // namespace
}  // namespace mha::test

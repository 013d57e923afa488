// Running the code under test: a call on guarded buffers that fails when anything outside
// its outputs' elements was written, the equivalence property, properties inside GoogleTest.
#pragma once

#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/registry.h>
#include <rapidcheck/gtest.h>

#include <cstdint>
#include <utility>

#include "buffers.h"
#include "cases.h"

namespace mha::test {

/// Runs `kernel` on the inputs (with lse requested) and asserts (RC_ASSERT) that nothing
/// outside o's and lse's elements was written, inputs included.
Outputs run(const KernelInfo& kernel, const Inputs& in, std::int64_t misalign = 0);

/// The same for a problem `p` over the inputs' arena at other pointers (slices, chunks).
Outputs run(const KernelInfo& kernel, const Problem& p, const Inputs& in, const float* q,
            const float* k, const float* v, std::int64_t misalign = 0);

/// Runs the parallel driver with `kernel` on `threads` threads over the inputs; the same
/// guard checks as run().
Outputs run_driver(const KernelInfo& kernel, const Inputs& in, int threads);

/// The full equivalence property: reference vs kernel on one case.
void check_equivalence(const KernelInfo& kernel, const Case& c);

/// Runs a RapidCheck property inside the current GoogleTest test, like RC_GTEST_PROP does:
/// RC_PARAMS controls counts and seeds, a failure prints the shrunk case and its
/// `reproduce` string.
template <typename Testable>
void check_property(Testable&& testable) {
  rc::detail::checkGTest(std::forward<Testable>(testable));
}

}  // namespace mha::test

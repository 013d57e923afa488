// Running the code under test: a kernel or the driver as a Call, run on guarded buffers that
// fail on any write outside its outputs; the equivalence property; properties in GoogleTest.
#pragma once

#include <sstream>

#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "buffers.h"
#include "cases.h"

namespace mha::test {

/// The code under test, called with a kernel's arguments (mha::Kernel). The two factories
/// below make every Call the properties run; they are the only code in the tests that calls
/// a kernel function or the parallel driver, so a change of the kernel signature is made in
/// them alone.
using Call =
    std::function<void(const Problem&, const float* q, KvView k, KvView v, float* o, float* lse)>;

/// `kernel` called directly, with a workspace of exactly the size it asks for in a guarded
/// buffer (a write outside it fails the property, a read before a write shows as NaN).
Call call_kernel(const KernelInfo& kernel);

/// A parallel driver's two entry points: mha/parallel.h's, or those of a copy of
/// kernels/parallel.cpp compiled under other names (the driver mutants).
struct ParallelDriver {
  decltype(&parallel_workspace) workspace = &parallel_workspace;
  decltype(&parallel_attention) attention = &parallel_attention;
};

/// `kernel` through the parallel driver (mha/parallel.h, or `driver`) on `threads` threads,
/// its workspace guarded alike.
Call call_driver(const KernelInfo& kernel, int threads,
                 const ParallelDriver& driver = ParallelDriver());

/// Runs `call` on the inputs (with lse requested) and asserts (RC_ASSERT) that nothing
/// outside o's and lse's elements was written, inputs included; failures name it `name`.
Outputs run(const Call& call, const std::string& name, const Inputs& in, std::int64_t misalign = 0);

/// The same for a problem `p` over the inputs' arena at other pointers (slices, chunks).
Outputs run(const Call& call, const std::string& name, const Problem& p, const Inputs& in,
            const float* q, KvView k, KvView v, std::int64_t misalign = 0);

/// The full equivalence property: reference vs kernel on one case.
void check_equivalence(const KernelInfo& kernel, const Case& c);

/// Inputs on which ALiBi's reach (support::AlibiReach) drops keys, drawn inside a property: a
/// causal case with ALiBi (any values, half of them large logits; any storage, window, cap,
/// sinks, offset), at least
/// AlibiReach::kMinRows rows of all g heads, and every head's slope steep for the inputs' own
/// logit bound U = |scale| max|q_i| max|k_j|: the longest distance, kv_len, biased by 10^y
/// (2 U + 30), y in [0.3, 2] per head. `bound` receives U.
Inputs alibi_reach_inputs(double* bound = nullptr);

/// The equivalence property on alibi_reach_inputs, and 1 in 3 with a NaN in V at key 0, which
/// the reach drops from the later rows: it must still reach every row that sees key 0.
void check_alibi_reach(const KernelInfo& kernel);

/// Runs a RapidCheck property inside the current GoogleTest test, like RC_GTEST_PROP does:
/// RC_PARAMS controls counts and seeds, a failure prints the shrunk case and its
/// `reproduce` string.
template <typename Testable>
void check_property(Testable&& testable) {
  rc::detail::checkGTest(std::forward<Testable>(testable));
}

/// The same with at most `most_cases` cases (fewer when RC_PARAMS asks for fewer), for a
/// property whose cases are costly.
template <typename Testable>
void check_property(Testable&& testable, int most_cases) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  rc::detail::TestMetadata metadata;
  metadata.id = std::string(info->test_suite_name()) + "/" + info->name();
  metadata.description = info->name();
  rc::detail::TestParams params = rc::detail::configuration().testParams;
  params.maxSuccess = std::min(params.maxSuccess, most_cases);
  const rc::detail::TestResult result = rc::detail::checkProperty(
      rc::detail::toProperty(std::forward<Testable>(testable)), metadata, params);
  if (!result.template is<rc::detail::SuccessResult>()) {
    std::ostringstream message;
    rc::detail::printResultMessage(result, message);
    FAIL() << message.str();
  }
}

}  // namespace mha::test

/// RC_ASSERT with a message: fails the property with everything streamed after `cond`,
/// e.g. MHA_RC_ASSERT(x == y, "x " << x << " differs from y " << y).
#define MHA_RC_ASSERT(cond, message)     \
  do {                                   \
    if (!(cond)) {                       \
      std::ostringstream mha_rc_message; \
      mha_rc_message << message;         \
      RC_FAIL(mha_rc_message.str());     \
    }                                    \
  } while (false)

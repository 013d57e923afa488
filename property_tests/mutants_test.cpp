// The equivalence property must catch every mutant within the default case count: this is
// what shows that the shared tolerance is tight enough to find real bugs.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <rapidcheck/detail/TestListener.h>
#include <iostream>

#include "cases.h"
#include "mutants/mutants.h"
#include "run.h"

namespace mha {
inline void PrintTo(const KernelInfo& k, std::ostream* os) { *os << k.name; }
}  // namespace mha

namespace mha::test {
namespace {

class Mutants : public ::testing::TestWithParam<KernelInfo> {};

// Mutant failures are expected: keep them out of RapidCheck's end-of-run "reproduce" notice.
class Quiet : public rc::detail::TestListener {
 public:
  void onTestCaseFinished(const rc::detail::CaseDescription&) override {}
  void onShrinkTried(const rc::detail::CaseDescription&, bool) override {}
  void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {}
};

TEST_P(Mutants, FailEquivalence) {
  const KernelInfo mutant = GetParam();
  // Without the attention variants, which these mutants do not implement: each must be
  // caught by its own change.
  CaseOptions options;
  options.any_sinks = false;
  options.any_window = false;
  options.any_softcap = false;
  options.any_alibi = false;
  rc::detail::TestMetadata metadata;
  metadata.id = std::string("Mutants/") + mutant.name;
  metadata.description = metadata.id;
  Quiet quiet;
  const auto result = rc::detail::checkProperty(
      rc::detail::toProperty([&] { check_equivalence(mutant, *gen_case(options)); }), metadata,
      rc::detail::configuration().testParams, quiet);
  rc::detail::FailureResult failure;
  ASSERT_TRUE(result.match(failure)) << "mutant " << mutant.name << " survived";
  std::cout << "mutant " << mutant.name << " caught after " << failure.numSuccess
            << " passing cases: " << failure.description << "\n";
}

INSTANTIATE_TEST_SUITE_P(Equivalence, Mutants, ::testing::ValuesIn(mutants()),
                         [](const auto& param) { return std::string(param.param.name); });

}  // namespace
}  // namespace mha::test

// The generated mutants (CMakeLists.txt here: copies of the avx512 and avx2 kernels and of the
// parallel driver with one change each) must fail their properties within the default case
// count: the kernels' equivalence to the reference, the driver's three properties
// (driver_properties.h). The controls, unchanged copies made the same way, must pass them.
//
// With --table[=N] [NAME...] the executable measures instead: for every mutant (the naive
// kernel's of mutants.cpp too), or those whose names contain a NAME, the cases its properties
// pass before the first failure, with seeds 0 .. N-1 (default 100), printed as a Markdown table.
#include <gtest/gtest.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <rapidcheck.h>

#include <rapidcheck/detail/TestListener.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "cases.h"
#include "driver_properties.h"
#include "mutants.h"
#include "run.h"

// The mutants' functions, as mutants.inc (generated) lists them.
#define MHA_KERNEL_MUTANT(name, kernel, symbol) \
  std::remove_pointer_t<mha::Kernel> symbol;    \
  std::remove_pointer_t<mha::WorkspaceSize> symbol##_workspace;
#define MHA_DRIVER_MUTANT(name, attention, workspace) \
  namespace mha {                                     \
  decltype(parallel_attention) attention;             \
  decltype(parallel_workspace) workspace;             \
  }
#include "mutants.inc"
#undef MHA_KERNEL_MUTANT
#undef MHA_DRIVER_MUTANT

namespace mha::test {
namespace {

/// A generated mutant: a copy of a registry kernel (kernel names it) or of the driver.
struct Mutant {
  const char* name;
  const char* kernel;  // nullptr: a driver mutant
  Kernel fn;
  WorkspaceSize workspace;
  ParallelDriver driver;

  bool control() const {
    const std::string n = name;
    return n.size() > 10 && n.compare(n.size() - 10, 10, "_unchanged") == 0;
  }
};

void PrintTo(const Mutant& m, std::ostream* os) { *os << m.name; }

const std::vector<Mutant>& generated() {
  static const std::vector<Mutant> list = {
#define MHA_KERNEL_MUTANT(name, kernel, symbol) \
  {#name, #kernel, &symbol, &symbol##_workspace, ParallelDriver()},
#define MHA_DRIVER_MUTANT(name, attention, workspace) \
  {#name, nullptr, nullptr, nullptr, ParallelDriver{&workspace, &attention}},
#include "mutants.inc"
#undef MHA_KERNEL_MUTANT
#undef MHA_DRIVER_MUTANT
  };
  return list;
}

std::vector<Mutant> mutants_or_controls(bool controls) {
  std::vector<Mutant> out;
  for (const Mutant& m : generated()) {
    if (m.control() == controls) out.push_back(m);
  }
  return out;
}

/// One property of a mutant: its name and its body (for RapidCheck: draws its case).
struct Property {
  std::string name;
  std::function<void()> body;
};

/// The registry entry a kernel mutant stands in for, with the mutant's functions; why it
/// cannot run here when its kernel's ISA is missing.
const KernelInfo* stand_in(const Mutant& m, KernelInfo& info, std::string& why_not) {
  const KernelInfo* original = find_kernel(m.kernel);
  if (original == nullptr) {
    why_not = std::string("no kernel ") + m.kernel + " in this build";
    return nullptr;
  }
  if (!available(*original)) {
    why_not = std::string("kernel ") + m.kernel + " needs " + isa_name(original->isa) +
              ", which this CPU lacks or MHA_MAX_ISA excludes";
    return nullptr;
  }
  info = *original;
  info.name = m.name;
  info.fn = m.fn;
  info.workspace = m.workspace;
  return &info;
}

/// The properties that must catch m, in the order they are tried: a kernel's equivalence, then
/// on long decodes (equivalence_test.cpp's LongDecode); the
/// driver's split-KV property first (most driver mutants are in the split), then the reference
/// and the thread-count ones, with the best kernel of this machine as the driver's worker.
/// `variants` false: cases without sinks, sliding windows, soft-caps and ALiBi, for the naive
/// mutants of mutants.cpp, which implement none (mutants_test.cpp draws the same).
std::vector<Property> properties(const KernelInfo& kernel, const ParallelDriver* driver,
                                 bool variants = true) {
  if (driver == nullptr) {
    CaseOptions plain, long_decode;
    plain.any_sinks = long_decode.any_sinks = variants;
    plain.any_window = long_decode.any_window = variants;
    plain.any_softcap = long_decode.any_softcap = variants;
    plain.any_alibi = long_decode.any_alibi = variants;
    long_decode.long_decode = true;
    std::vector<Property> out = {
        {"equivalence", [kernel, plain] { check_equivalence(kernel, *gen_case(plain)); }},
        {"long decode",
         [kernel, long_decode] { check_equivalence(kernel, *gen_case(long_decode)); }}};
    if (variants) {  // equivalence_test.cpp's SlidingWindow, SoftCapped and Alibi
      CaseOptions windows, softcaps, alibi;
      windows.only_windows = true;
      softcaps.only_softcaps = true;
      alibi.only_alibi = true;
      out.push_back(
          {"window", [kernel, windows] { check_equivalence(kernel, *gen_case(windows)); }});
      out.push_back(
          {"softcap", [kernel, softcaps] { check_equivalence(kernel, *gen_case(softcaps)); }});
      out.push_back({"alibi", [kernel, alibi] { check_equivalence(kernel, *gen_case(alibi)); }});
      out.push_back({"alibi reach", [kernel] { check_alibi_reach(kernel); }});
    }
    return out;
  }
  const ParallelDriver d = *driver;
  return {
      {"split-KV", [kernel, d] { split_kv_decoding_matches_reference(kernel, d); }},
      {"reference", [kernel, d] { driver_matches_reference(kernel, d); }},
      {"threads", [kernel, d] { thread_count_does_not_change_a_bit(kernel, d); }},
      {"batch", [kernel, d] { batch_does_not_change_a_sequence(kernel, d); }},
      {"ragged", [kernel, d] { ragged_batch_equals_separate_calls(kernel, d); }},
  };
}

// Mutant failures are expected: keep them out of RapidCheck's end-of-run "reproduce" notice.
class Quiet : public rc::detail::TestListener {
 public:
  void onTestCaseFinished(const rc::detail::CaseDescription&) override {}
  void onShrinkTried(const rc::detail::CaseDescription&, bool) override {}
  void onTestFinished(const rc::detail::TestMetadata&, const rc::detail::TestResult&) override {}
};

/// How the properties fared: the first that failed (-1: none did), the cases it passed
/// before, and the failure with its case.
struct Outcome {
  int property = -1;
  int passed = 0;
  std::string failure;
};

/// Runs `props` in order with `params` until one fails. Without shrinking: the first failing
/// case is what is counted, and shrinking a long case takes longer than finding it.
Outcome hunt(const std::string& name, const std::vector<Property>& props,
             rc::detail::TestParams params) {
  params.disableShrinking = true;
  Quiet quiet;
  Outcome out;
  for (std::size_t i = 0; i < props.size(); ++i) {
    rc::detail::TestMetadata metadata;
    metadata.id = "Mutants/" + name + "/" + props[i].name;
    metadata.description = metadata.id;
    const auto result =
        rc::detail::checkProperty(rc::detail::toProperty(props[i].body), metadata, params, quiet);
    rc::detail::FailureResult failure;
    if (result.match(failure)) {
      std::ostringstream text;
      text << props[i].name << " failed: " << failure.description;
      for (const auto& [type, value] : failure.counterExample) text << "\n  " << value;
      out.property = static_cast<int>(i);
      out.passed = failure.numSuccess;
      out.failure = text.str();
      return out;
    }
  }
  return out;
}

std::string describe(const std::vector<Property>& props) {
  std::string s;
  for (const Property& p : props) s += (s.empty() ? "" : ", ") + p.name;
  return s;
}

class Mutants : public ::testing::TestWithParam<Mutant> {};
class Controls : public ::testing::TestWithParam<Mutant> {};

TEST_P(Mutants, FailTheirProperties) {
  const Mutant& m = GetParam();
  KernelInfo info;
  std::string why_not;
  const KernelInfo* kernel = m.kernel != nullptr ? stand_in(m, info, why_not) : &best_kernel();
  if (kernel == nullptr) GTEST_SKIP() << why_not;
  const auto props = properties(*kernel, m.kernel != nullptr ? nullptr : &m.driver);
  const rc::detail::TestParams params = rc::detail::configuration().testParams;
  const Outcome out = hunt(m.name, props, params);
  ASSERT_GE(out.property, 0) << "mutant " << m.name << " survived " << params.maxSuccess
                             << " cases of each of: " << describe(props)
                             << " (RC_PARAMS=\"seed=" << params.seed << "\" reproduces)";
  std::cout << "mutant " << m.name << " caught after " << out.passed << " passing cases (seed "
            << params.seed << "): " << out.failure << "\n";
}

TEST_P(Controls, PassTheProperties) {
  const Mutant& m = GetParam();
  KernelInfo info;
  std::string why_not;
  const KernelInfo* kernel = m.kernel != nullptr ? stand_in(m, info, why_not) : &best_kernel();
  if (kernel == nullptr) GTEST_SKIP() << why_not;
  for (const Property& p : properties(*kernel, m.kernel != nullptr ? nullptr : &m.driver)) {
    SCOPED_TRACE(p.name);
    check_property(p.body);
  }
}

std::string mutant_name(const ::testing::TestParamInfo<Mutant>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Generated, Mutants, ::testing::ValuesIn(mutants_or_controls(false)),
                         mutant_name);
INSTANTIATE_TEST_SUITE_P(Generated, Controls, ::testing::ValuesIn(mutants_or_controls(true)),
                         mutant_name);

// --table: one row per mutant: where its code is, the properties that caught it (and how
// often), the seeds in which none did, and the passing cases before the first failure.
int table(int seeds, const std::vector<std::string>& names) {
  static const std::string kNaiveCode = "naive (mutants.cpp)";
  struct Row {
    std::string name, code;
    const KernelInfo* kernel;
    const ParallelDriver* driver;
  };
  std::vector<Row> rows;
  for (const KernelInfo& m : mutants()) rows.push_back({m.name, kNaiveCode, &m, nullptr});
  std::vector<KernelInfo> infos(generated().size());
  for (std::size_t i = 0; i < generated().size(); ++i) {
    const Mutant& m = generated()[i];
    if (m.control()) continue;
    if (m.kernel == nullptr) {
      rows.push_back({m.name, "driver", &best_kernel(), &m.driver});
      continue;
    }
    std::string why_not;
    rows.push_back({m.name, m.kernel, stand_in(m, infos[i], why_not), nullptr});
    if (rows.back().kernel == nullptr) rows.back().code += " (not run: " + why_not + ")";
  }
  const rc::detail::TestParams base = rc::detail::configuration().testParams;
  std::cout << "Passing cases before the first failure, seeds 0-" << seeds - 1 << ", at most "
            << base.maxSuccess << " cases a property\n\n"
            << "| mutant | code | caught by | caught in | mean | max |\n"
            << "| --- | --- | --- | --- | --- | --- |\n";
  for (const Row& row : rows) {
    const bool chosen =
        names.empty() || std::any_of(names.begin(), names.end(), [&](const std::string& n) {
          return row.name.find(n) != std::string::npos;
        });
    if (!chosen) continue;
    if (row.kernel == nullptr) {
      std::cout << "| " << row.name << " | " << row.code << " | | | | |\n";
      continue;
    }
    const auto props = properties(*row.kernel, row.driver, row.code != kNaiveCode);
    std::map<int, int> by_property;
    long total = 0;
    int caught = 0, most = 0;
    for (int seed = 0; seed < seeds; ++seed) {
      rc::detail::TestParams params = base;
      params.seed = static_cast<std::uint64_t>(seed);
      const Outcome out = hunt(row.name, props, params);
      if (out.property < 0) continue;
      ++by_property[out.property];
      ++caught;
      total += out.passed;
      most = std::max(most, out.passed);
    }
    std::string by;
    for (const auto& [index, count] : by_property) {
      by += (by.empty() ? "" : ", ") + props[static_cast<std::size_t>(index)].name;
      if (by_property.size() > 1) by += " " + std::to_string(count);
    }
    std::cout << "| " << row.name << " | " << row.code << " | " << by << " | " << caught << "/"
              << seeds << " | ";
    if (caught > 0) {
      std::cout << static_cast<double>(total) / caught << " | " << most << " |\n";
    } else {
      std::cout << "- | - |\n";
    }
    std::cout.flush();
  }
  return 0;
}

}  // namespace
}  // namespace mha::test

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]).rfind("--table", 0) == 0) {
    const std::string arg = argv[1];
    const int seeds = arg.size() > 8 && arg[7] == '=' ? std::atoi(arg.c_str() + 8) : 100;
    if (seeds < 1) {
      std::cerr << "usage: " << argv[0] << " --table[=SEEDS] [NAME...] (SEEDS >= 1)\n";
      return 2;
    }
    return mha::test::table(seeds, std::vector<std::string>(argv + 2, argv + argc));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

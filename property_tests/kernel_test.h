// A GoogleTest fixture parameterized over the registry: every property written against it
// runs once per kernel, so a new registry entry is tested without touching the tests.
#pragma once

#include <gtest/gtest.h>
#include <mha/registry.h>

#include <ostream>
#include <string>

namespace mha {
inline void PrintTo(const KernelInfo& k, std::ostream* os) { *os << k.name; }
}  // namespace mha

namespace mha::test {

class KernelTest : public ::testing::TestWithParam<KernelInfo> {
 protected:
  void SetUp() override {
    if (!available(GetParam())) {
      GTEST_SKIP() << "kernel " << GetParam().name << " needs " << isa_name(GetParam().isa)
                   << ", which this CPU lacks or MHA_MAX_ISA excludes";
    }
  }
  const KernelInfo& kernel() const { return GetParam(); }
};

inline std::string kernel_test_name(const ::testing::TestParamInfo<KernelInfo>& info) {
  std::string name = info.param.name;
  for (char& c : name) {
    if (c == '-') c = '_';
  }
  return name;
}

}  // namespace mha::test

#define MHA_INSTANTIATE_FOR_KERNELS(Suite)                                           \
  INSTANTIATE_TEST_SUITE_P(Registry, Suite, ::testing::ValuesIn(mha::all_kernels()), \
                           mha::test::kernel_test_name)

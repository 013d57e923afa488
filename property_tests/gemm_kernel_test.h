// A GoogleTest fixture parameterized over the GEMM list (kernels/gemm/gemm.inc), as
// kernel_test.h is over the attention kernels: a new GEMM kernel is tested without touching
// the tests.
#pragma once

#include <gtest/gtest.h>
#include <mha/registry.h>

#include <ostream>
#include <string>

namespace mha {
inline void PrintTo(const GemmInfo& g, std::ostream* os) { *os << g.name; }
}  // namespace mha

namespace mha::test {

class GemmKernelTest : public ::testing::TestWithParam<GemmInfo> {
 protected:
  void SetUp() override {
    if (!available(GetParam())) {
      GTEST_SKIP() << "gemm kernel " << GetParam().name << " needs " << isa_name(GetParam().isa)
                   << ", which this CPU lacks or MHA_MAX_ISA excludes";
    }
  }
  const GemmInfo& gemm_kernel() const { return GetParam(); }
};

}  // namespace mha::test

#define MHA_INSTANTIATE_FOR_GEMMS(Suite)                                              \
  INSTANTIATE_TEST_SUITE_P(Registry, Suite, ::testing::ValuesIn(mha::all_gemms()),    \
                           [](const ::testing::TestParamInfo<mha::GemmInfo>& param) { \
                             return std::string(param.param.name);                    \
                           })

// The highway kernel's 2^x (Exp2NonPositive, kernels/highway/highway_kernel-inl.h) against
// double exp2, once per Highway target the registry lists (sse4, avx2, avx3, avx3_dl on
// x86-64; neon, sve, sve2 on AArch64), each a test of its own, skipped where the CPU lacks its
// ISA: in units of the last place of the exact result rounded to float (results below 2^-126
// in units of 2^-149, the subnormal spacing), over every float in (-126.5, 0] (1.13e9
// inputs); every float from -126.5 down to -inf, whose 2^x is below 2^-126 and must flush to
// exactly 0 (reference/tolerance.h, step 4); and NaN. The bound asserted is the exp_ulp
// registry.inc declares for that target's kernel.
//
// MHA_EXP_STRIDE samples every stride-th float instead (CMake: 31 under qemu-aarch64, where the
// whole sweep would take an hour, and 251 for SVE, which qemu emulates 8x slower still; 17
// under the sanitizers; odd primes, so every residue of the low mantissa bits is hit).
//
// This file is compiled once per target, as highway.cpp is (hwy/foreach_target.h), with the
// same feature macros.
#define HWY_DISABLE_PCLMUL_AES
#define HWY_DISABLE_F16C
#define HWY_WANT_AVX3_DL

#include <cstddef>
#include <cstdint>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "highway_exp_test.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "highway_kernel-inl.h"
#include "ulp.h"

#ifndef MHA_HIGHWAY_EXP_SWEEP
#define MHA_HIGHWAY_EXP_SWEEP
namespace mha::highway_test {
// What a sweep over bit patterns lo, lo + stride, ... <= hi found.
struct Sweep {
  double worst_ulp = 0.0;      // largest error
  float worst_x = 0.0f;        // where
  std::uint64_t nonzero = 0;   // results that are not exactly +0
  float first_nonzero = 0.0f;  // the first such input
};
}  // namespace mha::highway_test
#endif

HWY_BEFORE_NAMESPACE();
namespace mha::highway_test {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Negative floats: ascending bits are descending values. Lanes past hi repeat hi.
Sweep SweepExp(std::uint32_t lo, std::uint32_t hi, std::uint32_t stride) {
  const hn::ScalableTag<float> d;
  const std::size_t n = hn::Lanes(d);
  HWY_ALIGN float x[mha::highway_kernel::HWY_NAMESPACE::kMaxLanes];
  HWY_ALIGN float y[mha::highway_kernel::HWY_NAMESPACE::kMaxLanes];
  Sweep s;
  for (std::uint64_t bits = lo; bits <= hi; bits += n * std::uint64_t{stride}) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t b = bits + std::uint64_t{stride} * i;
      const std::uint32_t b32 = static_cast<std::uint32_t>(b <= hi ? b : hi);
      std::memcpy(&x[i], &b32, sizeof b32);
    }
    hn::Store(mha::highway_kernel::HWY_NAMESPACE::Exp2NonPositive(hn::Load(d, x)), d, y);
    for (std::size_t i = 0; i < n; ++i) {
      const double err = mha::test::ulp_error(y[i], std::exp2(static_cast<double>(x[i])));
      if (!(err <= s.worst_ulp)) {  // also catches a NaN error
        s.worst_ulp = err;
        s.worst_x = x[i];
      }
      if (mha::test::bits_of(y[i]) != 0 && s.nonzero++ == 0) s.first_nonzero = x[i];
    }
  }
  return s;
}

}  // namespace HWY_NAMESPACE
}  // namespace mha::highway_test
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "mha/registry.h"

namespace mha::highway_test {
namespace {

#ifdef MHA_EXP_STRIDE
constexpr std::uint32_t kStride = MHA_EXP_STRIDE;
#else
constexpr std::uint32_t kStride = 1;
#endif
#ifdef MHA_EXP_SVE_STRIDE
constexpr std::uint32_t kSveStride = MHA_EXP_SVE_STRIDE;
#else
constexpr std::uint32_t kSveStride = kStride;
#endif

struct Target {
  const char* kernel;  // the registry name
  Sweep (*sweep)(std::uint32_t, std::uint32_t, std::uint32_t);
  std::uint32_t stride;  // of the sweeps
};

std::vector<Target> targets() {
  return {
#if HWY_ARCH_X86_64
    {"highway-sse4", &N_SSE4::SweepExp, kStride}, {"highway-avx2", &N_AVX2::SweepExp, kStride},
        {"highway-avx3", &N_AVX3::SweepExp, kStride},
        {"highway-avx3-dl", &N_AVX3_DL::SweepExp, kStride},
#elif HWY_ARCH_ARM_A64
    {"highway-neon", &N_NEON::SweepExp, kStride}, {"highway-sve", &N_SVE::SweepExp, kSveStride},
        {"highway-sve2", &N_SVE2::SweepExp, kSveStride},
#endif
  };
}

// gtest names the parameter in its messages.
void PrintTo(const Target& target, std::ostream* os) { *os << target.kernel; }

class HighwayExp : public ::testing::TestWithParam<Target> {
 protected:
  void SetUp() override {
    kernel_ = find_kernel(GetParam().kernel);
    ASSERT_NE(kernel_, nullptr) << GetParam().kernel << " is not in the registry";
    if (!cpu_supports(kernel_->isa)) GTEST_SKIP() << "CPU lacks " << isa_name(kernel_->isa);
  }
  const KernelInfo* kernel_ = nullptr;
};

TEST_P(HighwayExp, WithinDeclaredUlpAboveMinus126Point5) {
  const std::uint32_t stride = GetParam().stride;
  const Sweep s = GetParam().sweep(test::bits_of(-0.0f), test::bits_of(-126.5f) - 1, stride);
  std::printf("%s exp2: max error %.4f ulp at x = %.9g (every %u%s float of (-126.5, 0])\n",
              GetParam().kernel, s.worst_ulp, s.worst_x, stride, stride == 1 ? "st" : "th");
  EXPECT_LE(s.worst_ulp, kernel_->exp_ulp);
}

TEST_P(HighwayExp, FlushesToZeroFromMinus126Point5Down) {
  const Sweep s =
      GetParam().sweep(test::bits_of(-126.5f),
                       test::bits_of(-std::numeric_limits<float>::infinity()), GetParam().stride);
  EXPECT_EQ(s.nonzero, 0u) << "first at x = " << s.first_nonzero;
}

TEST_P(HighwayExp, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto one = [&](float x) {
    std::uint32_t b = 0;
    std::memcpy(&b, &x, sizeof b);
    return GetParam().sweep(b, b, 1);
  };
  EXPECT_EQ(one(-inf).nonzero, 0u);  // exactly +0: masked weights
  EXPECT_TRUE(std::isnan(one(nan).worst_ulp));
  EXPECT_TRUE(std::isnan(one(-nan).worst_ulp));
  EXPECT_EQ(one(0.0f).worst_ulp, 0.0);  // exactly 1
  EXPECT_EQ(one(-0.0f).worst_ulp, 0.0);
  EXPECT_EQ(one(-126.0f).worst_ulp, 0.0);  // the smallest normal, exactly
}

INSTANTIATE_TEST_SUITE_P(Targets, HighwayExp, ::testing::ValuesIn(targets()),
                         [](const ::testing::TestParamInfo<Target>& target) {
                           std::string name = target.param.kernel;
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace mha::highway_test
#endif  // HWY_ONCE

// The xsimd kernels' 2^x (Attention<Arch>::exp2_nonpositive, kernels/xsimd/xsimd_kernel.h)
// against double exp2, for the architecture this executable is built for (MHA_XSIMD_ARCH,
// evaluated by xsimd_exp_eval.cpp, the one file built with that ISA's flags; MHA_XSIMD_ISA
// its mha::Isa): in units of the last place of the exact
// result rounded to float (results below 2^-126 in units of 2^-149, the subnormal spacing),
// over every float in (-126.5, 0] (1.13e9 inputs); every float from -126.5 down to -inf,
// whose 2^x is below 2^-126 and must flush to exactly 0 (reference/tolerance.h, step 4); and
// NaN. The bound asserted is the exp_ulp registry.inc declares for the xsimd kernels.
//
// MHA_XSIMD_STRIDE tests every stride-th float instead: 13 under qemu-aarch64, where the
// whole sweep would take many minutes, and 17 under the sanitizers (odd primes, so every
// residue of the low mantissa bits is hit; the algorithm and its floats are those of x86-64,
// where every float is tested). Skipped on CPUs without the ISA.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "exp_eval.h"
#include "mha/registry.h"
#include "ulp.h"

namespace {

using mha::test::bits_of;
using mha::test::ulp_error;
using mha::test::xsimd_exp2;
using mha::test::xsimd_exp2_nonzero_results;
using mha::test::xsimd_exp2_width;
using mha::test::xsimd_exp2_worst_error;

constexpr std::uint32_t kStride = MHA_XSIMD_STRIDE;

bool runs() { return mha::cpu_supports(mha::Isa::MHA_XSIMD_ISA); }

double declared_xsimd_ulp() {
  return mha::test::declared_ulp(std::string("xsimd-") + mha::isa_name(mha::Isa::MHA_XSIMD_ISA));
}

TEST(XsimdExp, WithinDeclaredUlpAboveMinus126Point5) {
  if (!runs()) GTEST_SKIP() << "CPU lacks the ISA";
  float worst_x = 0.0f;
  const double worst =
      xsimd_exp2_worst_error(bits_of(-0.0f), bits_of(-126.5f) - 1, kStride, &worst_x);
  std::printf(
      "xsimd exp2 (%d lanes): max error %.4f ulp at x = %.9g (every %u%s float of "
      "(-126.5, 0])\n",
      xsimd_exp2_width(), worst, worst_x, kStride, kStride == 1 ? "st" : "th");
  EXPECT_LE(worst, declared_xsimd_ulp());
}

TEST(XsimdExp, FlushesToZeroFromMinus126Point5Down) {
  if (!runs()) GTEST_SKIP() << "CPU lacks the ISA";
  float first_x = 0.0f;
  const std::uint64_t n = xsimd_exp2_nonzero_results(
      bits_of(-126.5f), bits_of(-std::numeric_limits<float>::infinity()), kStride, &first_x);
  EXPECT_EQ(n, 0u) << "first at x = " << first_x;
}

TEST(XsimdExp, SpecialValues) {
  if (!runs()) GTEST_SKIP() << "CPU lacks the ISA";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float cases[8] = {-inf, nan, -nan, 0.0f, -0.0f, -126.0f, -126.49f, -125.9f};
  for (int c = 0; c < 8; ++c) {
    const int width = xsimd_exp2_width();
    float in[64], out[64];  // width <= 16 floats on every architecture
    ASSERT_LE(width, 64);
    for (int i = 0; i < width; ++i) in[i] = cases[c];  // every lane: each lane's path
    xsimd_exp2(in, out);
    for (int i = 0; i < width; ++i) {
      if (c == 0) {
        EXPECT_EQ(bits_of(out[i]), 0u);  // exactly +0: masked weights
      } else if (c <= 2) {
        EXPECT_TRUE(std::isnan(out[i]));
      } else if (c <= 4) {
        EXPECT_EQ(out[i], 1.0f);
      } else if (c == 5) {
        EXPECT_EQ(out[i], std::ldexp(1.0f, -126));  // the smallest normal, exactly
      } else {
        EXPECT_LE(ulp_error(out[i], std::exp2(static_cast<double>(cases[c]))), declared_xsimd_ulp())
            << cases[c];
      }
    }
  }
}

}  // namespace

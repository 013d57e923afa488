// The avx2 kernel's 2^x (kernels/avx2/avx2_exp.h) against double exp2 over EVERY float it
// can be given: every float in (-126.5, 0] (1.13e9 inputs) in units of the last place of
// the exact result rounded to float (results below 2^-126 in units of 2^-149, the
// subnormal spacing); every float from -126.5 down to -inf (1.02e9 inputs), whose 2^x is
// below 2^-126 and flushed to exactly 0 (allowed by reference/tolerance.h, step 4); and NaN.
// The bound asserted here is the exp_ulp that registry.inc declares for the avx2 kernel.
// Built on x86-64 only; skipped on CPUs without AVX2 and FMA. Only avx2_exp_eval.cpp, which
// this calls after the CPU check, is built with the kernel's flags.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "exp_eval.h"
#include "mha/registry.h"
#include "ulp.h"

namespace {

using mha::test::avx2_exp2;
using mha::test::avx2_exp2_nonzero_results;
using mha::test::avx2_exp2_worst_error;
using mha::test::bits_of;
using mha::test::ulp_error;

TEST(Avx2Exp, WithinDeclaredUlpOnEveryFloatAboveMinus126Point5) {
  if (!mha::cpu_supports(mha::Isa::avx2)) GTEST_SKIP() << "CPU lacks AVX2 or FMA";
  float worst_x = 0.0f;
  const double worst = avx2_exp2_worst_error(bits_of(-0.0f), bits_of(-126.5f) - 1, &worst_x);
  std::printf("avx2 exp2: max error %.4f ulp at x = %.9g (every float of (-126.5, 0])\n", worst,
              worst_x);
  EXPECT_LE(worst, mha::test::declared_ulp("avx2"));
}

TEST(Avx2Exp, FlushesToZeroOnEveryFloatFromMinus126Point5Down) {
  if (!mha::cpu_supports(mha::Isa::avx2)) GTEST_SKIP() << "CPU lacks AVX2 or FMA";
  float first_x = 0.0f;
  const std::uint64_t n = avx2_exp2_nonzero_results(
      bits_of(-126.5f), bits_of(-std::numeric_limits<float>::infinity()), &first_x);
  EXPECT_EQ(n, 0u) << "first at x = " << first_x;
}

TEST(Avx2Exp, SpecialValues) {
  if (!mha::cpu_supports(mha::Isa::avx2)) GTEST_SKIP() << "CPU lacks AVX2 or FMA";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float in[8] = {-inf, nan, -nan, 0.0f, -0.0f, -126.0f, -126.49f, -125.9f};
  float out[8];
  avx2_exp2(in, out);
  EXPECT_EQ(out[0], 0.0f);  // exactly: softmax needs 2^-inf == 0 for masked weights
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_TRUE(std::isnan(out[2]));
  EXPECT_EQ(out[3], 1.0f);
  EXPECT_EQ(out[4], 1.0f);
  EXPECT_EQ(out[5], std::ldexp(1.0f, -126));  // the smallest normal, exactly
  for (int i = 6; i < 8; ++i) {
    EXPECT_LE(ulp_error(out[i], std::exp2(static_cast<double>(in[i]))),
              mha::test::declared_ulp("avx2"))
        << in[i];
  }
}

}  // namespace

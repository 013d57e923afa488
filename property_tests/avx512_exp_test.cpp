// The avx512 kernel's 2^x (kernels/avx512/avx512_exp.h) against double exp2 over EVERY float
// in [-151, 0] (1.13e9 inputs), in units of the last place of the exact result rounded to
// float; results below 2^-126 are measured in units of 2^-149, the subnormal spacing. The
// bound asserted here is the exp_ulp that registry.inc declares for the avx512 kernel.
// Built on x86-64 only; skipped on CPUs without AVX-512. Only avx512_exp_eval.cpp, which
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

using mha::test::avx512_exp2;
using mha::test::avx512_exp2_worst_error;
using mha::test::bits_of;
using mha::test::ulp_error;

TEST(Avx512Exp, WithinDeclaredUlpOnEveryFloatInMinus151To0) {
  if (!mha::cpu_supports(mha::Isa::avx512)) GTEST_SKIP() << "CPU lacks AVX-512";
  float worst_x = 0.0f;
  const double worst = avx512_exp2_worst_error(bits_of(-0.0f), bits_of(-151.0f), &worst_x);
  std::printf("avx512 exp2: max error %.4f ulp at x = %.9g (every float of [-151, 0])\n", worst,
              worst_x);
  EXPECT_LE(worst, mha::test::declared_ulp("avx512"));
}

TEST(Avx512Exp, SpecialValues) {
  if (!mha::cpu_supports(mha::Isa::avx512)) GTEST_SKIP() << "CPU lacks AVX-512";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 2^-151 and below round to 0 (2^-150 is the tie between 0 and 2^-149).
  const float in[16] = {-inf,    nan,     0.0f,    -0.0f,  -151.0f, -160.0f, -200.0f, -1e30f,
                        -149.0f, -126.5f, -125.9f, -1e-8f, -1.0f,   -2.0f,   -50.0f,  -0.5f};
  float out[16];
  avx512_exp2(in, out);
  EXPECT_EQ(out[0], 0.0f);  // exactly: softmax needs 2^-inf == 0 for masked weights
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[3], 1.0f);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(out[i], 0.0f) << in[i];
  for (int i = 8; i < 16; ++i) {
    EXPECT_LE(ulp_error(out[i], std::exp2(static_cast<double>(in[i]))),
              mha::test::declared_ulp("avx512"))
        << in[i];
  }
}

}  // namespace

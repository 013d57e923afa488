// The avx512 kernel's 2^x (kernels/avx512/avx512_exp.h) against double exp2 over EVERY float
// in [-151, 0] (1.13e9 inputs), in units of the last place of the exact result rounded to
// float; results below 2^-126 are measured in units of 2^-149, the subnormal spacing. The
// bound asserted here is the exp_ulp that registry.inc declares for the avx512 kernel.
// Built on x86-64 only (with the kernel's per-file flags); skipped on CPUs without AVX-512.
// avx512_exp.h first: it includes immintrin.h (see there why).
#include "avx512_exp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "mha/registry.h"
#include "ulp.h"

namespace {

constexpr double kDeclaredUlp = 1.5;  // registry.inc: MHA_KERNEL(avx512, ..., 1.5, true)

using mha::test::bits_of;
using mha::test::ulp_error;

// Max ulp error over every float with bit pattern in [lo_bits, hi_bits] (negative floats:
// ascending bits are descending values), sixteen per call.
double worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, float* worst_x) {
  double worst = 0.0;
  const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (std::uint64_t bits = lo_bits; bits <= hi_bits; bits += 16) {
    // Lanes past hi_bits repeat hi_bits.
    const __m512i lanes = _mm512_min_epu32(
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(bits))),
                         step),
        _mm512_set1_epi32(static_cast<int>(hi_bits)));
    const __m512 x = _mm512_castsi512_ps(lanes);
    float xs[16], ys[16];
    _mm512_storeu_ps(xs, x);
    _mm512_storeu_ps(ys, mha::avx512::exp2_nonpositive(x));
    for (int i = 0; i < 16; ++i) {
      const double err = ulp_error(ys[i], std::exp2(static_cast<double>(xs[i])));
      if (!(err <= worst)) {  // also catches a NaN error
        worst = err;
        *worst_x = xs[i];
      }
    }
  }
  return worst;
}

TEST(Avx512Exp, WithinDeclaredUlpOnEveryFloatInMinus151To0) {
  if (!mha::cpu_supports(mha::Isa::avx512)) GTEST_SKIP() << "CPU lacks AVX-512";
  float worst_x = 0.0f;
  const double worst = worst_error(bits_of(-0.0f), bits_of(-151.0f), &worst_x);
  std::printf("avx512 exp2: max error %.4f ulp at x = %.9g (every float of [-151, 0])\n", worst,
              worst_x);
  EXPECT_LE(worst, kDeclaredUlp);
}

TEST(Avx512Exp, SpecialValues) {
  if (!mha::cpu_supports(mha::Isa::avx512)) GTEST_SKIP() << "CPU lacks AVX-512";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 2^-151 and below round to 0 (2^-150 is the tie between 0 and 2^-149).
  const float in[16] = {-inf,    nan,     0.0f,    -0.0f,  -151.0f, -160.0f, -200.0f, -1e30f,
                        -149.0f, -126.5f, -125.9f, -1e-8f, -1.0f,   -2.0f,   -50.0f,  -0.5f};
  float out[16];
  _mm512_storeu_ps(out, mha::avx512::exp2_nonpositive(_mm512_loadu_ps(in)));
  EXPECT_EQ(out[0], 0.0f);  // exactly: softmax needs 2^-inf == 0 for masked weights
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[3], 1.0f);
  for (int i = 4; i < 8; ++i) EXPECT_EQ(out[i], 0.0f) << in[i];
  for (int i = 8; i < 16; ++i) {
    EXPECT_LE(ulp_error(out[i], std::exp2(static_cast<double>(in[i]))), kDeclaredUlp) << in[i];
  }
}

}  // namespace

// The avx2 kernel's 2^x (kernels/avx2/avx2_exp.h) against double exp2 over EVERY float it
// can be given: every float in (-126.5, 0] (1.13e9 inputs) in units of the last place of
// the exact result rounded to float (results below 2^-126 in units of 2^-149, the
// subnormal spacing); every float from -126.5 down to -inf (1.02e9 inputs), whose 2^x is
// below 2^-126 and flushed to exactly 0 (allowed by reference/tolerance.h, step 4); and NaN.
// The bound asserted here is the exp_ulp that registry.inc declares for the avx2 kernel.
// Built on x86-64 only (with the kernel's per-file flags); skipped on CPUs without AVX2 and
// FMA.
#include "avx2_exp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "mha/registry.h"
#include "ulp.h"

namespace {

using mha::test::bits_of;
using mha::test::ulp_error;

constexpr double kDeclaredUlp = 1.0;  // registry.inc: MHA_KERNEL(avx2, ..., 1.0, true)

// The floats with bit patterns lo_bits, lo_bits + 1, ... <= hi_bits, eight at a time (lanes
// past hi_bits repeat hi_bits); negative floats: ascending bits are descending values.
__m256 lanes_from(std::uint64_t bits, std::uint32_t hi_bits) {
  const __m256i lanes = _mm256_min_epu32(
      _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(bits))),
                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
      _mm256_set1_epi32(static_cast<int>(hi_bits)));
  return _mm256_castsi256_ps(lanes);
}

// Max ulp error over every float with bit pattern in [lo_bits, hi_bits].
double worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, float* worst_x) {
  double worst = 0.0;
  for (std::uint64_t bits = lo_bits; bits <= hi_bits; bits += 8) {
    const __m256 x = lanes_from(bits, hi_bits);
    float xs[8], ys[8];
    _mm256_storeu_ps(xs, x);
    _mm256_storeu_ps(ys, mha::avx2::exp2_nonpositive(x));
    for (int i = 0; i < 8; ++i) {
      const double err = ulp_error(ys[i], std::exp2(static_cast<double>(xs[i])));
      if (!(err <= worst)) {  // also catches a NaN error
        worst = err;
        *worst_x = xs[i];
      }
    }
  }
  return worst;
}

// How many floats with bit pattern in [lo_bits, hi_bits] do not give exactly +0.
std::uint64_t nonzero_results(std::uint32_t lo_bits, std::uint32_t hi_bits, float* first_x) {
  std::uint64_t count = 0;
  for (std::uint64_t bits = lo_bits; bits <= hi_bits; bits += 8) {
    const __m256 x = lanes_from(bits, hi_bits);
    const __m256i y = _mm256_castps_si256(mha::avx2::exp2_nonpositive(x));
    const int zero =
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(y, _mm256_setzero_si256())));
    if (zero != 0xFF) {
      float xs[8];
      _mm256_storeu_ps(xs, x);
      for (int i = 0; i < 8; ++i) {
        if ((zero >> i & 1) == 0 && count++ == 0) *first_x = xs[i];
      }
    }
  }
  return count;
}

TEST(Avx2Exp, WithinDeclaredUlpOnEveryFloatAboveMinus126Point5) {
  if (!mha::cpu_supports(mha::Isa::avx2)) GTEST_SKIP() << "CPU lacks AVX2 or FMA";
  float worst_x = 0.0f;
  const double worst = worst_error(bits_of(-0.0f), bits_of(-126.5f) - 1, &worst_x);
  std::printf("avx2 exp2: max error %.4f ulp at x = %.9g (every float of (-126.5, 0])\n", worst,
              worst_x);
  EXPECT_LE(worst, kDeclaredUlp);
}

TEST(Avx2Exp, FlushesToZeroOnEveryFloatFromMinus126Point5Down) {
  if (!mha::cpu_supports(mha::Isa::avx2)) GTEST_SKIP() << "CPU lacks AVX2 or FMA";
  float first_x = 0.0f;
  const std::uint64_t n =
      nonzero_results(bits_of(-126.5f), bits_of(-std::numeric_limits<float>::infinity()), &first_x);
  EXPECT_EQ(n, 0u) << "first at x = " << first_x;
}

TEST(Avx2Exp, SpecialValues) {
  if (!mha::cpu_supports(mha::Isa::avx2)) GTEST_SKIP() << "CPU lacks AVX2 or FMA";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float in[8] = {-inf, nan, -nan, 0.0f, -0.0f, -126.0f, -126.49f, -125.9f};
  float out[8];
  _mm256_storeu_ps(out, mha::avx2::exp2_nonpositive(_mm256_loadu_ps(in)));
  EXPECT_EQ(out[0], 0.0f);  // exactly: softmax needs 2^-inf == 0 for masked weights
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_TRUE(std::isnan(out[2]));
  EXPECT_EQ(out[3], 1.0f);
  EXPECT_EQ(out[4], 1.0f);
  EXPECT_EQ(out[5], std::ldexp(1.0f, -126));  // the smallest normal, exactly
  for (int i = 6; i < 8; ++i) {
    EXPECT_LE(ulp_error(out[i], std::exp2(static_cast<double>(in[i]))), kDeclaredUlp) << in[i];
  }
}

}  // namespace

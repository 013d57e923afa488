// The neon kernel's exp (kernels/neon/neon_exp.h) against double exp, in units of the last
// place of the exact result rounded to float; results below 2^-126 are measured in units of
// 2^-149, the subnormal spacing. The bound asserted here is the exp_ulp that registry.inc
// declares for the neon kernel. Built on aarch64 only.
//
// Every float in [-104, 0] (1.12e9 inputs) took 5 minutes under qemu-aarch64, too long for
// every test run, so this tests every 7th float of [-104, 0] (7 is odd and prime, so every
// residue of the low mantissa bits is hit) plus every float of [-1, -2^-24] (most of the
// floats in [-1, 0] lie closer to 0; below 2^-24 in magnitude exp rounds to 1 and the
// stride-7 sweep covers them). About 95 s under qemu. The full sweep was
// run once (stride 1): max error 0.9371 ulp at x = -5.89112377; set kStride = 1 to repeat it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>

#include "neon_exp.h"
#include "ulp.h"

namespace {

using mha::test::bits_of;
using mha::test::ulp_error;

constexpr std::uint32_t kStride = 7;

// Max ulp error over the floats with bit patterns lo_bits, lo_bits + stride, ... <= hi_bits
// (negative floats: ascending bits are descending values), four per call.
double worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, std::uint32_t stride,
                   float* worst_x) {
  double worst = 0.0;
  for (std::uint64_t bits = lo_bits; bits <= hi_bits; bits += 4 * std::uint64_t{stride}) {
    float x[4], y[4];
    for (int i = 0; i < 4; ++i) {
      const std::uint64_t b = bits + std::uint64_t{stride} * static_cast<unsigned>(i);
      const std::uint32_t b32 = static_cast<std::uint32_t>(b <= hi_bits ? b : hi_bits);
      std::memcpy(&x[i], &b32, sizeof b32);
    }
    vst1q_f32(y, mha::neon::exp_nonpositive(vld1q_f32(x)));
    for (int i = 0; i < 4; ++i) {
      const double err = ulp_error(y[i], std::exp(static_cast<double>(x[i])));
      if (!(err <= worst)) {  // also catches a NaN error
        worst = err;
        *worst_x = x[i];
      }
    }
  }
  return worst;
}

TEST(NeonExp, WithinDeclaredUlpOnFloatsInMinus104To0) {
  float x_wide = 0.0f, x_near = 0.0f;
  const double wide = worst_error(bits_of(-0.0f), bits_of(-104.0f), kStride, &x_wide);
  const double near = worst_error(bits_of(-0x1p-24f), bits_of(-1.0f), 1, &x_near);
  std::printf(
      "neon exp: max error %.4f ulp at x = %.9g (every %u-th float of [-104, 0]), "
      "%.4f ulp at x = %.9g (every float of [-1, -2^-24])\n",
      wide, x_wide, kStride, near, x_near);
  EXPECT_LE(wide, mha::test::declared_ulp("neon"));
  EXPECT_LE(near, mha::test::declared_ulp("neon"));
}

TEST(NeonExp, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float in[4] = {-inf, std::numeric_limits<float>::quiet_NaN(), 0.0f, -0.0f};
  float out[4];
  vst1q_f32(out, mha::neon::exp_nonpositive(vld1q_f32(in)));
  EXPECT_EQ(out[0], 0.0f);  // exactly: softmax needs exp(-inf) == 0 for masked weights
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[3], 1.0f);
  const float below[4] = {-104.5f, -110.0f, -200.0f, -1e30f};
  vst1q_f32(out, mha::neon::exp_nonpositive(vld1q_f32(below)));
  for (float y : out) EXPECT_EQ(y, 0.0f);
}

}  // namespace

// The xsimd kernels' 2^x (Attention<Arch>::exp2_nonpositive, kernels/xsimd/xsimd_kernel.h)
// against double exp2, for the architecture this executable is built for (MHA_XSIMD_ARCH,
// with that ISA's flags; MHA_XSIMD_ISA its mha::Isa): in units of the last place of the exact
// result rounded to float (results below 2^-126 in units of 2^-149, the subnormal spacing),
// over every float in (-126.5, 0] (1.13e9 inputs); every float from -126.5 down to -inf,
// whose 2^x is below 2^-126 and must flush to exactly 0 (reference/tolerance.h, step 4); and
// NaN. The bound asserted is the exp_ulp registry.inc declares for the xsimd kernels.
//
// MHA_XSIMD_STRIDE tests every stride-th float instead: 13 under qemu-aarch64, where the
// whole sweep would take many minutes, and 17 under the sanitizers (odd primes, so every
// residue of the low mantissa bits is hit; the algorithm and its floats are those of x86-64,
// where every float is tested). Skipped on CPUs without the ISA.
#include "xsimd_kernel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>

#include "mha/registry.h"
#include "ulp.h"

namespace {

using mha::test::bits_of;
using mha::test::ulp_error;
using Kernel = mha::xsimd_kernel::Attention<MHA_XSIMD_ARCH>;
using Batch = Kernel::Batch;
constexpr int kWidth = Kernel::kWidth;

constexpr double kDeclaredUlp = 1.0;  // registry.inc: MHA_KERNEL(xsimd-..., ..., 1.0, true)
constexpr std::uint32_t kStride = MHA_XSIMD_STRIDE;

bool runs() { return mha::cpu_supports(mha::Isa::MHA_XSIMD_ISA); }

// The floats with bit patterns bits, bits + stride, ... (clamped to hi_bits), a vector of them,
// and their 2^x. Negative floats: ascending bits are descending values.
void evaluate(std::uint64_t bits, std::uint32_t hi_bits, std::uint32_t stride, float* x, float* y) {
  for (int i = 0; i < kWidth; ++i) {
    const std::uint64_t b = bits + std::uint64_t{stride} * static_cast<unsigned>(i);
    const std::uint32_t b32 = static_cast<std::uint32_t>(b <= hi_bits ? b : hi_bits);
    std::memcpy(&x[i], &b32, sizeof b32);
  }
  Kernel::exp2_nonpositive(Batch::load_unaligned(x)).store_unaligned(y);
}

// Max ulp error over the floats with bit patterns lo_bits, lo_bits + stride, ... <= hi_bits.
double worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, std::uint32_t stride,
                   float* worst_x) {
  double worst = 0.0;
  for (std::uint64_t bits = lo_bits; bits <= hi_bits; bits += kWidth * std::uint64_t{stride}) {
    float x[kWidth], y[kWidth];
    evaluate(bits, hi_bits, stride, x, y);
    for (int i = 0; i < kWidth; ++i) {
      const double err = ulp_error(y[i], std::exp2(static_cast<double>(x[i])));
      if (!(err <= worst)) {  // also catches a NaN error
        worst = err;
        *worst_x = x[i];
      }
    }
  }
  return worst;
}

// How many of those floats do not give exactly +0.
std::uint64_t nonzero_results(std::uint32_t lo_bits, std::uint32_t hi_bits, std::uint32_t stride,
                              float* first_x) {
  std::uint64_t count = 0;
  for (std::uint64_t bits = lo_bits; bits <= hi_bits; bits += kWidth * std::uint64_t{stride}) {
    float x[kWidth], y[kWidth];
    evaluate(bits, hi_bits, stride, x, y);
    for (int i = 0; i < kWidth; ++i) {
      if (bits_of(y[i]) != 0 && count++ == 0) *first_x = x[i];
    }
  }
  return count;
}

TEST(XsimdExp, WithinDeclaredUlpAboveMinus126Point5) {
  if (!runs()) GTEST_SKIP() << "CPU lacks the ISA";
  float worst_x = 0.0f;
  const double worst = worst_error(bits_of(-0.0f), bits_of(-126.5f) - 1, kStride, &worst_x);
  std::printf(
      "xsimd exp2 (%d lanes): max error %.4f ulp at x = %.9g (every %u%s float of "
      "(-126.5, 0])\n",
      kWidth, worst, worst_x, kStride, kStride == 1 ? "st" : "th");
  EXPECT_LE(worst, kDeclaredUlp);
}

TEST(XsimdExp, FlushesToZeroFromMinus126Point5Down) {
  if (!runs()) GTEST_SKIP() << "CPU lacks the ISA";
  float first_x = 0.0f;
  const std::uint64_t n = nonzero_results(
      bits_of(-126.5f), bits_of(-std::numeric_limits<float>::infinity()), kStride, &first_x);
  EXPECT_EQ(n, 0u) << "first at x = " << first_x;
}

TEST(XsimdExp, SpecialValues) {
  if (!runs()) GTEST_SKIP() << "CPU lacks the ISA";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float cases[8] = {-inf, nan, -nan, 0.0f, -0.0f, -126.0f, -126.49f, -125.9f};
  for (int c = 0; c < 8; ++c) {
    float in[kWidth], out[kWidth];
    for (float& x : in) x = cases[c];  // every lane, so each lane's path is checked
    Kernel::exp2_nonpositive(Batch::load_unaligned(in)).store_unaligned(out);
    for (int i = 0; i < kWidth; ++i) {
      if (c == 0) {
        EXPECT_EQ(bits_of(out[i]), 0u);  // exactly +0: masked weights
      } else if (c <= 2) {
        EXPECT_TRUE(std::isnan(out[i]));
      } else if (c <= 4) {
        EXPECT_EQ(out[i], 1.0f);
      } else if (c == 5) {
        EXPECT_EQ(out[i], std::ldexp(1.0f, -126));  // the smallest normal, exactly
      } else {
        EXPECT_LE(ulp_error(out[i], std::exp2(static_cast<double>(cases[c]))), kDeclaredUlp)
            << cases[c];
      }
    }
  }
}

}  // namespace

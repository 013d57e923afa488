// The kernels' soft-cap (mha::support::Softcap, Problem::softcap) against double tanh: the
// bound reference/tolerance.h allows (kSoftcapError u c, step 8) is asserted here, for caps
// from 2^-126 to 2^120 in natural-log and base-2 logit units, over a sample of every binade of
// positive floats (and a denser one where tanh is neither x nor 1), for the code
// as the kernels compile it: without fused multiply-adds (baseline x86-64: blocked) and with
// them (the AVX2 and AVX-512 kernels' target regions; every aarch64 build). Plus the special
// values: +-inf to +-cap, NaN to itself, +-0 to +-0, and the sign symmetry.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "mha/registry.h"
#include "mha/support.h"
#include "softcap_eval.h"
#include "tolerance.h"

#ifndef MHA_SOFTCAP_STRIDE
#define MHA_SOFTCAP_STRIDE 1  // multiplies the sampling strides (emulated runs: more)
#endif

namespace {

using mha::support::Softcap;

// The capped values of x[0 .. n) as a kernel compiled with fused multiply-adds computes them
// (softcap_eval.cpp: this file, whose static constructors register the tests before any CPU
// check, holds no ISA code), and as baseline code does.
bool have_fma() {
#if defined(__x86_64__)
  return mha::cpu_supports(mha::Isa::avx2);
#else
  return true;
#endif
}
void apply_plain(const Softcap& cap, float* x, std::int64_t n) { cap.apply(x, n); }

float from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

struct Worst {
  double error = 0.0;  // in units of u c b
  float x = 0.0f;
};

// The largest |capped(x) - c b tanh(x / (c b))| / (u c b) over the positive floats with bits
// [first, last] at `stride` (the sign is a bit: SpecialValues), c b in double, unrounded.
template <typename Apply>
Worst worst_error(double c, double units, std::uint32_t first, std::uint32_t last,
                  std::uint32_t stride, Apply apply) {
  mha::Problem p;
  p.softcap = static_cast<float>(c);
  const Softcap cap = Softcap::of(p, units);
  const double cb = static_cast<double>(p.softcap) * units;
  const double unit = std::ldexp(cb, -24);
  constexpr std::size_t kChunk = 1 << 16;
  std::vector<float> x, y;
  Worst w;
  for (std::uint64_t b = first; b <= last;) {
    x.clear();
    for (; b <= last && x.size() < kChunk; b += stride) {
      x.push_back(from_bits(static_cast<std::uint32_t>(b)));
    }
    y = x;
    apply(cap, y.data(), static_cast<std::int64_t>(y.size()));
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double exact = cb * std::tanh(static_cast<double>(x[i]) / cb);
      const double error = std::fabs(static_cast<double>(y[i]) - exact) / unit;
      if (!(error <= w.error)) w = {error, x[i]};  // NaN counts as the worst
    }
  }
  return w;
}

constexpr double kCaps[] = {0x1p-126, 0.37, 1.0, 3.0, 30.0, 50.0, 1e30, 0x1p120};
constexpr double kUnits[] = {1.0, mha::support::kLog2e};
const std::uint32_t kPositiveInf = bits_of(std::numeric_limits<float>::infinity());

template <typename Apply>
void expect_within_bound(const char* name, Apply apply) {
  for (const double units : kUnits) {
    for (const double c : kCaps) {
      // Every binade of positive floats, 1 in 997 (times MHA_SOFTCAP_STRIDE for emulated runs).
      Worst w = worst_error(c, units, 0, kPositiveInf - 1, 997 * MHA_SOFTCAP_STRIDE, apply);
      // Denser where tanh bends, 1 in 37: x from c b / 64 to 48 c b.
      const auto cb = static_cast<float>(c * units);
      const std::uint32_t lo = bits_of(cb / 64.0f);
      const std::uint32_t hi = bits_of(std::min(cb * 48.0f, std::numeric_limits<float>::max()));
      const Worst dense = worst_error(c, units, lo, hi, 37 * MHA_SOFTCAP_STRIDE, apply);
      if (!(dense.error <= w.error)) w = dense;
      std::printf("%s softcap c = %g, units %g: max error %.4f u c at x = %.9g\n", name, c, units,
                  w.error, static_cast<double>(w.x));
      EXPECT_LE(w.error, mha::ref::kSoftcapError)
          << "c " << c << " units " << units << " x " << w.x;
    }
  }
}

TEST(Softcap, WithinTheToleranceBoundWithoutFma) { expect_within_bound("plain", apply_plain); }

TEST(Softcap, WithinTheToleranceBoundWithFma) {
  if (!have_fma()) GTEST_SKIP() << "CPU lacks AVX2 and FMA";
  expect_within_bound("fma", mha::test::softcap_fma);
}

TEST(Softcap, SpecialValues) {
  for (const double units : kUnits) {
    for (const double c : kCaps) {
      mha::Problem p;
      p.softcap = static_cast<float>(c);
      const Softcap cap = Softcap::of(p, units);
      ASSERT_TRUE(cap.on());
      const float inf = std::numeric_limits<float>::infinity();
      const float nan = std::numeric_limits<float>::quiet_NaN();
      EXPECT_EQ(cap(inf), cap.cap) << c;
      EXPECT_EQ(cap(-inf), -cap.cap) << c;
      EXPECT_EQ(bits_of(cap(0.0f)), bits_of(0.0f)) << c;
      EXPECT_EQ(bits_of(cap(-0.0f)), bits_of(-0.0f)) << c;
      EXPECT_EQ(bits_of(cap(nan)), bits_of(nan)) << c;
      EXPECT_EQ(bits_of(cap(-nan)), bits_of(-nan)) << c;
      const float max = std::numeric_limits<float>::max();
      EXPECT_EQ(cap(max), cap.cap) << c;
      for (const float x : {0.5f, 1.0f, 7.0f, 1e-3f}) {
        const float y = x * cap.cap;
        EXPECT_EQ(cap(-y), -cap(y)) << c << " " << y;
      }
    }
  }
}

TEST(Softcap, OffWithoutACap) {
  mha::Problem p;
  EXPECT_FALSE(Softcap::of(p, 1.0).on());
  p.softcap = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(Softcap::of(p, mha::support::kLog2e).on());
  EXPECT_FALSE(mha::soft_capped(p));
}

}  // namespace

// The composed baselines' exp, against double exp over every float in [-104, 0]: its
// declared bound (kComposedExpUlp) is what the benchmarks' output check allows for it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "composed.h"

namespace mha::bench {
namespace {

// Error in units of the last place of the exact result (as a float).
double ulp_error(float got, double exact) {
  if (exact < std::ldexp(1.0, -126)) return std::fabs(got - exact) / std::ldexp(1.0, -149);
  int e;
  std::frexp(exact, &e);  // exact in [2^(e-1), 2^e)
  return std::fabs(got - exact) / std::ldexp(1.0, e - 24);
}

TEST(ComposedExp, WithinDeclaredUlpOnEveryFloatInRange) {
  double worst = 0.0;
  float worst_x = 0.0f;
  // Every float from -0 down to -87.3 (below that the result is clamped to 2^-126, an
  // absolute error under 2^-125 that the tolerance's underflow term covers).
  std::uint32_t bits;
  const float lo = -87.3f;
  std::uint32_t lo_bits;
  std::memcpy(&lo_bits, &lo, sizeof lo);
  for (bits = 0x80000000u; bits <= lo_bits; ++bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    const double err = ulp_error(composed_exp(x), std::exp(static_cast<double>(x)));
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  }
  std::printf("composed exp: max error %.3f ulp at x = %.9g\n", worst, worst_x);
  EXPECT_LE(worst, kComposedExpUlp);
  for (float x : {-87.5f, -100.0f, -104.0f}) {
    EXPECT_LE(composed_exp(x), std::ldexp(1.0f, -125)) << x;
  }
}

}  // namespace
}  // namespace mha::bench

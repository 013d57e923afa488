// Error measures shared by the exp tests (every float of a kernel's exp domain against
// double precision).
#pragma once

#include <mha/registry.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mha::test {

/// |got - exact| in units of the last place of exact rounded to float; results below 2^-126
/// in units of 2^-149, the subnormal spacing.
inline double ulp_error(float got, double exact) {
  if (exact < std::ldexp(1.0, -126)) return std::fabs(got - exact) / std::ldexp(1.0, -149);
  int e;
  std::frexp(exact, &e);  // exact in [2^(e-1), 2^e)
  return std::fabs(got - exact) / std::ldexp(1.0, e - 24);
}

/// The exp_ulp registry.inc declares for `kernel`: the bound an exp test asserts, so that
/// raising a declared bound cannot pass unnoticed (the bound is where the tolerance reads it).
inline double declared_ulp(const std::string& kernel) {
  const KernelInfo* k = find_kernel(kernel);
  if (k == nullptr) throw std::runtime_error("no kernel " + kernel + " in the registry");
  return k->exp_ulp;
}

/// The bit pattern of x (negative floats: ascending bits are descending values).
inline std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace mha::test

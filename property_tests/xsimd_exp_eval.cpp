// The xsimd kernels' 2^x (Attention<Arch>::exp2_nonpositive, kernels/xsimd/xsimd_kernel.h)
// evaluated for xsimd_exp_test.cpp, for the architecture MHA_XSIMD_ARCH: the only code of
// that test built with the architecture's ISA flags, its headers but xsimd_kernel.h in a
// baseline region as that header's are (property_tests/CMakeLists.txt
// configures one per architecture). It defines no object with a dynamic initializer, so that
// nothing of it runs before the test has checked the CPU (see avx512_exp_eval.cpp).
#include "xsimd_kernel.h"  // first (see there)

MHA_XSIMD_BASELINE_BEGIN
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ulp.h"
MHA_XSIMD_BASELINE_END
// Outside the region: GCC gives a function declared in it the region's target, even where
// its definition is outside (this file's functions call the kernel with vector arguments).
#include "exp_eval.h"

namespace mha::test {

namespace {

using Kernel = mha::xsimd_kernel::Attention<MHA_XSIMD_ARCH>;
using Batch = Kernel::Batch;
constexpr int kWidth = Kernel::kWidth;

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
}  // namespace

double xsimd_exp2_worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, std::uint32_t stride,
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
std::uint64_t xsimd_exp2_nonzero_results(std::uint32_t lo_bits, std::uint32_t hi_bits,
                                         std::uint32_t stride, float* first_x) {
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

int xsimd_exp2_width() { return kWidth; }

void xsimd_exp2(const float* x, float* y) {
  Kernel::exp2_nonpositive(Batch::load_unaligned(x)).store_unaligned(y);
}

}  // namespace mha::test

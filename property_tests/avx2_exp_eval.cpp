// The avx2 kernel's 2^x (kernels/avx2/avx2_exp.h) evaluated for avx2_exp_test.cpp: the only
// code of that test compiled for the kernel's ISA, in a target region (MHA_TARGET_BEGIN,
// mha/support.h) as the kernel's is, with no flags. It defines no object with a dynamic
// initializer, so that nothing of it runs before the test has checked the CPU (see
// avx512_exp_eval.cpp).
#include "avx2_exp.h"

#include <cmath>
#include <cstdint>

#include "exp_eval.h"
#include "mha/support.h"
#include "ulp.h"

MHA_TARGET_BEGIN("avx2,fma")
namespace mha::test {

namespace {

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
}  // namespace

double avx2_exp2_worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, float* worst_x) {
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
std::uint64_t avx2_exp2_nonzero_results(std::uint32_t lo_bits, std::uint32_t hi_bits,
                                        float* first_x) {
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

void avx2_exp2(const float* x, float* y) {
  _mm256_storeu_ps(y, mha::avx2::exp2_nonpositive(_mm256_loadu_ps(x)));
}

}  // namespace mha::test
MHA_TARGET_END

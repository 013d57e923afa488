// The avx512 kernel's 2^x (kernels/avx512/avx512_exp.h) evaluated for avx512_exp_test.cpp:
// the only code of that test compiled for the kernel's ISA, in a target region
// (MHA_TARGET_BEGIN, mha/support.h) as the kernel's is, with no flags. It defines no object with a
// dynamic initializer, so that nothing of it runs before the test has checked the CPU (a
// test file built with the flags registered its tests in a static constructor that the
// compiler was free to vectorize with AVX-512: the executable died on AVX2-only CPUs).
// avx512_exp.h first: it includes immintrin.h (see there why).
#include "avx512_exp.h"

#include <cmath>
#include <cstdint>

#include "exp_eval.h"
#include "mha/support.h"
#include "ulp.h"

MHA_TARGET_BEGIN("avx512f,avx512vl,avx512dq,avx512bw,fma")
namespace mha::test {

double avx512_exp2_worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, float* worst_x) {
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

void avx512_exp2(const float* x, float* y) {
  _mm512_storeu_ps(y, mha::avx512::exp2_nonpositive(_mm512_loadu_ps(x)));
}

}  // namespace mha::test
MHA_TARGET_END

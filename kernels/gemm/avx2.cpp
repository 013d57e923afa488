// gemm avx2: packed SGEMM on AVX2 and FMA, C = A B (+ bias) as mha/gemm.h specifies. Read
// portable.cpp first: the loops (support::gemm_loops), the packing and the blocking are the
// same; this file is its microkernel.
//
// Microkernel: 6 rows x 16 columns, 12 ymm accumulators. Each step l loads the B panel's row
// l as two vectors and multiplies it by each of the 6 A values of the panel, broadcast
// (VBROADCASTSS from memory): 12 FMAs per 2 loads and 6 broadcasts, 15 registers of 16. At
// two FMAs a cycle, 6 cycles a step for 8 loads: the FMA ports are the limit. The A
// micro-panel (6 x kc floats, 12 KiB at kc = 512) stays in L1 for the block's B panels.
//
// Few rows (decode): B streams from memory once, prefetched 8 KiB ahead (kAhead).
//
// Tails: rows through with_count; columns past n are zero in the packed B, computed, and not
// stored (VMASKMOVPS loads and stores of C and bias touch only the real columns).
//
// Runs under mha::FpEnvGuard: the caller's floating-point environment changes no bit.
//
// ISA: AVX2 and FMA, for the code below the includes (MHA_TARGET_BEGIN): no flags. Depends on
// gemm_loops.h, mha/gemm.h, mha/support.h, <immintrin.h> and the standard library only.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "gemm_loops.h"
#include "mha/gemm.h"
#include "mha/support.h"

MHA_TARGET_BEGIN("avx2,fma")
namespace {

constexpr int kMr = 6;
constexpr int kNr = 16;
// As avx512.cpp: a call of at most kStreamRows rows prefetches its B panel 8 KiB ahead.
constexpr int kStreamRows = 4;
constexpr std::int64_t kAhead = 2048;

// Lanes [0, n) of a vector set (n clamped to 0..8), as a VMASKMOVPS mask.
__m256i lanes(std::int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n)), index);
}

template <int R>
void micro(std::int64_t kc, const float* ap, const float* bp, float* c, std::int64_t ldc,
           std::int64_t cols, bool first, const float* bias) {
  const __m256i m0 = lanes(cols), m1 = lanes(cols - 8);
  __m256 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (first) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    } else {
      acc[r][0] = _mm256_maskload_ps(c + r * ldc, m0);
      acc[r][1] = _mm256_maskload_ps(c + r * ldc + 8, m1);
    }
  }
  for (std::int64_t l = 0; l < kc; ++l) {
    if (R <= kStreamRows) __builtin_prefetch(bp + l * kNr + kAhead);
    const __m256 b0 = _mm256_loadu_ps(bp + l * kNr);
    const __m256 b1 = _mm256_loadu_ps(bp + l * kNr + 8);
    const float* a = ap + l * kMr;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  if (bias != nullptr) {
    const __m256 bias0 = _mm256_maskload_ps(bias, m0);
    const __m256 bias1 = _mm256_maskload_ps(bias + 8, m1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_add_ps(acc[r][0], bias0);
      acc[r][1] = _mm256_add_ps(acc[r][1], bias1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(c + r * ldc, m0, acc[r][0]);
    _mm256_maskstore_ps(c + r * ldc + 8, m1, acc[r][1]);
  }
}

}  // namespace

mha::GemmTile mha_f32_gemm_avx2_tile() { return {kMr, kNr}; }

void mha_f32_gemm_avx2(const mha::GemmProblem& p, const float* a, const float* b, const float* bias,
                       float* c) {
  const mha::FpEnvGuard default_fp_env;
  // micro<R> for the rows left (with_count's constant), called as gemm_loops describes.
  mha::support::gemm_loops<kMr, kNr>(
      p, a, b, bias, c, [](auto rows, auto... args) { micro<decltype(rows)::value>(args...); });
}

MHA_TARGET_END

// gemm avx512: packed SGEMM on AVX-512, C = A B (+ bias) as mha/gemm.h specifies. Read
// portable.cpp first: the loops (support::gemm_loops), the packing and the blocking are the
// same; this file is its microkernel.
//
// Microkernel: 12 rows x 32 columns, 24 zmm accumulators. Each step l loads the B panel's row
// l as two vectors and multiplies it by each of the 12 A values of the panel, broadcast
// (VFMADD231PS with a {1to16} memory operand): 24 FMAs per 2 loads and 12 broadcasts, 26
// registers of 32. At two FMAs a cycle that is 12 cycles a step, while the 14 loads need 7
// of the two load ports: the FMA ports are the limit. The A micro-panel (12 x kc floats, 12
// KiB at kc = 256) stays in L1 for the B panels of the block, which stream from L2.
//
// Few rows (decode): B streams from memory once; software prefetch 8 KiB ahead (kAhead).
//
// Tails: rows through with_count (the microkernel for the rows left); columns past n are
// zero in the packed B, computed, and not stored (masked loads and stores of C and bias).
//
// Runs under mha::FpEnvGuard: the caller's floating-point environment changes no bit.
//
// ISA: AVX-512F, VL, DQ, BW and FMA, for the code below the includes (MHA_TARGET_BEGIN): no
// flags. Depends on gemm_loops.h, mha/gemm.h, mha/support.h, <immintrin.h> and the standard
// library only.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "gemm_loops.h"
#include "mha/gemm.h"
#include "mha/support.h"

MHA_TARGET_BEGIN("avx512f,avx512vl,avx512dq,avx512bw,fma")
namespace {

constexpr int kMr = 12;
constexpr int kNr = 32;
// A call of at most kStreamRows rows (a decode step's few tokens) reads its B panel once,
// from memory: it prefetches kAhead floats (8 KiB) ahead of its loads. Reading a 64 MiB
// weight with one row of A, 1 thread: 9-11% faster than the hardware prefetchers alone
// (e.g. 18.5 against 16.6 GB/s, medians of 40 cold calls; Intel Xeon model 207).
constexpr int kStreamRows = 4;
constexpr std::int64_t kAhead = 2048;

template <int R>
void micro(std::int64_t kc, const float* ap, const float* bp, float* c, std::int64_t ldc,
           std::int64_t cols, bool first, const float* bias) {
  // Lanes of the two column vectors that are real columns.
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 =
      cols >= 32 ? __mmask16(0xFFFF) : (cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1));
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (first) {
      acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    } else {
      acc[r][0] = _mm512_maskz_loadu_ps(m0, c + r * ldc);
      acc[r][1] = _mm512_maskz_loadu_ps(m1, c + r * ldc + 16);
    }
  }
#pragma GCC unroll 4
  for (std::int64_t l = 0; l < kc; ++l) {
    if (R <= kStreamRows) {
      __builtin_prefetch(bp + l * kNr + kAhead);
      __builtin_prefetch(bp + l * kNr + kAhead + 16);
    }
    const __m512 b0 = _mm512_loadu_ps(bp + l * kNr);
    const __m512 b1 = _mm512_loadu_ps(bp + l * kNr + 16);
    const float* a = ap + l * kMr;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  if (bias != nullptr) {
    const __m512 bias0 = _mm512_maskz_loadu_ps(m0, bias);
    const __m512 bias1 = _mm512_maskz_loadu_ps(m1, bias + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_add_ps(acc[r][0], bias0);
      acc[r][1] = _mm512_add_ps(acc[r][1], bias1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
  }
}

}  // namespace

mha::GemmTile mha_f32_gemm_avx512_tile() { return {kMr, kNr}; }

void mha_f32_gemm_avx512(const mha::GemmProblem& p, const float* a, const float* b,
                         const float* bias, float* c) {
  const mha::FpEnvGuard default_fp_env;
  // micro<R> for the rows left (with_count's constant), called as gemm_loops describes.
  mha::support::gemm_loops<kMr, kNr>(
      p, a, b, bias, c, [](auto rows, auto... args) { micro<decltype(rows)::value>(args...); });
}

MHA_TARGET_END

// gemm neon: packed SGEMM on AArch64 Advanced SIMD, C = A B (+ bias) as mha/gemm.h specifies.
// Read portable.cpp first: the loops (support::gemm_loops), the packing and the blocking are
// the same; this file is its microkernel.
//
// Microkernel: 8 rows x 12 columns, 24 q-register accumulators. Each step l loads the B
// panel's row l as three vectors and the A panel's 8 values as two, and multiplies each B
// vector by each A value with a by-lane FMLA: 24 FMAs per 5 loads, 29 registers of 32. The A
// micro-panel (8 x kc floats) stays in L1 for the block's B panels, which stream from L2.
//
// Tails: rows through with_count; columns past n are zero in the packed B and computed; a
// partial panel's C row goes through a 12-float stack buffer, so only real columns are read
// and written.
//
// Runs under mha::FpEnvGuard: the caller's floating-point environment changes no bit.
//
// ISA: Advanced SIMD, the AArch64 baseline. Depends on gemm_loops.h, mha/gemm.h,
// mha/support.h, <arm_neon.h> and the standard library only.
#include <arm_neon.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "gemm_loops.h"
#include "mha/gemm.h"
#include "mha/support.h"

namespace {

constexpr int kMr = 8;
constexpr int kNr = 12;

// Row I's three accumulators += B row times A value I (lane I % 4 of a0 or a1).
template <int I>
inline void fma_row(float32x4_t* acc, float32x4_t b0, float32x4_t b1, float32x4_t b2,
                    float32x4_t a0, float32x4_t a1) {
  const float32x4_t a = I < 4 ? a0 : a1;
  acc[0] = vfmaq_laneq_f32(acc[0], b0, a, I % 4);
  acc[1] = vfmaq_laneq_f32(acc[1], b1, a, I % 4);
  acc[2] = vfmaq_laneq_f32(acc[2], b2, a, I % 4);
}

template <int R, int... I>
inline void step(float32x4_t (&acc)[R][3], const float* a, const float* b,
                 std::integer_sequence<int, I...>) {
  const float32x4_t b0 = vld1q_f32(b), b1 = vld1q_f32(b + 4), b2 = vld1q_f32(b + 8);
  const float32x4_t a0 = vld1q_f32(a), a1 = vld1q_f32(a + 4);
  (fma_row<I>(acc[I], b0, b1, b2, a0, a1), ...);
}

template <int R>
void micro(std::int64_t kc, const float* ap, const float* bp, float* c, std::int64_t ldc,
           std::int64_t cols, bool first, const float* bias) {
  float32x4_t acc[R][3];
  float row[kNr];  // a partial panel's C row, real columns first, zeros after
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float* src = c + r * ldc;
    if (!first && cols < kNr) {
      for (int j = 0; j < kNr; ++j) row[j] = j < cols ? src[j] : 0.0f;
      src = row;
    }
#pragma GCC unroll 16
    for (int v = 0; v < 3; ++v) acc[r][v] = first ? vdupq_n_f32(0.0f) : vld1q_f32(src + 4 * v);
  }
  for (std::int64_t l = 0; l < kc; ++l) {
    step<R>(acc, ap + l * kMr, bp + l * kNr, std::make_integer_sequence<int, R>{});
  }
  if (bias != nullptr) {
    float padded[kNr];
    const float* b = bias;
    if (cols < kNr) {
      for (int j = 0; j < kNr; ++j) padded[j] = j < cols ? bias[j] : 0.0f;
      b = padded;
    }
#pragma GCC unroll 16
    for (int v = 0; v < 3; ++v) {
      const float32x4_t add = vld1q_f32(b + 4 * v);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][v] = vaddq_f32(acc[r][v], add);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* dst = c + r * ldc;
    if (cols == kNr) {
#pragma GCC unroll 16
      for (int v = 0; v < 3; ++v) vst1q_f32(dst + 4 * v, acc[r][v]);
    } else {
#pragma GCC unroll 16
      for (int v = 0; v < 3; ++v) vst1q_f32(row + 4 * v, acc[r][v]);
      for (std::int64_t j = 0; j < cols; ++j) dst[j] = row[j];
    }
  }
}

}  // namespace

mha::GemmTile mha_f32_gemm_neon_tile() { return {kMr, kNr}; }

void mha_f32_gemm_neon(const mha::GemmProblem& p, const float* a, const float* b, const float* bias,
                       float* c) {
  const mha::FpEnvGuard default_fp_env;
  // micro<R> for the rows left (with_count's constant), called as gemm_loops describes.
  mha::support::gemm_loops<kMr, kNr>(
      p, a, b, bias, c, [](auto rows, auto... args) { micro<decltype(rows)::value>(args...); });
}

// gemm portable: packed SGEMM in portable C++, C = A B (+ bias) as mha/gemm.h specifies. The
// reference shape of a GEMM kernel file: the SIMD ones (avx2.cpp, avx512.cpp, neon.cpp)
// differ only in their microkernel.
//
//   A packed per call (pack_a, by the caller: the driver packs it once for all its tiles),
//   B packed once (pack_b), both in panels of the register tile (mha/gemm.h)
//   for each block of nc columns of B:                        support::gemm_loops
//     for each pass over kc steps:
//       for each mr rows of A:
//         for each B panel: C tile (mr x nr) += A panel (mr x kc) B panel (kc x nr)   micro
//
// Microkernel: an mr x nr tile of accumulators, kMr = 4 rows by kNr = 16 columns; each step l
// multiplies the 4 values of the A panel by the 16 of the B panel's row l. The loop over
// columns is contiguous and carries no reduction, so compilers vectorize it (SSE2: 4
// vectors of 4 per row) without reassociating: every element is summed in order over l, as
// the contract requires. 4 x 16 accumulators are as many vectors as SSE2 has registers; the
// compiler keeps most of them in registers and the rest in L1.
//
// Blocking: support::gemm_blocking (kc from L1d, nc from L2; gemm_loops.h gives the rule).
// Tails: with_count instantiates the microkernel for the rows left, and only real rows are
// stored; columns past n are the zero columns of the packed B, computed and not stored.
// Writes only C's m x n elements; reads the packed panels that cover A's m rows and B's n
// columns, and bias's n floats. No workspace.
//
// Runs under mha::FpEnvGuard: the caller's floating-point environment changes no bit.
//
// Depends on gemm_loops.h, mha/gemm.h, mha/support.h (and the mha/attention.h it includes) and
// the standard library only.
#include <cstddef>
#include <cstdint>

#include "gemm_loops.h"
#include "mha/gemm.h"
#include "mha/support.h"

namespace {

constexpr int kMr = 4;
constexpr int kNr = 16;

template <int R>
void micro(std::int64_t kc, const float* ap, const float* bp, float* c, std::int64_t ldc,
           std::int64_t cols, bool first, const float* bias) {
  float acc[R][kNr];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kNr; ++j) acc[r][j] = first || j >= cols ? 0.0f : c[r * ldc + j];
  }
  for (std::int64_t l = 0; l < kc; ++l) {
    const float* b = bp + l * kNr;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float x = ap[l * kMr + r];
      for (int j = 0; j < kNr; ++j) acc[r][j] += x * b[j];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* row = c + r * ldc;
    if (bias != nullptr) {
      for (std::int64_t j = 0; j < cols; ++j) row[j] = acc[r][j] + bias[j];
    } else {
      for (std::int64_t j = 0; j < cols; ++j) row[j] = acc[r][j];
    }
  }
}

}  // namespace

mha::GemmTile mha_f32_gemm_portable_tile() { return {kMr, kNr}; }

void mha_f32_gemm_portable(const mha::GemmProblem& p, const float* a, const float* b,
                           const float* bias, float* c) {
  const mha::FpEnvGuard default_fp_env;
  // micro<R> for the rows left (with_count's constant), called as gemm_loops describes.
  mha::support::gemm_loops<kMr, kNr>(
      p, a, b, bias, c, [](auto rows, auto... args) { micro<decltype(rows)::value>(args...); });
}

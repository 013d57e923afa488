// gemm_loops.h: what the packed GEMM kernels of this folder share, so that each kernel file
// holds only its microkernel: the blocking of C = A B from the caches of one core, and the
// loops around the microkernel. Header-only, C++17; depends on mha/gemm.h and mha/support.h
// (caches(), with_count) only: a copied GEMM kernel is its file, this header, mha/gemm.h,
// mha/support.h and mha/attention.h (which support.h includes).
#pragma once

#include <algorithm>
#include <cstdint>

#include "mha/gemm.h"
#include "mha/support.h"

namespace mha::support {

/// How a packed GEMM kernel blocks C = A B (kernels/gemm/, mha/gemm.h): kc steps per pass
/// over B and mc rows of A per block.
struct GemmBlocking {
  std::int64_t kc;  ///< depth of one pass
  std::int64_t mc;  ///< rows of A per block, a multiple of mr
};

/// The blocking of a kernel with an mr x nr register tile, from the caches of one core.
///
/// kc: the B micro-panel of one pass, kc x nr floats, in half of L1d: the microkernel reads it
/// once for each mr rows of the A block, so it stays in L1 while the A panels stream from L2
/// beside it. nr = 32 (AVX-512): 192 with a 48 KiB L1d, 128 with 32 KiB. At least 64 and at
/// most 512, so that C's loads and stores (once per pass) stay below 2% of the FMAs.
/// mc: the A block of one pass, mc x kc floats, in half of L2, where every B panel of the
/// pass meets it; a multiple of mr, at most 1024 rows. kc 192, 2 MiB: 1020 rows with mr 12;
/// kc 128, 512 KiB: 504.
/// Neither changes a result: an element is one accumulation in order over l whatever the
/// blocking (mha/gemm.h). gemm_loops takes kc = k when m <= mr (one row panel).
inline GemmBlocking gemm_blocking(std::int64_t mr, std::int64_t nr, const Caches& c = caches()) {
  constexpr std::int64_t kMinDepth = 64, kMaxDepth = 512, kMaxRows = 1024;
  const std::int64_t f = std::int64_t{sizeof(float)};
  GemmBlocking b;
  b.kc = std::clamp(c.l1d / 2 / (nr * f), kMinDepth, kMaxDepth);
  b.mc = std::clamp(c.l2 / 2 / (b.kc * f) / mr * mr, mr, kMaxRows / mr * mr);
  return b;
}

/// The loops of a packed GEMM kernel with a kMr x kNr register tile:
///
///   for each pass over kc steps (l0 = 0, kc, ...):
///     for each block of mc rows of A:            its kc-step slice stays in L2
///       for each B panel of nr columns:          its kc x nr micro-panel stays in L1
///         for each mr rows of the block:         micro(rows, ...): C tile += A panel B panel
///
/// micro(std::integral_constant<int, R>, kc, ap, bp, c, ldc, cols, first, bias) must compute,
/// for r < R and j < cols, c[r ldc + j] = (first ? 0 : c[r ldc + j]) + sum_l ap[l mr + r]
/// bp[l nr + j] in order over l < kc, then + bias[j] when bias is not null (the last pass),
/// and write nothing else. R is the rows left (1..kMr, with_count), cols the columns of the
/// panel that are real (1..kNr); ap and bp are the kc-step slices of one A and one B panel.
template <int kMr, int kNr, typename Micro>
void gemm_loops(const GemmProblem& p, const float* a, const float* b, const float* bias, float* c,
                Micro&& micro) {
  GemmBlocking blocking = gemm_blocking(kMr, kNr);
  // One row panel (a decode step's m <= mr tokens): no B micro-panel is read twice, so a pass
  // is the whole depth and each B panel one contiguous stream from memory.
  if (p.m <= kMr) blocking.kc = p.k;
  for (std::int64_t l0 = 0; l0 < p.k; l0 += blocking.kc) {
    const std::int64_t kc = std::min(blocking.kc, p.k - l0);
    const bool first = l0 == 0;
    const float* pass_bias = l0 + kc == p.k ? bias : nullptr;
    for (std::int64_t i0 = 0; i0 < p.m; i0 += blocking.mc) {
      const std::int64_t rows = std::min(blocking.mc, p.m - i0);
      for (std::int64_t j0 = 0; j0 < p.n; j0 += kNr) {
        const std::int64_t cols = std::min<std::int64_t>(kNr, p.n - j0);
        const float* bp = b + j0 * p.k + l0 * kNr;
        const float* tile_bias = pass_bias != nullptr ? pass_bias + j0 : nullptr;
        for (std::int64_t r0 = 0; r0 < rows; r0 += kMr) {
          const float* ap = a + (i0 + r0) * p.k + l0 * kMr;
          float* ct = c + (i0 + r0) * p.ldc + j0;
          with_count<kMr>(rows - r0,
                          [&](auto r) { micro(r, kc, ap, bp, ct, p.ldc, cols, first, tile_bias); });
        }
      }
    }
  }
}

}  // namespace mha::support

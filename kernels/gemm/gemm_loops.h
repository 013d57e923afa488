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

/// How a packed GEMM kernel blocks C = A B (kernels/gemm/, mha/gemm.h): blocks of nc columns
/// of B, passes of kc steps over each.
struct GemmBlocking {
  std::int64_t kc;  ///< depth of one pass
  std::int64_t nc;  ///< columns of B per block, a multiple of nr
};

/// The blocking of a kernel with an mr x nr register tile, from the caches of one core.
///
/// kc: the A micro-panel of one pass, mr x kc floats, in a quarter of L1d: the microkernel
/// reads it once for each B panel of the block, so it stays in L1 while the B micro-panels
/// stream through beside it from L2. mr = 12 (AVX-512) and 48 KiB: 256; 32 KiB: 160. A
/// multiple of 16, at least 64 and at most 512, so that C's loads and stores (once per pass)
/// stay below 2% of the FMAs.
/// nc: the B block of one pass, kc x nc floats, in half of L2, where every A micro-panel of
/// the pass meets it; a multiple of nr. kc 256, 2 MiB: 1024 columns; 512 KiB: 256.
/// Neither changes a result: an element is one accumulation in order over l whatever the
/// blocking (mha/gemm.h). gemm_loops takes kc = k and nc = n when m <= mr (one row panel).
inline GemmBlocking gemm_blocking(std::int64_t mr, std::int64_t nr, const Caches& c = caches()) {
  constexpr std::int64_t kMinDepth = 64, kMaxDepth = 512;
  const std::int64_t f = std::int64_t{sizeof(float)};
  GemmBlocking b;
  b.kc = std::clamp(c.l1d / 4 / (mr * f) / 16 * 16, kMinDepth, kMaxDepth);
  b.nc = std::max(c.l2 / 2 / (b.kc * f) / nr * nr, nr);
  return b;
}

/// Software prefetch of the 64-byte lines [first, last) from `p` on, into L2 (and the caches
/// above it); the hint is all it is, so any address may be named.
inline void prefetch_lines(const float* p, std::int64_t first, std::int64_t last) {
  for (std::int64_t q = first; q < last; ++q) __builtin_prefetch(p + q * 16, 0, 2);
}

/// The loops of a packed GEMM kernel with a kMr x kNr register tile:
///
///   for each block of nc columns of B:
///     for each pass over kc steps (l0 = 0, kc, ...):  the pass's kc x nc B block stays in L2
///       for each mr rows of A:                        its mr x kc micro-panel stays in L1
///         for each B panel of the block:              micro(rows, ...): C tile += A B
///
/// So the C tiles of consecutive calls are side by side in the same mr rows (a stream per
/// row for the hardware prefetchers), and the only operands that come from memory are the
/// A micro-panels (once per block and pass) and the B block (once per pass): while the B
/// panels of one A micro-panel run, the next micro-panel is prefetched into L2, a share per
/// call; and while the rows of a pass run, the next pass's B block, a share per row panel.
///
/// micro(std::integral_constant<int, R>, kc, ap, bp, c, ldc, cols, first, bias) must compute,
/// for r < R and j < cols, c[r ldc + j] = (first ? 0 : c[r ldc + j]) + sum_l ap[l mr + r]
/// bp[l nr + j] in order over l < kc, then + bias[j] when bias is not null (the last pass),
/// and write nothing else. R is the rows left (1..kMr, with_count), cols the columns of the
/// panel that are real (1..kNr); ap and bp are the kc-step slices of one A and one B panel.
/// Always inlined into the kernel's entry point, so that micro, which is compiled in the
/// kernel's target region, is inlined into the loops (see MHA_ALWAYS_INLINE, mha/support.h).
template <int kMr, int kNr, typename Micro>
MHA_ALWAYS_INLINE void gemm_loops(const GemmProblem& p, const float* a, const float* b,
                                  const float* bias, float* c, Micro&& micro) {
  constexpr std::int64_t kLine = 16;  // floats in a 64-byte line
  GemmBlocking blocking = gemm_blocking(kMr, kNr);
  // One row panel (a decode step's m <= mr tokens): no B micro-panel is read twice, so a pass
  // is the whole depth and each B panel one contiguous stream from memory.
  if (p.m <= kMr) blocking = {p.k, p.n};
  const std::int64_t row_panels = (p.m + kMr - 1) / kMr;
  for (std::int64_t j0 = 0; j0 < p.n; j0 += blocking.nc) {
    const std::int64_t cols = std::min(blocking.nc, p.n - j0);
    const std::int64_t panels = (cols + kNr - 1) / kNr;
    for (std::int64_t l0 = 0; l0 < p.k; l0 += blocking.kc) {
      const std::int64_t kc = std::min(blocking.kc, p.k - l0);
      // Lines of a B panel's next pass: 0 on the last pass.
      const std::int64_t b_lines = std::min(blocking.kc, p.k - l0 - kc) * kNr / kLine;
      const bool first = l0 == 0;
      const float* pass_bias = l0 + kc == p.k ? bias : nullptr;
      for (std::int64_t ip = 0; ip < row_panels; ++ip) {
        const std::int64_t i0 = ip * kMr;
        const float* ap = a + i0 * p.k + l0 * kMr;
        const bool more_rows = ip + 1 < row_panels;
        const float* next_ap = more_rows ? ap + kMr * p.k : ap;
        const std::int64_t a_lines = more_rows ? kc * kMr / kLine : 0;
        for (std::int64_t jp = 0; jp < panels; ++jp) {
          const std::int64_t jj = j0 + jp * kNr;
          const float* bp = b + jj * p.k + l0 * kNr;
          // This call's shares: of the next A micro-panel, and of this B panel's next pass.
          prefetch_lines(next_ap, a_lines * jp / panels, a_lines * (jp + 1) / panels);
          prefetch_lines(bp + kc * kNr, b_lines * ip / row_panels, b_lines * (ip + 1) / row_panels);
          const float* tile_bias = pass_bias != nullptr ? pass_bias + jj : nullptr;
          float* ct = c + i0 * p.ldc + jj;
          const std::int64_t n_cols = std::min<std::int64_t>(kNr, p.n - jj);
          with_count<kMr>(
              p.m - i0, [&](auto r) { micro(r, kc, ap, bp, ct, p.ldc, n_cols, first, tile_bias); });
        }
      }
    }
  }
}

}  // namespace mha::support

// avx2: multi-head attention with flash-attention tiling and a base-2 online softmax, in
// fp32, with x86-64 AVX2 + FMA intrinsics, for CPUs without AVX-512. The algorithm of
// kernels/blocked/blocked.cpp (read that file first), with packed operands and register-
// blocked microkernels in the manner of a BLAS GEMM.
//
// Computes what mha/attention.h specifies: per query head h (reading KV head h / g,
// g = q_heads / kv_heads), o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator, one KV tile at a time:
//
//   for each (batch, KV head, block of R = g x Br query rows, head-major: row t is head
//            t / Br, query row r0 + t % Br; all g heads share every KV tile):  for_each_block
//     pack Q: each group of MR = 6 rows into Qp[d][6]; m, l, O empty           start_block
//     for each KV tile of Bc = 128 keys some row of the block sees (causal: later tiles
//              are skipped):
//       pack K^T into panels Kp[panel][d][16]                                  pack_k
//       S = scale log2(e) Q K^T  S microkernel: 6 rows x 16 keys, per K panel  tile_logits
//                                for all groups
//       online softmax in base 2 per row: m_new = max(m, max_j S),             tile_softmax
//         alpha = 2^(m - m_new), P = 2^(S - m_new) in place, l = alpha l + sum_j P
//         (exp2 in avx2_exp.h; weights below 2^-126.5 flush to 0, which
//         reference/tolerance.h allows)
//       pack V into column panels Vp[panel][key][16]                           pack_v
//       O = alpha O + P V        PV microkernel: 6 rows x 16 columns, per V    tile_pv
//                                panel for all groups, alpha applied as the accumulators
//                                are loaded (unless every alpha of the group is 1)
//     o = O / l, lse = (m + log2 l) ln2                                        finish_block
//
// Decode (fewer than 16 rows g x q_len per KV head) takes its own path, decode_rows, with
// the lanes along head_dim and K and V read in place: see "Decode" below.
//
// The loops (blocks, tiles, groups, the prefetch schedule, the tiling rule, the workspace
// and decode's tiles) are mha/tiled_loops.h's, which the xsimd and highway kernels share;
// this file is its policy, struct Avx2: the packing, the two microkernels, the softmax step
// and decode's row steps, inlined into the loops. Against this file's own loops (AMD EPYC
// Zen 4, 1 thread, alternating runs, medians) the prefill ran 0.99-1.00 times as long and
// decode 0.95-1.01; callgrind counted 0.995-0.998 times the instructions per prefill call
// and 1.005 per decode call.
//
// ISA: AVX2 + FMA + F16C, for all code below the includes (MHA_TARGET_BEGIN, mha/support.h: the
// file needs no flags), which runs only when the CPU has them: 8-float ymm vectors, 16 registers.
// Both microkernels hold a 6 x 2 grid of ymm accumulators (12 registers; 2 for the streamed
// operand, 1 for a broadcast): 12 independent FMA chains cover 2 FMA ports x 4 cycles of
// latency with slack, and each step issues 2 vector loads and 6 broadcasts (load-port
// operations) per 12 FMAs, within 2 load ports.
//
// Packing, and why: token-major K and V rows lie H_kv D floats apart (4 KiB at H_kv = 8,
// D = 128), so reading them in a microkernel hits one L1 set per key and evicts itself. The
// tile is packed once and then read contiguously: a K panel (16 keys x D, 8 KiB at
// D = 128) or a V panel (Bc keys x 16 columns, 8 KiB) stays in L1 while every row group of
// the block streams past it (panel-outer, group-inner loops). Qp[d][6] lets the S
// microkernel broadcast 6 rows' q_d from one pointer at constant offsets, and the S buffer's
// compile-time row stride Bc does the same for the PV microkernel's P broadcasts. Zero
// padding (keys past the tile's end in Kp, columns past D in Vp) keeps the microkernels on
// whole vectors.
//
// Tile sizes, from the caches of the core (mha::support::caches()). Bc = 128 keys: per
// tile each row pays one softmax max/rescale step, and each microkernel call amortizes its
// accumulator loads, stores and epilogue over 128 key or D steps; the panel a microkernel
// reuses from L1 (16 keys x D of Kp or Bc keys x 16 columns of Vp, 8 KiB each at D = 128)
// fits any L1d. R: every block packs every KV tile it sees, and reads its K and V from
// memory (or L3), once, so R divides that work and that traffic. R is 256 to 512 rows, by
// mha::support::packed_rows_per_head, whose comment gives the rule and its measurements:
// the block's working set, Qp, S and O (R x (D + Bc + D16) floats, D16 = D rounded up to
// 16), may outgrow the L2 into the L3, since its traffic per FLOP does not depend on R,
// while packing for too few rows is the cliff (D = 256 with a 512 KiB L2 once gave R = 1:
// 4.4 GFLOP/s on a Zen 3 core against 77 at R = 512). Xeon, 2 MiB L2: from R = 128 to 256
// the D = 128 prefill ran about 4% faster, from 256 to 512 3-8% faster at L = 2048 and
// level at L = 512, the packing's share of the time 3.5% -> 2.1%; 1024 no faster. Only heads
// wider than 256 get fewer rows: R x D16 is at most kBlockFloats (R = 32 at D = 4096).
//
// Prefetch: packing reads K and V rows one page apart, which the hardware prefetchers do
// not follow, so every row would start with a cache miss. While S runs, the tile's V rows
// are prefetched into L2, a few lines per microkernel call; while P V runs, the next tile's
// K rows. That halved the packing time, about 3% of the D = 128 prefill.
//
// Where the time goes (AMD Zen 3 core, 1 thread, D = 128, H = 32, H_kv = 8, L = 1024, at
// 0.78 of the FMA peak; perf samples over the kernel): the S loop 40%, the P V loop 41%, so
// both run at about 96% of the peak where they are; the softmax's exp loop 6%; the rest
// (packing, epilogues, prefetch, loop control) 13%, spread over many sites, none above 2%.
// At D = 16 the exp loop costs as much as either microkernel (25%, against 23% and 26%),
// about twice what its 8 FMA-port operations per 8 weights would take.
// Tried on that core and not adopted (alternating runs, medians, against this file):
// * S, softmax and P V per chunk of 6 to 48 rows, the K and V tiles both packed first, so
//   that a chunk's S and P stay in L1 (the FlashAttention-2 order): 0.94-0.97x at D = 128.
// * S and the softmax step group by group where the K tile fits in L1 (D <= 32), so that
//   one group's exp chains overlap the next group's S: level at D = 16 and 32.
// * Bc = 256 keys: 0.99x at D = 128; at D = 16 +8% in one set of runs, level in another.
// * Estrin's scheme for the 2^x polynomial (12 cycles of latency instead of 28, two more
//   multiplies): 0.96x at D = 16, 0.99x at D = 128.
// * The exp loop unrolled twice with two sums: 0.96x at D = 16, level at D = 128.
//
// Causal masking is bottom-right aligned, so every row sees a prefix of the keys: a per-row
// count. The S epilogue sets the logits of keys a row does not see to -inf (so their
// weights are exactly 0 and the row max ignores them); S panels no row of a group sees are
// not computed. P V visits only keys a row sees: keys every row of a microkernel group sees
// go through the 6-row kernel, each row's extra keys (the causal diagonal) through a
// 1-row pass, so NaN or Inf in a V row a query row does not see never reaches it (not even
// as 0 x Inf). A row that sees no key stays all-zero: o = 0, lse = -inf. NaN logits are
// ignored by the max (VMAXPS returns its second source, the running max, when the first is
// NaN) and reach l and O through their weights, as in blocked.
//
// Tails: any key count, row count and head_dim. Tensor memory is touched only at its
// elements: the last partial vector of a row by _mm256_maskload_ps / _mm256_maskstore_ps
// (which do not fault on masked-off lanes). Reads only elements the strides address (of keys, only
// those some row of the block sees); writes only o's and lse's elements, each once.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0, shared
// inputs); no alignment assumed for tensors. Workspace arrays are 64-byte aligned.
//
// Workspace (the caller's; mha_f32_attention_avx2_workspace gives its size), in floats:
// Bc D (Kp) + Bc D16 (Vp) + R6 D (Qp, R6 = R rounded up to 6) + R Bc (S) + R D16 (O) +
// 8 R (row maxima) + 3 R, and R int64 counts: about 924 KiB at D = 128, R = 512 (526 KiB
// at R = 256), 1.6 MiB at D = 256, R = 512. Kp and Vp grow with D (2 MiB each at
// D = 4096). Decode needs g x q_len x D8 floats (D8 = D rounded up to 8) and a tile's
// weights; a prefill workspace is at least the largest decode's, so that the size never
// shrinks as q_len grows.
//
// Floating-point environment: the default one for the call (mha::FpEnvGuard, mha/attention.h),
// so the caller's flush-to-zero, denormals-are-zero or rounding mode changes no bit of the
// output, and the caller's control bits are as they were on return.
// avx2_exp.h rounds x to an integer by adding 1.5 2^23, which in FE_UPWARD rounds up: f
// would leave [-1/2, 1/2], and the polynomial's error bound with it.
//
// Depends on mha/attention.h, mha/support.h, mha/tiled_loops.h and avx2_exp.h (this folder)
// only.
#include "avx2_exp.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "mha/attention.h"
#include "mha/support.h"

MHA_TARGET_BEGIN("avx2,fma,f16c")
namespace {

#include "mha/tiled_loops.h"  // the loops: inside this file's namespace and target region

using mha::support::round_up;
using tiled::kKeys;

// Lanes [0, n) of a ymm (none for n <= 0, all for n >= 8), as a maskload/maskstore mask.
__m256i first_lanes(std::int64_t n) {
  const int c = static_cast<int>(std::clamp<std::int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

float horizontal_max(__m256 x) {
  __m128 v = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  v = _mm_max_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}
float horizontal_sum(__m256 x) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// In-register transpose: r[i] lane j becomes r[j] lane i.
void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4 b + c]: in each 128-bit half, rows 4b .. 4b + 3 of column c (resp. 4 + c).
  __m256 u[8];
  for (int b = 0; b < 2; ++b) {
    u[4 * b + 0] = _mm256_shuffle_ps(t[4 * b], t[4 * b + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * b + 1] = _mm256_shuffle_ps(t[4 * b], t[4 * b + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * b + 2] = _mm256_shuffle_ps(t[4 * b + 1], t[4 * b + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * b + 3] = _mm256_shuffle_ps(t[4 * b + 1], t[4 * b + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// n floats (1 .. 8) of a tensor row; lanes past n are 0 and their memory is not touched.
__m256 load_part(const float* x, std::int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, first_lanes(n));
}

// Lane i of the result: the sum of a[i]'s 8 lanes.
__m256 sum_lanes8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // u0 lane i (i < 4): half of a[i]'s sum in each 128-bit half; u1 the same for a[4 + i].
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Decode: fewer than kDecodeRows = 16 query rows (g x q_len) per KV head, too few to
// amortize packing K and V for the 6-row microkernels: with K and V in L2 (D = 128, 2048
// keys), 8 rows took 13.9 ns per row and key here against 16.4 through the packed tiles, 16
// rows 13.4 against 11.2 (Xeon, 2 MiB L2). Here the lanes run along head_dim and K and V are read
// in place, in whole vectors (from memory for the group's first row of a tile, from L1 for the
// others): per row, 8 keys' dot products accumulate in 8 ymm and are finished together by
// sum_lanes8, and P V adds weight x V row into the row's accumulator, 8 ymm (64 columns) at
// a time. Keys come in tiles of support::decode_tile_keys (K and V of a tile in two thirds
// of L1d: 16 keys at D = 128 with a 32 KiB L1d, 32 with 48 KiB) while the next tile is
// prefetched into L2; a row reads only the keys it sees, so masked V rows are never touched.
//
//   for each (batch, KV head): its g x q_len rows, O = 0                    decode_rows
//     for each tile of keys, the next one prefetched:
//       for each row that sees a key of the tile:
//         S: 8 keys' dot products at once, 32 columns of q in registers      dot_keys,
//                                                                            sum_lanes8
//         online softmax, base 2: m, alpha, P = 2^(S - m), l
//         O = alpha O + P V, 8 ymm of head_dim at a time                     add_weighted_rows
//     o = O / l, lse = (m + log2 l) ln 2                                     finish_row
//
// Registers: dot_keys holds 8 accumulators and 4 q vectors (13 of 16 ymm with the key
// vector): per key and 32 columns 4 FMAs and 4 loads, the q loads amortized over 8 keys, so
// the 2 load ports keep the 2 FMA ports busy. add_weighted_rows holds 8 accumulators, the
// broadcast weight and the V vector: 8 independent FMA chains, one V load each. Their
// loops over vectors carry `#pragma GCC unroll`: without it GCC 12 kept the accumulator
// arrays in memory, a store per FMA.
//
// Prefetch: the next tile's K and V rows, spread over the S steps of every row (a few whole
// rows per 8 keys, tiled_loops.h's prefetch_rows). K and V of 256 MiB (g = 4, 8 KV heads x
// 32768 keys, head-major; Xeon, median of alternating runs): 22.2 ns per row and key, against 32.7
// without software prefetch, 26.1 with RowPrefetch's line-by-line steps; with K and V in L2
// the prefetches cost 13.2 -> 14.2 ns (a case decode meets only in benchmarks that repeat
// one step: a KV cache is read once per step). At g = 1 the stream runs at DRAM speed with
// or without them (75-79 ns per key of 1 KiB).
//
// Tried and not adopted (Zen 3): register blocks of 4 rows (S 4 rows x 3 keys, P V 4 rows x 2
// vectors, each K or V vector loaded feeding 4 FMAs) with tiles sized to the L2. With K and V
// in L2 it took 7.4-7.5 ns per row and key at D = 128 (g = 4, 8) against 10.5-11.3 here, and
// 1.9-2.0 against 3.2-3.4 at D = 16; streaming from DRAM, mha_bench's decode shapes ran
// 1.45-1.9x slower. With this file's L1 tiles and prefetch the blocks were still slower from
// DRAM (27-43 against 20-26 ns per row and key, g = 4, 32 MiB); the cause is not known. A
// cache is read once per step, so DRAM is what counts.
// The packed prefill path for such decodes (one query row, K and V of 4 MiB in the L3) was
// no better where decode is weakest: 0.89x at D = 16, g = 4 (1.2x at g = 8), 0.67x and
// 0.85x at D = 128, g = 4 and 8.
// The policy of mha/tiled_loops.h: this ISA's pieces.
struct Avx2 {
  static constexpr int kRows = 6;  // MR: query rows per microkernel group
  static constexpr bool kWholeGroups = false;
  static constexpr bool kKvDecode = true;     // decode_logits_kv, decode_pv_kv below
  static constexpr std::int64_t kPanel = 16;  // keys per K panel = columns per V panel (2 ymm)
  static constexpr std::int64_t lanes() { return 8; }
  static constexpr std::int64_t panel() { return kPanel; }

  // kp[panel][d][i] = k[16 panel + i][d], 0 for keys >= keys, over round_up(keys, 16) keys.
  // k: [keys][dim], row stride k_seq   kp: [panels][dim][16]
  static void pack_k(const float* k, std::int64_t k_seq, std::int64_t keys, std::int64_t dim,
                     float* kp) {
    for (std::int64_t j0 = 0; j0 < round_up(keys, kPanel); j0 += 8) {
      float* panel = kp + (j0 / kPanel) * dim * kPanel + j0 % kPanel;
      const std::int64_t nj = keys - j0;
      if (nj <= 0) {  // the upper half of the last panel: zeros
        for (std::int64_t d = 0; d < dim; ++d)
          _mm256_storeu_ps(panel + d * kPanel, _mm256_setzero_ps());
        continue;
      }
      for (std::int64_t d0 = 0; d0 < dim; d0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          r[i] = i < nj ? load_part(k + (j0 + i) * k_seq + d0, dim - d0) : _mm256_setzero_ps();
        }
        transpose8(r);
        const std::int64_t nd = std::min<std::int64_t>(8, dim - d0);
        for (int i = 0; i < nd; ++i) _mm256_storeu_ps(panel + (d0 + i) * kPanel, r[i]);
      }
    }
  }

  // vp[panel][j][c] = v[j][16 panel + c], 0 for columns >= dim.
  // v: [keys][dim], row stride v_seq   vp: [panels][kKeys][16]
  static void pack_v(const float* v, std::int64_t v_seq, std::int64_t keys, std::int64_t dim,
                     float* vp) {
    for (std::int64_t j = 0; j < keys; ++j) {
      const float* row = v + j * v_seq;
      for (std::int64_t c = 0; c < dim; c += 8) {
        _mm256_storeu_ps(vp + (c / kPanel) * kKeys * kPanel + j * kPanel + c % kPanel,
                         load_part(row + c, dim - c));
      }
      if (dim % kPanel != 0 && dim % kPanel <= 8) {  // the last panel's upper half: zeros
        _mm256_storeu_ps(vp + (dim / kPanel) * kKeys * kPanel + j * kPanel + 8,
                         _mm256_setzero_ps());
      }
    }
  }

  // qp[d][r] = q[r][d] for r < nr, 0 for nr <= r < 6: 8 x 8 transposes of 8 columns of the
  // rows (rows 6 and 7 zero), of which 6 lanes are stored.   q[r]: [dim]   qp: [dim][6]
  static void pack_q(const float* const* q, int nr, std::int64_t dim, float* qp) {
    for (std::int64_t d0 = 0; d0 < dim; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = i < nr ? load_part(q[i] + d0, dim - d0) : _mm256_setzero_ps();
      transpose8(r);
      const std::int64_t nd = std::min<std::int64_t>(8, dim - d0);
      for (int i = 0; i < nd; ++i) {
        float* out = qp + (d0 + i) * kRows;
        _mm_storeu_ps(out, _mm256_castps256_ps128(r[i]));
        _mm_storel_pi(reinterpret_cast<__m64*>(out + 4), _mm256_extractf128_ps(r[i], 1));
      }
    }
  }

  // One step of both microkernels, a rank-1 update of the MR x 16 accumulators:
  // acc[r] += a[r * kStride] * b[0 .. 16) for r < MR (a broadcast per row, b two vectors).
  template <int MR, std::int64_t kStride>
  static void rank1_update(__m256 (&acc)[MR][2], const float* a, const float* b) {
    const __m256 b0 = _mm256_loadu_ps(b);
    const __m256 b1 = _mm256_loadu_ps(b + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * kStride);
      acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
    }
  }

  // The S microkernel: s[r][0 .. 16) = c sum_d qp[d][r] kp[d][0 .. 16) for r < MR, with
  // lanes >= limit[r] set to -inf (keys row r does not see); rowmax[r] (8 lanes) takes the
  // lane-wise max, ignoring NaN logits.
  // qp: [dim][6]   kp: [dim][16] (one panel)   s: [MR][kKeys]   rowmax: [MR][8]
  template <int MR>
  static void logits_tile(const float* qp, const float* kp, std::int64_t dim, float c,
                          const std::int64_t* limit, float* s, float* rowmax) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < dim; ++d) {
      rank1_update<MR, 1>(acc, qp + d * kRows, kp + d * kPanel);
    }
    const __m256 cv = _mm256_set1_ps(c);
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < MR; ++r) {
      __m256 x0 = _mm256_mul_ps(acc[r][0], cv), x1 = _mm256_mul_ps(acc[r][1], cv);
      if (limit[r] < kPanel) {
        x0 = _mm256_blendv_ps(neg_inf, x0, _mm256_castsi256_ps(first_lanes(limit[r])));
        x1 = _mm256_blendv_ps(neg_inf, x1, _mm256_castsi256_ps(first_lanes(limit[r] - 8)));
      }
      _mm256_storeu_ps(s + r * kKeys, x0);
      _mm256_storeu_ps(s + r * kKeys + 8, x1);
      // Running max second: a NaN x leaves it unchanged.
      const __m256 m = _mm256_max_ps(x1, _mm256_loadu_ps(rowmax + 8 * r));
      _mm256_storeu_ps(rowmax + 8 * r, _mm256_max_ps(x0, m));
    }
  }

  // The PV microkernel: o[r][0 .. 16) = alpha[r] o[r][0 .. 16) + sum_{j < keys} p[r][j]
  // vp[j][0 .. 16) for r < MR; alpha null: no rescale.
  // p: [MR][kKeys]   vp: [keys][16] (one panel)   o: [MR][ld_o]
  template <int MR>
  static void pv_tile(const float* p, std::int64_t keys, const float* vp, const float* alpha,
                      float* o, std::int64_t ld_o) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * ld_o);
      acc[r][1] = _mm256_loadu_ps(o + r * ld_o + 8);
      if (alpha != nullptr) {
        const __m256 a = _mm256_broadcast_ss(alpha + r);
        acc[r][0] = _mm256_mul_ps(acc[r][0], a);
        acc[r][1] = _mm256_mul_ps(acc[r][1], a);
      }
    }
    for (std::int64_t j = 0; j < keys; ++j) {
      rank1_update<MR, kKeys>(acc, p + j, vp + j * kPanel);
    }
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(o + r * ld_o, acc[r][0]);
      _mm256_storeu_ps(o + r * ld_o + 8, acc[r][1]);
    }
  }

  // One row's base-2 online-softmax step over its `cols` (>= 1) logits of this tile: s
  // becomes the weights 2^(s - m_new); lanes up to the next multiple of 8 are -inf (masked
  // by the S epilogue) and become 0. rowmax: the row's 8 lane maxima over the tile.
  static void online_softmax(float* s, std::int64_t cols, const float* rowmax, float* m, float* l,
                             float* alpha) {
    const float m_old = *m;
    const float tile_max = horizontal_max(_mm256_loadu_ps(rowmax));  // no lane is NaN
    const float m_new = tile_max > m_old ? tile_max : m_old;
    float a = 1.0f;
    if (m_new > m_old) {
      a = std::exp2(m_old - m_new);  // exactly 0 when m_old is -inf
      *m = m_new;
    }
    const __m256 base = _mm256_set1_ps(mha::support::logit_shift(m_new));
    __m256 sum = _mm256_setzero_ps();
    for (std::int64_t j = 0; j < cols; j += 8) {
      const __m256 w = mha::avx2::exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), base));
      _mm256_storeu_ps(s + j, w);
      sum = _mm256_add_ps(sum, w);
    }
    *l = *l * a + horizontal_sum(sum);
    *alpha = a;
  }

  // o = acc / l and lse = (m + log2 l) ln 2 for a row that sees `visible` keys (see
  // blocked's finish_row).
  static void finish_row(const float* acc, float m, float l, float sink, std::int64_t visible,
                         std::int64_t dim, float* o, float* lse) {
    const mha::RowEnd end = mha::support::row_end_base2(m, l, sink);
    // A division: one rounding, as the tolerance assumes.
    const __m256 lv = _mm256_set1_ps(end.divisor);
    for (std::int64_t d = 0; d < dim; d += 8) {
      const __m256 x =
          visible == 0 ? _mm256_setzero_ps() : _mm256_div_ps(_mm256_loadu_ps(acc + d), lv);
      if (dim - d >= 8) {
        _mm256_storeu_ps(o + d, x);
      } else {
        _mm256_maskstore_ps(o + d, first_lanes(dim - d), x);
      }
    }
    if (lse == nullptr) return;
    *lse = visible == 0 ? sink : end.lse;
  }

  // ---- Decode (see "Decode" above) ----------------------------------------------------

  static constexpr std::int64_t kDotKeys = 8;     // keys per dot_keys call
  static constexpr std::int64_t kPvColumns = 64;  // head_dim columns per add_weighted_rows call
  static constexpr std::int64_t decode_step() { return kDotKeys; }

  // Lane i: q . k_i (i < NK; lanes from NK on are 0) for the key rows k_i = k + i k_seq,
  // over head_dim = dim: decode's S step. Full slices of 32 columns keep 4 vectors of q in
  // registers against 8 accumulators; the last partial slice loads its last vector masked.
  template <int NK>
  static __m256 dot_keys(const float* q, const float* k, std::int64_t k_seq, std::int64_t dim) {
    __m256 a[8];
#pragma GCC unroll 8
    for (__m256& x : a) x = _mm256_setzero_ps();
    std::int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32) {
      __m256 qv[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) qv[c] = _mm256_loadu_ps(q + d0 + 8 * c);
#pragma GCC unroll 8
      for (int i = 0; i < NK; ++i) {
        const float* key = k + i * k_seq + d0;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          a[i] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(key + 8 * c), a[i]);
      }
    }
    // The last 1 .. 31 columns, a vector at a time: whole vectors by plain loads, the last
    // partial one masked (all masked, the D = 16 decode, which is all tail, ran 6.0-6.5 ns per
    // row and key on a Zen 3 core instead of 5.7-6.1; VMASKMOVPS loads are slow on Zen).
    for (; d0 + 8 <= dim; d0 += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d0);
#pragma GCC unroll 8
      for (int i = 0; i < NK; ++i) {
        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * k_seq + d0), a[i]);
      }
    }
    if (d0 < dim) {
      const __m256i mask = first_lanes(dim - d0);
      const __m256 qv = _mm256_maskload_ps(q + d0, mask);
#pragma GCC unroll 8
      for (int i = 0; i < NK; ++i) {
        a[i] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k + i * k_seq + d0, mask), a[i]);
      }
    }
    return sum_lanes8(a);
  }

  // acc = alpha acc + sum_{j < cols} w[j] v_j over NV vectors (the last one's lanes limited to
  // `last` of them) of the rows v_j = v + j v_seq: decode's P V step for one row.
  template <int NV>
  static void add_weighted_rows(const float* w, std::int64_t cols, const float* v,
                                std::int64_t v_seq, std::int64_t last, float* acc, float alpha) {
    const __m256i last_mask = first_lanes(last);
    const __m256 av = _mm256_set1_ps(alpha);
    __m256 o[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), av);
    for (std::int64_t j = 0; j < cols; ++j) {
      const __m256 wj = _mm256_broadcast_ss(w + j);
      const float* row = v + j * v_seq;
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        const __m256 x = c + 1 == NV && last < 8 ? _mm256_maskload_ps(row + 8 * c, last_mask)
                                                 : _mm256_loadu_ps(row + 8 * c);
        o[c] = _mm256_fmadd_ps(wj, x, o[c]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + 8 * c, o[c]);
  }

  // Base-2 logits of the row's `cols` keys, 8 at a time: key i's dot product in a[i], over
  // slices of 32 columns of head_dim whose q part stays in registers.
  template <class Step>
  static MHA_ALWAYS_INLINE float decode_logits(const float* q, const float* k, std::int64_t k_seq,
                                               std::int64_t cols, std::int64_t dim, float c,
                                               float* w, const Step& after_step) {
    const __m256 logit_scale = _mm256_set1_ps(c);
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (std::int64_t j0 = 0; j0 < cols; j0 += kDotKeys) {
      const std::int64_t nk = std::min(kDotKeys, cols - j0);
      const float* key0 = k + j0 * k_seq;
      __m256 dots;
      mha::support::with_count<kDotKeys>(
          nk, [&](auto count) { dots = dot_keys<decltype(count)::value>(q, key0, k_seq, dim); });
      after_step();
      const __m256 x = _mm256_mul_ps(dots, logit_scale);
      _mm256_storeu_ps(w + j0, x);
      // Lanes past nk keep mv; VMAXPS returns its second source (mv) for a NaN x.
      mv = _mm256_blendv_ps(mv, _mm256_max_ps(x, mv), _mm256_castsi256_ps(first_lanes(nk)));
    }
    return horizontal_max(mv);  // no lane of mv is NaN
  }

  static MHA_ALWAYS_INLINE float decode_weights(float* w, std::int64_t cols, float shift) {
    const __m256 base = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps();
    for (std::int64_t j0 = 0; j0 < cols; j0 += kDotKeys) {
      const __m256 x = mha::avx2::exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(w + j0), base));
      const __m256 e = _mm256_and_ps(x, _mm256_castsi256_ps(first_lanes(cols - j0)));
      _mm256_storeu_ps(w + j0, e);
      sum = _mm256_add_ps(sum, e);
    }
    return horizontal_sum(sum);
  }

  // O = alpha O + P V over the row's keys, 64 columns of head_dim at a time.
  static MHA_ALWAYS_INLINE void decode_pv(const float* w, std::int64_t cols, const float* v,
                                          std::int64_t v_seq, std::int64_t dim, float* acc,
                                          float alpha) {
    for (std::int64_t d0 = 0; d0 < dim; d0 += kPvColumns) {
      const std::int64_t n = std::min(kPvColumns, dim - d0);
      mha::support::with_count<kPvColumns / 8>((n + 7) / 8, [&](auto vectors) {
        constexpr int kVectors = decltype(vectors)::value;
        add_weighted_rows<kVectors>(w, cols, v + d0, v_seq, n - 8 * (kVectors - 1), acc + d0,
                                    alpha);
      });
    }
  }

  // ---- Decode over K and V of a reduced type (tiled_loops.h: decode_rows_kv) ----------
  // The steps above with each element converted as it is loaded, so that the cache is read
  // once, in its own type, and nothing is written back: f16 by F16C (VCVTPH2PS), bf16 by a
  // 16-bit shift, i8 by sign extension and VCVTDQ2PS. An i8 row's scale multiplies the
  // key's finished logit (c q.k_j s_j) and the row's weight (w_j s_j): one rounding each,
  // as the tolerance's step 6 allows. Rows `seq` elements apart, scales `scale_seq` apart.

  // 8 elements from element i of a row of type T, as floats.
  template <mha::KvType T>
  static __m256 load_kv(const void* row, std::int64_t i) {
    if constexpr (T == mha::KvType::f16) {
      const auto* x = static_cast<const std::uint16_t*>(row) + i;
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    } else if constexpr (T == mha::KvType::bf16) {
      const auto* x = static_cast<const std::uint16_t*>(row) + i;
      const __m256i wide =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    } else {
      static_assert(T == mha::KvType::i8);
      const auto* x = static_cast<const std::int8_t*>(row) + i;
      return _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
    }
  }

  // n elements (1 .. 8) from element i, lanes past n 0; memory past them is not touched.
  template <mha::KvType T>
  static __m256 load_kv_part(const void* row, std::int64_t i, std::int64_t n) {
    if (n >= 8) return load_kv<T>(row, i);
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    alignas(16) unsigned char buf[16] = {};
    std::memcpy(buf, static_cast<const unsigned char*>(row) + i * kBytes,
                static_cast<std::size_t>(n * kBytes));
    return load_kv<T>(buf, 0);
  }

  // dot_keys over key rows of type T.
  template <int NK, mha::KvType T>
  static __m256 dot_keys_kv(const float* q, const void* k, std::int64_t k_seq, std::int64_t dim) {
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const auto* kb = static_cast<const unsigned char*>(k);
    __m256 a[8];
#pragma GCC unroll 8
    for (__m256& x : a) x = _mm256_setzero_ps();
    std::int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32) {
      __m256 qv[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) qv[c] = _mm256_loadu_ps(q + d0 + 8 * c);
#pragma GCC unroll 8
      for (int i = 0; i < NK; ++i) {
        const unsigned char* key = kb + i * k_seq * kBytes;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          a[i] = _mm256_fmadd_ps(qv[c], load_kv<T>(key, d0 + 8 * c), a[i]);
      }
    }
    for (; d0 < dim; d0 += 8) {
      const __m256 qv = load_part(q + d0, dim - d0);
#pragma GCC unroll 8
      for (int i = 0; i < NK; ++i) {
        a[i] = _mm256_fmadd_ps(qv, load_kv_part<T>(kb + i * k_seq * kBytes, d0, dim - d0), a[i]);
      }
    }
    return sum_lanes8(a);
  }

  // add_weighted_rows over value rows of type T.
  template <int NV, mha::KvType T>
  static void add_weighted_rows_kv(const float* w, std::int64_t cols, const void* v,
                                   std::int64_t v_seq, std::int64_t last, float* acc, float alpha) {
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const auto* vb = static_cast<const unsigned char*>(v);
    const __m256 av = _mm256_set1_ps(alpha);
    __m256 o[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), av);
    for (std::int64_t j = 0; j < cols; ++j) {
      const __m256 wj = _mm256_broadcast_ss(w + j);
      const unsigned char* row = vb + j * v_seq * kBytes;
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        const __m256 x =
            c + 1 == NV && last < 8 ? load_kv_part<T>(row, 8 * c, last) : load_kv<T>(row, 8 * c);
        o[c] = _mm256_fmadd_ps(wj, x, o[c]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + 8 * c, o[c]);
  }

  // decode_logits over K of type T (k: the tile's first row; k_scale: its scale, i8 only).
  template <mha::KvType T, class Step>
  static MHA_ALWAYS_INLINE float decode_logits_kv(const float* q, const void* k, std::int64_t k_seq,
                                                  const float* k_scale, std::int64_t k_scale_seq,
                                                  std::int64_t cols, std::int64_t dim, float c,
                                                  float* w, const Step& after_step) {
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const __m256 logit_scale = _mm256_set1_ps(c);
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (std::int64_t j0 = 0; j0 < cols; j0 += kDotKeys) {
      const std::int64_t nk = std::min(kDotKeys, cols - j0);
      const void* key0 = static_cast<const unsigned char*>(k) + j0 * k_seq * kBytes;
      __m256 dots;
      mha::support::with_count<kDotKeys>(nk, [&](auto count) {
        dots = dot_keys_kv<decltype(count)::value, T>(q, key0, k_seq, dim);
      });
      after_step();
      __m256 x = _mm256_mul_ps(dots, logit_scale);
      if constexpr (T == mha::KvType::i8) {
        alignas(32) float s[8] = {};
        for (std::int64_t i = 0; i < nk; ++i) s[i] = k_scale[(j0 + i) * k_scale_seq];
        x = _mm256_mul_ps(x, _mm256_load_ps(s));
      }
      _mm256_storeu_ps(w + j0, x);
      mv = _mm256_blendv_ps(mv, _mm256_max_ps(x, mv), _mm256_castsi256_ps(first_lanes(nk)));
    }
    return horizontal_max(mv);
  }

  // decode_pv over V of type T (i8: w[j] becomes w[j] s_j first).
  static MHA_ALWAYS_INLINE void scale_weights(float* w, std::int64_t cols, const float* v_scale,
                                              std::int64_t v_scale_seq) {
    for (std::int64_t j = 0; j < cols; ++j) w[j] *= v_scale[j * v_scale_seq];
  }
  template <mha::KvType T>
  static MHA_ALWAYS_INLINE void decode_pv_kv(float* w, std::int64_t cols, const void* v,
                                             std::int64_t v_seq, const float* v_scale,
                                             std::int64_t v_scale_seq, std::int64_t dim, float* acc,
                                             float alpha) {
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    if constexpr (T == mha::KvType::i8) scale_weights(w, cols, v_scale, v_scale_seq);
    for (std::int64_t d0 = 0; d0 < dim; d0 += kPvColumns) {
      const std::int64_t n = std::min(kPvColumns, dim - d0);
      mha::support::with_count<kPvColumns / 8>((n + 7) / 8, [&](auto vectors) {
        constexpr int kVectors = decltype(vectors)::value;
        add_weighted_rows_kv<kVectors, T>(w, cols,
                                          static_cast<const unsigned char*>(v) + d0 * kBytes, v_seq,
                                          n - 8 * (kVectors - 1), acc + d0, alpha);
      });
    }
  }

  // ---- Decode in row groups over a reduced type (tiled_loops.h: decode_rows_kv) -------
  // The query heads of a KV head at one query position see the same keys: in groups of R = 4
  // or 2 rows each K and V vector is loaded and converted once for the R rows instead of once
  // per row. S keeps R rows x 8 / R keys in the 8 accumulators sum_lanes8 finishes, P V
  // R rows x 8 / R vectors of head_dim (registers: 8 accumulators, R q vectors or weights,
  // one K or V vector). Only for a reduced type: fp32 decode converts nothing, and fp32 row
  // blocks measured slower from DRAM (the note under "Decode" above).
  static constexpr int kDecodeGroup = 4;  // rows per group at most

  // Lane r (8 / R) + i: q_r . k_i for r < R and the NK <= 8 / R key rows k_i = k + i k_seq
  // of type T (lanes of keys from NK on are 0), over head_dim = dim.
  template <int R, int NK, mha::KvType T>
  static __m256 dot_keys_group_kv(const float* const (&q)[R], const void* k, std::int64_t k_seq,
                                  std::int64_t dim) {
    constexpr int kGroupKeys = 8 / R;
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const auto* kb = static_cast<const unsigned char*>(k);
    __m256 a[8];
#pragma GCC unroll 8
    for (__m256& x : a) x = _mm256_setzero_ps();
    std::int64_t d0 = 0;
    for (; d0 + 8 <= dim; d0 += 8) {
      __m256 qv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q[r] + d0);
#pragma GCC unroll 4
      for (int i = 0; i < NK; ++i) {
        const __m256 x = load_kv<T>(kb + i * k_seq * kBytes, d0);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          a[r * kGroupKeys + i] = _mm256_fmadd_ps(qv[r], x, a[r * kGroupKeys + i]);
        }
      }
    }
    if (d0 < dim) {
      __m256 qv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) qv[r] = load_part(q[r] + d0, dim - d0);
#pragma GCC unroll 4
      for (int i = 0; i < NK; ++i) {
        const __m256 x = load_kv_part<T>(kb + i * k_seq * kBytes, d0, dim - d0);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          a[r * kGroupKeys + i] = _mm256_fmadd_ps(qv[r], x, a[r * kGroupKeys + i]);
        }
      }
    }
    return sum_lanes8(a);
  }

  // decode_logits_kv for the R rows q[r]: row r's logits to w + r ldw (lanes up to 7 past
  // cols may be written; ldw >= cols + 7), its maximum ignoring NaN to max[r]; after_step()
  // once per 8 / R keys.
  template <int R, mha::KvType T, class Step>
  static MHA_ALWAYS_INLINE void decode_logits_group_kv(const float* const (&q)[R], const void* k,
                                                       std::int64_t k_seq, const float* k_scale,
                                                       std::int64_t k_scale_seq, std::int64_t cols,
                                                       std::int64_t dim, float c, float* w,
                                                       std::int64_t ldw, float (&max)[R],
                                                       const Step& after_step) {
    constexpr int kGroupKeys = 8 / R;
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const __m256 logit_scale = _mm256_set1_ps(c);
    __m256 mv[R];
    for (__m256& m : mv) m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (std::int64_t j0 = 0; j0 < cols; j0 += kGroupKeys) {
      const std::int64_t nk = std::min<std::int64_t>(kGroupKeys, cols - j0);
      const void* key0 = static_cast<const unsigned char*>(k) + j0 * k_seq * kBytes;
      __m256 dots;
      mha::support::with_count<kGroupKeys>(nk, [&](auto count) {
        dots = dot_keys_group_kv<R, decltype(count)::value, T>(q, key0, k_seq, dim);
      });
      after_step();
      __m256 x = _mm256_mul_ps(dots, logit_scale);
      if constexpr (T == mha::KvType::i8) {
        alignas(32) float scale[8] = {};
        for (std::int64_t i = 0; i < nk; ++i) {
          for (int r = 0; r < R; ++r) scale[r * kGroupKeys + i] = k_scale[(j0 + i) * k_scale_seq];
        }
        x = _mm256_mul_ps(x, _mm256_load_ps(scale));
      }
      const __m256 valid = _mm256_castsi256_ps(first_lanes(nk));
      for (int r = 0; r < R; ++r) {
        // Row r's logits into lanes 0 .. nk - 1, stored whole: the next step's keys or the
        // row's last 8 floats take the others.
        const __m256 xr = _mm256_permutevar8x32_ps(
            x, _mm256_add_epi32(_mm256_set1_epi32(r * kGroupKeys),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        _mm256_storeu_ps(w + r * ldw + j0, xr);
        mv[r] = _mm256_blendv_ps(mv[r], _mm256_max_ps(xr, mv[r]), valid);
      }
    }
    for (int r = 0; r < R; ++r) max[r] = horizontal_max(mv[r]);  // no lane of mv is NaN
  }

  // acc[r] = alpha[r] acc[r] + sum_{j < cols} w[r][j] v_j for r < R, over NV vectors (the last
  // one's lanes limited to `last` of them) of the rows v_j = v + j v_seq of type T.
  template <int R, int NV, mha::KvType T>
  static void add_weighted_rows_group_kv(const float* const (&w)[R], std::int64_t cols,
                                         const void* v, std::int64_t v_seq, std::int64_t last,
                                         float* const (&acc)[R], const float (&alpha)[R]) {
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    const auto* vb = static_cast<const unsigned char*>(v);
    __m256 o[R][NV];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) o[r][c] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + 8 * c), a);
    }
    for (std::int64_t j = 0; j < cols; ++j) {
      __m256 wj[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) wj[r] = _mm256_broadcast_ss(w[r] + j);
      const unsigned char* row = vb + j * v_seq * kBytes;
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) {
        const __m256 x =
            c + 1 == NV && last < 8 ? load_kv_part<T>(row, 8 * c, last) : load_kv<T>(row, 8 * c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) o[r][c] = _mm256_fmadd_ps(wj[r], x, o[r][c]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc[r] + 8 * c, o[r][c]);
    }
  }

  // decode_pv_kv for the R rows: weights w + r ldw, accumulators acc + r acc_stride (i8: w[r][j]
  // becomes w[r][j] s_j first).
  template <int R, mha::KvType T>
  static MHA_ALWAYS_INLINE void decode_pv_group_kv(float* w, std::int64_t ldw, std::int64_t cols,
                                                   const void* v, std::int64_t v_seq,
                                                   const float* v_scale, std::int64_t v_scale_seq,
                                                   std::int64_t dim, float* acc,
                                                   std::int64_t acc_stride,
                                                   const float (&alpha)[R]) {
    constexpr auto kBytes = static_cast<std::int64_t>(mha::kv_type_bytes(T));
    constexpr int kVectors = 8 / R;
    if constexpr (T == mha::KvType::i8) {
      for (int r = 0; r < R; ++r) scale_weights(w + r * ldw, cols, v_scale, v_scale_seq);
    }
    const float* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = w + r * ldw;
    for (std::int64_t d0 = 0; d0 < dim; d0 += 8 * kVectors) {
      const std::int64_t n = std::min<std::int64_t>(8 * kVectors, dim - d0);
      float* out[R];
      for (int r = 0; r < R; ++r) out[r] = acc + r * acc_stride + d0;
      mha::support::with_count<kVectors>((n + 7) / 8, [&](auto vectors) {
        constexpr int kCount = decltype(vectors)::value;
        add_weighted_rows_group_kv<R, kCount, T>(rows, cols,
                                                 static_cast<const unsigned char*>(v) + d0 * kBytes,
                                                 v_seq, n - 8 * (kCount - 1), out, alpha);
      });
    }
  }
};

using Loops = tiled::Loops<Avx2>;

}  // namespace

std::size_t mha_f32_attention_avx2_workspace(const mha::Problem& p) { return Loops::workspace(p); }

void mha_f32_attention_avx2(const mha::Problem& call, const float* q, mha::KvView k, mha::KvView v,
                            float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(call))
    return mha::each_sequence(mha_f32_attention_avx2, call, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;
  // ALiBi's reach (support::AlibiReach): a sliding window past which no key weighs in.
  const mha::Problem p = mha::support::AlibiReach::apply(call, q, k, v);
  Loops::run(p, q, k, v, o, lse, ws);
}

MHA_TARGET_END

// xsimd_kernel.h: multi-head attention with flash-attention tiling and a base-2 online
// softmax, in fp32, written once over xsimd::batch<float, Arch> and instantiated per
// architecture by xsimd_avx2.cpp (fma3<avx2>), xsimd_avx512.cpp (avx512f) and
// xsimd_neon.cpp (neon64), each compiled with its ISA's flags (see "The ISA" below). The algorithm
// and layout of kernels/avx2/avx2.cpp (read that file first), with the vector width
// W = batch::size a template parameter instead of 8:
//
//   for each (batch, KV head, block of R = g x Br query rows; all g heads share every KV
//            tile):                                                      for_each_block
//     pack Q: each group of MR rows into Qp[d][MR]; m, l, O empty        start_block
//     for each KV tile of Bc = 128 keys some row of the block sees (causal: later tiles
//              are skipped):
//       pack K^T into panels Kp[panel][d][2W]                            pack_k
//       S = scale log2(e) Q K^T    microkernel MR rows x 2W keys         tile_logits
//       online softmax in base 2 per row (exp2 below)                    tile_softmax
//       pack V into column panels Vp[panel][key][2W]                     pack_v
//       O = alpha O + P V          microkernel MR rows x 2W columns      tile_pv
//     o = O / l, lse = (m + log2 l) ln2                                  finish_block
//
// Decode (fewer than 16 rows g x q_len per KV head): lanes along head_dim, K and V read in
// place, W keys' dot products finished together by xsimd::haddp (decode_rows).
//
// The loops are mha/tiled_loops.h's, shared with avx2 and highway; Attention<Arch> is their
// policy (the pieces above marked with a phase's name are its members) and its entry points.
//
// Register tiles: MR rows x 2 vectors of accumulators, a broadcast per row and two loads of
// the streamed panel per step. MR = 6 on 16-register ISAs (AVX2: 12 of 16 registers hold
// accumulators, 12 FMA chains for 2 ports x 4 cycles), 12 on 32-register ones (AVX-512,
// AArch64: 24 of 32). xsimd has no multiply by lane, so on AArch64 each row's broadcast is
// its own load (LD1R) where the hand-written neon kernel takes 4 rows from one load
// (FMLA by element).
//
// What xsimd 8.1 does not give, and what this file does instead:
//   * Masked loads and stores: a row's last partial vector goes through a W-float buffer
//     on the stack (load_part, store_part), so tensor memory is touched only at its
//     elements. D = 128 and other multiples of 2W never take that path.
//   * Prefetch: __builtin_prefetch (GCC and Clang), locality 2 = into L2 on x86-64.
//   * A 2^x of known error: its exp2 is neither declared within 1 ulp nor flushes the way
//     the tolerance expects, so exp2_nonpositive below is avx2_exp.h's algorithm in xsimd
//     operations (the same floats on every architecture; measured in
//     property_tests/xsimd_exp_test.cpp).
//   * Lane-wise maximum of a vector: a loop over the stored lanes (once per row and tile).
//   * A fused multiply-add on avx512f (8.1 has none there; fused() calls the intrinsic).
//
// Everything else (tile sizes from the caches, causal masking, NaN and Inf rules, tails of
// any key count, row count and head_dim, workspace layout, prefetch of the next tile) is
// avx2.cpp's, with the same reasons and the same contract (mha/attention.h).
//
// Depends on mha/attention.h, mha/support.h, mha/tiled_loops.h and xsimd (Debian's
// libxsimd-dev, header-only) only.
//
// The ISA. xsimd 8 takes its architectures from the compiler's ISA macros (__AVX2__ and the
// others), so the file that instantiates this header is compiled with its ISA's flags
// (xsimd_avx2.cpp with -mavx2 -mfma -mf16c; cmake/isa.cmake). But a file compiled with -mavx2
// makes AVX2 code of every inline function of the standard library and of mha/support.h
// that it uses out of line, and the linker may keep that copy for every other caller: SIGILL
// on an older CPU (cmake/check_isa_symbols.cmake). So on x86-64 this header includes all of
// them first, inside a region compiled for baseline x86-64 (target "no-sse3": SSE2 and
// nothing above it), and only then xsimd. Their copies are then the baseline code everyone
// else's are, and can still be inlined into this file's AVX2 code. What is compiled for the
// ISA is xsimd's code, the members of Attention<Arch> and the loops of mha/tiled_loops.h
// instantiated for it, whose names differ per architecture. A file that includes this
// header includes it first, and any other header with inline functions inside a baseline
// region of its own (MHA_XSIMD_BASELINE_BEGIN), but not the declarations of functions it
// defines: GCC gives a function declared in the region the region's target, even where its
// definition is outside.
//
// The kernels written with intrinsics do the opposite: no flags, and a target region around
// their own code (MHA_TARGET_BEGIN). Not here: xsimd's arithmetic operators are hidden
// friends of batch, which GCC compiles for the file's flags, not the region's, and then
// calls with the baseline convention for vector arguments.
#pragma once

// MHA_XSIMD_BASELINE_BEGIN ... _END: a region compiled for baseline x86-64, for includes.
#if defined(__x86_64__) && defined(__clang__)
#define MHA_XSIMD_BASELINE_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"no-sse3\"))), apply_to = function)")
#define MHA_XSIMD_BASELINE_END _Pragma("clang attribute pop")
#elif defined(__x86_64__) && defined(__GNUC__)
#define MHA_XSIMD_BASELINE_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"no-sse3\")")
#define MHA_XSIMD_BASELINE_END _Pragma("GCC pop_options")
#else
#define MHA_XSIMD_BASELINE_BEGIN
#define MHA_XSIMD_BASELINE_END
#endif

MHA_XSIMD_BASELINE_BEGIN
// Everything xsimd and this file include but xsimd itself and the intrinsics headers.
#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <complex>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

#include "mha/attention.h"
#include "mha/support.h"
MHA_XSIMD_BASELINE_END

// GCC 12 reports its own _mm512_undefined_ps (avx512fintrin.h) as "used uninitialized" when
// it is inlined from xsimd's AVX-512 haddp into this file; the value is a don't-care operand
// by design.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <xsimd/xsimd.hpp>

namespace mha::xsimd_kernel {

#include "mha/tiled_loops.h"  // the loops: inside this namespace, after xsimd (see above)

// The policy of mha/tiled_loops.h for one xsimd architecture, and its entry points.
template <class Arch>
struct Attention {
  using Batch = xsimd::batch<float, Arch>;
  using Ints = xsimd::batch<std::int32_t, Arch>;
  using Block = mha::support::Block;
  using Carve = mha::support::Carve;
  using RowPrefetch = mha::support::RowPrefetch;

  static constexpr int kWidth = static_cast<int>(Batch::size);  // W: floats per vector
  static constexpr int kPanel = 2 * kWidth;  // keys per K panel = columns per V panel
  // MR: query rows per microkernel group; 32 vector registers on AVX-512 and AArch64.
  static constexpr int kRows = kWidth == 8 ? 6 : 12;
  static constexpr bool kWholeGroups = false;          // microkernels for 1 .. MR rows
  static constexpr std::int64_t kKeys = tiled::kKeys;  // Bc: keys per KV tile, S's row stride
  static constexpr std::int64_t kDotKeys = kWidth;     // keys per dot_keys call (one haddp)
  static constexpr bool kKvDecode = false;             // reduced K, V: the loops widen each tile
  static constexpr int kDecodeGroup = 1;               // one decode row at a time
  static constexpr int kDotVectors = 4;                // q vectors in registers in dot_keys
  static constexpr int kPvVectors = 8;                 // O vectors per add_weighted_rows call
  static_assert(kKeys % kPanel == 0 && kWidth <= 64);

  static constexpr std::int64_t lanes() { return kWidth; }
  static constexpr std::int64_t panel() { return kPanel; }
  static constexpr std::int64_t decode_step() { return kDotKeys; }

  static float neg_inf() { return -std::numeric_limits<float>::infinity(); }

  // a b + c with one rounding. xsimd 8.1 has no fma for avx512f: there xsimd::fma is
  // a * b + c, fused only where the compiler contracts it (GCC 12 did at -O3, not at -O2
  // under the sanitizers, where the exp test measured 1.11 ulp instead of 0.91).
  static Batch fused(const Batch& a, const Batch& b, const Batch& c) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<Arch, xsimd::avx512f>) return Batch(_mm512_fmadd_ps(a, b, c));
#endif
    return xsimd::fma(a, b, c);
  }

  // Lanes [0, n) of a vector (none for n <= 0, all for n >= W), as a float lane mask.
  static xsimd::batch_bool<float, Arch> first_lanes(std::int64_t n) {
    alignas(64) static constexpr float kIota[64] = {
        0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
        22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
        44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
    const float c = static_cast<float>(std::clamp<std::int64_t>(n, 0, kWidth));
    return Batch::load_aligned(kIota) < Batch(c);
  }

  // n floats (n >= 1) of a tensor row; lanes past n are 0 and their memory is not touched.
  static Batch load_part(const float* x, std::int64_t n) {
    if (n >= kWidth) return Batch::load_unaligned(x);
    alignas(64) float buf[kWidth] = {};
    std::copy(x, x + n, buf);
    return Batch::load_aligned(buf);
  }
  // Stores lanes [0, n) of x (n >= 1) and touches no other element.
  static void store_part(float* out, std::int64_t n, const Batch& x) {
    if (n >= kWidth) {
      x.store_unaligned(out);
      return;
    }
    alignas(64) float buf[kWidth];
    x.store_aligned(buf);
    std::copy(buf, buf + n, out);
  }

  static float max_lanes(const Batch& x) {
    alignas(64) float lanes[kWidth];
    x.store_aligned(lanes);
    float m = lanes[0];
    for (int i = 1; i < kWidth; ++i) m = std::max(m, lanes[i]);
    return m;
  }

  // 2^x for x <= 0, -inf or NaN: avx2_exp.h's algorithm (its header gives the derivation).
  // 2^n 2^f with n = round(x), f = x - n exact; 2^f by a degree-7 Taylor polynomial; 2^n
  // built in the exponent field by one addition of 1.5 2^23 + 127 and a shift; x clamped to
  // -127, so results below 2^-126.5 flush to +0. -inf gives 0, NaN stays NaN (the clamp is
  // a select on x < -127, false for NaN).
  static Batch exp2_nonpositive(Batch x) {
    const Batch shifter(12583039.0f);  // 1.5 2^23 + 127
    x = xsimd::select(x < Batch(-127.0f), Batch(-127.0f), x);
    const Batch t = x + shifter;            // 1.5 2^23 + n + 127, n = round(x)
    const Batch f = x - (t - shifter);      // both exact
    Batch p(mha::support::kExp2Taylor[0]);  // ln2^k / k! for k = 7 .. 0
#pragma GCC unroll 8
    for (int k = 1; k < 8; ++k) p = fused(p, f, Batch(mha::support::kExp2Taylor[k]));
    const Ints field = xsimd::bitwise_cast<Ints>(t) << 23;  // 2^n, or +0 for n = -127
    return p * xsimd::bitwise_cast<Batch>(field);
  }

  // ---- Packing ----------------------------------------------------------------------

  // kp[panel][d][i] = k[2W panel + i][d], 0 for keys >= keys, over round_up(keys, 2W) keys.
  // A key row at a time, each element stored at its place in the panel: the tile's K is
  // read once per block of R rows, and this loop is a few percent of the S product's time
  // at R = 6 (the smallest prefill block) and well below 1% at R >= 128.
  static void pack_k(const float* k, std::int64_t k_seq, std::int64_t keys, std::int64_t dim,
                     float* kp) {
    const std::int64_t padded = mha::support::round_up(keys, kPanel);
    for (std::int64_t j = 0; j < padded; ++j) {
      float* column = kp + (j / kPanel) * dim * kPanel + j % kPanel;
      if (j >= keys) {
        for (std::int64_t d = 0; d < dim; ++d) column[d * kPanel] = 0.0f;
        continue;
      }
      const float* row = k + j * k_seq;
      for (std::int64_t d = 0; d < dim; ++d) column[d * kPanel] = row[d];
    }
  }

  // vp[panel][j][c] = v[j][2W panel + c], 0 for columns >= dim.
  static void pack_v(const float* v, std::int64_t v_seq, std::int64_t keys, std::int64_t dim,
                     float* vp) {
    const std::int64_t padded = mha::support::round_up(dim, kPanel);
    for (std::int64_t j = 0; j < keys; ++j) {
      const float* row = v + j * v_seq;
      for (std::int64_t c = 0; c < padded; c += kWidth) {
        const Batch x = c < dim ? load_part(row + c, dim - c) : Batch(0.0f);
        x.store_aligned(vp + (c / kPanel) * kKeys * kPanel + j * kPanel + c % kPanel);
      }
    }
  }

  // qp[d][r] = q[r][d] for r < nr, 0 for nr <= r < MR.
  static void pack_q(const float* const* q, int nr, std::int64_t dim, float* qp) {
    for (std::int64_t d = 0; d < dim; ++d) {
      for (int r = 0; r < kRows; ++r) qp[d * kRows + r] = r < nr ? q[r][d] : 0.0f;
    }
  }

  // ---- Microkernels -------------------------------------------------------------------

  // acc[r] += a[r * kStride] * b[0 .. 2W) for r < MR: one step of both microkernels.
  template <int MR, std::int64_t kStride>
  static void rank1_update(Batch (&acc)[MR][2], const float* a, const float* b) {
    const Batch b0 = Batch::load_aligned(b);
    const Batch b1 = Batch::load_aligned(b + kWidth);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const Batch ar(a[r * kStride]);
      acc[r][0] = fused(ar, b0, acc[r][0]);
      acc[r][1] = fused(ar, b1, acc[r][1]);
    }
  }

  // The S microkernel: s[r][0 .. 2W) = c sum_d qp[d][r] kp[d][0 .. 2W) for r < MR, with
  // lanes >= limit[r] set to -inf (keys row r does not see); rowmax[r] (W lanes) takes the
  // lane-wise max, ignoring NaN logits (the select keeps the max where x > max is false).
  template <int MR>
  static void logits_tile(const float* qp, const float* kp, std::int64_t dim, float c,
                          const std::int64_t* limit, float* s, float* rowmax) {
    Batch acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = Batch(0.0f);
    for (std::int64_t d = 0; d < dim; ++d) {
      rank1_update<MR, 1>(acc, qp + d * kRows, kp + d * kPanel);
    }
    const Batch cv(c), minus_inf(neg_inf());
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      Batch x0 = acc[r][0] * cv, x1 = acc[r][1] * cv;
      if (limit[r] < kPanel) {
        x0 = xsimd::select(first_lanes(limit[r]), x0, minus_inf);
        x1 = xsimd::select(first_lanes(limit[r] - kWidth), x1, minus_inf);
      }
      x0.store_aligned(s + r * kKeys);
      x1.store_aligned(s + r * kKeys + kWidth);
      Batch m = Batch::load_aligned(rowmax + kWidth * r);
      m = xsimd::select(x0 > m, x0, m);
      m = xsimd::select(x1 > m, x1, m);
      m.store_aligned(rowmax + kWidth * r);
    }
  }

  // The PV microkernel: o[r][0 .. 2W) = alpha[r] o[r][0 .. 2W) + sum_{j < keys} p[r][j]
  // vp[j][0 .. 2W) for r < MR; alpha null: no rescale.
  template <int MR>
  static void pv_tile(const float* p, std::int64_t keys, const float* vp, const float* alpha,
                      float* o, std::int64_t ld_o) {
    Batch acc[MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = Batch::load_aligned(o + r * ld_o);
      acc[r][1] = Batch::load_aligned(o + r * ld_o + kWidth);
      if (alpha != nullptr) {
        const Batch a(alpha[r]);
        acc[r][0] *= a;
        acc[r][1] *= a;
      }
    }
    for (std::int64_t j = 0; j < keys; ++j) {
      rank1_update<MR, kKeys>(acc, p + j, vp + j * kPanel);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      acc[r][0].store_aligned(o + r * ld_o);
      acc[r][1].store_aligned(o + r * ld_o + kWidth);
    }
  }

  // One row's base-2 online-softmax step over its `cols` (>= 1) logits of this tile: s
  // becomes 2^(s - m_new); lanes up to the next multiple of 2W are -inf and become 0.
  static void online_softmax(float* s, std::int64_t cols, const float* rowmax, float* m, float* l,
                             float* alpha) {
    const float m_old = *m;
    const float tile_max = max_lanes(Batch::load_aligned(rowmax));  // no lane is NaN
    float a = 1.0f;
    if (tile_max > m_old) {
      a = std::exp2(m_old - tile_max);  // exactly 0 when m_old is -inf
      *m = tile_max;
    }
    const Batch base(mha::support::logit_shift(*m));
    Batch sum(0.0f);
    for (std::int64_t j = 0; j < cols; j += kWidth) {
      const Batch w = exp2_nonpositive(Batch::load_aligned(s + j) - base);
      w.store_aligned(s + j);
      sum += w;
    }
    *l = *l * a + xsimd::hadd(sum);
    *alpha = a;
  }

  // o = acc / l and lse = (m + log2 l) ln 2 for a row that sees `visible` keys (see
  // blocked's finish_row).
  static void finish_row(const float* acc, float m, float l, float sink, std::int64_t visible,
                         std::int64_t dim, float* o, float* lse) {
    const mha::RowEnd end = mha::support::row_end_base2(m, l, sink);
    const Batch lv(end.divisor);  // a division: one rounding, as the tolerance assumes
    for (std::int64_t d = 0; d < dim; d += kWidth) {
      const Batch x = visible == 0 ? Batch(0.0f) : Batch::load_aligned(acc + d) / lv;
      store_part(o + d, dim - d, x);
    }
    if (lse == nullptr) return;
    *lse = visible == 0 ? sink : end.lse;
  }

  // ---- Decode -------------------------------------------------------------------------
  // avx2.cpp's decode_rows (its comment gives the measurements): per row, W keys' dot
  // products accumulate in W vectors over slices of 4 q vectors kept in registers and are
  // finished by one haddp; P V adds weight x V row into the row's accumulator, 8 vectors at
  // a time. Tiles of decode_tile_keys keys, the next tile prefetched into L2 a few rows per
  // dot_keys call.

  // xsimd 8's haddp for avx512f returns lane i of the sums in lane pi(i), pi swapping lanes
  // 2, 3 with 4, 5 in each half (it gives 0 1 4 5 2 3 6 7 8 9 12 13 10 11 14 15): dot_keys
  // keeps key i's accumulator in slot pi(i) (an involution), so the lanes come out in order.
  // The property tests fail if a version differs.
  static constexpr bool kHaddpSwapsLanes =
      std::is_same_v<Arch, xsimd::avx512f> && XSIMD_VERSION_MAJOR == 8;
  static constexpr int slot(int i) {
    if (!kHaddpSwapsLanes) return i;
    const int j = i % 8;
    return i - j + (j == 2 || j == 3 ? j + 2 : j == 4 || j == 5 ? j - 2 : j);
  }

  // Lane i: q . k_i (i < NK; lanes from NK on are 0) for the key rows k_i = k + i k_seq.
  template <int NK>
  static Batch dot_keys(const float* q, const float* k, std::int64_t k_seq, std::int64_t dim) {
    Batch a[kWidth];
#pragma GCC unroll 16
    for (Batch& x : a) x = Batch(0.0f);
    std::int64_t d0 = 0;
    for (; d0 + kDotVectors * kWidth <= dim; d0 += kDotVectors * kWidth) {
      Batch qv[kDotVectors];
#pragma GCC unroll 4
      for (int c = 0; c < kDotVectors; ++c) qv[c] = Batch::load_unaligned(q + d0 + kWidth * c);
#pragma GCC unroll 16
      for (int i = 0; i < NK; ++i) {
        const float* key = k + i * k_seq + d0;
#pragma GCC unroll 4
        for (int c = 0; c < kDotVectors; ++c) {
          a[slot(i)] = fused(qv[c], Batch::load_unaligned(key + kWidth * c), a[slot(i)]);
        }
      }
    }
    for (; d0 < dim; d0 += kWidth) {  // the last columns, a vector at a time
      const Batch qv = load_part(q + d0, dim - d0);
#pragma GCC unroll 16
      for (int i = 0; i < NK; ++i) {
        a[slot(i)] = fused(qv, load_part(k + i * k_seq + d0, dim - d0), a[slot(i)]);
      }
    }
    return xsimd::haddp(a);
  }

  // acc = alpha acc + sum_{j < cols} w[j] v_j over NV vectors (the last one's lanes limited
  // to `last`) of the rows v_j = v + j v_seq.
  template <int NV>
  static void add_weighted_rows(const float* w, std::int64_t cols, const float* v,
                                std::int64_t v_seq, std::int64_t last, float* acc, float alpha) {
    const Batch av(alpha);
    Batch o[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) o[c] = Batch::load_aligned(acc + kWidth * c) * av;
    for (std::int64_t j = 0; j < cols; ++j) {
      const Batch wj(w[j]);
      const float* row = v + j * v_seq;
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        const Batch x = c + 1 == NV && last < kWidth ? load_part(row + kWidth * c, last)
                                                     : Batch::load_unaligned(row + kWidth * c);
        o[c] = fused(wj, x, o[c]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) o[c].store_aligned(acc + kWidth * c);
  }

  // dot_keys of the first nk < W keys, a row's last step: out of line. Inlined, xsimd-avx512's
  // 15 of them made decode's function 34 KiB instead of 11 and decode 1.1-1.5 times as slow
  // (Zen 4; xsimd-avx2 up to 1.06). avx2.cpp's 7 stay inlined: out of line they cost it up to
  // 16 %.
  static MHA_NOINLINE Batch dot_keys_part(std::int64_t nk, const float* q, const float* k,
                                          std::int64_t k_seq, std::int64_t dim) {
    Batch dots;
    mha::support::with_count<kDotKeys - 1>(
        nk, [&](auto count) { dots = dot_keys<decltype(count)::value>(q, k, k_seq, dim); });
    return dots;
  }

  // Base-2 logits of the row's `cols` keys, W at a time (decode_logits, mha/tiled_loops.h).
  template <class Step>
  static MHA_ALWAYS_INLINE float decode_logits(const float* q, const float* k, std::int64_t k_seq,
                                               std::int64_t cols, std::int64_t dim, float c,
                                               float* w, const Step& after_step) {
    const Batch logit_scale(c);
    Batch mv(neg_inf());
    for (std::int64_t j0 = 0; j0 < cols; j0 += kDotKeys) {
      const std::int64_t nk = std::min(kDotKeys, cols - j0);
      const float* key0 = k + j0 * k_seq;
      const Batch dots = nk == kDotKeys ? dot_keys<kDotKeys>(q, key0, k_seq, dim)
                                        : dot_keys_part(nk, q, key0, k_seq, dim);
      after_step();
      const Batch x = dots * logit_scale;
      x.store_aligned(w + j0);
      // Lanes past nk keep mv, and so does a NaN x.
      mv = xsimd::select(first_lanes(nk) & (x > mv), x, mv);
    }
    return max_lanes(mv);  // no lane of mv is NaN
  }

  static MHA_ALWAYS_INLINE float decode_weights(float* w, std::int64_t cols, float shift) {
    const Batch base(shift);
    Batch sum(0.0f);
    for (std::int64_t j0 = 0; j0 < cols; j0 += kDotKeys) {
      const Batch e = exp2_nonpositive(Batch::load_aligned(w + j0) - base);
      const Batch x = xsimd::select(first_lanes(cols - j0), e, Batch(0.0f));
      x.store_aligned(w + j0);
      sum += x;
    }
    return xsimd::hadd(sum);
  }

  // O = alpha O + P V over the row's keys, kPvVectors vectors of head_dim at a time.
  static MHA_ALWAYS_INLINE void decode_pv(const float* w, std::int64_t cols, const float* v,
                                          std::int64_t v_seq, std::int64_t dim, float* acc,
                                          float alpha) {
    for (std::int64_t d0 = 0; d0 < dim; d0 += kPvVectors * kWidth) {
      const std::int64_t n = std::min<std::int64_t>(kPvVectors * kWidth, dim - d0);
      mha::support::with_count<kPvVectors>(mha::support::ceil_div(n, kWidth), [&](auto vectors) {
        constexpr int kVectors = decltype(vectors)::value;
        add_weighted_rows<kVectors>(w, cols, v + d0, v_seq, n - kWidth * (kVectors - 1), acc + d0,
                                    alpha);
      });
    }
  }

  // ---- Entry points -------------------------------------------------------------------

  static std::size_t workspace(const mha::Problem& p) {
    return tiled::Loops<Attention>::workspace(p);
  }

  static void run(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                  float* lse, mha::Workspace ws) {
    tiled::Loops<Attention>::run(p, q, k, v, o, lse, ws);
  }
};

}  // namespace mha::xsimd_kernel

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

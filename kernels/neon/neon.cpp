// neon: multi-head attention with flash-attention tiling and an online softmax, in fp32,
// over K and V of any KvType (f32, f16, bf16, i8), with AArch64 NEON intrinsics. The
// algorithm of kernels/blocked/blocked.cpp; read that file first.
//
// Computes what mha/attention.h specifies: per query head h (reading KV head h / g,
// g = q_heads / kv_heads), o = softmax(scale * q k^T + causal and window mask) v and lse = the
// log of the softmax denominator, one KV tile at a time. Two paths; decodes(p) chooses:
//
// Prefill, g x q_len >= 8 rows per KV head:
//
//   for each (batch, KV head, block of g x Br query rows):   for_each_block, start_block
//     for each KV tile of Bc keys some row of the block sees (causal: later tiles skipped;
//       sliding window: earlier ones)
//       pack K^T of the tile (4 x 4 transposes), widened to fp32,    pack_k_transposed
//         zero-padded to a multiple of 4 keys; all g heads share it
//       S = scale * Q K^T        microkernel 4 rows x 16 keys        tile_logits
//         (soft-capped with Problem::softcap, biased with Problem::alibi)
//       online softmax per row: running max m and sum l;             tile_softmax
//         vectorized exp (neon_exp.h)
//       a reduced V tile widened to fp32 rows in the workspace       widen_rows
//       O += P V                 microkernel 4 rows x 16 columns     tile_pv
//     o = O / l, lse = m + log(l)                                    finish_block
//
// Decode, g x q_len < 8 rows per KV head (decode_rows): lanes along head_dim instead.
//
//   for each (batch, KV head): its g x q_len rows, O = 0             for_each_block
//     prefetch the first tile into L2
//     for each tile of Bd keys some row sees, the next tile prefetched  Prefetch
//       into L2 over the tile's work:
//       for each row that sees a key of the tile, its keys only:
//         S: 16 keys' dot products at once, K rows read in place     row_logits,
//           and widened as loaded (4-float vectors, q in registers); dot_16_keys,
//           FADDP trees finish 4 accumulators at once                sum_lanes4
//         online softmax: m, alpha = exp(m_old - m), P = exp(S - m), l  row_softmax
//         O = alpha O + P V, 16 vectors of head_dim in registers     row_pv,
//           at a time, V rows read in place, widened as loaded       add_weighted_rows
//     o = O / l, lse = m + log(l)                                    finish_row
//
// ISA: AArch64 Advanced SIMD (mandatory on AArch64, no extra compiler flags; the reduced
// types' conversions are baseline instructions too, no FEAT_FP16 or BF16). Both
// microkernels hold a 4 x 4 grid of 128-bit accumulators (16 of the 32 vector registers)
// and multiply by lane (FMLA v.4s, v.4s, v.s[l]) so four rows' operands come from one
// 4-float load each: 16 independent FMA chains cover 4 cycles of latency x up to 4 FMA
// pipes, with 4 operand registers and 4 broadcast sources, 24 registers in all.
//
// Decode. With 1-3 rows the 4-row microkernels run partly empty (1 row: 4 of 16 chains,
// a load per FMA), and the K^T packing, about 4 instructions per key and 4 columns (a load,
// two permutes on the FMA pipes of Neoverse N1 and Cortex-A76, a store), costs as much as
// the S product of a full 4-row block. The decode path packs nothing: K and V rows are read
// in place, from memory for the first row of a tile and from L1 for the others. It needs a
// load per FMA (the 4-row microkernels about 0.3) but no permutes, no K^T stores and no
// partial row blocks. Per key and 4 columns for R rows: decode 2R FMAs and 2R loads;
// prefill 2R FMAs + 2 permutes on the same pipes, about 0.6 R loads and a store, and for
// 5-7 rows a remainder block as load-bound as decode rows and short of FMA chains. On cores
// with as many load as FMA pipes (N1, A76: 2 and 2) decode comes out ahead up to 8 rows and
// about even beyond; with 4 FMA pipes and 3 loads (Neoverse V1, V2) even at 4 rows, ahead at
// 5-7 and behind from 8 rows, where prefill runs two full 4-row blocks. And decode reads with
// software prefetch, which counts while the rows are too few to be compute-bound (D = 128:
// 8 D bytes of K and V per key against 64 R FMA instructions). Hence decode below 8 rows
// (kDecodeRows). These are instruction counts, not measurements: there is no Arm machine
// at hand, and qemu timings say nothing. The decode microkernels hold 16 accumulators too:
// 16 keys' dot products of one row (dot_16_keys, with 4 vectors of q), and 16 vectors (64
// columns) of one row's O (add_weighted_rows, 4 keys' weights per load, used by lane).
//
// Causal masking is bottom-right aligned: every row sees a prefix of the keys [0, end), and
// with a sliding window (Problem::window) only the window's last keys of it, [first, end).
// Prefill computes a microkernel block's logits over the keys one of its rows sees and masks
// the rest per row in the softmax (so keys outside a row's window never weigh in its max);
// decode computes each row's logits over its own keys only. P V only visits the keys a row
// sees (prefill: rows of a microkernel block share the keys all of them see; each row then
// adds its own others alone, those before the shared ones where its window starts earlier
// and its few past them on the diagonal), so NaN or Inf in a masked V row never reaches a
// row, not even as 0 x Inf. Tiles no row sees are skipped: a block's tiles start at its
// first row's first key.
//
// K and V of a reduced type (Problem::kv_type, mha/attention.h and mha/kv_types.h), read
// once per tile in their own type and never expanded as a whole: 4 elements at a time,
// f16 by FCVTL, bf16 by a 16-bit left shift (SHLL), i8 by sign extension (SXTL twice) and
// SCVTF (load_kv), all exact. Prefill widens K while it packs K^T (it copies K anyway) and
// a V tile into an fp32 tile in the workspace (widen_rows), an i8 element times its row's
// scale there (q s, one rounding): its P V runs over the tile once per 4-row block, R / 4
// times (28 in the workspace example below), so one conversion per tile beats one in
// every block's loads, and the microkernels stay the fp32 ones. A cache of values its type
// holds exactly thus gives the fp32 output bits. Decode widens as it loads instead
// (dot_16_keys, add_weighted_row): its few rows read each K and V element once or a few
// times, so a widened copy would be a pass of its own, which on x86 cost much of what the
// smaller cache saves (DESIGN.md, K and V types). There an i8 key's scale multiplies its
// finished logit and an i8 value row's its weight, one rounding each (tolerance.h, step
// 6), as avx512's decode does; f16 and bf16 give the fp32 bits there too. The whole path
// is a template over the type (prefill, decode_rows), chosen once per call.
//
// Tails: key counts, rows and head_dim of any size. Scratch tiles (K^T, S, weights,
// accumulators) are padded to multiples of 4 floats so the microkernels use whole vectors
// there; tensor memory is only touched with whole vectors that lie inside a row
// (d + 4 <= head_dim) and lane by lane (load_partial, load_kv_partial) or scalar for the
// last head_dim % 4 elements. An i8 row's scale is read only for keys the code reads.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0,
// shared inputs); no alignment assumed (vld1q/vst1q are unaligned-safe). Reads only
// elements the strides address (of keys, only those some row of the block sees; decode
// prefetches only such elements too); writes only o's and lse's elements. Reads nothing
// past the end of any tensor.
//
// Tile sizes: prefill, mha::support::flash_tiling, as blocked; decode, Bd =
// mha::support::decode_tile_keys(p, 16) keys, a multiple of 16 whose K and V rows fill two
// thirds of L1d, so that a tile's later rows read it from L1 (mha/support.h gives the
// reasoning). D = 128: Bc = 32 keys and Bd = 16 with a 32 KiB L1d, 48 and 32 with 48 KiB,
// 64 and 32 with 64 KiB. Both are sized for fp32 rows: a reduced type's decode tile takes
// half (f16, bf16) or a quarter (i8) of that room.
//
// Workspace (the caller's; mha_f32_attention_neon_workspace gives its size), in floats
// (Bc4, D4 = Bc, D rounded up to 4). Prefill: D x Bc4 (K^T) + R x Bc4 (scores) + R x D4
// (accumulators) + 2 R, R = g x Br: about 87 KiB at D = 128, g = 4 with 32 KiB L1d and
// 512 KiB L2 (Bc = 32, R = 112); + Bc x D4 (the widened V tile, 16 KiB there) when
// kv_type is not f32. Decode, for every type: rows x D4 (accumulators) + Bd (one row's
// logits, then weights), under 4 KiB at D = 128. A prefill workspace is at least the
// largest decode's (7 rows of the same head_dim), so the size never shrinks as q_len grows
// across the threshold (at head_dim 1, 7 decode rows need more than an 8-row prefill block).
//
// Floating-point environment: the default one for the call (mha::FpEnvGuard, mha/attention.h),
// so the caller's flush-to-zero, denormals-are-zero or rounding mode changes no bit of the
// output, and the caller's control bits are as they were on return.
//
// Depends on mha/attention.h, mha/support.h and neon_exp.h (this folder) only.
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "mha/attention.h"
#include "mha/support.h"
#include "neon_exp.h"

namespace {

using mha::support::Block;
using mha::support::Carve;
using mha::support::Tiling;

constexpr int kRows = 4;     // MR: rows per microkernel block
constexpr int kVectors = 4;  // NR = 4 x 4 = 16 floats per microkernel block

// Decode: below kDecodeRows rows (g x q_len) per KV head (the header says why 8). Its
// microkernels finish kDecodeKeys keys' logits at once, reading kDecodeQVectors vectors of
// q per pass over them, and add kDecodeOVectors vectors of a row's O at once.
constexpr std::int64_t kDecodeRows = 8;
constexpr std::int64_t kDecodeKeys = 16;
constexpr int kDecodeQVectors = 4;   // 16 accumulators + 4 q + loads: about 24 registers
constexpr int kDecodeOVectors = 16;  // 16 accumulators + weights + loads

std::int64_t round_up4(std::int64_t n) { return mha::support::round_up(n, 4); }

// The first n (1..3) floats of x in the low lanes, zeros above: never reads x[n].
[[gnu::always_inline]] inline float32x4_t load_partial(const float* x, std::int64_t n) {
  float32x4_t r = vdupq_n_f32(0.0f);
  r = vld1q_lane_f32(x, r, 0);
  if (n > 1) r = vld1q_lane_f32(x + 1, r, 1);
  if (n > 2) r = vld1q_lane_f32(x + 2, r, 2);
  return r;
}

// K and V of type T (Problem::kv_type) are stored as Elem<T>: floats, the 16 bits of an
// f16 or a bf16, or an i8's integers (each row's value q s with its fp32 scale s).
template <mha::KvType T>
using Elem =
    std::conditional_t<T == mha::KvType::f32, float,
                       std::conditional_t<T == mha::KvType::i8, std::int8_t, std::uint16_t>>;

// The low 4 of 8 signed bytes as floats, exactly: sign extension (SXTL twice) and SCVTF.
[[gnu::always_inline]] inline float32x4_t widen_i8(int8x8_t x) {
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(x))));
}

// 4 f16 or bf16 bit patterns as floats, exactly: f16 by FCVTL, bf16 by a 16-bit left shift
// (SHLL: a bf16 is the top half of an fp32).
template <mha::KvType T>
[[gnu::always_inline]] inline float32x4_t widen_16(uint16x4_t x) {
  if constexpr (T == mha::KvType::f16) {
    return vcvt_f32_f16(vreinterpret_f16_u16(x));
  } else {
    static_assert(T == mha::KvType::bf16);
    return vreinterpretq_f32_u32(vshll_n_u16(x, 16));
  }
}

// x[0 .. 4) of a K or V row of type T as floats, exactly (an i8 row's scale is the
// caller's to apply).
template <mha::KvType T>
[[gnu::always_inline]] inline float32x4_t load_kv(const Elem<T>* x) {
  if constexpr (T == mha::KvType::f32) {
    return vld1q_f32(x);
  } else if constexpr (T == mha::KvType::i8) {
    std::int32_t bytes;  // 4 bytes, unaligned: one LDR
    std::memcpy(&bytes, x, sizeof bytes);
    return widen_i8(vreinterpret_s8_s32(vdup_n_s32(bytes)));
  } else {
    return widen_16<T>(vld1_u16(x));
  }
}

// load_kv of the first n (1..3) elements of x in the low lanes, zeros above (0 widens to
// +0 in every type): never reads x[n].
template <mha::KvType T>
[[gnu::always_inline]] inline float32x4_t load_kv_partial(const Elem<T>* x, std::int64_t n) {
  if constexpr (T == mha::KvType::f32) {
    return load_partial(x, n);
  } else if constexpr (T == mha::KvType::i8) {
    int8x8_t r = vdup_n_s8(0);
    r = vld1_lane_s8(x, r, 0);
    if (n > 1) r = vld1_lane_s8(x + 1, r, 1);
    if (n > 2) r = vld1_lane_s8(x + 2, r, 2);
    return widen_i8(r);
  } else {
    uint16x4_t r = vdup_n_u16(0);
    r = vld1_lane_u16(x, r, 0);
    if (n > 1) r = vld1_lane_u16(x + 1, r, 1);
    if (n > 2) r = vld1_lane_u16(x + 2, r, 2);
    return widen_16<T>(r);
  }
}

// Widened i8 elements times their row's scale, one rounding: the values q s, the bits of
// mha::kv::value_at. The other types' values are the widened elements themselves.
template <mha::KvType T>
[[gnu::always_inline]] inline float32x4_t scaled(float32x4_t x, float scale) {
  if constexpr (T == mha::KvType::i8) {
    return vmulq_n_f32(x, scale);
  } else {
    return x;
  }
}

// The value of element x[0] of a row of type T (i8: times the row's `scale`).
template <mha::KvType T>
float kv_value(const Elem<T>* x, float scale) {
  if constexpr (T == mha::KvType::f32) {
    return *x;
  } else {
    return vgetq_lane_f32(scaled<T>(load_kv_partial<T>(x, 1), scale), 0);
  }
}

// The i8 scales of rows j, j + 1, ... of a KV head whose row 0's scale is at `scales`, `seq`
// apart; null for the other types, whose scale pointers and strides are never read.
template <mha::KvType T>
const float* scales_from(const float* scales, std::int64_t j, std::int64_t seq) {
  if constexpr (T == mha::KvType::i8) {
    return scales + j * seq;
  } else {
    return nullptr;
  }
}

// Row j's scale of `scales_from`'s scales: i8's, 1 (unread) for the other types.
template <mha::KvType T>
float row_scale(const float* scales, std::int64_t j, std::int64_t seq) {
  if constexpr (T == mha::KvType::i8) {
    return scales[j * seq];
  } else {
    return 1.0f;
  }
}

// acc[r][c] += b[c] * a[r][L]: the microkernels' FMA step, lane L a compile-time constant.
template <int MR, int NV, int L>
inline void fma_lane(float32x4_t (&acc)[MR][NV], const float32x4_t (&b)[NV],
                     const float32x4_t (&a)[MR]) {
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = vfmaq_laneq_f32(acc[r][c], b[c], a[r], L);
  }
}

// kt[d][j] = k[j][d] for j < cols, and 0 for cols <= j < round_up4(cols), widened from
// type T as the rows are read (i8: times row j's scale, scales[j scale_seq]): the values
// an fp32 K of those values would pack, bit for bit.
// k: [cols][head_dim], row stride k_seq   kt: [head_dim][ld]
template <mha::KvType T>
void pack_k_transposed(const Elem<T>* k, std::int64_t k_seq, const float* scales,
                       std::int64_t scale_seq, std::int64_t cols, std::int64_t head_dim, float* kt,
                       std::int64_t ld) {
  std::int64_t j0 = 0;
  for (; j0 + 4 <= cols; j0 += 4) {
    const Elem<T>* k0 = k + j0 * k_seq;
    const Elem<T>* k1 = k0 + k_seq;
    const Elem<T>* k2 = k1 + k_seq;
    const Elem<T>* k3 = k2 + k_seq;
    const float s0 = row_scale<T>(scales, j0, scale_seq);
    const float s1 = row_scale<T>(scales, j0 + 1, scale_seq);
    const float s2 = row_scale<T>(scales, j0 + 2, scale_seq);
    const float s3 = row_scale<T>(scales, j0 + 3, scale_seq);
    std::int64_t d = 0;
    for (; d + 4 <= head_dim; d += 4) {  // a 4 x 4 transpose in registers
      const float32x4_t r0 = scaled<T>(load_kv<T>(k0 + d), s0);
      const float32x4_t r1 = scaled<T>(load_kv<T>(k1 + d), s1);
      const float32x4_t r2 = scaled<T>(load_kv<T>(k2 + d), s2);
      const float32x4_t r3 = scaled<T>(load_kv<T>(k3 + d), s3);
      const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r0, r1));  // 00 10 02 12
      const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(r0, r1));  // 01 11 03 13
      const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r2, r3));  // 20 30 22 32
      const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(r2, r3));  // 21 31 23 33
      float* out = kt + d * ld + j0;
      vst1q_f32(out, vreinterpretq_f32_f64(vtrn1q_f64(t0, t2)));
      vst1q_f32(out + ld, vreinterpretq_f32_f64(vtrn1q_f64(t1, t3)));
      vst1q_f32(out + 2 * ld, vreinterpretq_f32_f64(vtrn2q_f64(t0, t2)));
      vst1q_f32(out + 3 * ld, vreinterpretq_f32_f64(vtrn2q_f64(t1, t3)));
    }
    for (; d < head_dim; ++d) {
      float* out = kt + d * ld + j0;
      out[0] = kv_value<T>(k0 + d, s0);
      out[1] = kv_value<T>(k1 + d, s1);
      out[2] = kv_value<T>(k2 + d, s2);
      out[3] = kv_value<T>(k3 + d, s3);
    }
  }
  const std::int64_t padded = round_up4(cols);
  for (std::int64_t j = j0; j < padded; ++j) {
    if (j < cols) {
      const float s = row_scale<T>(scales, j, scale_seq);
      for (std::int64_t d = 0; d < head_dim; ++d)
        kt[d * ld + j] = kv_value<T>(k + j * k_seq + d, s);
    } else {
      for (std::int64_t d = 0; d < head_dim; ++d) kt[d * ld + j] = 0.0f;
    }
  }
}

// Rows [0, keys) of a V tile of type T (head_dim elements each, `seq` apart; i8: times row
// j's scale, scales[j scale_seq], one rounding) widened into `out`, rows ld floats apart:
// prefill's P V then reads fp32 rows holding the values an fp32 V would, bit for bit.
template <mha::KvType T>
void widen_rows(const Elem<T>* in, std::int64_t seq, const float* scales, std::int64_t scale_seq,
                std::int64_t keys, std::int64_t head_dim, float* out, std::int64_t ld) {
  for (std::int64_t j = 0; j < keys; ++j) {
    const Elem<T>* row = in + j * seq;
    float* to = out + j * ld;
    const float s = row_scale<T>(scales, j, scale_seq);
    std::int64_t d = 0;
    for (; d + 4 <= head_dim; d += 4) vst1q_f32(to + d, scaled<T>(load_kv<T>(row + d), s));
    for (; d < head_dim; ++d) to[d] = kv_value<T>(row + d, s);
  }
}

// s[r][0 .. 4 NV) = scale * sum_d q[r][d] kt[d][0 .. 4 NV) for MR rows: the S microkernel.
// q[r]: [head_dim] (a tensor row: whole vectors only below head_dim)   kt: [head_dim][ld]
// s: [MR][ld]
template <int MR, int NV>
void logits_tile(const float* const* q, const float* kt, std::int64_t ld, std::int64_t head_dim,
                 float scale, float* s) {
  float32x4_t acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = vdupq_n_f32(0.0f);
  }
  float32x4_t b[NV];
  std::int64_t d = 0;
  for (; d + 4 <= head_dim; d += 4) {
    float32x4_t a[MR];  // q[r][d .. d + 4): four steps of d from one load
    for (int r = 0; r < MR; ++r) a[r] = vld1q_f32(q[r] + d);
    const float* k = kt + d * ld;
    for (int c = 0; c < NV; ++c) b[c] = vld1q_f32(k + 4 * c);
    fma_lane<MR, NV, 0>(acc, b, a);
    for (int c = 0; c < NV; ++c) b[c] = vld1q_f32(k + ld + 4 * c);
    fma_lane<MR, NV, 1>(acc, b, a);
    for (int c = 0; c < NV; ++c) b[c] = vld1q_f32(k + 2 * ld + 4 * c);
    fma_lane<MR, NV, 2>(acc, b, a);
    for (int c = 0; c < NV; ++c) b[c] = vld1q_f32(k + 3 * ld + 4 * c);
    fma_lane<MR, NV, 3>(acc, b, a);
  }
  for (; d < head_dim; ++d) {  // head_dim % 4 tail: q element by element
    for (int c = 0; c < NV; ++c) b[c] = vld1q_f32(kt + d * ld + 4 * c);
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NV; ++c) acc[r][c] = vfmaq_n_f32(acc[r][c], b[c], q[r][d]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) vst1q_f32(s + r * ld + 4 * c, vmulq_n_f32(acc[r][c], scale));
  }
}

// Logits of MR rows over the first n4 (a multiple of 4) columns of the K^T tile.
template <int MR>
void logits_rows(const float* const* q, const float* kt, std::int64_t ld, std::int64_t head_dim,
                 std::int64_t n4, float scale, float* s) {
  std::int64_t c = 0;
  for (; c + 4 * kVectors <= n4; c += 4 * kVectors) {
    logits_tile<MR, kVectors>(q, kt + c, ld, head_dim, scale, s + c);
  }
  for (; c < n4; c += 4) logits_tile<MR, 1>(q, kt + c, ld, head_dim, scale, s + c);
}

// acc[r][0 .. 4 NV) += sum_{j < keys} p[r][j] v[j][0 .. 4 NV): the P V microkernel. With
// kPartial (NV == 1) only the first `width` (1..3) columns of v are read; the other lanes
// of acc gain zeros.
// p: [MR][ld_p] (scratch)   v: [keys][>= 4 NV or width], row stride v_seq   acc: [MR][ld_acc]
template <int MR, int NV, bool kPartial>
void pv_tile(const float* p, std::int64_t ld_p, std::int64_t keys, const float* v,
             std::int64_t v_seq, std::int64_t width, float* acc_out, std::int64_t ld_acc) {
  float32x4_t acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = vld1q_f32(acc_out + r * ld_acc + 4 * c);
  }
  float32x4_t b[NV];
  const auto load_v = [&](std::int64_t j) {
    const float* row = v + j * v_seq;
    for (int c = 0; c < NV; ++c) {
      b[c] = kPartial ? load_partial(row + 4 * c, width) : vld1q_f32(row + 4 * c);
    }
  };
  std::int64_t j = 0;
  for (; j + 4 <= keys; j += 4) {
    float32x4_t a[MR];  // p[r][j .. j + 4): four keys from one load
    for (int r = 0; r < MR; ++r) a[r] = vld1q_f32(p + r * ld_p + j);
    load_v(j);
    fma_lane<MR, NV, 0>(acc, b, a);
    load_v(j + 1);
    fma_lane<MR, NV, 1>(acc, b, a);
    load_v(j + 2);
    fma_lane<MR, NV, 2>(acc, b, a);
    load_v(j + 3);
    fma_lane<MR, NV, 3>(acc, b, a);
  }
  for (; j < keys; ++j) {
    load_v(j);
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NV; ++c) acc[r][c] = vfmaq_n_f32(acc[r][c], b[c], p[r * ld_p + j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) vst1q_f32(acc_out + r * ld_acc + 4 * c, acc[r][c]);
  }
}

// O += P V for MR rows over their first `keys` keys, all of head_dim.
template <int MR>
void pv_rows(const float* p, std::int64_t ld_p, std::int64_t keys, const float* v,
             std::int64_t v_seq, std::int64_t head_dim, float* acc, std::int64_t ld_acc) {
  if (keys <= 0) return;
  std::int64_t d = 0;
  for (; d + 4 * kVectors <= head_dim; d += 4 * kVectors) {
    pv_tile<MR, kVectors, false>(p, ld_p, keys, v + d, v_seq, 4, acc + d, ld_acc);
  }
  for (; d + 4 <= head_dim; d += 4) {
    pv_tile<MR, 1, false>(p, ld_p, keys, v + d, v_seq, 4, acc + d, ld_acc);
  }
  if (d < head_dim) {
    pv_tile<MR, 1, true>(p, ld_p, keys, v + d, v_seq, head_dim - d, acc + d, ld_acc);
  }
}

// The lanes of the 4 keys j .. j + 4 that are among the keys [first, end).
inline uint32x4_t lanes_within(std::int64_t j, std::int64_t first, std::int64_t end) {
  const std::int32_t lane_ids[4] = {0, 1, 2, 3};
  const int32x4_t lanes = vld1q_s32(lane_ids);
  return vandq_u32(vcgeq_s32(lanes, vdupq_n_s32(static_cast<std::int32_t>(first - j))),
                   vcltq_s32(lanes, vdupq_n_s32(static_cast<std::int32_t>(end - j))));
}

// One row's online-softmax step over its logits s[first .. end) of this tile (as blocked's
// online_softmax): they become the weights exp(s - m). s has whole vectors from first
// rounded down to 4 up to round_up4(end) (scratch); the lanes outside [first, end) there are
// overwritten but weigh neither in m nor in l.
void online_softmax(float* s, std::int64_t first, std::int64_t end, float* m, float* l, float* acc,
                    std::int64_t ld_acc) {
  const float m_old = *m;
  const std::int64_t first4 = first - first % 4;  // the vector of the row's first key
  const float32x4_t neg_inf = vdupq_n_f32(-std::numeric_limits<float>::infinity());
  // `>` (FCMGT) ignores NaN logits as blocked does, so m never becomes NaN; their weights
  // are NaN and reach l and acc.
  float32x4_t mv = neg_inf;
  std::int64_t j = first4;
  if (j < first) {  // a sliding window starts within the vector: its lanes before it as -inf
    const float32x4_t x = vbslq_f32(lanes_within(j, first, end), vld1q_f32(s + j), neg_inf);
    mv = vbslq_f32(vcgtq_f32(x, mv), x, mv);
    j += 4;
  }
  for (; j + 4 <= end; j += 4) {
    const float32x4_t x = vld1q_f32(s + j);
    mv = vbslq_f32(vcgtq_f32(x, mv), x, mv);
  }
  float m_new = std::max(m_old, vmaxvq_f32(mv));  // no lane of mv is NaN
  for (; j < end; ++j) m_new = s[j] > m_new ? s[j] : m_new;

  if (m_new > m_old) {
    const float alpha = std::exp(m_old - m_new);  // exactly 0 when m_old is -inf
    *l *= alpha;
    const float32x4_t av = vdupq_n_f32(alpha);
    for (std::int64_t d = 0; d < ld_acc; d += 4)
      vst1q_f32(acc + d, vmulq_f32(vld1q_f32(acc + d), av));
    *m = m_new;
  }

  const float32x4_t base = vdupq_n_f32(mha::support::logit_shift(m_new));
  float32x4_t sum = vdupq_n_f32(0.0f);
  // Lanes outside [first, end) in the first and last vectors hold other keys' logits:
  // computed, masked out of l.
  const auto add_partial = [&](std::int64_t at) {
    const float32x4_t w = mha::neon::exp_nonpositive(vsubq_f32(vld1q_f32(s + at), base));
    vst1q_f32(s + at, w);
    sum = vaddq_f32(sum, vbslq_f32(lanes_within(at, first, end), w, vdupq_n_f32(0.0f)));
  };
  j = first4;
  if (j < first) {
    add_partial(j);
    j += 4;
  }
  for (; j + 4 <= end; j += 4) {
    const float32x4_t w = mha::neon::exp_nonpositive(vsubq_f32(vld1q_f32(s + j), base));
    vst1q_f32(s + j, w);
    sum = vaddq_f32(sum, w);
  }
  if (j < end) add_partial(j);
  *l += vaddvq_f32(sum);
}

// o = acc / l and lse = m + log(l) (see blocked's finish_row).
void finish_row(const float* acc, float m, float l, float sink, std::int64_t visible,
                std::int64_t head_dim, float* o, float* lse) {
  std::int64_t d = 0;
  if (visible == 0) {
    for (; d + 4 <= head_dim; d += 4) vst1q_f32(o + d, vdupq_n_f32(0.0f));
    for (; d < head_dim; ++d) o[d] = 0.0f;
    if (lse != nullptr) *lse = sink;
    return;
  }
  const mha::RowEnd end = mha::support::row_end(m, l, sink);
  // A division: one rounding, as the tolerance assumes.
  const float32x4_t lv = vdupq_n_f32(end.divisor);
  for (; d + 4 <= head_dim; d += 4) vst1q_f32(o + d, vdivq_f32(vld1q_f32(acc + d), lv));
  for (; d < head_dim; ++d) o[d] = acc[d] / end.divisor;
  if (lse != nullptr) *lse = end.lse;
}

// The kernel's arrays in the caller's workspace, sized for the largest block. Row strides
// are padded to whole vectors: ld = Bc rounded up to 4 (K^T, S), ld_acc = head_dim
// rounded up to 4 (accumulators).
struct Scratch {
  std::int64_t ld, ld_acc;
  float* kt;    // [head_dim][ld]: the K^T tile
  float* s;     // [R][ld]: the block's logits, then its weights
  float* acc;   // [R][ld_acc]: the block's O accumulators
  float* m;     // [R]: running maxima
  float* l;     // [R]: running sums
  float* wide;  // [Bc][ld_acc]: the V tile widened to fp32 (kv_type not f32; else null)
};

Scratch carve(const mha::Problem& p, const Tiling& tiling, Carve& carve) {
  const std::int64_t rows = p.q_heads / p.kv_heads * tiling.rows_per_head;
  Scratch s;
  s.ld = round_up4(tiling.keys);
  s.ld_acc = round_up4(p.head_dim);
  s.kt = carve.take<float>(p.head_dim * s.ld);
  s.s = carve.take<float>(rows * s.ld);
  s.acc = carve.take<float>(rows * s.ld_acc);
  s.m = carve.take<float>(rows);
  s.l = carve.take<float>(rows);
  s.wide = p.kv_type == mha::KvType::f32 ? nullptr : carve.take<float>(tiling.keys * s.ld_acc);
  return s;
}

// The KV tile of keys [c0, c0 + keys) in the block's loop.
struct Tile {
  std::int64_t c0, keys;
};

// The keys of the tile block row t sees: [first, end), {0, 0} when it sees none of them.
struct Seen {
  std::int64_t first, end;
};
Seen seen(const mha::Problem& p, const Block& block, const Tile& tile, std::int64_t t) {
  const std::int64_t first = block.tile_first_seen(p, t, tile.c0, tile.keys);
  const std::int64_t end = block.tile_keys_seen(p, t, tile.c0, tile.keys);
  return first < end ? Seen{first, end} : Seen{0, 0};
}

// The phases of one block, in the order the file's header lists them.

void start_block(const Block& block, const Scratch& s) {
  std::fill(s.m, s.m + block.rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + block.rows, 0.0f);
  std::fill(s.acc, s.acc + block.rows * s.ld_acc, 0.0f);
}

// S = scale Q K^T, kRows block rows at a time, over the keys one of them sees, from the
// vector of 4 that holds the first; with Problem::softcap each row's own then capped, with
// Problem::alibi biased.
void tile_logits(const mha::Problem& p, const Block& block, const Tile& tile, const float* q,
                 const Scratch& s) {
  const mha::support::Softcap cap = mha::support::Softcap::of(p, 1.0);
  const mha::support::Alibi alibi = mha::support::Alibi::of(p, 1.0);
  for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
    const std::int64_t nr = std::min<std::int64_t>(kRows, block.rows - t0);
    const float* qr[kRows];
    std::int64_t first = tile.keys, end = 0;  // columns the rows need (others are ignored)
    for (std::int64_t r = 0; r < nr; ++r) {
      qr[r] = block.q_row(p, q, t0 + r);
      const Seen keys = seen(p, block, tile, t0 + r);
      if (keys.end == 0) continue;
      first = std::min(first, keys.first);
      end = std::max(end, keys.end);
    }
    if (end == 0) continue;
    const std::int64_t from = first - first % 4;
    mha::support::with_count<kRows>(nr, [&](auto rows) {
      logits_rows<decltype(rows)::value>(qr, s.kt + from, s.ld, p.head_dim, round_up4(end) - from,
                                         p.scale, s.s + t0 * s.ld + from);
    });
    if (!cap.on() && !alibi.on()) continue;
    for (std::int64_t r = 0; r < nr; ++r) {  // each row's own logits [first, end)
      const Seen keys = seen(p, block, tile, t0 + r);
      if (keys.end == 0) continue;
      float* row = s.s + (t0 + r) * s.ld + keys.first;
      if (cap.on()) cap.apply(row, keys.end - keys.first);
      if (alibi.on()) {
        alibi.add(alibi.rate(block.head(t0 + r)),
                  alibi.distance(block.row(t0 + r), tile.c0 + keys.first), row,
                  keys.end - keys.first);
      }
    }
  }
}

// The online-softmax step of every block row that sees a key of the tile.
void tile_softmax(const mha::Problem& p, const Block& block, const Tile& tile, const Scratch& s) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    const Seen keys = seen(p, block, tile, t);
    if (keys.end > 0) {
      online_softmax(s.s + t * s.ld, keys.first, keys.end, s.m + t, s.l + t, s.acc + t * s.ld_acc,
                     s.ld_acc);
    }
  }
}

// O += P V, kRows block rows at a time: keys every row of the group sees through the
// nr-row microkernel; a row's others (before those: its sliding window starts earlier; past
// them: the causal diagonal) through one-row passes of its own. v_tile: the tile's first V
// row, rows v_seq apart.
void tile_pv(const mha::Problem& p, const Block& block, const Tile& tile, const float* v_tile,
             std::int64_t v_seq, const Scratch& s) {
  for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
    const std::int64_t nr = std::min<std::int64_t>(kRows, block.rows - t0);
    std::int64_t begin = 0, end = tile.keys;  // the shared keys: [begin, end)
    for (std::int64_t r = 0; r < nr; ++r) {
      const Seen keys = seen(p, block, tile, t0 + r);
      begin = std::max(begin, keys.first);
      end = std::min(end, keys.end);
    }
    end = std::max(begin, end);
    const float* p_rows = s.s + t0 * s.ld;
    float* acc_rows = s.acc + t0 * s.ld_acc;
    mha::support::with_count<kRows>(nr, [&](auto rows) {
      pv_rows<decltype(rows)::value>(p_rows + begin, s.ld, end - begin, v_tile + begin * v_seq,
                                     v_seq, p.head_dim, acc_rows, s.ld_acc);
    });
    for (std::int64_t r = 0; r < nr; ++r) {
      const Seen keys = seen(p, block, tile, t0 + r);
      const float* p_row = p_rows + r * s.ld;
      float* acc_row = acc_rows + r * s.ld_acc;
      const std::int64_t before = std::min(begin, keys.end);  // [keys.first, before)
      pv_rows<1>(p_row + keys.first, s.ld, before - keys.first, v_tile + keys.first * v_seq, v_seq,
                 p.head_dim, acc_row, s.ld_acc);
      const std::int64_t after = std::max(end, keys.first);  // [after, keys.end)
      pv_rows<1>(p_row + after, s.ld, keys.end - after, v_tile + after * v_seq, v_seq, p.head_dim,
                 acc_row, s.ld_acc);
    }
  }
}

// o = O / l, lse = m + log(l) for every block row.
void finish_block(const mha::Problem& p, const Block& block, const Scratch& s, float* o,
                  float* lse) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    finish_row(s.acc + t * s.ld_acc, s.m[t], s.l[t], mha::sink_of(p, block.head(t)),
               mha::visible_keys(p, block.row(t)), p.head_dim, block.o_row(p, o, t),
               block.lse_at(p, lse, t));
  }
}

// Decode: lanes along head_dim (the header's second path).

// Whether a problem takes the decode path.
bool decodes(const mha::Problem& p) { return p.q_heads / p.kv_heads * p.q_len < kDecodeRows; }

// Brings KV rows into L2 ahead of their use: the next tile's K and V rows while the
// current tile computes (and a block's first tile before it starts), a few lines of each
// every few microkernel steps (the avx512 kernel measured prefetches spread this way at
// three times the bandwidth of the hardware prefetchers alone in decode, and bursts no
// better). Into L2 (PRFM PLDL2KEEP), not L1: the next tile would evict the current one from
// L1, where the tile's other rows read it. A row's points are its bytes 0, 64, 128, ... and
// its last element's, at most 64 bytes apart, so every line holding an element of the row is
// touched whatever the row's alignment, and nothing else is; prefetches never fault.
class Prefetch {
 public:
  // Rows k[first + j], v[first + j] for j < keys (head_dim elements of `bytes` bytes each,
  // k_seq and v_seq elements apart; k, v the KV head's row 0), spread over `steps` step()s:
  // a point of each every few steps, or a few every step. A stride is scaled to bytes only
  // when a second row uses it (check() bounds a stride only by the rows that use it).
  Prefetch(const void* k, std::int64_t k_seq, const void* v, std::int64_t v_seq, std::int64_t first,
           std::int64_t keys, std::int64_t head_dim, std::int64_t bytes, std::int64_t steps)
      : k_(static_cast<const unsigned char*>(k)),
        v_(static_cast<const unsigned char*>(v)),
        k_seq_(keys > 0 && first + keys > 1 ? k_seq * bytes : 0),
        v_seq_(keys > 0 && first + keys > 1 ? v_seq * bytes : 0),
        first_(first),
        keys_(keys),
        last_((head_dim - 1) * bytes),
        points_(mha::support::ceil_div(last_, 64) + 1) {
    const std::int64_t total = std::max<std::int64_t>(1, keys * points_);
    steps = std::max<std::int64_t>(1, steps);
    every_ = std::max<std::int64_t>(1, steps / total);
    per_step_ = mha::support::ceil_div(total, steps);
  }

  // Inlined: a call in a microkernel's loop would spill its accumulators (AAPCS64 keeps
  // only the low halves of v8-v15 across calls).
  [[gnu::always_inline]] void step() {
    if (key_ == keys_ || ++tick_ < every_) return;
    tick_ = 0;
    for (std::int64_t n = 0; n < per_step_ && key_ < keys_; ++n) {
      const std::int64_t at = std::min(64 * point_, last_);
      __builtin_prefetch(k_ + (first_ + key_) * k_seq_ + at, 0, 2);
      __builtin_prefetch(v_ + (first_ + key_) * v_seq_ + at, 0, 2);
      if (++point_ == points_) {
        point_ = 0;
        ++key_;
      }
    }
  }
  // Whatever is left (rows that saw none of a tile's keys took no steps).
  void all() {
    while (key_ < keys_) step();
  }

 private:
  const unsigned char* k_;
  const unsigned char* v_;
  std::int64_t k_seq_, v_seq_, first_, keys_, last_, points_;
  std::int64_t every_ = 1, per_step_ = 1, key_ = 0, point_ = 0, tick_ = 0;
};

// f(NV, kPartial) for the slice of a row that starts `cols` columns before its end, at
// most 4 kMax columns: NV vectors, the last one partial (head_dim % 4 columns, lane by lane)
// when the slice ends the row and head_dim is not a multiple of 4.
template <int kMax, typename F>
void with_slice(std::int64_t cols, F&& f) {
  const std::int64_t n = std::min<std::int64_t>(4 * kMax, cols);
  mha::support::with_count<kMax>((n + 3) / 4, [&](auto vectors) {
    if (n % 4 != 0) {
      f(vectors, std::true_type{});
    } else {
      f(vectors, std::false_type{});
    }
  });
}

// Vector c of NV of a row slice of type T (q's: f32), widened as it is loaded: whole, or for
// the last one with kPartial its first `tail` (1..3) elements, zeros above.
template <int NV, bool kPartial, mha::KvType T = mha::KvType::f32>
[[gnu::always_inline]] inline float32x4_t load_slice(const Elem<T>* x, int c, std::int64_t tail) {
  return kPartial && c + 1 == NV ? load_kv_partial<T>(x + 4 * c, tail) : load_kv<T>(x + 4 * c);
}

// a[i] += q[0 .. 4 NV) * k_i[0 .. 4 NV) lane by lane for the first nk <= 16 of the key rows
// k_i = k + i k_seq, q held in NV registers: decode's S step over one slice of head_dim
// (tail: see load_slice; the zeros of q and k meet, so the lanes past head_dim add 0).
// 16 keys, 16 independent FMA chains. K of type T, widened as it is loaded (i8: unscaled).
template <int NV, bool kPartial, mha::KvType T>
[[gnu::always_inline]] inline void dot_16_keys(const float* q, const Elem<T>* k, std::int64_t k_seq,
                                               std::int64_t nk, std::int64_t tail,
                                               float32x4_t (&a)[kDecodeKeys]) {
  float32x4_t qv[NV];
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) qv[c] = load_slice<NV, kPartial>(q, c, tail);
#pragma GCC unroll 16
  for (int i = 0; i < kDecodeKeys; ++i) {
    if (i >= nk) break;
    const Elem<T>* key = k + i * k_seq;
    float32x4_t dot = a[i];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      dot = vfmaq_f32(dot, qv[c], load_slice<NV, kPartial, T>(key, c, tail));
    a[i] = dot;
  }
}

// Lane i of the result = the sum of the 4 lanes of a[i]: four dot products finished at once
// by a tree of 3 FADDP (pairwise adds) instead of 4 horizontal sums.
inline float32x4_t sum_lanes4(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
  return vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
}

// The lanes of 4-key vector j0 .. j0 + 4 that are among the first n keys.
inline uint32x4_t first_lanes(std::int64_t j0, std::int64_t n) {
  const std::int32_t lane_ids[4] = {0, 1, 2, 3};
  return vcltq_s32(vld1q_s32(lane_ids),
                   vdupq_n_s32(static_cast<std::int32_t>(std::clamp<std::int64_t>(n - j0, 0, 4))));
}

// o[c] += v_row[c] x wv[L] for NV vectors: one key of add_weighted_rows (V of type T,
// widened as it is loaded; i8: unscaled, its scale is in the weight).
template <int NV, bool kPartial, int L, mha::KvType T>
[[gnu::always_inline]] inline void add_weighted_row(float32x4_t (&o)[NV], const Elem<T>* row,
                                                    float32x4_t wv, std::int64_t tail) {
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) {
    const float32x4_t x = load_slice<NV, kPartial, T>(row, c, tail);  // clang: not in a macro
    o[c] = vfmaq_laneq_f32(o[c], x, wv, L);
  }
}

// acc = alpha acc + sum_{j < cols} w[j] v_j over NV vectors (tail: see load_slice; the lanes
// past head_dim gain w x 0 and are never stored to o) of the rows v_j = v + j v_seq:
// decode's P V step for one row and one slice of head_dim. w is read 4 keys per load and
// used by lane. NV independent FMA chains.
// w: [>= round_up4(cols)] (scratch)   acc: [4 NV] (scratch)
template <int NV, bool kPartial, mha::KvType T>
void add_weighted_rows(const float* w, std::int64_t cols, const Elem<T>* v, std::int64_t v_seq,
                       std::int64_t tail, float* acc, float alpha, Prefetch& prefetch) {
  float32x4_t o[NV];
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) o[c] = vmulq_n_f32(vld1q_f32(acc + 4 * c), alpha);
  std::int64_t j = 0;
  for (; j + 4 <= cols; j += 4) {
    const float32x4_t wv = vld1q_f32(w + j);
    const Elem<T>* row = v + j * v_seq;
    prefetch.step();
    add_weighted_row<NV, kPartial, 0, T>(o, row, wv, tail);
    prefetch.step();
    add_weighted_row<NV, kPartial, 1, T>(o, row + v_seq, wv, tail);
    prefetch.step();
    add_weighted_row<NV, kPartial, 2, T>(o, row + 2 * v_seq, wv, tail);
    prefetch.step();
    add_weighted_row<NV, kPartial, 3, T>(o, row + 3 * v_seq, wv, tail);
  }
  if (j < cols) {  // 1-3 keys; w's lanes past cols are not used
    const float32x4_t wv = vld1q_f32(w + j);
    const Elem<T>* row = v + j * v_seq;
    prefetch.step();
    add_weighted_row<NV, kPartial, 0, T>(o, row, wv, tail);
    if (j + 1 < cols) {
      prefetch.step();
      add_weighted_row<NV, kPartial, 1, T>(o, row + v_seq, wv, tail);
    }
    if (j + 2 < cols) {
      prefetch.step();
      add_weighted_row<NV, kPartial, 2, T>(o, row + 2 * v_seq, wv, tail);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < NV; ++c) vst1q_f32(acc + 4 * c, o[c]);
}

// Decode's arrays in the caller's workspace.
struct DecodeScratch {
  std::int64_t tile;    // Bd: keys per KV tile, a multiple of kDecodeKeys
  std::int64_t ld_acc;  // head_dim rounded up to 4: an accumulator's length
  float* acc;           // [rows][ld_acc]: O
  float* weights;       // [Bd]: one row's logits of the tile, then its weights
};

DecodeScratch carve_decode(const mha::Problem& p, Carve& carve) {
  const std::int64_t rows = p.q_heads / p.kv_heads * p.q_len;  // < kDecodeRows
  DecodeScratch s;
  s.tile = mha::support::decode_tile_keys(p, kDecodeKeys);
  s.ld_acc = round_up4(p.head_dim);
  s.acc = carve.take<float>(rows * s.ld_acc);
  s.weights = carve.take<float>(s.tile);
  return s;
}

// Decode's phases for one row and one tile, in the order the file's header lists them.

// logits[j] = scale q . k_j for the row's `cols` keys k_j = k + j k_seq (of type T, widened
// as they are loaded; i8: (scale q . k_j) s_j, the key's scale s_j = k_scales[j scale_seq]
// on the finished logit), 16 keys at a time over slices of 4 kDecodeQVectors columns;
// returns their max (NaN logits ignored, -inf if all are NaN or -inf).
// logits: [round_up(cols, 16)], lanes past cols hold 0 x scale.
template <mha::KvType T>
float row_logits(const float* q, const Elem<T>* k, std::int64_t k_seq, const float* k_scales,
                 std::int64_t scale_seq, std::int64_t cols, std::int64_t head_dim, float scale,
                 float* logits, Prefetch& prefetch) {
  const std::int64_t tail = head_dim % 4;
  const float32x4_t neg_inf = vdupq_n_f32(-std::numeric_limits<float>::infinity());
  float32x4_t mv = neg_inf;
  for (std::int64_t j0 = 0; j0 < cols; j0 += kDecodeKeys) {
    const std::int64_t nk = std::min(kDecodeKeys, cols - j0);
    const Elem<T>* keys = k + j0 * k_seq;
    float32x4_t a[kDecodeKeys];
    for (auto& x : a) x = vdupq_n_f32(0.0f);
    for (std::int64_t d0 = 0; d0 < head_dim; d0 += 4 * kDecodeQVectors) {
      with_slice<kDecodeQVectors>(head_dim - d0, [&](auto vectors, auto partial) {
        dot_16_keys<decltype(vectors)::value, decltype(partial)::value, T>(q + d0, keys + d0, k_seq,
                                                                           nk, tail, a);
      });
      prefetch.step();
    }
    for (int i = 0; i < kDecodeKeys; i += 4) {
      float32x4_t s = vmulq_n_f32(sum_lanes4(a[i], a[i + 1], a[i + 2], a[i + 3]), scale);
      if constexpr (T == mha::KvType::i8) {  // only the scales of the row's keys are read
        float key_scales[4] = {1.0f, 1.0f, 1.0f, 1.0f};
        for (std::int64_t u = 0; u < 4 && i + u < nk; ++u) {
          key_scales[u] = k_scales[(j0 + i + u) * scale_seq];
        }
        s = vmulq_f32(s, vld1q_f32(key_scales));
      }
      vst1q_f32(logits + j0 + i, s);
      // `>` (FCMGT) is false for NaN, so NaN logits stay out of the max, as in
      // online_softmax; lanes past the row's keys compare as -inf.
      const float32x4_t x = vbslq_f32(first_lanes(i, nk), s, neg_inf);
      mv = vbslq_f32(vcgtq_f32(x, mv), x, mv);
    }
  }
  return vmaxvq_f32(mv);  // no lane of mv is NaN
}

// The online-softmax step of a row over its `cols` logits of the tile (as online_softmax,
// but O's rescale is left to row_pv): the max m and sum l move on, the logits become the
// weights exp(s - m) (exactly 0 for -inf logits, NaN for NaN; lanes past cols 0). Returns
// alpha = exp(m_old - m_new), the factor for the row's O (exactly 0 when m_old is -inf).
float row_softmax(float* logits, std::int64_t cols, float tile_max, float* m, float* l) {
  float alpha = 1.0f;
  if (tile_max > *m) {
    alpha = std::exp(*m - tile_max);
    *m = tile_max;
  }
  const float32x4_t base = vdupq_n_f32(mha::support::logit_shift(*m));
  float32x4_t sum = vdupq_n_f32(0.0f);
  for (std::int64_t j = 0; j < cols; j += 4) {
    float32x4_t w = mha::neon::exp_nonpositive(vsubq_f32(vld1q_f32(logits + j), base));
    w = vbslq_f32(first_lanes(j, cols), w, vdupq_n_f32(0.0f));
    vst1q_f32(logits + j, w);
    sum = vaddq_f32(sum, w);
  }
  *l = *l * alpha + vaddvq_f32(sum);
  return alpha;
}

// O = alpha O + sum_{j < cols} w[j] v_j for one row, slices of 4 kDecodeOVectors columns
// (V of type T, widened as it is loaded; for i8 w[j] already holds the row's scale).
template <mha::KvType T>
void row_pv(const float* w, std::int64_t cols, const Elem<T>* v, std::int64_t v_seq,
            std::int64_t head_dim, float alpha, float* acc, Prefetch& prefetch) {
  const std::int64_t tail = head_dim % 4;
  for (std::int64_t d0 = 0; d0 < head_dim; d0 += 4 * kDecodeOVectors) {
    with_slice<kDecodeOVectors>(head_dim - d0, [&](auto vectors, auto partial) {
      add_weighted_rows<decltype(vectors)::value, decltype(partial)::value, T>(
          w, cols, v + d0, v_seq, tail, acc + d0, alpha, prefetch);
    });
  }
}

// The decode path: every (batch, KV head) is one block of its g x q_len rows, all of which
// read each KV tile while it is in L1, each over the keys it sees. K and V of type T, read
// in place and widened as they are loaded; an i8 key's scale multiplies its finished logit
// and an i8 value row's its weight (after the row's sum l), one rounding each, as
// tolerance.h's step 6 allows.
template <mha::KvType T>
void decode_rows(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                 float* lse, mha::Workspace ws) {
  Carve workspace(ws.data);
  const DecodeScratch s = carve_decode(p, workspace);
  const std::int64_t dim = p.head_dim, bd = s.tile;
  const mha::support::Softcap cap = mha::support::Softcap::of(p, 1.0);
  const mha::support::Alibi alibi = mha::support::Alibi::of(p, 1.0);
  // The step() calls of one row over a whole tile: one per 16 keys and q slice, one per key
  // and O slice.
  const std::int64_t row_steps =
      bd / kDecodeKeys * mha::support::ceil_div(dim, 4 * kDecodeQVectors) +
      bd * mha::support::ceil_div(dim, 4 * kDecodeOVectors);

  mha::support::for_each_block(p, p.q_len, [&](const Block& block) {
    float m[kDecodeRows], l[kDecodeRows];
    std::fill(m, m + block.rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + block.rows, 0.0f);
    std::fill(s.acc, s.acc + block.rows * s.ld_acc, 0.0f);
    const mha::KvView k_row0 = mha::kv_row(k, T, p.k, p.k_scale, block.batch, 0, block.kv_head);
    const mha::KvView v_row0 = mha::kv_row(v, T, p.v, p.v_scale, block.batch, 0, block.kv_head);
    const auto* k_head = static_cast<const Elem<T>*>(k_row0.data);
    const auto* v_head = static_cast<const Elem<T>*>(v_row0.data);
    constexpr auto kBytes = static_cast<std::int64_t>(sizeof(Elem<T>));
    // Keys [block_first, block_keys): a sliding window's tiles start at its first key.
    const std::int64_t block_keys = block.keys(p), block_first = block.first_key(p);
    Prefetch first_tile(k_head, p.k.seq, v_head, p.v.seq, block_first,
                        std::min(bd, block_keys - block_first), dim, kBytes, 1);
    first_tile.all();

    for (std::int64_t c0 = block_first; c0 < block_keys; c0 += bd) {
      const std::int64_t tile_keys = std::min(bd, block_keys - c0);
      Prefetch next(k_head, p.k.seq, v_head, p.v.seq, c0 + bd,
                    std::clamp(block_keys - c0 - bd, std::int64_t{0}, bd), dim, kBytes,
                    block.rows * row_steps);
      for (std::int64_t t = 0; t < block.rows; ++t) {
        // The row's keys of the tile: [c0 + first, c0 + first + cols).
        const std::int64_t first = block.tile_first_seen(p, t, c0, tile_keys);
        const std::int64_t cols = block.tile_keys_seen(p, t, c0, tile_keys) - first;
        if (cols == 0) continue;
        const std::int64_t j0 = c0 + first;
        const Elem<T>* k_tile = k_head + j0 * p.k.seq;
        const Elem<T>* v_tile = v_head + j0 * p.v.seq;
        const float* k_scales = scales_from<T>(k_row0.scale, j0, p.k_scale.seq);
        const float* v_scales = scales_from<T>(v_row0.scale, j0, p.v_scale.seq);
        float tile_max = row_logits<T>(block.q_row(p, q, t), k_tile, p.k.seq, k_scales,
                                       p.k_scale.seq, cols, dim, p.scale, s.weights, next);
        if (cap.on()) {  // the capped logits, and their max: the cap of the max
          cap.apply(s.weights, cols);
          tile_max = cap(tile_max);
        }
        if (alibi.on()) {  // the biased logits, and their max
          tile_max = alibi.add(alibi.rate(block.head(t)), alibi.distance(block.row(t), j0),
                               s.weights, cols);
        }
        const float alpha = row_softmax(s.weights, cols, tile_max, m + t, l + t);
        if constexpr (T == mha::KvType::i8) {  // w_j s_j: V's scales, after the sum
          for (std::int64_t j = 0; j < cols; ++j) s.weights[j] *= v_scales[j * p.v_scale.seq];
        }
        row_pv<T>(s.weights, cols, v_tile, p.v.seq, dim, alpha, s.acc + t * s.ld_acc, next);
      }
      next.all();
    }

    for (std::int64_t t = 0; t < block.rows; ++t) {
      finish_row(s.acc + t * s.ld_acc, m[t], l[t], mha::sink_of(p, block.head(t)),
                 mha::visible_keys(p, block.row(t)), dim, block.o_row(p, o, t),
                 block.lse_at(p, lse, t));
    }
  });
}

// The prefill path (the header's first path) over K and V of type T: each K tile widened as
// it is packed, each V tile of a reduced type widened into s.wide once for all the block's
// rows (an fp32 V tile is read in place). The products are the fp32 path's.
template <mha::KvType T>
void prefill(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
             float* lse, mha::Workspace ws) {
  const Tiling tiling = mha::support::flash_tiling(p);
  const std::int64_t bc = tiling.keys;
  Carve workspace(ws.data);
  const Scratch s = carve(p, tiling, workspace);

  mha::support::for_each_block(p, tiling.rows_per_head, [&](const Block& block) {
    start_block(block, s);
    const mha::KvView k_row0 = mha::kv_row(k, T, p.k, p.k_scale, block.batch, 0, block.kv_head);
    const mha::KvView v_row0 = mha::kv_row(v, T, p.v, p.v_scale, block.batch, 0, block.kv_head);
    const auto* k_head = static_cast<const Elem<T>*>(k_row0.data);
    const auto* v_head = static_cast<const Elem<T>*>(v_row0.data);
    const std::int64_t block_keys = block.keys(p);
    for (std::int64_t c0 = block.first_key(p); c0 < block_keys; c0 += bc) {
      const Tile tile{c0, std::min(bc, block_keys - c0)};
      pack_k_transposed<T>(k_head + c0 * p.k.seq, p.k.seq,
                           scales_from<T>(k_row0.scale, c0, p.k_scale.seq), p.k_scale.seq,
                           tile.keys, p.head_dim, s.kt, s.ld);
      tile_logits(p, block, tile, q, s);
      tile_softmax(p, block, tile, s);
      if constexpr (T == mha::KvType::f32) {
        tile_pv(p, block, tile, v_head + c0 * p.v.seq, p.v.seq, s);
      } else {
        widen_rows<T>(v_head + c0 * p.v.seq, p.v.seq,
                      scales_from<T>(v_row0.scale, c0, p.v_scale.seq), p.v_scale.seq, tile.keys,
                      p.head_dim, s.wide, s.ld_acc);
        tile_pv(p, block, tile, s.wide, s.ld_acc, s);
      }
    }
    finish_block(p, block, s, o, lse);
  });
}

}  // namespace

std::size_t mha_f32_attention_neon_workspace(const mha::Problem& p) {
  if (decodes(p)) return mha::support::workspace_bytes([&](Carve& c) { carve_decode(p, c); });
  // At least what the largest decode (kDecodeRows - 1 rows of this head_dim) needs: a
  // workspace never shrinks as q_len grows, even where the path changes (at head_dim 1, 7
  // decode rows, with their 256-key weights, need more than an 8-row prefill block).
  mha::Problem largest_decode = p;
  largest_decode.q_heads = p.kv_heads;
  largest_decode.q_len = kDecodeRows - 1;
  const Tiling tiling = mha::support::flash_tiling(p);
  return std::max(mha::support::workspace_bytes([&](Carve& c) { carve_decode(largest_decode, c); }),
                  mha::support::workspace_bytes([&](Carve& c) { carve(p, tiling, c); }));
}

void mha_f32_attention_neon(const mha::Problem& call, const float* q, mha::KvView k, mha::KvView v,
                            float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(call))
    return mha::each_sequence(mha_f32_attention_neon, call, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;
  // ALiBi's reach (support::AlibiReach): a sliding window past which no key weighs in.
  const mha::Problem p = mha::support::AlibiReach::apply(call, q, k, v);
  const auto run = [&](auto type) {
    constexpr mha::KvType kType = decltype(type)::value;
    if (decodes(p)) {
      decode_rows<kType>(p, q, k, v, o, lse, ws);
    } else {
      prefill<kType>(p, q, k, v, o, lse, ws);
    }
  };
  switch (p.kv_type) {
    case mha::KvType::f16:
      return run(std::integral_constant<mha::KvType, mha::KvType::f16>());
    case mha::KvType::bf16:
      return run(std::integral_constant<mha::KvType, mha::KvType::bf16>());
    case mha::KvType::i8:
      return run(std::integral_constant<mha::KvType, mha::KvType::i8>());
    case mha::KvType::f32:
      break;
  }
  run(std::integral_constant<mha::KvType, mha::KvType::f32>());
}

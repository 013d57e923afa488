// neon: multi-head attention with flash-attention tiling and an online softmax, in fp32,
// with AArch64 NEON intrinsics. The algorithm of kernels/blocked/blocked.cpp; read that
// file first.
//
// Computes what mha/attention.h specifies: per query head h (reading KV head h / g,
// g = q_heads / kv_heads), o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator, one KV tile at a time:
//
//   for each (batch, KV head, block of g x Br query rows):   for_each_block, start_block
//     for each KV tile of Bc keys some row of the block sees (causal: later tiles skipped):
//       pack K^T of the tile (4 x 4 transposes), zero-padded to      pack_k_transposed
//         a multiple of 4 keys; all g heads share it
//       S = scale * Q K^T        microkernel 4 rows x 16 keys        tile_logits
//       online softmax per row: running max m and sum l;             tile_softmax
//         vectorized exp (neon_exp.h)
//       O += P V                 microkernel 4 rows x 16 columns     tile_pv
//     o = O / l, lse = m + log(l)                                    finish_block
//
// ISA: AArch64 Advanced SIMD (mandatory on AArch64, no extra compiler flags). Both
// microkernels hold a 4 x 4 grid of 128-bit accumulators (16 of the 32 vector registers)
// and multiply by lane (FMLA v.4s, v.4s, v.s[l]) so four rows' operands come from one
// 4-float load each: 16 independent FMA chains cover 4 cycles of latency x up to 4 FMA
// pipes, with 4 operand registers and 4 broadcast sources, 24 registers in all.
//
// Tails: key counts, rows and head_dim of any size. Scratch tiles (K^T, S, accumulators)
// are padded to multiples of 4 floats so the microkernels use whole vectors there; tensor
// memory is only touched with whole vectors that lie inside a row (d + 4 <= head_dim) and
// lane by lane or scalar for the last head_dim % 4 elements. P V only visits the keys a row
// sees (rows of a microkernel block share the keys all of them see; each row then adds its
// own few extra keys alone), so NaN or Inf in a masked V row never reaches a row.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0,
// shared inputs); no alignment assumed (vld1q/vst1q are unaligned-safe). Reads only
// elements the strides address (of keys, only those some row of the block sees); writes
// only o's and lse's elements. Reads nothing past the end of any tensor.
//
// Tile sizes: mha::support::flash_tiling, as blocked (mha/support.h gives the reasoning).
//
// Workspace (the caller's; mha_f32_attention_neon_workspace gives its size), in floats
// (Bc4, D4 = Bc, D rounded up to 4): D x Bc4 (K^T) + R x Bc4 (scores) + R x D4
// (accumulators) + 2 R, R = g x Br: about 80 KiB at D = 128, g = 4.
//
// Depends on mha/attention.h, mha/support.h and neon_exp.h (this folder) only.
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "mha/attention.h"
#include "mha/support.h"
#include "neon_exp.h"

namespace {

using mha::support::Block;
using mha::support::Carve;
using mha::support::Tiling;

constexpr int kRows = 4;     // MR: rows per microkernel block
constexpr int kVectors = 4;  // NR = 4 x 4 = 16 floats per microkernel block

std::int64_t round_up4(std::int64_t n) { return mha::support::round_up(n, 4); }

// The first n (1..3) floats of x in the low lanes, zeros above: never reads x[n].
float32x4_t load_partial(const float* x, std::int64_t n) {
  float32x4_t r = vdupq_n_f32(0.0f);
  r = vld1q_lane_f32(x, r, 0);
  if (n > 1) r = vld1q_lane_f32(x + 1, r, 1);
  if (n > 2) r = vld1q_lane_f32(x + 2, r, 2);
  return r;
}

// acc[r][c] += b[c] * a[r][L]: the microkernels' FMA step, lane L a compile-time constant.
template <int MR, int NV, int L>
inline void fma_lane(float32x4_t (&acc)[MR][NV], const float32x4_t (&b)[NV],
                     const float32x4_t (&a)[MR]) {
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = vfmaq_laneq_f32(acc[r][c], b[c], a[r], L);
  }
}

// kt[d][j] = k[j][d] for j < cols, and 0 for cols <= j < round_up4(cols).
// k: [cols][head_dim], row stride k_seq   kt: [head_dim][ld]
void pack_k_transposed(const float* k, std::int64_t k_seq, std::int64_t cols, std::int64_t head_dim,
                       float* kt, std::int64_t ld) {
  std::int64_t j0 = 0;
  for (; j0 + 4 <= cols; j0 += 4) {
    const float* k0 = k + j0 * k_seq;
    const float* k1 = k0 + k_seq;
    const float* k2 = k1 + k_seq;
    const float* k3 = k2 + k_seq;
    std::int64_t d = 0;
    for (; d + 4 <= head_dim; d += 4) {  // a 4 x 4 transpose in registers
      const float32x4_t r0 = vld1q_f32(k0 + d), r1 = vld1q_f32(k1 + d);
      const float32x4_t r2 = vld1q_f32(k2 + d), r3 = vld1q_f32(k3 + d);
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
      out[0] = k0[d];
      out[1] = k1[d];
      out[2] = k2[d];
      out[3] = k3[d];
    }
  }
  const std::int64_t padded = round_up4(cols);
  for (std::int64_t d = 0; d < head_dim; ++d) {
    for (std::int64_t j = j0; j < padded; ++j) kt[d * ld + j] = j < cols ? k[j * k_seq + d] : 0.0f;
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

// One row's online-softmax step over its `cols` logits of this tile (as blocked's
// online_softmax): s becomes the weights exp(s - m). s has whole vectors up to
// round_up4(cols) (scratch); lanes past cols are overwritten but not summed.
void online_softmax(float* s, std::int64_t cols, float* m, float* l, float* acc,
                    std::int64_t ld_acc) {
  const float m_old = *m;
  // `>` (FCMGT) ignores NaN logits as blocked does, so m never becomes NaN; their weights
  // are NaN and reach l and acc.
  float32x4_t mv = vdupq_n_f32(-std::numeric_limits<float>::infinity());
  std::int64_t j = 0;
  for (; j + 4 <= cols; j += 4) {
    const float32x4_t x = vld1q_f32(s + j);
    mv = vbslq_f32(vcgtq_f32(x, mv), x, mv);
  }
  float m_new = std::max(m_old, vmaxvq_f32(mv));  // no lane of mv is NaN
  for (; j < cols; ++j) m_new = s[j] > m_new ? s[j] : m_new;

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
  j = 0;
  for (; j + 4 <= cols; j += 4) {
    const float32x4_t w = mha::neon::exp_nonpositive(vsubq_f32(vld1q_f32(s + j), base));
    vst1q_f32(s + j, w);
    sum = vaddq_f32(sum, w);
  }
  if (j < cols) {  // lanes past cols hold other keys' logits: computed, masked out of l
    const float32x4_t w = mha::neon::exp_nonpositive(vsubq_f32(vld1q_f32(s + j), base));
    vst1q_f32(s + j, w);
    const std::int32_t lane_ids[4] = {0, 1, 2, 3};
    const uint32x4_t keep =
        vcltq_s32(vld1q_s32(lane_ids), vdupq_n_s32(static_cast<std::int32_t>(cols - j)));
    sum = vaddq_f32(sum, vbslq_f32(keep, w, vdupq_n_f32(0.0f)));
  }
  *l += vaddvq_f32(sum);
}

// o = acc / l and lse = m + log(l) (see blocked's finish_row).
void finish_row(const float* acc, float m, float l, std::int64_t visible, std::int64_t head_dim,
                float* o, float* lse) {
  std::int64_t d = 0;
  if (visible == 0) {
    for (; d + 4 <= head_dim; d += 4) vst1q_f32(o + d, vdupq_n_f32(0.0f));
    for (; d < head_dim; ++d) o[d] = 0.0f;
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const float32x4_t lv = vdupq_n_f32(l);  // a division: one rounding, as the tolerance assumes
  for (; d + 4 <= head_dim; d += 4) vst1q_f32(o + d, vdivq_f32(vld1q_f32(acc + d), lv));
  for (; d < head_dim; ++d) o[d] = acc[d] / l;
  if (lse != nullptr) *lse = mha::support::row_lse(m, l);
}

// The kernel's arrays in the caller's workspace, sized for the largest block. Row strides
// are padded to whole vectors: ld = Bc rounded up to 4 (K^T, S), ld_acc = head_dim
// rounded up to 4 (accumulators).
struct Scratch {
  std::int64_t ld, ld_acc;
  float* kt;   // [head_dim][ld]: the K^T tile
  float* s;    // [R][ld]: the block's logits, then its weights
  float* acc;  // [R][ld_acc]: the block's O accumulators
  float* m;    // [R]: running maxima
  float* l;    // [R]: running sums
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
  return s;
}

// The KV tile of keys [c0, c0 + keys) in the block's loop.
struct Tile {
  std::int64_t c0, keys;
};

// The phases of one block, in the order the file's header lists them.

void start_block(const Block& block, const Scratch& s) {
  std::fill(s.m, s.m + block.rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + block.rows, 0.0f);
  std::fill(s.acc, s.acc + block.rows * s.ld_acc, 0.0f);
}

// S = scale Q K^T, kRows block rows at a time, up to the last key one of them sees.
void tile_logits(const mha::Problem& p, const Block& block, const Tile& tile, const float* q,
                 const Scratch& s) {
  for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
    const std::int64_t nr = std::min<std::int64_t>(kRows, block.rows - t0);
    const float* qr[kRows];
    std::int64_t most = 0;  // columns the rows need (others are ignored)
    for (std::int64_t r = 0; r < nr; ++r) {
      qr[r] = block.q_row(p, q, t0 + r);
      most = std::max(most, block.tile_keys_seen(p, t0 + r, tile.c0, tile.keys));
    }
    mha::support::with_count<kRows>(nr, [&](auto rows) {
      logits_rows<decltype(rows)::value>(qr, s.kt, s.ld, p.head_dim, round_up4(most), p.scale,
                                         s.s + t0 * s.ld);
    });
  }
}

// The online-softmax step of every block row that sees a key of the tile.
void tile_softmax(const mha::Problem& p, const Block& block, const Tile& tile, const Scratch& s) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    const std::int64_t n = block.tile_keys_seen(p, t, tile.c0, tile.keys);
    if (n > 0) online_softmax(s.s + t * s.ld, n, s.m + t, s.l + t, s.acc + t * s.ld_acc, s.ld_acc);
  }
}

// O += P V, kRows block rows at a time: keys every row of the group sees through the
// nr-row microkernel; a row's keys past those (the causal diagonal) through a one-row pass
// of its own. v_tile: the tile's first V row.
void tile_pv(const mha::Problem& p, const Block& block, const Tile& tile, const float* v_tile,
             const Scratch& s) {
  for (std::int64_t t0 = 0; t0 < block.rows; t0 += kRows) {
    const std::int64_t nr = std::min<std::int64_t>(kRows, block.rows - t0);
    std::int64_t shared = tile.keys;
    for (std::int64_t r = 0; r < nr; ++r) {
      shared = std::min(shared, block.tile_keys_seen(p, t0 + r, tile.c0, tile.keys));
    }
    const float* p_rows = s.s + t0 * s.ld;
    float* acc_rows = s.acc + t0 * s.ld_acc;
    mha::support::with_count<kRows>(nr, [&](auto rows) {
      pv_rows<decltype(rows)::value>(p_rows, s.ld, shared, v_tile, p.v.seq, p.head_dim, acc_rows,
                                     s.ld_acc);
    });
    for (std::int64_t r = 0; r < nr; ++r) {
      const std::int64_t extra = block.tile_keys_seen(p, t0 + r, tile.c0, tile.keys) - shared;
      pv_rows<1>(p_rows + r * s.ld + shared, s.ld, extra, v_tile + shared * p.v.seq, p.v.seq,
                 p.head_dim, acc_rows + r * s.ld_acc, s.ld_acc);
    }
  }
}

// o = O / l, lse = m + log(l) for every block row.
void finish_block(const mha::Problem& p, const Block& block, const Scratch& s, float* o,
                  float* lse) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    finish_row(s.acc + t * s.ld_acc, s.m[t], s.l[t], mha::visible_keys(p, block.row(t)), p.head_dim,
               block.o_row(p, o, t), block.lse_at(p, lse, t));
  }
}

}  // namespace

std::size_t mha_f32_attention_neon_workspace(const mha::Problem& p) {
  const Tiling tiling = mha::support::flash_tiling(p);
  return mha::support::workspace_bytes([&](Carve& c) { carve(p, tiling, c); });
}

void mha_f32_attention_neon(const mha::Problem& p, const float* q, const float* k, const float* v,
                            float* o, float* lse, mha::Workspace ws) {
  const Tiling tiling = mha::support::flash_tiling(p);
  const std::int64_t bc = tiling.keys;
  Carve workspace(ws.data);
  const Scratch s = carve(p, tiling, workspace);

  mha::support::for_each_block(p, tiling.rows_per_head, [&](const Block& block) {
    start_block(block, s);
    const float* k_head = block.k_head(p, k);
    const float* v_head = block.v_head(p, v);
    const std::int64_t block_keys = block.keys(p);
    for (std::int64_t c0 = 0; c0 < block_keys; c0 += bc) {
      const Tile tile{c0, std::min(bc, block_keys - c0)};
      pack_k_transposed(k_head + c0 * p.k.seq, p.k.seq, tile.keys, p.head_dim, s.kt, s.ld);
      tile_logits(p, block, tile, q, s);
      tile_softmax(p, block, tile, s);
      tile_pv(p, block, tile, v_head + c0 * p.v.seq, s);
    }
    finish_block(p, block, s, o, lse);
  });
}

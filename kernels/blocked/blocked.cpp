// blocked: multi-head attention with flash-attention tiling and an online softmax, in fp32,
// over K and V of any KvType.
//
// Computes what mha/attention.h specifies (per query head h, reading KV head h / g with
// g = q_heads / kv_heads: o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator) without ever holding a score row longer than one KV tile:
//
//   for each (batch, KV head, block of query rows):           for_each_block, start_block
//     block rows = the group's g query heads x up to Br query rows each
//     for each KV tile of Bc keys that some row of the block sees:
//       pack K^T of the tile                          once for all g heads: pack_k_transposed
//       S = scale * Q K^T (soft-capped: c tanh(S / c); ALiBi) [rows][Bc]  tile_logits
//       online softmax: running max m and sum l per row; when m grows, the  tile_softmax
//       accumulator and l are rescaled by the same exp(m_old - m_new); S becomes the weights P
//       O += P V                                      [rows][head_dim]    tile_pv
//     o = O / l, lse = m + log(l)                                         finish_block
//
// Causal masking is bottom-right aligned, so every row sees a prefix of the keys and the
// mask is a per-row column count: tiles past the block's last visible key are never
// visited, tiles below the diagonal run at full width, and only tiles crossing the
// diagonal are cut short per row. A sliding window is a per-row first key likewise: the
// block's tiles start at its first row's first key, and each row's products, softmax and
// P V start at its own (so V rows outside a row's window never reach it, not even as 0 x
// Inf). A row that sees no key is written as zeros, lse = -inf.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0,
// shared or fused inputs); no alignment assumed. Reads only elements the strides address
// (of keys, only those some row of the block sees); writes only o's and lse's elements,
// each once. Reads nothing past the end of any tensor.
//
// ISA: portable C++17, no intrinsics. Both products are loops whose innermost index is
// contiguous and carries no reduction (K is packed transposed for that), so compilers
// vectorize them without reassociating floating-point sums; every logit is summed over
// head_dim in order and every output over the keys in order, as in the naive kernel.
//
// Tile sizes: mha::support::flash_tiling (mha/support.h gives the reasoning).
//
// K and V stored as f16, bf16 or i8 (p.kv_type): each tile's rows are widened to fp32 into
// a Bc x head_dim buffer as they are read (mha::kv::widen_rows), K's then packed from there,
// V's read from there by P V. The arithmetic after that is the fp32 path's, so a cache of
// values the smaller type holds exactly gives the fp32 cache's output, bit for bit.
//
// Workspace (the caller's; mha_f32_attention_blocked_workspace gives its size), in floats:
// Bc x head_dim (K^T tile) + R x Bc (scores) + R x head_dim (accumulators) + 2 R (m, l),
// + Bc x head_dim (the widened K or V tile) when kv_type is not f32, and 2 R int64s (each
// row's keys of the tile),
// with R = g x Br block rows. For D = 128 and g = 4 that is 32 + 16 + 32 KiB; it depends on
// head_dim and g, never on q_len or kv_len beyond Bc and Br.
//
// Floating-point environment: the default one for the call (mha::FpEnvGuard, mha/attention.h),
// so the caller's flush-to-zero, denormals-are-zero or rounding mode changes no bit of the
// output, and the caller's control bits are as they were on return.
//
// Depends on mha/attention.h, mha/kv_types.h, mha/support.h and the standard library only.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "mha/attention.h"
#include "mha/kv_types.h"
#include "mha/support.h"

namespace {

using mha::support::Block;
using mha::support::Carve;
using mha::support::Tiling;

// kt[d][j] = k[j][d] for j < cols: the K^T tile, row stride ld.
// k: [cols][head_dim], row stride k_seq   kt: [head_dim][ld]
void pack_k_transposed(const float* k, std::int64_t k_seq, std::int64_t cols, std::int64_t head_dim,
                       float* kt, std::int64_t ld) {
  // Eight keys at a time: a key at a time writes one float into each of head_dim cache
  // lines, which made packing about 10% of the kernel's time at D = 128 (4% like this).
  constexpr std::int64_t kKeys = 8;
  std::int64_t j0 = 0;
  for (; j0 + kKeys <= cols; j0 += kKeys) {
    const float* k_rows = k + j0 * k_seq;
    for (std::int64_t d = 0; d < head_dim; ++d) {
      float* kt_d = kt + d * ld + j0;
      for (std::int64_t j = 0; j < kKeys; ++j) kt_d[j] = k_rows[j * k_seq + d];
    }
  }
  for (; j0 < cols; ++j0) {
    const float* k_row = k + j0 * k_seq;
    for (std::int64_t d = 0; d < head_dim; ++d) kt[d * ld + j0] = k_row[d];
  }
}

// s[j] = scale * sum_d q[d] kt[d][j] for j < cols: one row of S = scale * Q K^T.
// Broadcast q[d] times a contiguous row of K^T is the shape a SIMD microkernel uses too.
// Four d per pass load and store s once per four products instead of once per product;
// `s + a + b + c + d` parses as (((s + a) + b) + c) + d, so each logit is still summed
// in order over d and the result is the same as one d at a time.
// q: [head_dim]   kt: [head_dim][ld]   s: [cols]
void logits(const float* q, const float* kt, std::int64_t ld, std::int64_t head_dim,
            std::int64_t cols, float scale, float* s) {
  for (std::int64_t j = 0; j < cols; ++j) s[j] = 0.0f;
  std::int64_t d = 0;
  for (; d + 4 <= head_dim; d += 4) {
    const float q0 = q[d], q1 = q[d + 1], q2 = q[d + 2], q3 = q[d + 3];
    const float* k0 = kt + d * ld;
    const float* k1 = k0 + ld;
    const float* k2 = k1 + ld;
    const float* k3 = k2 + ld;
    for (std::int64_t j = 0; j < cols; ++j) {
      s[j] = s[j] + q0 * k0[j] + q1 * k1[j] + q2 * k2[j] + q3 * k3[j];
    }
  }
  for (; d < head_dim; ++d) {
    const float q_d = q[d];
    const float* kt_d = kt + d * ld;
    for (std::int64_t j = 0; j < cols; ++j) s[j] += q_d * kt_d[j];
  }
  for (std::int64_t j = 0; j < cols; ++j) s[j] *= scale;
}

// One row's online-softmax step over its `cols` logits in this tile: rescales acc and l
// when the max grew, turns s into the weights exp(s - m), and adds them to l.
// s: [cols]   acc: [head_dim]
void online_softmax(float* s, std::int64_t cols, float* m, float* l, float* acc,
                    std::int64_t head_dim) {
  // `>` ignores NaN logits, so m never becomes NaN; their weights below are NaN instead,
  // and that NaN reaches l and acc.
  const float m_old = *m;
  float m_new = m_old;
  for (std::int64_t j = 0; j < cols; ++j) m_new = s[j] > m_new ? s[j] : m_new;

  if (m_new > m_old) {
    // The same factor for acc and l, so its own rounding cancels in acc / l. m_new > m_old
    // rules out -inf - (-inf), and m_old = -inf gives exactly 0. When the max did not grow
    // the factor would be 1: skipped.
    const float alpha = std::exp(m_old - m_new);
    *l *= alpha;
    for (std::int64_t d = 0; d < head_dim; ++d) acc[d] *= alpha;
    *m = m_new;
  }

  const float base = mha::support::logit_shift(m_new);
  float sum = 0.0f;
  for (std::int64_t j = 0; j < cols; ++j) {
    s[j] = std::exp(s[j] - base);
    sum += s[j];
  }
  *l += sum;
}

// acc[d] += sum_j p[j] v[j][d] for j < cols: one row of O += P V. The inner loop runs over
// d, contiguous in acc and in the V row. Four keys per pass, added in key order as in
// logits(): acc is loaded and stored once per four products.
// p: [cols]   v: [cols][head_dim], row stride v_seq   acc: [head_dim]
void accumulate_pv(const float* p, std::int64_t cols, const float* v, std::int64_t v_seq,
                   std::int64_t head_dim, float* acc) {
  std::int64_t j = 0;
  for (; j + 4 <= cols; j += 4) {
    const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
    const float* v0 = v + j * v_seq;
    const float* v1 = v0 + v_seq;
    const float* v2 = v1 + v_seq;
    const float* v3 = v2 + v_seq;
    for (std::int64_t d = 0; d < head_dim; ++d) {
      acc[d] = acc[d] + p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
  }
  for (; j < cols; ++j) {
    const float p_j = p[j];
    const float* v_row = v + j * v_seq;
    for (std::int64_t d = 0; d < head_dim; ++d) acc[d] += p_j * v_row[d];
  }
}

// o = acc / l and lse = m + log(l) for a row that sees `visible` keys in all.
// acc, o: [head_dim]
void finish_row(const float* acc, float m, float l, float sink, std::int64_t visible,
                std::int64_t head_dim, float* o, float* lse) {
  if (visible == 0) {  // the contract: zeros and the sink (-inf without), not 0 / 0
    for (std::int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
    if (lse != nullptr) *lse = sink;
    return;
  }
  const mha::RowEnd end = mha::support::row_end(m, l, sink);
  // A division rather than a multiply by 1 / l: one rounding, as the tolerance assumes.
  for (std::int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] / end.divisor;
  if (lse != nullptr) *lse = end.lse;
}

// The kernel's arrays in the caller's workspace, sized for the largest block.
struct Scratch {
  float* kt;            // [head_dim][Bc]: the K^T tile
  float* s;             // [R][Bc]: the block's logits, then its weights
  float* acc;           // [R][head_dim]: the block's O accumulators
  float* m;             // [R]: running maxima
  float* l;             // [R]: running sums
  std::int64_t* first;  // [R]: the keys of this tile each row sees: [first, first + count)
  std::int64_t* count;
  float* wide;  // [Bc][head_dim]: a K or V tile widened to fp32 (kv_type not f32; else null)
};

Scratch carve(const mha::Problem& p, const Tiling& tiling, Carve& carve) {
  const std::int64_t rows = p.q_heads / p.kv_heads * tiling.rows_per_head;
  Scratch s;
  s.kt = carve.take<float>(tiling.keys * p.head_dim);
  s.s = carve.take<float>(rows * tiling.keys);
  s.acc = carve.take<float>(rows * p.head_dim);
  s.m = carve.take<float>(rows);
  s.l = carve.take<float>(rows);
  s.first = carve.take<std::int64_t>(rows);
  s.count = carve.take<std::int64_t>(rows);
  s.wide = p.kv_type == mha::KvType::f32 ? nullptr : carve.take<float>(tiling.keys * p.head_dim);
  return s;
}

// The phases of one block, in the order the file's header lists them.

void start_block(const Block& block, std::int64_t head_dim, const Scratch& s) {
  std::fill(s.m, s.m + block.rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + block.rows, 0.0f);
  std::fill(s.acc, s.acc + block.rows * head_dim, 0.0f);
}

// The KV tile of keys [c0, c0 + keys) in the block's loop.
struct Tile {
  std::int64_t c0, keys;
};

// S = scale Q K^T for every block row over the keys of the tile it sees (K^T in s.kt).
// The keys of the tile each block row sees, into s.first and s.count.
void tile_keys(const mha::Problem& p, const Block& block, const Tile& tile, const Scratch& s) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    s.first[t] = block.tile_first_seen(p, t, tile.c0, tile.keys);
    s.count[t] = block.tile_keys_seen(p, t, tile.c0, tile.keys) - s.first[t];
  }
}

// With a soft-cap (Problem::softcap) each row's logits are then capped in place, and with
// ALiBi (Problem::alibi) biased.
void tile_logits(const mha::Problem& p, const Block& block, const Tile& tile, const float* q,
                 std::int64_t bc, const Scratch& s) {
  const mha::support::Softcap cap = mha::support::Softcap::of(p, 1.0);
  const mha::support::Alibi alibi = mha::support::Alibi::of(p, 1.0);
  for (std::int64_t t = 0; t < block.rows; ++t) {
    float* row = s.s + t * bc + s.first[t];
    logits(block.q_row(p, q, t), s.kt + s.first[t], bc, p.head_dim, s.count[t], p.scale, row);
    if (cap.on()) cap.apply(row, s.count[t]);
    if (alibi.on()) {
      alibi.add(alibi.rate(block.head(t)), alibi.distance(block.row(t), tile.c0 + s.first[t]), row,
                s.count[t]);
    }
  }
}

// The online-softmax step of every block row: S becomes the weights P.
void tile_softmax(const mha::Problem& p, const Block& block, std::int64_t bc, const Scratch& s) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    online_softmax(s.s + t * bc + s.first[t], s.count[t], s.m + t, s.l + t, s.acc + t * p.head_dim,
                   p.head_dim);
  }
}

// O += P V for every block row; v_tile: the tile's first V row, rows v_seq apart.
void tile_pv(const mha::Problem& p, const Block& block, const float* v_tile, std::int64_t v_seq,
             std::int64_t bc, const Scratch& s) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    accumulate_pv(s.s + t * bc + s.first[t], s.count[t], v_tile + s.first[t] * v_seq, v_seq,
                  p.head_dim, s.acc + t * p.head_dim);
  }
}

// o = O / l, lse = m + log(l) for every block row.
void finish_block(const mha::Problem& p, const Block& block, const Scratch& s, float* o,
                  float* lse) {
  for (std::int64_t t = 0; t < block.rows; ++t) {
    finish_row(s.acc + t * p.head_dim, s.m[t], s.l[t], mha::sink_of(p, block.head(t)),
               mha::visible_keys(p, block.row(t)), p.head_dim, block.o_row(p, o, t),
               block.lse_at(p, lse, t));
  }
}

}  // namespace

std::size_t mha_f32_attention_blocked_workspace(const mha::Problem& p) {
  const Tiling tiling = mha::support::flash_tiling(p);
  return mha::support::workspace_bytes([&](Carve& c) { carve(p, tiling, c); });
}

void mha_f32_attention_blocked(const mha::Problem& call, const float* q, mha::KvView k,
                               mha::KvView v, float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(call))
    return mha::each_sequence(mha_f32_attention_blocked, call, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;
  // ALiBi's reach (support::AlibiReach): a sliding window past which no key weighs in.
  const mha::Problem p = mha::support::AlibiReach::apply(call, q, k, v);
  const Tiling tiling = mha::support::flash_tiling(p);
  const std::int64_t bc = tiling.keys;
  Carve workspace(ws.data);
  const Scratch s = carve(p, tiling, workspace);
  const mha::KvType type = p.kv_type;

  mha::support::for_each_block(p, tiling.rows_per_head, [&](const Block& block) {
    start_block(block, p.head_dim, s);
    // Rows [c0, c0 + keys) of the block's KV head of x (K or V), as fp32 rows `seq` apart:
    // in place for f32, else widened into s.wide.
    const auto tile_rows = [&](const mha::KvView& x, const mha::Strides& st,
                               const mha::Strides& scale_st, std::int64_t c0, std::int64_t keys,
                               std::int64_t* seq) -> const float* {
      const mha::KvView rows = mha::kv_row(x, type, st, scale_st, block.batch, c0, block.kv_head);
      if (type == mha::KvType::f32) {
        *seq = st.seq;
        return static_cast<const float*>(rows.data);
      }
      mha::kv::widen_rows(type, rows.data, st.seq, rows.scale, scale_st.seq, keys, p.head_dim,
                          s.wide);
      *seq = p.head_dim;
      return s.wide;
    };
    const std::int64_t block_keys = block.keys(p);
    for (std::int64_t c0 = block.first_key(p); c0 < block_keys; c0 += bc) {
      const Tile tile{c0, std::min(bc, block_keys - c0)};
      std::int64_t seq = 0;
      const float* k_tile = tile_rows(k, p.k, p.k_scale, c0, tile.keys, &seq);
      pack_k_transposed(k_tile, seq, tile.keys, p.head_dim, s.kt, bc);
      tile_keys(p, block, tile, s);
      tile_logits(p, block, tile, q, bc, s);
      tile_softmax(p, block, bc, s);
      const float* v_tile = tile_rows(v, p.v, p.v_scale, c0, tile.keys, &seq);
      tile_pv(p, block, v_tile, seq, bc, s);
    }
    finish_block(p, block, s, o, lse);
  });
}

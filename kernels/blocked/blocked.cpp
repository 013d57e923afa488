// blocked: multi-head attention with flash-attention tiling and an online softmax, in fp32.
//
// Computes what mha/attention.h specifies (per query head h, reading KV head h / g with
// g = q_heads / kv_heads: o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator) without ever holding a score row longer than one KV tile:
//
//   for each (batch, KV head, block of query rows):
//     block rows = the group's g query heads x up to Br query rows each
//     for each KV tile of Bc keys that some row of the block sees:
//       pack K^T of the tile                          once for all g heads of the group
//       S = scale * Q K^T                             [rows][Bc]
//       online softmax: running max m and sum l per row; when m grows, the accumulator
//       and l are rescaled by the same exp(m_old - m_new); S becomes the weights P
//       O += P V                                      [rows][head_dim]
//     o = O / l, lse = m + log(l)
//
// Causal masking is bottom-right aligned, so every row sees a prefix of the keys and the
// mask is a per-row column count: tiles past the block's last visible key are never
// visited, tiles below the diagonal run at full width, and only tiles crossing the
// diagonal are cut short per row. A row that sees no key is written as zeros, lse = -inf.
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
// Scratch, allocated once per call, in floats: Bc x head_dim (K^T tile) + R x Bc (scores)
// + R x head_dim (accumulators) + 2 R (m, l), with R = g x Br block rows. For D = 128 and
// g = 4 that is 32 + 16 + 32 KiB; it depends on head_dim and g, never on q_len or kv_len.
//
// Depends on mha/attention.h and the standard library only.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "mha/attention.h"

namespace {

// Tile sizes, from caches assumed per core: L1d 32-48 KiB, L2 >= 1 MiB. They are constants
// (the kernel does not query the OS), so results never depend on the machine.
//
// KV tile, Bc keys: the K^T tile and the V tile hold Bc x head_dim floats each, 32 KiB.
// The S phase streams K^T once per block row and the PV phase streams V once per block row,
// so each phase reuses one L1-sized operand across all R rows, and both stay in L2 between
// the phases. D = 128: Bc = 8192 / 128 = 64 keys, K and V 2 x 64 x 128 x 4 B = 64 KiB.
// At least 16 keys keep the vectorized loop over keys long (above D = 512 the tiles
// outgrow L1 and live in L2: D = 4096 gives 2 x 256 KiB); at most 256 bound the score tile.
constexpr std::int64_t kKvTileFloats = 8192;  // 32 KiB
constexpr std::int64_t kMinKeys = 16;
constexpr std::int64_t kMaxKeys = 256;

// Query block, R = g x Br rows: R x head_dim accumulators in 32 KiB. D = 128, g = 4:
// Br = 8192 / (4 x 128) = 16 query rows, R = 64; accumulators 64 x 128 x 4 B = 32 KiB,
// scores 64 x 64 x 4 B = 16 KiB, the block's Q rows (read in place) 32 KiB: with the KV
// tiles 144 KiB, well inside L2. Each KV tile then comes from memory once per 16 query rows
// and feeds 2 x R x Bc x D = 1 M multiply-adds (16 per byte of K and V). Br is at
// most 64, so causal block skipping keeps a fine grain, and at least 1: when g x D > 8192 a
// block is one row of each head.
constexpr std::int64_t kAccFloats = 8192;  // 32 KiB
constexpr std::int64_t kMaxRowsPerHead = 64;

struct Tiling {
  std::int64_t keys;           // Bc: keys per KV tile
  std::int64_t rows_per_head;  // Br: query rows per head in one block
};

Tiling choose_tiling(const mha::Problem& p) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  Tiling t;
  t.keys = std::min(std::clamp(kKvTileFloats / p.head_dim, kMinKeys, kMaxKeys), p.kv_len);
  t.rows_per_head = std::clamp(kAccFloats / (group * p.head_dim), std::int64_t{1}, kMaxRowsPerHead);
  t.rows_per_head = std::min(t.rows_per_head, p.q_len);
  return t;
}

// What a row's logits are taken relative to. While all its logits so far are -inf (or
// NaN) the running max is -inf, and exp(-inf - (-inf)) would be NaN where the weight must
// be 0. Relative to 0 instead, -inf logits weigh exp(-inf) = 0 exactly and NaN logits stay
// NaN; when a finite max arrives, the rescale factor exp(-inf - m) = 0 clears the zeros
// (and keeps a NaN a NaN).
float subtrahend(float m) { return m == -std::numeric_limits<float>::infinity() ? 0.0f : m; }

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

  const float base = subtrahend(m_new);
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
void finish_row(const float* acc, float m, float l, std::int64_t visible, std::int64_t head_dim,
                float* o, float* lse) {
  if (visible == 0) {  // the contract: zeros and -inf, not 0 / 0
    for (std::int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  // A division rather than a multiply by 1 / l: one rounding, as the tolerance assumes.
  for (std::int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] / l;
  if (lse != nullptr) {
    // l >= 1 once a finite max was seen. l == 0 means every logit was -inf (possible only
    // with infinite inputs): the softmax is 0 / 0 and o is NaN, so lse is NaN too, as the
    // reference's two-pass formula gives.
    *lse = l == 0.0f ? std::numeric_limits<float>::quiet_NaN() : subtrahend(m) + std::log(l);
  }
}

}  // namespace

void mha_f32_attention_blocked(const mha::Problem& p, const float* q, const float* k,
                               const float* v, float* o, float* lse) {
  const std::int64_t group = p.q_heads / p.kv_heads;  // query heads per KV head
  const std::int64_t dim = p.head_dim;
  const Tiling tiling = choose_tiling(p);
  const std::int64_t bc = tiling.keys;
  const std::int64_t max_rows = group * tiling.rows_per_head;

  std::vector<float> kt_tile(static_cast<std::size_t>(bc * dim));         // [dim][bc]
  std::vector<float> s_tile(static_cast<std::size_t>(max_rows * bc));     // [rows][bc]
  std::vector<float> acc_tile(static_cast<std::size_t>(max_rows * dim));  // [rows][dim]
  std::vector<float> m_rows(static_cast<std::size_t>(max_rows));
  std::vector<float> l_rows(static_cast<std::size_t>(max_rows));
  float* const kt = kt_tile.data();
  float* const s = s_tile.data();
  float* const acc = acc_tile.data();
  float* const m = m_rows.data();
  float* const l = l_rows.data();

  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.kv_heads; ++kv_head) {
      // k, v of this (batch, KV head): [kv_len][head_dim], row strides p.k.seq, p.v.seq
      const float* k_head = k + b * p.k.batch + kv_head * p.k.head;
      const float* v_head = v + b * p.v.batch + kv_head * p.v.head;
      const std::int64_t head0 = kv_head * group;  // the group's first query head

      for (std::int64_t r0 = 0; r0 < p.q_len; r0 += tiling.rows_per_head) {
        // Block row t is query head head0 + t / br, query row r0 + t % br: all heads of
        // the group share every KV tile while it is in cache.
        const std::int64_t br = std::min(tiling.rows_per_head, p.q_len - r0);
        const std::int64_t rows = group * br;
        const auto q_row = [&](std::int64_t t) {
          return q + b * p.q.batch + (r0 + t % br) * p.q.seq + (head0 + t / br) * p.q.head;
        };
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        std::fill(acc, acc + rows * dim, 0.0f);

        // Each row sees a prefix of the keys, the block's last row the longest: tiles past
        // it are masked for every row of the block and never visited.
        const std::int64_t block_keys = mha::visible_keys(p, r0 + br - 1);
        for (std::int64_t c0 = 0; c0 < block_keys; c0 += bc) {
          const std::int64_t tile_keys = std::min(bc, block_keys - c0);
          // The tile's keys that block row t sees: all of them below the diagonal, a
          // prefix where the tile crosses it (the causal mask), none above it.
          const auto cols = [&](std::int64_t t) {
            const std::int64_t n = mha::visible_keys(p, r0 + t % br) - c0;
            return std::clamp(n, std::int64_t{0}, tile_keys);
          };

          pack_k_transposed(k_head + c0 * p.k.seq, p.k.seq, tile_keys, dim, kt, bc);
          for (std::int64_t t = 0; t < rows; ++t) {
            logits(q_row(t), kt, bc, dim, cols(t), p.scale, s + t * bc);
          }
          for (std::int64_t t = 0; t < rows; ++t) {
            online_softmax(s + t * bc, cols(t), m + t, l + t, acc + t * dim, dim);
          }
          const float* v_tile = v_head + c0 * p.v.seq;
          for (std::int64_t t = 0; t < rows; ++t) {
            accumulate_pv(s + t * bc, cols(t), v_tile, p.v.seq, dim, acc + t * dim);
          }
        }

        for (std::int64_t t = 0; t < rows; ++t) {
          const std::int64_t row = r0 + t % br, head = head0 + t / br;
          finish_row(acc + t * dim, m[t], l[t], mha::visible_keys(p, row), dim,
                     o + b * p.o.batch + row * p.o.seq + head * p.o.head,
                     lse != nullptr ? lse + b * p.lse.batch + head * p.lse.head + row : nullptr);
        }
      }
    }
  }
}

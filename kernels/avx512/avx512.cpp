// avx512: multi-head attention with flash-attention tiling and an online softmax, in fp32,
// with x86-64 AVX-512 intrinsics. The design of kernels/neon/neon.cpp (and the algorithm of
// kernels/blocked/blocked.cpp; read that file first) with 16-float zmm vectors.
//
// Computes what mha/attention.h specifies: per query head h (reading KV head h / g,
// g = q_heads / kv_heads), o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator, one KV tile at a time:
//
//   for each (batch, KV head, block of g x Br query rows):   all g heads share each KV tile
//     for each KV tile of Bc keys some row of the block sees (causal: later tiles skipped):
//       pack K^T of the tile (16 x 16 transposes), zero-padded to a multiple of 16 keys
//       S = scale * Q K^T        microkernel 4 rows x 64 keys (4 zmm)
//       online softmax per row: running max m and sum l; vectorized exp (avx512_exp.h)
//       O += P V                 microkernel 4 rows x 64 columns of head_dim (4 zmm)
//     o = O / l, lse = m + log(l)
//
// ISA: AVX-512F (+ FMA; the file is compiled with -mavx512f -mavx512vl -mavx512dq
// -mavx512bw -mfma and only called when the CPU has them). Both microkernels hold a 4 x 4
// grid of zmm accumulators (16 of the 32 registers): 16 independent FMA chains cover
// 2 FMA ports x 4 cycles of latency twice over. Each step loads 4 zmm of the packed K^T
// (or of a V row) and broadcasts one float of each of the 4 rows (embedded broadcast
// operands), 8 loads per 16 FMAs.
//
// Tails: key counts, rows and head_dim of any size. Scratch tiles (K^T, S, accumulators)
// are padded to multiples of 16 floats so the microkernels use whole vectors there; tensor
// memory is touched with masked loads and stores (_mm512_maskz_loadu_ps /
// _mm512_mask_storeu_ps, which never fault on masked-off lanes) and scalar broadcasts,
// only at elements of the tensors. P V only visits the keys a row sees (rows of a
// microkernel block share the keys all of them see; each row then adds its own few extra
// keys alone), so NaN or Inf in a masked V row never reaches a row.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0,
// shared inputs); no alignment assumed (all loads and stores are unaligned forms). Reads
// only elements the strides address (of keys, only those some row of the block sees);
// writes only o's and lse's elements. Reads nothing past the end of any tensor.
//
// Scratch, allocated once per call, in floats (Bc16, D16 = Bc, D rounded up to 16):
// D16 x Bc16 (K^T) + R x Bc16 (scores) + R x D16 (accumulators) + 2 R, R = g x Br, sized
// as in blocked: about 80 KiB at D = 128, g = 4.
//
// Depends on mha/attention.h and avx512_exp.h (this folder) only.
// avx512_exp.h first: it includes immintrin.h (see there why).
#include "avx512_exp.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "mha/attention.h"

namespace {

// Tile sizes as in blocked (reasoning there): a KV tile of K and V 32 KiB each, the block's
// accumulators 32 KiB, 16..256 keys per tile, 1..64 query rows per head.
constexpr std::int64_t kKvTileFloats = 8192;
constexpr std::int64_t kMinKeys = 16;
constexpr std::int64_t kMaxKeys = 256;
constexpr std::int64_t kAccFloats = 8192;
constexpr std::int64_t kMaxRowsPerHead = 64;

constexpr int kRows = 4;     // MR: rows per microkernel block
constexpr int kVectors = 4;  // NR = 4 x 16 = 64 floats per microkernel block

struct Tiling {
  std::int64_t keys;           // Bc
  std::int64_t rows_per_head;  // Br
};

Tiling choose_tiling(const mha::Problem& p) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  Tiling t;
  t.keys = std::min(std::clamp(kKvTileFloats / p.head_dim, kMinKeys, kMaxKeys), p.kv_len);
  t.rows_per_head = std::clamp(kAccFloats / (group * p.head_dim), std::int64_t{1}, kMaxRowsPerHead);
  t.rows_per_head = std::min(t.rows_per_head, p.q_len);
  return t;
}

std::int64_t round_up16(std::int64_t n) { return (n + 15) / 16 * 16; }

// The first n lanes (n >= 16: all of them).
__mmask16 first_lanes(std::int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << static_cast<unsigned>(n)) - 1u);
}

// Logits relative to 0 while the running max is -inf: see blocked's subtrahend().
float subtrahend(float m) { return m == -std::numeric_limits<float>::infinity() ? 0.0f : m; }

// Horizontal max and sum without _mm512_reduce_*_ps (GCC 12 warns inside them).
float horizontal_max(__m512 x) {
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}
float horizontal_sum(__m512 x) {
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}

// In-register transpose: r[i] lane j becomes r[j] lane i.
void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4 b + c]: in each 128-bit lane L, rows 4b .. 4b + 3 of column 4L + c.
  for (int b = 0; b < 4; ++b) {
    r[4 * b + 0] = _mm512_shuffle_ps(t[4 * b], t[4 * b + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * b + 1] = _mm512_shuffle_ps(t[4 * b], t[4 * b + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * b + 2] = _mm512_shuffle_ps(t[4 * b + 1], t[4 * b + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * b + 3] = _mm512_shuffle_ps(t[4 * b + 1], t[4 * b + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // t[c], t[4 + c]: columns c, 8 + c (resp. 4 + c, 12 + c) of rows 0..7; t[8 + ...]: rows 8..15.
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd);
  }
}

// kt[d][j] = k[j][d] for j < cols, and 0 for cols <= j < round_up16(cols).
// k: [cols][head_dim], row stride k_seq   kt: [head_dim][ld]
void pack_k_transposed(const float* k, std::int64_t k_seq, std::int64_t cols, std::int64_t head_dim,
                       float* kt, std::int64_t ld) {
  for (std::int64_t j0 = 0; j0 < cols; j0 += 16) {
    const std::int64_t nj = std::min<std::int64_t>(16, cols - j0);
    for (std::int64_t d = 0; d < head_dim; d += 16) {
      const std::int64_t nd = std::min<std::int64_t>(16, head_dim - d);
      const __mmask16 mask = first_lanes(nd);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < nj ? _mm512_maskz_loadu_ps(mask, k + (j0 + i) * k_seq + d) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int i = 0; i < nd; ++i) _mm512_storeu_ps(kt + (d + i) * ld + j0, r[i]);
    }
  }
}

// s[r][0 .. 16 NV) = scale * sum_d q[r][d] kt[d][0 .. 16 NV) for MR rows: the S microkernel.
// q[r]: [head_dim] (a tensor row: read by scalar broadcasts)   kt: [head_dim][ld]
// s: [MR][ld]
template <int MR, int NV>
void logits_tile(const float* const* q, const float* kt, std::int64_t ld, std::int64_t head_dim,
                 float scale, float* s) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (std::int64_t d = 0; d < head_dim; ++d) {
    const float* k = kt + d * ld;
    __m512 b[NV];
    for (int c = 0; c < NV; ++c) b[c] = _mm512_loadu_ps(k + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(q[r][d]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(s + r * ld + 16 * c, _mm512_mul_ps(acc[r][c], sv));
  }
}

// Logits of MR rows over the first n16 (a multiple of 16) columns of the K^T tile.
template <int MR>
void logits_rows(const float* const* q, const float* kt, std::int64_t ld, std::int64_t head_dim,
                 std::int64_t n16, float scale, float* s) {
  std::int64_t c = 0;
  for (; c + 16 * kVectors <= n16; c += 16 * kVectors) {
    logits_tile<MR, kVectors>(q, kt + c, ld, head_dim, scale, s + c);
  }
  switch ((n16 - c) / 16) {
    case 3:
      logits_tile<MR, 3>(q, kt + c, ld, head_dim, scale, s + c);
      break;
    case 2:
      logits_tile<MR, 2>(q, kt + c, ld, head_dim, scale, s + c);
      break;
    case 1:
      logits_tile<MR, 1>(q, kt + c, ld, head_dim, scale, s + c);
      break;
    default:
      break;
  }
}

// acc[r][0 .. 16 NV) += sum_{j < keys} p[r][j] v[j][0 .. 16 NV): the P V microkernel. Only
// the first `width` (1 .. 16 NV) columns of v are read (masked loads); the other lanes of
// acc gain zeros.
// p: [MR][ld_p] (scratch)   v: [keys][width], row stride v_seq   acc: [MR][ld_acc]
template <int MR, int NV>
void pv_tile(const float* p, std::int64_t ld_p, std::int64_t keys, const float* v,
             std::int64_t v_seq, std::int64_t width, float* acc_out, std::int64_t ld_acc) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(acc_out + r * ld_acc + 16 * c);
  }
  __mmask16 mask[NV];
  for (int c = 0; c < NV; ++c) mask[c] = first_lanes(width - 16 * c);
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* row = v + j * v_seq;
    __m512 b[NV];
    for (int c = 0; c < NV; ++c) b[c] = _mm512_maskz_loadu_ps(mask[c], row + 16 * c);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(p[r * ld_p + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc_out + r * ld_acc + 16 * c, acc[r][c]);
  }
}

// O += P V for MR rows over their first `keys` keys, all of head_dim.
template <int MR>
void pv_rows(const float* p, std::int64_t ld_p, std::int64_t keys, const float* v,
             std::int64_t v_seq, std::int64_t head_dim, float* acc, std::int64_t ld_acc) {
  if (keys <= 0) return;
  std::int64_t d = 0;
  for (; d + 16 * kVectors < head_dim; d += 16 * kVectors) {  // leaves 1 .. 64 columns
    pv_tile<MR, kVectors>(p, ld_p, keys, v + d, v_seq, 16 * kVectors, acc + d, ld_acc);
  }
  const std::int64_t rest = head_dim - d;
  switch ((rest + 15) / 16) {  // 1 .. 4 vectors, the last one partial or whole
    case 4:
      pv_tile<MR, 4>(p, ld_p, keys, v + d, v_seq, rest, acc + d, ld_acc);
      break;
    case 3:
      pv_tile<MR, 3>(p, ld_p, keys, v + d, v_seq, rest, acc + d, ld_acc);
      break;
    case 2:
      pv_tile<MR, 2>(p, ld_p, keys, v + d, v_seq, rest, acc + d, ld_acc);
      break;
    case 1:
      pv_tile<MR, 1>(p, ld_p, keys, v + d, v_seq, rest, acc + d, ld_acc);
      break;
    default:
      break;
  }
}

// One row's online-softmax step over its `cols` logits of this tile (as blocked's
// online_softmax): s becomes the weights exp(s - m). s has whole vectors up to
// round_up16(cols) (scratch); lanes past cols are overwritten but not used.
void online_softmax(float* s, std::int64_t cols, float* m, float* l, float* acc,
                    std::int64_t ld_acc) {
  const float m_old = *m;
  // `>` (ordered compare) ignores NaN logits as blocked does, so m never becomes NaN; their
  // weights are NaN and reach l and acc.
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = neg_inf;
  for (std::int64_t j = 0; j < cols; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(first_lanes(cols - j), x, mv, _CMP_GT_OQ);
    mv = _mm512_mask_blend_ps(gt, mv, x);
  }
  const float tile_max = horizontal_max(mv);  // no lane of mv is NaN
  const float m_new = tile_max > m_old ? tile_max : m_old;

  if (m_new > m_old) {
    const float alpha = std::exp(m_old - m_new);  // exactly 0 when m_old is -inf
    *l *= alpha;
    const __m512 av = _mm512_set1_ps(alpha);
    for (std::int64_t d = 0; d < ld_acc; d += 16) {
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
    }
    *m = m_new;
  }

  const __m512 base = _mm512_set1_ps(subtrahend(m_new));
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < cols; j += 16) {
    const __m512 w = mha::avx512::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), base));
    _mm512_storeu_ps(s + j, w);
    // Lanes past cols hold other keys' logits: computed, masked out of l.
    sum = _mm512_mask_add_ps(sum, first_lanes(cols - j), sum, w);
  }
  *l += horizontal_sum(sum);
}

// o = acc / l and lse = m + log(l) (see blocked's finish_row).
void finish_row(const float* acc, float m, float l, std::int64_t visible, std::int64_t head_dim,
                float* o, float* lse) {
  if (visible == 0) {
    for (std::int64_t d = 0; d < head_dim; d += 16) {
      _mm512_mask_storeu_ps(o + d, first_lanes(head_dim - d), _mm512_setzero_ps());
    }
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const __m512 lv = _mm512_set1_ps(l);  // a division: one rounding, as the tolerance assumes
  for (std::int64_t d = 0; d < head_dim; d += 16) {
    _mm512_mask_storeu_ps(o + d, first_lanes(head_dim - d),
                          _mm512_div_ps(_mm512_loadu_ps(acc + d), lv));
  }
  if (lse != nullptr) {
    *lse = l == 0.0f ? std::numeric_limits<float>::quiet_NaN() : subtrahend(m) + std::log(l);
  }
}

// Logits of nr (1 .. kRows) rows over the first n16 columns.
void logits_block(const float* const* q, const float* kt, std::int64_t ld, std::int64_t head_dim,
                  std::int64_t n16, float scale, float* s, int nr) {
  switch (nr) {
    case 4:
      logits_rows<4>(q, kt, ld, head_dim, n16, scale, s);
      break;
    case 3:
      logits_rows<3>(q, kt, ld, head_dim, n16, scale, s);
      break;
    case 2:
      logits_rows<2>(q, kt, ld, head_dim, n16, scale, s);
      break;
    default:
      logits_rows<1>(q, kt, ld, head_dim, n16, scale, s);
      break;
  }
}

}  // namespace

void mha_f32_attention_avx512(const mha::Problem& p, const float* q, const float* k, const float* v,
                              float* o, float* lse) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  const std::int64_t dim = p.head_dim;
  const Tiling tiling = choose_tiling(p);
  const std::int64_t bc = tiling.keys;
  const std::int64_t ld = round_up16(bc);       // row stride of the K^T and S tiles
  const std::int64_t ld_acc = round_up16(dim);  // row stride of the accumulators
  const std::int64_t max_rows = group * tiling.rows_per_head;

  // K^T has whole 16-row transposes written only below head_dim: dim rows suffice.
  std::vector<float> kt_tile(static_cast<std::size_t>(dim * ld));            // [dim][ld]
  std::vector<float> s_tile(static_cast<std::size_t>(max_rows * ld));        // [rows][ld]
  std::vector<float> acc_tile(static_cast<std::size_t>(max_rows * ld_acc));  // [rows][ld_acc]
  std::vector<float> m_rows(static_cast<std::size_t>(max_rows));
  std::vector<float> l_rows(static_cast<std::size_t>(max_rows));
  float* const kt = kt_tile.data();
  float* const s = s_tile.data();
  float* const acc = acc_tile.data();
  float* const m = m_rows.data();
  float* const l = l_rows.data();

  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.kv_heads; ++kv_head) {
      const float* k_head = k + b * p.k.batch + kv_head * p.k.head;
      const float* v_head = v + b * p.v.batch + kv_head * p.v.head;
      const std::int64_t head0 = kv_head * group;

      for (std::int64_t r0 = 0; r0 < p.q_len; r0 += tiling.rows_per_head) {
        // Block row t is query head head0 + t / br, query row r0 + t % br.
        const std::int64_t br = std::min(tiling.rows_per_head, p.q_len - r0);
        const std::int64_t rows = group * br;
        const auto q_row = [&](std::int64_t t) {
          return q + b * p.q.batch + (r0 + t % br) * p.q.seq + (head0 + t / br) * p.q.head;
        };
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        std::fill(acc, acc + rows * ld_acc, 0.0f);

        const std::int64_t block_keys = mha::visible_keys(p, r0 + br - 1);
        for (std::int64_t c0 = 0; c0 < block_keys; c0 += bc) {
          const std::int64_t tile_keys = std::min(bc, block_keys - c0);
          const auto cols = [&](std::int64_t t) {
            const std::int64_t n = mha::visible_keys(p, r0 + t % br) - c0;
            return std::clamp(n, std::int64_t{0}, tile_keys);
          };

          pack_k_transposed(k_head + c0 * p.k.seq, p.k.seq, tile_keys, dim, kt, ld);
          for (std::int64_t t0 = 0; t0 < rows; t0 += kRows) {
            const int nr = static_cast<int>(std::min<std::int64_t>(kRows, rows - t0));
            const float* qr[kRows];
            std::int64_t most = 0;  // columns the block's rows need (others are ignored)
            for (int r = 0; r < nr; ++r) {
              qr[r] = q_row(t0 + r);
              most = std::max(most, cols(t0 + r));
            }
            logits_block(qr, kt, ld, dim, round_up16(most), p.scale, s + t0 * ld, nr);
          }
          for (std::int64_t t = 0; t < rows; ++t) {
            const std::int64_t n = cols(t);
            if (n > 0) online_softmax(s + t * ld, n, m + t, l + t, acc + t * ld_acc, ld_acc);
          }
          const float* v_tile = v_head + c0 * p.v.seq;
          for (std::int64_t t0 = 0; t0 < rows; t0 += kRows) {
            const int nr = static_cast<int>(std::min<std::int64_t>(kRows, rows - t0));
            // Keys every row of the block sees go through the nr-row microkernel; a row's
            // keys past those (the causal diagonal) through a one-row pass of its own.
            std::int64_t shared = tile_keys;
            for (int r = 0; r < nr; ++r) shared = std::min(shared, cols(t0 + r));
            const float* p_rows = s + t0 * ld;
            float* acc_rows = acc + t0 * ld_acc;
            switch (nr) {
              case 4:
                pv_rows<4>(p_rows, ld, shared, v_tile, p.v.seq, dim, acc_rows, ld_acc);
                break;
              case 3:
                pv_rows<3>(p_rows, ld, shared, v_tile, p.v.seq, dim, acc_rows, ld_acc);
                break;
              case 2:
                pv_rows<2>(p_rows, ld, shared, v_tile, p.v.seq, dim, acc_rows, ld_acc);
                break;
              default:
                pv_rows<1>(p_rows, ld, shared, v_tile, p.v.seq, dim, acc_rows, ld_acc);
                break;
            }
            for (int r = 0; r < nr; ++r) {
              const std::int64_t extra = cols(t0 + r) - shared;
              pv_rows<1>(p_rows + r * ld + shared, ld, extra, v_tile + shared * p.v.seq, p.v.seq,
                         dim, acc_rows + r * ld_acc, ld_acc);
            }
          }
        }

        for (std::int64_t t = 0; t < rows; ++t) {
          const std::int64_t row = r0 + t % br, head = head0 + t / br;
          finish_row(acc + t * ld_acc, m[t], l[t], mha::visible_keys(p, row), dim,
                     o + b * p.o.batch + row * p.o.seq + head * p.o.head,
                     lse != nullptr ? lse + b * p.lse.batch + head * p.lse.head + row : nullptr);
        }
      }
    }
  }
}

// avx512: multi-head attention with flash-attention tiling and an online softmax, in fp32,
// with x86-64 AVX-512 intrinsics. The algorithm of kernels/blocked/blocked.cpp (read that
// file first), with packed operands and register-blocked microkernels.
//
// Computes what mha/attention.h specifies: per query head h (reading KV head h / g,
// g = q_heads / kv_heads), o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator, one KV tile at a time:
//
//   for each (batch, KV head, block of R = g x Br query rows):  all g heads share each tile
//     pack the block's Q in groups of 12 rows, transposed: Qp[group][d][12]
//     for each KV tile of Bc keys some row of the block sees (causal: later tiles skipped):
//       pack K^T in panels of 32 keys, Kp[panel][d][32], and V in panels of 32 columns,
//       Vp[panel][key][32], each panel contiguous and zero-padded
//       S = scale log2(e) Q K^T    microkernel: 12 rows x 32 keys (2 x 12 zmm)
//       online softmax in base 2 per row: running max m and sum l; P = 2^(S - m) in place
//       O = alpha O + P V          microkernel: 12 rows x 32 columns (2 x 12 zmm), alpha =
//                                  2^(m_old - m_new) applied as O is loaded
//     o = O / l, lse = (m + log2 l) ln 2
//
// Why this shape. Both products are small matrix products whose streamed operand (a K^T
// or V panel: 32 floats x D or x Bc, 16 KiB at D = Bc = 128) stays in L1 while every row
// group of the block reuses it; the other operand is read by embedded broadcasts from one
// pointer with constant offsets (the packed Q, or the S tile whose row stride kLd is a
// compile-time constant). Per step: 2 zmm loads and 12 broadcasts feed 24 independent
// FMAs, 12 cycles on 2 FMA ports, well within 2 loads per cycle and 4-cycle FMA latency.
// Packing costs one pass over K and V per tile and removes the 4 KiB row stride of
// token-major K and V, whose rows would otherwise share a few L1 sets. Per 16 logits the
// softmax costs about 12 vector instructions (max, subtraction, 2^x in 9, sum) against
// 2 D FMAs of the two products: 5% at D = 128.
//
// Sizes. Bc = 128 keys (the S tile's row stride, kLd) while 32 x D x Bc fits 64 KiB, fewer
// (a multiple of 32, at least 32) for D > 128. R is about 96 rows: Br = 96 / g (at least 1,
// at most q_len), so the K and V tiles (2 x 64 KiB) come from memory once per 96 rows; S
// (96 x 128) and O (96 x D) take 48 KiB each at D = 128, all in L2 with the packed tiles.
// When R is not a multiple of 12 the last group uses the same microkernels with fewer rows.
//
// Causal masking is bottom-right aligned: every row sees a prefix of the keys. A row
// group's logits are computed up to the 32-key panel holding the last key any of its rows
// sees, the softmax of each row reads its own visible prefix only, and P V runs the keys
// every row of the group sees through the group microkernel and each row's extra keys
// (on the diagonal) through a 1-row pass, so a weight is never multiplied with a V row its
// row does not see (NaN or Inf there never reaches it).
//
// ISA: AVX-512F + DQ (VREDUCEPS in the exp) + FMA; the file is compiled with -mavx512f
// -mavx512vl -mavx512dq -mavx512bw -mfma and only called when the CPU has them.
//
// Tails: any head_dim, key count and row count. Tensor memory is touched with masked loads
// and stores (_mm512_maskz_loadu_ps / _mm512_mask_storeu_ps never fault on masked-off
// lanes) and scalar loads, only at elements of the tensors; the packed panels are padded
// with zeros, so the microkernels always use whole vectors.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0,
// shared inputs); no alignment assumed. Reads only elements the strides address (of keys,
// only those some row of the block sees); writes only o's and lse's elements. Reads
// nothing past the end of any tensor.
//
// Scratch, allocated once per call, in floats (D32 = head_dim rounded up to 32): R x D
// (packed Q) + Bc x D32 (K^T) + Bc x D32 (V) + R x kLd (S) + R x D32 (O) + 3 R: about
// 240 KiB at D = 128.
//
// Depends on mha/attention.h and avx512_exp.h (this folder) only.
// avx512_exp.h first: it includes immintrin.h (see there why).
#include "avx512_exp.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "mha/attention.h"

namespace {

constexpr int kMr = 12;                       // rows per microkernel group
constexpr std::int64_t kPanel = 32;           // keys per K^T panel, columns per V panel: 2 zmm
constexpr std::int64_t kLd = 128;             // row stride of the S tile = most keys per tile
constexpr std::int64_t kTileFloats = 16384;   // one K^T (or V) tile: 64 KiB
constexpr std::int64_t kBlockRows = 256;      // R, rows of a block, when g and D allow
constexpr std::int64_t kBlockFloats = 32768;  // R x D: the block's O, 128 KiB

constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.69314718055994530942;

struct Tiling {
  std::int64_t keys;           // Bc: keys per KV tile, a multiple of 32 (or all of kv_len)
  std::int64_t rows_per_head;  // Br: query rows per head in one block
};

Tiling choose_tiling(const mha::Problem& p) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  Tiling t;
  const std::int64_t keys = kTileFloats / p.head_dim / kPanel * kPanel;
  t.keys = std::min(std::clamp(keys, kPanel, kLd), p.kv_len);
  const std::int64_t rows = std::min(kBlockRows, kBlockFloats / p.head_dim);
  t.rows_per_head = std::clamp(rows / group, std::int64_t{1}, p.q_len);
  return t;
}

std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

// The first n lanes (n >= 16: all of them; n <= 0: none).
__mmask16 first_lanes(std::int64_t n) {
  if (n <= 0) return 0;
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

// K of `keys` keys into 32-key panels: kp[panel][d][jj] = k[32 panel + jj][d], zeros for
// keys past `keys` in the last panel.
// k: [keys][head_dim], row stride k_seq   kp: [round_up(keys, 32) / 32][head_dim][32]
void pack_k_panels(const float* k, std::int64_t k_seq, std::int64_t keys, std::int64_t head_dim,
                   float* kp) {
  for (std::int64_t j0 = 0; j0 < round_up(keys, 2 * 16); j0 += 16) {
    const std::int64_t nj = std::min<std::int64_t>(16, keys - j0);  // <= 0: a zero half
    float* panel = kp + j0 / kPanel * head_dim * kPanel + j0 % kPanel;
    for (std::int64_t d = 0; d < head_dim; d += 16) {
      const std::int64_t nd = std::min<std::int64_t>(16, head_dim - d);
      const __mmask16 mask = first_lanes(nd);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < nj ? _mm512_maskz_loadu_ps(mask, k + (j0 + i) * k_seq + d) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int i = 0; i < nd; ++i) _mm512_storeu_ps(panel + (d + i) * kPanel, r[i]);
    }
  }
}

// V of `keys` keys into 32-column panels: vp[panel][j][cc] = v[j][32 panel + cc], zeros for
// columns past head_dim in the last panel.
// v: [keys][head_dim], row stride v_seq   vp: [round_up(head_dim, 32) / 32][keys][32]
void pack_v_panels(const float* v, std::int64_t v_seq, std::int64_t keys, std::int64_t head_dim,
                   float* vp) {
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* row = v + j * v_seq;
    float* out = vp + j * kPanel;
    for (std::int64_t c = 0; c < head_dim; c += kPanel) {
      _mm512_storeu_ps(out, _mm512_maskz_loadu_ps(first_lanes(head_dim - c), row + c));
      _mm512_storeu_ps(out + 16,
                       _mm512_maskz_loadu_ps(first_lanes(head_dim - c - 16), row + c + 16));
      out += keys * kPanel;
    }
  }
}

// Brings the next KV tile's K and V rows into L2 while the current tile computes, a few
// cache lines per microkernel call, so that packing the next tile reads L2 instead of
// memory (a unit of the parallel driver streams its KV head from memory once). Only lines
// holding elements of those rows are touched; prefetches never fault.
class NextTile {
 public:
  // The rows k[j], v[j] for j < keys (head_dim floats each), spread over `calls` calls.
  NextTile(const float* k, std::int64_t k_seq, const float* v, std::int64_t v_seq,
           std::int64_t keys, std::int64_t head_dim, std::int64_t calls)
      : k_(k),
        v_(v),
        k_seq_(k_seq),
        v_seq_(v_seq),
        row_lines_((head_dim + 15) / 16),
        lines_(keys * row_lines_),
        per_call_((2 * lines_ + calls - 1) / std::max<std::int64_t>(calls, 1)) {}

  void step() {
    for (std::int64_t n = 0; n < per_call_ && next_ < 2 * lines_; ++n, ++next_) {
      const bool in_v = next_ >= lines_;
      const std::int64_t line = in_v ? next_ - lines_ : next_;
      const float* row = in_v ? v_ + line / row_lines_ * v_seq_ : k_ + line / row_lines_ * k_seq_;
      _mm_prefetch(reinterpret_cast<const char*>(row + line % row_lines_ * 16), _MM_HINT_T1);
    }
  }

 private:
  const float* k_;
  const float* v_;
  std::int64_t k_seq_, v_seq_, row_lines_, lines_, per_call_, next_ = 0;
};

// S for MR rows against one K^T panel: s[r][0 .. 32) = c sum_d qp[d][r] kp[d][0 .. 32),
// c = scale log2(e). The microkernel of the S product.
// qp: [head_dim][MR]   kp: [head_dim][32]   s: [MR][kLd]
template <int MR>
void logits_panel(const float* qp, const float* kp, std::int64_t head_dim, __m512 c, float* s) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (std::int64_t d = 0; d < head_dim; ++d) {
    const __m512 b0 = _mm512_loadu_ps(kp + d * kPanel);
    const __m512 b1 = _mm512_loadu_ps(kp + d * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(qp[d * MR + r]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(s + r * kLd, _mm512_mul_ps(acc[r][0], c));
    _mm512_storeu_ps(s + r * kLd + 16, _mm512_mul_ps(acc[r][1], c));
  }
}

// O = alpha O + P V for MR rows over `keys` keys and one 32-column V panel: the microkernel
// of the P V product. With kRescale false, alpha is not read (taken as 1).
// p: [MR][kLd]   vp: [keys][32]   o: [MR][ld_o]   alpha: [MR]
template <int MR, bool kRescale>
void pv_panel(const float* p, std::int64_t keys, const float* vp, float* o, std::int64_t ld_o,
              const float* alpha) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm512_loadu_ps(o + r * ld_o);
    acc[r][1] = _mm512_loadu_ps(o + r * ld_o + 16);
    if (kRescale) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      acc[r][0] = _mm512_mul_ps(acc[r][0], a);
      acc[r][1] = _mm512_mul_ps(acc[r][1], a);
    }
  }
  for (std::int64_t j = 0; j < keys; ++j) {
    const __m512 b0 = _mm512_loadu_ps(vp + j * kPanel);
    const __m512 b1 = _mm512_loadu_ps(vp + j * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(p[r * kLd + j]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(o + r * ld_o, acc[r][0]);
    _mm512_storeu_ps(o + r * ld_o + 16, acc[r][1]);
  }
}

// f(std::integral_constant<int, mr>{}) for mr in 1 .. kMr: the microkernels' row count as
// a compile-time constant.
template <typename F>
void with_rows(int mr, F&& f) {
  switch (mr) {
    case 12:
      f(std::integral_constant<int, 12>{});
      break;
    case 11:
      f(std::integral_constant<int, 11>{});
      break;
    case 10:
      f(std::integral_constant<int, 10>{});
      break;
    case 9:
      f(std::integral_constant<int, 9>{});
      break;
    case 8:
      f(std::integral_constant<int, 8>{});
      break;
    case 7:
      f(std::integral_constant<int, 7>{});
      break;
    case 6:
      f(std::integral_constant<int, 6>{});
      break;
    case 5:
      f(std::integral_constant<int, 5>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
      break;
  }
}

// One row's online-softmax step over its `cols` logits (base 2) of this tile, as blocked's
// online_softmax: s becomes the weights 2^(s - m); alpha = 2^(m_old - m_new), the factor
// P V applies to the row's accumulator (1 when the max did not grow). s has whole vectors
// up to round_up(cols, 16) (scratch); lanes past cols are overwritten but never used.
void online_softmax(float* s, std::int64_t cols, float* m, float* l, float* alpha) {
  *alpha = 1.0f;
  if (cols <= 0) return;
  const float m_old = *m;
  // NaN logits are left out of the max as blocked does, so m never becomes NaN; their
  // weights are NaN and reach l and O.
  // VMAXPS returns its second source when either is NaN: max(x, mv) skips NaN logits.
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  std::int64_t j = 0;
  for (; j + 16 <= cols; j += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + j), mv);
  if (j < cols) mv = _mm512_mask_max_ps(mv, first_lanes(cols - j), _mm512_loadu_ps(s + j), mv);
  const float tile_max = horizontal_max(mv);  // no lane of mv is NaN
  if (tile_max > m_old) {
    *alpha = std::exp2(m_old - tile_max);  // exactly 0 when m_old is -inf
    *l *= *alpha;
    *m = tile_max;
  }
  const __m512 base = _mm512_set1_ps(subtrahend(*m));
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < cols; j += 16) {
    const __m512 w = mha::avx512::exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), base));
    _mm512_storeu_ps(s + j, w);
    // Lanes past cols (last vector) hold other keys' logits: computed, masked out of l.
    sum = j + 16 <= cols ? _mm512_add_ps(sum, w)
                         : _mm512_mask_add_ps(sum, first_lanes(cols - j), sum, w);
  }
  *l += horizontal_sum(sum);
}

// o = acc / l and lse = (m + log2 l) ln 2 (see blocked's finish_row).
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
    *lse = l == 0.0f ? std::numeric_limits<float>::quiet_NaN()
                     : static_cast<float>(static_cast<double>(subtrahend(m)) * kLn2 +
                                          std::log(static_cast<double>(l)));
  }
}

}  // namespace

void mha_f32_attention_avx512(const mha::Problem& p, const float* q, const float* k, const float* v,
                              float* o, float* lse) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  const std::int64_t dim = p.head_dim;
  const Tiling tiling = choose_tiling(p);
  const std::int64_t bc = tiling.keys;
  const std::int64_t d32 = round_up(dim, kPanel);  // row stride of O, columns of the V panels
  const std::int64_t max_rows = group * tiling.rows_per_head;

  // One allocation, left uninitialized (every element is written before it is read), cut
  // into pieces that start on 64-byte boundaries so that whole-vector loads never straddle
  // two cache lines.
  const std::int64_t sizes[] = {max_rows * dim, round_up(bc, kPanel) * dim,
                                bc * d32,       max_rows * kLd,
                                max_rows * d32, 3 * max_rows};
  std::int64_t total = 16;
  for (const std::int64_t n : sizes) total += round_up(n, 16);
  const std::unique_ptr<float[]> scratch(new float[static_cast<std::size_t>(total)]);
  float* pieces[6];
  float* next =
      scratch.get() + (16 - reinterpret_cast<std::uintptr_t>(scratch.get()) / 4 % 16) % 16;
  for (int i = 0; i < 6; ++i) {
    pieces[i] = next;
    next += round_up(sizes[i], 16);
  }
  float* const qp = pieces[0];
  float* const kp = pieces[1];
  float* const vp = pieces[2];
  float* const s = pieces[3];
  float* const acc = pieces[4];
  float* const m = pieces[5];
  float* const l = m + max_rows;
  float* const alpha = l + max_rows;
  std::vector<std::int64_t> group_most(static_cast<std::size_t>((max_rows + kMr - 1) / kMr));
  std::vector<std::int64_t> group_shared(group_most.size());
  // scale log2(e) rounded once: the logits' base change (tolerance.h counts it).
  const __m512 logit_scale =
      _mm512_set1_ps(static_cast<float>(static_cast<double>(p.scale) * kLog2e));

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
        // Group t0 .. t0 + mr - 1 of the block's rows, at qp + t0 dim: [dim][mr].
        for (std::int64_t t0 = 0; t0 < rows; t0 += kMr) {
          const std::int64_t mr = std::min<std::int64_t>(kMr, rows - t0);
          for (std::int64_t r = 0; r < mr; ++r) {
            const float* row = q_row(t0 + r);
            for (std::int64_t d = 0; d < dim; ++d) qp[t0 * dim + d * mr + r] = row[d];
          }
        }
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        std::fill(acc, acc + rows * d32, 0.0f);

        const std::int64_t block_keys = mha::visible_keys(p, r0 + br - 1);
        for (std::int64_t c0 = 0; c0 < block_keys; c0 += bc) {
          const std::int64_t tile_keys = std::min(bc, block_keys - c0);
          const auto cols = [&](std::int64_t t) {
            const std::int64_t n = mha::visible_keys(p, r0 + t % br) - c0;
            return std::clamp(n, std::int64_t{0}, tile_keys);
          };
          pack_k_panels(k_head + c0 * p.k.seq, p.k.seq, tile_keys, dim, kp);
          pack_v_panels(v_head + c0 * p.v.seq, p.v.seq, tile_keys, dim, vp);
          const std::int64_t groups = (rows + kMr - 1) / kMr;
          NextTile next_tile(k_head + (c0 + bc) * p.k.seq, p.k.seq, v_head + (c0 + bc) * p.v.seq,
                             p.v.seq, std::clamp(block_keys - c0 - bc, std::int64_t{0}, bc), dim,
                             groups * ((tile_keys + kPanel - 1) / kPanel + d32 / kPanel));

          // Per group of kMr rows: the keys some row sees (S is computed up to there) and
          // the keys every row sees (P V's group microkernel; each row's extra keys on the
          // causal diagonal go through a one-row pass of its own).
          for (std::int64_t t0 = 0; t0 < rows; t0 += kMr) {
            std::int64_t& most = group_most[static_cast<std::size_t>(t0 / kMr)];
            std::int64_t& shared = group_shared[static_cast<std::size_t>(t0 / kMr)];
            most = 0;
            shared = tile_keys;
            for (std::int64_t t = t0; t < std::min(rows, t0 + kMr); ++t) {
              most = std::max(most, cols(t));
              shared = std::min(shared, cols(t));
            }
          }
          // Panels outer, groups inner: each K^T panel (and below each V panel) stays in L1
          // while every group of the block uses it.
          for (std::int64_t j = 0; j < tile_keys; j += kPanel) {
            for (std::int64_t t0 = 0; t0 < rows; t0 += kMr) {
              next_tile.step();
              if (j >= group_most[static_cast<std::size_t>(t0 / kMr)]) continue;
              with_rows(static_cast<int>(std::min<std::int64_t>(kMr, rows - t0)), [&](auto mr) {
                logits_panel<decltype(mr)::value>(qp + t0 * dim, kp + j * dim, dim, logit_scale,
                                                  s + t0 * kLd + j);
              });
            }
          }
          for (std::int64_t t = 0; t < rows; ++t) {
            online_softmax(s + t * kLd, cols(t), m + t, l + t, alpha + t);
          }
          for (std::int64_t c = 0; c < d32; c += kPanel) {
            const float* v_panel = vp + c * tile_keys;
            for (std::int64_t t0 = 0; t0 < rows; t0 += kMr) {
              next_tile.step();
              const std::int64_t shared = group_shared[static_cast<std::size_t>(t0 / kMr)];
              const std::int64_t mr = std::min<std::int64_t>(kMr, rows - t0);
              const float* p_rows = s + t0 * kLd;
              float* o_rows = acc + t0 * d32 + c;
              with_rows(static_cast<int>(mr), [&](auto rows_constant) {  // also applies alpha
                pv_panel<decltype(rows_constant)::value, true>(p_rows, shared, v_panel, o_rows, d32,
                                                               alpha + t0);
              });
              for (std::int64_t r = 0; r < mr; ++r) {
                const std::int64_t extra = cols(t0 + r) - shared;
                if (extra > 0) {
                  pv_panel<1, false>(p_rows + r * kLd + shared, extra, v_panel + shared * kPanel,
                                     o_rows + r * d32, d32, nullptr);
                }
              }
            }
          }
        }

        for (std::int64_t t = 0; t < rows; ++t) {
          const std::int64_t row = r0 + t % br, head = head0 + t / br;
          finish_row(acc + t * d32, m[t], l[t], mha::visible_keys(p, row), dim,
                     o + b * p.o.batch + row * p.o.seq + head * p.o.head,
                     lse != nullptr ? lse + b * p.lse.batch + head * p.lse.head + row : nullptr);
        }
      }
    }
  }
}

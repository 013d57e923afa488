// avx512: multi-head attention with flash-attention tiling and an online softmax, in fp32,
// with x86-64 AVX-512 intrinsics. The algorithm of kernels/blocked/blocked.cpp (read that
// file first), computed transposed: query rows run along the vector lanes.
//
// Computes what mha/attention.h specifies: per query head h (reading KV head h / g,
// g = q_heads / kv_heads), o = softmax(scale * q k^T + causal mask) v and lse = the log of
// the softmax denominator, one KV tile at a time:
//
//   for each (batch, KV head, block of R = g x Br query rows):           for_each_block
//     pack the block's Q transposed, Q^T[d][32] per strip of 32 rows,     start_block
//       once; all g heads share each KV tile
//     for each KV tile of Bc keys some row of the block sees (causal: later tiles skipped):
//       copy the tile's K and V rows to buffers with a padded row stride  copy_rows
//       (decode-sized blocks read suitably strided rows in place instead)
//       for each strip of 32 rows (2 zmm):
//         S^T = scale log2(e) K Q^T    microkernel: 12 keys x 32 rows,   strip_logits
//                                      K broadcast; soft-capped (Problem::softcap),
//                                      ALiBi's bias added (Problem::alibi)
//         online softmax in base 2, 16 rows per vector: running max m,   strip_softmax
//           sum l; P^T = 2^(S^T - m)
//         O^T = alpha O^T + V^T P^T    microkernel: 12 columns x 32      strip_pv
//                                      rows, V broadcast
//     o = O / l, lse = (m + log2 l) ln 2                                  finish_block
//
// Why transposed. The broadcast operands of both products are rows of K and V as they are
// (12 key rows of K, one row of V at a time), so K and V are never transposed: each tile's
// rows are only copied, with vector loads and stores, to a row stride of an odd number of
// cache lines (token-major rows are H_kv D floats apart, 4 KiB at 8 x 128, and 12 of them
// would share one L1 set). The only transpositions are Q^T, once per block, and O^T back to
// o at its end, 16 x 16 floats at a time in registers. The streamed operand (a 32-row strip
// of Q^T or of P^T, 16 KiB at D = Bc = 128) stays in L1 while the microkernel walks 12 keys
// or 12 columns at a time. Per step 2 zmm loads and 12 broadcasts feed 24 independent FMAs:
// 12 cycles on 2 FMA ports, within 2 loads per cycle and 4-cycle FMA latency. And the
// softmax of a row is a lane of a vector: the max and the sum over keys are vertical
// (VMAXPS, VADDPS per key), with no horizontal reductions and no scalar exp; per 16 logits
// it costs 11 vector instructions (max, subtraction, 2^x in 8, sum) against 2 D FMAs of the
// two products (4% at D = 128, 8% at D = 64, 34% at D = 16; measured inside the kernel,
// timed by phase: 4.3%, 7% and 22% of its time, on the same two ports as the FMAs).
//
// Decode. With fewer than 16 rows (g x q_len) per KV head, the lanes of the transposed
// microkernels would mostly be padding (one decode row uses one lane in 16), so
// decode_rows() turns the lanes along head_dim instead: K and V are read in whole vectors,
// the query heads that share a KV head go in groups of up to 4 rows that load each K and V
// vector once, 16 dot products (16 keys of one row, or 4 keys of 4 rows) are finished
// together (sum_lanes16), and P V adds weight x V row into 16 zmm of accumulators. Decode
// streams K and V from memory, so keys come in tiles of 16 or 32 with the next one
// prefetched.
//
// Sizes, from the caches of the core (mha::support::caches()). Bc = 128 keys: the
// streamed strip of P^T and S^T (Bc x 32 floats, 16 KiB) stays in any L1d of 32 KiB or
// more. R, 256 to 512 rows (Br = R / g, at most q_len), by mha::support::packed_rows_per_head,
// whose comment gives the rule and its measurements: each KV tile is copied once per block,
// so the larger R, the fewer copies per FLOP (R = 512 measured 4-7% faster than 256 at
// D = 128, token-major, 2 MiB L2), and the block's Q^T and O^T may outgrow the L2 into
// the L3 (R = 512 at D = 128: 256 KiB each). Only heads wider than 256 get fewer rows:
// R x D is at most kBlockFloats (R = 32 at D = 4096). Q^T and O^T are stored strip by strip: a
// strip's 32 rows are one contiguous [D][32] panel (16 KiB at 128), so the operand a microkernel
// streams lies in 4 pages and covers the L1 sets evenly. S^T is one strip's [Bc][32] panel, reused
// by every strip: it stays in L1 between the S^T product, the softmax and P V.
//
// Causal masking is bottom-right aligned: every row sees a prefix of the keys, a lane
// count per tile. A strip's logits are computed up to the last key any of its rows sees;
// vectors where some row sees fewer keys take a masked softmax (weight 0, out of max and
// sum), and P V runs the keys every row of the strip sees without masks and the rest with
// masked FMAs (_mm512_mask3_fmadd_ps keeps the lanes whose row does not see the key), so a
// V row is never multiplied into a row that does not see it (0 x Inf or NaN would be NaN).
//
// K and V of a reduced type (Problem::kv_type, mha/kv_types.h). Prefill converts each tile
// as it copies it (copy_rows: a reduced type is always copied, so the microkernels read
// fp32 rows); decode converts as it loads (load_kv: VCVTPH2PS for f16, a 16-bit shift for
// bf16, sign extension and VCVTDQ2PS for i8), so the cache is read once, in its own type.
// An i8 row's scale multiplies the finished logit in decode and each element in the copy:
// one rounding, tolerance.h's step 6. Decode is a template over the type; prefill is one
// function. The microkernels are MHA_NOINLINE and sum_lanes16 MHA_ALWAYS_INLINE: with the
// typed decode in this file GCC's unit-growth limits moved the inlining otherwise (fp32
// decode ran 1.08-1.27x slower with sum_lanes16 a call).
//
// ISA: AVX-512F + DQ (VREDUCEPS in the exp) + FMA, BW and VL (the masked 8- and 16-bit
// loads of a reduced type); the code below the includes is compiled for AVX-512F, VL, DQ,
// BW and FMA (MHA_TARGET_BEGIN in mha/support.h) and only called when the CPU has them. The
// file needs no flags.
//
// Tails: any head_dim, key count and row count. Tensors are read by masked vector loads
// and scalar loads of their own elements only; rows past R up to a whole vector are zero padding of
// the scratch tiles, computed and never stored. Any 12-key or 12-column remainder uses
// the same microkernels instantiated for fewer.
//
// Layout: any strides mha::check accepts (token-major, head-major, padded, stride 0,
// shared inputs); no alignment assumed. Reads only elements the strides address (of keys,
// only those some row of the block sees); writes only o's and lse's elements. Reads
// nothing past the end of any tensor.
//
// Workspace (the caller's; mha_f32_attention_avx512_workspace gives its size), in floats
// (R' = R rounded up to 32; ldkv = D rounded up to 16, plus 16): D x R' (Q^T) + 32 Bc (S^T)
// + D x R' (O^T) + 3 R' + 2 Bc x ldkv (the K and V copies), and each row's keys (2 R' int32
// of the tile, 2 R' int64 of the KV head): about 690 KiB at D = 128, R = 512 (430 KiB at
// R = 256). Decode needs g x q_len x D16 floats and a tile of weights.
//
// Floating-point environment: the default one for the call (mha::FpEnvGuard, mha/attention.h),
// so the caller's flush-to-zero, denormals-are-zero or rounding mode changes no bit of the
// output, and the caller's control bits are as they were on return.
//
// Depends on mha/attention.h, mha/support.h and avx512_exp.h (this folder) only.
// avx512_exp.h first: it includes immintrin.h (see there why).
#include "avx512_exp.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "mha/attention.h"
#include "mha/support.h"

MHA_TARGET_BEGIN("avx512f,avx512vl,avx512dq,avx512bw,fma")
namespace {

constexpr int kMr = 12;                        // keys (S) or head_dim columns (P V) per microkernel
constexpr std::int64_t kStrip = 32;            // query rows per microkernel: 2 zmm
constexpr std::int64_t kMaxKeys = 128;         // Bc: keys per KV tile
constexpr std::int64_t kBlockFloats = 131072;  // R x D at most this (512 KiB of Q^T)
constexpr std::int64_t kSmallBlockRows = 64;   // decode-sized blocks: see `small` below

using mha::support::Block;
using mha::support::Carve;
using mha::support::round_up;
using mha::support::Tiling;
using mha::support::with_count;

// Br: mha::support::packed_rows_per_head's rule over this kernel's scratch, R (2 D + 3)
// floats for Q^T, O^T, m, l and alpha, and 2 Bc ldkv for the K and V copies, with R D
// within kBlockFloats (and at least 16 rows however wide the head).
Tiling choose_tiling(const mha::Problem& p) {
  Tiling t;
  t.keys = std::min(kMaxKeys, p.kv_len);
  const std::int64_t ldkv = round_up(p.head_dim, 16) + 16;
  t.rows_per_head =
      mha::support::packed_rows_per_head(p, 2 * p.head_dim + 3, 2 * kMaxKeys * ldkv,
                                         std::max<std::int64_t>(16, kBlockFloats / p.head_dim));
  return t;
}

// scale log2(e) rounded once, in every lane: the logits' base change (tolerance.h counts it).
__m512 logit_scale_of(const mha::Problem& p) {
  return _mm512_set1_ps(static_cast<float>(static_cast<double>(p.scale) * mha::support::kLog2e));
}

// Problem::softcap in the kernel's base-2 logit units (off without one).
mha::support::Softcap softcap_of(const mha::Problem& p) {
  return mha::support::Softcap::of(p, mha::support::kLog2e);
}

// Problem::alibi in the kernel's base-2 logit units (off without).
mha::support::Alibi alibi_of(const mha::Problem& p) {
  return mha::support::Alibi::of(p, mha::support::kLog2e);
}

// op over the 16 lanes, by halving (shuffles; not _mm512_reduce_*_ps, inside which GCC 12
// warns): lanes_max and lanes_sum. The max of lanes that are not NaN is not NaN. The lambdas
// are generic so that GCC emits no function-pointer thunk for them, which it would compile
// outside the target region.
template <typename Op>
float reduce_lanes(__m512 x, Op op) {
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}
float lanes_max(__m512 x) {
  return reduce_lanes(x, [](auto a, auto b) { return _mm512_max_ps(a, b); });
}
float lanes_sum(__m512 x) {
  return reduce_lanes(x, [](auto a, auto b) { return _mm512_add_ps(a, b); });
}

// Lanes (query rows) that see key j: those whose visible-key count exceeds j.
// The keys of a tile each of 32 query rows (2 vectors of lanes) sees: [first, end).
struct LaneKeys {
  __m512i first[2], end[2];
};

// How a masked pass tells which lanes see a key: by the end of their keys only, where the
// pass's keys are at or past every lane's first; by both ends, where they are not (a sliding
// window's start).
enum class Mask { none, end, range };

// The lanes of vector n that see key j: j < end, and with kMask range first <= j.
template <Mask kMask>
__mmask16 sees(const LaneKeys& keys, int n, std::int64_t j) {
  const __m512i key = _mm512_set1_epi32(static_cast<int>(j));
  const __mmask16 below_end = _mm512_cmpgt_epi32_mask(keys.end[n], key);
  if constexpr (kMask == Mask::end) return below_end;
  return _mm512_mask_cmple_epi32_mask(below_end, keys.first[n], key);
}

// Brings KV rows into L2 ahead of their use: the next tile's K and V rows while the
// current tile computes (and a block's first tile before it starts), one line of each
// every few microkernel steps of the block's first strip. Left to the hardware prefetchers,
// the microkernels' lockstep walk over 12 rows (a cache line of each every 16 steps) keeps
// too few lines in flight to stream from memory: decode read 5 GB/s of a 15 GB/s DRAM.
// Bursts of prefetches do no better: they wait for line fill buffers like loads. Into L2
// (PREFETCHT1), not L1: the next tile would evict the current one from L1, where decode
// reads it once per query row (g = 8 decode: 15.6 -> 13.9 ms). Only lines holding elements
// of those rows are touched; prefetches never fault.
class Prefetch {
 public:
  // Rows k[j], v[j] for j < keys (head_dim elements of `bytes` bytes each, k_seq and v_seq
  // elements apart), spread over `steps` step()s: a line of each every few steps, or a few
  // lines every step. A stride is scaled to bytes only when there is a second row (check()
  // bounds a stride only by the keys that use it).
  Prefetch(const void* k, std::int64_t k_seq, const void* v, std::int64_t v_seq, std::int64_t keys,
           std::int64_t head_dim, std::int64_t bytes, std::int64_t steps)
      : k_(static_cast<const char*>(k)),
        v_(static_cast<const char*>(v)),
        k_seq_(keys > 1 ? k_seq * bytes : 0),
        v_seq_(keys > 1 ? v_seq * bytes : 0),
        keys_(keys),
        row_lines_((head_dim * bytes + 63) / 64) {
    const std::int64_t lines = std::max<std::int64_t>(1, keys * row_lines_);
    steps = std::max<std::int64_t>(1, steps);
    every_ = std::max<std::int64_t>(1, steps / lines);
    per_step_ = (lines + steps - 1) / steps;
  }

  void step() {
    if (key_ == keys_ || ++tick_ < every_) return;
    tick_ = 0;
    for (std::int64_t n = 0; n < per_step_ && key_ < keys_; ++n) {
      _mm_prefetch(k_ + line_ * 64, _MM_HINT_T1);
      _mm_prefetch(v_ + line_ * 64, _MM_HINT_T1);
      if (++line_ == row_lines_) {
        line_ = 0;
        // Not past the last key: its offset may overflow (check() bounds a stride only by
        // the keys that use it).
        if (++key_ < keys_) {
          k_ += k_seq_;
          v_ += v_seq_;
        }
      }
    }
  }
  void all() {
    while (key_ < keys_) step();
  }

 private:
  const char* k_;
  const char* v_;
  std::int64_t k_seq_, v_seq_, keys_, row_lines_, every_ = 1, per_step_ = 1, key_ = 0, line_ = 0,
                                                  tick_ = 0;
};

// The first n lanes (n >= 16: all of them; n <= 0: none).
__mmask16 first_lanes(std::int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << static_cast<unsigned>(n)) - 1u);
}

// Row t's lane at d = 0 in a strip-major buffer (Q^T, O^T): strip t / kStrip is a
// [head_dim][kStrip] panel, row t its lane t % kStrip.
template <typename T>
T* panel_lane(T* base, std::int64_t t, std::int64_t head_dim) {
  return base + t / kStrip * head_dim * kStrip + t % kStrip;
}

// Rows of a tensor or of a copy: the first row and the row stride, in floats.
struct Rows {
  const float* at;
  std::int64_t seq;
};

// What K and V of type T are stored as, and its size.
template <mha::KvType T>
using Elem =
    std::conditional_t<T == mha::KvType::f32, float,
                       std::conditional_t<T == mha::KvType::i8, std::int8_t, std::uint16_t>>;
template <mha::KvType T>
constexpr std::int64_t kBytes = static_cast<std::int64_t>(sizeof(Elem<T>));

// 16 elements of a K or V row of type T from element i, as floats: f16 by VCVTPH2PS, bf16
// by a 16-bit shift, i8 by sign extension and VCVTDQ2PS (its scale is the caller's).
// load_kv_masked: lanes outside `mask` 0, their memory not read.
template <mha::KvType T>
__m512 load_kv_masked(const Elem<T>* row, std::int64_t i, __mmask16 mask) {
  const Elem<T>* x = row + i;
  if constexpr (T == mha::KvType::f32) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else if constexpr (T == mha::KvType::f16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, x));
  } else if constexpr (T == mha::KvType::bf16) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x)), 16));
  } else {
    static_assert(T == mha::KvType::i8);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, x)));
  }
}
template <mha::KvType T>
__m512 load_kv(const Elem<T>* row, std::int64_t i) {
  const Elem<T>* x = row + i;
  if constexpr (T == mha::KvType::f32) {
    return _mm512_loadu_ps(x);
  } else if constexpr (T == mha::KvType::f16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  } else if constexpr (T == mha::KvType::bf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
  } else {
    static_assert(T == mha::KvType::i8);
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
  }
}

// rows [0, keys) of a K or V tile (head_dim elements of type T each, `stride` apart;
// i8: times its scale, `scales` scale_seq apart, one rounding) into `out` as floats with row
// stride ld: the microkernels' 12 broadcast rows then sit ld apart whatever the tensor's
// layout (token-major rows are H_kv D floats apart, 4 KiB at 8 x 128: 12 such rows share one
// L1 set and evict each other), and a reduced type is converted once per tile.
template <mha::KvType T>
void copy_rows(const Elem<T>* in, std::int64_t stride, const float* scales, std::int64_t scale_seq,
               std::int64_t keys, std::int64_t head_dim, float* out, std::int64_t ld) {
  for (std::int64_t j = 0; j < keys; ++j) {
    const Elem<T>* row = in + j * stride;
    float* to = out + j * ld;
    __m512 scale = _mm512_set1_ps(1.0f);
    if constexpr (T == mha::KvType::i8) scale = _mm512_set1_ps(scales[j * scale_seq]);
    const auto scaled = [&](__m512 x) {
      return T == mha::KvType::i8 ? _mm512_mul_ps(x, scale) : x;
    };
    std::int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16) _mm512_storeu_ps(to + d, scaled(load_kv<T>(row, d)));
    if (d < head_dim) {
      const __mmask16 mask = first_lanes(head_dim - d);
      _mm512_mask_storeu_ps(to + d, mask, scaled(load_kv_masked<T>(row, d, mask)));
    }
  }
}

// S^T for MK keys and 16 NV query rows: st[i][0 .. 16 NV) = c sum_d k_i[d] qt[d][0 .. 16 NV),
// c = scale log2(e). The microkernel of the S product: per d, NV loads of Q^T and MK
// broadcasts, one from each key row, feed MK x NV independent FMAs.
// qt: [head_dim][ld]   k: MK rows of head_dim floats, row stride k_seq   st: [MK][ld]
template <int MK, int NV>
MHA_NOINLINE void logits_tile(const float* qt, std::int64_t ld, const float* k, std::int64_t k_seq,
                              std::int64_t head_dim, __m512 c, float* st, Prefetch* prefetch) {
  __m512 acc[MK][NV];
  const float* key[MK];
#pragma GCC unroll 12
  for (int i = 0; i < MK; ++i) {
    key[i] = k + i * k_seq;
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) acc[i][n] = _mm512_setzero_ps();
  }
  for (std::int64_t d = 0; d < head_dim; ++d) {
    if (prefetch != nullptr) prefetch->step();
    __m512 b[NV];
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) b[n] = _mm512_load_ps(qt + d * ld + 16 * n);
#pragma GCC unroll 12
    for (int i = 0; i < MK; ++i) {
      const __m512 a = _mm512_set1_ps(key[i][d]);
#pragma GCC unroll 2
      for (int n = 0; n < NV; ++n) acc[i][n] = _mm512_fmadd_ps(a, b[n], acc[i][n]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MK; ++i) {
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) _mm512_store_ps(st + i * ld + 16 * n, _mm512_mul_ps(acc[i][n], c));
  }
}

// O^T = alpha O^T + V^T P^T for MD columns of head_dim and 16 NV query rows over `keys`
// keys: ot[i][rows] = alpha[rows] ot[i][rows] + sum_j v_j[i] pt[j][rows]. The microkernel of
// the P V product: per key, NV loads of P^T and MD broadcasts from the key's V row feed
// MD x NV independent FMAs. kMask not none: lanes whose row does not see key j (sees()) keep
// their accumulator, so a V row a query row does not see never reaches it (its weight is 0,
// but 0 x Inf or 0 x NaN is NaN); alpha is then not applied (the unmasked pass did).
// pt: [keys][ld]   v: `keys` rows, row stride v_seq, starting at column i0   ot: [MD][ld]
template <int MD, int NV, Mask kMask>
MHA_NOINLINE void pv_tile(const float* pt, std::int64_t ld, std::int64_t j0, std::int64_t keys,
                          const float* v, std::int64_t v_seq, float* ot, const float* alpha,
                          const LaneKeys& seen, Prefetch* prefetch) {
  __m512 acc[MD][NV];
#pragma GCC unroll 12
  for (int i = 0; i < MD; ++i) {
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) {
      acc[i][n] = _mm512_load_ps(ot + i * ld + 16 * n);
      if (kMask == Mask::none) acc[i][n] = _mm512_mul_ps(acc[i][n], _mm512_load_ps(alpha + 16 * n));
    }
  }
  for (std::int64_t j = j0; j < keys; ++j) {
    if (prefetch != nullptr) prefetch->step();
    const float* row = v + j * v_seq;
    __m512 b[NV];
    __mmask16 mask[NV];
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) {
      b[n] = _mm512_load_ps(pt + j * ld + 16 * n);
      if constexpr (kMask != Mask::none) mask[n] = sees<kMask>(seen, n, j);
    }
#pragma GCC unroll 12
    for (int i = 0; i < MD; ++i) {
      const __m512 a = _mm512_set1_ps(row[i]);
#pragma GCC unroll 2
      for (int n = 0; n < NV; ++n) {
        acc[i][n] = kMask != Mask::none ? _mm512_mask3_fmadd_ps(a, b[n], acc[i][n], mask[n])
                                        : _mm512_fmadd_ps(a, b[n], acc[i][n]);
      }
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MD; ++i) {
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) _mm512_store_ps(ot + i * ld + 16 * n, acc[i][n]);
  }
}

// chains[n][c] = step(n, j, chains[n][c]) for every key j in [begin, keys) of each of NV
// vectors, key begin + i in chain i mod kChains (the tail in chain 0); chains start at
// `init`. Fully unrolled over the chains and vectors, so that they stay in registers.
constexpr int kChains = 4;
template <int NV, typename Step>
void fold_keys(std::int64_t begin, std::int64_t keys, __m512 init, __m512 (&chains)[NV][kChains],
               Step step) {
#pragma GCC unroll 2
  for (int n = 0; n < NV; ++n) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) chains[n][c] = init;
  }
  std::int64_t j = begin;
  for (; j + kChains <= keys; j += kChains) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
#pragma GCC unroll 2
      for (int n = 0; n < NV; ++n) chains[n][c] = step(n, j + c, chains[n][c]);
    }
  }
  for (; j < keys; ++j) {
#pragma GCC unroll 2
    for (int n = 0; n < NV; ++n) chains[n][0] = step(n, j, chains[n][0]);
  }
}

// The online-softmax step of 16 NV query rows (one lane each) over the keys [begin, keys)
// of this tile: st[j][0 .. 16 NV) holds the rows' base-2 logits of key j and becomes their
// weights 2^(logit - m); m, l and alpha (the factor 2^(m_old - m_new) P V applies to O^T)
// are the rows' running max, sum and rescale factor. kMask not none: a lane sees only the
// keys sees() gives it; other lanes get weight 0 and stay out of the max and the sum.
//
// Both vectors of a strip in one pass, four running maxima and sums per vector (keys j mod
// 4), in registers. The max pass is short (a load and a VMAXPS per key) but its result
// gates every weight, so its chains are the latency between the S product and the 2^x: one
// vector at a time, with four chains, the softmax took 1.7x its in-L1 time inside the
// kernel at D = 16. (Indexed as an array, j % 4, GCC 12 kept the chains in memory: a
// store-to-load forwarding per key, 8.5 cycles per 16 logits where the 2^x needs 5.)
template <Mask kMask, int NV>
void online_softmax(float* st, std::int64_t ld, std::int64_t begin, std::int64_t keys,
                    const LaneKeys& seen, float* m, float* l, float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // VMAXPS returns its second source when either is NaN: max(x, mv) skips NaN logits (as
  // blocked does), so m never becomes NaN; their weights are NaN and reach l and O.
  const auto max_at = [&](int n, std::int64_t key, __m512 a) {
    const __m512 x = _mm512_load_ps(st + key * ld + 16 * n);
    if constexpr (kMask == Mask::none) return _mm512_max_ps(x, a);
    return _mm512_mask_max_ps(a, sees<kMask>(seen, n, key), x, a);
  };
  __m512 mv[NV][kChains];
  fold_keys(begin, keys, neg_inf, mv, max_at);
  // Logits relative to 0 while a row's max is -inf (no finite logit yet): see
  // mha::support::logit_shift. alpha is 2^-inf = 0 when m_old is -inf, 1 when the max did not grow.
  __m512 base[NV];
#pragma GCC unroll 2
  for (int n = 0; n < NV; ++n) {
    const __m512 m_old = _mm512_load_ps(m + 16 * n);
    const __m512 m_new = _mm512_max_ps(
        _mm512_max_ps(_mm512_max_ps(mv[n][0], mv[n][1]), _mm512_max_ps(mv[n][2], mv[n][3])), m_old);
    base[n] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), m_new,
                                   _mm512_setzero_ps());
    _mm512_store_ps(m + 16 * n, m_new);
    _mm512_store_ps(alpha + 16 * n, mha::avx512::exp2_nonpositive(_mm512_sub_ps(m_old, base[n])));
  }
  // The weight of key j, stored over its logit, added to sum.
  const auto weigh = [&](int n, std::int64_t key, __m512 sum) {
    const __m512 x = _mm512_sub_ps(_mm512_load_ps(st + key * ld + 16 * n), base[n]);
    const __m512 e = mha::avx512::exp2_nonpositive(x);
    __m512 w = e;
    if constexpr (kMask != Mask::none) w = _mm512_maskz_mov_ps(sees<kMask>(seen, n, key), e);
    _mm512_store_ps(st + key * ld + 16 * n, w);
    return _mm512_add_ps(sum, w);
  };
  __m512 sums[NV][kChains];
  fold_keys(begin, keys, _mm512_setzero_ps(), sums, weigh);
#pragma GCC unroll 2
  for (int n = 0; n < NV; ++n) {
    const __m512 sum =
        _mm512_add_ps(_mm512_add_ps(sums[n][0], sums[n][1]), _mm512_add_ps(sums[n][2], sums[n][3]));
    _mm512_store_ps(l + 16 * n, _mm512_fmadd_ps(_mm512_load_ps(l + 16 * n),
                                                _mm512_load_ps(alpha + 16 * n), sum));
  }
}

// o = acc / divisor and lse for a row that sees `visible` keys, `end` being its
// support::row_end_base2 (of m, l and the head's sink; without a sink divisor l and lse
// (m + log2 l) ln 2, NaN when l == 0: every logit -inf): zeros and the sink (-inf without)
// when it sees none, not 0 / 0; a division, one rounding, as the tolerance assumes.
void finish_row(const float* acc, std::int64_t acc_stride, const mha::RowEnd& end, float sink,
                std::int64_t visible, std::int64_t head_dim, float* o, float* lse) {
  if (visible == 0) {
    for (std::int64_t d = 0; d < head_dim; ++d) o[d] = 0.0f;
    if (lse != nullptr) *lse = sink;
    return;
  }
  for (std::int64_t d = 0; d < head_dim; ++d) o[d] = acc[d * acc_stride] / end.divisor;
  if (lse != nullptr) *lse = end.lse;
}

// r[i][j] <-> r[j][i]: a 16 x 16 transpose in 64 shuffles (pairs of rows, then quads,
// then 128-bit blocks twice).
void transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
  // Rows a = r[2i], b = r[2i+1]:
  // t[2i] = a0 b0 a1 b1 | a4 b4 a5 b5 | ...,  t[2i+1] = a2 b2 a3 b3 | ...
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c]: column c (mod 4) of rows 4i .. 4i+3, per block
    const __m512d lo = _mm512_castps_pd(t[4 * i]), hi = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d lo1 = _mm512_castps_pd(t[4 * i + 1]), hi1 = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo1, hi1));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo1, hi1));
  }
  for (int c = 0; c < 4; ++c) {  // blocks: u[c] rows 0-3, u[4 + c] 4-7, u[8 + c] 8-11, ...
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  // columns c, c + 8
    const __m512 v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);  // columns c + 4, c + 12
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

// Q^T for 16 rows: panel[d * kStrip + i] = row_i[d] for d < head_dim, 0 for the rows that
// are null (padding). Rows are read with masked vector loads of their own elements only.
void pack_rows16(const float* const (&row)[16], std::int64_t head_dim, float* panel) {
  for (std::int64_t d0 = 0; d0 < head_dim; d0 += 16) {
    const std::int64_t n = std::min<std::int64_t>(16, head_dim - d0);
    const __mmask16 mask = first_lanes(n);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = row[i] != nullptr ? _mm512_maskz_loadu_ps(mask, row[i] + d0) : _mm512_setzero_ps();
    }
    transpose16(r);
    for (std::int64_t d = 0; d < n; ++d) _mm512_store_ps(panel + (d0 + d) * kStrip, r[d]);
  }
}

// o_i = acc_i / l_i for 16 rows whose accumulators are lanes of the O^T panel
// (panel[d * kStrip + i]): a division, one rounding, as finish_row.
void divide_rows16(const float* panel, const float* l, std::int64_t head_dim,
                   float* const (&o)[16]) {
  for (std::int64_t d0 = 0; d0 < head_dim; d0 += 16) {
    const std::int64_t n = std::min<std::int64_t>(16, head_dim - d0);
    const __mmask16 mask = first_lanes(n);
    __m512 r[16];
    for (std::int64_t d = 0; d < 16; ++d) {
      r[d] = d < n ? _mm512_load_ps(panel + (d0 + d) * kStrip) : _mm512_setzero_ps();
    }
    transpose16(r);
    for (int i = 0; i < 16; ++i) {
      _mm512_mask_storeu_ps(o[i] + d0, mask, _mm512_div_ps(r[i], _mm512_set1_ps(l[i])));
    }
  }
}

// lane i of the result = the sum of the 16 lanes of a[i]: sixteen dot products finished at
// once (45 instructions instead of 16 horizontal sums).
MHA_ALWAYS_INLINE __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: a0+a2, b0+b2, a1+a3, b1+b3
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit block L: the block-L sums of a[4i .. 4i+3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  }
  const __m512 w01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 w23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Decode's prefetch in a row group's loops: as the S and P V steps load a vector of a key or
// value row of this tile, the same columns of the row `keys` rows further (the next tile's)
// go into L2, a line per line read, so the next tile streams in at the pace this one is
// read. `bytes` is that distance; rows at or past `rows` are not prefetched (0: none, as for
// a group after the tile's first, whose rows are in L1 already; past the block's last key
// their offset may overflow: check() bounds a stride only by the keys that use it).
struct Ahead {
  std::int64_t bytes = 0;
  std::int64_t rows = 0;
  template <mha::KvType T>
  void line(const Elem<T>* x, std::int64_t row, int vector) const {
    // A vector of 16 elements starts a line every 64 / (16 sizeof) vectors.
    constexpr int kEvery = static_cast<int>(64 / (16 * sizeof(Elem<T>)));
    if (vector % kEvery != 0 || row >= rows) return;
    _mm_prefetch(reinterpret_cast<const char*>(x) + bytes, _MM_HINT_T1);
  }
};

// a[i] += q . k_i over NV vectors (16 NV elements, the last vector's lanes limited to
// `last`) for the first nk <= 16 of the 16 key rows k_i = k + i k_seq (of type T): decode's S step.
template <int NV, mha::KvType T>
void dot_16_keys(const float* q, const Elem<T>* k, std::int64_t k_seq, std::int64_t nk,
                 __mmask16 last, __m512 (&a)[16], const Ahead& ahead) {
  __m512 qv[NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    qv[c] = _mm512_maskz_loadu_ps(c + 1 == NV ? last : static_cast<__mmask16>(0xFFFF), q + 16 * c);
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i >= nk) break;
    const Elem<T>* key = k + i * k_seq;
    __m512 dot = a[i];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      ahead.line<T>(key + 16 * c, i, c);
      const __m512 kv =
          c + 1 == NV ? load_kv_masked<T>(key, 16 * c, last) : load_kv<T>(key, 16 * c);
      dot = _mm512_fmadd_ps(qv[c], kv, dot);
    }
    a[i] = dot;
  }
}

// acc = alpha acc + sum_{j < cols} w[j] v_j over NV vectors (the last one's lanes limited
// to `last`) of the rows v_j = v + j v_seq (of type T):
// decode's P V step for one row.
template <int NV, mha::KvType T>
void add_weighted_rows(const float* w, std::int64_t cols, const Elem<T>* v, std::int64_t v_seq,
                       __mmask16 last, float* acc, __m512 alpha, Prefetch& prefetch,
                       const Ahead& ahead) {
  __m512 o[NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), alpha);
  for (std::int64_t j = 0; j < cols; ++j) {
    prefetch.step();
    const __m512 wj = _mm512_set1_ps(w[j]);
    const Elem<T>* row = v + j * v_seq;
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      ahead.line<T>(row + 16 * c, j, c);
      const __m512 x = c + 1 == NV ? load_kv_masked<T>(row, 16 * c, last) : load_kv<T>(row, 16 * c);
      o[c] = _mm512_fmadd_ps(wj, x, o[c]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}

// Decode's row groups: the R query heads of a KV head at one query position read the same
// keys, so their S and P V steps run together and each K or V vector is loaded (and
// converted) once for R rows instead of once per row. R is 1, 2 or 4 (kMaxGroup); 16
// accumulators hold R rows x 16 / R keys in S and R rows x 16 / R vectors in P V.
constexpr int kMaxGroup = 4;
template <int R>
constexpr int kGroupKeys = 16 / R;  // keys per S step of an R-row group

// a[r kGroupKeys + i] += q_r . k_i for r < R and the first nk <= kGroupKeys keys k_i =
// k + i k_seq (of type T), over NV vectors of head_dim (the last one's lanes limited to
// `last`): decode's S step for R >= 2 rows. Per vector of head_dim: R loads of q, one load
// (and conversion) per key, R x keys FMAs.
template <int R, int NV, mha::KvType T>
void dot_group_keys(const float* const (&q)[R], const Elem<T>* k, std::int64_t k_seq,
                    std::int64_t nk, __mmask16 last, __m512 (&a)[16], const Ahead& ahead) {
  constexpr int kKeys = kGroupKeys<R>;
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    const __mmask16 lanes = c + 1 == NV ? last : static_cast<__mmask16>(0xFFFF);
    __m512 qv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) qv[r] = _mm512_maskz_loadu_ps(lanes, q[r] + 16 * c);
#pragma GCC unroll 8
    for (int i = 0; i < kKeys; ++i) {
      if (i >= nk) break;
      const Elem<T>* key = k + i * k_seq;
      ahead.line<T>(key + 16 * c, i, c);
      const __m512 x = c + 1 == NV ? load_kv_masked<T>(key, 16 * c, last) : load_kv<T>(key, 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r * kKeys + i] = _mm512_fmadd_ps(qv[r], x, a[r * kKeys + i]);
    }
  }
}

// acc_r = alpha_r acc_r + sum_{j < cols} w_r[j] v_j for r < R over NV vectors (the last
// one's lanes limited to `last`) of the rows v_j = v + j v_seq (of type T): decode's P V step
// for R >= 2 rows, each V vector loaded (and converted) once for the R rows. No prefetch step
// in its loop: with one, GCC 12 ran out of general registers and kept broadcast weights on
// the stack.
template <int R, int NV, mha::KvType T>
void add_weighted_rows_group(const float* const (&w)[R], std::int64_t cols, const Elem<T>* v,
                             std::int64_t v_seq, __mmask16 last, float* const (&acc)[R],
                             const float (&alpha)[R], const Ahead& ahead) {
  __m512 o[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * c), a);
  }
  for (std::int64_t j = 0; j < cols; ++j) {
    __m512 wj[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wj[r] = _mm512_set1_ps(w[r][j]);
    const Elem<T>* row = v + j * v_seq;
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      ahead.line<T>(row + 16 * c, j, c);
      const __m512 x = c + 1 == NV ? load_kv_masked<T>(row, 16 * c, last) : load_kv<T>(row, 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) o[r][c] = _mm512_fmadd_ps(wj[r], x, o[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc[r] + 16 * c, o[r][c]);
  }
}

// Decode: fewer than 16 query rows (g x q_len) per KV head, too few to fill the lanes of the
// transposed microkernels (one decode row would use 1 lane in 16). Here the lanes run along
// head_dim instead and K and V are read in whole vectors (from memory for the first group of
// a tile, from L1 for the others). The g query heads of a KV head at one query position see
// the same keys; they go in groups of R = 4, 2 or 1 rows (g = 8: 4 + 4, g = 6: 4 + 2, g = 1:
// 1), and a group's S and P V steps load and convert each K and V vector once for its R rows:
// 16 accumulators hold 16 / R keys' dot products of each row, finished together by
// sum_lanes16, and P V adds weight x V row into 16 / R zmm of each row's accumulator. Keys
// come in tiles of support::decode_tile_keys (K and V of a tile in two thirds of L1d: 32
// keys at D = 128 with a 48 KiB L1d, 16 with 32 KiB) while the next tile is prefetched; a
// group reads only the keys its rows see, so masked V rows are never touched. Each row's
// softmax runs on its own row of logits, 16 at a time, as with R = 1.
//
//   for each (batch, KV head): its g x q_len rows, O = 0
//     for each tile of keys, the next one prefetched:
//       for each query position, for each group of R heads that sees a key of the tile:
//         S: 16 / R keys' dot products of R rows at once    dot_group_keys, sum_lanes16
//         per row, online softmax, base 2: m, alpha, P = 2^(S - m), l
//         O = alpha O + P V, 16 / R zmm of head_dim at a time   add_weighted_rows_group
//     o = O / l, lse = (m + log2 l) ln 2                    finish_row
//
// One function on purpose: with the three per-row steps as functions of their own, a
// decode of one KV chunk (4 rows x 256 keys, D = 128) ran 8% slower (GCC 12, register
// allocation across the calls).

// Decode's arrays in the caller's workspace.
struct DecodeScratch {
  std::int64_t d16;        // head_dim rounded up to 16: an accumulator's length
  float* acc;              // [rows][d16]: O
  std::int64_t tile_keys;  // keys per tile, a multiple of 16
  std::int64_t ldw;        // tile_keys + 16: a row of weights, room for a whole vector past
                           // its last key
  float* weights;          // [kMaxGroup][ldw]: a group's logits, then its weights
};

DecodeScratch carve_decode(const mha::Problem& p, Carve& carve) {
  const std::int64_t rows = p.q_heads / p.kv_heads * p.q_len;  // < 16
  DecodeScratch s;
  s.d16 = round_up(p.head_dim, 16);
  s.acc = carve.take<float>(rows * s.d16);
  s.tile_keys = mha::support::decode_tile_keys(p, 16);
  s.ldw = s.tile_keys + 16;
  s.weights = carve.take<float>(kMaxGroup * s.ldw);
  return s;
}

// Rows of the next group when `left` query heads of a KV head remain: 4, 2 or 1.
std::int64_t group_rows(std::int64_t left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }

// Zmm of head_dim per P V step of an R-row group (R x that many accumulators).
constexpr int pv_vectors(int rows) { return rows == 4 ? 4 : 8; }

// Prefetch::step() calls of an R-row group over a tile of `keys` keys: one per S step per
// 128 columns; in P V one per key and slice (R = 1), or per 16 / R keys and slice.
std::int64_t group_steps(std::int64_t rows, std::int64_t keys, std::int64_t head_dim) {
  const std::int64_t s_keys = 16 / rows;
  const std::int64_t pv_cols = 16 * pv_vectors(static_cast<int>(rows));
  const std::int64_t pv_keys = rows == 1 ? keys : (keys + s_keys - 1) / s_keys;
  return (keys + s_keys - 1) / s_keys * ((head_dim + 127) / 128) +
         pv_keys * ((head_dim + pv_cols - 1) / pv_cols);
}

// K and V of type T, rows read in place (i8: a key's scale multiplies its finished logit,
// a value row's its weight, one rounding each, as tolerance.h's step 6 allows).
template <mha::KvType T>
void decode_rows(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                 float* lse, mha::Workspace ws) {
  const std::int64_t dim = p.head_dim;
  const std::int64_t heads = p.q_heads / p.kv_heads;  // g
  const std::int64_t rows = heads * p.q_len;          // < 16
  const std::int64_t d16 = round_up(dim, 16);
  Carve workspace(ws.data);
  const DecodeScratch scratch = carve_decode(p, workspace);
  float* const acc_rows = scratch.acc;
  float* const weights = scratch.weights;
  const std::int64_t ldw = scratch.ldw;
  const __m512 logit_scale = logit_scale_of(p);
  const mha::support::Softcap cap = softcap_of(p);
  const mha::support::Alibi alibi = alibi_of(p);
  const std::int64_t decode_keys = scratch.tile_keys;
  // f16 and bf16: a tile's first group prefetches the next tile in its own loops (Ahead).
  // Measured from DRAM against Prefetch::step() (1 thread, D = 128, Lk = 32768, time ratio):
  // H32 Hkv8 f16 0.78-0.83, bf16 0.80-0.85, token-major f16 0.91; H8 Hkv8 f16 0.81. fp32
  // and i8 keep Prefetch::step(), spread over the steps of every group: with Ahead, fp32
  // H32 Hkv8 took 1.05 (token-major 1.16), H8 Hkv8 1.08 (1.22); i8 H32 Hkv8 0.96-0.99, H8
  // Hkv8 1.07.
  const bool ahead = T == mha::KvType::f16 || T == mha::KvType::bf16;
  std::int64_t steps = 0;
  for (std::int64_t h0 = 0; h0 < heads; h0 += group_rows(heads - h0)) {
    steps += p.q_len * group_steps(group_rows(heads - h0), decode_keys, dim);
  }
  const std::int64_t k_seq = p.k.seq, v_seq = p.v.seq;

  // One block per (batch, KV head): all its g x q_len rows (block row t: query head
  // head0 + t / q_len, query row t % q_len).
  mha::support::for_each_block(p, p.q_len, [&](const Block& block) {
    const mha::KvView k_view = mha::kv_row(k, T, p.k, p.k_scale, block.batch, 0, block.kv_head);
    const mha::KvView v_view = mha::kv_row(v, T, p.v, p.v_scale, block.batch, 0, block.kv_head);
    const auto* k_head = static_cast<const Elem<T>*>(k_view.data);
    const auto* v_head = static_cast<const Elem<T>*>(v_view.data);
    float ms[16], ls[16];
    std::fill(ms, ms + rows, -std::numeric_limits<float>::infinity());
    std::fill(ls, ls + rows, 0.0f);
    std::fill(acc_rows, acc_rows + rows * d16, 0.0f);
    // Keys [block_first, block_keys): a sliding window's tiles start at its first key.
    const std::int64_t block_keys = block.keys(p), block_first = block.first_key(p);
    Prefetch(k_head + block_first * k_seq, k_seq, v_head + block_first * v_seq, v_seq,
             std::min(decode_keys, block_keys - block_first), dim, kBytes<T>, 1)
        .all();

    for (std::int64_t c0 = block_first; c0 < block_keys; c0 += decode_keys) {
      const std::int64_t tile_keys = std::min(decode_keys, block_keys - c0);
      const std::int64_t next_keys =
          std::clamp(block_keys - c0 - decode_keys, std::int64_t{0}, decode_keys);
      // The next tile's rows only when it has keys: past the last key the offset may
      // overflow, since check() bounds a stride only by the keys that use it.
      Prefetch next(next_keys > 0 ? k_head + (c0 + decode_keys) * k_seq : k_head, k_seq,
                    next_keys > 0 ? v_head + (c0 + decode_keys) * v_seq : v_head, v_seq,
                    ahead ? 0 : next_keys, dim, kBytes<T>, steps);
      // The group of R rows t0 + r q_len (query heads head0 + t0 / q_len + r, one query row).
      const auto run_group = [&](auto group_size, std::int64_t t0) __attribute__((always_inline)) {
        constexpr int R = decltype(group_size)::value;
        constexpr int kKeys = kGroupKeys<R>;
        // The same for every row of the group, which share the query row: the tile's keys
        // [c0 + first, c0 + first + cols).
        const std::int64_t first = block.tile_first_seen(p, t0, c0, tile_keys);
        const std::int64_t cols = block.tile_keys_seen(p, t0, c0, tile_keys) - first;
        if (cols == 0) return;
        const std::int64_t c1 = c0 + first;
        const Elem<T>* k_tile = k_head + c1 * k_seq;
        const Elem<T>* v_tile = v_head + c1 * v_seq;
        // A copy the group's loops step, its state in registers (the next group goes on from
        // where this one stopped).
        Prefetch pf = next;
        const float* qr[R];
        for (int r = 0; r < R; ++r) qr[r] = block.q_row(p, q, t0 + r * p.q_len);
        // The tile's first group (query row 0, heads 0 .. R - 1) prefetches the next tile.
        const bool leads = ahead && t0 == 0;
        const std::int64_t k_ahead = leads ? decode_keys * k_seq * kBytes<T> : 0;
        const std::int64_t v_ahead = leads ? decode_keys * v_seq * kBytes<T> : 0;
        // none: no prefetch at all (the next tile's rows are `first` keys further on)
        const std::int64_t ahead_keys = leads ? next_keys - first : 0;
        // Base-2 logits of the rows' `cols` keys, kKeys at a time: row r's dot product with
        // key i in a[r kKeys + i], over slices of 128 columns of head_dim. Row r's logits go
        // to weights + r ldw.
        __m512 mv[R];
        for (int r = 0; r < R; ++r) mv[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (std::int64_t j0 = 0; j0 < cols; j0 += kKeys) {
          const std::int64_t nk = std::min<std::int64_t>(kKeys, cols - j0);
          const Elem<T>* keys = k_tile + j0 * k_seq;
          __m512 a[16];
          for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
          for (std::int64_t d0 = 0; d0 < dim; d0 += 128) {
            with_count<8>((std::min<std::int64_t>(128, dim - d0) + 15) / 16, [&](auto vectors) {
              constexpr int NV = decltype(vectors)::value;
              const __mmask16 key_tail = first_lanes(dim - d0 - 16 * (NV - 1));
              if constexpr (R == 1) {
                dot_16_keys<NV, T>(qr[0] + d0, keys + d0, k_seq, nk, key_tail, a,
                                   Ahead{k_ahead, ahead_keys - j0});
              } else {
                const float* qd[R];
                for (int r = 0; r < R; ++r) qd[r] = qr[r] + d0;
                dot_group_keys<R, NV, T>(qd, keys + d0, k_seq, nk, key_tail, a,
                                         Ahead{k_ahead, ahead_keys - j0});
              }
            });
            pf.step();
          }
          __m512 s = _mm512_mul_ps(sum_lanes16(a), logit_scale);
          if constexpr (T == mha::KvType::i8) {
            alignas(64) float scales[16] = {};
            for (std::int64_t i = 0; i < nk; ++i) {
              const float scale = k_view.scale[(c1 + j0 + i) * p.k_scale.seq];
              for (int r = 0; r < R; ++r) scales[r * kKeys + i] = scale;
            }
            s = _mm512_mul_ps(s, _mm512_load_ps(scales));
          }
          const __mmask16 valid = first_lanes(nk);
          for (int r = 0; r < R; ++r) {
            __m512 sr = s;  // row r's logits in lanes 0 .. nk - 1
            if constexpr (R > 1) {
              const __m512i from = _mm512_add_epi32(
                  _mm512_set1_epi32(r * kKeys),
                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
              sr = _mm512_permutexvar_ps(from, s);
            }
            // All 16 lanes, the ones past nk into the next step's keys or the row's last 16
            // floats: a masked store does not forward to the softmax's loads (with one, MHA
            // decode of f16 from DRAM ran 1.12 [1.05, 1.23] times as long as before groups).
            _mm512_storeu_ps(weights + r * ldw + j0, sr);
            // VMAXPS returns its second source when either is NaN: NaN logits stay out.
            mv[r] = _mm512_mask_max_ps(mv[r], valid, sr, mv[r]);
          }
        }
        // Each row's softmax over its logits, 16 at a time.
        float alpha[R];
        for (int r = 0; r < R; ++r) {
          const std::int64_t t = t0 + r * p.q_len;
          float* w = weights + r * ldw;
          // alpha by the vector 2^x (its error cancels: O and l get the same factor).
          float tile_max = lanes_max(mv[r]);  // no lane of mv is NaN
          if (cap.on()) {  // the capped logits, and their max: the cap of the max
            cap.apply(w, cols);
            tile_max = cap(tile_max);
          }
          if (alibi.on()) {  // the biased logits, and their max
            tile_max =
                alibi.add(alibi.rate(block.head(t)), alibi.distance(block.row(t), c1), w, cols);
          }
          alpha[r] = 1.0f;
          if (tile_max > ms[t]) {
            // 0 when the old max is -inf.
            alpha[r] =
                _mm512_cvtss_f32(mha::avx512::exp2_nonpositive(_mm512_set1_ps(ms[t] - tile_max)));
            ms[t] = tile_max;
          }
          const __m512 base = _mm512_set1_ps(mha::support::logit_shift(ms[t]));
          __m512 sum = _mm512_setzero_ps();
          for (std::int64_t j0 = 0; j0 < cols; j0 += 16) {
            const std::int64_t nk = std::min<std::int64_t>(16, cols - j0);
            const __m512 x = _mm512_maskz_mov_ps(
                first_lanes(nk),
                mha::avx512::exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(w + j0), base)));
            _mm512_storeu_ps(w + j0, x);
            sum = _mm512_add_ps(sum, x);
          }
          ls[t] = ls[t] * alpha[r] + lanes_sum(sum);
          if constexpr (T == mha::KvType::i8) {  // w_j s_j: V's scales, after the sum
            for (std::int64_t j = 0; j < cols; ++j) w[j] *= v_view.scale[(c1 + j) * p.v_scale.seq];
          }
        }
        // O = alpha O + P V over the rows' keys, pv_vectors(R) zmm of head_dim at a time.
        float* acc = acc_rows + t0 * d16;
        constexpr int kVectors = pv_vectors(R);
        for (std::int64_t d0 = 0; d0 < dim; d0 += 16 * kVectors) {
          with_count<kVectors>(
              (std::min<std::int64_t>(16 * kVectors, dim - d0) + 15) / 16, [&](auto vectors) {
                constexpr int NV = decltype(vectors)::value;
                const __mmask16 last = first_lanes(dim - d0 - 16 * (NV - 1));
                if constexpr (R == 1) {
                  add_weighted_rows<NV, T>(weights, cols, v_tile + d0, v_seq, last, acc + d0,
                                           _mm512_set1_ps(alpha[0]), pf,
                                           Ahead{v_ahead, ahead_keys});
                } else {
                  const float* w[R];
                  float* accs[R];
                  for (int r = 0; r < R; ++r) {
                    w[r] = weights + r * ldw;
                    accs[r] = acc + r * p.q_len * d16 + d0;
                  }
                  add_weighted_rows_group<R, NV, T>(w, cols, v_tile + d0, v_seq, last, accs, alpha,
                                                    Ahead{v_ahead, ahead_keys});
                }
              });
          if constexpr (R > 1) {
            for (std::int64_t j = 0; j < cols; j += kKeys) pf.step();
          }
        }
        next = pf;
      };
      // Groups of 2 and 4 rows in a function of their own (inlined too, g = 4 and 8 ran 1.5
      // times as long); a single row's steps in this one (in its own function as well, g = 1
      // from L3 took 1.1-1.5 times as long: GCC 12 kept the prefetch state in memory).
      const auto run_wide = [&](auto group_size, std::int64_t t0) __attribute__((noinline)) {
        run_group(group_size, t0);
      };
      for (std::int64_t row = 0; row < p.q_len; ++row) {
        for (std::int64_t h0 = 0; h0 < heads; h0 += group_rows(heads - h0)) {
          const std::int64_t t0 = h0 * p.q_len + row;
          switch (group_rows(heads - h0)) {
            case 4:
              run_wide(std::integral_constant<int, 4>{}, t0);
              break;
            case 2:
              run_wide(std::integral_constant<int, 2>{}, t0);
              break;
            default:
              run_group(std::integral_constant<int, 1>{}, t0);
          }
        }
      }
    }

    for (std::int64_t t = 0; t < rows; ++t) {
      const float sink = mha::sink_of(p, block.head(t));
      finish_row(acc_rows + t * d16, 1, mha::support::row_end_base2(ms[t], ls[t], sink), sink,
                 mha::visible_keys(p, block.row(t)), dim, block.o_row(p, o, t),
                 block.lse_at(p, lse, t));
    }
  });
}

// Prefill's arrays in the caller's workspace, for blocks of up to R rows (R' = R rounded up
// to 32). Q^T and O^T are strip-major: the 32 rows of a strip are one contiguous
// [head_dim][32] panel, 16 KiB in 4 pages at D = 128 (stored [d][R], a strip's lines lay
// 1 KiB apart over 34 pages; strip-major measured 1-2.5% faster at D = 128). S^T is one
// [Bc][32] panel, reused by every strip. Within a panel, rows are kStrip apart.
struct Scratch {
  std::int64_t ldkv;    // row stride of the K and V copies: head_dim rounded up to 16, plus 16
                        // (an odd number of cache lines, so that rows spread over the L1 sets)
  float* qt;            // per strip [head_dim][32]: Q^T
  float* st;            // [Bc][32]: the strip's S^T, then P^T
  float* ot;            // per strip [head_dim][32]: O^T
  float* m;             // [R']: running maxima (base 2)
  float* l;             // [R']: running sums
  float* alpha;         // [R']: this tile's rescale factors
  float* k_tile;        // [Bc][ldkv]: the K tile's rows
  float* v_tile;        // [Bc][ldkv]: the V tile's rows
  std::int32_t* first;  // [R']: the keys of this tile each row sees, [first, end)
  std::int32_t* end;
  std::int64_t* row_first;  // [R']: the keys of the whole KV head each row sees
  std::int64_t* row_end;
};

Scratch carve(const mha::Problem& p, const Tiling& tiling, Carve& carve) {
  const std::int64_t dim = p.head_dim;
  const std::int64_t block_rows = round_up(p.q_heads / p.kv_heads * tiling.rows_per_head, kStrip);
  Scratch s;
  s.ldkv = round_up(dim, 16) + 16;
  s.qt = carve.take<float>(dim * block_rows);
  s.st = carve.take<float>(tiling.keys * kStrip);
  s.ot = carve.take<float>(dim * block_rows);
  s.m = carve.take<float>(block_rows);
  s.l = carve.take<float>(block_rows);
  s.alpha = carve.take<float>(block_rows);
  s.k_tile = carve.take<float>(tiling.keys * s.ldkv);
  s.v_tile = carve.take<float>(tiling.keys * s.ldkv);
  s.first = carve.take<std::int32_t>(block_rows);
  s.end = carve.take<std::int32_t>(block_rows);
  s.row_first = carve.take<std::int64_t>(block_rows);
  s.row_end = carve.take<std::int64_t>(block_rows);
  return s;
}

// Whether a problem takes the decode path.
bool decodes(const mha::Problem& p) { return p.q_heads / p.kv_heads * p.q_len < 16; }

// The KV tile of keys [c0, c0 + keys) in the block's loop, and the rows the microkernels
// read its K and V from: the tensors' own, or their copies.
struct Tile {
  std::int64_t c0, keys;
  Rows k, v;
};

// A strip of 32 (or, last, 16) block rows from row s0, the keys of the tile some row of it
// sees, [begin, most) (S is computed over them), and those all of its rows see, [lo, shared)
// (P V without masks over them; none when lo >= shared). Without a sliding window begin and
// lo are 0.
struct Strip {
  std::int64_t s0, rows, begin, most, lo, shared;
};

// The strip's rows' keys, [first, end), as lanes (the second vector repeats the first for a
// strip of 16 rows).
LaneKeys lane_keys(const Strip& strip, const std::int32_t* first, const std::int32_t* end) {
  LaneKeys keys;
  for (int n = 0; n < 2; ++n) {
    const std::int64_t t = strip.s0 + 16 * std::min<std::int64_t>(n, strip.rows / 16 - 1);
    keys.first[n] = _mm512_loadu_si512(first + t);
    keys.end[n] = _mm512_loadu_si512(end + t);
  }
  return keys;
}

// The phases of one block, in the order the file's header lists them.

// Q^T of the block's rows, rows past `rows` (up to a multiple of 16) zero padding; m, l
// and O^T start empty. Returns the padded row count.
std::int64_t start_block(const mha::Problem& p, const Block& block, const float* q,
                         const Scratch& s) {
  const std::int64_t padded = round_up(block.rows, 16);
  for (std::int64_t t0 = 0; t0 < padded; t0 += 16) {
    const float* row[16];
    for (std::int64_t i = 0; i < 16; ++i) {
      row[i] = t0 + i < block.rows ? block.q_row(p, q, t0 + i) : nullptr;
    }
    pack_rows16(row, p.head_dim, panel_lane(s.qt, t0, p.head_dim));
  }
  std::fill(s.m, s.m + padded, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + padded, 0.0f);
  std::fill(s.ot, s.ot + round_up(padded, kStrip) * p.head_dim, 0.0f);
  return padded;
}

// ALiBi's bias on the strip's S^T over keys [begin, most): lane i (block row s0 + i) adds
// rate_i |d_i - k| at the k-th key, d_i the distance of key c0 + begin (support::Alibi's
// evaluation, the product fused with the addition: one rounding fewer). Padding lanes add 0.
void strip_alibi(const Block& block, const Tile& tile, const Strip& strip,
                 const mha::support::Alibi& alibi, const Scratch& s) {
  alignas(64) float rate[kStrip] = {}, base[kStrip] = {};
  for (std::int64_t i = 0; i < strip.rows && strip.s0 + i < block.rows; ++i) {
    const std::int64_t t = strip.s0 + i;
    rate[i] = alibi.rate(block.head(t));
    base[i] = static_cast<float>(alibi.distance(block.row(t), tile.c0 + strip.begin));
  }
  const auto run = [&](auto vectors) {
    constexpr int NV = decltype(vectors)::value;
    __m512 r[NV], d[NV];
    for (int n = 0; n < NV; ++n) {
      r[n] = _mm512_load_ps(rate + 16 * n);
      d[n] = _mm512_load_ps(base + 16 * n);
    }
    for (std::int64_t j = strip.begin; j < strip.most; ++j) {
      const __m512 k = _mm512_set1_ps(static_cast<float>(j - strip.begin));
      float* st = s.st + j * kStrip;
      for (int n = 0; n < NV; ++n) {
        const __m512 x = _mm512_loadu_ps(st + 16 * n);
        const __m512 distance = _mm512_abs_ps(_mm512_sub_ps(d[n], k));
        _mm512_storeu_ps(st + 16 * n, _mm512_fmadd_ps(r[n], distance, x));
      }
    }
  };
  if (strip.rows == 32) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, 1>{});
  }
}

// S^T = scale log2(e) K Q^T for the strip, 12 keys at a time, then soft-capped by `cap` and
// biased by `alibi` (base-2 units) if on: the strip's rows' lanes of every key, masked ones
// too (the softmax's masks keep those out).
void strip_logits(const mha::Problem& p, const Block& block, const Tile& tile, const Strip& strip,
                  __m512 logit_scale, const mha::support::Softcap& cap,
                  const mha::support::Alibi& alibi, const Scratch& s, Prefetch* pf) {
  for (std::int64_t j = strip.begin; j < strip.most; j += kMr) {
    with_count<kMr>(strip.most - j, [&](auto keys) {
      constexpr int kKeys = decltype(keys)::value;
      const float* qt = panel_lane(s.qt, strip.s0, p.head_dim);
      const float* k_rows = tile.k.at + j * tile.k.seq;
      if (strip.rows == 32) {
        logits_tile<kKeys, 2>(qt, kStrip, k_rows, tile.k.seq, p.head_dim, logit_scale,
                              s.st + j * kStrip, pf);
      } else {
        logits_tile<kKeys, 1>(qt, kStrip, k_rows, tile.k.seq, p.head_dim, logit_scale,
                              s.st + j * kStrip, pf);
      }
    });
  }
  if (cap.on()) {
    if (strip.rows == 32) {
      cap.apply(s.st + strip.begin * kStrip, (strip.most - strip.begin) * kStrip);
    } else {
      for (std::int64_t j = strip.begin; j < strip.most; ++j) cap.apply(s.st + j * kStrip, 16);
    }
  }
  if (alibi.on()) strip_alibi(block, tile, strip, alibi, s);
}

// The online softmax of the strip's rows over [begin, most); masks only where a row sees
// part of those keys (the causal diagonal, a sliding window's start, the zero padding).
void strip_softmax(const Block& block, const Strip& strip, const Scratch& s) {
  const LaneKeys seen = lane_keys(strip, s.first, s.end);
  // The seeing rows' firsts differ: [begin, most) holds keys before some row's window.
  const bool starts = strip.lo > strip.begin;
  const bool whole = strip.s0 + strip.rows <= block.rows && !starts && strip.shared == strip.most;
  float* const m = s.m + strip.s0;
  float* const l = s.l + strip.s0;
  float* const alpha = s.alpha + strip.s0;
  const auto run = [&](auto vectors) {
    constexpr int NV = decltype(vectors)::value;
    if (whole) {
      online_softmax<Mask::none, NV>(s.st, kStrip, strip.begin, strip.most, seen, m, l, alpha);
    } else if (!starts) {
      online_softmax<Mask::end, NV>(s.st, kStrip, strip.begin, strip.most, seen, m, l, alpha);
    } else {
      online_softmax<Mask::range, NV>(s.st, kStrip, strip.begin, strip.most, seen, m, l, alpha);
    }
  };
  if (strip.rows == 32) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, 1>{});
  }
}

// O^T = alpha O^T + V^T P^T, 12 columns of head_dim at a time: keys every row sees without
// masks (the pass that applies alpha, run even over no key), the others (before them: a
// sliding window's start; after them: the causal diagonal) with.
void strip_pv(const mha::Problem& p, const Tile& tile, const Strip& strip, const Scratch& s,
              Prefetch* pf) {
  const LaneKeys seen = lane_keys(strip, s.first, s.end);
  const float* alpha = s.alpha + strip.s0;
  // Unmasked [lo, shared); masked [begin, before) and [shared, most).
  const std::int64_t shared = std::max(strip.lo, strip.shared);
  const std::int64_t before = std::min(strip.lo, strip.most);
  for (std::int64_t d = 0; d < p.head_dim; d += kMr) {
    with_count<kMr>(p.head_dim - d, [&](auto columns) {
      constexpr int kCols = decltype(columns)::value;
      float* o_cols = panel_lane(s.ot, strip.s0, p.head_dim) + d * kStrip;
      const float* v_cols = tile.v.at + d;
      const auto passes = [&](auto vectors) {
        constexpr int NV = decltype(vectors)::value;
        pv_tile<kCols, NV, Mask::none>(s.st, kStrip, strip.lo, shared, v_cols, tile.v.seq, o_cols,
                                       alpha, seen, pf);
        if (strip.begin < before) {  // keys before some row's window
          pv_tile<kCols, NV, Mask::range>(s.st, kStrip, strip.begin, before, v_cols, tile.v.seq,
                                          o_cols, alpha, seen, pf);
        }
        if (shared < strip.most) {  // keys at or past every row's first: the ends decide
          pv_tile<kCols, NV, Mask::end>(s.st, kStrip, shared, strip.most, v_cols, tile.v.seq,
                                        o_cols, alpha, seen, pf);
        }
      };
      if (strip.rows == 32) {
        passes(std::integral_constant<int, 2>{});
      } else {
        passes(std::integral_constant<int, 1>{});
      }
    });
  }
}

// o = O / l: 16 rows at a time by a transpose when all 16 see some key, else row by row;
// lse row by row (finish_row with no columns).
void finish_block(const mha::Problem& p, const Block& block, const Scratch& s, float* o,
                  float* lse) {
  for (std::int64_t t0 = 0; t0 < block.rows; t0 += 16) {
    const std::int64_t n = std::min<std::int64_t>(16, block.rows - t0);
    float* o_row[16];
    float* lse_row[16];
    float sink[16], divisor[16];
    mha::RowEnd end[16];
    std::int64_t seen[16];
    bool all_see = n == 16;
    for (std::int64_t i = 0; i < n; ++i) {
      o_row[i] = block.o_row(p, o, t0 + i);
      lse_row[i] = block.lse_at(p, lse, t0 + i);
      sink[i] = mha::sink_of(p, block.head(t0 + i));
      end[i] = mha::support::row_end_base2(s.m[t0 + i], s.l[t0 + i], sink[i]);
      divisor[i] = end[i].divisor;
      seen[i] = mha::visible_keys(p, block.row(t0 + i));
      all_see = all_see && seen[i] > 0;
    }
    const float* const panel = panel_lane(s.ot, t0, p.head_dim);
    if (all_see) divide_rows16(panel, divisor, p.head_dim, o_row);
    for (std::int64_t i = 0; i < n; ++i) {
      finish_row(panel + i, kStrip, end[i], sink[i], seen[i], all_see ? 0 : p.head_dim, o_row[i],
                 lse_row[i]);
    }
  }
}

}  // namespace

std::size_t mha_f32_attention_avx512_workspace(const mha::Problem& p) {
  if (decodes(p)) return mha::support::workspace_bytes([&](Carve& c) { carve_decode(p, c); });
  // At least what the largest decode (15 rows) needs: a workspace never shrinks as q_len
  // grows, even where the path changes (at head_dim 1, 15 decode rows need more than a
  // 16-row block).
  mha::Problem largest_decode = p;
  largest_decode.q_heads = p.kv_heads;
  largest_decode.q_len = 15;
  const Tiling tiling = choose_tiling(p);
  return std::max(mha::support::workspace_bytes([&](Carve& c) { carve_decode(largest_decode, c); }),
                  mha::support::workspace_bytes([&](Carve& c) { carve(p, tiling, c); }));
}

namespace {

// copy_rows for K or V of the problem's type.
void copy_kv_rows(mha::KvType t, const void* in, std::int64_t stride, const float* scales,
                  std::int64_t scale_seq, std::int64_t keys, std::int64_t head_dim, float* out,
                  std::int64_t ld) {
  const auto copy = [&](auto type) {
    constexpr mha::KvType kType = decltype(type)::value;
    copy_rows<kType>(static_cast<const Elem<kType>*>(in), stride, scales, scale_seq, keys, head_dim,
                     out, ld);
  };
  switch (t) {
    case mha::KvType::f16:
      return copy(std::integral_constant<mha::KvType, mha::KvType::f16>());
    case mha::KvType::bf16:
      return copy(std::integral_constant<mha::KvType, mha::KvType::bf16>());
    case mha::KvType::i8:
      return copy(std::integral_constant<mha::KvType, mha::KvType::i8>());
    case mha::KvType::f32:
      break;
  }
  copy(std::integral_constant<mha::KvType, mha::KvType::f32>());
}

// Every problem that is not a decode: blocks of R rows over KV tiles, K and V of any type
// (a reduced one converted as its tile is copied).
void prefill(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
             float* lse, mha::Workspace ws) {
  const std::int64_t dim = p.head_dim;
  const mha::KvType type = p.kv_type;
  const auto bytes = static_cast<std::int64_t>(mha::kv_type_bytes(type));
  const auto at = [&](const mha::KvView& x, std::int64_t offset) {  // `offset` elements on
    return mha::advance(x, type, offset, 0).data;
  };
  const Tiling tiling = choose_tiling(p);
  const std::int64_t bc = tiling.keys;
  Carve workspace(ws.data);
  const Scratch s = carve(p, tiling, workspace);
  const __m512 logit_scale = logit_scale_of(p);
  const mha::support::Softcap cap = softcap_of(p);
  const mha::support::Alibi alibi = alibi_of(p);

  mha::support::for_each_block(p, tiling.rows_per_head, [&](const Block& block) {
    const std::int64_t padded = start_block(p, block, q, s);
    const mha::KvView k_view = mha::kv_row(k, type, p.k, p.k_scale, block.batch, 0, block.kv_head);
    const mha::KvView v_view = mha::kv_row(v, type, p.v, p.v_scale, block.batch, 0, block.kv_head);
    // Keys [block_first, block_keys): a sliding window's tiles start at its first key.
    const std::int64_t block_keys = block.keys(p), block_first = block.first_key(p);
    // Decode-sized blocks (at most kSmallBlockRows rows, 16 to 64 per KV head) compute a
    // tile too briefly to hide reading the next one: their first strip prefetches it,
    // spread over the microkernel steps. Larger blocks compute each tile long enough for
    // the hardware prefetchers and the copy's own reads; software prefetches there
    // measured 1.5-5% slower (token-major, L = 2048 and 8192).
    const bool small = padded <= kSmallBlockRows;
    const std::int64_t steps = (bc + kMr - 1) / kMr * dim + (dim + kMr - 1) / kMr * bc;
    if (small) {
      Prefetch(at(k_view, block_first * p.k.seq), p.k.seq, at(v_view, block_first * p.v.seq),
               p.v.seq, std::min(bc, block_keys - block_first), dim, bytes, 1)
          .all();
    }
    // K and V tiles are copied to the padded stride ldkv, except in decode-sized blocks
    // whose rows are not a multiple of 1 KiB apart: there the copy cost up to a third of a
    // tile's FMAs (MQA decode, 32 rows, ran 8-17% faster reading head-major rows where they
    // are), while in large blocks the padded stride pays for itself (reading 512-byte-apart
    // rows in place made D = 128 prefill 1.5-4% slower). Rows 1 KiB apart or a multiple of
    // it (token-major: 4 KiB) put 3 or more of 12 rows into one L1 set, and stride 0
    // (shared rows) is copied too, and so is a reduced type: converted once per tile.
    const auto copied = [&](std::int64_t seq) {
      return type != mha::KvType::f32 || !small ||
             seq % (1024 / std::int64_t{sizeof(float)}) == 0;  // no overflow
    };
    const bool copy_k = copied(p.k.seq), copy_v = copied(p.v.seq);
    // Each row's keys, once per block (padding rows see none): a tile's are these clamped.
    for (std::int64_t t = 0; t < padded; ++t) {
      const bool row = t < block.rows;
      s.row_first[t] = row ? mha::first_key(p, block.row(t)) : 0;
      s.row_end[t] = row ? mha::visible_keys(p, block.row(t)) : 0;
    }

    for (std::int64_t c0 = block_first; c0 < block_keys; c0 += bc) {
      const std::int64_t tile_keys = std::min(bc, block_keys - c0);
      const std::int64_t next_keys = std::clamp(block_keys - c0 - bc, std::int64_t{0}, bc);
      // As in decode_rows: the next tile's rows only when it has keys.
      Prefetch next(next_keys > 0 ? at(k_view, (c0 + bc) * p.k.seq) : k_view.data, p.k.seq,
                    next_keys > 0 ? at(v_view, (c0 + bc) * p.v.seq) : v_view.data, p.v.seq,
                    next_keys, dim, bytes, steps);
      // The microkernels' K and V rows: the tensor's own (fp32), or their copy in `buffer`.
      const auto tile_rows = [&](const mha::KvView& head, std::int64_t seq, std::int64_t scale_seq,
                                 bool copy, float* buffer) {
        const mha::KvView first = mha::advance(head, type, c0 * seq, c0 * scale_seq);
        if (!copy) return Rows{static_cast<const float*>(first.data), seq};  // f32 only
        copy_kv_rows(type, first.data, seq, first.scale, scale_seq, tile_keys, dim, buffer, s.ldkv);
        return Rows{buffer, s.ldkv};
      };
      const Tile tile{c0, tile_keys, tile_rows(k_view, p.k.seq, p.k_scale.seq, copy_k, s.k_tile),
                      tile_rows(v_view, p.v.seq, p.v_scale.seq, copy_v, s.v_tile)};
      for (std::int64_t t = 0; t < padded; ++t) {  // Block::tile_first_seen, tile_keys_seen
        const std::int64_t first = std::clamp(s.row_first[t] - c0, std::int64_t{0}, tile_keys);
        const std::int64_t end = std::clamp(s.row_end[t] - c0, std::int64_t{0}, tile_keys);
        const bool none = first == end;  // of the tile: both 0
        s.first[t] = static_cast<std::int32_t>(none ? 0 : first);
        s.end[t] = static_cast<std::int32_t>(none ? 0 : end);
      }
      for (std::int64_t s0 = 0; s0 < padded; s0 += kStrip) {
        Strip strip{s0, std::min(kStrip, padded - s0), tile_keys, 0, 0, tile_keys};
        for (std::int64_t t = s0; t < std::min(s0 + strip.rows, block.rows); ++t) {
          if (s.end[t] > 0) strip.begin = std::min<std::int64_t>(strip.begin, s.first[t]);
          strip.most = std::max<std::int64_t>(strip.most, s.end[t]);
          strip.lo = std::max<std::int64_t>(strip.lo, s.first[t]);
          strip.shared = std::min<std::int64_t>(strip.shared, s.end[t]);
        }
        if (strip.most == 0) {  // no row of the strip sees this tile: alpha = 1, O^T unchanged
          std::fill(s.alpha + s0, s.alpha + s0 + strip.rows, 1.0f);
          continue;
        }
        Prefetch* const pf = small && s0 == 0 ? &next : nullptr;
        strip_logits(p, block, tile, strip, logit_scale, cap, alibi, s, pf);
        strip_softmax(block, strip, s);
        strip_pv(p, tile, strip, s, pf);
      }
    }
    finish_block(p, block, s, o, lse);
  });
}

}  // namespace

void mha_f32_attention_avx512(const mha::Problem& call, const float* q, mha::KvView k,
                              mha::KvView v, float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(call))
    return mha::each_sequence(mha_f32_attention_avx512, call, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;
  // ALiBi's reach (support::AlibiReach): a sliding window past which no key weighs in.
  const mha::Problem p = mha::support::AlibiReach::apply(call, q, k, v);
  if (!decodes(p)) {
    prefill(p, q, k, v, o, lse, ws);
    return;
  }
  switch (p.kv_type) {
    case mha::KvType::f16:
      return decode_rows<mha::KvType::f16>(p, q, k, v, o, lse, ws);
    case mha::KvType::bf16:
      return decode_rows<mha::KvType::bf16>(p, q, k, v, o, lse, ws);
    case mha::KvType::i8:
      return decode_rows<mha::KvType::i8>(p, q, k, v, o, lse, ws);
    case mha::KvType::f32:
      break;
  }
  decode_rows<mha::KvType::f32>(p, q, k, v, o, lse, ws);
}

MHA_TARGET_END

// highway_kernel-inl.h: multi-head attention with flash-attention tiling and a base-2 online
// softmax, in fp32, written once in Highway ops and compiled by highway.cpp once per target
// (hwy/foreach_target.h re-includes this file with a new HWY_TARGET each time). The
// algorithm and layout of kernels/avx2/avx2.cpp (read that file first), with the vector
// length N = Lanes(d), a run-time value on SVE:
//
//   for each (batch, KV head, block of R = g x Br query rows; all g heads share every KV
//            tile):                                                      tiled::Loops
//     pack Q: each group of MR rows into Qp[d][MR], rows past R zero     PackQ
//     for each KV tile of Bc = 128 keys some row of the block sees (causal: later tiles
//              are skipped):
//       pack K^T into panels Kp[panel][d][2N]                            PackK
//       S = scale log2(e) Q K^T    microkernel MR rows x 2N keys         LogitsTile
//       online softmax in base 2 per row (Exp2NonPositive below)         OnlineSoftmax
//       pack V into column panels Vp[panel][key][2N]                     PackV
//       O = alpha O + P V          microkernel MR rows x 2N columns      PvTile, PvRow
//     o = O / l, lse = (m + log2 l) ln2                                  FinishRow
//
// Decode (fewer than 16 rows g x q_len per KV head): lanes along head_dim, K and V read in
// place, 4 keys' dot products at a time, each finished by SumOfLanes (DecodeLogits,
// DecodeWeights, AddWeightedRows).
//
// The loops are mha/tiled_loops.h's, shared with avx2 and the xsimd kernels, included once
// per target inside this target's namespace and pragmas; struct Ops below is their policy,
// made of this file's functions.
//
// What Highway 1.0.3 does not give, and what this file does instead:
//   * Arrays of vectors or vectors as members: SVE's vectors are sizeless types, which may
//     not be array elements, class members or captured by copy. The MR x 2 accumulator grid
//     is named variables, written once by the MHA_HWY_ROWS macro (a row list, 6 or 12
//     entries); so a group always computes MR rows, and Qp holds zero rows past the block's
//     last (their results are never read).
//   * Loads and stores of part of a vector that touch only those elements (no LoadN or
//     StoreN; MaskedLoad may read the whole vector): a row's last partial vector is a
//     scalar loop or goes through a vector-sized buffer on the stack.
//   * Prefetch of arbitrary addresses into L2: support::RowPrefetch and __builtin_prefetch.
//   * Horizontal sum of several vectors at once (xsimd's haddp): decode finishes each key
//     with SumOfLanes, about 4-6 instructions per key beside D / N FMAs.
//   * A 2^x of declared error that flushes as the tolerance expects: Exp2NonPositive is
//     avx2_exp.h's algorithm in Highway ops (measured per target in
//     property_tests/highway_exp_test.cpp).
//
// Register tiles: MR = 6 on targets with 16 vector registers (SSE4, AVX2), 12 with 32
// (AVX-512, NEON, SVE): 12 or 24 accumulators, a broadcast per row and 2 panel loads a step.
//
// Everything else (tile sizes from the caches, causal masking, NaN and Inf rules, tails of
// any key count, row count and head_dim, workspace layout, prefetch) is avx2.cpp's, with the
// same reasons and the same contract (mha/attention.h).
//
// Per-target include guard (Highway's idiom): the body is compiled once per HWY_TARGET.
#if defined(MHA_HIGHWAY_KERNEL_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_HIGHWAY_KERNEL_INL_H_
#undef MHA_HIGHWAY_KERNEL_INL_H_
#else
#define MHA_HIGHWAY_KERNEL_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "mha/attention.h"
#include "mha/support.h"

HWY_BEFORE_NAMESPACE();
namespace mha::highway_kernel {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The loops, once per target: inside this target's namespace and pragmas (mha/tiled_loops.h).
#include "mha/tiled_loops.h"

using mha::support::round_up;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;

// MR, and the row list that names each row's accumulators.
#if HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSSE3 || \
    HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
constexpr int kRows = 6;
#define MHA_HWY_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#else
constexpr int kRows = 12;
#define MHA_HWY_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#endif

using tiled::kKeys;                   // Bc: keys per KV tile, S's row stride
constexpr std::int64_t kDotKeys = 4;  // keys per decode dot-product step
// The widest vector this target may have, in floats (2048-bit SVE: 64).
constexpr std::size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);

inline float NegInf() { return -std::numeric_limits<float>::infinity(); }

// N, and the panel width 2N: run-time values (constant on every target but SVE).
HWY_INLINE std::int64_t Lanes() { return static_cast<std::int64_t>(hn::Lanes(D())); }
HWY_INLINE std::int64_t Panel() { return 2 * Lanes(); }

// 2^x for x <= 0, -inf or NaN: avx2_exp.h's algorithm (its header gives the derivation).
// 2^n 2^f, n = round(x), f = x - n exact; 2^f by a degree-7 Taylor polynomial; 2^n built in
// the exponent field by one addition of 1.5 2^23 + 127 and a shift; x clamped to -127, so
// results below 2^-126.5 flush to +0. -inf gives 0; NaN stays NaN (the clamp's comparison
// is false for NaN). Where the target has no FMA (SSE4), MulAdd is a multiply and an add.
HWY_INLINE V Exp2NonPositive(V x) {
  const D d;
  const hn::RebindToSigned<D> di;
  const V shifter = hn::Set(d, 12583039.0f);  // 1.5 2^23 + 127
  x = hn::IfThenElse(hn::Lt(x, hn::Set(d, -127.0f)), hn::Set(d, -127.0f), x);
  const V t = hn::Add(x, shifter);                 // 1.5 2^23 + n + 127
  const V f = hn::Sub(x, hn::Sub(t, shifter));     // both exact
  V p = hn::Set(d, mha::support::kExp2Taylor[0]);  // ln2^k / k! for k = 7 .. 0
#pragma GCC unroll 8
  for (int k = 1; k < 8; ++k) p = hn::MulAdd(p, f, hn::Set(d, mha::support::kExp2Taylor[k]));
  const V scale = hn::BitCast(d, hn::ShiftLeft<23>(hn::BitCast(di, t)));  // 2^n, or +0
  return hn::Mul(p, scale);
}

// Stores lanes [0, n) of x (1 <= n) and touches no other element of out.
HWY_INLINE void StorePart(V x, std::int64_t n, float* out) {
  const D d;
  if (n >= Lanes()) {
    hn::StoreU(x, d, out);
    return;
  }
  HWY_ALIGN float buf[kMaxLanes];
  hn::Store(x, d, buf);
  std::copy(buf, buf + n, out);
}

// ---- Packing ----------------------------------------------------------------------------

// kp[panel][d][i] = k[2N panel + i][d], 0 for keys >= keys, over round_up(keys, 2N) keys.
inline void PackK(const float* k, std::int64_t k_seq, std::int64_t keys, std::int64_t dim,
                  float* kp) {
  const std::int64_t panel = Panel();
  const std::int64_t padded = round_up(keys, panel);
  for (std::int64_t j = 0; j < padded; ++j) {
    float* column = kp + (j / panel) * dim * panel + j % panel;
    if (j >= keys) {  // no row: its offset may overflow (a stride is bounded by its rows)
      for (std::int64_t d = 0; d < dim; ++d) column[d * panel] = 0.0f;
      continue;
    }
    const float* row = k + j * k_seq;
    for (std::int64_t d = 0; d < dim; ++d) column[d * panel] = row[d];
  }
}

// vp[panel][j][c] = v[j][2N panel + c], 0 for columns >= dim.
inline void PackV(const float* v, std::int64_t v_seq, std::int64_t keys, std::int64_t dim,
                  float* vp) {
  const D d;
  const std::int64_t n = Lanes(), panel = Panel();
  const std::int64_t dim_p = round_up(dim, panel), full = dim / n * n;
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* row = v + j * v_seq;
    for (std::int64_t c = 0; c < dim_p; c += n) {
      float* out = vp + (c / panel) * kKeys * panel + j * panel + c % panel;
      if (c < full) {
        hn::Store(hn::LoadU(d, row + c), d, out);
      } else {
        for (std::int64_t i = 0; i < n; ++i) out[i] = c + i < dim ? row[c + i] : 0.0f;
      }
    }
  }
}

// qp[d][r] = q[r][d] for r < nr, 0 for nr <= r < MR.
inline void PackQ(const float* const* q, int nr, std::int64_t dim, float* qp) {
  for (std::int64_t d = 0; d < dim; ++d) {
    for (int r = 0; r < kRows; ++r) qp[d * kRows + r] = r < nr ? q[r][d] : 0.0f;
  }
}

// ---- Microkernels -----------------------------------------------------------------------

// The S microkernel over all MR rows: s[r][0 .. 2N) = c sum_d qp[d][r] kp[d][0 .. 2N), lanes
// >= limit[r] set to -inf (keys row r does not see), and rowmax[r] (N lanes) takes the lane
// maxima, ignoring NaN logits (a NaN x > max is false).
// qp: [dim][MR]   kp: [dim][2N]   s: [MR][kKeys]   rowmax: [MR][N]
inline HWY_NOINLINE void LogitsTile(const float* qp, const float* kp, std::int64_t dim, float c,
                                    const std::int64_t* limit, float* s, float* rowmax) {
  const D d;
  const std::int64_t n = Lanes(), panel = Panel();
#define MHA_HWY_DECLARE(r) \
  V a##r##0 = hn::Zero(d); \
  V a##r##1 = hn::Zero(d);
  MHA_HWY_ROWS(MHA_HWY_DECLARE)
#undef MHA_HWY_DECLARE
  for (std::int64_t i = 0; i < dim; ++i) {
    const V b0 = hn::Load(d, kp + i * panel);
    const V b1 = hn::Load(d, kp + i * panel + n);
    const float* a = qp + i * kRows;
#define MHA_HWY_STEP(r)                    \
  {                                        \
    const V ar = hn::Set(d, a[r]);         \
    a##r##0 = hn::MulAdd(ar, b0, a##r##0); \
    a##r##1 = hn::MulAdd(ar, b1, a##r##1); \
  }
    MHA_HWY_ROWS(MHA_HWY_STEP)
#undef MHA_HWY_STEP
  }
  const V cv = hn::Set(d, c), minus_inf = hn::Set(d, NegInf());
  const V iota = hn::Iota(d, 0.0f);
#define MHA_HWY_EPILOGUE(r)                                                                  \
  {                                                                                          \
    V x0 = hn::Mul(a##r##0, cv), x1 = hn::Mul(a##r##1, cv);                                  \
    if (limit[r] < panel) {                                                                  \
      const V lim = hn::Set(d, static_cast<float>(std::max<std::int64_t>(limit[r], 0)));     \
      x0 = hn::IfThenElse(hn::Lt(iota, lim), x0, minus_inf);                                 \
      x1 = hn::IfThenElse(hn::Lt(hn::Add(iota, hn::Set(d, static_cast<float>(n))), lim), x1, \
                          minus_inf);                                                        \
    }                                                                                        \
    hn::Store(x0, d, s + (r)*kKeys);                                                         \
    hn::Store(x1, d, s + (r)*kKeys + n);                                                     \
    V m = hn::Load(d, rowmax + (r)*n);                                                       \
    m = hn::IfThenElse(hn::Gt(x0, m), x0, m);                                                \
    m = hn::IfThenElse(hn::Gt(x1, m), x1, m);                                                \
    hn::Store(m, d, rowmax + (r)*n);                                                         \
  }
  MHA_HWY_ROWS(MHA_HWY_EPILOGUE)
#undef MHA_HWY_EPILOGUE
}

// The PV microkernel over all MR rows: o[r][0 .. 2N) = alpha[r] o[r][0 .. 2N) + sum_{j <
// keys} p[r][j] vp[j][0 .. 2N); alpha null: no rescale.
// p: [MR][kKeys]   vp: [keys][2N]   o: [MR][ld_o]
inline HWY_NOINLINE void PvTile(const float* p, std::int64_t keys, const float* vp,
                                const float* alpha, float* o, std::int64_t ld_o) {
  const D d;
  const std::int64_t n = Lanes(), panel = Panel();
#define MHA_HWY_LOAD(r)                               \
  V a##r##0 = hn::Load(d, o + (r)*ld_o);              \
  V a##r##1 = hn::Load(d, o + (r)*ld_o + n);          \
  if (alpha != nullptr) {                             \
    a##r##0 = hn::Mul(a##r##0, hn::Set(d, alpha[r])); \
    a##r##1 = hn::Mul(a##r##1, hn::Set(d, alpha[r])); \
  }
  MHA_HWY_ROWS(MHA_HWY_LOAD)
#undef MHA_HWY_LOAD
  for (std::int64_t j = 0; j < keys; ++j) {
    const V b0 = hn::Load(d, vp + j * panel);
    const V b1 = hn::Load(d, vp + j * panel + n);
#define MHA_HWY_STEP(r)                        \
  {                                            \
    const V pr = hn::Set(d, p[(r)*kKeys + j]); \
    a##r##0 = hn::MulAdd(pr, b0, a##r##0);     \
    a##r##1 = hn::MulAdd(pr, b1, a##r##1);     \
  }
    MHA_HWY_ROWS(MHA_HWY_STEP)
#undef MHA_HWY_STEP
  }
#define MHA_HWY_STORE(r)               \
  hn::Store(a##r##0, d, o + (r)*ld_o); \
  hn::Store(a##r##1, d, o + (r)*ld_o + n);
  MHA_HWY_ROWS(MHA_HWY_STORE)
#undef MHA_HWY_STORE
}

// One row's P V over `keys` keys: o[0 .. 2N) += sum_j p[j] vp[j][0 .. 2N).
HWY_INLINE void PvRow(const float* p, std::int64_t keys, const float* vp, float* o) {
  const D d;
  const std::int64_t n = Lanes(), panel = Panel();
  V a0 = hn::Load(d, o), a1 = hn::Load(d, o + n);
  for (std::int64_t j = 0; j < keys; ++j) {
    const V pj = hn::Set(d, p[j]);
    a0 = hn::MulAdd(pj, hn::Load(d, vp + j * panel), a0);
    a1 = hn::MulAdd(pj, hn::Load(d, vp + j * panel + n), a1);
  }
  hn::Store(a0, d, o);
  hn::Store(a1, d, o + n);
}

// One row's base-2 online-softmax step over its `cols` (>= 1) logits of this tile: s
// becomes 2^(s - m_new); lanes up to the next multiple of 2N are -inf and become 0.
inline void OnlineSoftmax(float* s, std::int64_t cols, const float* rowmax, float* m, float* l,
                          float* alpha) {
  const D d;
  const std::int64_t n = Lanes();
  const float m_old = *m;
  const float tile_max = hn::GetLane(hn::MaxOfLanes(d, hn::Load(d, rowmax)));  // no NaN lane
  float a = 1.0f;
  if (tile_max > m_old) {
    a = std::exp2(m_old - tile_max);  // exactly 0 when m_old is -inf
    *m = tile_max;
  }
  const V base = hn::Set(d, mha::support::logit_shift(*m));
  V sum = hn::Zero(d);
  for (std::int64_t j = 0; j < cols; j += n) {
    const V w = Exp2NonPositive(hn::Sub(hn::Load(d, s + j), base));
    hn::Store(w, d, s + j);
    sum = hn::Add(sum, w);
  }
  *l = *l * a + hn::GetLane(hn::SumOfLanes(d, sum));
  *alpha = a;
}

// o = acc / l and lse = (m + log2 l) ln 2 for a row that sees `visible` keys.
inline void FinishRow(const float* acc, float m, float l, float sink, std::int64_t visible,
                      std::int64_t dim, float* o, float* lse) {
  const D d;
  const mha::RowEnd end = mha::support::row_end_base2(m, l, sink);
  const V lv = hn::Set(d, end.divisor);  // a division: one rounding, as the tolerance assumes
  for (std::int64_t i = 0; i < dim; i += Lanes()) {
    const V x = visible == 0 ? hn::Zero(d) : hn::Div(hn::LoadU(d, acc + i), lv);
    StorePart(x, dim - i, o + i);
  }
  if (lse == nullptr) return;
  *lse = visible == 0 ? sink : end.lse;
}

// ---- Decode -----------------------------------------------------------------------------
// avx2.cpp's decode_rows in Highway ops: per row, 4 keys' dot products at a time over the
// full vectors of head_dim (4 accumulators, one q load per 4 K loads), each finished by
// SumOfLanes, the last D mod N columns in scalar code; P V adds weight x V row into the row's
// accumulator, 4 vectors at a time. Tiles of decode_tile_keys keys, the next tile prefetched
// into L2 a few rows per dot-product step.

// Keys per decode step of the softmax: a multiple of both N and kDotKeys.
inline std::int64_t DecodeStep() { return std::max(Lanes(), kDotKeys); }

// out[i] = c q . k_i for the nk (1 .. 4) key rows k_i = k + i k_seq.
HWY_INLINE void DotKeys(const float* q, const float* k, std::int64_t k_seq, std::int64_t nk,
                        std::int64_t dim, float c, float* out) {
  const D d;
  const std::int64_t n = Lanes(), full = dim / n * n;
  // Keys past nk repeat the last one (rows the caller may read); their sums are dropped.
  const float* k0 = k;
  const float* k1 = k + std::min<std::int64_t>(1, nk - 1) * k_seq;
  const float* k2 = k + std::min<std::int64_t>(2, nk - 1) * k_seq;
  const float* k3 = k + std::min<std::int64_t>(3, nk - 1) * k_seq;
  V a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (std::int64_t i = 0; i < full; i += n) {
    const V qv = hn::LoadU(d, q + i);
    a0 = hn::MulAdd(qv, hn::LoadU(d, k0 + i), a0);
    a1 = hn::MulAdd(qv, hn::LoadU(d, k1 + i), a1);
    a2 = hn::MulAdd(qv, hn::LoadU(d, k2 + i), a2);
    a3 = hn::MulAdd(qv, hn::LoadU(d, k3 + i), a3);
  }
  float sums[kDotKeys] = {hn::GetLane(hn::SumOfLanes(d, a0)), hn::GetLane(hn::SumOfLanes(d, a1)),
                          hn::GetLane(hn::SumOfLanes(d, a2)), hn::GetLane(hn::SumOfLanes(d, a3))};
  const float* keys[kDotKeys] = {k0, k1, k2, k3};
  for (std::int64_t j = 0; j < nk; ++j) {
    for (std::int64_t i = full; i < dim; ++i) sums[j] += q[i] * keys[j][i];
    out[j] = sums[j] * c;
  }
}

// acc = alpha acc + sum_{j < cols} w[j] v_j over head_dim = dim, for the rows v_j = v + j v_seq.
inline void AddWeightedRows(const float* w, std::int64_t cols, const float* v, std::int64_t v_seq,
                            std::int64_t dim, float* acc, float alpha) {
  const D d;
  const std::int64_t n = Lanes(), full = dim / n * n;
  const V av = hn::Set(d, alpha);
  std::int64_t c = 0;
  for (; c + 4 * n <= full; c += 4 * n) {  // 4 vectors at a time
    V o0 = hn::Mul(hn::LoadU(d, acc + c), av), o1 = hn::Mul(hn::LoadU(d, acc + c + n), av);
    V o2 = hn::Mul(hn::LoadU(d, acc + c + 2 * n), av);
    V o3 = hn::Mul(hn::LoadU(d, acc + c + 3 * n), av);
    for (std::int64_t j = 0; j < cols; ++j) {
      const V wj = hn::Set(d, w[j]);
      const float* row = v + j * v_seq + c;
      o0 = hn::MulAdd(wj, hn::LoadU(d, row), o0);
      o1 = hn::MulAdd(wj, hn::LoadU(d, row + n), o1);
      o2 = hn::MulAdd(wj, hn::LoadU(d, row + 2 * n), o2);
      o3 = hn::MulAdd(wj, hn::LoadU(d, row + 3 * n), o3);
    }
    hn::StoreU(o0, d, acc + c);
    hn::StoreU(o1, d, acc + c + n);
    hn::StoreU(o2, d, acc + c + 2 * n);
    hn::StoreU(o3, d, acc + c + 3 * n);
  }
  for (; c < full; c += n) {  // then one vector at a time
    V o0 = hn::Mul(hn::LoadU(d, acc + c), av);
    for (std::int64_t j = 0; j < cols; ++j) {
      o0 = hn::MulAdd(hn::Set(d, w[j]), hn::LoadU(d, v + j * v_seq + c), o0);
    }
    hn::StoreU(o0, d, acc + c);
  }
  for (; c < dim; ++c) {  // the last D mod N columns
    float x = acc[c] * alpha;
    for (std::int64_t j = 0; j < cols; ++j) x += w[j] * v[j * v_seq + c];
    acc[c] = x;
  }
}

// Base-2 logits of the row's `cols` keys into w, kDotKeys at a time, a prefetch step after
// each; returns their max, ignoring NaN logits (a NaN x > max is false).
template <class Step>
HWY_INLINE float DecodeLogits(const float* q, const float* k, std::int64_t k_seq, std::int64_t cols,
                              std::int64_t dim, float c, float* w, const Step& after_step) {
  for (std::int64_t j0 = 0; j0 < cols; j0 += kDotKeys) {
    DotKeys(q, k + j0 * k_seq, k_seq, std::min(kDotKeys, cols - j0), dim, c, w + j0);
    after_step();
  }
  float tile_max = NegInf();
  for (std::int64_t j = 0; j < cols; ++j) {
    if (w[j] > tile_max) tile_max = w[j];
  }
  return tile_max;
}

// w = 2^(w - shift) over the row's `cols` keys, 0 up to the next multiple of N; their sum.
HWY_INLINE float DecodeWeights(float* w, std::int64_t cols, float shift) {
  const D d;
  const std::int64_t n = Lanes();
  const V base = hn::Set(d, shift);
  V sum = hn::Zero(d);
  for (std::int64_t j0 = 0; j0 < cols; j0 += n) {
    const V e = Exp2NonPositive(hn::Sub(hn::LoadU(d, w + j0), base));
    const V x = hn::IfThenElseZero(hn::FirstN(d, static_cast<std::size_t>(cols - j0)), e);
    hn::StoreU(x, d, w + j0);
    sum = hn::Add(sum, x);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// ---- The policy of mha/tiled_loops.h, and this target's entry points ----------------------

struct Ops {
  static constexpr int kRows = HWY_NAMESPACE::kRows;
  static constexpr bool kWholeGroups = true;  // MHA_HWY_ROWS: a group computes all MR rows
  static constexpr bool kKvDecode = false;    // reduced K, V: the loops widen each tile
  static constexpr int kDecodeGroup = 1;      // one decode row at a time
  static constexpr std::int64_t kDotKeys = HWY_NAMESPACE::kDotKeys;
  static std::int64_t lanes() { return Lanes(); }
  static std::int64_t panel() { return Panel(); }
  static std::int64_t decode_step() { return DecodeStep(); }

  static void pack_k(const float* k, std::int64_t k_seq, std::int64_t keys, std::int64_t dim,
                     float* kp) {
    PackK(k, k_seq, keys, dim, kp);
  }
  static void pack_v(const float* v, std::int64_t v_seq, std::int64_t keys, std::int64_t dim,
                     float* vp) {
    PackV(v, v_seq, keys, dim, vp);
  }
  static void pack_q(const float* const* q, int nr, std::int64_t dim, float* qp) {
    PackQ(q, nr, dim, qp);
  }
  template <int MR>
  static void logits_tile(const float* qp, const float* kp, std::int64_t dim, float c,
                          const std::int64_t* limit, float* s, float* rowmax) {
    static_assert(MR == kRows, "whole groups only");
    LogitsTile(qp, kp, dim, c, limit, s, rowmax);
  }
  // A group's P V (MR = kRows), or one row's keys past its group's (MR = 1, no rescale).
  template <int MR>
  static void pv_tile(const float* p, std::int64_t keys, const float* vp, const float* alpha,
                      float* o, std::int64_t ld_o) {
    static_assert(MR == kRows || MR == 1, "whole groups or one row");
    if constexpr (MR == 1) {
      PvRow(p, keys, vp, o);
    } else {
      PvTile(p, keys, vp, alpha, o, ld_o);
    }
  }
  static void online_softmax(float* s, std::int64_t cols, const float* rowmax, float* m, float* l,
                             float* alpha) {
    OnlineSoftmax(s, cols, rowmax, m, l, alpha);
  }
  static void finish_row(const float* acc, float m, float l, float sink, std::int64_t visible,
                         std::int64_t dim, float* o, float* lse) {
    FinishRow(acc, m, l, sink, visible, dim, o, lse);
  }

  template <class Step>
  static HWY_INLINE float decode_logits(const float* q, const float* k, std::int64_t k_seq,
                                        std::int64_t cols, std::int64_t dim, float c, float* w,
                                        const Step& after_step) {
    return DecodeLogits(q, k, k_seq, cols, dim, c, w, after_step);
  }
  static HWY_INLINE float decode_weights(float* w, std::int64_t cols, float shift) {
    return DecodeWeights(w, cols, shift);
  }
  static HWY_INLINE void decode_pv(const float* w, std::int64_t cols, const float* v,
                                   std::int64_t v_seq, std::int64_t dim, float* acc, float alpha) {
    AddWeightedRows(w, cols, v, v_seq, dim, acc, alpha);
  }
};

inline std::size_t Workspace(const mha::Problem& p) { return tiled::Loops<Ops>::workspace(p); }

inline void Run(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                float* lse, mha::Workspace ws) {
  tiled::Loops<Ops>::run(p, q, k, v, o, lse, ws);
}

#undef MHA_HWY_ROWS

}  // namespace HWY_NAMESPACE
}  // namespace mha::highway_kernel
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard

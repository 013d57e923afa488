// The oracle for the whole layer (mha/layer.h): projections, attention and W^O in double,
// straight loops, sharing no code with the fast layer; and the bound a correct fp32 layer
// stays within, derived from the GEMM bound (mha/gemm.h) composed with the attention bound
// (tolerance.h).
//
// Notation, per sequence: exact (double) Q = X W^Q + b^Q, K, V likewise, O = Attention(Q, K,
// V), Y = O W^O + b^O; gamma(n) as in tolerance.h. The fp32 layer computes:
//
// 1. Projections. Each element of Q^ = fl(X W^Q + b^Q) is one GEMM element over d products,
//    so |Q^ - Q| <= eQ = gamma(d + 1) (|X| |W^Q| + |b^Q|), elementwise; eK, eV likewise.
// 2. Attention's inputs moved. A logit of row i, key t moves by at most
//      sigma_t = scale sum_e (eQ_e |K_te| + |Q_e| eK_te + eQ_e eK_te),
//    so with sigma = max over the visible keys, every softmax weight moves by a factor within
//    [exp(-2 sigma), exp(2 sigma)] and sum_t |p^_t - p_t| <= min(2, exp(2 sigma) - 1). The
//    exact attention of (Q^, K^, V^) is then within min(2, exp(2 sigma) - 1) Vmax + EVmax of
//    O, Vmax = max |V| and EVmax = max eV over the visible keys and all columns.
// 3. The attention kernel on (Q^, K^, V^) stays within tolerance.h's tol_o of their exact
//    attention, evaluated with the magnitudes the kernel saw, bounded by |Q| + eQ, |K| + eK
//    and |V| + eV (o_bound with A' = scale max_t sum_e (|Q_e| + eQ_e)(|K_te| + eK_te) and
//    V' = max(|V| + eV)).
//    eO (per row and head, every column) = tol_o' + min(2, exp(2 sigma) - 1) Vmax + EVmax.
// 4. Output. Y^ = fl(O^ W^O + b^O) with |O^ - O| <= eO:
//      |Y^ - Y| <= gamma(H D + 1) (sum_r (|O_r| + eO_r) |W^O_rc| + |b^O_c|) + sum_r eO_r |W^O_rc|.
//
// Every step is a worst case, so a correct layer never exceeds the bound.
//
// Keys taken as given (PastKv, StoredKv): a K or V row the layer read from a cache rather
// than projected is exact here, eK = eV = 0 for it, so its key adds nothing to sigma or EVmax.
// A cache of a reduced KvType (mha::KvCache) stores the projections rounded (f16, bf16) or
// quantised (i8); the reference takes those stored values (StoredKv), not the projections,
// so the rounding of the storage is not in the bound (the tests check the stored rows
// against the conversion of the fp32 projections, exactly), and what the kernel adds is
// step 3 at the stored magnitudes: for f16 and bf16, which widen exactly, the fp32 bound;
// for i8, tolerance.h's step 6 (q s rounded once in fp32: one more rounding per product
// and u V more), o_bound's kv_type.
#pragma once

#include <mha/layer.h>

#include <cstdint>
#include <vector>

namespace mha::ref {

/// Outputs of the layer for query positions [first, len) of every sequence, dense
/// [batch][len - first][d], and the bound on each.
struct LayerResult {
  std::int64_t rows = 0, d_model = 0;  ///< rows per sequence (len - first)
  std::vector<double> y, tol;
  std::size_t at(std::int64_t b, std::int64_t i, std::int64_t c) const {
    return static_cast<std::size_t>((b * rows + i) * d_model + c);
  }
};

/// The layer over sequences x [batch][len][d] (row-major): the queries at positions
/// [first, len) attend over the keys at positions 0 .. len - 1 (causal: up to their own
/// position), as a layer that prefilled positions [0, first) before gives. exp_ulp is the
/// attention kernel's (registry.inc). Weights as mha::LayerWeights says (transposed too).
LayerResult layer(const LayerConfig& c, const LayerWeights& w, const float* x, std::int64_t batch,
                  std::int64_t len, std::int64_t first, bool causal, double exp_ulp);

/// K and V of `length` tokens already in a cache, taken as exact (eK = eV = 0):
/// k[b * strides.batch + t * strides.seq + j * strides.head + e], likewise v.
struct PastKv {
  const float* k = nullptr;
  const float* v = nullptr;
  Strides strides;
  std::int64_t length = 0;
};

/// The same after `past`: x [batch][len][d] are new tokens at positions past.length + 0 ..
/// past.length + len - 1, whose keys follow the past ones; rows are counted in x.
LayerResult layer(const LayerConfig& c, const LayerWeights& w, const float* x, std::int64_t batch,
                  std::int64_t len, std::int64_t first, bool causal, double exp_ulp,
                  const PastKv& past);

/// K and V of every key as a cache stores them after the layer's call: `length` positions of
/// KvType `type`, row (b, t, j) at element b * strides.batch + t * strides.seq + j *
/// strides.head of k.data (likewise v), for i8 with its scale at the same position under
/// scale_strides in k.scale; taken as exact (the stored number times the scale, in double).
/// mha::KvCache gives them as kv_type(), k_view(), v_view(), strides(), scale_strides(),
/// length().
struct StoredKv {
  KvType type = KvType::f32;
  KvView k, v;
  Strides strides, scale_strides;
  std::int64_t length = 0;
};

/// The same with every key and value read from `stored`: x [batch][len][d] are the tokens at
/// its last len positions (stored.length - len ..), of which only the queries are projected;
/// rows are counted in x. Throws std::invalid_argument when len > stored.length.
LayerResult layer(const LayerConfig& c, const LayerWeights& w, const float* x, std::int64_t batch,
                  std::int64_t len, std::int64_t first, bool causal, double exp_ulp,
                  const StoredKv& stored);

}  // namespace mha::ref

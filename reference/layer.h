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

}  // namespace mha::ref

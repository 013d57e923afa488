// mha/layer.h: the whole multi-head attention layer, with a KV cache.
//
// With model width d, H query heads and Hkv KV heads of width D (usually D = d / H):
//
//   Q = X W^Q + b^Q  (d x H D)      K = X W^K + b^K,  V = X W^V + b^V  (d x Hkv D)
//   head_i = Attention(Q_i, K_{i/g}, V_{i/g})      (g = H / Hkv: MHA, GQA, MQA alike)
//   Y = Concat(head_1 .. head_H) W^O + b^O         (H D x d)
//
// Tokens are rows: X and Y are [batch][n][d]. The attention step writes its output
// token-major, [n][H][D], which is already the n x H D matrix Concat(...): concatenation
// costs nothing, and W^O is the one place where heads are mixed.
//
// * The four weights are packed once, at construction, for one GEMM kernel of the registry
//   (mha/registry.h: best_gemm() unless named); the projections and W^O run on it through
//   the GEMM driver, and the attention step on a registry attention kernel (best_kernel()
//   unless named) through the attention driver (mha/parallel.h). Both drivers cut work by
//   the problem only, so a layer's output is bit-identical for every thread count.
// * K and V of new tokens are projected straight into the cache (one GEMM job per KV head,
//   whose output rows are the cache's rows), then the new queries attend over every cached
//   key. prefill(n tokens) and n decode() steps project every token identically, bit for
//   bit (mha/gemm.h), and attend within the attention tolerance of each other.
// * Causal masking counts positions in the sequence: the query at position p sees cache
//   positions 0..p, i.e. bottom-right alignment (mha/attention.h) of the n new queries over
//   the cache's length + n keys. Without causal masking every new query sees every cached key.
// * A Layer is immutable after construction: calls on one Layer from several threads are
//   safe as long as each uses its own KvCache. Scratch memory is per calling thread and only
//   grows, as for mha::attention; when it cannot, the call throws AllocationError before
//   writing anything.
#pragma once

#include <mha/registry.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mha {

/// The shape of one layer.
struct LayerConfig {
  std::int64_t d_model = 0;   ///< d: the width of a token
  std::int64_t q_heads = 0;   ///< H
  std::int64_t kv_heads = 0;  ///< Hkv, a divisor of H
  std::int64_t head_dim = 0;  ///< D, usually d / H
};

/// Why c is not a valid layer shape, or an empty string: positive sizes, kv_heads dividing
/// q_heads, and sizes whose products (H D, d H D) fit int64.
std::string check(const LayerConfig& c);

/// The weights as the math writes them, row-major [in][out]: wq [d][H D], wk and wv
/// [d][Hkv D], wo [H D][d]; with `transposed`, each is PyTorch's Linear weight [out][in]
/// instead. Biases are optional (nullptr: none): bq [H D], bk and bv [Hkv D], bo [d].
/// Query head h owns columns [h D, h D + D) of W^Q, KV head j columns [j D, j D + D) of W^K
/// and W^V, and rows [h D, h D + D) of W^O read head h's output.
struct LayerWeights {
  const float* wq = nullptr;
  const float* wk = nullptr;
  const float* wv = nullptr;
  const float* wo = nullptr;
  const float* bq = nullptr;
  const float* bk = nullptr;
  const float* bv = nullptr;
  const float* bo = nullptr;
  bool transposed = false;
};

/// The KV cache of one layer for `batch` sequences: K and V of up to `capacity` tokens per
/// sequence, head-major, k[b][j][t][D] for KV head j and position t (likewise v), so that
/// appending a token writes one D-float row per head and one head's keys are contiguous.
/// The length is the same for every sequence of the batch.
class KvCache {
 public:
  /// Throws std::invalid_argument when the shape is invalid, batch or capacity is not
  /// positive, or the size overflows; AllocationError (mha/attention.h) when K and V cannot
  /// be allocated.
  KvCache(const LayerConfig& config, std::int64_t batch, std::int64_t capacity);

  /// Bytes of K and V for this shape: 2 batch Hkv capacity D 4. MHA, GQA and MQA of the
  /// same d and H differ here by the factor H / Hkv.
  static std::size_t bytes(const LayerConfig& config, std::int64_t batch, std::int64_t capacity);
  std::size_t bytes() const { return bytes(config_, batch_, capacity_); }

  std::int64_t batch() const { return batch_; }
  std::int64_t capacity() const { return capacity_; }
  std::int64_t length() const { return length_; }  ///< tokens cached per sequence
  std::int64_t kv_heads() const { return config_.kv_heads; }
  std::int64_t head_dim() const { return config_.head_dim; }
  const LayerConfig& config() const { return config_; }

  /// Forgets every token (length 0); the memory stays.
  void reset() { length_ = 0; }
  /// Keeps the first `length` tokens, forgetting the rest (a rejected draft, a rewound
  /// conversation). Throws std::invalid_argument unless 0 <= length <= length().
  void truncate(std::int64_t length);

  /// Appends n tokens' K and V given head-major and dense, k[b][j][t][D] for t < n (likewise
  /// v): a cache restored from elsewhere. Throws std::invalid_argument, writing nothing,
  /// when n is not positive, a pointer is null or fewer than n positions are free.
  void append(const float* k, const float* v, std::int64_t n);

  /// K and V, [batch][kv_heads][capacity][head_dim]; positions >= length() are unspecified.
  const float* k() const { return k_.data(); }
  const float* v() const { return v_.data(); }
  /// Their strides as an attention problem's {batch, seq, head}.
  Strides strides() const;

 private:
  friend class Layer;
  LayerConfig config_;
  std::int64_t batch_ = 0, capacity_ = 0, length_ = 0;
  std::vector<float> k_, v_;
};

class Layer {
 public:
  /// Packs the weights for the GEMM kernel `gemm` and runs attention with the kernel
  /// `attention` (registry names; empty: best_gemm(), best_kernel()). Throws
  /// std::invalid_argument for an invalid shape, a null weight, or an unknown or
  /// unavailable kernel; AllocationError, naming the weight, when its packed copy cannot be
  /// allocated.
  Layer(const LayerConfig& config, const LayerWeights& weights, const std::string& gemm = "",
        const std::string& attention = "");

  const LayerConfig& config() const { return config_; }
  const GemmInfo& gemm_kernel() const { return *gemm_; }
  const KernelInfo& attention_kernel() const { return *attention_; }

  /// Y [batch][n][d] for the n new tokens X [batch][n][d] of every sequence of the cache:
  /// their K and V are appended to the cache, then their queries attend over every cached
  /// token (causal: each sees the positions up to its own). Throws std::invalid_argument,
  /// before writing anything, when the cache has another shape, holds fewer than n free
  /// positions, n is not positive, a pointer is null, or y overlaps x; and AllocationError,
  /// also before writing anything (y, the cache's rows and length untouched), when its
  /// scratch cannot grow.
  void prefill(const float* x, std::int64_t n, float* y, KvCache& cache, bool causal = true,
               int threads = 0) const;

  /// One token per sequence: x, y [batch][d]; prefill with n = 1.
  void decode(const float* x, float* y, KvCache& cache, int threads = 0) const;

  /// The layer without a cache: Y = MultiHead(X) for X [batch][n][d], keys and values from
  /// the same n tokens (a cache of capacity n, used once).
  void forward(const float* x, std::int64_t batch, std::int64_t n, float* y, bool causal,
               int threads = 0) const;

 private:
  LayerConfig config_;
  const GemmInfo* gemm_ = nullptr;
  const KernelInfo* attention_ = nullptr;
  PackedMatrix wq_, wo_;
  std::vector<PackedMatrix> wk_, wv_;     ///< one per KV head: their output rows are cache rows
  std::vector<float> bq_, bk_, bv_, bo_;  ///< empty: no bias
};

}  // namespace mha

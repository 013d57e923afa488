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
// * K and V of new tokens are projected straight into an fp32 cache (one GEMM job per KV
//   head, whose output rows are the cache's rows); for a cache of a reduced KvType into an
//   fp32 scratch, then converted into the cache's rows as KvCache::append converts. Then the
//   new queries attend over every cached key, read in the cache's type. prefill(n tokens) and
//   n decode() steps project (and convert) every token identically, bit for bit
//   (mha/gemm.h), and attend within the attention tolerance of each other.
// * The attention kernel is chosen per KvType: a named kernel serves the types it reads (a
//   cache of another type is rejected), otherwise best_kernel(type) of each type.
// * Causal masking counts positions in the sequence: the query at position p sees cache
//   positions 0..p, i.e. bottom-right alignment (mha/attention.h) of the n new queries over
//   the cache's length + n keys. Without causal masking every new query sees every cached key.
// * A Layer is immutable after construction: calls on one Layer from several threads are
//   safe as long as each uses its own KvCache. Scratch memory is per calling thread and only
//   grows, as for mha::attention; when it cannot, the call throws AllocationError before
//   writing anything.
#pragma once

#include <mha/registry.h>

#include <array>
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
/// appending a token writes one D-element row per head and one head's keys are contiguous.
/// The length is the same for every sequence of the batch.
///
/// The elements are of kv_type() (mha/kv_types.h): f32 (the default), f16 or bf16, or i8 with
/// one fp32 scale per row, k_scale[b][j][t] (likewise v). A reduced type holds the fp32 rows it
/// is given converted: f16 and bf16 rounded to nearest, ties to even; i8 quantised per row
/// (kv::quantize_i8_row: scale max|x| / 127). Attention reads the stored values in place
/// (Problem::kv_type, KvView): an attention problem over the cache takes
///   p.kv_type = kv_type(); p.k = p.v = strides(); p.k_scale = p.v_scale = scale_strides();
/// and the views k_view(), v_view().
class KvCache {
 public:
  /// Throws std::invalid_argument when the shape is invalid, batch or capacity is not
  /// positive, kv_type is not a KvType, or the size overflows; AllocationError
  /// (mha/attention.h) when K and V (and i8's scales) cannot be allocated.
  KvCache(const LayerConfig& config, std::int64_t batch, std::int64_t capacity,
          KvType kv_type = KvType::f32);

  /// Bytes of K and V (and for i8 their scales) for this shape: 2 batch Hkv capacity (D e + s),
  /// e = kv_type_bytes(kv_type) (4, 2, 2, 1) and s = 4 for i8's scale, 0 otherwise. MHA, GQA
  /// and MQA of the same d and H differ here by the factor H / Hkv. Throws
  /// std::invalid_argument when kv_type is not a KvType.
  static std::size_t bytes(const LayerConfig& config, std::int64_t batch, std::int64_t capacity,
                           KvType kv_type = KvType::f32);
  std::size_t bytes() const { return bytes(config_, batch_, capacity_, kv_type_); }

  std::int64_t batch() const { return batch_; }
  std::int64_t capacity() const { return capacity_; }
  std::int64_t length() const { return length_; }  ///< tokens cached per sequence
  std::int64_t kv_heads() const { return config_.kv_heads; }
  std::int64_t head_dim() const { return config_.head_dim; }
  const LayerConfig& config() const { return config_; }
  KvType kv_type() const { return kv_type_; }

  /// Forgets every token (length 0); the memory stays.
  void reset() { length_ = 0; }
  /// Keeps the first `length` tokens, forgetting the rest (a rejected draft, a rewound
  /// conversation). Throws std::invalid_argument unless 0 <= length <= length().
  void truncate(std::int64_t length);

  /// Appends n tokens' K and V given in fp32, head-major and dense, k[b][j][t][D] for t < n
  /// (likewise v): a cache restored from elsewhere. Each row is converted to kv_type() as the
  /// class comment says. Throws std::invalid_argument, writing nothing, when n is not
  /// positive, a pointer is null or fewer than n positions are free.
  void append(const float* k, const float* v, std::int64_t n);

  /// K and V as attention reads them: the elements, [batch][kv_heads][capacity][head_dim] of
  /// kv_type(), and for i8 the scales, [batch][kv_heads][capacity] (null for other types).
  /// Positions >= length() are unspecified.
  KvView k_view() const { return {k_.data(), k_scale_.empty() ? nullptr : k_scale_.data()}; }
  KvView v_view() const { return {v_.data(), v_scale_.empty() ? nullptr : v_scale_.data()}; }
  /// The elements' strides as an attention problem's {batch, seq, head}, in elements of
  /// kv_type(); the same for any type.
  Strides strides() const;
  /// The i8 scales' strides as Problem::k_scale and v_scale take them: {kv_heads capacity, 1,
  /// capacity} (given for every type; only i8 has scales).
  Strides scale_strides() const;
  /// K and V as fp32 elements, for an fp32 cache only: throws std::logic_error for any other
  /// kv_type(), whose elements are not floats (read those through k_view() and v_view()).
  const float* k() const;
  const float* v() const;

 private:
  friend class Layer;
  // Converts and stores n tokens' K and V rows, given as append takes them, at positions
  // [length, length + n), and advances the length. Unchecked: append and Layer validate.
  void store(const float* k, const float* v, std::int64_t n);
  const float* f32(const std::vector<unsigned char>& x, const char* where) const;

  LayerConfig config_;
  std::int64_t batch_ = 0, capacity_ = 0, length_ = 0;
  KvType kv_type_ = KvType::f32;
  std::vector<unsigned char> k_, v_;      ///< elements of kv_type_
  std::vector<float> k_scale_, v_scale_;  ///< i8 only: one per row
};

class Layer {
 public:
  /// Packs the weights for the GEMM kernel `gemm` and runs attention with the kernel
  /// `attention` (registry names; empty: best_gemm(), and best_kernel(t) for a cache of
  /// KvType t). Throws std::invalid_argument for an invalid shape, a null weight, or an
  /// unknown or unavailable kernel; AllocationError, naming the weight, when its packed copy
  /// cannot be allocated. A named attention kernel that does not read some KvType is
  /// accepted: a cache of that type is rejected when a call meets it.
  Layer(const LayerConfig& config, const LayerWeights& weights, const std::string& gemm = "",
        const std::string& attention = "");
  /// The same with an attention kernel given by its entry, which need not be in the registry
  /// (a copied or modified kernel; mha::attention takes one too). The layer keeps a pointer
  /// to it: it must outlive the layer. Throws std::invalid_argument when its name, fn or
  /// workspace is null.
  Layer(const LayerConfig& config, const LayerWeights& weights, const std::string& gemm,
        const KernelInfo& attention);

  const LayerConfig& config() const { return config_; }
  const GemmInfo& gemm_kernel() const { return *gemm_; }
  /// The attention kernel a call over a cache of type t runs. Throws std::invalid_argument
  /// when t is not a KvType, or the named kernel does not read t.
  const KernelInfo& attention_kernel(KvType t = KvType::f32) const;

  /// Y [batch][n][d] for the n new tokens X [batch][n][d] of every sequence of the cache:
  /// their K and V are appended to the cache (in its kv_type), then their queries attend over
  /// every cached token (causal: each sees the positions up to its own). Throws
  /// std::invalid_argument, before writing anything, when the cache has another shape, holds
  /// fewer than n free positions, n is not positive, a pointer is null, y overlaps x, or the
  /// named attention kernel does not read the cache's kv_type; and AllocationError,
  /// also before writing anything (y, the cache's rows and length untouched), when its
  /// scratch cannot grow.
  void prefill(const float* x, std::int64_t n, float* y, KvCache& cache, bool causal = true,
               int threads = 0) const;

  /// One token per sequence: x, y [batch][d]; prefill with n = 1.
  void decode(const float* x, float* y, KvCache& cache, int threads = 0) const;

  /// The layer without a cache: Y = MultiHead(X) for X [batch][n][d], keys and values from
  /// the same n tokens (an fp32 cache of capacity n, used once).
  void forward(const float* x, std::int64_t batch, std::int64_t n, float* y, bool causal,
               int threads = 0) const;

 private:
  // The public constructors': the attention kernel is `kernel` when not null, else the
  // registry's called `name` when not empty, else the best for each KvType.
  Layer(const LayerConfig& config, const LayerWeights& weights, const std::string& gemm,
        const std::string& name, const KernelInfo* kernel);
  // attention_kernel(t), its errors said as `where`.
  const KernelInfo& kernel_for(KvType t, const char* where) const;

  LayerConfig config_;
  const GemmInfo* gemm_ = nullptr;
  const KernelInfo* named_ = nullptr;  ///< the attention kernel asked for by name, if any
  /// The attention kernel for each KvType (indexed by its value); null where named_ does not
  /// read the type.
  std::array<const KernelInfo*, static_cast<std::size_t>(KvType::i8) + 1> attention_{};
  PackedMatrix wq_, wo_;
  std::vector<PackedMatrix> wk_, wv_;     ///< one per KV head: their output rows are cache rows
  std::vector<float> bq_, bk_, bv_, bo_;  ///< empty: no bias
};

}  // namespace mha

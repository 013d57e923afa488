// The multi-head attention layer (mha/layer.h): projections and W^O on a registry GEMM
// kernel through the GEMM driver, attention on a registry kernel through the attention
// driver, K and V projected straight into an fp32 cache.
//
//   prefill(X [B][n][d]):
//     pack X, per sequence (its rows start a panel)              parallel_pack_a
//     one batch of GEMM jobs, per sequence b:                     parallel_gemm
//       Q_b = X_b W^Q + b^Q          -> q [B n][H D]
//       K_b,j = X_b W^K_j + b^K_j    -> cache.k[b][j][len .. len + n)   for each KV head j
//       V_b,j likewise               -> cache.v
//       (a cache of f16, bf16 or i8: into an fp32 scratch [2][B][Hkv][n][D] instead, then
//        converted into those rows, i8's scales beside them     KvCache::store)
//     O = Attention(Q, cache K, cache V), bottom-right causal    parallel_attention
//        (q and o token-major [B][n][H][D], K and V head-major [B][Hkv][capacity][D] of the
//        cache's kv_type, i8 scales [B][Hkv][capacity])
//     pack O (= Concat(heads), [B n][H D])                        parallel_pack_a
//     Y = O W^O + b^O                                             parallel_gemm
//
// W^K and W^V are packed per KV head (D columns each) so that every job's output rows are
// rows of the cache whatever D and the kernel's panel width: a job's C is the head's cache
// rows from position len on, ldc = D.
#include "mha/layer.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mha/kv_types.h"
#include "mha/parallel.h"

namespace mha {

namespace {

using detail::sat_mul;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

[[noreturn]] void fail(const std::string& where, const std::string& why) {
  throw std::invalid_argument(where + ": " + why);
}

bool same_shape(const LayerConfig& a, const LayerConfig& b) {
  return a.d_model == b.d_model && a.q_heads == b.q_heads && a.kv_heads == b.kv_heads &&
         a.head_dim == b.head_dim;
}

std::string shape(const LayerConfig& c) {
  return "d " + std::to_string(c.d_model) + ", H " + std::to_string(c.q_heads) + ", Hkv " +
         std::to_string(c.kv_heads) + ", D " + std::to_string(c.head_dim);
}

// Columns [j0, j0 + cols) of a weight with `in` rows and `out` columns, packed for `gemm`.
PackedMatrix pack_columns(const GemmInfo& gemm, const float* w, bool transposed, std::int64_t in,
                          std::int64_t out, std::int64_t j0, std::int64_t cols) {
  if (transposed) return PackedMatrix(gemm, in, cols, w + j0 * in, 1, in);
  return PackedMatrix(gemm, in, cols, w + j0, out, 1);
}

std::vector<float> copy_bias(const float* b, std::int64_t n) {
  return b != nullptr ? std::vector<float>(b, b + n) : std::vector<float>();
}

const float* bias_at(const std::vector<float>& b, std::int64_t offset) {
  return b.empty() ? nullptr : b.data() + offset;
}

// Grows v to at least n elements, freeing the old buffer first (the peak is the new size);
// AllocationError(where, what) when that memory cannot be had, v then empty.
template <typename T>
T* grow(std::vector<T>& v, std::size_t n, const char* where, const char* what) {
  if (v.size() < n) {
    v.clear();
    v.shrink_to_fit();
    const std::size_t max = std::numeric_limits<std::size_t>::max();
    detail::allocate_or_throw(where, what, n > max / sizeof(T) ? max : n * sizeof(T),
                              [&] { v.resize(n); });
  }
  return v.data();
}

// A count of elements that fits int64 as a size_t (a saturated one stays too large to allocate).
std::size_t count(std::int64_t n) { return static_cast<std::size_t>(std::max<std::int64_t>(n, 0)); }

// kv_type_bytes(t), or std::invalid_argument from `where` when t is not a KvType.
std::size_t element_bytes(const char* where, KvType t) {
  const std::size_t size = kv_type_bytes(t);
  if (size == 0)
    fail(where, "kv_type (" + std::to_string(static_cast<int>(t)) + ") is not a KvType");
  return size;
}

// The calling thread's scratch, grown to the largest call so far.
struct Scratch {
  std::vector<float> packed_x, q, o, packed_o;
  std::vector<float> kv;  ///< the new tokens' K and V for a cache of a reduced type
  std::vector<unsigned char> attention;
  std::vector<GemmJob> jobs;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

std::string check(const LayerConfig& c) {
  const struct {
    const char* name;
    std::int64_t value;
  } sizes[] = {{"d_model", c.d_model},
               {"q_heads", c.q_heads},
               {"kv_heads", c.kv_heads},
               {"head_dim", c.head_dim}};
  for (const auto& s : sizes) {
    if (s.value < 1)
      return std::string(s.name) + " must be positive, got " + std::to_string(s.value);
  }
  if (c.q_heads % c.kv_heads != 0) {
    return "q_heads (" + std::to_string(c.q_heads) + ") must be a multiple of kv_heads (" +
           std::to_string(c.kv_heads) + ")";
  }
  // The largest weight holds d H D floats, each packed with at most 64 columns of padding.
  if (sat_mul(sat_mul(c.d_model, c.q_heads), c.head_dim + 64) == kMax) {
    return "the weights' sizes (" + shape(c) + ") overflow int64";
  }
  return {};
}

KvCache::KvCache(const LayerConfig& config, std::int64_t batch, std::int64_t capacity,
                 KvType kv_type)
    : config_(config), batch_(batch), capacity_(capacity), kv_type_(kv_type) {
  if (const std::string why = check(config); !why.empty()) fail("KvCache", why);
  if (batch < 1 || capacity < 1) {
    fail("KvCache", "batch and capacity must be positive, got batch " + std::to_string(batch) +
                        ", capacity " + std::to_string(capacity));
  }
  const std::size_t size = element_bytes("KvCache", kv_type);
  const std::int64_t rows = sat_mul(sat_mul(batch, config.kv_heads), capacity);
  const std::int64_t elements = sat_mul(rows, config.head_dim);
  // K's and V's elements as bytes, and a cache of floats (the largest) too, must fit.
  if (elements == kMax || static_cast<std::uint64_t>(elements) > k_.max_size() / 8) {
    fail("KvCache", "the cache's size overflows");
  }
  const bool scaled = kv_type == KvType::i8;
  detail::allocate_or_throw("KvCache", "the cache's K and V",
                            bytes(config, batch, capacity, kv_type), [&] {
                              k_.resize(static_cast<std::size_t>(elements) * size);
                              v_.resize(static_cast<std::size_t>(elements) * size);
                              if (scaled) {
                                k_scale_.resize(static_cast<std::size_t>(rows));
                                v_scale_.resize(static_cast<std::size_t>(rows));
                              }
                            });
}

std::size_t KvCache::bytes(const LayerConfig& config, std::int64_t batch, std::int64_t capacity,
                           KvType kv_type) {
  const std::size_t size = element_bytes("KvCache::bytes", kv_type);
  const std::size_t scale = kv_type == KvType::i8 ? sizeof(float) : 0;
  return 2 * static_cast<std::size_t>(batch) * static_cast<std::size_t>(config.kv_heads) *
         static_cast<std::size_t>(capacity) *
         (static_cast<std::size_t>(config.head_dim) * size + scale);
}

void KvCache::append(const float* k, const float* v, std::int64_t n) {
  if (n < 1) fail("KvCache::append", "n must be positive, got " + std::to_string(n));
  if (k == nullptr || v == nullptr) fail("KvCache::append", "k and v must not be null");
  if (n > capacity_ - length_) {
    fail("KvCache::append", "the KV cache is full: " + std::to_string(length_) + " of " +
                                std::to_string(capacity_) + " positions used, " +
                                std::to_string(n) + " more requested");
  }
  store(k, v, n);
}

void KvCache::store(const float* k, const float* v, std::int64_t n) {
  const std::int64_t D = config_.head_dim;
  const std::size_t size = kv_type_bytes(kv_type_);
  for (std::int64_t b = 0; b < batch_; ++b) {
    for (std::int64_t j = 0; j < config_.kv_heads; ++j) {
      const std::int64_t from = (b * config_.kv_heads + j) * n * D;
      // Row (b, j, t) of the cache is row (b Hkv + j) capacity + t: elements D apart, scales 1.
      const auto row = static_cast<std::size_t>((b * config_.kv_heads + j) * capacity_ + length_);
      const auto at = row * static_cast<std::size_t>(D) * size;
      float* k_scale = k_scale_.empty() ? nullptr : k_scale_.data() + row;
      float* v_scale = v_scale_.empty() ? nullptr : v_scale_.data() + row;
      kv::narrow_rows(kv_type_, k + from, n, D, k_.data() + at, k_scale);
      kv::narrow_rows(kv_type_, v + from, n, D, v_.data() + at, v_scale);
    }
  }
  length_ += n;
}

void KvCache::truncate(std::int64_t length) {
  if (length < 0 || length > length_) {
    fail("KvCache::truncate",
         "length must be in [0, " + std::to_string(length_) + "], got " + std::to_string(length));
  }
  length_ = length;
}

Strides KvCache::strides() const {
  return {config_.kv_heads * capacity_ * config_.head_dim, config_.head_dim,
          capacity_ * config_.head_dim};
}

Strides KvCache::scale_strides() const { return {config_.kv_heads * capacity_, 1, capacity_}; }

const float* KvCache::f32(const std::vector<unsigned char>& x, const char* where) const {
  if (kv_type_ != KvType::f32) {
    throw std::logic_error(std::string(where) + ": the cache holds kv_type " +
                           kv_type_name(kv_type_) +
                           ", not f32 floats: read it through k_view() and v_view()");
  }
  return reinterpret_cast<const float*>(x.data());
}

const float* KvCache::k() const { return f32(k_, "KvCache::k"); }
const float* KvCache::v() const { return f32(v_, "KvCache::v"); }

Layer::Layer(const LayerConfig& config, const LayerWeights& w, const std::string& gemm,
             const std::string& attention)
    : Layer(config, w, gemm, attention, nullptr) {}

Layer::Layer(const LayerConfig& config, const LayerWeights& w, const std::string& gemm,
             const KernelInfo& attention)
    : Layer(config, w, gemm, "", &attention) {}

Layer::Layer(const LayerConfig& config, const LayerWeights& w, const std::string& gemm,
             const std::string& attention, const KernelInfo* kernel)
    : config_(config) {
  if (const std::string why = check(config); !why.empty()) fail("Layer", why);
  if (w.wq == nullptr || w.wk == nullptr || w.wv == nullptr || w.wo == nullptr) {
    fail("Layer", "wq, wk, wv and wo must not be null");
  }
  gemm_ = gemm.empty() ? &best_gemm() : find_gemm(gemm);
  if (gemm_ == nullptr) fail("Layer", "unknown gemm kernel '" + gemm + "'");
  if (kernel != nullptr) {
    if (!callable(*kernel)) {
      fail("Layer", "the attention kernel's KernelInfo needs a name, fn and workspace");
    }
    named_ = kernel;
  } else if (!attention.empty()) {
    named_ = find_kernel(attention);
    if (named_ == nullptr) fail("Layer", "unknown attention kernel '" + attention + "'");
  }
  if (named_ != nullptr) {
    if (!available(*named_)) {
      fail("Layer", "attention kernel '" + std::string(named_->name) + "' needs " +
                        isa_name(named_->isa) + ", which this CPU lacks or MHA_MAX_ISA excludes");
    }
  }
  // One kernel per KvType, chosen once: a call only indexes this table.
  for (std::size_t i = 0; i < attention_.size(); ++i) {
    const auto t = static_cast<KvType>(i);
    if (named_ == nullptr) {
      attention_[i] = &best_kernel(t);
    } else if (reads(*named_, t)) {
      attention_[i] = named_;
    }
  }
  const std::int64_t d = config.d_model, D = config.head_dim;
  const std::int64_t hd = config.q_heads * D, kvd = config.kv_heads * D;
  // PackedMatrix checks the GEMM kernel's availability, and says when its memory cannot be
  // had; the layer says which weight that was.
  const auto pack = [&](const char* name, const float* weight, std::int64_t in, std::int64_t out,
                        std::int64_t j0, std::int64_t cols) {
    try {
      return pack_columns(*gemm_, weight, w.transposed, in, out, j0, cols);
    } catch (const AllocationError& e) {
      throw AllocationError("Layer", std::string("the packed ") + name, e.bytes());
    }
  };
  const auto kv_heads = static_cast<std::size_t>(config.kv_heads);
  detail::allocate_or_throw("Layer", "the list of packed W^K and W^V",
                            2 * kv_heads * sizeof(PackedMatrix), [&] {
                              wk_.reserve(kv_heads);
                              wv_.reserve(kv_heads);
                            });
  wq_ = pack("W^Q", w.wq, d, hd, 0, hd);
  for (std::int64_t j = 0; j < config.kv_heads; ++j) {
    wk_.push_back(pack("W^K", w.wk, d, kvd, j * D, D));
    wv_.push_back(pack("W^V", w.wv, d, kvd, j * D, D));
  }
  wo_ = pack("W^O", w.wo, hd, d, 0, d);
  detail::allocate_or_throw("Layer", "the biases", 2 * (hd + kvd) * sizeof(float), [&] {
    bq_ = copy_bias(w.bq, hd);
    bk_ = copy_bias(w.bk, kvd);
    bv_ = copy_bias(w.bv, kvd);
    bo_ = copy_bias(w.bo, d);
  });
}

const KernelInfo& Layer::attention_kernel(KvType t) const {
  return kernel_for(t, "Layer::attention_kernel");
}

const KernelInfo& Layer::kernel_for(KvType t, const char* where) const {
  element_bytes(where, t);  // t is a KvType
  const KernelInfo* kernel = attention_[static_cast<std::size_t>(t)];
  if (kernel == nullptr) {
    fail(where, "attention kernel '" + std::string(named_->name) + "' does not read kv_type " +
                    kv_type_name(t));
  }
  return *kernel;
}

void Layer::prefill(const float* x, std::int64_t n, float* y, KvCache& cache, bool causal,
                    int threads) const {
  // The kernels guard their own arithmetic; this covers the layer's (the attention scale
  // 1/sqrt(D) of make_problem), and the OpenMP threads keep their own environments.
  const FpEnvGuard default_fp_env;
  const char* where = "Layer::prefill";
  if (!same_shape(cache.config(), config_)) {
    fail(where, "the cache is for another layer shape (" + shape(cache.config()) +
                    "; the layer's: " + shape(config_) + ")");
  }
  if (n < 1) fail(where, "n must be positive, got " + std::to_string(n));
  if (n > cache.capacity() - cache.length()) {
    fail(where, "the KV cache is full: " + std::to_string(cache.length()) + " of " +
                    std::to_string(cache.capacity()) + " positions used, " + std::to_string(n) +
                    " more requested");
  }
  if (x == nullptr || y == nullptr) fail(where, "x and y must not be null");
  const KernelInfo& attention = kernel_for(cache.kv_type(), where);
  const std::int64_t B = cache.batch(), d = config_.d_model, D = config_.head_dim;
  const std::int64_t H = config_.q_heads, Hkv = config_.kv_heads, hd = H * D;
  // n <= capacity, and B Hkv capacity D floats exist, but B n d and B n H D may still not.
  const std::int64_t rows = sat_mul(B, n);
  if (sat_mul(rows, std::max(d, hd)) == kMax) fail(where, "the activations' size overflows int64");
  const auto begin = [](const float* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const std::uintptr_t bytes = static_cast<std::uintptr_t>(rows * d) * sizeof(float);
  if (begin(x) < begin(y) + bytes && begin(y) < begin(x) + bytes) fail(where, "y overlaps x");
  threads = call_threads(threads);  // the workspace for the threads that will run

  const GemmTile tile = wq_.tile();
  const std::int64_t len = cache.length();
  const Strides kv = cache.strides();
  // The attention of the n new queries over the len + n cached keys, sized here: every
  // scratch array is grown before anything is written, so that when memory runs out y and
  // the cache (its length and its rows) are as they were.
  Problem p = make_problem(B, n, len + n, H, Hkv, D, causal);
  p.kv_type = cache.kv_type();
  p.k = p.v = kv;
  p.k_scale = p.v_scale = cache.scale_strides();
  const WorkspaceSize kernel_ws = attention.workspace;
  const std::size_t attention_bytes = parallel_workspace(kernel_ws, p, threads);
  Scratch& s = scratch();
  const std::int64_t packed_rows = packed_floats(n, d, tile.mr);  // one sequence's packed X
  float* packed_x = grow(s.packed_x, count(sat_mul(B, packed_rows)), where, "the packed X");
  float* q = grow(s.q, count(rows * hd), where, "the queries Q");
  float* o = grow(s.o, count(rows * hd), where, "the attention output");
  float* packed_o = grow(s.packed_o, count(packed_floats(rows, hd, tile.mr)), where,
                         "the packed attention output");
  const Workspace ws{grow(s.attention, attention_bytes, where, "the attention driver's workspace"),
                     s.attention.size()};
  // An fp32 cache takes the projections in its rows; another type's rows are converted from
  // an fp32 scratch of the new tokens' K and V, [B][Hkv][n][D] each, as append takes them.
  const bool direct = cache.kv_type() == KvType::f32;
  const std::int64_t new_kv = B * Hkv * n * D;  // <= the cache's elements
  float* projected =
      direct ? nullptr : grow(s.kv, count(sat_mul(2, new_kv)), where, "the projected K and V");
  const auto jobs = static_cast<std::size_t>(B * (1 + 2 * Hkv));
  s.jobs.clear();
  detail::allocate_or_throw(where, "the GEMM job list", jobs * sizeof(GemmJob),
                            [&] { s.jobs.reserve(jobs); });

  for (std::int64_t b = 0; b < B; ++b) {
    parallel_pack_a(n, d, x + b * n * d, d, tile.mr, packed_x + b * packed_rows, threads);
  }

  // Projections: per sequence, Q and each KV head's K and V rows, into the cache (or the
  // scratch). A GEMM element depends on its row of X and column of W alone, so the rows hold
  // the same bits either way.
  float* const cache_k = reinterpret_cast<float*>(cache.k_.data());
  float* const cache_v = reinterpret_cast<float*>(cache.v_.data());
  for (std::int64_t b = 0; b < B; ++b) {
    const float* a = packed_x + b * packed_rows;
    s.jobs.push_back({{n, hd, d, hd}, a, wq_.data(), bias_at(bq_, 0), q + b * n * hd});
    for (std::int64_t j = 0; j < Hkv; ++j) {
      const std::int64_t at = b * kv.batch + j * kv.head + len * kv.seq;
      const std::int64_t from = (b * Hkv + j) * n * D;
      s.jobs.push_back({{n, D, d, D},
                        a,
                        wk_[static_cast<std::size_t>(j)].data(),
                        bias_at(bk_, j * D),
                        direct ? cache_k + at : projected + from});
      s.jobs.push_back({{n, D, d, D},
                        a,
                        wv_[static_cast<std::size_t>(j)].data(),
                        bias_at(bv_, j * D),
                        direct ? cache_v + at : projected + new_kv + from});
    }
  }
  parallel_gemm(gemm_->fn, tile, s.jobs.data(), s.jobs.size(), threads);
  if (direct) {
    cache.length_ = len + n;
  } else {
    cache.store(projected, projected + new_kv, n);
  }

  // Attention of the n new queries over the len + n cached keys, read in the cache's type.
  parallel_attention(attention.fn, kernel_ws, p, q, cache.k_view(), cache.v_view(), o, nullptr,
                     threads, ws);

  // Y = Concat(heads) W^O + b^O: o is token-major [B n][H D], the concatenation itself.
  parallel_pack_a(rows, hd, o, hd, tile.mr, packed_o, threads);
  const GemmJob out{{rows, d, hd, d}, packed_o, wo_.data(), bias_at(bo_, 0), y};
  parallel_gemm(gemm_->fn, tile, &out, 1, threads);
}

void Layer::decode(const float* x, float* y, KvCache& cache, int threads) const {
  prefill(x, 1, y, cache, true, threads);
}

void Layer::forward(const float* x, std::int64_t batch, std::int64_t n, float* y, bool causal,
                    int threads) const {
  if (batch < 1 || n < 1) {
    fail("Layer::forward", "batch and n must be positive, got batch " + std::to_string(batch) +
                               ", n " + std::to_string(n));
  }
  KvCache cache(config_, batch, n);
  prefill(x, n, y, cache, causal, threads);
}

}  // namespace mha

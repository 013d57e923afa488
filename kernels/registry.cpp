// The runtime registry generated from registry.inc, and the validating entry point.
#include "mha/registry.h"

#include "mha/parallel.h"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#define MHA_KERNEL(name, isa, function, exp_ulp, tiled, kv_types)                              \
  void function(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o, \
                float* lse, mha::Workspace ws);                                                \
  std::size_t function##_workspace(const mha::Problem& p);
#include "registry.inc"
#undef MHA_KERNEL

#define MHA_GEMM(name, isa, function)                                                         \
  void function(const mha::GemmProblem& p, const float* a, const float* b, const float* bias, \
                float* c);                                                                    \
  mha::GemmTile function##_tile();
#include "gemm/gemm.inc"
#undef MHA_GEMM

namespace mha {

const std::vector<KernelInfo>& all_kernels() {
  static const std::vector<KernelInfo> kernels = {
#define MHA_KERNEL(name, isa, function, exp_ulp, tiled, kv_types) \
  {#name, Isa::isa, function, function##_workspace, exp_ulp, tiled, kv_types},
#include "registry.inc"
#undef MHA_KERNEL
  };
  return kernels;
}

bool available(const KernelInfo& kernel) {
  return isa_rank(kernel.isa) <= max_isa_rank() && cpu_supports(kernel.isa);
}

const KernelInfo* find_kernel(const std::string& name) {
  for (const KernelInfo& kernel : all_kernels()) {
    if (name == kernel.name) return &kernel;
  }
  return nullptr;
}

const KernelInfo& best_kernel(KvType t) {
  const KernelInfo* best = &all_kernels().front();  // naive: scalar, always available, any type
  for (const KernelInfo& kernel : all_kernels()) {
    if (available(kernel) && reads(kernel, t)) best = &kernel;
  }
  return *best;
}

const std::vector<GemmInfo>& all_gemms() {
  static const std::vector<GemmInfo> gemms = {
#define MHA_GEMM(name, isa, function) {#name, Isa::isa, function, function##_tile},
#include "gemm/gemm.inc"
#undef MHA_GEMM
  };
  return gemms;
}

bool available(const GemmInfo& gemm) {
  return isa_rank(gemm.isa) <= max_isa_rank() && cpu_supports(gemm.isa);
}

const GemmInfo* find_gemm(const std::string& name) {
  for (const GemmInfo& gemm : all_gemms()) {
    if (name == gemm.name) return &gemm;
  }
  return nullptr;
}

const GemmInfo& best_gemm() {
  const GemmInfo* best = &all_gemms().front();  // portable: scalar, always available
  for (const GemmInfo& gemm : all_gemms()) {
    if (available(gemm)) best = &gemm;
  }
  return *best;
}

namespace {

struct Range {
  const char* name;
  std::uintptr_t begin, end;  // bytes [begin, end)
};

Range range(const char* name, const void* base, std::int64_t elements,
            std::size_t bytes = sizeof(float)) {
  const auto begin = reinterpret_cast<std::uintptr_t>(base);
  return {name, begin, begin + static_cast<std::uintptr_t>(elements) * bytes};
}

bool intersect(const Range& a, const Range& b) { return a.begin < b.end && b.begin < a.end; }

}  // namespace

std::string check_call(const Problem& p, const float* q, KvView k, KvView v, const float* o,
                       const float* lse) {
  std::string message = check(p);
  if (!message.empty()) return message;
  const bool i8 = p.kv_type == KvType::i8;
  const struct {
    const char* name;
    const void* ptr;
  } required[] = {{"q", q},
                  {"k", k.data},
                  {"v", v.data},
                  {"o", o},
                  {"k.scale (kv_type i8)", i8 ? k.scale : q},
                  {"v.scale (kv_type i8)", i8 ? v.scale : q}};
  for (const auto& r : required) {
    if (r.ptr == nullptr) return std::string(r.name) + " must not be null";
  }
  // Whole memory ranges are compared, so an output interleaved with an input in one buffer
  // (disjoint elements, overlapping ranges) is rejected too: conservative, never unsafe.
  const std::size_t kv_bytes = kv_type_bytes(p.kv_type);
  const Range inputs[] = {
      range("q", q, q_extent(p)),
      range("k", k.data, k_extent(p), kv_bytes),
      range("v", v.data, v_extent(p), kv_bytes),
      range("k.scale", k.scale, i8 ? k_scale_extent(p) : 0),
      range("v.scale", v.scale, i8 ? v_scale_extent(p) : 0),
      range("sinks", p.sinks, p.sinks != nullptr ? p.q_heads : 0),
      range("alibi", p.alibi, p.alibi != nullptr ? p.q_heads : 0),
      range("q_lens", p.q_lens, p.q_lens != nullptr ? p.batch : 0, sizeof(std::int64_t)),
      range("kv_lens", p.kv_lens, p.kv_lens != nullptr ? p.batch : 0, sizeof(std::int64_t))};
  Range outputs[] = {range("o", o, o_extent(p)), range("lse", lse, lse_extent(p))};
  const int n_outputs = lse != nullptr ? 2 : 1;
  for (int i = 0; i < n_outputs; ++i) {
    for (const Range& in : inputs) {
      if (intersect(outputs[i], in)) {
        return std::string(outputs[i].name) + " overlaps " + in.name +
               ": outputs must not share memory with inputs";
      }
    }
  }
  if (n_outputs == 2 && intersect(outputs[0], outputs[1])) {
    return "lse overlaps o: outputs must not share memory";
  }
  return std::string();
}

namespace {

// The driver's workspace of the calling thread, grown to the largest call so far.
Workspace thread_workspace(std::size_t bytes) {
  thread_local std::unique_ptr<unsigned char[]> data;
  thread_local std::size_t size = 0;
  if (bytes > size) {
    data.reset();  // the old one first: the peak is the new size, not the sum
    size = 0;      // and its size forgotten, so a failure below leaves no size without memory
    data = detail::allocate_or_throw("mha::attention", "the driver's workspace", bytes, [&] {
      return std::unique_ptr<unsigned char[]>(new unsigned char[bytes]);
    });
    size = bytes;
  }
  return {data.get(), size};
}

void run(const KernelInfo& info, const Problem& p, const float* q, KvView k, KvView v, float* o,
         float* lse, int threads) {
  if (!available(info)) {
    throw std::invalid_argument("kernel '" + std::string(info.name) + "' needs " +
                                isa_name(info.isa) +
                                ", which this CPU lacks or MHA_MAX_ISA excludes");
  }
  const std::string message = check_call(p, q, k, v, o, lse);
  if (!message.empty()) throw std::invalid_argument("mha::attention: " + message);
  if (!reads(info, p.kv_type)) {
    throw std::invalid_argument("mha::attention: kernel '" + std::string(info.name) +
                                "' does not read kv_type " + kv_type_name(p.kv_type));
  }
  threads = call_threads(threads);  // the workspace for the threads that will run
  const Workspace ws = thread_workspace(parallel_workspace(info.workspace, p, threads));
  parallel_attention(info.fn, info.workspace, p, q, k, v, o, lse, threads, ws);
}

}  // namespace

PackedMatrix::PackedMatrix(const GemmInfo& kernel, std::int64_t k, std::int64_t n, const float* b,
                           std::int64_t row_stride, std::int64_t col_stride)
    : kernel_(&kernel), k_(k), n_(n) {
  if (!available(kernel)) {
    throw std::invalid_argument("gemm kernel '" + std::string(kernel.name) + "' needs " +
                                isa_name(kernel.isa) +
                                ", which this CPU lacks or MHA_MAX_ISA excludes");
  }
  if (k < 1 || n < 1) {
    throw std::invalid_argument("PackedMatrix: k and n must be positive, got k = " +
                                std::to_string(k) + ", n = " + std::to_string(n));
  }
  if (b == nullptr) throw std::invalid_argument("PackedMatrix: b must not be null");
  tile_ = kernel.tile();
  const std::int64_t floats = packed_floats(n, k, tile_.nr);
  if (floats == std::numeric_limits<std::int64_t>::max() ||
      static_cast<std::uint64_t>(floats) > data_.max_size()) {
    throw std::invalid_argument("PackedMatrix: the packed size overflows");
  }
  detail::allocate_or_throw("PackedMatrix", "the packed matrix",
                            detail::bytes_of(floats, sizeof(float)),
                            [&] { data_.resize(static_cast<std::size_t>(floats)); });
  pack_b(k, n, b, row_stride, col_stride, tile_.nr, data_.data());
}

void gemm(std::int64_t m, const float* a, std::int64_t lda, const PackedMatrix& b,
          const float* bias, float* c, std::int64_t ldc, int threads) {
  const auto fail = [](const std::string& why) {
    throw std::invalid_argument("mha::gemm: " + why);
  };
  if (b.kernel() == nullptr) fail("b is an empty PackedMatrix");
  const GemmProblem p{m, b.n(), b.k(), ldc};
  if (const std::string message = check_gemm(p); !message.empty()) fail(message);
  if (lda < p.k) fail("lda must be >= k (" + std::to_string(p.k) + "), got " + std::to_string(lda));
  if (p.m > 1 && lda > (std::numeric_limits<std::int64_t>::max() - p.k) / (p.m - 1)) {
    fail("a's highest element offset overflows int64");
  }
  if (a == nullptr || c == nullptr) fail("a and c must not be null");
  const Range out = range("c", c, c_extent(p));
  if (intersect(out, range("a", a, (p.m - 1) * lda + p.k))) fail("c overlaps a");
  if (bias != nullptr && intersect(out, range("bias", bias, p.n))) fail("c overlaps bias");
  if (threads <= 0) threads = default_threads();
  const GemmTile tile = b.tile();
  thread_local std::vector<float> packed_a;  // grows to the largest call on this thread
  const auto floats = static_cast<std::size_t>(packed_floats(p.m, p.k, tile.mr));
  if (packed_a.size() < floats) {
    packed_a.clear();
    packed_a.shrink_to_fit();  // the old one first: the peak is the new size, not the sum
    detail::allocate_or_throw("mha::gemm", "the packed A",
                              detail::bytes_of(static_cast<std::int64_t>(floats), sizeof(float)),
                              [&] { packed_a.resize(floats); });
  }
  parallel_pack_a(p.m, p.k, a, lda, tile.mr, packed_a.data(), threads);
  const GemmJob job{p, packed_a.data(), b.data(), bias, c};
  parallel_gemm(b.kernel()->fn, tile, &job, 1, threads);
}

void attention(const std::string& kernel, const Problem& p, const float* q, KvView k, KvView v,
               float* o, float* lse, int threads) {
  const KernelInfo* info = find_kernel(kernel);
  if (info == nullptr) throw std::invalid_argument("unknown kernel '" + kernel + "'");
  run(*info, p, q, k, v, o, lse, threads);
}

void attention(const KernelInfo& kernel, const Problem& p, const float* q, KvView k, KvView v,
               float* o, float* lse, int threads) {
  if (!callable(kernel)) {
    throw std::invalid_argument("mha::attention: a KernelInfo needs a name, fn and workspace");
  }
  run(kernel, p, q, k, v, o, lse, threads);
}

void attention(const Problem& p, const float* q, KvView k, KvView v, float* o, float* lse,
               int threads) {
  run(best_kernel(p.kv_type), p, q, k, v, o, lse, threads);
}

}  // namespace mha

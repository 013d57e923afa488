// mha/registry.h: the kernel variants this build contains, CPU feature detection, and the
// validating public entry point.
#pragma once

#include <mha/attention.h>
#include <mha/gemm.h>

#include <cstddef>
#include <new>
#include <string>
#include <vector>

namespace mha {

namespace detail {
/// An allocator of 64-byte-aligned storage (a cache line, a zmm vector): a packed weight's
/// panels start on cache lines, so that no vector load of B straddles two of them. With the
/// 16-byte alignment of an ordinary vector, the avx512 GEMM ran 3% slower (2048 x 4096 x 4096,
/// one thread, Intel Xeon family 6 model 167).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT: rebinding converts
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};
}  // namespace detail

/// Instruction sets a kernel may need, in the order of mha/isa.inc (the one list, with each
/// ISA's rank and detection). Ranks order them for MHA_MAX_ISA: a kernel is offered when the
/// CPU has its ISA and the ISA's rank is at most the cap's.
enum class Isa {
#define MHA_ISA(name, rank, arch, needs, detect) name,
#include <mha/isa.inc>
#undef MHA_ISA
};

/// Every Isa, in the order of mha/isa.inc.
inline constexpr Isa all_isas[] = {
#define MHA_ISA(name, rank, arch, needs, detect) Isa::name,
#include <mha/isa.inc>
#undef MHA_ISA
};

const char* isa_name(Isa isa);
int isa_rank(Isa isa);

/// Whether this CPU (and OS) supports `isa`, ignoring MHA_MAX_ISA. False for an ISA of
/// another architecture.
bool cpu_supports(Isa isa);

/// The cap from the environment variable MHA_MAX_ISA (an isa_name: scalar, avx2, avx512,
/// neon), or the highest rank of all ISAs when it is unset or empty. Throws
/// std::invalid_argument naming the accepted values when it holds anything else.
int max_isa_rank();

namespace detail {
/// max_isa_rank() of the text `value` (MHA_MAX_ISA's value; null or empty: unset).
int parse_max_isa(const char* value);
}  // namespace detail

/// One registry entry: see kernels/registry.inc.
struct KernelInfo {
  const char* name;
  Isa isa;
  Kernel fn;
  WorkspaceSize workspace;  ///< the bytes of workspace fn needs
  double exp_ulp;
  bool tiled;
  unsigned kv_types;  ///< the KvTypes it reads: bit kv_bit(t) for each
};

/// A KvType's bit in KernelInfo::kv_types.
constexpr unsigned kv_bit(KvType t) { return 1u << static_cast<unsigned>(t); }
constexpr unsigned kKvF32 = kv_bit(KvType::f32);  ///< fp32 K and V only
constexpr unsigned kKvAll =                       ///< every KvType
    kv_bit(KvType::f32) | kv_bit(KvType::f16) | kv_bit(KvType::bf16) | kv_bit(KvType::i8);

/// Whether an entry can be called: its name, fn and workspace are set (mha::attention and
/// Layer refuse one that is not).
inline bool callable(const KernelInfo& kernel) {
  return kernel.name != nullptr && kernel.fn != nullptr && kernel.workspace != nullptr;
}

/// Whether `kernel` reads K and V stored as t.
inline bool reads(const KernelInfo& kernel, KvType t) { return (kernel.kv_types & kv_bit(t)) != 0; }

/// Every kernel compiled into this build, in registry order (slowest first).
const std::vector<KernelInfo>& all_kernels();

/// Whether `kernel` may run here: the CPU has its ISA and MHA_MAX_ISA allows it.
bool available(const KernelInfo& kernel);

/// The kernel called `name`, or nullptr.
const KernelInfo* find_kernel(const std::string& name);

/// The last available kernel in registry order that reads K and V stored as t (the fastest
/// this machine may use for them).
const KernelInfo& best_kernel(KvType t = KvType::f32);

/// Why a call with these arguments would be invalid, or an empty string: check(p), null
/// pointers, and outputs whose memory ranges overlap an input's or each other's.
std::string check_call(const Problem& p, const float* q, KvView k, KvView v, const float* o,
                       const float* lse);

/// Validates (throwing std::invalid_argument with check_call's message) and runs the best
/// available kernel that reads p.kv_type through the parallel driver (mha/parallel.h) on `threads`
/// threads (0: MHA_NUM_THREADS, else all cores; inside a caller's OpenMP parallel region the
/// calling thread alone: call_threads). lse may be null. The output does not depend on
/// the thread count, bit for bit. The driver's workspace is kept per calling thread and
/// grown when a problem needs more: a call no larger than an earlier one on the same thread
/// allocates nothing. When it cannot be grown, throws AllocationError (mha/attention.h)
/// before writing anything; a later call that fits in memory works again.
void attention(const Problem& p, const float* q, KvView k, KvView v, float* o, float* lse = nullptr,
               int threads = 0);

/// The same with a named kernel; throws std::invalid_argument when the name is unknown, the
/// kernel is not available on this CPU or does not read p.kv_type.
void attention(const std::string& kernel, const Problem& p, const float* q, KvView k, KvView v,
               float* o, float* lse = nullptr, int threads = 0);

/// The same with a kernel given by its entry, which need not be in the registry: a copied or
/// modified kernel gets the same validation, parallel driver and workspace. Throws
/// std::invalid_argument when its name, fn or workspace is null, and as above.
void attention(const KernelInfo& kernel, const Problem& p, const float* q, KvView k, KvView v,
               float* o, float* lse = nullptr, int threads = 0);

/// One GEMM kernel of kernels/gemm/gemm.inc (mha/gemm.h).
struct GemmInfo {
  const char* name;
  Isa isa;
  GemmKernel fn;
  /// Its register tile, for which A and B must be packed. Compiled with the kernel's ISA
  /// flags like the kernel: call it only where available() holds.
  GemmTileOf tile;
};

/// Every GEMM kernel compiled into this build, in list order (slowest first).
const std::vector<GemmInfo>& all_gemms();

/// Whether `gemm` may run here (its ISA, MHA_MAX_ISA).
bool available(const GemmInfo& gemm);

/// The GEMM kernel called `name`, or nullptr.
const GemmInfo* find_gemm(const std::string& name);

/// The last available GEMM kernel in list order.
const GemmInfo& best_gemm();

/// A matrix B (k x n) packed once for one GEMM kernel (a weight of the layer).
class PackedMatrix {
 public:
  PackedMatrix() = default;
  /// Packs B, element (l, j) at b[l * row_stride + j * col_stride] (B[k][n]: {n, 1}; a
  /// PyTorch Linear weight W[n][k], B = W^T: {1, k}), for `kernel`. Throws
  /// std::invalid_argument when the kernel is not available, a size is not positive or the
  /// packed size overflows, AllocationError when its memory cannot be had.
  PackedMatrix(const GemmInfo& kernel, std::int64_t k, std::int64_t n, const float* b,
               std::int64_t row_stride, std::int64_t col_stride);
  const GemmInfo* kernel() const { return kernel_; }
  GemmTile tile() const { return tile_; }
  std::int64_t k() const { return k_; }
  std::int64_t n() const { return n_; }
  const float* data() const { return data_.data(); }
  /// The packed columns [j0, n) as a matrix of their own: j0 must be a multiple of tile().nr.
  const float* columns(std::int64_t j0) const {
    return packed_panel(data(), k_, tile_.nr, j0 / tile_.nr);
  }

 private:
  const GemmInfo* kernel_ = nullptr;
  GemmTile tile_;
  std::int64_t k_ = 0, n_ = 0;
  std::vector<float, detail::CacheLineAllocator<float>> data_;  // panels on cache lines
};

/// C = A B (+ bias when not null) with B's kernel, through the GEMM driver (mha/parallel.h)
/// on `threads` threads (0: MHA_NUM_THREADS, else all cores; inside a caller's OpenMP
/// parallel region the calling thread alone: call_threads): A (m x k, rows lda apart) is
/// packed into a per-thread scratch that only grows, C is m x n with rows ldc apart, bias
/// has n floats. Validates (std::invalid_argument: sizes, strides, null pointers, C
/// overlapping A or bias, an empty B); AllocationError when the packed A cannot grow, before
/// C is written. The output does not depend on the thread count.
void gemm(std::int64_t m, const float* a, std::int64_t lda, const PackedMatrix& b,
          const float* bias, float* c, std::int64_t ldc, int threads = 0);

}  // namespace mha

// mha/parallel.h: the thread-parallel driver. Kernels stay single-threaded microkernels;
// the driver cuts one problem into independent sub-problems and runs them on threads.
#pragma once

#include <mha/attention.h>
#include <mha/gemm.h>

#include <cstddef>
#include <cstdint>

namespace mha {

/// How the driver cuts a problem. It depends only on the problem, never on the number of
/// threads, so every thread count computes exactly the same operations and gives
/// bit-identical output.
///
/// * Units: (batch, KV-head group, block of query rows). A group is the g = q_heads /
///   kv_heads query heads that read one KV head, so a unit is the problem {batch 1,
///   q_heads g, kv_heads 1, its rows}: the kernel loads each KV tile once for all g heads.
///   A unit's block of query rows is kUnitRows / g long, within [kMinRowBlock, kRowBlock],
///   so that a unit is about 512 rows of all g heads (a block of the avx512 kernel); MQA
///   (g = 32) gets 16-row blocks. Rows are sliced with bottom-right causal alignment
///   (DESIGN.md, section 4): rows [r0, r1) see keys up to kv_len - q_len + r1; a slice that sees no
///   key is written as zeros and lse = -inf by the driver itself. With a sliding window
///   (Problem::window) a unit's keys start at its first row's first key: the unit is the
///   problem of its rows over those keys, with the same window.
/// * Split-KV: when a sequence (one batch element) has fewer units than kMinUnits, the units are
/// short of rows
///   (q_len below the row block: decoding) and the KV length is long, each unit's KV range
///   is cut into chunks (a prefill of few heads is not: its units are whole, and splitting
///   them only adds merges, 15% at H = 4, L = 1024, D = 256); each chunk runs with lse into
///   workspace and the chunks are merged exactly (mha::merge's arithmetic). Chunks of a causal unit
///   end at or before key kv_len - q_len + r1 - rows + 1, so that every row sees them whole, except
///   the last, which stays causal. The cut depends on the sequence alone (its lengths and
///   heads), not on the batch size, so a sequence's output does not depend on the thread count
///   or on the other sequences in its batch. With sinks (Problem::sinks), the chunks run without
///   them and the merge counts each once. With a sliding window, the keys a unit's rows read
///   (the window, plus a key per row after the first) decide the split, chunks are cut from the
///   unit's first key, and only a unit whose rows' windows all start at that key is cut (one
///   query row, or windows that reach key 0), so that every chunk lies in every row's window
///   (a chunk before the last could not give rows different first keys).
struct Plan {
  static constexpr std::int64_t kUnitRows = 512;  ///< rows of all g heads per unit, about
  /// Query rows per unit at most: 512, so that an MHA unit (g = 1) is a whole avx512 block
  /// too. With 128 (R = 128), MHA prefill at D = 128 ran 13-25% slower on one thread.
  static constexpr std::int64_t kRowBlock = 512;
  static constexpr std::int64_t kMinRowBlock = 16;  ///< and at least
  static constexpr std::int64_t kMinUnits = 16;     ///< below this, split the KV length
  static constexpr std::int64_t kChunk = 256;       ///< keys per KV chunk at least: 256 KiB
                                                    ///< of K and V at D = 128, many tiles
  /// Chunks per unit at most. Each chunk is a kernel call whose first KV tile is read
  /// before any of its work can hide it, and a part to merge: MQA decode (32 rows, Lk =
  /// 32768) in 64 chunks of 512 keys took 12-14% longer on 1 thread and 13-21% longer on
  /// 2 than in 16 of 2048. 16 chunks still keep 16 cores busy on a single sequence's decode.
  static constexpr std::int64_t kMaxChunks = 16;

  std::int64_t row_block = 0;  ///< rows per unit
  std::int64_t units = 0;      ///< batch * kv_heads * row blocks
  std::int64_t chunks = 1;     ///< KV chunks per unit (1: no split)
  std::int64_t chunk = 0;      ///< keys per chunk when chunks > 1
};

/// The decomposition of p (see Plan), on its lengths q_len and kv_len. A ragged problem
/// (Problem::q_lens, kv_lens) is cut sequence by sequence, sequence b as plan(sequence(p, b))
/// says: exactly as its call alone would be.
Plan plan(const Problem& p);

/// The thread count the driver uses when given 0: MHA_NUM_THREADS when set (a positive
/// integer; anything else throws std::invalid_argument), else the number of cores.
int default_threads();

/// The threads a driver call runs on when asked for `threads` (0: default_threads()): that
/// many, except inside an active OpenMP parallel region of the caller (omp_in_parallel(): a
/// `#pragma omp parallel` of more than one thread, or a task created in one), where the whole call
/// runs on the calling thread, whatever `threads` says and whether the caller enabled nested
/// parallelism or not. The caller's team already holds the cores: with OpenMP's default
/// (max-active-levels 1) a nested team would get one thread anyway, and with nesting
/// enabled (omp_set_max_active_levels(2)) each of the caller's T threads would start a team
/// of its own, T x threads threads on T cores. The output is the same bits either way (the
/// cut does not depend on the thread count), and the call waits on no other thread of the
/// caller's team (every region is the driver's own), so it cannot deadlock on it.
///
/// Threads that are not inside an OpenMP region (std::thread, a thread pool) may call at
/// once: each call starts its own team, so k callers use k x threads threads; pass
/// `threads` (or set MHA_NUM_THREADS) to fit them to the cores.
int call_threads(int threads);

namespace detail {
/// The thread count the text `value` (MHA_NUM_THREADS's value) sets: 0 when null or empty
/// (unset), else as default_threads() says.
int parse_num_threads(const char* value);
}  // namespace detail

/// Bytes of workspace parallel_attention needs to run a kernel whose own workspace is
/// `kernel_workspace` over p on `threads` threads (0: default_threads()): one kernel
/// workspace per thread (for the largest unit), the schedule, and for split-KV the partial
/// results, chunks * (D + 1) floats per query row of every unit, at most 16 chunks (about
/// 0.25 MiB for one decode token of 32 heads at D = 128). Sized for `threads` inside a
/// parallel region too, so that a workspace sized there serves calls made outside.
std::size_t parallel_workspace(WorkspaceSize kernel_workspace, const Problem& p, int threads = 0);

/// Runs `kernel` over p on call_threads(threads) threads. Same contract as a
/// kernel: p must pass check(), pointers valid, outputs disjoint from inputs; lse may be
/// null. ws must hold parallel_workspace(kernel_workspace, p, threads) bytes for the same
/// thread count, or for more threads (fewer need less: inside a parallel region, any
/// count's workspace serves); nothing is allocated, so a caller that keeps its workspace makes
/// repeated calls allocation-free (OpenMP's own thread pool aside).
void parallel_attention(Kernel kernel, WorkspaceSize kernel_workspace, const Problem& p,
                        const float* q, KvView k, KvView v, float* o, float* lse, int threads,
                        Workspace ws);

/// How the GEMM driver cuts its jobs: into tiles of C of `rows` (whole panels of mr) by
/// `cols` (whole panels of nr), each a kernel call over the whole depth k. No tile splits k,
/// so every element is the same accumulation whatever the cut: the output is bit-identical
/// for every tile size and thread count, and the cut may follow the thread count.
///
/// A tile reads its k x cols slab of B from memory once and its rows x k of A once, so the
/// larger the tile the less memory traffic per multiply-add: tiles start at kRows x kCols
/// (1032 x 512 at the avx512 tile; B's slab is then read once per 1032 rows, A once per
/// 512 columns) and are halved, the longer side first, down to kMinRows x kMinCols, until
/// every thread has at least two tiles to take in turn. With one thread, 2048 x 4096 x 4096
/// ran at 0.93-0.95 of oneDNN in 1032 x 512 tiles against 0.86-0.88 in 516 x 256 (2 threads:
/// 0.90 against 0.82-0.85; Intel Xeon family 6 model 167, medians of interleaved runs).
/// A decode step's projection (m = 1, n = 4096) is 8 tiles on one or two threads and 32 on
/// sixteen.
struct GemmPlan {
  static constexpr std::int64_t kRows = 1024;
  static constexpr std::int64_t kCols = 512;
  static constexpr std::int64_t kMinRows = 128;
  static constexpr std::int64_t kMinCols = 128;

  std::int64_t rows = 0;  ///< rows of a tile, a multiple of the kernel's mr
  std::int64_t cols = 0;  ///< columns of a tile, a multiple of its nr
};

/// One GEMM for parallel_gemm: c = a b (+ bias when not null), a and b packed for the
/// kernel's tile (mha/gemm.h). The layer runs its Q projection and every KV head's K and V
/// projections (straight into the cache) as one batch of jobs over one packed X.
struct GemmJob {
  GemmProblem p;
  const float* a = nullptr;  ///< packed A (pack_a)
  const float* b = nullptr;  ///< packed B (pack_b)
  const float* bias = nullptr;
  float* c = nullptr;
};

/// The tiles parallel_gemm cuts `jobs` into for a kernel with register tile `tile` on
/// `threads` threads (0: default_threads()); see GemmPlan.
GemmPlan gemm_plan(GemmTile tile, const GemmJob* jobs, std::size_t count, int threads);

/// Runs the jobs with `kernel` (register tile `tile`) on call_threads(threads) threads, the
/// tiles of all jobs dealt out dynamically. Each job must pass
/// check_gemm and the kernel's contract (c disjoint from every input and from every other
/// job's c). Needs no workspace and allocates nothing (OpenMP's thread pool aside).
void parallel_gemm(GemmKernel kernel, GemmTile tile, const GemmJob* jobs, std::size_t count,
                   int threads);

/// pack_a on call_threads(threads) threads, a panel at a time.
void parallel_pack_a(std::int64_t m, std::int64_t k, const float* a, std::int64_t lda,
                     std::int64_t mr, float* packed, int threads);

}  // namespace mha

// The thread-parallel driver: see mha/parallel.h for the decomposition.
#include "mha/parallel.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "mha/support.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace mha {

namespace {

using support::ceil_div;

// One unit: batch b, KV head kv, query rows [r0, r0 + rows) of the g heads reading kv.
struct Unit {
  std::int64_t b, kv, r0, rows;
  std::int64_t kv_len;      // keys the unit can see at all (bottom-right causal slicing)
  std::int64_t first_part;  // its first partial result, or -1 when it is not split
  std::int64_t parts;       // how many (0 when not split)
};

// One kernel call: a unit's KV range [c0, c1), or all of it.
struct Task {
  std::int64_t unit, c0, c1;
  bool causal;
  std::int64_t part;  // index of the partial result in the workspace, or -1: write o directly
};

// Sizes that bound the schedule, from the problem and the thread count alone.
struct Bounds {
  std::int64_t group, unit_rows;  // g; query rows of the largest unit
  std::int64_t units;             // units of all sequences
  std::int64_t max_tasks;         // kernel calls: units x their sequence's chunks
  std::int64_t max_parts;         // partial results (split-KV only)
  std::int64_t max_chunks;        // chunks of a unit at most (1: no sequence is split)
  std::int64_t part_o, part_lse;  // floats of one partial o and lse
  int threads;                    // threads that get work: at most one per task
  std::size_t kernel_bytes;       // one thread's kernel workspace, for the largest unit
};

Bounds bounds(WorkspaceSize kernel_workspace, const Problem& p, int threads) {
  Bounds b;
  b.group = p.q_heads / p.kv_heads;
  b.unit_rows = std::min(plan(p).row_block, p.q_len);  // every sequence's row block
  b.units = b.max_tasks = b.max_parts = 0;
  b.max_chunks = 1;
  // Each sequence planned alone; without per-sequence lengths they are all alike.
  const std::int64_t distinct = ragged(p) ? p.batch : 1;
  const std::int64_t copies = ragged(p) ? 1 : p.batch;
  for (std::int64_t s = 0; s < distinct; ++s) {
    const Plan sp = plan(sequence(p, s));
    b.units += copies * sp.units;
    b.max_tasks += copies * sp.units * sp.chunks;
    if (sp.chunks > 1) b.max_parts += copies * sp.units * sp.chunks;
    b.max_chunks = std::max(b.max_chunks, sp.chunks);
  }
  b.part_o = b.unit_rows * b.group * p.head_dim;
  b.part_lse = b.unit_rows * b.group;
  b.threads = static_cast<int>(std::clamp<std::int64_t>(b.max_tasks, 1, threads));
  // Every task is a problem {batch 1, q_heads g, kv_heads 1} of at most unit_rows rows and
  // kv_len keys, and a kernel's workspace never decreases with q_len or kv_len.
  Problem largest = p;
  largest.batch = 1;
  largest.q_len = b.unit_rows;
  largest.q_heads = b.group;
  largest.kv_heads = 1;
  largest.q_lens = largest.kv_lens = nullptr;
  b.kernel_bytes = kernel_workspace(largest);
  return b;
}

// The driver's arrays in the workspace; laid out by the same code for the size query.
struct Scratch {
  Unit* units;
  Task* tasks;
  const float** part_o;    // [max_parts]: each partial o
  const float** part_lse;  // [max_parts]: each partial lse
  float* parts_o;          // [max_parts][part_o]
  float* parts_lse;        // [max_parts][part_lse]
  float* merge;            // per thread: chunks + head_dim floats for the merge
  unsigned char* kernel;   // per thread: kernel_bytes rounded up to 64
  std::size_t kernel_stride;
};

Scratch layout(const Bounds& b, const Problem& p, support::Carve& carve) {
  Scratch l;
  l.units = carve.take<Unit>(b.units);
  l.tasks = carve.take<Task>(b.max_tasks);
  l.part_o = carve.take<const float*>(b.max_parts);
  l.part_lse = carve.take<const float*>(b.max_parts);
  l.parts_o = carve.take<float>(b.max_parts * b.part_o);
  l.parts_lse = carve.take<float>(b.max_parts * b.part_lse);
  l.merge = carve.take<float>(b.threads * (b.max_chunks + p.head_dim));
  l.kernel_stride = (b.kernel_bytes + support::Carve::kAlign - 1) / support::Carve::kAlign *
                    support::Carve::kAlign;
  l.kernel = carve.take<unsigned char>(b.threads * static_cast<std::int64_t>(l.kernel_stride));
  return l;
}

// What schedule() filled.
struct Schedule {
  std::int64_t units, tasks;
};

// Fills l.units and l.tasks.
Schedule schedule(const Problem& p, const Bounds& bd, const Scratch& l) {
  std::int64_t n_units = 0, n_tasks = 0, parts = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    // The sequence's own lengths and cut: its tasks are those of its call alone.
    const Problem seq = sequence(p, b);
    const Plan plan = mha::plan(seq);
    for (std::int64_t kv = 0; kv < p.kv_heads; ++kv) {
      for (std::int64_t r0 = 0; r0 < seq.q_len; r0 += plan.row_block) {
        const std::int64_t rows = std::min(plan.row_block, seq.q_len - r0);
        const std::int64_t kv_len = p.causal ? seq.kv_len - seq.q_len + r0 + rows : seq.kv_len;
        // A sliding window: the unit's keys start at its first row's first key, and the unit
        // is the problem of its rows over [first, kv_len) with the same window (bottom-right
        // alignment keeps each row's window where it was).
        const std::int64_t first = first_key(seq, r0);
        Unit& unit = l.units[n_units];
        unit = {b, kv, r0, rows, kv_len, -1, 0};
        const std::int64_t u = n_units++;
        if (kv_len <= 0) continue;  // every row sees no key: the driver writes zeros
        // Keys every row of the unit sees: a chunk ending there or before is not causal.
        // Cuts at multiples of the chunk from the first key up to there (and before the
        // end), only where every row's window starts at that key: then every chunk lies in
        // every row's window, which has no effect but on the last one (no problem of one
        // window could give rows of different first keys a chunk before the last).
        const std::int64_t whole = p.causal ? kv_len - rows + 1 : kv_len;
        const bool cuttable = plan.chunks > 1 && first_key(seq, r0 + rows - 1) == first;
        const std::int64_t cuts =
            cuttable ? std::max<std::int64_t>(0, std::min(whole, kv_len - 1) - first) / plan.chunk
                     : 0;
        const std::int64_t n = cuts + 1;
        if (n > 1) {
          unit.first_part = parts;
          unit.parts = n;
        }
        for (std::int64_t c = 0; c < n; ++c) {
          const bool last = c + 1 == n;
          l.tasks[n_tasks++] = {u, first + c * plan.chunk,
                                last ? kv_len : first + (c + 1) * plan.chunk, p.causal && last,
                                n > 1 ? parts + c : -1};
        }
        if (n > 1) parts += n;
      }
    }
  }
  for (std::int64_t i = 0; i < parts; ++i) {
    l.part_o[i] = l.parts_o + i * bd.part_o;
    l.part_lse[i] = l.parts_lse + i * bd.part_lse;
  }
  return {n_units, n_tasks};
}

int thread_index() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace

Plan plan(const Problem& p) {
  Plan plan;
  plan.row_block =
      std::clamp(Plan::kUnitRows / (p.q_heads / p.kv_heads), Plan::kMinRowBlock, Plan::kRowBlock);
  // Whether and where to cut a sequence's KV range depends on that sequence alone (its
  // lengths and heads), never on the batch: a sequence's bits do not depend on the other
  // sequences it is batched with.
  const std::int64_t sequence_units = p.kv_heads * ceil_div(p.q_len, plan.row_block);
  plan.units = p.batch * sequence_units;
  // The keys a unit reads: with a sliding window, its rows' windows.
  const std::int64_t reach =
      p.window > 0 && p.window < p.kv_len ? std::min(p.kv_len, p.window + p.q_len - 1) : p.kv_len;
  if (sequence_units < Plan::kMinUnits && p.q_len < plan.row_block && reach >= 2 * Plan::kChunk) {
    plan.chunk = std::max(Plan::kChunk, ceil_div(ceil_div(reach, Plan::kMaxChunks), 256) * 256);
    plan.chunks = ceil_div(reach, plan.chunk);
  }
  return plan;
}

int call_threads(int threads) {
  // Resolved first, so that a malformed MHA_NUM_THREADS is reported inside a region too.
  if (threads <= 0) threads = default_threads();
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
#endif
  return threads;
}

namespace detail {

int parse_num_threads(const char* value) {
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  if (*end != '\0' || n < 1 || n > 4096) {
    throw std::invalid_argument("MHA_NUM_THREADS=" + std::string(value) +
                                " is not a positive integer (1..4096)");
  }
  return static_cast<int>(n);
}

}  // namespace detail

int default_threads() {
  const int n = detail::parse_num_threads(std::getenv("MHA_NUM_THREADS"));
  if (n > 0) return n;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::size_t parallel_workspace(WorkspaceSize kernel_workspace, const Problem& p, int threads) {
  if (threads <= 0) threads = default_threads();
  const Bounds b = bounds(kernel_workspace, p, threads);
  // A kernel workspace that does not fit threads times over (SIZE_MAX: a naive decode over a
  // broadcast KV cache of 2^62 keys) makes the whole one SIZE_MAX, which no allocation gives.
  if (b.kernel_bytes >
      static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max() - support::Carve::kAlign) /
          static_cast<std::size_t>(b.threads)) {
    return std::numeric_limits<std::size_t>::max();
  }
  return support::workspace_bytes([&](support::Carve& c) { layout(b, p, c); });
}

void parallel_attention(Kernel kernel, WorkspaceSize kernel_workspace, const Problem& p,
                        const float* q, KvView k, KvView v, float* o, float* lse, int threads,
                        Workspace ws) {
  // One thread inside a caller's parallel region, whatever ws was sized for: the layout for
  // fewer threads differs only in its per-thread arrays, which are shorter.
  threads = call_threads(threads);
  const Bounds bd = bounds(kernel_workspace, p, threads);
  support::Carve carve(ws.data);
  const Scratch l = layout(bd, p, carve);
  const Schedule sched = schedule(p, bd, l);
  const std::int64_t n_tasks = sched.tasks;
  const std::int64_t g = bd.group;
  const std::int64_t D = p.head_dim;
  threads = bd.threads;  // NOLINT: read by the num_threads clauses

  const auto unit_problem = [&](const Unit& u) {
    Problem up = p;
    up.batch = 1;
    up.q_len = u.rows;
    up.kv_len = u.kv_len;
    up.q_heads = g;
    up.kv_heads = 1;
    up.q_lens = up.kv_lens = nullptr;
    if (p.sinks != nullptr) up.sinks = p.sinks + u.kv * g;
    if (p.alibi != nullptr) up.alibi = p.alibi + u.kv * g;
    return up;
  };
  const auto o_at = [&](const Unit& u) {
    return o + u.b * p.o.batch + u.r0 * p.o.seq + u.kv * g * p.o.head;
  };
  const auto lse_at = [&](const Unit& u) {
    return lse + u.b * p.lse.batch + u.kv * g * p.lse.head + u.r0;
  };

  // Partial results (o [row][head][d], lse [head][row] of every chunk of a split unit) are
  // left uninitialized: each is written whole by its kernel call before the merge reads it.
  // (Zero-filling row_block rows of every chunk cost 27 ms per call at H = 32, Hkv = 8,
  // Lk = 32768: the decode itself.)
  const auto run_task = [&](std::int64_t t) {
    const Task& task = l.tasks[t];
    const Unit& u = l.units[task.unit];
    Problem tp = unit_problem(u);
    tp.kv_len = task.c1 - task.c0;
    tp.causal = task.causal;
    // ALiBi's distances are the sequence's: its rows [r0, r0 + rows) over keys [c0, c1).
    tp.alibi_offset = slice_offset(sequence(p, u.b), u.r0 + u.rows, task.c1);
    const float* tq = q + u.b * p.q.batch + u.r0 * p.q.seq + u.kv * g * p.q.head;
    const KvView tk = kv_row(k, p.kv_type, p.k, p.k_scale, u.b, task.c0, u.kv);
    const KvView tv = kv_row(v, p.kv_type, p.v, p.v_scale, u.b, task.c0, u.kv);
    const Workspace kws{l.kernel + static_cast<std::size_t>(thread_index()) * l.kernel_stride,
                        bd.kernel_bytes};
    if (task.part < 0) {
      kernel(tp, tq, tk, tv, o_at(u), lse != nullptr ? lse_at(u) : nullptr, kws);
    } else {
      tp.o = {0, g * D, D};
      tp.lse = {0, u.rows};
      tp.sinks = nullptr;  // a chunk's part leaves the sink out: the merge counts it once
      kernel(tp, tq, tk, tv, l.parts_o + task.part * bd.part_o,
             l.parts_lse + task.part * bd.part_lse, kws);
    }
  };
  if (bd.max_parts > 0) {
    // Split KV: dealt out the same way every call, so that a thread finds its chunks in its
    // own core's L2 when the KV cache fits there (dynamic dealing can move a chunk to the
    // other core from one call to the next), and in turn, task t to thread t mod T: each
    // unit's chunks are of equal work, so every thread gets its share of every sequence. (In
    // halves, a ragged batch's short sequences went to one thread and its long ones to the
    // other: 8 sequences of 1024..32768 keys, H = 32, Hkv = 8, 2 threads, ran 1.25-1.33x
    // longer.)
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (std::int64_t t = 0; t < n_tasks; ++t) run_task(t);
  } else {
    // Units of unequal work (causal blocks see different numbers of keys): taken in turn.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (std::int64_t t = 0; t < n_tasks; ++t) run_task(t);
  }

  const std::int64_t n_units = sched.units;
  // One unit (a decode of one KV head) is merged where it is, without waking the threads.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n_units > 1)
  for (std::int64_t i = 0; i < n_units; ++i) {
    const Unit& u = l.units[i];
    if (u.kv_len <= 0) {  // no row of the slice sees a key
      for (std::int64_t r = 0; r < u.rows; ++r) {
        for (std::int64_t h = 0; h < g; ++h) {
          float* row = o_at(u) + r * p.o.seq + h * p.o.head;
          std::fill(row, row + D, 0.0f);
          if (lse != nullptr) lse_at(u)[h * p.lse.head + r] = sink_of(p, u.kv * g + h);
        }
      }
      continue;
    }
    if (u.first_part < 0) continue;
    Parts parts;
    parts.count = static_cast<int>(u.parts);
    parts.o = l.part_o + u.first_part;
    parts.lse = l.part_lse + u.first_part;
    parts.o_strides = {0, g * D, D};
    parts.lse_strides = {0, u.rows};
    detail::merge_unchecked(unit_problem(u), parts, o_at(u), lse != nullptr ? lse_at(u) : nullptr,
                            l.merge + thread_index() * (bd.max_chunks + D));
  }
}

namespace {

// Tiles of `rows` x `cols` over all jobs.
std::int64_t gemm_tiles(const GemmJob* jobs, std::size_t count, std::int64_t rows,
                        std::int64_t cols) {
  std::int64_t tiles = 0;
  for (std::size_t j = 0; j < count; ++j)
    tiles += ceil_div(jobs[j].p.m, rows) * ceil_div(jobs[j].p.n, cols);
  return tiles;
}

}  // namespace

GemmPlan gemm_plan(GemmTile tile, const GemmJob* jobs, std::size_t count, int threads) {
  if (threads <= 0) threads = default_threads();
  std::int64_t most_m = 1, most_n = 1;
  for (std::size_t j = 0; j < count; ++j) {
    most_m = std::max(most_m, jobs[j].p.m);
    most_n = std::max(most_n, jobs[j].p.n);
  }
  // Rows and columns beyond the largest job's add no tile: start no larger than it.
  std::int64_t rows = support::round_up(std::min(GemmPlan::kRows, most_m), tile.mr);
  std::int64_t cols = support::round_up(std::min(GemmPlan::kCols, most_n), tile.nr);
  const std::int64_t wanted = threads > 1 ? 2 * std::int64_t{threads} : 1;
  while (gemm_tiles(jobs, count, rows, cols) < wanted) {
    // Halve the longer side that may still be halved; stop when neither may.
    const bool can_rows = rows / 2 >= GemmPlan::kMinRows;
    const bool can_cols = cols / 2 >= GemmPlan::kMinCols;
    if (can_rows && (rows >= cols || !can_cols))
      rows = support::round_up(rows / 2, tile.mr);
    else if (can_cols)
      cols = support::round_up(cols / 2, tile.nr);
    else
      break;
  }
  return {rows, cols};
}

void parallel_gemm(GemmKernel kernel, GemmTile tile, const GemmJob* jobs, std::size_t count,
                   int threads) {
  threads = call_threads(threads);
  // The kernels' blocking reads the cache sizes once per process (support::caches(), which
  // allocates and may throw): read here, a failure is this call's exception, not
  // std::terminate inside the parallel region.
  (void)support::caches();
  const GemmPlan cut = gemm_plan(tile, jobs, count, threads);
  const auto col_tiles = [&](const GemmProblem& p) { return ceil_div(p.n, cut.cols); };
  const auto tiles_of = [&](const GemmProblem& p) {
    return ceil_div(p.m, cut.rows) * col_tiles(p);
  };
  const std::int64_t tiles = gemm_tiles(jobs, count, cut.rows, cut.cols);
  threads = static_cast<int>(std::clamp<std::int64_t>(tiles, 1, threads));  // NOLINT: num_threads

  // Tile t of all jobs: the job is found by a scan (a handful of jobs, each tile millions of
  // multiply-adds), so the driver keeps no table and needs no workspace. A job's tiles run
  // along its rows of tiles, so that consecutive tiles share their rows of A.
  const auto run_tile = [&](std::int64_t t) {
    std::size_t j = 0;
    while (t >= tiles_of(jobs[j].p)) t -= tiles_of(jobs[j++].p);
    const GemmJob& job = jobs[j];
    const std::int64_t per_row = col_tiles(job.p);
    const std::int64_t i0 = t / per_row * cut.rows, j0 = t % per_row * cut.cols;
    GemmProblem tp = job.p;
    tp.m = std::min(cut.rows, job.p.m - i0);
    tp.n = std::min(cut.cols, job.p.n - j0);
    // Rows [i0, ...) and columns [j0, ...) of the packed operands start at whole panels.
    kernel(tp, packed_panel(job.a, job.p.k, tile.mr, i0 / tile.mr),
           packed_panel(job.b, job.p.k, tile.nr, j0 / tile.nr),
           job.bias != nullptr ? job.bias + j0 : nullptr, job.c + i0 * job.p.ldc + j0);
  };
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (std::int64_t t = 0; t < tiles; ++t) run_tile(t);
}

void parallel_pack_a(std::int64_t m, std::int64_t k, const float* a, std::int64_t lda,
                     std::int64_t mr, float* packed, int threads) {
  threads = call_threads(threads);
  const std::int64_t panels = ceil_div(m, mr);
  threads = static_cast<int>(std::clamp<std::int64_t>(panels, 1, threads));  // NOLINT
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * k >= 65536)
  for (std::int64_t p = 0; p < panels; ++p) {
    const std::int64_t rows = std::min(mr, m - p * mr);
    pack_a(rows, k, a + p * mr * lda, lda, 1, mr, packed + p * mr * k);
  }
}

}  // namespace mha

// The thread-parallel driver: see mha/parallel.h for the decomposition.
#include "mha/parallel.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace mha {

namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// One unit: batch b, KV head kv, query rows [r0, r0 + rows) of the g heads reading kv.
struct Unit {
  std::int64_t b, kv, r0, rows;
  std::int64_t kv_len;  // keys the unit can see at all (bottom-right causal slicing)
};

// One kernel call: a unit's KV range [c0, c1), or all of it.
struct Task {
  std::int64_t unit, c0, c1;
  bool causal;
  std::int64_t part;  // index of the partial result in scratch, or -1: write o directly
};

struct Schedule {
  std::vector<Unit> units;
  std::vector<Task> tasks;
  std::vector<std::int64_t> first_part;  // per unit: its first partial, or -1 if not split
  std::vector<std::int64_t> n_parts;     // per unit
  std::int64_t parts = 0;
};

Schedule schedule(const Problem& p, const Plan& plan) {
  Schedule s;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv = 0; kv < p.kv_heads; ++kv) {
      for (std::int64_t r0 = 0; r0 < p.q_len; r0 += plan.row_block) {
        const std::int64_t rows = std::min(plan.row_block, p.q_len - r0);
        const std::int64_t kv_len = p.causal ? p.kv_len - p.q_len + r0 + rows : p.kv_len;
        s.units.push_back({b, kv, r0, rows, kv_len});
      }
    }
  }
  for (std::int64_t u = 0; u < static_cast<std::int64_t>(s.units.size()); ++u) {
    const Unit& unit = s.units[static_cast<std::size_t>(u)];
    s.first_part.push_back(-1);
    s.n_parts.push_back(0);
    if (unit.kv_len <= 0) continue;  // every row sees no key: the driver writes zeros
    // Keys every row of the unit sees: a chunk ending here or before is not causal.
    const std::int64_t whole = p.causal ? unit.kv_len - unit.rows + 1 : unit.kv_len;
    std::vector<std::int64_t> cuts = {0};
    if (plan.chunks > 1) {
      for (std::int64_t c = plan.chunk; c <= whole && c < unit.kv_len; c += plan.chunk) {
        cuts.push_back(c);
      }
    }
    cuts.push_back(unit.kv_len);
    const std::int64_t n = static_cast<std::int64_t>(cuts.size()) - 1;
    if (n > 1) {
      s.first_part.back() = s.parts;
      s.n_parts.back() = n;
    }
    for (std::int64_t c = 0; c < n; ++c) {
      const bool last = c + 1 == n;
      s.tasks.push_back({u, cuts[static_cast<std::size_t>(c)],
                         cuts[static_cast<std::size_t>(c + 1)], p.causal && last,
                         n > 1 ? s.parts + c : -1});
    }
    if (n > 1) s.parts += n;
  }
  return s;
}

}  // namespace

Plan plan(const Problem& p) {
  Plan plan;
  plan.row_block =
      std::clamp(Plan::kUnitRows / (p.q_heads / p.kv_heads), Plan::kMinRowBlock, Plan::kRowBlock);
  plan.units = p.batch * p.kv_heads * ceil_div(p.q_len, plan.row_block);
  if (plan.units < Plan::kMinUnits && p.kv_len >= 2 * Plan::kChunk) {
    plan.chunk = std::max(Plan::kChunk, ceil_div(ceil_div(p.kv_len, Plan::kMaxChunks), 256) * 256);
    plan.chunks = ceil_div(p.kv_len, plan.chunk);
  }
  return plan;
}

int default_threads() {
  if (const char* env = std::getenv("MHA_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (*end != '\0' || n < 1 || n > 4096) {
      throw std::invalid_argument("MHA_NUM_THREADS=" + std::string(env) +
                                  " is not a positive integer (1..4096)");
    }
    return static_cast<int>(n);
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void parallel_attention(Kernel kernel, const Problem& p, const float* q, const float* k,
                        const float* v, float* o, float* lse, int threads) {
  if (threads <= 0) threads = default_threads();  // NOLINT: read by the num_threads clauses
  const Plan pl = plan(p);
  const Schedule s = schedule(p, pl);
  const std::int64_t g = p.q_heads / p.kv_heads;
  const std::int64_t D = p.head_dim;
  // Partial results: o [row][head][d] and lse [head][row] for every chunk of a split unit,
  // sized for the rows a unit has (decode: one) and left uninitialized: each is written
  // whole by its kernel call before the merge reads it. (Zero-filling row_block rows of
  // every chunk cost 27 ms per call at H = 32, Hkv = 8, Lk = 32768: the decode itself.)
  const std::int64_t unit_rows = std::min(pl.row_block, p.q_len);
  const std::int64_t part_o = unit_rows * g * D, part_lse = unit_rows * g;
  const std::unique_ptr<float[]> scratch_o(new float[static_cast<std::size_t>(s.parts * part_o)]);
  const std::unique_ptr<float[]> scratch_lse(
      new float[static_cast<std::size_t>(s.parts * part_lse)]);

  const auto unit_problem = [&](const Unit& u) {
    Problem up = p;
    up.batch = 1;
    up.q_len = u.rows;
    up.kv_len = u.kv_len;
    up.q_heads = g;
    up.kv_heads = 1;
    return up;
  };
  const auto o_at = [&](const Unit& u) {
    return o + u.b * p.o.batch + u.r0 * p.o.seq + u.kv * g * p.o.head;
  };
  const auto lse_at = [&](const Unit& u) {
    return lse + u.b * p.lse.batch + u.kv * g * p.lse.head + u.r0;
  };

  const auto run_task = [&](std::int64_t t) {
    const Task& task = s.tasks[static_cast<std::size_t>(t)];
    const Unit& u = s.units[static_cast<std::size_t>(task.unit)];
    Problem tp = unit_problem(u);
    tp.kv_len = task.c1 - task.c0;
    tp.causal = task.causal;
    const float* tq = q + u.b * p.q.batch + u.r0 * p.q.seq + u.kv * g * p.q.head;
    const float* tk = k + u.b * p.k.batch + task.c0 * p.k.seq + u.kv * p.k.head;
    const float* tv = v + u.b * p.v.batch + task.c0 * p.v.seq + u.kv * p.v.head;
    if (task.part < 0) {
      kernel(tp, tq, tk, tv, o_at(u), lse != nullptr ? lse_at(u) : nullptr);
    } else {
      tp.o = {0, g * D, D};
      tp.lse = {0, u.rows};
      kernel(tp, tq, tk, tv, scratch_o.get() + task.part * part_o,
             scratch_lse.get() + task.part * part_lse);
    }
  };
  const auto n_tasks = static_cast<std::int64_t>(s.tasks.size());
  if (pl.chunks > 1) {
    // Split KV: chunks of equal work, dealt out the same way every call, so that a thread
    // finds its chunks in its own core's L2 when the KV cache fits there (dynamic dealing
    // can move a chunk to the other core from one call to the next).
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::int64_t t = 0; t < n_tasks; ++t) run_task(t);
  } else {
    // Units of unequal work (causal blocks see different numbers of keys): taken in turn.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (std::int64_t t = 0; t < n_tasks; ++t) run_task(t);
  }

  const auto n_units = static_cast<std::int64_t>(s.units.size());
  // One unit (a decode of one KV head) is merged where it is, without waking the threads.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n_units > 1)
  for (std::int64_t i = 0; i < n_units; ++i) {
    const Unit& u = s.units[static_cast<std::size_t>(i)];
    const Problem up = unit_problem(u);
    if (u.kv_len <= 0) {  // no row of the slice sees a key
      for (std::int64_t r = 0; r < u.rows; ++r) {
        for (std::int64_t h = 0; h < g; ++h) {
          float* row = o_at(u) + r * p.o.seq + h * p.o.head;
          std::fill(row, row + D, 0.0f);
          if (lse != nullptr)
            lse_at(u)[h * p.lse.head + r] = -std::numeric_limits<float>::infinity();
        }
      }
      continue;
    }
    const std::int64_t first = s.first_part[static_cast<std::size_t>(i)];
    if (first < 0) continue;
    const std::int64_t n = s.n_parts[static_cast<std::size_t>(i)];
    std::vector<const float*> os, ls;
    for (std::int64_t c = 0; c < n; ++c) {
      os.push_back(scratch_o.get() + (first + c) * part_o);
      ls.push_back(scratch_lse.get() + (first + c) * part_lse);
    }
    Parts parts;
    parts.count = static_cast<int>(n);
    parts.o = os.data();
    parts.lse = ls.data();
    parts.o_strides = {0, g * D, D};
    parts.lse_strides = {0, u.rows};
    detail::merge_unchecked(up, parts, o_at(u), lse != nullptr ? lse_at(u) : nullptr);
  }
}

}  // namespace mha

// Concurrent use of the library: every output must be the bits of the same call made alone.
//
//   threads         kWorkers std::threads start behind a barrier as the first thing main does,
//                   so that the registry, the cache sizes (support::caches()), the shared
//                   Layer's construction and Highway's dynamic dispatch are first used by
//                   several threads at once. Each runs every job kRounds times, starting at
//                   its own place in the list, so that different problems and kernels run
//                   side by side. Then main runs every job alone and compares.
//   omp-nested-off  every job on every thread of a caller's `#pragma omp parallel` of kTeam
//                   threads, then as tasks of one thread of such a region, with OpenMP's
//                   default of one active level (a nested region gets one thread).
//   omp-nested-on   the same after omp_set_max_active_levels(2), where a nested region of
//                   the caller's own gets its threads (checked).
//
// In the OpenMP modes the library must run each call on the calling thread (mha/parallel.h):
// a kernel wrapped in a spy must see a team of one on the calling thread, and the process
// must never hold more threads than before the regions plus the caller's team (/proc/self/
// status, sampled throughout). The jobs are the same in every mode: mha::attention with its
// own kernel (MHA, GQA split-KV decode, rows that see no key), every registry kernel this CPU
// has by name (GQA causal prefill, MQA split-KV decode), mha::gemm on every GEMM kernel it
// has, one Layer shared by every thread (prefill, then decode steps, each call with its own
// KvCache), a Layer of each call's own, Highway's dynamically dispatched kernel, and the
// driver over the spy. Thread counts 0 (the default) to 4.
//
// Usage: mha_concurrency_test MODE [--timeout=SECONDS]   (default 60)
// Exit status: 0 every output equal and every bound held; 1 something differed or failed
// (each said on stderr); 2 no progress within the timeout: a deadlock.
#include <mha/layer.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(MHA_EXPECT_ARCHER)
#include <link.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// Kernels called directly, declared as a copied kernel's caller declares them: blocked under
// the spy, and the Highway kernel's dynamically dispatched entry point (the registry calls
// its per-target functions instead, so only this job reaches Highway's dispatch tables).
void mha_f32_attention_blocked(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v,
                               float* o, float* lse, mha::Workspace ws);
std::size_t mha_f32_attention_blocked_workspace(const mha::Problem& p);
void mha_f32_attention_highway(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v,
                               float* o, float* lse, mha::Workspace ws);
std::size_t mha_f32_attention_highway_workspace(const mha::Problem& p);

namespace {

constexpr int kWorkers = 6;  // user threads in `threads` mode: 3 per core here
constexpr int kRounds = 8;   // each worker runs every job this many times
constexpr int kTeam = 4;     // the caller's OpenMP team in the OpenMP modes

// Names from the lists themselves, so that building the job list calls nothing of the
// library: its first use is the workers'.
constexpr const char* kKernels[] = {
#define MHA_KERNEL(name, isa, function, exp_ulp, tiled, kv_types) #name,
#include "registry.inc"
#undef MHA_KERNEL
};
constexpr const char* kGemms[] = {
#define MHA_GEMM(name, isa, function) #name,
#include "gemm/gemm.inc"
#undef MHA_GEMM
};

using Floats = std::vector<float>;

long os_thread_id() { return static_cast<long>(syscall(SYS_gettid)); }

// Inputs in [-1, 1) from a seed (xorshift32): the same for a job wherever it runs.
Floats random_floats(std::int64_t n, std::uint32_t seed) {
  Floats x(static_cast<std::size_t>(n));
  std::uint32_t s = seed * 2654435761u | 1u;
  for (float& f : x) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    f = static_cast<float>(s >> 8) / 8388608.0f - 1.0f;
  }
  return x;
}

void append(Floats& to, const float* from, std::int64_t n) { to.insert(to.end(), from, from + n); }

// One call (or a few) of the library. Its outputs one after another; empty when the CPU
// lacks the kernel it names.
struct Job {
  std::string name;
  std::function<Floats()> run;
};

struct Inputs {
  Floats q, k, v;
  explicit Inputs(const mha::Problem& p, std::uint32_t seed)
      : q(random_floats(mha::q_extent(p), seed)),
        k(random_floats(mha::k_extent(p), seed + 1)),
        v(random_floats(mha::v_extent(p), seed + 2)) {}
};

// kernel: a registry name, or "" for mha::attention's own choice (best_kernel()).
Job attention_job(const std::string& what, const std::string& kernel, const mha::Problem& p,
                  bool with_lse, int threads, std::uint32_t seed) {
  return {
      (kernel.empty() ? "best" : kernel) + "/" + what + "/threads:" + std::to_string(threads), [=] {
        if (!kernel.empty()) {
          const mha::KernelInfo* info = mha::find_kernel(kernel);
          if (info == nullptr || !mha::available(*info)) return Floats();
        }
        const Inputs in(p, seed);
        Floats o(static_cast<std::size_t>(mha::o_extent(p)));
        Floats lse(with_lse ? static_cast<std::size_t>(mha::lse_extent(p)) : 0);
        float* l = with_lse ? lse.data() : nullptr;
        if (kernel.empty()) {
          mha::attention(p, in.q.data(), in.k.data(), in.v.data(), o.data(), l, threads);
        } else {
          mha::attention(kernel, p, in.q.data(), in.k.data(), in.v.data(), o.data(), l, threads);
        }
        append(o, lse.data(), static_cast<std::int64_t>(lse.size()));
        return o;
      }};
}

Job gemm_job(const std::string& kernel, std::int64_t m, std::int64_t k, std::int64_t n, int threads,
             std::uint32_t seed) {
  return {"gemm-" + kernel + "/M:" + std::to_string(m) + "/threads:" + std::to_string(threads),
          [=] {
            const mha::GemmInfo* info = mha::find_gemm(kernel);
            if (info == nullptr || !mha::available(*info)) return Floats();
            const Floats a = random_floats(m * k, seed), b = random_floats(k * n, seed + 1);
            const Floats bias = random_floats(n, seed + 2);
            const mha::PackedMatrix packed(*info, k, n, b.data(), n, 1);
            Floats c(static_cast<std::size_t>(m * n));
            mha::gemm(m, a.data(), k, packed, bias.data(), c.data(), n, threads);
            return c;
          }};
}

struct Weights {
  Floats wq, wk, wv, wo, bq, bk, bv, bo;

  Weights(const mha::LayerConfig& c, std::uint32_t seed) {
    const std::int64_t d = c.d_model, hd = c.q_heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
    wq = random_floats(d * hd, seed);
    wk = random_floats(d * kvd, seed + 1);
    wv = random_floats(d * kvd, seed + 2);
    wo = random_floats(hd * d, seed + 3);
    bq = random_floats(hd, seed + 4);
    bk = random_floats(kvd, seed + 5);
    bv = random_floats(kvd, seed + 6);
    bo = random_floats(d, seed + 7);
  }

  mha::LayerWeights view(bool transposed) const {
    return {wq.data(), wk.data(), wv.data(), wo.data(), bq.data(),
            bk.data(), bv.data(), bo.data(), transposed};
  }
};

// A prefill of n tokens, then `steps` decode steps, on a fresh cache of `batch` sequences:
// every y, then the cache's K and V at every position it holds.
Floats run_layer(const mha::Layer& layer, std::int64_t batch, std::int64_t n, std::int64_t steps,
                 int threads, std::uint32_t seed) {
  const mha::LayerConfig& c = layer.config();
  const std::int64_t d = c.d_model, D = c.head_dim;
  mha::KvCache cache(c, batch, n + steps);
  const Floats x = random_floats(batch * n * d, seed);
  Floats out(static_cast<std::size_t>(batch * n * d));
  layer.prefill(x.data(), n, out.data(), cache, true, threads);
  for (std::int64_t s = 0; s < steps; ++s) {
    const Floats xt = random_floats(batch * d, seed + 1 + static_cast<std::uint32_t>(s));
    Floats yt(static_cast<std::size_t>(batch * d));
    layer.decode(xt.data(), yt.data(), cache, threads);
    append(out, yt.data(), batch * d);
  }
  const mha::Strides st = cache.strides();
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t j = 0; j < c.kv_heads; ++j) {
      const std::int64_t at = b * st.batch + j * st.head;
      append(out, cache.k() + at, cache.length() * D);
      append(out, cache.v() + at, cache.length() * D);
    }
  }
  return out;
}

// GQA, d = H D.
constexpr mha::LayerConfig kSharedLayer{64, 4, 2, 16};

// One Layer for every thread. Built by whichever job gets here first while the other threads
// run theirs: its construction (best_gemm(), best_kernel(), packing) is part of what runs
// concurrently, and the threads then share it, each with its own KvCache.
const mha::Layer& shared_layer() {
  static const Weights w(kSharedLayer, 500);
  static const mha::Layer layer(kSharedLayer, w.view(false));
  return layer;
}

Job shared_layer_job(int threads, std::uint32_t seed) {
  return {"layer-shared/prefill+decode/threads:" + std::to_string(threads),
          [=] { return run_layer(shared_layer(), 2, 6, 3, threads, seed); }};
}

// A Layer of the call's own: MQA, PyTorch's weight layout, named kernels.
Job own_layer_job(int threads, std::uint32_t seed) {
  return {"layer-own/prefill+decode/threads:" + std::to_string(threads), [=] {
            const mha::LayerConfig c{48, 6, 1, 8};
            const Weights w(c, seed);
            const mha::Layer layer(c, w.view(true), "portable", "blocked");
            return run_layer(layer, 1, 9, 2, threads, seed + 100);
          }};
}

Job highway_dispatch_job(const mha::Problem& p, std::uint32_t seed) {
  return {"highway-dispatch/mha-prefill", [=] {
            const Inputs in(p, seed);
            Floats o(static_cast<std::size_t>(mha::o_extent(p)));
            Floats lse(static_cast<std::size_t>(mha::lse_extent(p)));
            std::vector<unsigned char> ws(mha_f32_attention_highway_workspace(p));
            mha_f32_attention_highway(p, in.q.data(), in.k.data(), in.v.data(), o.data(),
                                      lse.data(), {ws.data(), ws.size()});
            append(o, lse.data(), static_cast<std::int64_t>(lse.size()));
            return o;
          }};
}

// The spy: blocked, noting the OpenMP team it runs in and whether it runs on the thread that
// called the driver.
thread_local long t_driver_caller = 0;
std::atomic<int> g_widest_team{0};
std::atomic<int> g_calls_elsewhere{0};

void spy_kernel(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                float* lse, mha::Workspace ws) {
  const int team = omp_get_num_threads();
  int widest = g_widest_team.load();
  while (team > widest && !g_widest_team.compare_exchange_weak(widest, team)) {
  }
  if (t_driver_caller != os_thread_id()) g_calls_elsewhere.fetch_add(1);
  mha_f32_attention_blocked(p, q, k, v, o, lse, ws);
}

Job driver_job(const mha::Problem& p, int threads, std::uint32_t seed) {
  return {"driver-spy/threads:" + std::to_string(threads), [=] {
            const Inputs in(p, seed);
            Floats o(static_cast<std::size_t>(mha::o_extent(p)));
            Floats lse(static_cast<std::size_t>(mha::lse_extent(p)));
            std::vector<unsigned char> ws(
                mha::parallel_workspace(mha_f32_attention_blocked_workspace, p, threads));
            t_driver_caller = os_thread_id();
            mha::parallel_attention(spy_kernel, mha_f32_attention_blocked_workspace, p, in.q.data(),
                                    in.k.data(), in.v.data(), o.data(), lse.data(), threads,
                                    {ws.data(), ws.size()});
            append(o, lse.data(), static_cast<std::int64_t>(lse.size()));
            return o;
          }};
}

std::vector<Job> make_jobs() {
  using mha::make_problem;
  constexpr auto token = mha::Layout::token_major;
  constexpr auto head = mha::Layout::head_major;
  std::vector<Job> jobs;
  // The decodes have one or two units and at least 512 keys: the driver splits their keys
  // (mha::plan) and merges the chunks.
  jobs.push_back(attention_job("mha-prefill", "", make_problem(2, 70, 70, 4, 4, 64, false, token),
                               true, 0, 1));
  jobs.push_back(attention_job("gqa-decode-split", "",
                               make_problem(1, 4, 2100, 4, 2, 128, true, head), false, 4, 2));
  jobs.push_back(attention_job("rows-without-keys", "",
                               make_problem(2, 40, 20, 2, 1, 16, true, token), true, 1, 3));
  std::uint32_t seed = 10;
  for (const char* kernel : kKernels) {
    jobs.push_back(attention_job("gqa-causal-prefill", kernel,
                                 make_problem(1, 150, 150, 8, 2, 40, true, head), true, 3, seed));
    jobs.push_back(attention_job("mqa-decode-split", kernel,
                                 make_problem(1, 1, 1300, 8, 1, 64, true, head), true, 2,
                                 seed + 3));
    seed += 6;
  }
  for (const char* gemm : kGemms) {
    jobs.push_back(gemm_job(gemm, 67, 256, 200, 2, seed));
    jobs.push_back(gemm_job(gemm, 1, 200, 130, 0, seed + 3));
    seed += 6;
  }
  jobs.push_back(shared_layer_job(2, 300));
  jobs.push_back(shared_layer_job(0, 310));
  jobs.push_back(own_layer_job(3, 320));
  jobs.push_back(highway_dispatch_job(make_problem(1, 50, 50, 2, 2, 24, false, token), 330));
  jobs.push_back(driver_job(make_problem(1, 3, 1100, 4, 1, 32, true, head), 2, 340));
  return jobs;
}

// What went wrong, from any thread.
class Failures {
 public:
  void add(const std::string& what) {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++count_;
  }
  int count() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return count_;
  }

 private:
  std::mutex mutex_;
  int count_ = 0;
};

Failures failures;

Floats run_job(const Job& job) {
  try {
    return job.run();
  } catch (const std::exception& e) {
    failures.add(job.name + " threw: " + e.what());
  }
  return Floats();
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

void expect_same(const Job& job, const std::string& where, const Floats& got, const Floats& alone) {
  if (got.size() != alone.size()) {
    failures.add(job.name + " (" + where + "): " + std::to_string(got.size()) +
                 " output floats, alone " + std::to_string(alone.size()));
    return;
  }
  std::size_t first = got.size(), differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (bits(got[i]) == bits(alone[i])) continue;
    if (differ++ == 0) first = i;
  }
  if (differ == 0) return;
  char detail[160];
  std::snprintf(detail, sizeof detail, "%zu of %zu floats differ, first [%zu]: %a, alone %a",
                differ, got.size(), first, static_cast<double>(got[first]),
                static_cast<double>(alone[first]));
  failures.add(job.name + " (" + where + "): " + detail);
}

// Every job alone, one after another on the calling thread: what the others must equal.
std::vector<Floats> alone(const std::vector<Job>& jobs) {
  std::vector<Floats> out;
  for (const Job& job : jobs) out.push_back(run_job(job));
  return out;
}

// A barrier for the workers (C++17 has none).
class Gate {
 public:
  explicit Gate(int n) : waiting_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (--waiting_ == 0) {
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return waiting_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int waiting_;
};

// Ends the process with status 2 unless stopped within `seconds`: a deadlock fails the test
// with a message rather than by ctest's timeout.
class Watchdog {
 public:
  explicit Watchdog(int seconds)
      : thread_([this, seconds] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [&] { return stopped_; })) {
            std::fprintf(stderr, "FAILED: no progress after %d s: a deadlock (still running: %s)\n",
                         seconds, stage_.c_str());
            std::fflush(stderr);
            std::_Exit(2);
          }
        }) {}
  ~Watchdog() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void stage(const std::string& what) {
    const std::lock_guard<std::mutex> lock(mutex_);
    stage_ = what;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopped_ = false;
  std::string stage_ = "start";
  std::thread thread_;
};

// The process's threads now (Linux: /proc/self/status).
int os_threads() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "Threads:") {
      int n = 0;
      status >> n;
      return n;
    }
    status.ignore(1 << 16, '\n');
  }
  return -1;
}

// The most threads the process held while it ran, sampled every 100 us: a team that lives as
// long as a kernel call (milliseconds) is seen.
class ThreadSampler {
 public:
  ThreadSampler()
      : thread_([this] {
          while (!stop_.load()) {
            const int n = os_threads();
            if (n > most_.load()) most_.store(n);
            std::this_thread::sleep_for(std::chrono::microseconds(100));
          }
        }) {}
  ~ThreadSampler() { stop(); }
  int stop() {
    if (!stop_.exchange(true)) thread_.join();
    return most_.load();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> most_{0};
  std::thread thread_;
};

int count_unavailable(const std::vector<Floats>& outputs) {
  int n = 0;
  for (const Floats& o : outputs) n += o.empty() ? 1 : 0;
  return n;
}

void run_threads(const std::vector<Job>& jobs, Watchdog& watchdog) {
  const std::size_t n = jobs.size();
  std::vector<std::vector<std::vector<Floats>>> got(
      kWorkers, std::vector<std::vector<Floats>>(kRounds, std::vector<Floats>(n)));
  Gate gate(kWorkers);
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      gate.arrive_and_wait();
      for (int r = 0; r < kRounds; ++r) {
        // Even rounds: the workers spread over the list, different problems side by side.
        // Odd rounds: each one job behind the next, the same kind of call side by side.
        const std::size_t offset = static_cast<std::size_t>(w) * (r % 2 == 0 ? n / kWorkers : 1);
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t j = (i + offset) % n;
          got[w][r][j] = run_job(jobs[j]);
        }
      }
    });
  }
  for (std::thread& t : workers) t.join();
  watchdog.stage("the jobs alone");
  const std::vector<Floats> want = alone(jobs);
  for (int w = 0; w < kWorkers; ++w) {
    for (int r = 0; r < kRounds; ++r) {
      for (std::size_t j = 0; j < n; ++j) {
        expect_same(jobs[j], "worker " + std::to_string(w) + ", round " + std::to_string(r),
                    got[w][r][j], want[j]);
      }
    }
  }
  std::printf("%d threads x %d rounds x %zu jobs (%d need what this CPU lacks): ", kWorkers,
              kRounds, n, count_unavailable(want));
}

void run_openmp(const std::vector<Job>& jobs, bool nested, Watchdog& watchdog) {
  if (nested) omp_set_max_active_levels(2);
  const std::size_t n = jobs.size();
  std::vector<std::vector<Floats>> on_team(kTeam, std::vector<Floats>(n));
  std::vector<Floats> as_tasks(n);
  int team = 0;
  ThreadSampler sampler;
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the sampler's first reading
  const int before = os_threads();
  g_widest_team = 0;
  g_calls_elsewhere = 0;
#pragma omp parallel num_threads(kTeam)
  {
#pragma omp single
    team = omp_get_num_threads();
    const auto t = static_cast<std::size_t>(omp_get_thread_num());
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t j = (i + t * n / kTeam) % n;
      on_team[t][j] = run_job(jobs[j]);
    }
  }
  watchdog.stage("the jobs as tasks");
#pragma omp parallel num_threads(kTeam)
#pragma omp single
  for (std::size_t j = 0; j < n; ++j) {
#pragma omp task firstprivate(j)
    as_tasks[j] = run_job(jobs[j]);
  }
  const int most = sampler.stop();
  const int widest = g_widest_team.load(), elsewhere = g_calls_elsewhere.load();

  // Last, since its threads would count: a nested region of the caller's own gets its
  // threads exactly when nesting is on, so the mode is what it says.
  int own_nested = 0;
#pragma omp parallel num_threads(2)
  {
#pragma omp parallel num_threads(2)
#pragma omp single
    {
#pragma omp atomic write
      own_nested = omp_get_num_threads();
    }
  }
  if (own_nested != (nested ? 2 : 1)) {
    failures.add("a nested region of the caller's own ran on " + std::to_string(own_nested) +
                 " threads, expected " + (nested ? "2 (nesting on)" : "1 (nesting off)"));
  }
  watchdog.stage("the jobs alone");
  const std::vector<Floats> want = alone(jobs);
  for (int t = 0; t < team; ++t) {
    for (std::size_t j = 0; j < n; ++j) {
      expect_same(jobs[j], "team thread " + std::to_string(t), on_team[t][j], want[j]);
    }
  }
  for (std::size_t j = 0; j < n; ++j) expect_same(jobs[j], "task", as_tasks[j], want[j]);
  if (widest != 1 || elsewhere != 0) {
    failures.add("inside the caller's region the driver ran its kernel in a team of up to " +
                 std::to_string(widest) + " threads, " + std::to_string(elsewhere) +
                 " calls on another thread than the caller: expected one team of one");
  }
  // Sampled threads beyond the caller's team: teams the library started. The sampler may
  // miss a short one, but the spy above cannot.
  if (most > before + team - 1) {
    failures.add("the process held up to " + std::to_string(most) + " threads, " +
                 std::to_string(before) + " before the caller's team of " + std::to_string(team) +
                 ": the library started threads of its own");
  }
  std::printf(
      "nesting %s (a nested region of the caller's own: %d threads); a team of %d and its "
      "tasks ran %zu jobs each (%d need what this CPU lacks); the library's kernels ran in "
      "teams of %d on the calling thread; threads %d before, at most %d during: ",
      nested ? "on" : "off", own_nested, team, n, count_unavailable(want), widest, before, most);
}

#if defined(MHA_EXPECT_ARCHER)
// Without Archer (LLVM's OMPT tool) ThreadSanitizer cannot see OpenMP's synchronisation and
// reports races that are not there, or worse, a clean run would have checked nothing real.
bool archer_loaded() {
  bool found = false;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        if (std::strstr(info->dlpi_name, "libarcher") != nullptr) *static_cast<bool*>(data) = true;
        return 0;
      },
      &found);
  return found;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int timeout = 60;
  for (int i = 2; i < argc; ++i) {
    if (std::strncmp(argv[i], "--timeout=", 10) == 0) timeout = std::atoi(argv[i] + 10);
  }
  if ((mode != "threads" && mode != "omp-nested-off" && mode != "omp-nested-on") || timeout < 1) {
    std::fprintf(stderr, "usage: %s threads|omp-nested-off|omp-nested-on [--timeout=SECONDS]\n",
                 argv[0]);
    return 1;
  }
  const std::vector<Job> jobs = make_jobs();  // names and closures: nothing of the library yet
  {
    Watchdog watchdog(timeout);
    watchdog.stage("the concurrent jobs");
    if (mode == "threads") {
      run_threads(jobs, watchdog);
    } else {
      run_openmp(jobs, mode == "omp-nested-on", watchdog);
    }
  }
#if defined(MHA_EXPECT_ARCHER)
  if (!archer_loaded()) {
    failures.add(
        "Archer (libarcher.so) is not loaded: set OMP_TOOL_LIBRARIES to it, or "
        "ThreadSanitizer cannot see OpenMP's synchronisation");
  }
#endif
  const int failed = failures.count();
  std::printf("%s\n", failed == 0 ? "every output equal to the call's alone" : "FAILED");
  return failed == 0 ? 0 : 1;
}

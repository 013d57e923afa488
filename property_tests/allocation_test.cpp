// Allocation counts: with a caller-owned workspace the kernels and the parallel driver
// allocate nothing, and mha::attention allocates nothing in steady state (a call no larger
// than an earlier one on the same thread). Its own executable, because it replaces the
// global operator new and delete to count every allocation of the process.
//
// Counted: every C++ allocation (std::vector, std::string, new). Not counted: malloc called
// directly, which the project's code never does; OpenMP's runtime allocates its thread pool
// that way, once. The same operator new fails on demand (allocation_hooks.h) for
// allocation_failure_test.cpp.
#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include "allocation_hooks.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

namespace {

std::atomic<long> g_allocations{0};
// What allocation_hooks.h sets, per thread: the allocation to fail and the size limit.
thread_local long t_allocations = 0;
thread_local long t_fail_at = -1;
thread_local std::size_t t_limit = std::numeric_limits<std::size_t>::max();

void* counted(std::size_t size, std::size_t align) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (t_allocations++ == t_fail_at || size > t_limit) return nullptr;
  if (size == 0) size = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(size);
  } else if (posix_memalign(&p, align, size) != 0) {
    p = nullptr;
  }
  return p;
}

}  // namespace

namespace mha::test::alloc {
long count() { return t_allocations; }
void fail_at(long n) { t_fail_at = n < 0 ? -1 : t_allocations + n; }
void limit(std::size_t bytes) { t_limit = bytes; }
}  // namespace mha::test::alloc

// The replaceable global allocation functions (the array and nothrow forms of the standard
// library call these).
void* operator new(std::size_t size) {
  void* p = counted(size, 0);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new(std::size_t size, std::align_val_t align) {
  void* p = counted(size, static_cast<std::size_t>(align));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
// GCC sees free() of what a new-expression returned once these are inlined into a caller,
// and warns; here that pairing is the point (operator new above is malloc).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace {

// Allocations made while f runs.
template <typename F>
long allocations(F&& f) {
  const long before = g_allocations.load();
  f();
  return g_allocations.load() - before;
}

// Dense token-major inputs and outputs of one problem, with random values.
struct Buffers {
  mha::Problem p;
  std::vector<float> q, k, v, o, lse;
  explicit Buffers(const mha::Problem& problem) : p(problem) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const auto filled = [&](std::int64_t n) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (float& e : x) e = unit(rng);
      return x;
    };
    q = filled(mha::q_extent(p));
    k = filled(mha::k_extent(p));
    v = filled(mha::v_extent(p));
    o.resize(static_cast<std::size_t>(mha::o_extent(p)));
    lse.resize(static_cast<std::size_t>(mha::lse_extent(p)));
  }
};

// Shapes that take every path of every kernel: prefill (MHA, GQA, causal, a head_dim off
// every vector width), decode (GQA, MQA, long enough for the driver's split-KV) and a
// causal problem with more queries than keys (rows that see nothing).
std::vector<mha::Problem> shapes() {
  return {
      mha::make_problem(1, 300, 300, 4, 4, 128, true),
      mha::make_problem(2, 67, 67, 8, 2, 40, false, mha::Layout::head_major),
      mha::make_problem(1, 1, 4096, 32, 8, 128, true),
      mha::make_problem(1, 1, 3000, 16, 1, 64, false),
      mha::make_problem(1, 40, 17, 6, 3, 24, true),
  };
}

std::string describe(const mha::Problem& p) {
  return "B=" + std::to_string(p.batch) + " Lq=" + std::to_string(p.q_len) +
         " Lk=" + std::to_string(p.kv_len) + " H=" + std::to_string(p.q_heads) +
         " Hkv=" + std::to_string(p.kv_heads) + " D=" + std::to_string(p.head_dim) +
         (p.causal ? " causal" : "");
}

TEST(Allocations, CounterSeesAllocations) {
  // The counter itself: otherwise every 0 below would prove nothing.
  const long n = allocations([] {
    const auto x = std::make_unique<float[]>(100);
    volatile float sink = x[50];  // kept: the allocation may not be elided
    (void)sink;
  });
  EXPECT_EQ(n, 1);
}

TEST(Allocations, KernelWithWorkspaceAllocatesNothing) {
  for (const mha::KernelInfo& kernel : mha::all_kernels()) {
    if (!mha::available(kernel)) continue;
    for (const mha::Problem& p : shapes()) {
      Buffers b(p);
      std::vector<unsigned char> ws(kernel.workspace(p));
      for (int call = 0; call < 3; ++call) {
        const long n = allocations([&] {
          kernel.fn(p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data(),
                    mha::Workspace{ws.data(), ws.size()});
        });
        EXPECT_EQ(n, 0) << kernel.name << " call " << call << ", " << describe(p);
      }
    }
  }
}

TEST(Allocations, DriverWithWorkspaceAllocatesNothing) {
  for (const mha::KernelInfo& kernel : mha::all_kernels()) {
    if (!mha::available(kernel)) continue;
    for (const int threads : {1, 2}) {
      for (const mha::Problem& p : shapes()) {
        Buffers b(p);
        std::vector<unsigned char> ws(mha::parallel_workspace(kernel.workspace, p, threads));
        for (int call = 0; call < 3; ++call) {
          const long n = allocations([&] {
            mha::parallel_attention(kernel.fn, kernel.workspace, p, b.q.data(), b.k.data(),
                                    b.v.data(), b.o.data(), b.lse.data(), threads,
                                    mha::Workspace{ws.data(), ws.size()});
          });
          EXPECT_EQ(n, 0) << kernel.name << " on " << threads << " threads, call " << call << ", "
                          << describe(p);
        }
      }
    }
  }
}

TEST(Allocations, AttentionAllocatesNothingInSteadyState) {
  // Largest first: the thread's workspace grows once, then serves every smaller call.
  std::vector<Buffers> problems;
  for (const mha::Problem& p : shapes()) problems.emplace_back(p);
  for (const int threads : {1, 2}) {
    for (int round = 0; round < 2; ++round) {
      for (Buffers& b : problems) {
        const long n = allocations([&] {
          mha::attention(b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data(),
                         threads);
        });
        if (round > 0) {
          EXPECT_EQ(n, 0) << "mha::attention on " << threads << " threads, " << describe(b.p);
        } else if (threads == 1 && &b == &problems.front()) {
          EXPECT_GT(n, 0) << "the first call grows the thread's workspace: the count sees it";
        }
      }
    }
  }
}

// A kernel's workspace depends on the sizes and never decreases when q_len or kv_len grows:
// the driver sizes one thread's workspace for its largest unit by that rule. Checked for
// the kernels this CPU may run (a _workspace function is compiled with its kernel's ISA
// flags), on shapes of every size and, apart, on tiny ones, where the tiles are smallest
// and a kernel may change paths, with K and V of every KvType the kernel reads (a reduced
// type may take scratch of its own).
void check_workspace_never_shrinks(std::int64_t max_dim, std::int64_t max_len) {
  const std::int64_t kv_heads = *rc::gen::inRange<std::int64_t>(1, 5);
  const std::int64_t group = *rc::gen::inRange<std::int64_t>(1, 17);
  const std::int64_t dim = *rc::gen::inRange<std::int64_t>(1, max_dim + 1);
  const std::int64_t q_len = *rc::gen::inRange<std::int64_t>(1, max_len + 1);
  const std::int64_t kv_len = *rc::gen::inRange<std::int64_t>(1, 8 * max_len + 1);
  const bool causal = *rc::gen::arbitrary<bool>();
  const mha::KvType type =
      *rc::gen::element(mha::KvType::f32, mha::KvType::f16, mha::KvType::bf16, mha::KvType::i8);
  mha::Problem p = mha::make_problem(1, q_len, kv_len, group * kv_heads, kv_heads, dim, causal);
  p.kv_type = type;
  mha::Problem longer = p;
  longer.q_len += *rc::gen::inRange<std::int64_t>(0, max_len + 1);
  longer.kv_len += *rc::gen::inRange<std::int64_t>(0, 8 * max_len + 1);
  for (const mha::KernelInfo& kernel : mha::all_kernels()) {
    if (!mha::available(kernel) || !mha::reads(kernel, type)) continue;
    RC_ASSERT(kernel.workspace(p) <= kernel.workspace(longer));
  }
}

RC_GTEST_PROP(Workspace, NeverShrinksAsLengthsGrow, ()) { check_workspace_never_shrinks(300, 600); }

RC_GTEST_PROP(Workspace, NeverShrinksAsLengthsGrowOnTinyShapes, ()) {
  check_workspace_never_shrinks(4, 20);
}

}  // namespace

// Running out of memory. Every allocation a call can make (mha::attention's driver
// workspace, mha::gemm's packed A, a PackedMatrix, mha::merge's row, the layer's packed
// weights, its scratch, a KV cache) fails in turn, on a thread whose scratch starts empty,
// and the call must throw mha::AllocationError, whose message names the call, what it
// needed and how many bytes, before writing anything: outputs in guarded buffers bit for
// bit as they were, a KV cache's length and rows too. Then the same call on the same
// thread, memory back, must give the right result. Huge but valid problems (a broadcast KV
// cache of 2^40 or 2^62 keys, a cache or a weight of terabytes) fail the same way, under a
// per-thread size limit and, natively, under a real address-space limit (RLIMIT_AS).
//
// In the allocation test executable, whose operator new fails on demand
// (allocation_hooks.h); not under the sanitizers, which replace operator new.
#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/layer.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocation_hooks.h"
#include "buffers.h"

namespace mha::test {
namespace {

constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

// f on a new thread, whose thread_local scratch (mha::attention's workspace, mha::gemm's
// packed A, the layer's) starts empty.
template <typename F>
void on_new_thread(F&& f) {
  std::thread t(std::forward<F>(f));
  t.join();
}

// An output in a guarded buffer (buffers.h: guard zones and the tensor filled with one NaN
// pattern), and its bits as they were made, so that any write shows.
class Filled {
 public:
  explicit Filled(std::int64_t n) : buffer_(n, 3), before_(buffer_.snapshot()) {}
  float* data() { return buffer_.data(); }
  bool untouched() const { return buffer_.same_as(before_); }
  std::vector<std::uint32_t> bits() const {
    const std::vector<float> all = buffer_.snapshot();
    std::vector<std::uint32_t> b(all.size());
    std::memcpy(b.data(), all.data(), all.size() * sizeof(float));
    return b;
  }

 private:
  Guarded buffer_;
  std::vector<float> before_;
};

std::vector<float> random(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& e : x) e = unit(rng);
  return x;
}

using Bits = std::vector<std::uint32_t>;
Bits bits_of(const float* x, std::size_t n) {
  Bits b(n);
  std::memcpy(b.data(), x, n * sizeof(float));
  return b;
}
void append(Bits& to, const Bits& more) { to.insert(to.end(), more.begin(), more.end()); }
// Bytes as Bits, the last word padded with zeros.
Bits bits_of_bytes(const void* x, std::size_t bytes) {
  Bits b((bytes + 3) / 4, 0);
  std::memcpy(b.data(), x, bytes);
  return b;
}

constexpr KvType kKvTypes[] = {KvType::f32, KvType::f16, KvType::bf16, KvType::i8};

// Which allocations of a call fail: the at-th (0: the first), and any above `limit` bytes.
struct Failing {
  long at = -1;
  std::size_t limit = kNoLimit;
};

// Why call(), with `failing` armed on this thread for exactly its duration, did not throw an
// AllocationError saying "<where>: out of memory: cannot allocate <n> bytes for <what>" (or
// "<what> needs more bytes than a size_t counts") for one of `wheres`, or "".
std::string allocation_failure(const std::function<void()>& call,
                               const std::vector<std::string>& wheres, Failing failing) {
  const auto disarm = [] {
    alloc::fail_at(-1);
    alloc::limit(kNoLimit);
  };
  try {
    alloc::fail_at(failing.at);
    alloc::limit(failing.limit);
    call();
    disarm();
  } catch (const AllocationError& e) {
    disarm();
    const std::string m = e.what();
    const std::string bytes = "cannot allocate " + std::to_string(e.bytes()) + " bytes for ";
    const std::string too_many = " needs more bytes than a size_t counts";
    for (const std::string& where : wheres) {
      const std::string start = where + ": out of memory: ";
      if (m.rfind(start, 0) != 0) continue;
      const std::string rest = m.substr(start.size());
      // The bytes and what they were for, or what could not even be counted.
      if (e.bytes() != kNoLimit && rest.rfind(bytes, 0) == 0 && rest.size() > bytes.size()) {
        return "";
      }
      if (e.bytes() == kNoLimit && rest.size() > too_many.size() &&
          rest.compare(rest.size() - too_many.size(), too_many.size(), too_many) == 0) {
        return "";
      }
    }
    return "the message does not say where, what and how many bytes: \"" + m + "\"";
  } catch (const std::exception& e) {
    disarm();
    return std::string("not an AllocationError: ") + e.what();
  }
  return "no exception";
}

// A call under test: prepare() makes fresh inputs and outputs (allocating freely), call()
// is the call, untouched() is "" while the outputs are as prepare() left them, and
// outputs() the bits a successful call wrote.
struct Subject {
  std::vector<std::string> where;  // what the message may start with
  std::function<void()> prepare;
  std::function<void()> call;
  std::function<std::string()> untouched;
  std::function<Bits()> outputs;
};

// Every allocation of s.call() fails in turn, each on a new thread.
void expect_each_allocation_failure_clean(const Subject& s) {
  long count = 0;
  Bits expected;
  // Tables the process makes once, on first use (the registry's lists, the cache sizes read
  // from sysfs), are not the call's: made here, on a thread of their own.
  on_new_thread([&] {
    s.prepare();
    s.call();
  });
  on_new_thread([&] {
    s.prepare();
    const long before = alloc::count();
    s.call();
    count = alloc::count() - before;
    expected = s.outputs();
  });
  ASSERT_GT(count, 0) << s.where[0] << " allocates nothing on a new thread: nothing was tested";
  for (long i = 0; i < count; ++i) {
    on_new_thread([&] {
      s.prepare();
      const std::string why = allocation_failure(s.call, s.where, {i});
      EXPECT_EQ(why, "") << s.where[0] << ", allocation " << i << " of " << count << " failing";
      EXPECT_EQ(s.untouched(), "") << s.where[0] << ", allocation " << i << " of " << count
                                   << " failing: outputs written before the exception";
      s.prepare();
      EXPECT_NO_THROW(s.call()) << s.where[0] << " after allocation " << i << " failed";
      EXPECT_TRUE(s.outputs() == expected) << s.where[0] << " after allocation " << i << " failed";
    });
  }
}

constexpr int kThreads = 2;

TEST(AllocationFailure, Attention) {
  const Problem p = make_problem(1, 40, 40, 4, 2, 24, true);
  const std::vector<float> q = random(q_extent(p), 1), k = random(k_extent(p), 2),
                           v = random(v_extent(p), 3);
  std::optional<Filled> o, lse;
  expect_each_allocation_failure_clean(
      {{"mha::attention"},
       [&] {
         o.emplace(o_extent(p));
         lse.emplace(lse_extent(p));
       },
       [&] { attention(p, q.data(), k.data(), v.data(), o->data(), lse->data(), kThreads); },
       [&] { return o->untouched() && lse->untouched() ? "" : "o or lse written"; },
       [&] {
         Bits b = o->bits();
         append(b, lse->bits());
         return b;
       }});
}

TEST(AllocationFailure, Gemm) {
  const std::int64_t m = 50, n = 70, k = 33;
  const std::vector<float> a = random(m * k, 4), b = random(k * n, 5), bias = random(n, 6);
  const PackedMatrix packed(best_gemm(), k, n, b.data(), n, 1);
  std::optional<Filled> c;
  expect_each_allocation_failure_clean(
      {{"mha::gemm"},
       [&] { c.emplace(m * n); },
       [&] { gemm(m, a.data(), k, packed, bias.data(), c->data(), n, kThreads); },
       [&] { return c->untouched() ? "" : "c written"; },
       [&] { return c->bits(); }});
}

TEST(AllocationFailure, PackedMatrix) {
  const std::int64_t k = 33, n = 70;
  const std::vector<float> b = random(k * n, 7);
  std::optional<PackedMatrix> packed;
  expect_each_allocation_failure_clean(
      {{"PackedMatrix"},
       [&] { packed.reset(); },
       [&] { packed.emplace(best_gemm(), k, n, b.data(), n, 1); },
       [] { return ""; },
       [&] {
         return bits_of(packed->data(),
                        static_cast<std::size_t>(packed_floats(n, k, packed->tile().nr)));
       }});
}

TEST(AllocationFailure, Merge) {
  const Problem p = make_problem(1, 3, 8, 2, 2, 16, false);
  const std::vector<float> o0 = random(o_extent(p), 8), o1 = random(o_extent(p), 9);
  const std::vector<float> lse0 = random(lse_extent(p), 10), lse1 = random(lse_extent(p), 11);
  const float* parts_o[] = {o0.data(), o1.data()};
  const float* parts_lse[] = {lse0.data(), lse1.data()};
  const Parts parts{2, parts_o, parts_lse, p.o, p.lse};
  std::optional<Filled> o, lse;
  expect_each_allocation_failure_clean(
      {{"mha::merge"},
       [&] {
         o.emplace(o_extent(p));
         lse.emplace(lse_extent(p));
       },
       [&] { merge(p, parts, o->data(), lse->data()); },
       [&] { return o->untouched() && lse->untouched() ? "" : "o or lse written"; },
       [&] {
         Bits b = o->bits();
         append(b, lse->bits());
         return b;
       }});
}

// A small layer with biases and GQA, and its inputs.
struct Model {
  LayerConfig c{32, 4, 2, 8};
  std::int64_t hd = 32, kvd = 16;
  std::vector<float> wq = random(32 * 32, 20), wk = random(32 * 16, 21), wv = random(32 * 16, 22),
                     wo = random(32 * 32, 23), bq = random(32, 24), bk = random(16, 25),
                     bv = random(16, 26), bo = random(32, 27);
  LayerWeights weights() const {
    return {wq.data(), wk.data(), wv.data(), wo.data(), bq.data(),
            bk.data(), bv.data(), bo.data(), false};
  }
};

TEST(AllocationFailure, LayerAndKvCache) {
  const Model model;
  std::optional<Layer> layer;
  expect_each_allocation_failure_clean({{"Layer"},
                                        [&] { layer.reset(); },
                                        [&] { layer.emplace(model.c, model.weights()); },
                                        [] { return ""; },
                                        [] { return Bits(); }});
  std::optional<KvCache> cache;
  for (KvType t : kKvTypes) {  // i8 allocates its scales too
    expect_each_allocation_failure_clean({{"KvCache"},
                                          [&] { cache.reset(); },
                                          [&] { cache.emplace(model.c, 2, 16, t); },
                                          [] { return ""; },
                                          [] { return Bits(); }});
  }
}

// prefill and decode on a cache of each KvType that holds a past of 3 tokens (a reduced
// type's projections go through a scratch of their own), and forward: y, the cache's length
// and every element of its K and V (and i8's scales) as they were when an allocation fails.
TEST(AllocationFailure, LayerCalls) {
  const Model model;
  const Layer layer(model.c, model.weights());
  constexpr std::int64_t kBatch = 2, kCapacity = 16, kPast = 3, kNew = 5;
  const std::int64_t d = model.c.d_model;
  const std::int64_t cache_rows = kBatch * model.c.kv_heads * kCapacity;
  const std::vector<float> past_k = random(kBatch * model.kvd * kPast, 30),
                           past_v = random(kBatch * model.kvd * kPast, 31),
                           x = random(kBatch * kNew * d, 32);
  std::optional<KvCache> cache;
  std::optional<Filled> y;
  Bits cache_before;
  KvType type = KvType::f32;
  const auto cache_bits = [&] {
    const auto bytes =
        static_cast<std::size_t>(cache_rows * model.c.head_dim) * kv_type_bytes(type);
    Bits b = bits_of_bytes(cache->k_view().data, bytes);
    append(b, bits_of_bytes(cache->v_view().data, bytes));
    if (type == KvType::i8) {
      append(b, bits_of(cache->k_view().scale, static_cast<std::size_t>(cache_rows)));
      append(b, bits_of(cache->v_view().scale, static_cast<std::size_t>(cache_rows)));
    }
    return b;
  };
  // Prefill and decode on fp32 and i8, one of them on f16 and bf16 (the same path).
  for (const auto& run : {std::pair{KvType::f32, kNew}, std::pair{KvType::f32, std::int64_t{1}},
                          std::pair{KvType::f16, kNew}, std::pair{KvType::bf16, std::int64_t{1}},
                          std::pair{KvType::i8, kNew}, std::pair{KvType::i8, std::int64_t{1}}}) {
    type = run.first;
    const std::int64_t n = run.second;
    const auto prepare = [&] {
      cache.emplace(model.c, kBatch, kCapacity, type);
      cache->append(past_k.data(), past_v.data(), kPast);
      cache_before = cache_bits();
      y.emplace(kBatch * n * d);
    };
    const auto untouched = [&]() -> std::string {
      if (!y->untouched()) return "y written";
      if (cache->length() != kPast) return "the cache's length changed";
      return cache_bits() == cache_before ? "" : "the cache's K or V changed";
    };
    const auto outputs = [&] {
      Bits b = y->bits();
      append(b, cache_bits());
      return b;
    };
    if (n == 1) {
      expect_each_allocation_failure_clean(
          {{"Layer::prefill"},
           prepare,
           [&] { layer.decode(x.data(), y->data(), *cache, kThreads); },
           untouched,
           outputs});
    } else {
      expect_each_allocation_failure_clean(
          {{"Layer::prefill"},
           prepare,
           [&] { layer.prefill(x.data(), n, y->data(), *cache, true, kThreads); },
           untouched,
           outputs});
    }
  }
  // forward's own cache first, then prefill's scratch.
  expect_each_allocation_failure_clean(
      {{"KvCache", "Layer::prefill"},
       [&] { y.emplace(kBatch * kNew * d); },
       [&] { layer.forward(x.data(), kBatch, kNew, y->data(), true, kThreads); },
       [&] { return y->untouched() ? "" : "y written"; },
       [&] { return y->bits(); }});
}

// After a call that could not grow the thread's scratch, a call that fits what the thread
// had before works: no size outlives the memory it described.
TEST(AllocationFailure, ScratchRecoversAfterAFailedGrowth) {
  const Problem small = make_problem(1, 8, 8, 2, 2, 16, true);
  const Problem large = make_problem(1, 300, 300, 4, 4, 64, true);
  const std::vector<float> q = random(q_extent(large), 40), k = random(k_extent(large), 41),
                           v = random(v_extent(large), 42);
  const auto run = [&](const Problem& p, Filled& o) {
    attention(p, q.data(), k.data(), v.data(), o.data(), nullptr, 1);
  };
  Filled expected(o_extent(small));
  on_new_thread([&] { run(small, expected); });
  on_new_thread([&] {
    Filled o(o_extent(small)), o_large(o_extent(large));
    run(small, o);
    EXPECT_EQ(allocation_failure([&] { run(large, o_large); }, {"mha::attention"}, {0}), "");
    EXPECT_TRUE(o_large.untouched());
    Filled again(o_extent(small));
    run(small, again);
    EXPECT_TRUE(again.bits() == expected.bits());
  });
}

// A decode over a broadcast KV cache (sequence stride 0) of `keys` keys: valid, with
// inputs of a few floats, and a naive workspace of 4 bytes a key.
struct Broadcast {
  Problem p;
  std::vector<float> q = random(4, 50), k = random(4, 51), v = random(4, 52);
  explicit Broadcast(std::int64_t keys) : p(make_problem(1, 1, keys, 1, 1, 4, false)) {
    p.k = p.v = {0, 0, 0};
  }
};

// As an address space of 1 GiB would.
const Failing kOneGiB{-1, std::size_t{1} << 30};

TEST(AllocationFailure, HugeProblems) {
  const KernelInfo& naive = *find_kernel("naive");
  for (const std::int64_t keys : {std::int64_t{1} << 40, std::int64_t{1} << 62}) {
    const Broadcast in(keys);
    ASSERT_EQ(check(in.p), "");
    const std::size_t bytes = parallel_workspace(naive.workspace, in.p, 1);
    // 2^62 keys need 2^64 bytes: saturated, never wrapped round to a small size.
    EXPECT_EQ(bytes == kNoLimit, keys == std::int64_t{1} << 62) << bytes;
    EXPECT_GE(bytes, 4 * static_cast<std::size_t>(keys));
    on_new_thread([&] {
      Filled o(4), lse(1);
      EXPECT_EQ(allocation_failure(
                    [&] {
                      attention("naive", in.p, in.q.data(), in.k.data(), in.v.data(), o.data(),
                                lse.data(), 1);
                    },
                    {"mha::attention"}, kOneGiB),
                "");
      EXPECT_TRUE(o.untouched() && lse.untouched());
    });
  }
  const Model model;
  EXPECT_EQ(allocation_failure([&] { KvCache cache(model.c, 1, std::int64_t{1} << 40); },
                               {"KvCache"}, kOneGiB),
            "");
  const float b = 1.0f;  // a weight of 2^40 equal elements: strides 0
  EXPECT_EQ(allocation_failure(
                [&] {
                  PackedMatrix m(best_gemm(), std::int64_t{1} << 20, std::int64_t{1} << 20, &b, 0,
                                 0);
                },
                {"PackedMatrix"}, kOneGiB),
            "");
}

// The same through the C library's allocator under a real address-space limit: the
// process may map at most 256 MiB more, and the naive workspace of a decode over 2^31
// broadcast keys is 8 GiB. Skipped where the limit does not bind (an emulator that
// reserved its address space up front).
TEST(AllocationFailure, AddressSpaceLimit) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &before), 0);
  long pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  if (pages <= 0) GTEST_SKIP() << "/proc/self/statm unreadable";
  const rlim_t mapped = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
  rlimit limited = before;
  limited.rlim_cur = mapped + (rlim_t{256} << 20);
  if (before.rlim_cur != RLIM_INFINITY && before.rlim_cur < limited.rlim_cur) {
    GTEST_SKIP() << "the address space is limited already";
  }
  ASSERT_EQ(setrlimit(RLIMIT_AS, &limited), 0);
  void* probe = std::malloc(std::size_t{1} << 30);
  std::string why = "skipped";
  const Broadcast in(std::int64_t{1} << 31);
  Filled o(4), lse(1);
  if (probe == nullptr) {
    why = allocation_failure(
        [&] {
          attention("naive", in.p, in.q.data(), in.k.data(), in.v.data(), o.data(), lse.data(), 1);
        },
        {"mha::attention"}, {});
  }
  std::free(probe);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &before), 0);
  if (probe != nullptr) GTEST_SKIP() << "RLIMIT_AS does not bind here";
  EXPECT_EQ(why, "");
  EXPECT_TRUE(o.untouched() && lse.untouched());
}

}  // namespace
}  // namespace mha::test

// Bad input: every rule of mha::check and of the public entry point, each with its own
// message, and a property that check() itself never misbehaves on arbitrary fields.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <mha/support.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "run.h"

namespace mha::test {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

Problem valid() { return make_problem(2, 5, 7, 4, 2, 8, true); }

TEST(Check, AcceptsTheLayoutHelpers) {
  EXPECT_EQ(check(valid()), "");
  EXPECT_EQ(check(make_problem(1, 1, 1, 1, 1, 1)), "");
  EXPECT_EQ(check(make_problem(3, 9, 4, 12, 3, 33, true, Layout::head_major)), "");
}

TEST(Check, LayoutHelpersSetDefaults) {
  const Problem p = make_problem(2, 3, 5, 4, 2, 16, false, Layout::head_major);
  EXPECT_FLOAT_EQ(p.scale, 0.25f);
  EXPECT_EQ(p.q.head, 3 * 16);
  EXPECT_EQ(p.k.seq, 16);
  EXPECT_EQ(p.k.batch, 2 * 5 * 16);
  EXPECT_EQ(p.lse.head, 3);
  EXPECT_EQ(p.lse.batch, 12);
  const Problem t = make_problem(2, 3, 5, 4, 2, 16);
  EXPECT_EQ(t.q.seq, 4 * 16);
  EXPECT_EQ(t.k.head, 16);
}

TEST(Check, SizesMustBePositive) {
  struct Case {
    std::int64_t Problem::*field;
    const char* message;
  } cases[] = {{&Problem::batch, "batch (0) must be positive"},
               {&Problem::q_len, "q_len (0) must be positive"},
               {&Problem::kv_len, "kv_len (0) must be positive"},
               {&Problem::q_heads, "q_heads (0) must be positive"},
               {&Problem::kv_heads, "kv_heads (0) must be positive"},
               {&Problem::head_dim, "head_dim (0) must be positive"}};
  for (const Case& c : cases) {
    Problem p = valid();
    p.*c.field = 0;
    EXPECT_EQ(check(p), c.message);
  }
  Problem p = valid();
  p.kv_len = -3;
  EXPECT_EQ(check(p), "kv_len (-3) must be positive");
}

TEST(Check, HeadsMustDivide) {
  Problem p = make_problem(1, 4, 4, 12, 5, 8);
  EXPECT_EQ(check(p), "q_heads (12) must be a multiple of kv_heads (5)");
  p = make_problem(1, 4, 4, 2, 4, 8);
  EXPECT_EQ(check(p), "q_heads (2) must be a multiple of kv_heads (4)");
}

TEST(Check, ScaleMustBeFiniteAndNonZero) {
  for (float bad :
       {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    Problem p = valid();
    p.scale = bad;
    EXPECT_THAT(check(p), HasSubstr("must be finite and non-zero")) << bad;
    EXPECT_THAT(check(p), HasSubstr("scale (")) << bad;
  }
  Problem p = valid();
  p.scale = -0.5f;  // legal: a negative scale is a valid (if unusual) attention
  EXPECT_EQ(check(p), "");
}

TEST(Check, SinksAreFiniteOrMinusInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> sinks = {0.5f, -inf, -1e30f, 3.0f};  // one per query head (4)
  Problem p = valid();
  p.sinks = sinks.data();
  EXPECT_EQ(check(p), "");
  sinks[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(check(p), "sinks[2] (nan) must be finite or -inf");
  sinks[2] = 0.0f;
  sinks[3] = inf;
  EXPECT_EQ(check(p), "sinks[3] (inf) must be finite or -inf");
}

TEST(Check, WindowIsNotNegative) {
  Problem p = valid();  // kv_len 7
  for (const std::int64_t window : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, kMax}) {
    p.window = window;
    EXPECT_EQ(check(p), "") << window;
  }
  p.window = -1;
  EXPECT_EQ(check(p), "window (-1) must be >= 0 (0: no sliding window)");
  p.window = std::numeric_limits<std::int64_t>::min();
  EXPECT_EQ(check(p),
            "window (" + std::to_string(p.window) + ") must be >= 0 (0: no sliding window)");
}

TEST(Check, SoftcapIsNoneOrWithinItsRange) {
  Problem p = valid();
  const float inf = std::numeric_limits<float>::infinity();
  for (const float cap : {0.0f, inf, 0x1p-126f, 0.5f, 50.0f, 0x1p120f}) {
    p.softcap = cap;
    EXPECT_EQ(check(p), "") << cap;
  }
  const std::string range = ") must be 0 or +inf (none), or within [2^-126, 2^120]";
  p.softcap = -1.0f;
  EXPECT_EQ(check(p), "softcap (-1" + range);
  p.softcap = -inf;
  EXPECT_EQ(check(p), "softcap (-inf" + range);
  p.softcap = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(check(p), "softcap (nan" + range);
  p.softcap = 0x1p-127f;  // its 1 / c would overflow in base 2
  EXPECT_EQ(check(p), "softcap (5.87747e-39" + range);
  p.softcap = 0x1p121f;
  EXPECT_EQ(check(p), "softcap (2.65846e+36" + range);
  p.softcap = -0.0f;  // zero either way: none
  EXPECT_EQ(check(p), "");
}

TEST(Check, AlibiSlopesAndOffsetAreWithinTheirRanges) {
  Problem p = valid();  // q_heads 4
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> slopes = {0.0f, 0.5f, 0x1p-149f, 0x1p32f};
  p.alibi = slopes.data();
  EXPECT_EQ(check(p), "");
  const std::string range = ") must be within [0, 2^32]";
  slopes[2] = -0.0f;  // zero either way
  EXPECT_EQ(check(p), "");
  slopes[2] = -0x1p-149f;
  EXPECT_EQ(check(p), "alibi[2] (-1.4013e-45" + range);
  slopes[2] = 0.0f;
  slopes[3] = 0x1.000002p32f;
  EXPECT_EQ(check(p), "alibi[3] (4.29497e+09" + range);
  slopes[3] = inf;
  EXPECT_EQ(check(p), "alibi[3] (inf" + range);
  slopes[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(check(p), "alibi[3] (nan" + range);
  slopes[3] = 1.0f;
  for (const std::int64_t offset : {std::int64_t{1} << 62, -(std::int64_t{1} << 62)}) {
    p.alibi_offset = offset;
    EXPECT_EQ(check(p), "") << offset;
  }
  p.alibi_offset = (std::int64_t{1} << 62) + 1;
  EXPECT_EQ(check(p), "alibi_offset (4611686018427387905) must be within [-2^62, 2^62]");
  p.alibi_offset = std::numeric_limits<std::int64_t>::min();
  EXPECT_EQ(check(p), "alibi_offset (-9223372036854775808) must be within [-2^62, 2^62]");
  p.alibi = nullptr;  // the offset is unused without slopes
  EXPECT_EQ(check(p), "");
}

TEST(Check, SequenceLengthsAreWithinTheTensors) {
  Problem p = valid();  // batch 2, q_len 5, kv_len 7
  std::vector<std::int64_t> q_lens = {0, 5}, kv_lens = {7, 0};
  p.q_lens = q_lens.data();
  p.kv_lens = kv_lens.data();
  EXPECT_EQ(check(p), "");
  q_lens[1] = 6;
  EXPECT_EQ(check(p), "q_lens[1] (6) must be within [0, q_len 5]");
  q_lens[1] = 1;
  kv_lens[0] = -1;
  EXPECT_EQ(check(p), "kv_lens[0] (-1) must be within [0, kv_len 7]");
  kv_lens[0] = kMax;
  EXPECT_EQ(check(p), "kv_lens[0] (" + std::to_string(kMax) + ") must be within [0, kv_len 7]");
  p.kv_lens = nullptr;  // either array alone
  EXPECT_EQ(check(p), "");
}

TEST(Check, StridesMustNotBeNegative) {
  Problem p = valid();
  p.k.seq = -1;
  EXPECT_EQ(check(p), "k.seq stride (-1) must be >= 0");
  p = valid();
  p.q.batch = -40;
  EXPECT_EQ(check(p), "q.batch stride (-40) must be >= 0");
  p = valid();
  p.o.head = -8;
  EXPECT_EQ(check(p), "o.head stride (-8) must be >= 0");
  p = valid();
  p.lse.head = -1;
  EXPECT_THAT(check(p), HasSubstr("lse strides {batch 20, head -1} must be >= 0"));
}

TEST(Check, InputsMayBroadcastButOutputsMayNotOverlap) {
  Problem p = valid();
  p.k.batch = p.v.batch = 0;  // one KV for every batch element
  p.q.head = 0;               // every head reads the same query
  EXPECT_EQ(check(p), "");

  p = valid();
  p.o.seq = 0;
  EXPECT_THAT(check(p), HasSubstr("o strides {batch 160, seq 0, head 8} make o overlap itself"));
  p = valid();
  p.o.head = 4;  // heads 8 wide, 4 apart
  EXPECT_THAT(check(p), HasSubstr("make o overlap itself"));
  p = valid();
  p.o.batch = p.o.seq;  // batch 1 starts at query row 1
  EXPECT_THAT(check(p), HasSubstr("make o overlap itself"));

  p = valid();
  p.lse.head = 2;  // rows of 5 floats, 2 apart
  EXPECT_THAT(check(p), HasSubstr("make lse overlap itself"));

  p = valid();  // padded strides are fine
  p.o.head = 9;
  p.o.seq = 4 * 9 + 3;
  p.o.batch = 5 * p.o.seq + 1;
  p.lse.head = 6;
  p.lse.batch = 30;
  EXPECT_EQ(check(p), "");
}

TEST(Check, OffsetsMustFitInt64) {
  Problem p = valid();
  p.q.batch = kMax / 2;
  EXPECT_THAT(check(p), HasSubstr("highest offset of q overflows int64_t"));
  p = valid();
  p.v.seq = kMax / 8;  // fits in elements, not in bytes
  EXPECT_THAT(check(p), HasSubstr("highest offset of v overflows int64_t"));
  // Sizes whose dense strides overflow: the layout helpers saturate, check() reports it.
  p = make_problem(1, std::int64_t{1} << 42, std::int64_t{1} << 42, 1, 1, 1 << 20);
  EXPECT_THAT(check(p), HasSubstr("overflows int64_t"));
  p = valid();
  p.lse.batch = kMax;
  EXPECT_THAT(check(p), HasSubstr("highest offset of lse overflows int64_t"));
}

// check() is total: on arbitrary field values it returns a message or accepts, and when it
// accepts, every offset the kernels compute fits (UBSan would report an overflow).
TEST(Check, NeverMisbehavesOnArbitraryFields) {
  const auto field = [] {
    return rc::gen::oneOf(
        rc::gen::inRange<std::int64_t>(-3, 40),
        rc::gen::elementOf(std::vector<std::int64_t>{
            kMax, kMax / 2, kMax / 4 + 1, std::numeric_limits<std::int64_t>::min(),
            std::int64_t{1} << 31, std::int64_t{1} << 62}));
  };
  check_property([&] {
    Problem p;
    p.batch = *field();
    p.q_len = *field();
    p.kv_len = *field();
    p.q_heads = *field();
    p.kv_heads = *field();
    p.head_dim = *field();
    p.scale = *rc::gen::elementOf(std::vector<float>{1.0f, -2.0f, 0.0f, NAN, INFINITY});
    for (Strides* s : {&p.q, &p.k, &p.v, &p.o}) {
      s->batch = *field();
      s->seq = *field();
      s->head = *field();
    }
    p.lse.batch = *field();
    p.lse.head = *field();
    const std::string message = check(p);
    if (message.empty()) {
      RC_ASSERT(q_extent(p) > 0);
      RC_ASSERT(o_extent(p) <= kMax / 4);
      RC_ASSERT(lse_extent(p) > 0);
    }
  });
}

// The tensors of valid(), in one allocation, in the order q, k, v, o, lse, each followed by
// a gap as long as the longest of them: a pointer a few elements into one tensor then
// overlaps that tensor and no other, whatever the heap does (as separate vectors, v + 3
// overlapped q too whenever the allocator had placed q right after v).
struct Buffers {
  struct Tensor {
    float* at;
    std::size_t size;
    float* data() const { return at; }
    float* begin() const { return at; }
    float* end() const { return at + size; }
  };
  Problem p = valid();
  std::size_t gap = static_cast<std::size_t>(
      std::max({q_extent(p), k_extent(p), v_extent(p), o_extent(p), lse_extent(p)}));
  std::vector<float> storage = std::vector<float>(10 * gap, 0.0f);
  Tensor q = place(0, q_extent(p), 0.5f);
  Tensor k = place(1, k_extent(p), 0.25f);
  Tensor v = place(2, v_extent(p), 1.0f);
  Tensor o = place(3, o_extent(p), 0.0f);
  Tensor lse = place(4, lse_extent(p), 0.0f);

  Tensor place(std::size_t index, std::int64_t extent, float value) {
    const Tensor t{storage.data() + 2 * index * gap, static_cast<std::size_t>(extent)};
    std::fill(t.begin(), t.end(), value);
    return t;
  }
};

TEST(EntryPoint, RunsTheBestKernel) {
  Buffers b;
  attention(b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data());
  for (float x : b.o) EXPECT_FLOAT_EQ(x, 1.0f);                    // constant v
  attention(b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data());  // lse is optional
}

TEST(EntryPoint, RejectsNullPointers) {
  Buffers b;
  EXPECT_EQ(check_call(b.p, nullptr, b.k.data(), b.v.data(), b.o.data(), nullptr),
            "q must not be null");
  EXPECT_EQ(check_call(b.p, b.q.data(), nullptr, b.v.data(), b.o.data(), nullptr),
            "k must not be null");
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), nullptr, b.o.data(), nullptr),
            "v must not be null");
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), b.v.data(), nullptr, nullptr),
            "o must not be null");
  try {
    attention(b.p, b.q.data(), b.k.data(), b.v.data(), nullptr);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "mha::attention: o must not be null");
  }
}

TEST(EntryPoint, RejectsOutputsOverlappingInputs) {
  Buffers b;
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), b.v.data(), b.q.data(), nullptr),
            "o overlaps q: outputs must not share memory with inputs");
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), b.v.data(), b.v.data() + 3, nullptr),
            "o overlaps v: outputs must not share memory with inputs");
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.k.data() + 1),
            "lse overlaps k: outputs must not share memory with inputs");
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.o.data() + 5),
            "lse overlaps o: outputs must not share memory");
  // The sinks and the sequences' lengths are inputs too.
  Problem p = b.p;
  p.sinks = b.o.data() + 1;
  EXPECT_EQ(check_call(p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), nullptr),
            "o overlaps sinks: outputs must not share memory with inputs");
  p = b.p;
  std::vector<float> zeros(static_cast<std::size_t>(p.q_heads), 0.0f);
  p.alibi = b.lse.data() + 2;  // lse is zeros: valid slopes
  EXPECT_EQ(check_call(p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data()),
            "lse overlaps alibi: outputs must not share memory with inputs");
  p.alibi = zeros.data();
  EXPECT_EQ(check_call(p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data()), "");
  p = b.p;
  std::vector<std::int64_t> lens(static_cast<std::size_t>(p.batch), 1);
  p.kv_lens = lens.data();
  EXPECT_EQ(check_call(p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data()), "");
  // Inside lse (its zeros: lengths 0), at an address an int64_t may have.
  const auto inside = (reinterpret_cast<std::uintptr_t>(b.lse.data()) + 7) & ~std::uintptr_t{7};
  p.q_lens = reinterpret_cast<const std::int64_t*>(inside);
  EXPECT_EQ(check_call(p, b.q.data(), b.k.data(), b.v.data(), b.o.data(), b.lse.data()),
            "lse overlaps q_lens: outputs must not share memory with inputs");
  // Inputs may share memory.
  EXPECT_EQ(check_call(b.p, b.q.data(), b.k.data(), b.k.data(), b.o.data(), b.lse.data()), "");
  EXPECT_THROW(attention(b.p, b.q.data(), b.k.data(), b.v.data(), b.k.data()),
               std::invalid_argument);
}

TEST(EntryPoint, RejectsInvalidProblems) {
  Buffers b;
  b.p.kv_heads = 3;
  try {
    attention(b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data());
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "mha::attention: q_heads (4) must be a multiple of kv_heads (3)");
  }
}

TEST(EntryPoint, NamedKernels) {
  Buffers b;
  EXPECT_NO_THROW(attention("naive", b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data()));
  try {
    attention("fastest", b.p, b.q.data(), b.k.data(), b.v.data(), b.o.data());
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "unknown kernel 'fastest'");
  }
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(Registry, MaxIsaCapsWhatIsOffered) {
  {
    ScopedEnv env("MHA_MAX_ISA", "scalar");
    const KernelInfo* last_scalar = nullptr;  // the best kernel is the last one offered
    for (const KernelInfo& k : all_kernels()) {
      if (k.isa == Isa::scalar) last_scalar = &k;
    }
    ASSERT_NE(last_scalar, nullptr);
    EXPECT_EQ(&best_kernel(), last_scalar);
    for (const KernelInfo& k : all_kernels()) {
      EXPECT_EQ(available(k), k.isa == Isa::scalar) << k.name;
    }
  }
  {
    ScopedEnv env("MHA_MAX_ISA", "sse9");
    try {
      max_isa_rank();
      FAIL() << "no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_STREQ(
          e.what(),
          "MHA_MAX_ISA=sse9 is not one of scalar, sse4, avx2, avx512, avx512icl, neon, sve, sve2");
    }
  }
}

// mha/isa.inc generates the names, the ranks and the cap: every name is accepted by
// MHA_MAX_ISA as its own rank, the default cap is the highest rank of the list, and the
// error message names every ISA.
TEST(Registry, IsaNamesRoundTrip) {
  std::set<std::string> names;
  std::string accepted;
  int highest = 0;
  for (Isa isa : all_isas) {
    const std::string name = isa_name(isa);
    EXPECT_NE(name, "unknown");
    EXPECT_TRUE(names.insert(name).second) << "two ISAs called " << name;
    ScopedEnv env("MHA_MAX_ISA", name.c_str());
    EXPECT_EQ(max_isa_rank(), isa_rank(isa)) << name;
    accepted += (accepted.empty() ? "" : ", ") + name;
    highest = std::max(highest, isa_rank(isa));
  }
  {
    ScopedEnv env("MHA_MAX_ISA", "");
    EXPECT_EQ(max_isa_rank(), highest);
  }
  ScopedEnv env("MHA_MAX_ISA", "none");
  try {
    max_isa_rank();
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(e.what(), "MHA_MAX_ISA=none is not one of " + accepted);
  }
}

// Detection: the scalar ISA everywhere, an ISA of another architecture nowhere.
TEST(Registry, DetectsOnlyTheTargetsIsas) {
  EXPECT_TRUE(cpu_supports(Isa::scalar));
#if defined(__x86_64__)
  EXPECT_FALSE(cpu_supports(Isa::neon));
#elif defined(__aarch64__)
  EXPECT_TRUE(cpu_supports(Isa::neon));
  EXPECT_FALSE(cpu_supports(Isa::avx2));
  EXPECT_FALSE(cpu_supports(Isa::avx512));
#endif
}

// Under emulation the test command names the CPU model's best ISA; detection must agree,
// or the emulated runs would not test the fallbacks they are meant to.
TEST(Registry, DetectsTheEmulatedCpu) {
  const char* expected = std::getenv("MHA_EXPECT_CPU_ISA");
  if (expected == nullptr) GTEST_SKIP() << "MHA_EXPECT_CPU_ISA not set (native run)";
  Isa top = Isa::scalar;
  for (Isa isa : all_isas) {
    if (cpu_supports(isa) && isa_rank(isa) > isa_rank(top)) top = isa;
  }
  EXPECT_STREQ(isa_name(top), expected);
}

// The test command names the ISA the best kernel must have: under emulation the CPU
// model's best, natively the MHA_MAX_ISA cap (capped/avx2), so that mha::attention()
// demonstrably runs that ISA's kernel in those runs.
TEST(Registry, BestKernelHasTheExpectedIsa) {
  const char* expected = std::getenv("MHA_EXPECT_BEST_ISA");
  if (expected == nullptr) GTEST_SKIP() << "MHA_EXPECT_BEST_ISA not set";
  bool known = false;
  for (Isa isa : all_isas) {
    if (std::string(expected) != isa_name(isa)) continue;
    known = true;
    // A native capped run on a CPU without that ISA has nothing to check.
    if (std::getenv("MHA_EXPECT_CPU_ISA") == nullptr && !cpu_supports(isa)) {
      GTEST_SKIP() << "this CPU lacks " << expected;
    }
  }
  ASSERT_TRUE(known) << "MHA_EXPECT_BEST_ISA=" << expected;
  EXPECT_STREQ(isa_name(best_kernel().isa), expected);
}

TEST(Driver, NumThreadsFromTheEnvironment) {
  {
    ScopedEnv env("MHA_NUM_THREADS", "3");
    EXPECT_EQ(default_threads(), 3);
  }
  for (const char* bad : {"0", "-2", "two", "4x", "100000"}) {
    ScopedEnv env("MHA_NUM_THREADS", bad);
    try {
      default_threads();
      FAIL() << "no exception for " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("is not a positive integer")) << bad;
    }
  }
}

TEST(Driver, PlanDependsOnTheProblemOnly) {
  const Plan prefill = plan(make_problem(2, 2048, 2048, 32, 8, 128, true));
  EXPECT_EQ(prefill.row_block, 128);  // g = 4: kUnitRows / 4
  EXPECT_EQ(prefill.units, 2 * 8 * 16);
  EXPECT_EQ(prefill.chunks, 1);
  const Plan mqa = plan(make_problem(1, 1024, 1024, 32, 1, 128, false));
  EXPECT_EQ(mqa.row_block, 16);  // g = 32: kUnitRows / 32
  EXPECT_EQ(mqa.units, 1024 / 16);
  EXPECT_EQ(mqa.chunks, 1);  // enough units: not split
  const Plan decode = plan(make_problem(1, 1, 131072, 32, 8, 128, true));
  EXPECT_EQ(decode.units, 8);
  EXPECT_EQ(decode.chunks, 16);  // the cap: 8192-key chunks
  EXPECT_EQ(decode.chunk, 8192);
  const Plan short_cache = plan(make_problem(1, 1, 511, 8, 1, 128, true));
  EXPECT_EQ(short_cache.chunks, 1);  // below 2 kChunk keys: not split
  const Plan mha = plan(make_problem(1, 1024, 1024, 4, 4, 256, false));
  EXPECT_EQ(mha.row_block, 512);  // g = 1: kUnitRows, within kRowBlock
  EXPECT_EQ(mha.units, 4 * 2);
  EXPECT_EQ(mha.chunks, 1);  // few units, but whole ones: a prefill is not split
  const Plan few_rows = plan(make_problem(1, 100, 4096, 4, 4, 64, true));
  EXPECT_EQ(few_rows.units, 4);
  EXPECT_EQ(few_rows.chunks, 16);  // units short of rows and a long KV: split
}

TEST(Caches, SizesParseAsSysfsWritesThem) {
  using mha::support::detail::parse_cache_size;
  EXPECT_EQ(parse_cache_size("48K"), 48 << 10);
  EXPECT_EQ(parse_cache_size("2048K\n"), 2048 << 10);
  EXPECT_EQ(parse_cache_size("1M"), 1 << 20);
  EXPECT_EQ(parse_cache_size("1024M"), 1 << 30);  // the largest accepted
  EXPECT_EQ(parse_cache_size("32768"), 32768);
  for (const char* bad : {"", "x", "0", "0K", "-4K", "12Q", "1G", "1025M", "4K,", " 4K"}) {
    EXPECT_EQ(parse_cache_size(bad), -1) << '"' << bad << '"';
  }
  EXPECT_EQ(parse_cache_size(nullptr), -1);
}

TEST(Caches, SharedCpuListsCount) {
  using mha::support::detail::count_cpus;
  EXPECT_EQ(count_cpus("0"), 1);
  EXPECT_EQ(count_cpus("0-1"), 2);
  EXPECT_EQ(count_cpus("0,64"), 2);
  EXPECT_EQ(count_cpus("0-3,8-11"), 8);
  for (const char* unreadable : {"", "a", "3-1", "0-", "0;1"}) {
    EXPECT_EQ(count_cpus(unreadable), 1) << '"' << unreadable << '"';
  }
}

TEST(Caches, EnvironmentSetsThemOrIsRejected) {
  {
    ScopedEnv env("MHA_CACHES", "32K,512K");
    const mha::support::Caches c = mha::support::detail::read_caches();
    EXPECT_EQ(c.l1d, 32 << 10);
    EXPECT_EQ(c.l2, 512 << 10);
    EXPECT_EQ(c.l3, 0);  // not given: none known
  }
  {
    ScopedEnv env("MHA_CACHES", "48K,2M,1920K");  // an L3 share may be smaller than the L2
    const mha::support::Caches c = mha::support::detail::read_caches();
    EXPECT_EQ(c.l1d, 48 << 10);
    EXPECT_EQ(c.l2, 2 << 20);
    EXPECT_EQ(c.l3, 1920 << 10);
  }
  for (const char* bad : {"32K", "32K,", ",512K", "2K,512K", "64K,32K", "32K,512K,", "32K,512K,0",
                          "32K,512K,1M,2M", "big"}) {
    ScopedEnv env("MHA_CACHES", bad);
    try {
      mha::support::detail::read_caches();
      FAIL() << "no exception for " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_THAT(e.what(), HasSubstr("is not L1D,L2 or L1D,L2,L3 sizes such as 32K,512K or "
                                      "32K,512K,4M"))
          << bad;
    }
  }
  const mha::support::Caches system = mha::support::detail::read_caches();  // sysfs or fallback
  EXPECT_GE(system.l1d, 4 << 10);
  EXPECT_GE(system.l2, system.l1d);
}

// Tile sizes within their documented bounds for any caches, and Br independent of kv_len:
// a split-KV chunk must never need more workspace than its whole problem.
RC_GTEST_PROP(Caches, TilingsStayWithinTheirBounds, ()) {
  const std::int64_t l1d = std::int64_t{4 << 10} << *rc::gen::inRange(0, 6);
  const mha::support::Caches c{l1d, l1d << *rc::gen::inRange(0, 8), 0};
  const std::int64_t kv_heads = *rc::gen::inRange<std::int64_t>(1, 5);
  const std::int64_t group = *rc::gen::inRange<std::int64_t>(1, 33);
  const std::int64_t dim = *rc::gen::inRange<std::int64_t>(1, 4097);
  const std::int64_t q_len = *rc::gen::inRange<std::int64_t>(1, 5000);
  const std::int64_t kv_len = *rc::gen::inRange<std::int64_t>(1, 5000);
  const Problem p = make_problem(1, q_len, kv_len, group * kv_heads, kv_heads, dim, false);
  const mha::support::Tiling t = mha::support::flash_tiling(p, c);
  RC_ASSERT(t.keys >= std::min<std::int64_t>(16, kv_len));
  RC_ASSERT(t.keys <= std::min<std::int64_t>(256, kv_len));
  RC_ASSERT(t.rows_per_head >= 1);
  RC_ASSERT(t.rows_per_head <= std::min<std::int64_t>(64, q_len));
  Problem longer = p;
  longer.kv_len = *rc::gen::inRange<std::int64_t>(kv_len, 10000);
  RC_ASSERT(mha::support::flash_tiling(longer, c).rows_per_head == t.rows_per_head);
  for (const std::int64_t step : {8, 16}) {
    const std::int64_t keys = mha::support::decode_tile_keys(p, step, c);
    RC_ASSERT(keys % step == 0);
    RC_ASSERT(keys >= step);
    RC_ASSERT(keys <= 256);
  }
}

// The packing kernels' block (support::packed_rows_per_head) never falls below the rows that
// amortize a packed tile, whatever the caches and the head width: a block of R = g Br rows is
// at least 256 rows (or all the rows there are, or the kernel's own bound), short of what
// dividing by g rounds off, and at most 512 (or one row per head).
RC_GTEST_PROP(Caches, PackedBlocksAmortizeTheirTiles, ()) {
  const std::int64_t l1d = std::int64_t{4 << 10} << *rc::gen::inRange(0, 6);
  const std::int64_t l2 = l1d << *rc::gen::inRange(0, 8);
  const std::int64_t l3 = *rc::gen::element<std::int64_t>(0, 1 << 20, 32 << 20);
  const mha::support::Caches c{l1d, l2, l3};
  const std::int64_t kv_heads = *rc::gen::inRange<std::int64_t>(1, 5);
  const std::int64_t group = *rc::gen::element<std::int64_t>(1, 2, 3, 4, 7, 8, 32, 64, 600);
  const std::int64_t dim = *rc::gen::inRange<std::int64_t>(1, 4097);
  const std::int64_t q_len = *rc::gen::inRange<std::int64_t>(1, 5000);
  const std::int64_t kv_len = *rc::gen::inRange<std::int64_t>(1, 5000);
  const Problem p = make_problem(1, q_len, kv_len, group * kv_heads, kv_heads, dim, false);
  // As avx2 asks: Qp, S and O per row, Kp and Vp per tile, R x D16 within 128 Ki floats.
  const std::int64_t d16 = (dim + 15) / 16 * 16;
  const std::int64_t max_rows = std::max<std::int64_t>(1, 131072 / d16);
  const std::int64_t br =
      mha::support::packed_rows_per_head(p, dim + 128 + d16, 256 * d16, max_rows, c);
  RC_ASSERT(br >= 1);
  RC_ASSERT(br <= q_len);
  const std::int64_t least = std::min<std::int64_t>({256, max_rows, group * q_len});
  RC_ASSERT(group * br > least - group);
  RC_ASSERT(group * br <= std::max(group, std::min<std::int64_t>(512, max_rows)));
  Problem longer = p;
  longer.kv_len = *rc::gen::inRange<std::int64_t>(kv_len, 10000);
  RC_ASSERT(mha::support::packed_rows_per_head(longer, dim + 128 + d16, 256 * d16, max_rows, c) ==
            br);
}

TEST(Registry, NamesAreUniqueAndNaiveComesFirst) {
  const auto& kernels = all_kernels();
  ASSERT_FALSE(kernels.empty());
  EXPECT_STREQ(kernels.front().name, "naive");
  for (std::size_t i = 0; i < kernels.size(); ++i) {
    EXPECT_NE(find_kernel(kernels[i].name), nullptr);
    EXPECT_EQ(find_kernel(kernels[i].name), &kernels[i]);
    EXPECT_GE(kernels[i].exp_ulp, 0.5) << kernels[i].name;
  }
  EXPECT_EQ(find_kernel("no-such-kernel"), nullptr);
}

TEST(Merge, RejectsBadInput) {
  Buffers b;
  Parts parts;
  EXPECT_THROW(merge(b.p, parts, b.o.data(), nullptr), std::invalid_argument);
  const float* one[] = {nullptr};
  parts.count = 1;
  parts.o = one;
  parts.lse = one;
  try {
    merge(b.p, parts, b.o.data(), nullptr);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "mha::merge: part 0 is null");
  }
  b.p.head_dim = 0;
  EXPECT_THROW(merge(b.p, parts, b.o.data(), nullptr), std::invalid_argument);
}

TEST(Merge, PartsThatSawNoKeyDropOut) {
  Problem p = make_problem(1, 1, 1, 1, 1, 2);
  const float o0[] = {1.0f, 2.0f}, o1[] = {0.0f, 0.0f}, o2[] = {3.0f, 6.0f};
  const float inf = std::numeric_limits<float>::infinity();
  const float l0[] = {0.0f}, l1[] = {-inf}, l2[] = {0.0f};
  const float* os[] = {o0, o1, o2};
  const float* ls[] = {l0, l1, l2};
  Parts parts;
  parts.count = 3;
  parts.o = os;
  parts.lse = ls;
  parts.o_strides = p.o;
  parts.lse_strides = p.lse;
  float o[2], lse;
  merge(p, parts, o, &lse);
  EXPECT_FLOAT_EQ(o[0], 2.0f);  // equal weights: the mean of parts 0 and 2
  EXPECT_FLOAT_EQ(o[1], 4.0f);
  EXPECT_FLOAT_EQ(lse, std::log(2.0f));
  const float* all_empty[] = {l1, l1, l1};
  parts.lse = all_empty;
  merge(p, parts, o, &lse);
  EXPECT_EQ(o[0], 0.0f);
  EXPECT_EQ(o[1], 0.0f);
  EXPECT_EQ(lse, -inf);
}

}  // namespace
}  // namespace mha::test

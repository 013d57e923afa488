// The floating-point environment a caller may leave set (frameworks set flush-to-zero and
// denormals-are-zero for speed; code may change the rounding mode or enable traps): every
// registry kernel, the parallel driver, mha::merge, every GEMM kernel (alone and through
// mha::gemm) and the layer must give exactly the bits they give under the default
// environment, on inputs with subnormal numbers, and give the caller's environment back:
// its control bits exactly, and every status flag it had raised still raised (the code may
// raise more flags, never clear one: mha::FpEnvGuard's contract, mha/attention.h).
//
// Each OpenMP thread has an environment of its own: for the code that runs on the driver's
// threads, every thread of the calling thread's team is set and checked alike.
//
// x86-64: FTZ and DAZ are MXCSR bits 15 and 6; what is compared is MXCSR as _mm_getcsr reads
// it and fegetenv's bytes (the x87 part exactly, its MXCSR copy by the flag rule). AArch64:
// FPCR.FZ flushes inputs and outputs both; FPCR exactly, FPSR by the flag rule.
#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/layer.h>
#include <mha/parallel.h>
#include <mha/registry.h>

#include <cfenv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "buffers.h"
#include "gemm_kernel_test.h"
#include "kernel_test.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace mha::test {
namespace {

// One environment a caller may leave set.
struct Env {
  const char* name;
  int rounding;  // FE_TONEAREST, FE_UPWARD, ...
  bool flush;    // FTZ + DAZ (x86-64), FPCR.FZ (AArch64)
  bool traps;    // invalid, divide-by-zero and overflow trap (where the CPU can)
  bool raised;   // FE_DIVBYZERO raised before the call, which none of the code raises
};

// The default control bits with a raised flag take the guard's fast path; the others its
// switch. No flag is raised where traps are on: a raised flag with its trap enabled fires
// at the next x87 instruction.
const Env kEnvironments[] = {
    {"default control, FE_DIVBYZERO raised", FE_TONEAREST, false, false, true},
    {"FTZ+DAZ", FE_TONEAREST, true, false, true},
    {"FE_UPWARD", FE_UPWARD, false, false, true},
    {"FE_DOWNWARD", FE_DOWNWARD, false, false, true},
    {"FE_TOWARDZERO", FE_TOWARDZERO, false, false, true},
    {"FTZ+DAZ, FE_UPWARD", FE_UPWARD, true, false, true},
    {"FTZ+DAZ, FE_DOWNWARD", FE_DOWNWARD, true, false, true},
    {"FTZ+DAZ, FE_TOWARDZERO", FE_TOWARDZERO, true, false, true},
    {"traps on invalid, divide-by-zero and overflow", FE_TONEAREST, false, true, false},
};

// What a call must give back: the environment as fegetenv stores it, and the control and
// status registers read directly.
struct State {
  std::fenv_t env;
  std::uint64_t control = 0;  // x86-64: MXCSR without its flags; AArch64: FPCR
  std::uint64_t status = 0;   // x86-64: MXCSR's flags; AArch64: FPSR
};

State read_state() {
  State s;
  std::fegetenv(&s.env);
#if defined(__x86_64__)
  const unsigned csr = _mm_getcsr();
  s.control = csr & ~0x3Fu;
  s.status = csr & 0x3Fu;
#elif defined(__aarch64__)
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(s.control));
  __asm__ __volatile__("mrs %0, fpsr" : "=r"(s.status));
#else
  s.control = static_cast<std::uint64_t>(std::fegetround());
  s.status = static_cast<std::uint64_t>(std::fetestexcept(FE_ALL_EXCEPT));
#endif
  return s;
}

// Why `after` is not `before` given back (control identical, no flag cleared), or "".
std::string given_back(const State& before, const State& after) {
  std::ostringstream why;
  why << std::hex;
  const auto compare = [&](const char* what, std::uint64_t control0, std::uint64_t control1,
                           std::uint64_t flags0, std::uint64_t flags1) {
    if (control0 != control1)
      why << what << " control 0x" << control0 << " -> 0x" << control1 << "; ";
    if ((flags1 & flags0) != flags0)
      why << what << " flags 0x" << flags0 << " -> 0x" << flags1 << "; ";
  };
  compare("register", before.control, after.control, before.status, after.status);
#if defined(__x86_64__) && defined(__GLIBC__)
  // Nothing uses the x87 unit: its environment (control, status and tag words, the last
  // instruction's pointers) must be the very same bytes.
  if (std::memcmp(&before.env, &after.env, offsetof(std::fenv_t, __mxcsr)) != 0) {
    why << "fegetenv's x87 environment changed; ";
  }
  compare("fegetenv's mxcsr", before.env.__mxcsr & ~0x3Fu, after.env.__mxcsr & ~0x3Fu,
          before.env.__mxcsr & 0x3Fu, after.env.__mxcsr & 0x3Fu);
#elif defined(__aarch64__) && defined(__GLIBC__)
  compare("fegetenv's fpcr/fpsr", before.env.__fpcr, after.env.__fpcr, before.env.__fpsr,
          after.env.__fpsr);
#endif
  return why.str();
}

void set_flush() {
#if defined(__x86_64__)
  _mm_setcsr(_mm_getcsr() | 0x8040u);  // FTZ (bit 15) and DAZ (bit 6)
#elif defined(__aarch64__)
  std::uint64_t fpcr;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
  fpcr |= std::uint64_t{1} << 24;  // FZ
  __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#endif
}

// Sets e on the calling thread; false where this machine cannot.
bool apply(const Env& e) {
  std::fesetenv(FE_DFL_ENV);
#if !defined(__x86_64__) && !defined(__aarch64__)
  if (e.flush) return false;
#endif
  if (std::fesetround(e.rounding) != 0) return false;
  if (e.flush) set_flush();
  if (e.raised) std::feraiseexcept(FE_DIVBYZERO);
  if (e.traps) {
#if defined(__GLIBC__)
    // AArch64 cores (and qemu) may not implement trapping: feenableexcept then fails.
    const int traps = FE_INVALID | FE_DIVBYZERO | FE_OVERFLOW;
    if (feenableexcept(traps) == -1 || fegetexcept() != traps) {
      std::fesetenv(FE_DFL_ENV);
      return false;
    }
#else
    return false;
#endif
  }
  return true;
}

// f(t) on every thread t of a team of `threads` of the calling thread (which is thread 0):
// the threads the driver's parallel regions run on, since a team reuses its pool in order.
template <typename F>
void on_threads(int threads, F&& f) {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  f(omp_get_thread_num());
#else
  (void)threads;
  f(0);
#endif
}

// The environment of one call: enter() sets it on every thread of the team and notes what
// was set, leave() notes what was found and puts the default back. env == nullptr: the
// default environment, whose result every other is held to.
class Under {
 public:
  Under(const Env* env, int threads)
      : env_(env), threads_(threads), ok_(threads, 1), before_(threads), after_(threads) {}

  void enter() {
    on_threads(threads_, [&](int t) {
      if (env_ != nullptr) {
        ok_[t] = apply(*env_);
      } else {
        std::fesetenv(FE_DFL_ENV);
      }
      before_[t] = read_state();
    });
  }
  void leave() {
    on_threads(threads_, [&](int t) {
      after_[t] = read_state();
      std::fesetenv(FE_DFL_ENV);
    });
  }

  bool supported() const {
    for (char ok : ok_) {
      if (ok == 0) return false;
    }
    return true;
  }
  // How the environment of some thread was not given back, or "".
  std::string not_given_back() const {
    std::string why;
    for (int t = 0; t < threads_; ++t) {
      const std::string w = given_back(before_[t], after_[t]);
      if (!w.empty()) why += "thread " + std::to_string(t) + ": " + w;
    }
    return why;
  }

 private:
  const Env* env_;
  int threads_;
  std::vector<char> ok_;
  std::vector<State> before_, after_;
};

using Bits = std::vector<std::uint32_t>;

void append(Bits& bits, const float* x, std::size_t n) {
  const std::size_t at = bits.size();
  bits.resize(at + n);
  std::memcpy(bits.data() + at, x, n * sizeof(float));
}
void append(Bits& bits, const Guarded& g) {
  const std::vector<float> all = g.snapshot();  // the guard zones too
  append(bits, all.data(), all.size());
}

// run(under) prepares its buffers, calls the code under test between under.enter() and
// under.leave(), and returns the bits of everything the code may write. Every environment
// must give the default environment's bits and be given back.
void expect_environment_ignored(const std::string& what, int threads,
                                const std::function<Bits(Under&)>& run) {
  Under base(nullptr, threads);
  const Bits expected = run(base);
  EXPECT_EQ(base.not_given_back(), "") << what << ", default environment";
  int checked = 0;
  for (const Env& env : kEnvironments) {
    Under under(&env, threads);
    const Bits got = run(under);
    if (!under.supported()) continue;  // traps on a CPU without them
    ++checked;
    ASSERT_EQ(got.size(), expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i] != expected[i]) {
        float g, e;
        std::memcpy(&g, &got[i], sizeof g);
        std::memcpy(&e, &expected[i], sizeof e);
        ADD_FAILURE() << what << " under " << env.name << ": output float " << i << " is " << g
                      << " (0x" << std::hex << got[i] << "), under the default environment " << e
                      << " (0x" << expected[i] << std::dec << ")";
        break;
      }
    }
    EXPECT_EQ(under.not_given_back(), "") << what << " under " << env.name;
  }
  EXPECT_GE(checked, 8) << "FTZ+DAZ and the rounding modes are available on every target";
}

// Values in [-1, 1] with every 5th one subnormal, and, with `tiny_first` (one column of V or
// B), every value of column 0 subnormal, so that results there are subnormal too: what
// DAZ reads as zero and FTZ flushes.
std::vector<float> values(std::int64_t n, std::int64_t row, bool tiny_first, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> steps(1, 1 << 22);
  const float denorm = std::numeric_limits<float>::denorm_min();
  std::vector<float> x(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float v = unit(rng);
    if (tiny_first && i % row == 0) {
      v = denorm * static_cast<float>(steps(rng) + (1 << 22));  // positive, up to 2^-126
    } else if (i % 5 == 0) {
      v = (v < 0 ? -denorm : denorm) * static_cast<float>(steps(rng));
    }
    x[static_cast<std::size_t>(i)] = v;
  }
  return x;
}

// An attention problem with such inputs. With `specials`, also an infinite key, a NaN
// value and a query whose dot products overflow: invalid operations and overflows, whose
// traps must not fire (NaN and Inf propagate by contract).
struct Attention {
  Problem p;
  std::vector<float> q, k, v;
  Attention(const Problem& problem, std::uint64_t seed, bool specials = false) : p(problem) {
    q = values(q_extent(p), p.head_dim, false, seed);
    k = values(k_extent(p), p.head_dim, false, seed + 1);
    v = values(v_extent(p), p.head_dim, true, seed + 2);
    if (specials) {
      k[static_cast<std::size_t>(5 * p.k.seq)] = std::numeric_limits<float>::infinity();
      v[static_cast<std::size_t>(2 * p.v.seq + 1)] = std::numeric_limits<float>::quiet_NaN();
      q[static_cast<std::size_t>(p.q.seq)] = 1e30f;
    }
  }
};

// Prefill (a block path, GQA, causal, a head_dim off every vector width), decode (the
// decode paths; head-major), causal with more queries than keys (rows that see none), and
// a small causal prefill with special values.
struct Shape {
  Problem p;
  bool specials;
};
std::vector<Shape> kernel_shapes() {
  return {{make_problem(1, 37, 37, 4, 2, 40, true), false},
          {make_problem(2, 1, 100, 4, 1, 24, false, Layout::head_major), false},
          {make_problem(1, 20, 9, 2, 2, 17, true), false},
          {make_problem(1, 12, 12, 2, 1, 16, true), true}};
}

class FpEnvKernel : public KernelTest {};

TEST_P(FpEnvKernel, GivesTheDefaultEnvironmentsBits) {
  for (const Shape& shape : kernel_shapes()) {
    const Problem& p = shape.p;
    const Attention a(p, 11, shape.specials);
    const std::size_t ws_bytes = kernel().workspace(p);
    expect_environment_ignored(std::string(kernel().name) + ", Lq " + std::to_string(p.q_len), 1,
                               [&](Under& under) {
                                 Guarded o(o_extent(p), 3), lse(lse_extent(p), 5);
                                 std::vector<unsigned char> ws(ws_bytes);
                                 under.enter();
                                 kernel().fn(p, a.q.data(), a.k.data(), a.v.data(), o.data(),
                                             lse.data(), Workspace{ws.data(), ws.size()});
                                 under.leave();
                                 Bits bits;
                                 append(bits, o);
                                 append(bits, lse);
                                 return bits;
                               });
  }
}

MHA_INSTANTIATE_FOR_KERNELS(FpEnvKernel);

// The driver on two threads, their environments set alike: split-KV decode (chunk kernel
// calls and merges on the threads), prefill of several units, and units that see no key.
TEST(FpEnv, DriverGivesTheDefaultEnvironmentsBits) {
  const KernelInfo& kernel = best_kernel();
  constexpr int kThreads = 2;
  for (const Problem& p :
       {make_problem(1, 1, 1100, 4, 2, 16, false, Layout::head_major),
        make_problem(2, 40, 40, 4, 4, 8, true), make_problem(1, 40, 17, 2, 1, 8, true)}) {
    ASSERT_TRUE(p.kv_len < 1000 || plan(p).chunks > 1) << "the decode shape must split";
    const Attention a(p, 21);
    const std::size_t ws_bytes = parallel_workspace(kernel.workspace, p, kThreads);
    expect_environment_ignored(
        "driver over " + std::string(kernel.name) + ", Lk " + std::to_string(p.kv_len), kThreads,
        [&](Under& under) {
          Guarded o(o_extent(p), 1), lse(lse_extent(p), 2);
          std::vector<unsigned char> ws(ws_bytes);
          under.enter();
          parallel_attention(kernel.fn, kernel.workspace, p, a.q.data(), a.k.data(), a.v.data(),
                             o.data(), lse.data(), kThreads, Workspace{ws.data(), ws.size()});
          under.leave();
          Bits bits;
          append(bits, o);
          append(bits, lse);
          return bits;
        });
  }
}

// mha::merge of three parts with subnormal values in o's first column and lse values that
// make exp's, log's and the division's roundings show.
TEST(FpEnv, MergeGivesTheDefaultEnvironmentsBits) {
  const Problem p = make_problem(2, 5, 50, 3, 3, 19, false);
  constexpr int kParts = 3;
  std::vector<std::vector<float>> o(kParts), lse(kParts);
  for (int c = 0; c < kParts; ++c) {
    o[c] = values(o_extent(p), p.head_dim, true, 31 + c);
    lse[c] = values(lse_extent(p), p.q_len, false, 41 + c);
    for (float& x : lse[c]) x = 3.0f * x + static_cast<float>(c);
  }
  lse[1][2] = -std::numeric_limits<float>::infinity();  // a part that saw no key
  const float* parts_o[kParts] = {o[0].data(), o[1].data(), o[2].data()};
  const float* parts_lse[kParts] = {lse[0].data(), lse[1].data(), lse[2].data()};
  Parts parts;
  parts.count = kParts;
  parts.o = parts_o;
  parts.lse = parts_lse;
  parts.o_strides = p.o;
  parts.lse_strides = p.lse;
  expect_environment_ignored("mha::merge", 1, [&](Under& under) {
    Guarded out(o_extent(p), 0), out_lse(lse_extent(p), 0);
    under.enter();
    merge(p, parts, out.data(), out_lse.data());
    under.leave();
    Bits bits;
    append(bits, out);
    append(bits, out_lse);
    return bits;
  });
}

class FpEnvGemm : public GemmKernelTest {};

// The kernel alone on packed operands (m and n off its tile, a bias), then mha::gemm on two
// threads, B packed and A packed inside the caller's environment: packing only copies, so
// DAZ must not touch a subnormal on the way.
TEST_P(FpEnvGemm, GivesTheDefaultEnvironmentsBits) {
  const GemmInfo& g = gemm_kernel();
  const GemmTile t = g.tile();
  {
    const GemmProblem p{13, 37, 50, 40};
    const std::vector<float> a = values(p.m * p.k, p.k, false, 51);
    const std::vector<float> b = values(p.k * p.n, p.n, true, 52);
    const std::vector<float> bias = values(p.n, p.n, true, 53);
    std::vector<float> pa(static_cast<std::size_t>(packed_floats(p.m, p.k, t.mr)));
    std::vector<float> pb(static_cast<std::size_t>(packed_floats(p.n, p.k, t.nr)));
    pack_a(p.m, p.k, a.data(), p.k, 1, t.mr, pa.data());
    pack_b(p.k, p.n, b.data(), p.n, 1, t.nr, pb.data());
    expect_environment_ignored(std::string("gemm kernel ") + g.name, 1, [&](Under& under) {
      Guarded c(c_extent(p), 7);
      under.enter();
      g.fn(p, pa.data(), pb.data(), bias.data(), c.data());
      under.leave();
      Bits bits;
      append(bits, c);
      return bits;
    });
  }
  const std::int64_t m = 70, n = 300, k = 64;
  const std::vector<float> a = values(m * k, k, false, 54);
  const std::vector<float> b = values(k * n, n, true, 55);
  expect_environment_ignored(std::string("mha::gemm with ") + g.name, 2, [&](Under& under) {
    Guarded c(m * n, 0);
    under.enter();
    const PackedMatrix packed(g, k, n, b.data(), n, 1);
    gemm(m, a.data(), k, packed, nullptr, c.data(), n, 2);
    under.leave();
    Bits bits;
    append(bits, c);
    return bits;
  });
}

MHA_INSTANTIATE_FOR_GEMMS(FpEnvGemm);

class FpEnvLayer : public GemmKernelTest {};

// A small layer on two threads: a prefill of 6 tokens, then a decode step; y of both and
// the cache's K and V. W^O's first column is subnormal, so y's is too. D = 6: rounded
// downward, the attention scale 1/sqrt(6) that the layer computes itself is one ulp lower,
// which changes the logits of every kernel of the registry. Then a prefill that is refused
// (the cache is full) must give the environment back as well.
TEST_P(FpEnvLayer, GivesTheDefaultEnvironmentsBits) {
  const LayerConfig c{32, 4, 2, 6};
  const std::int64_t hd = c.q_heads * c.head_dim, kvd = c.kv_heads * c.head_dim, n = 6;
  const std::vector<float> wq = values(c.d_model * hd, hd, false, 61);
  const std::vector<float> wk = values(c.d_model * kvd, kvd, false, 62);
  const std::vector<float> wv = values(c.d_model * kvd, kvd, true, 63);
  const std::vector<float> wo = values(hd * c.d_model, c.d_model, true, 64);
  const std::vector<float> bq = values(hd, hd, false, 65);
  const std::vector<float> x = values((n + 1) * c.d_model, c.d_model, false, 66);
  const LayerWeights w{wq.data(), wk.data(), wv.data(), wo.data(), bq.data(),
                       nullptr,   nullptr,   nullptr,   false};
  const Layer layer(c, w, gemm_kernel().name);
  constexpr int kThreads = 2;
  expect_environment_ignored(
      std::string("layer with ") + gemm_kernel().name, kThreads, [&](Under& under) {
        KvCache cache(c, 1, n + 1);
        Guarded y(n * c.d_model, 0), y_step(c.d_model, 0);
        under.enter();
        layer.prefill(x.data(), n, y.data(), cache, true, kThreads);
        layer.decode(x.data() + n * c.d_model, y_step.data(), cache, kThreads);
        under.leave();
        Bits bits;
        append(bits, y);
        append(bits, y_step);
        append(bits, cache.k(), KvCache::bytes(c, 1, n + 1) / 8);
        append(bits, cache.v(), KvCache::bytes(c, 1, n + 1) / 8);
        return bits;
      });
  for (const Env& env : kEnvironments) {
    KvCache full(c, 1, 1);
    std::vector<float> y(static_cast<std::size_t>(n * c.d_model));
    Under under(&env, 1);
    under.enter();
    bool refused = false;
    try {
      layer.prefill(x.data(), n, y.data(), full, true, 1);
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    under.leave();
    EXPECT_TRUE(refused);
    if (under.supported()) {
      EXPECT_EQ(under.not_given_back(), "") << "refused prefill, " << env.name;
    }
  }
}

MHA_INSTANTIATE_FOR_GEMMS(FpEnvLayer);

// The guard itself: inside, the default control bits with the caller's flags; after, the
// caller's control bits and every flag raised on either side; nested guards alike.
TEST(FpEnv, GuardSetsTheDefaultInsideAndGivesTheCallersBack) {
  for (const Env& env : kEnvironments) {
    Under under(&env, 1);
    State inside, nested;
    under.enter();
    {
      const FpEnvGuard guard;
      {
        const FpEnvGuard inner;
        nested = read_state();
      }
      inside = read_state();
      // Raised inside, by the vector unit (glibc's feraiseexcept(FE_UNDERFLOW) sets the x87
      // flag on x86-64): it must survive the guard.
      volatile float tiny = 1e-30f;
      tiny = tiny * tiny;
    }
    const State after = read_state();
    under.leave();
    if (!under.supported()) continue;
    EXPECT_EQ(inside.control, nested.control) << env.name;
#if defined(__x86_64__)
    EXPECT_EQ(inside.control, 0x1F80u) << env.name;
    EXPECT_NE(after.status & 0x10u, 0u) << env.name << ": underflow (UE) raised inside was lost";
#elif defined(__aarch64__)
    EXPECT_EQ(inside.control, 0u) << env.name;
    EXPECT_NE(after.status & 0x8u, 0u) << env.name << ": underflow (UFC) raised inside was lost";
#endif
    EXPECT_EQ(under.not_given_back(), "") << env.name;
  }
}

}  // namespace
}  // namespace mha::test

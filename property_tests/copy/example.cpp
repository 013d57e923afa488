// A kernel used from a copy: README.md's "Copy a kernel" builds this file with one kernel's
// files and mha/attention.h alone (the tiled kernels' files include mha/support.h), and the
// copy/<kernel> ctests do exactly that in an empty folder, for every kernel of the README's
// table. It runs one small problem and compares the kernel with attention computed here in
// double precision.
//
// Compile it with -DMHA_EXAMPLE_KERNEL=<name> (naive, blocked, avx2, avx512, neon, xsimd_avx2,
// ...: the registry name with '_' for '-'): it calls mha_f32_attention_<name>. Neither file takes
// ISA flags (the kernel's ISA code is in its target region), so the CPU check in main runs before
// any instruction of that ISA can: on a CPU without it the program says so and exits 77 instead
// of dying of SIGILL.
//
// Exit codes: 0 error within the bound, 1 error above it (or an invalid problem), 77 this
// CPU lacks the kernel's ISA (ctest's SKIP_RETURN_CODE).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "mha/attention.h"

#ifndef MHA_EXAMPLE_KERNEL
#error "compile with -DMHA_EXAMPLE_KERNEL=<kernel name>, e.g. -DMHA_EXAMPLE_KERNEL=avx2"
#endif
#define MHA_EXAMPLE_CAT2(a, b) a##b
#define MHA_EXAMPLE_CAT(a, b) MHA_EXAMPLE_CAT2(a, b)
#define MHA_EXAMPLE_STR2(a) #a
#define MHA_EXAMPLE_STR(a) MHA_EXAMPLE_STR2(a)
#define MHA_EXAMPLE_FUNCTION MHA_EXAMPLE_CAT(mha_f32_attention_, MHA_EXAMPLE_KERNEL)
#define MHA_EXAMPLE_WORKSPACE MHA_EXAMPLE_CAT(MHA_EXAMPLE_FUNCTION, _workspace)

// From the kernel file, e.g. avx2.cpp. Call them only with a problem that passed mha::check,
// and only on a CPU with the kernel's ISA: both are compiled with its flags.
void MHA_EXAMPLE_FUNCTION(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v,
                          float* o, float* lse, mha::Workspace ws);
std::size_t MHA_EXAMPLE_WORKSPACE(const mha::Problem& p);

namespace {

constexpr int kIsaMissing = 77;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Values in [-1, 1] from a fixed xorshift sequence: the same inputs on every machine.
std::vector<float> random_tensor(std::int64_t size, std::uint32_t& state) {
  std::vector<float> x(static_cast<std::size_t>(size));
  for (float& e : x) {
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    e = static_cast<float>(static_cast<double>(state) / 2147483648.0 - 1.0);
  }
  return x;
}

// Largest |kernel - exact| over every element of o and lse (infinity if any is NaN), with
// exact attention computed straight from the formula in mha/attention.h, in double. Needs
// q_len <= kv_len (every row sees a key).
double max_error(const mha::Problem& p, const float* q, const float* k, const float* v,
                 const float* o, const float* lse) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  std::vector<double> s_row(static_cast<std::size_t>(p.kv_len));
  std::vector<double> acc_row(static_cast<std::size_t>(p.head_dim));
  double* const s = s_row.data();
  double* const acc = acc_row.data();
  double worst = 0.0;
  const auto note = [&worst](double error) {
    worst = std::isnan(error) ? kInf : std::max(worst, error);
  };
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const float* k_head = k + b * p.k.batch + h / group * p.k.head;
      const float* v_head = v + b * p.v.batch + h / group * p.v.head;
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        const std::int64_t n = mha::visible_keys(p, i);
        double m = -kInf;
        for (std::int64_t j = 0; j < n; ++j) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            dot += static_cast<double>(q_row[d]) * k_head[j * p.k.seq + d];
          }
          s[j] = p.scale * dot;
          m = std::max(m, s[j]);
        }
        double l = 0.0;
        std::fill(acc, acc + p.head_dim, 0.0);
        for (std::int64_t j = 0; j < n; ++j) {
          const double w = std::exp(s[j] - m);
          l += w;
          for (std::int64_t d = 0; d < p.head_dim; ++d) acc[d] += w * v_head[j * p.v.seq + d];
        }
        const float* o_row = o + b * p.o.batch + i * p.o.seq + h * p.o.head;
        for (std::int64_t d = 0; d < p.head_dim; ++d) note(std::fabs(o_row[d] - acc[d] / l));
        note(std::fabs(lse[b * p.lse.batch + h * p.lse.head + i] - (m + std::log(l))));
      }
    }
  }
  return worst;
}

// The bound for inputs in [-1, 1], from the problem size: u = 2^-24 (fp32's unit roundoff),
// D = head_dim, n = kv_len (the most keys a row sees).
//  * Logits: |scale q.k| <= sqrt(D); the fp32 dot product (D products and sums) and the
//    scaling err by at most e_s = (D + 1) sqrt(D) u.
//  * Weights exp(s_j - max) err relatively by 2 e_s (s_j and the max), u for the
//    subtraction, 3 u for the exp (the kernels' exps are within 1.5 ulp: registry.inc) and
//    3 u per KV tile of at least 16 keys (the online softmax's rescaling):
//    e_w = 2 e_s + 4 u + 3 u ceil(n / 16).
//  * o = sum_j w_j v_j / sum_j w_j with |v| <= 1: the weights' errors move it by at most
//    2 e_w, the two fp32 sums of n terms by 2 n u, the division by u.
//  * lse = max + log(sum_j w_j) errs by at most e_s + e_w + n u + |lse| u, which is less.
// For D = 40, n = 53: about 1180 u = 7.0e-5.
double error_bound(const mha::Problem& p) {
  const double u = std::ldexp(1.0, -24);
  const double dim = static_cast<double>(p.head_dim);
  const double n = static_cast<double>(p.kv_len);
  const double e_s = (dim + 1) * std::sqrt(dim) * u;
  const double e_w = 2 * e_s + 4 * u + 3 * u * std::ceil(n / 16);
  return 2 * e_w + (2 * n + 1) * u;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
#endif

// Whether this CPU runs the kernel, named after its ISA (avx2, xsimd_avx2, ...): GCC and
// Clang builtins, which also check that the OS saves the vector registers. Kernels not
// named after an x86-64 ISA need only the baseline ISA.
bool cpu_runs(const std::string& kernel) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (ends_with(kernel, "avx512")) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("fma");
  }
  if (ends_with(kernel, "avx2")) {
    // F16C (avx2's decode of an f16 cache) is CPUID.1:ECX[29]: the builtin does not know it.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && ((ecx >> 29) & 1u) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  }
#endif
  (void)kernel;
  return true;
}

}  // namespace

int main() {
  const std::string kernel = MHA_EXAMPLE_STR(MHA_EXAMPLE_KERNEL);
  if (!cpu_runs(kernel)) {
    std::printf("skipped: this CPU lacks the ISA of the %s kernel\n", kernel.c_str());
    return kIsaMissing;
  }

  // Batch 2; GQA, 6 query heads sharing 2 KV heads; causal against a longer KV cache
  // (bottom-right aligned: query row i sees keys 0..i+16); head_dim 40, not a multiple of
  // any kernel's vector width, so the kernel's tails run too.
  const mha::Problem p = mha::make_problem(/*batch=*/2, /*q_len=*/37, /*kv_len=*/53,
                                           /*q_heads=*/6, /*kv_heads=*/2, /*head_dim=*/40,
                                           /*causal=*/true, mha::Layout::token_major);
  const std::string invalid = mha::check(p);
  if (!invalid.empty()) {
    std::printf("invalid problem: %s\n", invalid.c_str());
    return 1;
  }
  std::uint32_t state = 2463534242u;
  const std::vector<float> q = random_tensor(mha::q_extent(p), state);
  const std::vector<float> k = random_tensor(mha::k_extent(p), state);
  const std::vector<float> v = random_tensor(mha::v_extent(p), state);
  std::vector<float> o(static_cast<std::size_t>(mha::o_extent(p)));
  std::vector<float> lse(static_cast<std::size_t>(mha::lse_extent(p)));

  // The kernel's scratch is the caller's: sized once, it serves every call of this shape.
  std::vector<unsigned char> workspace(MHA_EXAMPLE_WORKSPACE(p));
  MHA_EXAMPLE_FUNCTION(p, q.data(), k.data(), v.data(), o.data(), lse.data(),
                       mha::Workspace{workspace.data(), workspace.size()});

  const double error = max_error(p, q.data(), k.data(), v.data(), o.data(), lse.data());
  const double bound = error_bound(p);
  const bool ok = error <= bound;
  std::printf("%s kernel vs attention in double: max |error| %.3g, bound %.3g: %s\n",
              kernel.c_str(), error, bound, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

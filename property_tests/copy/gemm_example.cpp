// A GEMM kernel used from a copy: README.md's "Copy a kernel" (its GEMM table) builds this file
// with one GEMM kernel's files alone, and the copy/gemm-<kernel> ctests do exactly that in an
// empty folder. It packs a small A and B (mha/gemm.h), calls the kernel and compares C with the
// product computed here in double precision, within the contract's bound gamma(k + 1) (sum |a
// b| + |bias|).
//
// Compile it with -DMHA_EXAMPLE_GEMM=<name> (portable, avx2, avx512, neon): it calls
// mha_f32_gemm_<name> and mha_f32_gemm_<name>_tile. No file takes ISA flags (the kernel's ISA
// code is in its target region), so the CPU check in main runs first: on a CPU without the ISA
// it says so and exits 77.
//
// Exit codes: 0 within the bound, 1 above it, 77 this CPU lacks the kernel's ISA.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "mha/gemm.h"

#ifndef MHA_EXAMPLE_GEMM
#error "compile with -DMHA_EXAMPLE_GEMM=<kernel name>, e.g. -DMHA_EXAMPLE_GEMM=avx2"
#endif
#define MHA_EXAMPLE_CAT2(a, b) a##b
#define MHA_EXAMPLE_CAT(a, b) MHA_EXAMPLE_CAT2(a, b)
#define MHA_EXAMPLE_STR2(a) #a
#define MHA_EXAMPLE_STR(a) MHA_EXAMPLE_STR2(a)
#define MHA_EXAMPLE_FUNCTION MHA_EXAMPLE_CAT(mha_f32_gemm_, MHA_EXAMPLE_GEMM)
#define MHA_EXAMPLE_TILE MHA_EXAMPLE_CAT(MHA_EXAMPLE_FUNCTION, _tile)

// From the kernel file, e.g. avx2.cpp, compiled for its ISA: call them only on a CPU with it.
void MHA_EXAMPLE_FUNCTION(const mha::GemmProblem& p, const float* a, const float* b,
                          const float* bias, float* c);
mha::GemmTile MHA_EXAMPLE_TILE();

namespace {

constexpr int kIsaMissing = 77;

bool cpu_runs(const std::string& kernel) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (kernel == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("fma");
  }
  if (kernel == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  (void)kernel;
  return true;
}

// Values in [-1, 1] from a fixed xorshift sequence.
std::vector<float> random_matrix(std::int64_t size, std::uint32_t& state) {
  std::vector<float> x(static_cast<std::size_t>(size));
  for (float& e : x) {
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    e = static_cast<float>(state % 2001) / 1000.0f - 1.0f;
  }
  return x;
}

}  // namespace

int main() {
  const std::string kernel = MHA_EXAMPLE_STR(MHA_EXAMPLE_GEMM);
  if (!cpu_runs(kernel)) {
    std::printf("skipped: this CPU lacks the ISA of the gemm %s kernel\n", kernel.c_str());
    return kIsaMissing;
  }
  // Sizes off every tile edge; C with padded rows.
  const std::int64_t m = 37, n = 45, k = 300, ldc = n + 3;
  std::uint32_t state = 2463534242u;
  const std::vector<float> a = random_matrix(m * k, state), b = random_matrix(k * n, state);
  const std::vector<float> bias = random_matrix(n, state);
  const mha::GemmTile tile = MHA_EXAMPLE_TILE();
  std::vector<float> pa(static_cast<std::size_t>(mha::packed_floats(m, k, tile.mr)));
  std::vector<float> pb(static_cast<std::size_t>(mha::packed_floats(n, k, tile.nr)));
  mha::pack_a(m, k, a.data(), k, 1, tile.mr, pa.data());
  mha::pack_b(k, n, b.data(), n, 1, tile.nr, pb.data());
  const mha::GemmProblem p{m, n, k, ldc};
  if (const std::string why = mha::check_gemm(p); !why.empty()) {
    std::printf("invalid problem: %s\n", why.c_str());
    return 1;
  }
  std::vector<float> c(static_cast<std::size_t>(m * ldc), -7.0f);
  MHA_EXAMPLE_FUNCTION(p, pa.data(), pb.data(), bias.data(), c.data());
  const double u = std::ldexp(1.0, -24), nu = static_cast<double>(k + 1) * u;
  double worst = 0.0;  // largest error over its bound
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < ldc; ++j) {
      const float got = c[static_cast<std::size_t>(i * ldc + j)];
      if (j >= n) {  // padding: never written
        if (got != -7.0f) {
          std::printf("gemm %s wrote c[%lld][%lld], past n\n", kernel.c_str(),
                      static_cast<long long>(i), static_cast<long long>(j));
          return 1;
        }
        continue;
      }
      double exact = bias[static_cast<std::size_t>(j)];
      double magnitude = std::fabs(exact);
      for (std::int64_t l = 0; l < k; ++l) {
        const double t = static_cast<double>(a[static_cast<std::size_t>(i * k + l)]) *
                         b[static_cast<std::size_t>(l * n + j)];
        exact += t;
        magnitude += std::fabs(t);
      }
      const double ratio = std::fabs(got - exact) / (nu / (1.0 - nu) * magnitude);
      if (!(ratio <= worst)) worst = ratio;  // NaN too
    }
  }
  std::printf("gemm %s: %lld x %lld x %lld, largest error %.3f of its bound\n", kernel.c_str(),
              static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
              worst);
  return worst <= 1.0 ? 0 : 1;
}

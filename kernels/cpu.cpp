// Runtime CPU feature detection and the MHA_MAX_ISA cap.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "mha/registry.h"

namespace mha {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
    case Isa::neon:
      return "neon";
  }
  return "unknown";
}

int isa_rank(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return 0;
    case Isa::avx2:
    case Isa::neon:
      return 1;
    case Isa::avx512:
      return 2;
  }
  return 0;
}

bool cpu_supports(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return true;
#if defined(__x86_64__) || defined(_M_X64)
    // libgcc's __builtin_cpu_supports also checks XCR0, i.e. that the OS saves the
    // registers, not only the CPUID bits.
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("fma");
#else
    case Isa::avx2:
    case Isa::avx512:
      return false;
#endif
    case Isa::neon:
#if defined(__aarch64__)
      return true;  // Advanced SIMD is mandatory in AArch64
#else
      return false;
#endif
  }
  return false;
}

int max_isa_rank() {
  const char* env = std::getenv("MHA_MAX_ISA");
  if (env == nullptr || *env == '\0') return isa_rank(Isa::avx512);
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::neon}) {
    if (std::string(env) == isa_name(isa)) return isa_rank(isa);
  }
  throw std::invalid_argument("MHA_MAX_ISA=" + std::string(env) +
                              " is not one of scalar, avx2, avx512, neon");
}

}  // namespace mha

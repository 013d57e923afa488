// Runtime CPU feature detection and the MHA_MAX_ISA cap, generated from mha/isa.inc.
#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>

#include "mha/registry.h"

#if defined(__aarch64__)
#include <sys/auxv.h>  // getauxval, AT_HWCAP, HWCAP_SVE, HWCAP2_SVE2
#endif
#if defined(__x86_64__)
#include <cpuid.h>  // __get_cpuid_count
#endif

// An ISA's detection is compiled only on its own architecture; elsewhere it is false.
#define MHA_DETECT_any(detect) (detect)
#if defined(__x86_64__) || defined(_M_X64)
#define MHA_DETECT_x86_64(detect) (detect)
#else
#define MHA_DETECT_x86_64(detect) false
#endif
#if defined(__aarch64__)
#define MHA_DETECT_aarch64(detect) (detect)
#else
#define MHA_DETECT_aarch64(detect) false
#endif

namespace mha {
namespace {

struct IsaInfo {
  const char* name;
  int rank;
};

// Indexed by the enumerator: the enum is generated from the same list, in the same order.
constexpr IsaInfo kIsas[] = {
#define MHA_ISA(name, rank, arch, needs, detect) {#name, rank},
#include "mha/isa.inc"
#undef MHA_ISA
};
static_assert(std::size(kIsas) == std::size(all_isas));

const IsaInfo* info(Isa isa) {
  const auto i = static_cast<std::size_t>(isa);
  return i < std::size(kIsas) ? &kIsas[i] : nullptr;
}

#if defined(__x86_64__)
// CPUID leaf 7 features whose names clang 14's __builtin_cpu_supports does not know. They
// are read only beside avx512f (mha/isa.inc), whose check covers the OS's saving of the
// vector registers they use.
bool cpuid7_bit(unsigned subleaf, bool in_ecx, unsigned bit) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, subleaf, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (((in_ecx ? ecx : eax) >> bit) & 1u) != 0;
}
bool cpu_has_vaes() { return cpuid7_bit(0, true, 9); }  // CPUID.(7, 0):ECX[9]
// F16C: GCC 12's and clang 14's __builtin_cpu_supports do not know it. Read beside avx2,
// whose check covers the OS's saving of the ymm registers it uses.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return ((ecx >> 29) & 1u) != 0;  // CPUID.1:ECX[29]
}
bool cpu_has_avx_vnni() { return cpuid7_bit(1, false, 4); }  // CPUID.(7, 1):EAX[4]
#endif

constexpr int highest_rank() {
  int highest = 0;
  for (const IsaInfo& isa : kIsas) highest = std::max(highest, isa.rank);
  return highest;
}

}  // namespace

const char* isa_name(Isa isa) {
  const IsaInfo* i = info(isa);
  return i != nullptr ? i->name : "unknown";
}

int isa_rank(Isa isa) {
  const IsaInfo* i = info(isa);
  return i != nullptr ? i->rank : 0;
}

bool cpu_supports(Isa isa) {
  switch (isa) {
#define MHA_ISA(name, rank, arch, needs, detect) \
  case Isa::name:                                \
    return MHA_DETECT_##arch(detect);
#include "mha/isa.inc"
#undef MHA_ISA
  }
  return false;
}

namespace detail {

int parse_max_isa(const char* value) {
  if (value == nullptr || *value == '\0') return highest_rank();
  // No allocation unless the value is wrong: mha::attention asks on every call.
  for (const IsaInfo& isa : kIsas) {
    if (std::strcmp(value, isa.name) == 0) return isa.rank;
  }
  std::string accepted;
  for (const IsaInfo& isa : kIsas)
    accepted += (accepted.empty() ? "" : ", ") + std::string(isa.name);
  throw std::invalid_argument("MHA_MAX_ISA=" + std::string(value) + " is not one of " + accepted);
}

}  // namespace detail

int max_isa_rank() { return detail::parse_max_isa(std::getenv("MHA_MAX_ISA")); }

}  // namespace mha

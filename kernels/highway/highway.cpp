// highway: the Highway kernel (highway_kernel-inl.h, which describes it) compiled for every
// target Highway 1.0.3 builds, with its dynamic dispatch, and an entry point per target.
//
// hwy/foreach_target.h includes highway_kernel-inl.h once per target in HWY_TARGETS (x86-64:
// SSSE3, SSE4, AVX2, AVX3, AVX3_DL and the baseline; AArch64: NEON, SVE, SVE2, SVE_256,
// SVE2_128), each inside HWY_BEFORE_NAMESPACE's target pragmas, so this file itself needs no
// ISA flags. Then:
//   * mha_f32_attention_highway and _workspace: HWY_DYNAMIC_DISPATCH over HWY_EXPORT tables,
//     the best target of the CPU it runs on. This is the entry point to copy.
//   * mha_f32_attention_highway_<target> and _workspace: one target each (sse4, avx2, avx3,
//     avx3_dl; neon, sve, sve2), for the registry, so that every target is tested and timed
//     on its own. Call one only where the CPU has its ISA (kernels/include/mha/isa.inc:
//     sse4, avx2, avx512, avx512icl; neon, sve, sve2).
//
// Target features. Highway's x86 targets also enable PCLMUL and AES (SSE4 and up) and F16C
// (AVX2 and up); this file turns those off (HWY_DISABLE_PCLMUL_AES, HWY_DISABLE_F16C), which
// the kernel does not use, so that the targets need exactly what isa.inc detects, except
// that Highway's AVX2 and AVX3 targets also enable BMI1 and BMI2, which every CPU with AVX2
// and FMA so far has (Intel since Haswell, AMD since Excavator). HWY_DYNAMIC_DISPATCH
// consults libhwy's own detection, which is stricter.
//
// Every entry point runs under mha::FpEnvGuard: the caller's floating-point environment
// changes no bit.
//
// Depends on mha/attention.h, mha/support.h, mha/tiled_loops.h, highway_kernel-inl.h (this
// folder; found through the include path: compile with -I of this folder) and Highway
// (headers and libhwy, -lhwy) only.
#define HWY_DISABLE_PCLMUL_AES
#define HWY_DISABLE_F16C
#define HWY_WANT_AVX3_DL  // Highway 1.0 builds AVX3_DL only on request

#include <cstddef>

#include "mha/attention.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "highway_kernel-inl.h"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "highway_kernel-inl.h"

#if HWY_ONCE

namespace mha::highway_kernel {

HWY_EXPORT(Run);
HWY_EXPORT(Workspace);

std::size_t DispatchWorkspace(const mha::Problem& p) { return HWY_DYNAMIC_DISPATCH(Workspace)(p); }
void DispatchRun(const mha::Problem& p, const float* q, mha::KvView k, mha::KvView v, float* o,
                 float* lse, mha::Workspace ws) {
  HWY_DYNAMIC_DISPATCH(Run)(p, q, k, v, o, lse, ws);
}

}  // namespace mha::highway_kernel

std::size_t mha_f32_attention_highway_workspace(const mha::Problem& p) {
  return mha::highway_kernel::DispatchWorkspace(p);
}

void mha_f32_attention_highway(const mha::Problem& call, const float* q, mha::KvView k,
                               mha::KvView v, float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(call))
    return mha::each_sequence(mha_f32_attention_highway, call, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;
  // ALiBi's reach (support::AlibiReach): a sliding window past which no key weighs in.
  const mha::Problem p = mha::support::AlibiReach::apply(call, q, k, v);
  mha::highway_kernel::DispatchRun(p, q, k, v, o, lse, ws);
}

// One target's entry points. The registry lists exactly these targets, so each must be built.
#define MHA_HWY_TARGET_ENTRY(name, TARGET)                                                        \
  static_assert((HWY_TARGETS & HWY_##TARGET) != 0,                                                \
                "Highway does not build its " #TARGET " target here");                            \
  std::size_t mha_f32_attention_highway_##name##_workspace(const mha::Problem& p) {               \
    return mha::highway_kernel::N_##TARGET::Workspace(p);                                         \
  }                                                                                               \
  void mha_f32_attention_highway_##name(const mha::Problem& p, const float* q, mha::KvView k,     \
                                        mha::KvView v, float* o, float* lse, mha::Workspace ws) { \
    if (mha::ragged(p)) {                                                                         \
      return mha::each_sequence(mha_f32_attention_highway_##name, p, q, k, v, o, lse, ws);        \
    }                                                                                             \
    const mha::FpEnvGuard default_fp_env;                                                         \
    mha::highway_kernel::N_##TARGET::Run(mha::support::AlibiReach::apply(p, q, k, v), q, k, v, o, \
                                         lse, ws);                                                \
  }

#if HWY_ARCH_X86_64
MHA_HWY_TARGET_ENTRY(sse4, SSE4)
MHA_HWY_TARGET_ENTRY(avx2, AVX2)
MHA_HWY_TARGET_ENTRY(avx3, AVX3)
MHA_HWY_TARGET_ENTRY(avx3_dl, AVX3_DL)
#elif HWY_ARCH_ARM_A64
MHA_HWY_TARGET_ENTRY(neon, NEON)
MHA_HWY_TARGET_ENTRY(sve, SVE)
MHA_HWY_TARGET_ENTRY(sve2, SVE2)
#endif

#undef MHA_HWY_TARGET_ENTRY

#endif  // HWY_ONCE

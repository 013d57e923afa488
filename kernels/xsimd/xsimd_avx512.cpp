// xsimd-avx512: the xsimd kernel of xsimd_kernel.h (which describes it), instantiated for
// xsimd::avx512f, AVX-512F: 16-float vectors, 32 registers,
// MR = 12. Compiled with the avx512 ISA's flags (cmake/isa.cmake).
//
// Runs under mha::FpEnvGuard: the caller's floating-point environment changes no bit.
//
// Depends on mha/attention.h, mha/support.h, xsimd_kernel.h (this folder) and xsimd only.
// First: it includes its headers, and these, in a baseline region (see there).
#include "xsimd_kernel.h"

#include <cstddef>

#include "mha/attention.h"

template struct mha::xsimd_kernel::Attention<xsimd::avx512f>;

std::size_t mha_f32_attention_xsimd_avx512_workspace(const mha::Problem& p) {
  return mha::xsimd_kernel::Attention<xsimd::avx512f>::workspace(p);
}

void mha_f32_attention_xsimd_avx512(const mha::Problem& call, const float* q, mha::KvView k,
                                    mha::KvView v, float* o, float* lse, mha::Workspace ws) {
  if (mha::ragged(call))
    return mha::each_sequence(mha_f32_attention_xsimd_avx512, call, q, k, v, o, lse, ws);
  const mha::FpEnvGuard default_fp_env;
  // ALiBi's reach (support::AlibiReach): a sliding window past which no key weighs in.
  const mha::Problem p = mha::support::AlibiReach::apply(call, q, k, v);
  mha::xsimd_kernel::Attention<xsimd::avx512f>::run(p, q, k, v, o, lse, ws);
}

// The soft-cap's loop (mha::support::Softcap::apply) as the kernels with fused multiply-adds
// compile it: in an AVX2 + FMA target region on x86-64 (call it only where the CPU has both),
// the baseline elsewhere (aarch64 has FMA). For softcap_test.cpp.
#pragma once

#include <cstdint>

#include "mha/support.h"

namespace mha::test {

void softcap_fma(const mha::support::Softcap& cap, float* x, std::int64_t n);

}  // namespace mha::test

// avx512_exp.h: a vectorized 2^x for non-positive fp32 inputs with AVX-512F/DQ, for the
// avx512 attention kernel's softmax weights 2^(s - max) (logits in base 2) and its exp test.
//
// 2^x = 2^floor(x) * 2^f with f = x - floor(x) in [0, 1):
//   * f by VREDUCEPS (x minus x rounded down to an integer: exact, one instruction);
//   * 2^f by a degree-6 polynomial in Horner form, fitted to minimize the relative error on
//     [0, 1) (fitting error 7.5e-9 relative, 0.13 units of 2^-24; the rest is the
//     rounding of the six fused multiply-adds);
//   * the scaling by 2^floor(x) by VSCALEFPS, which floors its second operand itself and
//     rounds once, so results below 2^-126 round correctly into the subnormal range and
//     results below 2^-150 become 0 instead of flushing early.
// Eight vector instructions: VREDUCEPS, six FMAs and VSCALEFPS; no clamp is needed.
//
// Domain: x <= 0 (what softmax passes: a logit minus a max at least as large), -inf and NaN.
//   * Measured error: see property_tests/avx512_exp_test.cpp (every float in [-151, 0],
//     subnormal results in units of 2^-149); registry.inc declares the bound.
//   * 2^-inf is exactly 0, as softmax needs for masked weights: VREDUCEPS gives 0 for an
//     infinite input (so the polynomial gives 1) and VSCALEFPS(1, -inf) is 0. Inputs of
//     -2^23 and below have no fraction bits either: f = 0 and the scaling underflows to 0.
//   * NaN gives NaN (VREDUCEPS and VSCALEFPS propagate it). Positive x is outside the domain.
// Compiled for AVX-512F + DQ + FMA by its own target attribute, whatever the includer's flags:
// call it only where the CPU has them. Depends on immintrin.h only, which it includes for its
// users with -W(maybe-)uninitialized off: GCC 12.2 warns inside _mm512_undefined_ps(), the
// source operand of many unmasked AVX-512 intrinsics (GCC bug 105593, a false positive
// fixed in 12.3/13). Include this header before anything else that includes immintrin.h.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace mha::avx512 {

__attribute__((target("avx512f,avx512dq,fma"))) inline __m512 exp2_nonpositive(__m512 x) {
  // f = x - floor(x): imm 0x09 = keep 0 fraction bits, round down, no precision exception.
  const __m512 f = _mm512_reduce_ps(x, 0x09);
  __m512 p = _mm512_set1_ps(2.17022302e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.24396954e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67884064e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.54833412e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40229830e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147004e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  // p * 2^floor(x) with one rounding (subnormal results included).
  return _mm512_scalef_ps(p, x);
}

}  // namespace mha::avx512

// The kernels' vector 2^x evaluated for the exp tests: each function is defined in a file of
// its own, in a target region of its kernel's ISA (<kernel>_exp_eval.cpp), called by a test
// file with none only after the test has checked the CPU. x holds the inputs as floats;
// bit patterns run over negative floats, where ascending bits are descending values.
#pragma once

#include <cstdint>

namespace mha::test {

// The largest ulp error of the kernel's 2^x over the floats with bit patterns in [lo_bits,
// hi_bits] (the xsimd one: every stride-th of them), and the float where it occurs.
double avx2_exp2_worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, float* worst_x);
double avx512_exp2_worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, float* worst_x);
double xsimd_exp2_worst_error(std::uint32_t lo_bits, std::uint32_t hi_bits, std::uint32_t stride,
                              float* worst_x);

// How many of those floats do not give exactly +0, and the first that does not.
std::uint64_t avx2_exp2_nonzero_results(std::uint32_t lo_bits, std::uint32_t hi_bits,
                                        float* first_x);
std::uint64_t xsimd_exp2_nonzero_results(std::uint32_t lo_bits, std::uint32_t hi_bits,
                                         std::uint32_t stride, float* first_x);

// One vector: 8 floats (avx2), 16 (avx512), xsimd_exp2_width() (xsimd).
void avx2_exp2(const float* x, float* y);
void avx512_exp2(const float* x, float* y);
void xsimd_exp2(const float* x, float* y);
int xsimd_exp2_width();

}  // namespace mha::test

// mha/kv_types.h: the element types a KV cache can be stored in, and their conversions to
// and from fp32 in scalar code: what the reference widens with, and what a scalar kernel, a
// SIMD kernel's tail or a cache's append may use; a SIMD kernel's own conversions (F16C,
// FCVTL, shifts) are tested against these. The f16 and bf16 conversions are integer
// arithmetic on the bit patterns and i8's quantisation holds an FpEnvGuard, so every result
// is the same bits under any floating-point environment.
//
// C++17, header-only; needs mha/attention.h only.
//
//   f32   IEEE binary32, today's type.
//   f16   IEEE binary16: 1 sign, 5 exponent, 10 fraction bits; 65504 at most, steps of
//         2^-24 below 2^-14. Every f16 widens to fp32 exactly.
//   bf16  the top 16 bits of a binary32: fp32's range, 8 significant bits. Widens exactly.
//   i8    a signed byte q in [-127, 127] and one fp32 scale s per (token, KV head) row of
//         head_dim elements: the value is q s (formed in fp32 by a kernel: one rounding).
//
// Why a scale per row rather than per group of 32 elements (llama.cpp's q8_0, OpenVINO's
// group size): a row is what one decode step's dot product reads, so one scale multiplies
// the finished dot product (c q.k_j s_j) instead of every partial sum, K's arithmetic stays
// the fp32 kernel's, and the scales cost 4 / head_dim bytes per element (3 % at D = 128)
// instead of 4 / 32 (12.5 %). The price is range: one outlier in a row coarsens the whole
// row's steps.
#pragma once

#include <mha/attention.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mha {

// KvType, kv_type_name and kv_type_bytes are in mha/attention.h (Problem holds a KvType).

namespace kv {

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// binary16 -> fp32, exact. Infinities stay infinite; a NaN stays a NaN with its sign and
/// payload (shifted into fp32's fraction; a signalling one stays signalling, as in the
/// bits: nothing is computed).
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t frac = h & 0x3FFu;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (frac << 13));
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (frac << 13));
  if (frac == 0) return float_of(sign);
  // Subnormal: frac 2^-24. Normalise: shift the leading 1 into the implicit bit.
  std::uint32_t e = 113;  // fp32 biased exponent of 2^-14, one past the largest subnormal's
  while ((frac & 0x400u) == 0) {
    frac <<= 1;
    --e;
  }
  return float_of(sign | (e << 23) | ((frac & 0x3FFu) << 13));
}

/// fp32 -> binary16, rounded to nearest, ties to even: magnitudes from 65520 up become
/// infinity, those at most 2^-25 zero (with their sign). A NaN becomes a quiet NaN with its
/// sign and the top 9 bits of its payload.
inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t x = bits_of(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) {  // NaN
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x1FFu));
  }
  if (ax >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520
  if (ax >= 0x38800000u) {  // >= 2^-14: a normal half
    // Rebias the exponent (127 -> 15) and round the 13 dropped bits; a carry out of the
    // fraction steps the exponent, as it should.
    const std::uint32_t r = ax - 0x38000000u;
    return static_cast<std::uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  if (ax <= 0x33000000u) return sign;  // <= 2^-25: zero (2^-25 itself ties to even 0)
  // A subnormal half (or 2^-14 by rounding up): |f| / 2^-24 rounded to an integer.
  const std::uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;  // |f| = mant 2^(e - 150)
  const std::uint32_t shift = 126 - (ax >> 23);             // 14 .. 24
  const std::uint32_t q = mant >> shift, rest = mant & ((1u << shift) - 1);
  const std::uint32_t half = 1u << (shift - 1);
  const std::uint32_t up = rest > half || (rest == half && (q & 1u)) ? 1u : 0u;
  return static_cast<std::uint16_t>(sign | (q + up));
}

/// bfloat16 -> fp32, exact: the 16 bits are fp32's top half.
inline float bf16_to_f32(std::uint16_t b) { return float_of(static_cast<std::uint32_t>(b) << 16); }

/// fp32 -> bfloat16, rounded to nearest, ties to even (magnitudes past the largest bf16 by
/// half a step or more become infinity). A NaN becomes a quiet NaN with its sign and the
/// top 6 bits of its payload.
inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t x = bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/// Quantises one row of n fp32 values to i8: returns the row's scale s = max|x| / 127
/// (rounded to fp32) and writes q[j] = x[j] / s rounded to nearest, ties away from zero,
/// clamped to [-127, 127], so that |x[j] - q[j] s| <= s / 2 + 127 ulp(s), ulp(s) being at
/// most max(s 2^-23, 2^-149) (s is m / 127 rounded; |q| <= 127). An all-zero row has s = 0
/// and q = 0. A row holding a NaN gets s = NaN, one holding an infinity (and no NaN)
/// s = +inf, and q = 0: every q[j] s is then NaN, so whatever reads the row gives NaN, as
/// an fp32 row holding a NaN or an infinity makes attention's output NaN or infinite.
inline float quantize_i8_row(const float* x, std::int64_t n, std::int8_t* q) {
  const FpEnvGuard env;
  float max_abs = 0.0f;
  bool nan = false;
  for (std::int64_t j = 0; j < n; ++j) {
    const float a = float_of(bits_of(x[j]) & 0x7FFFFFFFu);
    if (a != a) nan = true;
    if (a > max_abs) max_abs = a;
  }
  const float scale = nan ? float_of(0x7FC00000u) : max_abs / 127.0f;
  const bool steps = scale > 0.0f && scale < float_of(0x7F800000u);  // false for NaN too
  for (std::int64_t j = 0; j < n; ++j) {
    std::int32_t v = 0;
    if (steps) {
      const double r = static_cast<double>(x[j]) / static_cast<double>(scale);
      const double t = r < 0 ? -r : r;
      v = t >= 127.0 ? 127 : static_cast<std::int32_t>(t + 0.5);
      if (r < 0) v = -v;
    }
    q[j] = static_cast<std::int8_t>(v);
  }
  return scale;
}

/// `rows` dense rows of `dim` fp32 values, x[r][e], stored as type t into dense rows at
/// `out` (dim elements of t each), as a cache's append stores them: f32 copied, f16 and bf16
/// rounded to nearest even, i8 quantised per row (quantize_i8_row) with its scale in
/// scales[r] (not touched for the other types).
inline void narrow_rows(KvType t, const float* x, std::int64_t rows, std::int64_t dim, void* out,
                        float* scales) {
  auto* bytes = static_cast<unsigned char*>(out);
  const std::int64_t n = rows * dim;
  switch (t) {
    case KvType::f32:
      std::memcpy(out, x, static_cast<std::size_t>(n) * sizeof(float));
      return;
    case KvType::f16:
    case KvType::bf16:
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint16_t h = t == KvType::f16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
        std::memcpy(bytes + 2 * i, &h, sizeof h);
      }
      return;
    case KvType::i8:
      for (std::int64_t r = 0; r < rows; ++r) {
        scales[r] =
            quantize_i8_row(x + r * dim, dim, reinterpret_cast<std::int8_t*>(bytes) + r * dim);
      }
      return;
  }
}

/// What element i of a K or V row of type t stores, in fp32 (exact): the value itself for
/// f32, f16 and bf16, the integer q for i8 (whose value is q times the row's scale).
inline float stored_at(KvType t, const void* row, std::int64_t i) {
  switch (t) {
    case KvType::f16:
      return f16_to_f32(static_cast<const std::uint16_t*>(row)[i]);
    case KvType::bf16:
      return bf16_to_f32(static_cast<const std::uint16_t*>(row)[i]);
    case KvType::i8:
      return static_cast<float>(static_cast<const std::int8_t*>(row)[i]);
    case KvType::f32:
      break;
  }
  return static_cast<const float*>(row)[i];
}

/// Element i's value as a kernel reads it, in fp32: stored_at, for i8 times the row's scale
/// (one rounding; `scale` is ignored for the other types).
inline float value_at(KvType t, const void* row, std::int64_t i, float scale) {
  const float x = stored_at(t, row, i);
  return t == KvType::i8 ? x * scale : x;
}

/// Rows [0, rows) of K or V (type t, elements `seq` apart, i8 scales `scale_seq` apart from
/// `scales`) widened to fp32, dense: out[j][d] = value_at(row j, d), dim elements per row.
inline void widen_rows(KvType t, const void* data, std::int64_t seq, const float* scales,
                       std::int64_t scale_seq, std::int64_t rows, std::int64_t dim, float* out) {
  const auto bytes = static_cast<std::int64_t>(kv_type_bytes(t));
  for (std::int64_t j = 0; j < rows; ++j) {
    const void* row = static_cast<const unsigned char*>(data) + j * seq * bytes;
    const float scale = t == KvType::i8 ? scales[j * scale_seq] : 1.0f;
    for (std::int64_t d = 0; d < dim; ++d) out[j * dim + d] = value_at(t, row, d, scale);
  }
}

}  // namespace kv
}  // namespace mha

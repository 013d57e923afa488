// The KV element types' scalar conversions (mha/kv_types.h), against definitions written
// from the formats alone: every f16 and bf16 widened, every one narrowed back, rounding at
// every boundary between two neighbours (the midpoint ties to even, the floats beside it go
// to their side), F16C's conversion as an oracle on random bit patterns where the CPU has
// it, and i8's row quantisation as properties (its scale, its error bound, NaN and infinity,
// the same bits under another floating-point environment).
#include <gtest/gtest.h>
#include <mha/kv_types.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace mha::test {
namespace {

using kv::bits_of;
using kv::float_of;

constexpr float kInf = std::numeric_limits<float>::infinity();

// The value of a binary16 bit pattern, from the format's definition (not a NaN).
double f16_value(std::uint16_t h) {
  const int exp = (h >> 10) & 0x1F, frac = h & 0x3FF;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0x1F) return sign * std::numeric_limits<double>::infinity();
  if (exp == 0) return sign * std::ldexp(frac, -24);
  return sign * std::ldexp(1024 + frac, exp - 25);
}

bool f16_is_nan(std::uint16_t h) { return (h & 0x7C00) == 0x7C00 && (h & 0x3FF) != 0; }
bool bf16_is_nan(std::uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0; }

TEST(KvF16, EveryHalfWidensToItsValue) {
  for (std::uint32_t i = 0; i < 0x10000; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const float f = kv::f16_to_f32(h);
    if (f16_is_nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      ASSERT_EQ(bits_of(f) >> 31, i >> 15) << std::hex << i;              // sign
      ASSERT_EQ((bits_of(f) >> 13) & 0x3FF, i & 0x3FF) << std::hex << i;  // payload
    } else {
      ASSERT_EQ(bits_of(f), bits_of(static_cast<float>(f16_value(h)))) << std::hex << i;
    }
  }
}

TEST(KvF16, EveryHalfNarrowsBackToItself) {
  for (std::uint32_t i = 0; i < 0x10000; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const std::uint16_t back = kv::f32_to_f16(kv::f16_to_f32(h));
    if (f16_is_nan(h)) {
      // A quiet NaN of the same sign, its payload's top bits kept (a signalling one quieted).
      ASSERT_EQ(back, i | 0x200u) << std::hex << i;
    } else {
      ASSERT_EQ(back, h) << std::hex << i;
    }
  }
}

// Between every two neighbouring halves a < b (and between 65504 and the 65536 the next
// step would reach, past which lies infinity): the midpoint goes to the even one, the float
// below it to a and the float above it to b. With the round trip above this pins down
// rounding for every finite float, subnormal halves and overflow included.
TEST(KvF16, RoundsToNearestEvenAtEveryBoundary) {
  for (std::uint16_t a = 0; a <= 0x7BFF; ++a) {
    const auto b = static_cast<std::uint16_t>(a + 1);  // 0x7C00 is infinity
    const double hi = a == 0x7BFF ? 65536.0 : f16_value(b);
    const double mid_exact = (f16_value(a) + hi) / 2;
    const auto mid = static_cast<float>(mid_exact);
    ASSERT_EQ(static_cast<double>(mid), mid_exact) << a;  // 12 significant bits: exact
    const std::uint16_t even = (a & 1) ? b : a;
    for (const std::uint16_t sign : {0, 0x8000}) {
      const float s = sign ? -1.0f : 1.0f;
      ASSERT_EQ(kv::f32_to_f16(s * mid), even | sign) << std::hex << a;
      ASSERT_EQ(kv::f32_to_f16(s * std::nextafter(mid, 0.0f)), a | sign) << std::hex << a;
      ASSERT_EQ(kv::f32_to_f16(s * std::nextafter(mid, kInf)), b | sign) << std::hex << a;
    }
  }
  EXPECT_EQ(kv::f32_to_f16(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(kv::f32_to_f16(-kInf), 0xFC00);
  EXPECT_EQ(kv::f32_to_f16(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(kv::f32_to_f16(-0.0f), 0x8000);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("f16c"))) std::uint16_t f16c_narrow(float f) {
  return static_cast<std::uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}

// F16C's VCVTPS2PH (round to nearest even; denormals kept whatever MXCSR says), bit for
// bit, NaNs included, on random bit patterns of every exponent.
TEST(KvF16, MatchesF16cOnRandomFloats) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C";
  std::mt19937 rng(7);
  for (int i = 0; i < (1 << 22); ++i) {
    const float f = float_of(static_cast<std::uint32_t>(rng()));
    ASSERT_EQ(kv::f32_to_f16(f), f16c_narrow(f)) << std::hex << bits_of(f);
  }
}
#endif

TEST(KvBf16, EveryBf16WidensToItsTopHalf) {
  for (std::uint32_t i = 0; i < 0x10000; ++i) {
    ASSERT_EQ(bits_of(kv::bf16_to_f32(static_cast<std::uint16_t>(i))), i << 16) << std::hex << i;
  }
}

TEST(KvBf16, EveryBf16NarrowsBackToItself) {
  for (std::uint32_t i = 0; i < 0x10000; ++i) {
    const auto b = static_cast<std::uint16_t>(i);
    const std::uint16_t back = kv::f32_to_bf16(kv::bf16_to_f32(b));
    ASSERT_EQ(back, bf16_is_nan(b) ? (i | 0x40u) : i) << std::hex << i;
  }
}

TEST(KvBf16, RoundsToNearestEvenAtEveryBoundary) {
  for (std::uint32_t a = 0; a <= 0x7F7F; ++a) {
    // The midpoint of a and a + 1 (0x7F80 is infinity) is a's bits with bit 15 set.
    const float mid = float_of((a << 16) | 0x8000u);
    const std::uint32_t even = (a & 1) ? a + 1 : a;
    for (const std::uint32_t sign : {0u, 0x8000u}) {
      const float s = sign ? -1.0f : 1.0f;
      ASSERT_EQ(kv::f32_to_bf16(s * mid), even | sign) << std::hex << a;
      ASSERT_EQ(kv::f32_to_bf16(s * std::nextafter(mid, 0.0f)), a | sign) << std::hex << a;
      ASSERT_EQ(kv::f32_to_bf16(s * std::nextafter(mid, kInf)), (a + 1) | sign) << std::hex << a;
    }
  }
  for (std::uint32_t payload : {1u, 0x7Fu, 0x3FFFFFu, 0x400000u, 0x7FFFFFu}) {
    const float nan = float_of(0xFF800000u | payload);
    EXPECT_EQ(kv::f32_to_bf16(nan), ((0xFF800000u | payload) >> 16) | 0x40u) << payload;
  }
}

// Rows of mixed magnitudes, zeros and repeated values, subnormals included.
rc::Gen<std::vector<float>> rows() {
  return rc::gen::nonEmpty(rc::gen::container<std::vector<float>>(
      rc::gen::map(rc::gen::tuple(rc::gen::inRange(-1000000, 1000001), rc::gen::inRange(-149, 120)),
                   [](const std::tuple<int, int>& t) {
                     return static_cast<float>(std::ldexp(std::get<0>(t) / 1e6, std::get<1>(t)));
                   })));
}

// ulp(s) for s >= 0, at least the smallest subnormal.
double ulp_of(float s) {
  return static_cast<double>(std::nextafter(s, kInf)) - static_cast<double>(s);
}

RC_GTEST_PROP(KvI8, ScaleIsMaxAbsOver127AndErrorsWithinHalfAStep, ()) {
  const std::vector<float> x = *rows();
  std::vector<std::int8_t> q(x.size());
  const float s = kv::quantize_i8_row(x.data(), static_cast<std::int64_t>(x.size()), q.data());
  float max_abs = 0.0f;
  for (float v : x) max_abs = std::max(max_abs, std::fabs(v));
  RC_ASSERT(bits_of(s) == bits_of(max_abs / 127.0f));
  const double bound = static_cast<double>(s) / 2 + 127 * ulp_of(s);
  bool reached = s < std::numeric_limits<float>::min();  // a subnormal scale: coarser steps
  for (std::size_t j = 0; j < x.size(); ++j) {
    RC_ASSERT(q[j] >= -127);  // never -128: the range is symmetric
    RC_ASSERT(std::fabs(static_cast<double>(x[j]) - q[j] * static_cast<double>(s)) <= bound);
    if (std::fabs(x[j]) == max_abs && max_abs > 0.0f) reached |= std::abs(q[j]) == 127;
  }
  RC_ASSERT(reached);  // the largest magnitude uses the whole range
}

TEST(KvI8, ZeroRowHasScaleZero) {
  const std::vector<float> x = {0.0f, -0.0f, 0.0f};
  std::vector<std::int8_t> q(3, 5);
  EXPECT_EQ(kv::quantize_i8_row(x.data(), 3, q.data()), 0.0f);
  EXPECT_EQ(q, (std::vector<std::int8_t>{0, 0, 0}));
}

TEST(KvI8, NanOrInfinityMakesEveryValueNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::vector<float>& x : std::vector<std::vector<float>>{
           {1.0f, nan, -2.0f}, {1.0f, kInf, 0.0f}, {-kInf, 3.0f, 0.5f}, {kInf, nan, 1.0f}}) {
    std::vector<std::int8_t> q(x.size(), 99);
    const float s = kv::quantize_i8_row(x.data(), 3, q.data());
    bool has_nan = false;
    for (float v : x) has_nan |= std::isnan(v);
    EXPECT_TRUE(has_nan ? std::isnan(s) : s == kInf);
    for (std::int8_t v : q) EXPECT_TRUE(std::isnan(v * s)) << int{v};
  }
}

// The same scale and bytes when the caller rounds upward (and, on x86-64, flushes
// denormals): the quantisation holds the default environment.
RC_GTEST_PROP(KvI8, SameBitsUnderAnotherRoundingMode, ()) {
  const std::vector<float> x = *rows();
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<std::int8_t> want(x.size()), got(x.size());
  const float s_want = kv::quantize_i8_row(x.data(), n, want.data());
  const int round = std::fegetround();
  std::fesetround(FE_UPWARD);
#if defined(__x86_64__) && defined(__GNUC__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040u);  // FTZ and DAZ
#endif
  const float s_got = kv::quantize_i8_row(x.data(), n, got.data());
#if defined(__x86_64__) && defined(__GNUC__)
  _mm_setcsr(csr);
#endif
  std::fesetround(round);
  RC_ASSERT(bits_of(s_got) == bits_of(s_want));
  RC_ASSERT(got == want);
}

}  // namespace
}  // namespace mha::test

// mha/support.h: what the tiled kernels share, so that each kernel file holds only its own
// algorithm and ISA. C++17, header-only, depends on mha/attention.h and the standard library
// only: a copied kernel is its file, its ISA helper header, mha/attention.h and this file.
//
// * Numbers: the base change constants, round_up, ceil_div.
// * The online softmax's edge rules: logit_shift (what a row's logits are taken relative
//   to) and row_lse (the log-sum-exp a row ends with), in natural log and in base 2.
// * Workspace: Carve lays scratch arrays out in a caller's mha::Workspace, and the same
//   code sizes it (kernels' *_workspace functions run their layout with no memory).
// * Blocks: a block is the g query heads of one KV head times Br query rows; for_each_block
//   visits them, and Block maps a block row t to its head, query row and tensor rows.
// * with_count: a run-time count 1..N as a compile-time constant, for microkernels
//   instantiated per row or column count.
// * RowPrefetch: software prefetch of the rows a later phase packs, spread over steps.
// * Caches: the L1d, L2 and L3 sizes the kernels derive their tile sizes from, read once
//   from the system (or from MHA_CACHES), with fallbacks; set_caches for a sweep over them.
// * Tilings: flash_tiling (blocked, neon), packed_rows_per_head (the kernels that pack each
//   KV tile), decode_tile_keys (the decode paths).
// * MHA_TARGET_BEGIN / MHA_TARGET_END: a region of a kernel file compiled for an ISA.
#pragma once

#include <mha/attention.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

/// MHA_TARGET_BEGIN("avx2,fma") ... MHA_TARGET_END: the functions defined between the two
/// (lambdas included) are compiled for the ISA named, as by __attribute__((target(...))),
/// and nothing else is. A kernel file includes every header before the region, so that the
/// inline functions of headers and the standard library's templates it instantiates are
/// compiled for baseline x86-64 like everyone else's copies of them: the linker keeps one
/// copy of each, and it must run on every CPU (cmake/check_isa_symbols.cmake). Compiling
/// the whole file with -mavx2 instead makes each such copy AVX2 code. The functions of the
/// region are called only after a CPU check; they may inline baseline code, not the
/// reverse. A region holds no namespace-scope object with a dynamic initializer. GCC does
/// not give the region's target to the hidden friends of a class template (friend functions
/// defined in the class), which it compiles for the file's flags: code in a region must not
/// pass vectors to such friends (xsimd's operators are some: kernels/xsimd/xsimd_kernel.h).
/// Other compilers (MSVC) take intrinsics anywhere: the macros are empty there.
#define MHA_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define MHA_TARGET_BEGIN(isa) \
  MHA_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define MHA_TARGET_END MHA_PRAGMA(clang attribute pop)
#elif defined(__GNUC__)
#define MHA_TARGET_BEGIN(isa) MHA_PRAGMA(GCC push_options) MHA_PRAGMA(GCC target(isa))
#define MHA_TARGET_END MHA_PRAGMA(GCC pop_options)
#else
#define MHA_TARGET_BEGIN(isa)
#define MHA_TARGET_END
#endif

/// with_count, which calls a kernel's lambda per microkernel, is always inlined: a lambda
/// defined in a target region cannot be inlined into baseline code, only into the region's
/// function that with_count is inlined into, and the early inliner sees that call only once
/// with_count is inlined. (Without it, the avx2 kernel's microkernels were called out of
/// line, and its prefill took 1.4 times as long. for_each_block, called once per block, is
/// not: inlining the whole block into the kernel's entry made the S microkernel spill an
/// accumulator, 1.2 times as long.) MHA_NOINLINE keeps a rarely taken path out of a hot
/// function whose register allocation it would otherwise share.
#if defined(__GNUC__) || defined(__clang__)
#define MHA_ALWAYS_INLINE inline __attribute__((always_inline))
#define MHA_NOINLINE __attribute__((noinline))
#else
#define MHA_ALWAYS_INLINE inline
#define MHA_NOINLINE
#endif

namespace mha::support {

constexpr double kLog2e = 1.4426950408889634074;  ///< log2(e): natural to base-2 logits
constexpr double kLn2 = 0.69314718055994530942;   ///< ln(2): base-2 to natural log

/// 2^f = e^(f ln2) by its degree-7 Taylor polynomial for f in [-1/2, 1/2], Horner order:
/// the coefficients ln2^k / k! for k = 7 down to 0, rounded to float (truncation error
/// (ln2 / 2)^8 / 8! < 2^-27 relative). The 2^x of the avx2, xsimd and highway kernels
/// (kernels/avx2/avx2_exp.h gives the algorithm and its measured error); avx512 and neon use
/// their own minimax polynomials.
inline constexpr float kExp2Taylor[8] = {
    1.52527338e-5f, 1.54035304e-4f, 1.33335581e-3f, 9.61812911e-3f,
    5.55041087e-2f, 2.40226507e-1f, 6.93147181e-1f, 1.0f};

/// Logit soft-capping (Problem::softcap) in a kernel's logit units: x -> cap tanh(x / cap), with
/// cap = c b rounded once for logits in units b (1: natural; log2(e): base 2, since
/// b c tanh(s / c) = (c b) tanh(s b / (c b))). tanh |y| = (1 - e) / (1 + e) with e = 2^(-k |x|),
/// k = 2 log2(e) / cap, and 2^z = 2^n 2^f as kernels/avx2/avx2_exp.h computes it (kExp2Taylor;
/// n built in the exponent field). Small |y| lose relative accuracy in 1 - e but not absolute,
/// which is what a logit's error is measured in.
///
/// Written without floating-point comparisons (integer ones on the bits), so that apply()'s
/// loop vectorizes for the includer's ISA under GCC's default -ftrapping-math: |x| is clamped
/// to `limit` = 126 / k (past it e < 2^-125.9 stays normal and tanh rounds to 1), so an
/// infinite x gives +-cap; a NaN x is returned as it is; the sign is put back by its bit.
/// Monotonic up to the last ulps only (the polynomial's segments meet within an ulp): a capped
/// logit may exceed the cap of a larger one by that much, which a running max taken over capped
/// maxima (cap(max s) for max cap(s)) tolerates: a weight of 2^(a few ulp) is as exact.
///
/// Measured within 3.22 u c b of c b tanh(x / (c b)) (u = 2^-24; the rounding of c b to cap
/// included), with and without fused multiply-adds, for caps from 2^-126 to 2^120
/// (property_tests/softcap_test.cpp); reference/tolerance.h allows 4 u c.
struct Softcap {
  float cap = 0.0f;         ///< c b, 0 when p has no soft-cap
  float k = 0.0f;           ///< 2 log2(e) / cap
  std::uint32_t limit = 0;  ///< the bits of 126 / k

  /// p's soft-cap (none: cap 0) for logits in units `units` (1 or kLog2e).
  static Softcap of(const Problem& p, double units);

  bool on() const { return cap != 0.0f; }

  MHA_ALWAYS_INLINE float operator()(float x) const {
    std::uint32_t xb, rb, limited;
    std::memcpy(&xb, &x, sizeof xb);
    const std::uint32_t ab = xb & 0x7FFFFFFFu;  // |x|; past 0x7F800000: NaN
    const std::uint32_t below = 0u - static_cast<std::uint32_t>(ab < limit);
    limited = (ab & below) | (limit & ~below);
    float a;
    std::memcpy(&a, &limited, sizeof a);
    const float z = -k * a;             // in [-126 - 2^-17, 0]
    const float shifter = 12583039.0f;  // 1.5 2^23 + 127: t's low bits hold n + 127
    const float t = z + shifter;
    const float f = z - (t - shifter);  // in [-1/2, 1/2], exact
    float p = kExp2Taylor[0];
    for (int i = 1; i < 8; ++i) p = p * f + kExp2Taylor[i];
    std::uint32_t tb;
    std::memcpy(&tb, &t, sizeof tb);
    const std::uint32_t scale_bits = tb << 23;  // 2^n, n >= -127 (never below -127 here)
    float scale;
    std::memcpy(&scale, &scale_bits, sizeof scale);
    const float e = p * scale;
    const float r = cap * ((1.0f - e) / (1.0f + e));
    std::memcpy(&rb, &r, sizeof rb);
    rb |= xb & 0x80000000u;
    const std::uint32_t nan = 0u - static_cast<std::uint32_t>(ab > 0x7F800000u);
    const std::uint32_t out = (xb & nan) | (rb & ~nan);
    float y;
    std::memcpy(&y, &out, sizeof y);
    return y;
  }

  /// s[j] = (*this)(s[j]) for j < n; a loop the compiler vectorizes for the caller's ISA when
  /// it is inlined there (always: kernels call it from their target regions).
  MHA_ALWAYS_INLINE void apply(float* s, std::int64_t n) const {
    const Softcap c = *this;  // in registers: s may alias nothing the loop reads but itself
    for (std::int64_t j = 0; j < n; ++j) s[j] = c(s[j]);
  }
};

inline Softcap Softcap::of(const Problem& p, double units) {
  Softcap c;
  if (!soft_capped(p)) return c;
  c.cap = static_cast<float>(static_cast<double>(p.softcap) * units);
  c.k = static_cast<float>(2.0 * kLog2e / static_cast<double>(c.cap));
  const auto limit = static_cast<float>(126.0 / static_cast<double>(c.k));
  std::memcpy(&c.limit, &limit, sizeof limit);
  return c;
}

/// ALiBi (Problem::alibi) in a kernel's logit units b (1: natural; log2(e): base 2): row i of
/// head h adds rate_h |d| to its logit of a key at distance d = pos_i - j, rate_h = -slope_h b
/// rounded once. add() takes a row's logits of consecutive keys from the first one's distance
/// d0: the k-th key's distance is d0 - k, evaluated in float as float(d0) - k (exact below 2^24;
/// beyond, two roundings), the bias rate |d| (one more) added to the logit (one more): the
/// roundings reference/tolerance.h's step 9 counts. A zero slope adds -0: the logit's bits stay.
///
/// add() also returns the biased row's max (a kernel's running max must be that of the biased
/// logits: the bias moves the max to other keys), taken on the bits as ordered integers (x's
/// bits, the magnitude bits flipped for negative x), so that its loop vectorizes for the
/// includer's ISA under GCC's default -ftrapping-math, where a float comparison does not. A NaN
/// of positive sign orders above +inf, one of negative sign below -inf: the max may be NaN; the
/// row's output is then NaN, as its NaN weight alone makes it.
struct Alibi {
  const float* slopes = nullptr;  ///< the problem's, null without ALiBi
  double units = 1.0;             ///< b
  std::int64_t position0 = 0;     ///< row 0's position among the keys

  /// p's ALiBi (none: slopes null) for logits in units `units` (1 or kLog2e).
  static Alibi of(const Problem& p, double units) {
    return {p.alibi, units, p.kv_len - p.q_len + p.alibi_offset};
  }

  bool on() const { return slopes != nullptr; }

  /// rate_h of query head h: -slope_h b, rounded once.
  float rate(std::int64_t head) const {
    return static_cast<float>(-static_cast<double>(slopes[head]) * units);
  }

  /// The distance pos_i - j of key j from query row i.
  std::int64_t distance(std::int64_t row, std::int64_t key) const { return position0 + row - key; }

  /// s[k] += rate |d0 - k| for k < n, d0 the distance of s[0]'s key; returns the max of the
  /// biased s[0 .. n) (-inf for n = 0).
  static MHA_ALWAYS_INLINE float add(float rate, std::int64_t d0, float* s, std::int64_t n) {
    constexpr std::int32_t kMinusInf = static_cast<std::int32_t>(0xFF800000u ^ 0x7FFFFFFFu);
    constexpr std::int64_t kChunk = std::int64_t{1} << 22;  // k exact in float
    std::int32_t most = kMinusInf;
    for (std::int64_t k0 = 0; k0 < n; k0 += kChunk) {
      const auto m = static_cast<std::int32_t>(n - k0 < kChunk ? n - k0 : kChunk);
      const auto base = static_cast<float>(d0 - k0);
      float* x = s + k0;
      for (std::int32_t k = 0; k < m; ++k) {
        const float y = x[k] + rate * std::fabs(base - static_cast<float>(k));
        x[k] = y;
        std::int32_t bits;
        std::memcpy(&bits, &y, sizeof bits);
        const std::int32_t ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF);
        most = ordered > most ? ordered : most;
      }
    }
    const std::int32_t bits = most ^ ((most >> 31) & 0x7FFFFFFF);
    float max;
    std::memcpy(&max, &bits, sizeof max);
    return max;
  }
};

/// ALiBi's reach: the sliding window past which no key weighs 2^-40 of its row's top one in a
/// causal problem with ALiBi (Problem::alibi), so that a kernel skips those keys' tiles as it
/// skips a window's. ALiBi's bias falls by slope_h per key of distance, while a logit can rise
/// above the row's by at most what the inputs bound: row i's logits are at most U_i = |scale| |q_i|
/// max_j |k_j| (or the soft-cap), and its max at least x_i, its logit of its last key (biased
/// by |alibi_offset|, capped). So a key whose distance passes d_i = (U_i - x_i + M) / slope_h
/// beyond the last key's has a weight below e^-M of the row's max, M = 40 ln 2 + 1: 2^-40,
/// far below the 2 u (u = 2^-24) of the row's sum that rounding may lose of each key within
/// the tolerance (reference/tolerance.h, step 10), so a kernel's result stays within it (the
/// 1 and the slack `err` below cover the roundings of the bound's own terms). The window is
/// the largest of the call's rows and heads, counted from the last key (the rows' positions
/// lie alibi_offset past it).
///
/// It costs a pass over K (and over V's keys it drops, which must be finite: a NaN or an
/// infinity there still reaches the output, as the contract says; so must q's and k's, else
/// there is no reach), 1 / (g q_len) of the attention's reads, so it is taken for calls of at
/// least kMinRows rows of all g heads only (never a decode step, which would read K twice);
/// and the window is the call's widest, one for all its heads and sequences: the parallel
/// driver's calls are one sequence and one KV head's group each. 0: no reach (no ALiBi, not
/// causal, too few rows, a zero slope, a non-finite input, or no key it could drop).
struct AlibiReach {
  static constexpr std::int64_t kMinRows = 64;

  /// f(value): value(d) is element d of a K or V row of type t as a kernel reads it (i8: the
  /// stored integer times scale, rounded once), in fp32; one instantiation per type, so that
  /// f's loop over d vectorizes.
  template <typename F>
  static void with_values(KvType t, const void* row, float scale, F&& f) {
    const auto bits16 = [row](std::int64_t d) {
      std::uint16_t h;
      std::memcpy(&h, static_cast<const unsigned char*>(row) + 2 * d, sizeof h);
      return std::uint32_t{h};
    };
    const auto float_of = [](std::uint32_t u) {
      float x;
      std::memcpy(&x, &u, sizeof x);
      return x;
    };
    switch (t) {
      case KvType::f32:
        return f([row](std::int64_t d) { return static_cast<const float*>(row)[d]; });
      case KvType::bf16:
        return f([&](std::int64_t d) { return float_of(bits16(d) << 16); });
      case KvType::f16:
        // The magnitude bits in fp32's place times 2^112 (exact for normals and subnormals
        // alike), the sign put back; exponent 31 (an infinity, a NaN) gives a NaN, so that
        // nothing finite comes of it.
        return f([&](std::int64_t d) {
          const std::uint32_t h = bits16(d);
          const std::uint32_t m = h & 0x7FFFu;
          const float a =
              m >= 0x7C00u ? std::numeric_limits<float>::quiet_NaN() : float_of(m << 13) * 0x1p112f;
          return (h & 0x8000u) != 0 ? -a : a;
        });
      case KvType::i8:
        return f([row, scale](std::int64_t d) {
          return static_cast<float>(static_cast<const std::int8_t*>(row)[d]) * scale;
        });
    }
  }

  /// sum_d a(d) b(d) over d < n in fp32 lanes (a vectorizable loop): within gamma(n) of the
  /// sum of |products| (u = 2^-24), which `err` below covers.
  template <typename A, typename B>
  static double dot(const A& a, const B& b, std::int64_t n) {
    constexpr int kLanes = 16;
    float acc[kLanes] = {};
    std::int64_t d = 0;
    for (; d + kLanes <= n; d += kLanes) {
      for (int l = 0; l < kLanes; ++l) acc[l] += a(d + l) * b(d + l);
    }
    for (; d < n; ++d) acc[0] += a(d) * b(d);
    double total = 0;
    for (float x : acc) total += static_cast<double>(x);
    return total;
  }

  /// The squared norm of a K or V row: +inf or NaN when an element is not finite, and +inf
  /// when the sum passes fp32's range (|x| near 2^64: then there is no reach either).
  static double squared_norm(const Problem& p, const KvView& row) {
    double n2 = 0;
    with_values(p.kv_type, row.data, p.kv_type == KvType::i8 ? *row.scale : 1.0f,
                [&](const auto& value) { n2 = dot(value, value, p.head_dim); });
    return n2;
  }

  /// The window (Problem::window) past which p's keys weigh below 2^-40, 0 for none (above).
  static std::int64_t of(const Problem& p, const float* q, KvView k, KvView v) {
    if (!has_alibi(p) || !p.causal || p.kv_len <= 0) return 0;
    const std::int64_t g = p.q_heads / p.kv_heads;
    if (g * p.q_len < kMinRows) return 0;
    // The keys a row sees at most: a window must be shorter to drop any.
    const std::int64_t most = p.window > 0 && p.window < p.kv_len ? p.window : p.kv_len;
    const double margin = 40.0 * std::log(2.0) + 1.0;
    // The slack of the bound's own roundings: its fp32 dot products and norms (D + 16) 2u
    // relative to U, the cap's, the offset's bias's, and the slope's (on it below).
    const double delta = static_cast<double>(p.head_dim + 16) * 0x1p-23;
    const bool capped = soft_capped(p);
    const double cap = p.softcap, scale = p.scale;
    // Row i keeps the keys within (need + M) / slope of its position, end_i - 1 +
    // alibi_offset: its window is that plus 1 - alibi_offset. (need counts the last key's
    // distance, |alibi_offset|, in its bias.)
    const auto off = static_cast<double>(p.alibi_offset);
    const auto window_for = [&](double need, double slope) {
      return (need + margin) / (slope * (1 - delta)) + 1.0 - off;
    };
    double smallest = std::numeric_limits<double>::infinity();
    for (std::int64_t h = 0; h < p.q_heads; ++h) smallest = std::min<double>(smallest, p.alibi[h]);
    // Every need is at least slope |alibi_offset| (x_i <= U_i): a window that cannot be
    // shorter than `most` reads nothing.
    if (!(window_for(smallest * std::fabs(off), smallest) < static_cast<double>(most))) return 0;

    // The keys some row sees: [lo, hi) (a sliding window's rows read no further back).
    const std::int64_t lo = first_key(p, 0), hi = visible_keys(p, p.q_len - 1);
    double widest = 0;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t kv_head = 0; kv_head < p.kv_heads; ++kv_head) {
        const auto key = [&](std::int64_t j) {
          return kv_row(k, p.kv_type, p.k, p.k_scale, b, j, kv_head);
        };
        double k_max2 = 0;
        for (std::int64_t j = lo; j < hi; ++j) {
          const double n2 = squared_norm(p, key(j));
          if (!(n2 < std::numeric_limits<double>::infinity())) return 0;  // NaN too
          k_max2 = std::max(k_max2, n2);
        }
        const double k_max = std::sqrt(k_max2);
        for (std::int64_t h = kv_head * g; h < (kv_head + 1) * g; ++h) {
          const double slope = p.alibi[h];
          for (std::int64_t i = 0; i < p.q_len; ++i) {
            const std::int64_t end = visible_keys(p, i);
            if (end == 0) continue;
            const float* qi = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
            const KvView last = key(end - 1);
            const auto q_value = [qi](std::int64_t d) { return qi[d]; };
            double qk = 0;
            with_values(p.kv_type, last.data, p.kv_type == KvType::i8 ? *last.scale : 1.0f,
                        [&](const auto& value) { qk = dot(q_value, value, p.head_dim); });
            const double q2 = dot(q_value, q_value, p.head_dim);
            double top = std::fabs(scale) * std::sqrt(q2) * k_max;  // U_i
            double x = scale * qk;
            const double off_bias = slope * std::fabs(off);
            const double err = delta * (top + (capped ? cap : 0.0) + off_bias);
            if (capped) {
              top = std::min(top, cap);
              x = cap * std::tanh(x / cap);
            }
            x -= off_bias;
            const double w = window_for(top - x + err, slope);
            if (!(w < static_cast<double>(most))) return 0;  // NaN: a non-finite input
            widest = std::max(widest, w);
          }
        }
      }
    }
    const auto window = static_cast<std::int64_t>(std::ceil(widest));
    if (window >= most) return 0;
    // The keys some row drops, [lo, hi - window): V's must be finite.
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t kv_head = 0; kv_head < p.kv_heads; ++kv_head) {
        for (std::int64_t j = lo; j < hi - window; ++j) {
          const double n2 = squared_norm(p, kv_row(v, p.kv_type, p.v, p.v_scale, b, j, kv_head));
          if (!(n2 < std::numeric_limits<double>::infinity())) return 0;
        }
      }
    }
    return window;
  }

  /// p with its window narrowed to ALiBi's reach (p itself when there is none).
  static Problem apply(const Problem& p, const float* q, KvView k, KvView v) {
    Problem r = p;
    const std::int64_t window = of(p, q, k, v);
    if (window > 0) r.window = window;
    return r;
  }
};

constexpr std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }
constexpr std::int64_t ceil_div(std::int64_t n, std::int64_t m) { return (n + m - 1) / m; }

/// What a row's logits are taken relative to, given its running max m. While every logit
/// so far is -inf (or NaN) the max is -inf, and exp(-inf - (-inf)) would be NaN where the
/// weight must be 0. Relative to 0 instead, -inf logits weigh exp(-inf) = 0 exactly and NaN
/// logits stay NaN; when a finite max arrives, the rescale factor exp(-inf - m) = 0 clears
/// the zeros (and keeps a NaN a NaN).
inline float logit_shift(float m) {
  return m == -std::numeric_limits<float>::infinity() ? 0.0f : m;
}

/// The lse of a row that saw some key, from its running max m and sum l of exp(s - m)
/// (natural-log logits). l >= 1 once a finite max was seen; l == 0 means every logit was
/// -inf (possible only with infinite inputs): the softmax is 0 / 0, o is NaN, and so is
/// lse, as the reference's two-pass formula gives.
inline float row_lse(float m, float l) {
  return l == 0.0f ? std::numeric_limits<float>::quiet_NaN() : logit_shift(m) + std::log(l);
}

/// The same for base-2 logits (s log2(e)) and l = sum 2^(s - m): (m + log2 l) ln 2,
/// evaluated in double so that the base change adds no rounding of its own.
inline float row_lse_base2(float m, float l) {
  if (l == 0.0f) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(static_cast<double>(logit_shift(m)) * kLn2 +
                            std::log(static_cast<double>(l)));
}

/// How a row ends (o = acc / divisor, and its lse) from its running max m and sum l of
/// exp(s - m) (natural-log logits), with its head's sink logit (mha::sink_of: -inf for
/// none, which gives l and row_lse exactly).
inline RowEnd row_end(float m, float l, float sink) {
  if (sink == -std::numeric_limits<float>::infinity()) return {l, row_lse(m, l)};
  return sink_row_end(logit_shift(m), l, sink);
}

/// The same for base-2 logits (s log2(e)) and l = sum 2^(s - m).
inline RowEnd row_end_base2(float m, float l, float sink) {
  if (sink == -std::numeric_limits<float>::infinity()) return {l, row_lse_base2(m, l)};
  return sink_row_end(static_cast<double>(logit_shift(m)) * kLn2, l, sink);
}

/// Lays arrays out one after another in a workspace, each on a 64-byte boundary (cache
/// lines; aligned vector loads). Constructed over nullptr it hands out no memory and only
/// counts: a kernel's workspace size is its layout run that way, so the size and the use
/// cannot disagree. bytes() includes the slack to align the first array of any base.
class Carve {
 public:
  static constexpr std::size_t kAlign = 64;

  explicit Carve(void* base) : base_(static_cast<unsigned char*>(base)) {
    if (base_ != nullptr) {
      const auto at = reinterpret_cast<std::uintptr_t>(base_);
      used_ = (kAlign - at % kAlign) % kAlign;  // aligns the first array
    }
  }

  /// The next n elements of T (n >= 0), uninitialized; nullptr while only counting.
  template <typename T>
  T* take(std::int64_t n) {
    static_assert(std::is_trivially_copyable_v<T> && alignof(T) <= kAlign);
    T* at = base_ != nullptr ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    const std::size_t size = static_cast<std::size_t>(n) * sizeof(T);
    used_ += (size + kAlign - 1) / kAlign * kAlign;
    return at;
  }

  /// Bytes the arrays taken so far need in a workspace at any address.
  std::size_t bytes() const { return base_ != nullptr ? used_ : used_ + kAlign - 1; }

 private:
  unsigned char* base_;
  std::size_t used_ = 0;
};

/// The workspace size of a kernel whose arrays are laid out by `layout(carve)`.
template <typename Layout>
std::size_t workspace_bytes(Layout&& layout) {
  Carve carve(nullptr);
  layout(carve);
  return carve.bytes();
}

/// The data caches one core works in, in bytes: what the kernels size their tiles for.
struct Caches {
  std::int64_t l1d;     ///< level 1 data cache of one core
  std::int64_t l2;      ///< level 2, the share of one core where cores share it
  std::int64_t l3 = 0;  ///< level 3, the share of one CPU (its size over the CPUs sharing
                        ///< it); 0 when there is none or it is not known
};

/// Used for a size the system does not give: the smallest of the cores the kernels are
/// meant for (AMD Zen 2-4: 32 KiB L1d, 512 KiB-1 MiB L2; Intel Xeon since Skylake-SP: 32-48
/// KiB, 1-2 MiB; Arm Neoverse N1/V1/V2: 64 KiB, 1-2 MiB), so a tile sized from it fits
/// everywhere.
constexpr Caches kFallbackCaches{32 << 10, 512 << 10};

namespace detail {

/// "48K", "2048K", "1M", "32768": bytes; -1 if s is not such a size (or above 1 GiB).
inline std::int64_t parse_cache_size(const char* s) {
  if (s == nullptr || *s < '0' || *s > '9') return -1;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(s, &end, 10);
  std::int64_t unit = 1;
  if (*end == 'K' || *end == 'k') unit = std::int64_t{1} << 10;
  if (*end == 'M' || *end == 'm') unit = std::int64_t{1} << 20;
  if (unit != 1) ++end;
  while (*end == '\n' || *end == ' ') ++end;
  if (*end != '\0' || n == 0 || n > (1ull << 30) / static_cast<unsigned long long>(unit)) return -1;
  return static_cast<std::int64_t>(n) * unit;
}

/// The first line of a small text file, or "" if it cannot be read.
inline std::string read_line(const std::string& path) {
  std::string line;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[256];
    if (std::fgets(buf, sizeof buf, f) != nullptr) line = buf;
    std::fclose(f);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

/// How many CPUs a sysfs shared_cpu_list ("0", "0-1", "0,64", "0-3,8-11") names; 1 if unreadable.
/// CPU numbers outside [0, 2^22] make a list unreadable: no system has them (Linux's NR_CPUS
/// is at most 8192), and with them the count could overflow.
inline std::int64_t count_cpus(const std::string& list) {
  constexpr long kMaxCpu = 1L << 22;
  std::int64_t count = 0;
  const char* s = list.c_str();
  while (*s != '\0') {
    char* end = nullptr;
    const long first = std::strtol(s, &end, 10);
    if (end == s) return 1;
    long last = first;
    if (*end == '-') {
      s = end + 1;
      last = std::strtol(s, &end, 10);
      if (end == s || last < first) return 1;
    }
    if (first < 0 || last > kMaxCpu) return 1;
    count += last - first + 1;
    s = *end == ',' ? end + 1 : end;
    if (*end != ',' && *end != '\0') return 1;
  }
  return count > 0 ? count : 1;
}

/// The caches MHA_CACHES's value `value` ("L1D,L2" or "L1D,L2,L3", e.g. "32K,512K" or
/// "32K,512K,4M"; L3 the share of one CPU, none when left out) sets; throws
/// std::invalid_argument for anything else (null reads as empty).
inline Caches parse_caches(const char* value) {
  if (value == nullptr) value = "";
  const std::string text = value;
  const std::size_t first = text.find(',');
  const std::size_t second = first == std::string::npos ? first : text.find(',', first + 1);
  const std::int64_t l1d =
      first != std::string::npos ? parse_cache_size(text.substr(0, first).c_str()) : -1;
  const std::int64_t l2 =
      first != std::string::npos
          ? parse_cache_size(text.substr(first + 1, second - (first + 1)).c_str())
          : -1;
  const std::int64_t l3 =
      second != std::string::npos ? parse_cache_size(text.substr(second + 1).c_str()) : 0;
  if (l1d < (4 << 10) || l2 < l1d || l3 < 0) {
    throw std::invalid_argument(std::string("MHA_CACHES=") + value +
                                " is not L1D,L2 or L1D,L2,L3 sizes such as 32K,512K or "
                                "32K,512K,4M (L1D at least 4K, L2 at least L1D, each at most "
                                "1024M)");
  }
  return {l1d, l2, l3};
}

/// MHA_CACHES="L1D,L2[,L3]" (e.g. "32K,512K") if set; else Linux's sysfs for CPU 0 (each
/// cache's size over the CPUs sharing it); else kFallbackCaches, per size (no L3).
inline Caches read_caches() {
  if (const char* env = std::getenv("MHA_CACHES"); env != nullptr && *env != '\0') {
    return parse_caches(env);
  }
  Caches c{0, 0, 0};
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    const std::string level = read_line(dir + "/level"), type = read_line(dir + "/type");
    const std::int64_t bytes = parse_cache_size(read_line(dir + "/size").c_str());
    if (bytes <= 0 || type == "Instruction") continue;
    const std::int64_t share = bytes / count_cpus(read_line(dir + "/shared_cpu_list"));
    if (level == "1") c.l1d = share;
    if (level == "2") c.l2 = share;
    if (level == "3") c.l3 = share;
  }
  if (c.l1d < (4 << 10)) c.l1d = kFallbackCaches.l1d;
  if (c.l2 < c.l1d) c.l2 = std::max(kFallbackCaches.l2, c.l1d);
  return c;
}

/// What caches() returns instead of the system's while l1d is not 0 (set_caches).
struct CachesOverride {
  std::atomic<std::int64_t> l1d{0}, l2{0}, l3{0};
};
inline CachesOverride caches_override;

}  // namespace detail

/// The caches of the CPU the process runs on, read once (or those set_caches set). Tile
/// sizes, and so workspace sizes and the order of floating-point sums, follow from them:
/// results are the same for every thread count and every run on one machine, and may differ
/// in the last bits between machines with different caches. MHA_CACHES="L1D,L2[,L3]" sets
/// them (to reproduce another machine's tiling; the tests run the kernels under several); a
/// malformed value throws std::invalid_argument.
inline Caches caches() {
  static const Caches system = detail::read_caches();
  const detail::CachesOverride& o = detail::caches_override;
  if (const std::int64_t l1d = o.l1d.load(std::memory_order_relaxed); l1d != 0) {
    return {l1d, o.l2.load(std::memory_order_relaxed), o.l3.load(std::memory_order_relaxed)};
  }
  return system;
}

/// Makes caches() return `c` from now on, in every thread, or the system's caches again for
/// c.l1d == 0: what MHA_CACHES does, for a program that sweeps cache configurations in one
/// process (mha_bench's cliffs family). Call it only while no kernel runs and no workspace
/// sized before it will be used after it: workspace sizes follow the caches.
inline void set_caches(const Caches& c) {
  detail::CachesOverride& o = detail::caches_override;
  o.l2.store(c.l2, std::memory_order_relaxed);
  o.l3.store(c.l3, std::memory_order_relaxed);
  o.l1d.store(c.l1d, std::memory_order_relaxed);
}

/// Tile sizes: Bc keys per KV tile and Br query rows of each of the g heads per block.
struct Tiling {
  std::int64_t keys;
  std::int64_t rows_per_head;
};

/// The tiling of kernels that compute S and P V a few rows at a time over a packed K^T tile
/// and V read in place (blocked, neon), from the caches of one core.
///
/// KV tile, Bc keys: the K^T tile and the V tile hold Bc x head_dim floats each, half of
/// L1d each. The S phase streams K^T once per block row and the PV phase streams V once per
/// block row, so each phase reuses one operand from L1 across all R rows, with room for the
/// row's Q, scores and accumulator beside it, and both stay in L2 between the phases. D =
/// 128: Bc = 32 keys with a 32 KiB L1d, 48 with 48 KiB, 64 with 64 KiB (Neoverse). At least
/// 16 keys keep the vectorized loop over keys long (above D = 256 at 32 KiB the tiles
/// outgrow half of L1 and live in L1 and L2); at most 256 bound the score tile.
///
/// Query block, R = g x Br rows: the block's Q rows, accumulators (R x head_dim each) and
/// scores (R x Bc) in a quarter of L2, the rest of which holds the KV tiles and what streams
/// in. 512 KiB L2, D = 128, g = 4, Bc = 32: R x (2 x 128 + 32) floats <= 128 KiB: R = 112,
/// Br = 28. 2 MiB: Br = 64, the cap. Each KV tile then comes from memory once per Br query
/// rows of its g heads (2 R D multiply-adds per key). Br is at most 64, so causal block
/// skipping keeps a fine grain, and at least 1: a block is at least one row of each head.
inline Tiling flash_tiling(const Problem& p, const Caches& c = caches()) {
  constexpr std::int64_t kMinKeys = 16, kMaxKeys = 256;
  constexpr std::int64_t kMaxRowsPerHead = 64;
  const std::int64_t group = p.q_heads / p.kv_heads;
  const std::int64_t kv_tile_floats = c.l1d / 2 / std::int64_t{sizeof(float)};
  // Sized for a whole tile even when kv_len is shorter, so that Br does not depend on
  // kv_len: the workspace of a shorter problem (a split-KV chunk) is never the larger.
  const std::int64_t keys = std::clamp(kv_tile_floats / p.head_dim, kMinKeys, kMaxKeys);
  Tiling t;
  t.keys = std::min(keys, p.kv_len);
  const std::int64_t block_floats = c.l2 / 4 / std::int64_t{sizeof(float)};
  const std::int64_t row_floats = 2 * p.head_dim + keys;
  t.rows_per_head =
      std::clamp(block_floats / (group * row_floats), std::int64_t{1}, kMaxRowsPerHead);
  t.rows_per_head = std::min(t.rows_per_head, p.q_len);
  return t;
}

/// Query rows per head, Br, of a block of the kernels that pack every KV tile they read
/// (avx2, avx512, xsimd-*, highway-*): the block's R = g Br rows share each packed tile.
/// `row_floats` is the kernel's scratch per block row (Q, scores, O), `tile_floats` a KV
/// tile's packed K and V, `max_rows` the most rows the kernel's workspace allows.
///
/// R is what amortizes the tile: packing it (transposes, about 10^4 instructions at D = 128)
/// and bringing each of its panels into L1 cost the same whatever R, so per FLOP they shrink
/// as 1 / R, and so do the K and V bytes read from memory (2 / R bytes per FLOP). With avx2
/// on an AMD Zen 3 core (512 KiB L2), D = 128: packing took 9% of the time at R = 85 and
/// 2-5% at R = 256 to 512, and from R = 85 to R = 512 the prefill ran 13-17% faster on 1
/// thread and 19-22% on 2 (g 1 and 4; D = 256: 4.4 GFLOP/s at R = 1, 64 at 64, 77 at 512).
///
/// Why the L2 does not bound R: the block's own rows are read and written once per tile
/// wherever they are, so their traffic per FLOP, about (3 D + 2 Bc) / (Bc D) bytes (0.04 at
/// D = Bc = 128: 3 GB/s at 75 GFLOP/s), does not depend on R; where they outgrow the L2
/// they stream from the L3, a few percent of its bandwidth, in sequential streams the
/// hardware prefetchers follow. At R = 512, D = 128, they are 1.5 MiB, three times that
/// Zen 3 L2, and run fastest. So the block takes what fits in half of the L2 and half of the
/// CPU's share of the L3, and:
/// * at least kMinRows = 256, whatever the caches: below it packing costs more than the
///   stream does from any level. Without an L3 (or one not known, as with a two-size
///   MHA_CACHES), the rows beyond the L2 stream from memory: 3 GB/s, a small part of one
///   core's bandwidth, which many cores together would share, hence no more than the least.
/// * at most kMaxRows = 512, a unit of the driver (mha/parallel.h) and no faster beyond
///   (Xeon, 2 MiB L2), and at most max_rows.
/// Br = R / g, at least 1 and at most q_len.
inline std::int64_t packed_rows_per_head(const Problem& p, std::int64_t row_floats,
                                         std::int64_t tile_floats, std::int64_t max_rows,
                                         const Caches& c = caches()) {
  constexpr std::int64_t kMinRows = 256, kMaxRows = 512;
  const std::int64_t group = p.q_heads / p.kv_heads;
  const std::int64_t budget = (c.l2 / 2 + c.l3 / 2) / std::int64_t{sizeof(float)} - tile_floats;
  const std::int64_t most = std::min(kMaxRows, max_rows);
  const std::int64_t rows = std::clamp(budget / row_floats, std::min(kMinRows, most), most);
  return std::clamp(rows / group, std::int64_t{1}, p.q_len);
}

/// Keys per KV tile of a decode path (few query rows per KV head, lanes along head_dim):
/// the tile's K and V rows, 2 x keys x head_dim floats, in two thirds of L1d, so that the
/// group's other rows read them from L1 after the first, while the next tile is prefetched
/// into L2. A multiple of `step` (the keys a microkernel finishes at once), at least `step`
/// and at most 256. D = 128: 32 keys with a 48 KiB L1d, 16 with 32 KiB.
inline std::int64_t decode_tile_keys(const Problem& p, std::int64_t step,
                                     const Caches& c = caches()) {
  const std::int64_t fit = c.l1d * 2 / 3 / (2 * p.head_dim * std::int64_t{sizeof(float)});
  return std::clamp(fit / step * step, step, std::max<std::int64_t>(step, 256 / step * step));
}

/// Software prefetch, into L2, of tensor rows a later phase of a tiled kernel reads (packs), a
/// few cache lines per step, spread over the calls of the phase before it. Token-major K and
/// V rows lie a page or more apart, too far for the hardware prefetchers, so without it every
/// packed row starts with a cache miss; spread over the microkernel calls of the phase
/// before, the next rows arrive while the FMAs run. Prefetches never fault and change no
/// result; every address is an element of the rows. __builtin_prefetch (GCC, Clang) with
/// locality 2: PREFETCHT1 on x86-64, PRFM PLDL2KEEP on AArch64.
class RowPrefetch {
 public:
  RowPrefetch() = default;
  /// Rows [0, rows) of `base` (row stride `seq`, `dim` floats each), over about `calls` steps.
  RowPrefetch(const float* base, std::int64_t seq, std::int64_t rows, std::int64_t dim,
              std::int64_t calls)
      : row_(base),
        seq_(seq),
        last_(dim - 1),
        lines_((dim + 15) / 16 + 1),  // +1: a row need not start at a line
        rows_left_(rows),
        per_step_((rows * lines_ + calls - 1) / std::max<std::int64_t>(calls, 1)) {}

  /// The next few lines.
  void step() {
    for (std::int64_t n = 0; n < per_step_ && rows_left_ > 0; ++n) {
      __builtin_prefetch(row_ + std::min(16 * line_, last_), 0, 2);
      if (++line_ == lines_) {
        line_ = 0;
        // Not past the last row: its offset may overflow (check() bounds a stride only by
        // the rows that use it).
        if (--rows_left_ > 0) row_ += seq_;
      }
    }
  }

 private:
  const float* row_ = nullptr;  ///< the row being prefetched; line_ is its next line
  std::int64_t seq_ = 0, last_ = 0, lines_ = 1, line_ = 0, rows_left_ = 0, per_step_ = 0;
};

/// One block of a problem: the g = q_heads / kv_heads query heads reading KV head kv_head,
/// query rows [r0, r0 + br) of each. Block row t (0 <= t < rows = g br) is query head
/// head0 + t / br and query row r0 + t % br: rows of one head are consecutive, and all g
/// heads share every KV tile while it is in cache.
struct Block {
  std::int64_t batch = 0, kv_head = 0;
  std::int64_t head0 = 0;  ///< the group's first query head: kv_head * g
  std::int64_t r0 = 0;     ///< the first query row
  std::int64_t br = 0;     ///< query rows per head
  std::int64_t rows = 0;   ///< g * br

  std::int64_t head(std::int64_t t) const { return head0 + t / br; }
  std::int64_t row(std::int64_t t) const { return r0 + t % br; }

  /// Block row t's q row, o row and lse element (nullptr when lse is).
  const float* q_row(const Problem& p, const float* q, std::int64_t t) const {
    return q + batch * p.q.batch + row(t) * p.q.seq + head(t) * p.q.head;
  }
  float* o_row(const Problem& p, float* o, std::int64_t t) const {
    return o + batch * p.o.batch + row(t) * p.o.seq + head(t) * p.o.head;
  }
  float* lse_at(const Problem& p, float* lse, std::int64_t t) const {
    return lse != nullptr ? lse + batch * p.lse.batch + head(t) * p.lse.head + row(t) : nullptr;
  }
  /// The block's KV head: [kv_len][head_dim], row strides p.k.seq and p.v.seq.
  const float* k_head(const Problem& p, const float* k) const {
    return k + batch * p.k.batch + kv_head * p.k.head;
  }
  const float* v_head(const Problem& p, const float* v) const {
    return v + batch * p.v.batch + kv_head * p.v.head;
  }

  /// The keys some row of the block sees are [first_key, keys): its first row's first (0
  /// without a sliding window) to its last row's end. Tiles outside them are masked for every
  /// row and never visited.
  std::int64_t keys(const Problem& p) const { return visible_keys(p, r0 + br - 1); }
  std::int64_t first_key(const Problem& p) const { return mha::first_key(p, r0); }
  /// Of the tile [c0, c0 + tile_keys), block row t sees the keys [tile_first_seen,
  /// tile_keys_seen): the end is the tile's end below the causal diagonal, where the tile
  /// crosses it, or c0 above it; the first is c0 unless the row's sliding window begins
  /// within the tile (or after it: then the two are equal, and the row sees none of it).
  std::int64_t tile_keys_seen(const Problem& p, std::int64_t t, std::int64_t c0,
                              std::int64_t tile_keys) const {
    return std::clamp(visible_keys(p, row(t)) - c0, std::int64_t{0}, tile_keys);
  }
  std::int64_t tile_first_seen(const Problem& p, std::int64_t t, std::int64_t c0,
                               std::int64_t tile_keys) const {
    return std::clamp(mha::first_key(p, row(t)) - c0, std::int64_t{0}, tile_keys);
  }
};

/// f(block) for every (batch, KV head, run of rows_per_head query rows) of p, in order.
template <typename F>
void for_each_block(const Problem& p, std::int64_t rows_per_head, F&& f) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.kv_heads; ++kv_head) {
      for (std::int64_t r0 = 0; r0 < p.q_len; r0 += rows_per_head) {
        Block block;
        block.batch = b;
        block.kv_head = kv_head;
        block.head0 = kv_head * group;
        block.r0 = r0;
        block.br = std::min(rows_per_head, p.q_len - r0);
        block.rows = group * block.br;
        f(static_cast<const Block&>(block));
      }
    }
  }
}

namespace detail {
template <int... I, typename F>
MHA_ALWAYS_INLINE void with_count(std::int64_t n, F& f, std::integer_sequence<int, I...>) {
  // Exactly one comparison holds: n is clamped to 1 .. kMax by the caller. Largest first:
  // whole row groups and whole key or column steps are the common case.
  constexpr int kMax = sizeof...(I);
  (void)((n == kMax - I && (f(std::integral_constant<int, kMax - I>{}), true)) || ...);
}
}  // namespace detail

/// f(std::integral_constant<int, n>{}) with n clamped to 1 .. kMax: a microkernel's row,
/// key or column count as a compile-time constant.
template <int kMax, typename F>
MHA_ALWAYS_INLINE void with_count(std::int64_t n, F&& f) {
  static_assert(kMax >= 1);
  detail::with_count(std::clamp<std::int64_t>(n, 1, kMax), f,
                     std::make_integer_sequence<int, kMax>{});
}

}  // namespace mha::support

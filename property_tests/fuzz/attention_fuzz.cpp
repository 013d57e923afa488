// Fuzz target: any bytes -> one attention problem (every field and stride of mha::Problem),
// its pointers, its values and calls of the public API: mha::check, check_call,
// mha::attention (best kernel and by name), the parallel driver, one kernel alone, and
// mha::merge. Every input must either be rejected with std::invalid_argument and the
// documented message, before anything is read or written, or be computed with
//  * no access out of bounds: each buffer is allocated at exactly the size check() admits,
//    so AddressSanitizer sees a byte past it, and the floats inside a buffer that are no
//    element of its tensor (stride padding) hold a NaN pattern that must not change (a
//    write) and that a read would carry into the output;
//  * no undefined behaviour and no leak (the sanitizers);
//  * inputs unchanged, and outputs within the shared tolerance of the double-precision
//    reference (reference/tolerance.h), compared as property_tests/compare.cpp compares.
// Anything else aborts, which libFuzzer records as a crash.
//
// The input, in order (reads past its end give zeros; make_corpus.py writes seeds). It is
// read whole before anything runs, every section whatever the problem (merge only when the
// calls byte asks for it), so the sections that check() needs may come last:
//   problem    six sizes (batch, q_len, kv_len, q_heads, kv_heads, head_dim), each a field();
//              1 byte causal; scale(); the strides of q, k, v, o (strides()); lse_strides()
//   addresses  five fake addresses (q, k, v, o, lse) for check_call, never dereferenced
//   memory     1 byte: which buffers share memory, or which output overlaps what; 1 byte more
//              for the modes that place a pointer (call_pointers())
//   values     1 byte mode, 1 byte exponent, 8 bytes seed
//   calls      1 byte: which calls (and whether for every kernel); 1 byte: kernel; 1 byte:
//              threads and workspace offset
//   merge      (calls bit 5 only) 1 byte count; the parts' o strides and lse strides; 1 byte
//              flags; with flag bit 2, 1 byte: the null part
//   sinks      Problem::sinks (read_sinks()): 1 byte mode (0: null), then sink_value()s
//   lengths    Problem::q_lens and kv_lens: 1 byte, bit 0 q_lens, bit 1 kv_lens; for each
//              given, 1 byte mode and its field()s (read_length_array())
//   overlaps   1 byte: a fake o or lse moved into the sinks, q_lens or kv_lens array (then a
//              field(): the offset in floats); 1 byte: one of those arrays placed inside the
//              real o's or lse's buffer (then 1 byte: the offset) (read_extras())
//   window     Problem::window (read_window()): 1 byte mode (0: none), then its value
//   softcap    Problem::softcap (read_softcap()): 1 byte mode (0: none), then its value
//   alibi      Problem::alibi and alibi_offset (read_alibi()): 1 byte mode (0: none), then
//              the slopes and the offset
// The last six sections came last, so that every older seed (zeros there) has no sinks, no
// per-sequence lengths, no window, no soft-cap and no ALiBi. A sinks or length array is allocated
// at exactly its size (q_heads floats, batch int64s) when that is at most kMaxArray elements, else
// left null.
#include <mha/attention.h>
#include <mha/parallel.h>
#include <mha/registry.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "reference.h"
#include "tolerance.h"

namespace mha::fuzz {
namespace {

using i64 = std::int64_t;
__extension__ typedef __int128 i128;  // exact offsets and addresses (GCC and clang have it)
constexpr i64 kMax = std::numeric_limits<i64>::max();
constexpr i64 kMin = std::numeric_limits<i64>::min();

// Buffers are allocated only for problems this small: every float of all the buffers
// together (2 MiB), and B H Lq Lk D multiply-adds (the reference costs about as much again).
// Enough for split-KV decoding (Lk >= 512) and D past the largest tile, and small enough for
// a few hundred inputs a second.
constexpr double kMaxFloats = 1 << 19;
constexpr double kMaxWork = 1 << 19;

constexpr std::uint32_t kPattern = 0x7FC0DEADu;  // a quiet NaN, as the property tests use

i64 saturate(i128 v) { return v > kMax ? kMax : (v < kMin ? kMin : static_cast<i64>(v)); }

// One int64 field. Selectors below 0x80 are the value itself (0..127), so small problems are
// one byte a size; the others reach medium sizes, the edges of int64 arithmetic, negative
// values and any 64-bit value.
i64 field(Bytes& in) {
  static constexpr i64 kSpecial[32] = {0,
                                       kMax,
                                       kMin,
                                       kMax - 1,
                                       kMax / 2,
                                       kMax / 4,
                                       kMax / 4 + 1,
                                       kMax / 8,
                                       i64{1} << 31,
                                       (i64{1} << 31) - 1,
                                       i64{1} << 32,
                                       (i64{1} << 32) + 1,
                                       i64{1} << 40,
                                       i64{1} << 48,
                                       i64{1} << 61,
                                       (i64{1} << 61) + 1,
                                       i64{1} << 62,
                                       (i64{1} << 62) + 1,
                                       3037000499,
                                       3037000500,
                                       (i64{1} << 21) - 1,
                                       i64{1} << 21,
                                       65535,
                                       65536,
                                       16777216,
                                       16777217,
                                       -(i64{1} << 31),
                                       -(i64{1} << 62),
                                       kMin + 1,
                                       511,
                                       512,
                                       4096};
  const std::uint8_t s = in.u8();
  if (s < 0x80) return s;
  if (s < 0xa0) return i64{s & 0x1f} << 8 | in.u8();  // 0..8191
  if (s < 0xc0) return kSpecial[s & 0x1f];
  if (s < 0xe0) return -1 - (s & 0x1f);
  return static_cast<i64>(in.u64());
}

// Any float, NaN and infinities included: 4 bytes, its bits.
float any_float(Bytes& in) {
  const std::uint32_t bits = in.u32();
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float scale(Bytes& in, i64 head_dim) {
  static constexpr float kSpecial[16] = {0.0f,
                                         -0.0f,
                                         std::numeric_limits<float>::infinity(),
                                         -std::numeric_limits<float>::infinity(),
                                         std::numeric_limits<float>::quiet_NaN(),
                                         std::numeric_limits<float>::min(),
                                         std::numeric_limits<float>::denorm_min(),
                                         std::numeric_limits<float>::max(),
                                         -std::numeric_limits<float>::max(),
                                         1e-30f,
                                         1e30f,
                                         1.0f,
                                         -1.0f,
                                         0.5f,
                                         -0.125f,
                                         1e-3f};
  switch (in.u8() % 4) {
    case 0:  // make_problem's
      return head_dim > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)))
                          : 1.0f;
    case 1:
      return any_float(in);
    case 2:
      return kSpecial[in.u8() % 16];
    default:
      return static_cast<float>(static_cast<std::int8_t>(in.u8())) / 16.0f;
  }
}

// Strides of a [batch][len][heads][dim] tensor: dense and padded layouts, broadcast, and any
// three values. Products saturate, as make_problem's do.
Strides strides(Bytes& in, i64 len, i64 heads, i64 dim) {
  const auto mul = [](i64 a, i64 b) { return saturate(i128{a} * b); };
  const auto add = [](i64 a, i64 b) { return saturate(i128{a} + b); };
  switch (in.u8() % 8) {
    case 0:
      return dense_strides(Layout::token_major, len, heads, dim);
    case 1:
      return dense_strides(Layout::head_major, len, heads, dim);
    case 2: {  // token-major, each stride padded
      const i64 head = add(dim, in.u8());
      const i64 seq = add(mul(heads, head), in.u8());
      return {add(mul(len, seq), in.u8()), seq, head};
    }
    case 3: {  // head-major, each stride padded
      const i64 seq = add(dim, in.u8());
      const i64 head = add(mul(len, seq), in.u8());
      return {add(mul(heads, head), in.u8()), seq, head};
    }
    case 4: {  // one sequence shared by the batch
      Strides s = dense_strides(Layout::token_major, len, heads, dim);
      s.batch = 0;
      return s;
    }
    case 5: {
      Strides s;
      s.batch = field(in);
      s.seq = field(in);
      s.head = field(in);
      return s;
    }
    case 6:
      return {0, 0, 0};
    default: {  // token-major with one stride of any value
      Strides s = dense_strides(Layout::token_major, len, heads, dim);
      const int which = in.u8() % 3;
      (which == 0 ? s.batch : which == 1 ? s.seq : s.head) = field(in);
      return s;
    }
  }
}

LseStrides lse_strides(Bytes& in, i64 batch, i64 heads, i64 len) {
  const auto mul = [](i64 a, i64 b) { return saturate(i128{a} * b); };
  const auto add = [](i64 a, i64 b) { return saturate(i128{a} + b); };
  switch (in.u8() % 4) {
    case 0:
      return {mul(heads, len), len};
    case 1:
      return {len, mul(batch, len)};  // [head][batch][row]
    case 2: {
      const i64 head = add(len, in.u8());
      return {add(mul(heads, head), in.u8()), head};
    }
    default: {
      LseStrides s;
      s.batch = field(in);
      s.head = field(in);
      return s;
    }
  }
}

Problem decode_problem(Bytes& in) {
  Problem p;
  p.batch = field(in);
  p.q_len = field(in);
  p.kv_len = field(in);
  p.q_heads = field(in);
  p.kv_heads = field(in);
  p.head_dim = field(in);
  p.causal = (in.u8() & 1) != 0;
  p.scale = scale(in, p.head_dim);
  p.q = strides(in, p.q_len, p.q_heads, p.head_dim);
  p.k = strides(in, p.kv_len, p.kv_heads, p.head_dim);
  p.v = strides(in, p.kv_len, p.kv_heads, p.head_dim);
  p.o = strides(in, p.q_len, p.q_heads, p.head_dim);
  p.lse = lse_strides(in, p.batch, p.q_heads, p.q_len);
  return p;
}

// A sinks array (q_heads floats) or a length array (batch int64s) is allocated, and so
// given, only up to this many elements: check() reads every element of a non-null one.
constexpr i64 kMaxArray = i64{1} << 16;

// One sink logit. A selector byte below 0x80 is (s - 64) / 4, in [-16, 15.75] (below, about
// and above typical logits); 0x80 to 0x9f name special values (infinities, NaNs, huge and
// tiny values, the edges of expf); the others take the next 4 bytes as any bits.
float sink_value(Bytes& in) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float max = std::numeric_limits<float>::max();
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float kSpecial[32] = {
      -inf,    inf,     nan,      -nan,      max,    -max,
      1e30f,   -1e30f,  88.8f,    -88.8f,    104.0f, -104.0f,
      -150.0f, 1e4f,    -1e4f,    tiny,      -tiny,  0.0f,
      -0.0f,   0x1p64f, 0x1p100f, -0x1p100f, 1e-30f, std::numeric_limits<float>::min(),
      128.0f,  -128.0f, 127.9f,   1e38f,     -1e38f, 60.0f,
      -60.0f,  0.125f};
  const std::uint8_t s = in.u8();
  if (s < 0x80) return static_cast<float>(s - 64) / 4.0f;
  if (s < 0xa0) return kSpecial[s & 0x1f];
  return any_float(in);
}

// Problem::sinks for `heads` query heads. Mode byte % 4: 0 none; 1 one sink_value() for every
// head; 2 one per head; 3 one for every head, then head field() (when there is one) gets
// another. Null, with nothing read past the mode byte, when heads is outside [1, kMaxArray].
std::unique_ptr<float[]> read_sinks(Bytes& in, i64 heads) {
  const int mode = in.u8() % 4;
  if (mode == 0 || heads < 1 || heads > kMaxArray) return nullptr;
  const auto n = static_cast<std::size_t>(heads);
  std::unique_ptr<float[]> sinks(new float[n]);
  if (mode == 2) {
    for (std::size_t h = 0; h < n; ++h) sinks[h] = sink_value(in);
    return sinks;
  }
  std::fill(sinks.get(), sinks.get() + n, sink_value(in));
  if (mode == 3) {
    const i64 h = field(in);
    const float x = sink_value(in);
    if (h >= 0 && h < heads) sinks[static_cast<std::size_t>(h)] = x;
  }
  return sinks;
}

// One length array of `batch` sequences whose tensors hold `most` rows (q_lens: q_len,
// kv_lens: kv_len). Mode byte % 4: 0 each a field(); 1 each most - field() (0: the whole
// length, negative: past it); 2 each `most`, then sequence field() (when there is one) gets
// field(); 3 each (b * field() + field()) mod (most + 1): valid lengths for any batch (each a
// field() when most < 0). Null, with nothing read past the mode byte, when batch is outside
// [1, kMaxArray].
std::unique_ptr<i64[]> read_length_array(Bytes& in, i64 batch, i64 most) {
  const int mode = in.u8() % 4;
  if (batch < 1 || batch > kMaxArray) return nullptr;
  const auto n = static_cast<std::size_t>(batch);
  std::unique_ptr<i64[]> lens(new i64[n]);
  switch (mode) {
    case 0:
      for (std::size_t b = 0; b < n; ++b) lens[b] = field(in);
      break;
    case 1:
      for (std::size_t b = 0; b < n; ++b) lens[b] = saturate(i128{most} - field(in));
      break;
    case 2: {
      std::fill(lens.get(), lens.get() + n, most);
      const i64 b = field(in);
      const i64 x = field(in);
      if (b >= 0 && b < batch) lens[static_cast<std::size_t>(b)] = x;
      break;
    }
    default: {
      const i128 step = field(in), start = field(in), m = i128{most} + 1;
      for (std::size_t b = 0; b < n; ++b) {
        const i128 x = static_cast<i128>(b) * step + start;
        lens[b] = m > 0 ? static_cast<i64>((x % m + m) % m) : saturate(x);
      }
    }
  }
  return lens;
}

// Problem::window for a problem of kv_len keys. Mode byte % 4: 0 none; 1 a field(); 2 kv_len
// - field() (0: the whole length, negative: past it); 3 a byte + 1 (1 to 256 keys).
i64 read_window(Bytes& in, i64 kv_len) {
  switch (in.u8() % 4) {
    case 0:
      return 0;
    case 1:
      return field(in);
    case 2:
      return saturate(i128{kv_len} - field(in));
    default:
      return i64{in.u8()} + 1;
  }
}

// Problem::softcap. Mode byte % 4: 0 none; 1 any float (4 bytes: NaN, negative, subnormal, huge
// and +inf among them); 2 2^(byte / 8 - 16), 2^-16 to 2^15.9 (caps that matter for some
// logits); 3 a special: +inf, 2^-126, 2^120 or their neighbours outside, -0, by a byte.
float read_softcap(Bytes& in) {
  switch (in.u8() % 4) {
    case 0:
      return 0.0f;
    case 1:
      return any_float(in);
    case 2:
      return std::exp2(static_cast<float>(in.u8()) / 8.0f - 16.0f);
    default: {
      static constexpr float kSpecial[8] = {std::numeric_limits<float>::infinity(),
                                            0x1p-126f,
                                            0x1p120f,
                                            0x1.fffffcp-127f,  // 2^-126's neighbours outside
                                            0x1.000002p120f,
                                            -0.0f,
                                            -std::numeric_limits<float>::infinity(),
                                            std::numeric_limits<float>::quiet_NaN()};
      return kSpecial[in.u8() % 8];
    }
  }
}

// An ALiBi slope by a byte: below 0x80, 2^(b / 8 - 12), 2^-12 to 2^3.9 (a nudge to a wall over
// the problem's distances); below 0xa0 a special (0, -0, 2^32 and its neighbour outside, the
// smallest subnormal and its negative, +-inf, NaN); else any float (4 bytes).
float alibi_slope(Bytes& in) {
  static constexpr float kSpecial[16] = {0.0f,
                                         -0.0f,
                                         0x1p32f,
                                         0x1.000002p32f,
                                         0x1p-149f,
                                         -0x1p-149f,
                                         std::numeric_limits<float>::infinity(),
                                         -std::numeric_limits<float>::infinity(),
                                         std::numeric_limits<float>::quiet_NaN(),
                                         -1.0f,
                                         0.5f,
                                         1.0f,
                                         0x1p-8f,
                                         0x1p-16f,
                                         100.0f,
                                         0x1p31f};
  const std::uint8_t b = in.u8();
  if (b < 0x80) return std::exp2(static_cast<float>(b) / 8.0f - 12.0f);
  if (b < 0xa0) return kSpecial[b & 0xf];
  return any_float(in);
}

// Problem::alibi for `heads` query heads and alibi_offset. Mode byte % 4: 0 none; 1 one
// alibi_slope() for every head; 2 one per head; 3 the geometric slopes of the ALiBi paper,
// 2^(-8 (h + 1) / heads). Then, for modes 1 to 3, the offset: a field(). Null slopes, with
// nothing read past the mode byte, when heads is outside [1, kMaxArray].
std::unique_ptr<float[]> read_alibi(Bytes& in, i64 heads, i64* offset) {
  const int mode = in.u8() % 4;
  *offset = 0;
  if (mode == 0 || heads < 1 || heads > kMaxArray) return nullptr;
  const auto n = static_cast<std::size_t>(heads);
  std::unique_ptr<float[]> slopes(new float[n]);
  if (mode == 1) {
    std::fill(slopes.get(), slopes.get() + n, alibi_slope(in));
  } else {
    for (std::size_t h = 0; h < n; ++h) {
      slopes[h] = mode == 2
                      ? alibi_slope(in)
                      : std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads));
    }
  }
  *offset = field(in);
  return slopes;
}

// The input's last sections (see the top): the sinks, the lengths, where check_call finds
// those arrays relative to the outputs, the window, the soft-cap and ALiBi.
struct Extras {
  std::unique_ptr<float[]> sinks;          // q_heads floats, or null
  std::unique_ptr<i64[]> q_lens, kv_lens;  // batch each, or null
  std::unique_ptr<float[]> alibi;          // q_heads floats, or null
  i64 alibi_offset = 0;
  // Fake addresses: output 1 (o) or 2 (lse) moved to `fake_offset` floats from the start of
  // array `fake_array` (0 sinks, 1 q_lens, 2 kv_lens, 3 alibi), when that array is given; else
  // none.
  int fake_output = 0, fake_array = 0;
  i64 fake_offset = 0;
  // Real buffers: array `place_array` (1 sinks, 2 q_lens, 3 kv_lens; 0 none) copied inside
  // the buffer of o (or of lse), `place_offset` floats in (rounded up to 8 bytes).
  int place_array = 0;
  bool place_in_lse = false;
  std::uint8_t place_offset = 0;
  i64 window = 0;
  float softcap = 0.0f;
};

Extras read_extras(Bytes& in, const Problem& p) {
  Extras e;
  e.sinks = read_sinks(in, p.q_heads);
  const std::uint8_t which = in.u8();
  if ((which & 1) != 0) e.q_lens = read_length_array(in, p.batch, p.q_len);
  if ((which & 2) != 0) e.kv_lens = read_length_array(in, p.batch, p.kv_len);
  const std::uint8_t fake = in.u8();
  e.fake_output = fake & 3;
  e.fake_array = (fake >> 2) & 3;
  if (e.fake_output == 1 || e.fake_output == 2) e.fake_offset = field(in);
  const std::uint8_t place = in.u8();
  e.place_array = place & 3;
  e.place_in_lse = (place & 4) != 0;
  if (e.place_array != 0) e.place_offset = in.u8();
  e.window = read_window(in, p.kv_len);
  e.softcap = read_softcap(in);
  e.alibi = read_alibi(in, p.q_heads, &e.alibi_offset);
  return e;
}

// ALiBi slopes, sinks and lengths of q_heads and batch elements that check() admitted: each
// slope within [0, 2^32], each sink finite or -inf, each length within [0, the tensors'
// length].
void verify_admitted_arrays(const Problem& p) {
  for (i64 h = 0; p.alibi != nullptr && h < p.q_heads; ++h) {
    const float a = p.alibi[h];
    if (!(a >= 0.0f && a <= 4294967296.0f)) {
      fail("check admitted alibi[" + std::to_string(h) + "] = " + std::to_string(a));
    }
  }
  for (i64 h = 0; p.sinks != nullptr && h < p.q_heads; ++h) {
    const float s = p.sinks[h];
    if (std::isnan(s) || s == std::numeric_limits<float>::infinity()) {
      fail("check admitted sinks[" + std::to_string(h) + "] = " + std::to_string(s));
    }
  }
  const struct {
    const char* name;
    const i64* lens;
    i64 most;
  } arrays[] = {{"q_lens", p.q_lens, p.q_len}, {"kv_lens", p.kv_lens, p.kv_len}};
  for (const auto& a : arrays) {
    for (i64 b = 0; a.lens != nullptr && b < p.batch; ++b) {
      if (a.lens[b] < 0 || a.lens[b] > a.most) {
        fail(std::string("check admitted ") + a.name + "[" + std::to_string(b) +
             "] = " + std::to_string(a.lens[b]));
      }
    }
  }
}

// check()'s verdict on p, modeled: check() itself on p without ALiBi, sinks and lengths for
// every other rule, and the rules on those, which come after every rule but those on lse's
// strides: the first head whose ALiBi slope is outside [0, 2^32] (NaN too), an offset outside
// [-2^62, 2^62], the first head whose sink is NaN or +inf, then the first sequence of q_lens,
// then of kv_lens, whose length is outside [0, the tensors' length].
std::string expected_check(const Problem& p) {
  Problem plain = p;
  plain.alibi = nullptr;
  plain.sinks = nullptr;
  plain.q_lens = plain.kv_lens = nullptr;
  std::string other = check(plain);
  const auto starts = [&](const char* prefix) { return other.rfind(prefix, 0) == 0; };
  if (!other.empty() && !starts("lse strides ") && !starts("highest offset of lse ")) return other;
  for (i64 h = 0; p.alibi != nullptr && h < p.q_heads; ++h) {
    const float a = p.alibi[h];
    if (std::isnan(a) || a < 0.0f || a > 4294967296.0f) {
      return "alibi[" + std::to_string(h) + "] (" + detail::str_g(a) + ") must be within [0, 2^32]";
    }
  }
  if (p.alibi != nullptr && (p.alibi_offset < -(i64{1} << 62) || p.alibi_offset > (i64{1} << 62))) {
    return "alibi_offset (" + std::to_string(p.alibi_offset) + ") must be within [-2^62, 2^62]";
  }
  for (i64 h = 0; p.sinks != nullptr && h < p.q_heads; ++h) {
    const float s = p.sinks[h];
    if (std::isnan(s) || s == std::numeric_limits<float>::infinity()) {
      return "sinks[" + std::to_string(h) + "] (" + std::to_string(s) + ") must be finite or -inf";
    }
  }
  const struct {
    const char* name;
    const i64* lens;
    i64 most;
    const char* bound;
  } arrays[] = {{"q_lens", p.q_lens, p.q_len, "q_len"}, {"kv_lens", p.kv_lens, p.kv_len, "kv_len"}};
  for (const auto& a : arrays) {
    for (i64 b = 0; a.lens != nullptr && b < p.batch; ++b) {
      if (a.lens[b] < 0 || a.lens[b] > a.most) {
        return std::string(a.name) + "[" + std::to_string(b) + "] (" + std::to_string(a.lens[b]) +
               ") must be within [0, " + a.bound + " " + std::to_string(a.most) + "]";
      }
    }
  }
  return other;
}

// Highest element offset of a tensor in exact arithmetic (sizes >= 1, strides >= 0).
i128 highest(const i64* extent, const i64* stride, int rank) {
  i128 sum = 0;
  // Each term is below 2^126; capped at 2^100, four cannot overflow whatever check() let by.
  for (int i = 0; i < rank; ++i) sum += std::min(i128{extent[i] - 1} * stride[i], i128{1} << 100);
  return sum;
}

// Calls f(offset) for every element of a [batch][len][heads][dim] tensor, stopping when f
// returns false. `len` is a number of rows, or a function of the batch element giving its
// rows (a ragged sequence's first rows only).
inline i64 rows_in(i64 len, i64) { return len; }
template <typename Len>
auto rows_in(const Len& len, i64 b) -> decltype(len(b)) {
  return len(b);
}

template <typename Len, typename F>
void for_each_offset(const Strides& s, i64 batch, const Len& len, i64 heads, i64 dim, F&& f) {
  for (i64 b = 0; b < batch; ++b)
    for (i64 l = 0; l < rows_in(len, b); ++l)
      for (i64 h = 0; h < heads; ++h)
        for (i64 d = 0; d < dim; ++d)
          if (!f(b * s.batch + l * s.seq + h * s.head + d)) return;
}

template <typename Len, typename F>
void for_each_lse_offset(const LseStrides& s, i64 batch, i64 heads, const Len& len, F&& f) {
  for (i64 b = 0; b < batch; ++b)
    for (i64 h = 0; h < heads; ++h)
      for (i64 i = 0; i < rows_in(len, b); ++i)
        if (!f(b * s.batch + h * s.head + i)) return;
}

// What check() admits must hold: every tensor's highest byte offset fits int64_t, and no two
// elements of o, or of lse, share an offset (checked by marking every element when o and lse
// are small enough to enumerate).
void verify_admitted(const Problem& p) {
  const i64 head_dim = p.head_dim;
  const struct {
    const char* name;
    const Strides& s;
    i64 len, heads;
  } tensors[] = {{"q", p.q, p.q_len, p.q_heads},
                 {"k", p.k, p.kv_len, p.kv_heads},
                 {"v", p.v, p.kv_len, p.kv_heads},
                 {"o", p.o, p.q_len, p.q_heads}};
  for (const auto& t : tensors) {
    const i64 extent[4] = {p.batch, t.len, t.heads, head_dim};
    const i64 stride[4] = {t.s.batch, t.s.seq, t.s.head, 1};
    expect(t.s.batch >= 0 && t.s.seq >= 0 && t.s.head >= 0,
           std::string("check admitted a negative stride of ") + t.name);
    expect(highest(extent, stride, 4) <= kMax / 4,
           std::string("check admitted ") + t.name + " whose highest byte offset overflows");
  }
  const i64 lse_sizes[3] = {p.batch, p.q_heads, p.q_len};
  const i64 lse_stride[3] = {p.lse.batch, p.lse.head, 1};
  expect(p.lse.batch >= 0 && p.lse.head >= 0, "check admitted a negative lse stride");
  expect(highest(lse_sizes, lse_stride, 3) <= kMax / 4,
         "check admitted lse whose highest byte offset overflows");

  const auto distinct = [](const char* name, i64 extent, double elements, auto&& each) {
    if (static_cast<double>(extent) > kMaxFloats) return;
    // More elements than offsets: two must share one.
    expect(elements <= static_cast<double>(extent),
           std::string("check admitted ") + name + " with more elements than offsets");
    std::vector<bool> seen(static_cast<std::size_t>(extent));
    each([&](i64 off) {
      expect(off >= 0 && off < extent, std::string(name) + " element outside its extent");
      expect(!seen[static_cast<std::size_t>(off)],
             std::string("check admitted ") + name + " whose elements overlap");
      seen[static_cast<std::size_t>(off)] = true;
      return true;
    });
  };
  const double rows =
      static_cast<double>(p.batch) * static_cast<double>(p.q_len) * static_cast<double>(p.q_heads);
  distinct("o", o_extent(p), rows * static_cast<double>(head_dim),
           [&](auto&& f) { for_each_offset(p.o, p.batch, p.q_len, p.q_heads, head_dim, f); });
  distinct("lse", lse_extent(p), rows,
           [&](auto&& f) { for_each_lse_offset(p.lse, p.batch, p.q_heads, p.q_len, f); });
  verify_admitted_arrays(p);
}

// check_call's verdict for these pointers (q, k, v, o, lse), from exact address ranges. The
// inputs are q, k and v, then the problem's sinks and ALiBi slopes (q_heads floats each),
// q_lens and kv_lens (batch int64s each) when given; each output, o first, is checked against
// each input in turn.
std::string expected_verdict(const Problem& p, const float* const* ptr) {
  std::string message = expected_check(p);
  if (!message.empty()) return message;
  const char* names[9] = {"q", "k", "v", "o", "lse", "sinks", "alibi", "q_lens", "kv_lens"};
  for (int t = 0; t < 4; ++t) {
    if (ptr[t] == nullptr) return std::string(names[t]) + " must not be null";
  }
  const void* base[9] = {ptr[0],  ptr[1],  ptr[2],   ptr[3],   ptr[4],
                         p.sinks, p.alibi, p.q_lens, p.kv_lens};
  const i128 bytes[9] = {i128{q_extent(p)} * 4, i128{k_extent(p)} * 4,   i128{v_extent(p)} * 4,
                         i128{o_extent(p)} * 4, i128{lse_extent(p)} * 4, i128{p.q_heads} * 4,
                         i128{p.q_heads} * 4,   i128{p.batch} * 8,       i128{p.batch} * 8};
  const auto begin = [&](int t) { return i128{reinterpret_cast<std::uintptr_t>(base[t])}; };
  const auto end = [&](int t) { return begin(t) + bytes[t]; };
  const auto overlap = [&](int a, int b) {
    return base[a] != nullptr && base[b] != nullptr && begin(a) < end(b) && begin(b) < end(a);
  };
  const int outputs = ptr[4] != nullptr ? 5 : 4;
  const int inputs[7] = {0, 1, 2, 5, 6, 7, 8};
  for (int out = 3; out < outputs; ++out) {
    for (int in : inputs) {
      if (overlap(out, in)) {
        return std::string(names[out]) + " overlaps " + names[in] +
               ": outputs must not share memory with inputs";
      }
    }
  }
  if (outputs == 5 && overlap(3, 4)) return "lse overlaps o: outputs must not share memory";
  return std::string();
}

// An address a process can have (x86-64 and AArch64 user space: below 2^47), or `fallback`.
std::uintptr_t plausible(i128 a, std::uintptr_t fallback) {
  return a >= 4096 && a < (i128{1} << 47) ? static_cast<std::uintptr_t>(a) : fallback;
}

// Fake addresses for check_call (q, k, v, o, lse), never dereferenced: each tensor in a
// region of its own (4 TiB apart), at an offset from another tensor, or null.
std::array<std::uintptr_t, 5> read_fake_addresses(Bytes& in) {
  std::array<std::uintptr_t, 5> addr = {};
  const auto region = [](int t) { return static_cast<std::uintptr_t>(t + 1) << 42; };
  for (int t = 0; t < 5; ++t) {
    switch (in.u8() % 4) {
      case 0:
        addr[t] = 0;
        break;
      case 1:
        addr[t] = region(t);
        break;
      case 2: {
        const int other = in.u8() % 5;
        const std::uintptr_t base = addr[other] != 0 ? addr[other] : region(other);
        addr[t] = plausible(i128{base} + i128{field(in)} * 4, region(t));
        break;
      }
      default:
        addr[t] = region(t) + 4 * std::uintptr_t{in.u8()};
        break;
    }
  }
  return addr;
}

// check_call on the fake addresses, with o or lse moved into p's sinks, q_lens, kv_lens or
// alibi array as the extras say (those arrays are real). A rejected call must be rejected by
// mha::attention too, before it reads anything (a read would fault), and an invalid problem
// by mha::merge.
void fake_addresses(std::array<std::uintptr_t, 5> addr, const Extras& extras, const Problem& p) {
  const void* arrays[4] = {p.sinks, p.q_lens, p.kv_lens, p.alibi};
  const void* array = arrays[extras.fake_array];
  if ((extras.fake_output == 1 || extras.fake_output == 2) && array != nullptr) {
    std::uintptr_t& a = extras.fake_output == 1 ? addr[3] : addr[4];
    a = plausible(i128{reinterpret_cast<std::uintptr_t>(array)} + i128{extras.fake_offset} * 4, a);
  }
  const float* ptr[5];
  for (int t = 0; t < 5; ++t) ptr[t] = reinterpret_cast<const float*>(addr[t]);
  const std::string want = expected_verdict(p, ptr);
  const std::string got = check_call(p, ptr[0], ptr[1], ptr[2], ptr[3], ptr[4]);
  expect(got == want, "check_call said \"" + got + "\", expected \"" + want + "\"");
  if (want.empty()) return;
  float* o = const_cast<float*>(ptr[3]);
  float* lse = const_cast<float*>(ptr[4]);
  expect_rejected([&] { attention(p, ptr[0], ptr[1], ptr[2], o, lse, 1); },
                  "mha::attention: " + want, "mha::attention on fake addresses");
  const std::string problem = check(p);
  if (problem.empty()) return;
  const float* part_o[1] = {ptr[3]};
  const float* part_lse[1] = {ptr[4]};
  Parts parts;
  parts.count = 1;
  parts.o = part_o;
  parts.lse = part_lse;
  parts.o_strides = p.o;
  parts.lse_strides = p.lse;
  expect_rejected([&] { merge(p, parts, o, lse); }, "mha::merge: " + problem,
                  "mha::merge of an invalid problem");
}

std::uint32_t bits_of(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// A buffer of exactly `size` floats (AddressSanitizer's redzone starts right after it).
struct Buffer {
  std::unique_ptr<float[]> data;
  i64 size = 0;
  explicit Buffer(i64 n) : data(new float[static_cast<std::size_t>(n)]), size(n) { fill_pattern(); }
  void fill_pattern() {
    for (i64 i = 0; i < size; ++i) std::memcpy(&data[static_cast<std::size_t>(i)], &kPattern, 4);
  }
  bool is_pattern(i64 i) const {
    std::uint32_t bits;
    std::memcpy(&bits, &data[static_cast<std::size_t>(i)], 4);
    return bits == kPattern;
  }
  std::vector<float> snapshot() const { return {data.get(), data.get() + size}; }
  bool same_as(const std::vector<float>& s) const {
    return std::memcmp(data.get(), s.data(), static_cast<std::size_t>(size) * 4) == 0;
  }
};

// The values of the inputs: uniform in [-1, 1), times 2^e for any e, with NaN, Inf, zeros,
// subnormals and large values sprinkled in, or a few repeated values (equal keys, constant V).
class Values {
 public:
  explicit Values(Bytes& in) : mode_(in.u8() % 4), exponent_(static_cast<std::int8_t>(in.u8())) {
    state_ = in.u64();
  }
  float next() {
    const std::uint64_t r = bits();
    const float unit = static_cast<float>(static_cast<double>(r >> 40) * 0x1p-23 - 1.0);
    switch (mode_) {
      case 0:
        return unit;
      case 1:
        return std::ldexp(unit, exponent_);
      case 2: {
        static constexpr float kSpecial[8] = {std::numeric_limits<float>::quiet_NaN(),
                                              std::numeric_limits<float>::infinity(),
                                              -std::numeric_limits<float>::infinity(),
                                              0.0f,
                                              -0.0f,
                                              std::numeric_limits<float>::denorm_min(),
                                              std::numeric_limits<float>::max(),
                                              1e4f};
        return (r & 15) == 0 ? kSpecial[(r >> 4) & 7] : unit;
      }
      default: {
        static constexpr float kFew[4] = {0.0f, 1.0f, -1.0f, 0.5f};
        return kFew[r & 3];
      }
    }
  }
  /// For lse parts: finite, or -inf (a part that saw no key) one time in four.
  float next_lse() {
    const std::uint64_t r = bits();
    if ((r & 3) == 0) return -std::numeric_limits<float>::infinity();
    return mode_ == 2 && (r & 60) == 0 ? next() : 4.0f * next();
  }

 private:
  std::uint64_t bits() {  // splitmix64
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int mode_;
  int exponent_;
  std::uint64_t state_;
};

bool close(double got, double want, double bound) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return !std::isfinite(got);
  return std::isfinite(got) && std::fabs(got - want) <= bound;
}

// The tolerance model counts every fp32 operation as a relative rounding, which holds while
// nothing overflows or flushes. A row's outputs are compared within it when the inputs keep
// every logit, its rescaling and the weighted sum of values far below 2^128 (the bounds
// below leave 2^64), and the row's largest |v| is 0 or at least 2^-100 (products with v in
// the subnormal range round absolutely, by 2^-150, which is then below 2^-24 V by far).
// Outside it only the exact rules are checked (rows that see no key).
constexpr double kModelLimit = 0x1p64;
constexpr double kSmallestModeledV = 0x1p-100;

bool row_modeled(double v_max) { return v_max == 0.0 || v_max >= kSmallestModeledV; }

struct Inputs {  // a problem with its input pointers
  const Problem& p;
  const float *q, *k, *v;
};

bool inputs_modeled(const Inputs& c) {
  const Problem& p = c.p;
  double mq = 0, mk = 0, mv = 0;
  const auto max_abs = [&](const float* t, const Strides& s, i64 len, i64 heads, double& m) {
    for_each_offset(s, p.batch, len, heads, p.head_dim, [&](i64 off) {
      const double x = std::fabs(static_cast<double>(t[off]));
      if (std::isfinite(x)) m = std::max(m, x);
      return true;
    });
  };
  max_abs(c.q, p.q, p.q_len, p.q_heads, mq);
  max_abs(c.k, p.k, p.kv_len, p.kv_heads, mk);
  max_abs(c.v, p.v, p.kv_len, p.kv_heads, mv);
  const double logits = std::max(1.0, std::fabs(static_cast<double>(p.scale))) * std::max(1.0, mq) *
                        std::max(1.0, mk) * static_cast<double>(p.head_dim);
  return logits <= kModelLimit && std::max(1.0, mv) * static_cast<double>(p.kv_len) <= kModelLimit;
}

// o and lse (lse may be null) against the reference, as property_tests/compare.cpp compares:
// finite values within the row's bound, non-finite values exactly where the reference has
// them, exact zeros and lse = the head's sink (-inf without) for rows that see no key. Rows
// past a ragged sequence's length are no outputs (the caller checks they were not written).
void compare(const Problem& p, const float* o, const float* lse, const ref::Result& want,
             const ref::Tolerance& tol, bool modeled, const std::string& what) {
  for (i64 b = 0; b < p.batch; ++b) {
    for (i64 h = 0; h < p.q_heads; ++h) {
      const double empty_lse = sink_of(p, h);
      for (i64 i = 0; i < ref::rows_of(p, b); ++i) {
        const bool masked = ref::keys_seen(p, b, i) == 0;
        const std::size_t r = tol.row(b, h, i);
        const bool check_o = modeled && row_modeled(tol.v_max[r]);
        const auto where = [&](const char* name, i64 d) {
          return what + ": " + name + "[b=" + std::to_string(b) + "][h=" + std::to_string(h) +
                 "][i=" + std::to_string(i) + "]" + (d >= 0 ? "[d=" + std::to_string(d) + "]" : "");
        };
        for (i64 d = 0; d < p.head_dim; ++d) {
          const double got = o[b * p.o.batch + i * p.o.seq + h * p.o.head + d];
          const double w = want.o_at(b, h, i, d);
          if (masked) {
            expect(got == 0.0 && w == 0.0, where("o", d) + " of a row that sees no key is not 0");
          } else if (check_o && !close(got, w, tol.o[r])) {
            fail(where("o", d) + " = " + std::to_string(got) + ", expected " + std::to_string(w) +
                 " within " + std::to_string(tol.o[r]));
          }
        }
        if (lse == nullptr) continue;
        const double got = lse[b * p.lse.batch + h * p.lse.head + i];
        const double w = want.lse_at(b, h, i);
        if (masked) {
          expect(got == empty_lse && w == empty_lse,
                 where("lse", -1) + " = " + std::to_string(got) +
                     " of a row that sees no key is not its sink " + std::to_string(empty_lse));
        } else if (modeled && !(std::isinf(w) ? got == w : close(got, w, tol.lse[r]))) {
          fail(where("lse", -1) + " = " + std::to_string(got) + ", expected " + std::to_string(w) +
               " within " + std::to_string(tol.lse[r]));
        }
      }
    }
  }
}

// Which floats of a buffer are elements of a tensor (the rest is padding). `len` as
// for_each_offset takes it.
template <typename Len>
std::vector<bool> element_mask(i64 size, const Strides& s, i64 batch, const Len& len, i64 heads,
                               i64 dim) {
  std::vector<bool> mask(static_cast<std::size_t>(size));
  for_each_offset(s, batch, len, heads, dim, [&](i64 off) {
    mask[static_cast<std::size_t>(off)] = true;
    return true;
  });
  return mask;
}

// The elements of o that a call on p writes: the rows of each sequence (ref::rows_of).
std::vector<bool> o_mask(const Problem& p) {
  return element_mask(
      o_extent(p), p.o, p.batch, [&](i64 b) { return ref::rows_of(p, b); }, p.q_heads, p.head_dim);
}

// The same for lse.
std::vector<bool> lse_mask(const Problem& p) {
  std::vector<bool> mask(static_cast<std::size_t>(lse_extent(p)));
  for_each_lse_offset(
      p.lse, p.batch, p.q_heads, [&](i64 b) { return ref::rows_of(p, b); },
      [&](i64 off) {
        mask[static_cast<std::size_t>(off)] = true;
        return true;
      });
  return mask;
}

// Every float of `b` outside `mask` (padding, and rows past a sequence's length) still holds
// what `before` had (the NaN pattern when null).
void expect_padding_untouched(const Buffer& b, const std::vector<bool>& mask,
                              const std::string& what, const std::vector<float>* before = nullptr) {
  for (i64 i = 0; i < b.size; ++i) {
    if (mask[static_cast<std::size_t>(i)]) continue;
    const bool same = before != nullptr ? bits_of(b.data[static_cast<std::size_t>(i)]) ==
                                              bits_of((*before)[static_cast<std::size_t>(i)])
                                        : b.is_pattern(i);
    if (!same) {
      fail(what + " wrote float " + std::to_string(i) +
           " of its buffer, which is no element it writes");
    }
  }
}

// Caches the reference and each exp_ulp's tolerance for the calls of one input.
class Oracle {
 public:
  explicit Oracle(const Inputs& c) : c_(c) {}
  const ref::Result& result() {
    if (!result_) result_ = std::make_unique<ref::Result>(ref::attention(c_.p, c_.q, c_.k, c_.v));
    return *result_;
  }
  const ref::Tolerance& tolerance(double exp_ulp) {
    for (const auto& [ulp, tol] : tolerances_) {
      if (ulp == exp_ulp) return tol;
    }
    tolerances_.emplace_back(exp_ulp, ref::tolerance(c_.p, c_.q, c_.k, c_.v, exp_ulp));
    return tolerances_.back().second;
  }
  bool modeled() {
    if (modeled_ < 0) modeled_ = inputs_modeled(c_) ? 1 : 0;
    return modeled_ == 1;
  }

 private:
  Inputs c_;
  std::unique_ptr<ref::Result> result_;
  std::vector<std::pair<double, ref::Tolerance>> tolerances_;
  int modeled_ = -1;
};

// The parts' count and layout, as merge_parts reads them: a count byte (0, -1, INT_MIN or 1
// to 4), then the parts' o strides and lse strides. parts.o and parts.lse stay null.
Parts read_parts_layout(Bytes& in, const Problem& p) {
  const std::uint8_t count_byte = in.u8();
  static constexpr int kCounts[8] = {0, -1, std::numeric_limits<int>::min(), 1, 2, 3, 4, 2};
  Parts parts;
  parts.count = kCounts[count_byte % 8];
  parts.o_strides = strides(in, p.q_len, p.q_heads, p.head_dim);
  parts.lse_strides = lse_strides(in, p.batch, p.q_heads, p.q_len);
  return parts;
}

// merge_parts' section of the input: the parts' layout, the flags (bit 0: o into part 0; 1:
// no lse; 2: a null part, bit 4: its o, else its lse; 3: a null parts.o) and, with flag bit
// 2, the null part's byte.
struct MergeBytes {
  Parts layout;
  std::uint8_t flags = 0;
  std::uint8_t null_part = 0;
};

MergeBytes read_merge_bytes(Bytes& in, const Problem& p) {
  MergeBytes m;
  m.layout = read_parts_layout(in, p);
  m.flags = in.u8();
  if ((m.flags & 4) != 0) m.null_part = in.u8();
  return m;
}

// The parts' strides must be >= 0 with highest offsets that fit int64_t bytes, as check()
// requires of an input: otherwise merge cannot keep its reads inside the parts.
bool part_strides_valid(const Problem& p, const Parts& parts) {
  const i64 o_ext4[4] = {p.batch, p.q_len, p.q_heads, p.head_dim};
  const i64 o_str4[4] = {parts.o_strides.batch, parts.o_strides.seq, parts.o_strides.head, 1};
  const i64 lse_ext3[3] = {p.batch, p.q_heads, p.q_len};
  const i64 lse_str3[3] = {parts.lse_strides.batch, parts.lse_strides.head, 1};
  return *std::min_element(o_str4, o_str4 + 4) >= 0 &&
         *std::min_element(lse_str3, lse_str3 + 3) >= 0 && highest(o_ext4, o_str4, 4) <= kMax / 4 &&
         highest(lse_ext3, lse_str3, 3) <= kMax / 4;
}

// A count below 1, or a null parts.o (flag bit 3), must be rejected before anything is read.
void expect_merge_rejects_no_parts(const Problem& p, Parts parts, std::uint8_t flags) {
  Buffer o(o_extent(p));
  const float* none[1] = {nullptr};
  parts.o = (flags & 8) != 0 ? nullptr : none;
  parts.lse = none;
  expect_rejected([&] { merge(p, parts, o.data.get(), nullptr); },
                  "mha::merge: needs parts.count >= 1 and non-null o, parts.o and parts.lse",
                  "mha::merge of " + std::to_string(parts.count) + " parts");
}

// Parts that cannot be sized: one float each, which merge must not read past.
void expect_merge_rejects_unsized_parts(const Problem& p, Parts parts) {
  const int count = parts.count;
  std::vector<Buffer> bufs;
  for (int c = 0; c < 2 * count; ++c) bufs.emplace_back(1);
  std::vector<const float*> po, pl;
  for (int c = 0; c < count; ++c) {
    po.push_back(bufs[static_cast<std::size_t>(2 * c)].data.get());
    pl.push_back(bufs[static_cast<std::size_t>(2 * c + 1)].data.get());
  }
  parts.o = po.data();
  parts.lse = pl.data();
  Buffer o(o_extent(p));
  const std::string message =
      "mha::merge: parts.o_strides {batch " + std::to_string(parts.o_strides.batch) + ", seq " +
      std::to_string(parts.o_strides.seq) + ", head " + std::to_string(parts.o_strides.head) +
      "} and parts.lse_strides {batch " + std::to_string(parts.lse_strides.batch) + ", head " +
      std::to_string(parts.lse_strides.head) +
      "} must be >= 0 with a highest offset that fits int64_t bytes";
  expect_rejected([&] { merge(p, parts, o.data.get(), nullptr); }, message,
                  "mha::merge with parts that cannot be sized");
}

// The parts of a merge, each part's o and lse in a buffer of exactly the extent of the parts'
// layout, and the pointers merge is given.
struct PartBuffers {
  std::vector<Buffer> o, lse;
  std::vector<const float*> po, pl;
};

// Parts whose elements take the next values (o from next(), lse from next_lse()); their
// padding, and the rows past a sequence's length (which merge does not read), keep the NaN
// pattern. `shape` is p with the parts' strides.
PartBuffers make_parts(const Problem& shape, const Parts& parts, Values& values) {
  const i64 part_o_extent = o_extent(shape), part_lse_extent = lse_extent(shape);
  const std::vector<bool> o_elements = o_mask(shape);
  const std::vector<bool> lse_elements = lse_mask(shape);
  PartBuffers out;
  for (int c = 0; c < parts.count; ++c) {
    out.o.emplace_back(part_o_extent);
    out.lse.emplace_back(part_lse_extent);
    for (i64 i = 0; i < part_o_extent; ++i) {
      if (o_elements[static_cast<std::size_t>(i)]) out.o.back().data[i] = values.next();
    }
    for (i64 i = 0; i < part_lse_extent; ++i) {
      if (lse_elements[static_cast<std::size_t>(i)]) out.lse.back().data[i] = values.next_lse();
    }
  }
  for (int c = 0; c < parts.count; ++c) {
    out.po.push_back(out.o[static_cast<std::size_t>(c)].data.get());
    out.pl.push_back(out.lse[static_cast<std::size_t>(c)].data.get());
  }
  return out;
}

// Part `null_part`'s o (`null_o`) or lse pointer set to null must be rejected.
void expect_merge_rejects_null_part(const Problem& p, const Parts& parts, int null_part,
                                    bool null_o, PartBuffers* bufs) {
  (null_o ? bufs->po : bufs->pl)[static_cast<std::size_t>(null_part)] = nullptr;
  Buffer o(o_extent(p));
  expect_rejected([&] { merge(p, parts, o.data.get(), nullptr); },
                  "mha::merge: part " + std::to_string(null_part) + " is null",
                  "mha::merge with a null part");
}

// What merge must give, row by row (r = (b H + h) Lq + i): o (head_dim values a row) and lse,
// their bounds, whether the row's o is within the tolerance model, and whether no part saw a
// key (then o is exactly 0 and lse exactly the head's sink, -inf without).
struct MergeWant {
  std::vector<double> o, lse, tol_o, tol_lse;
  std::vector<char> check_o, empty;
};

// Row r of `want` for head h, from the parts' lse at lse_off and their o rows at o_off. With a
// sink (p.sinks), the sink is one more part, of o = 0 and lse = sinks[h], counted once.
void want_merged_row(const Problem& p, const PartBuffers& bufs, int count, i64 h, i64 lse_off,
                     i64 o_off, i64 r, MergeWant* want) {
  const std::vector<const float*>& po = bufs.po;
  const std::vector<const float*>& pl = bufs.pl;
  const double u = 0x1p-24, inf = std::numeric_limits<double>::infinity();
  const double sink = sink_of(p, h);
  const bool has_sink = sink != -inf;
  double m = sink;
  bool nan = false, empty = true;
  for (int c = 0; c < count; ++c) {
    const double l = pl[static_cast<std::size_t>(c)][lse_off];
    nan |= std::isnan(l);
    empty &= l == -inf;
    m = std::max(m, l);
  }
  double* o_row = &want->o[static_cast<std::size_t>(r * p.head_dim)];
  if (nan || empty) {
    std::fill(o_row, o_row + p.head_dim, nan ? std::nan("") : 0.0);
    want->lse[static_cast<std::size_t>(r)] = nan ? std::nan("") : sink;
    want->empty[static_cast<std::size_t>(r)] = !nan;
    return;
  }
  double sum = has_sink ? std::exp(sink - m) : 0.0, x_max = has_sink ? std::fabs(sink - m) : 0.0;
  double o_max = 0;
  for (int c = 0; c < count; ++c) {
    const double l = pl[static_cast<std::size_t>(c)][lse_off];
    sum += std::exp(l - m);
    if (l != -inf) {
      x_max = std::max(x_max, std::fabs(l - m));
      for (i64 d = 0; d < p.head_dim; ++d) {
        const double x = std::fabs(static_cast<double>(po[static_cast<std::size_t>(c)][o_off + d]));
        if (std::isfinite(x)) o_max = std::max(o_max, x);
      }
    }
  }
  for (i64 d = 0; d < p.head_dim; ++d) {
    double acc = 0;
    for (int c = 0; c < count; ++c) {
      const double l = pl[static_cast<std::size_t>(c)][lse_off];
      if (l == -inf) continue;  // contributes nothing, as documented
      acc += std::exp(l - m) / sum * po[static_cast<std::size_t>(c)][o_off + d];
    }
    o_row[d] = acc;
  }
  want->lse[static_cast<std::size_t>(r)] = m + std::log(sum);
  // The sink is one more term of the sum (its o, 0, adds nothing to the values).
  const double terms = count + (has_sink ? 1 : 0);
  const double eta = std::exp(u * x_max) * (1.0 + 2.0 * u) - 1.0;
  want->tol_o[static_cast<std::size_t>(r)] =
      (ref::weight_shift(eta) + ref::accumulation_factor(terms)) * o_max;
  want->tol_lse[static_cast<std::size_t>(r)] =
      std::log1p(eta) - std::log1p(-ref::gamma(terms)) +
      5.0 * 2.0 * u * (std::fabs(m) + std::log(terms) + 1.0);
  want->check_o[static_cast<std::size_t>(r)] = o_max <= kModelLimit && row_modeled(o_max);
}

// The expected rows, from the parts before the call (o may be merged into part 0): those of
// each sequence (q_lens), the others are not written.
MergeWant merge_want(const Problem& p, const Parts& parts, const PartBuffers& bufs) {
  const auto rows = static_cast<std::size_t>(p.batch * p.q_heads * p.q_len);
  MergeWant want;
  want.o.resize(rows * static_cast<std::size_t>(p.head_dim));
  want.lse.resize(rows);
  want.tol_o.resize(rows);
  want.tol_lse.resize(rows);
  want.check_o.resize(rows);
  want.empty.resize(rows);
  for (i64 b = 0; b < p.batch; ++b) {
    for (i64 h = 0; h < p.q_heads; ++h) {
      for (i64 i = 0; i < ref::rows_of(p, b); ++i) {
        const i64 r = (b * p.q_heads + h) * p.q_len + i;
        const i64 lse_off = b * parts.lse_strides.batch + h * parts.lse_strides.head + i;
        const i64 o_off =
            b * parts.o_strides.batch + i * parts.o_strides.seq + h * parts.o_strides.head;
        want_merged_row(p, bufs, parts.count, h, lse_off, o_off, r, &want);
      }
    }
  }
  return want;
}

// Every row of merge's o and lse (lse may be null) against `want`: o of a row no part saw is
// 0 and its lse the head's sink (-inf without); other rows within their bounds, o where the
// model holds.
void compare_merged(const Problem& p, const float* o, const float* lse, const MergeWant& want,
                    int count) {
  for (i64 b = 0; b < p.batch; ++b) {
    for (i64 h = 0; h < p.q_heads; ++h) {
      for (i64 i = 0; i < ref::rows_of(p, b); ++i) {
        const std::size_t r = static_cast<std::size_t>((b * p.q_heads + h) * p.q_len + i);
        const std::string where = "mha::merge of " + std::to_string(count) +
                                  " parts, row [b=" + std::to_string(b) +
                                  "][h=" + std::to_string(h) + "][i=" + std::to_string(i) + "]";
        const bool empty = want.empty[r] != 0;
        for (i64 d = 0; d < p.head_dim; ++d) {
          const double got = o[b * p.o.batch + i * p.o.seq + h * p.o.head + d];
          const double w =
              want.o[r * static_cast<std::size_t>(p.head_dim) + static_cast<std::size_t>(d)];
          if (empty) {
            expect(got == 0.0, where + ": o of a row no part saw is not 0");
          } else if (std::isnan(w) || want.check_o[r]) {
            expect(close(got, w, want.tol_o[r]), where + ": o[" + std::to_string(d) +
                                                     "] = " + std::to_string(got) + ", expected " +
                                                     std::to_string(w) + " within " +
                                                     std::to_string(want.tol_o[r]));
          }
        }
        if (lse == nullptr) continue;
        const double got = lse[b * p.lse.batch + h * p.lse.head + i];
        const bool ok = empty
                            ? got == want.lse[r]
                            : (std::isinf(want.lse[r]) ? got == want.lse[r]
                                                       : close(got, want.lse[r], want.tol_lse[r]));
        expect(ok, where + ": lse = " + std::to_string(got) + ", expected " +
                       std::to_string(want.lse[r]) +
                       (empty ? " exactly (no part saw a key)"
                              : " within " + std::to_string(want.tol_lse[r])));
      }
    }
  }
}

// merge of the parts into o in a buffer of its own or, with flag bit 0 when the strides agree,
// in place into part 0; into lse unless flag bit 1 says none. The parts' lse and the padding
// of o and lse (and, in place, part 0's floats that are no row merge writes) must stay
// untouched, and every row must match `want`.
void merge_and_compare(const Problem& p, const Parts& parts, const PartBuffers& bufs,
                       std::uint8_t flags, const MergeWant& want) {
  const int count = parts.count;
  const bool in_place = (flags & 1) != 0 && parts.o_strides.batch == p.o.batch &&
                        parts.o_strides.seq == p.o.seq && parts.o_strides.head == p.o.head;
  std::unique_ptr<Buffer> own_o;
  const Buffer* o_buf = nullptr;
  if (in_place) {
    o_buf = &bufs.o[0];
  } else {
    own_o = std::make_unique<Buffer>(o_extent(p));
    o_buf = own_o.get();
  }
  float* o = o_buf->data.get();
  const std::vector<float> o_before = o_buf->snapshot();
  std::unique_ptr<Buffer> lse;
  if ((flags & 2) == 0) lse = std::make_unique<Buffer>(lse_extent(p));
  std::vector<std::vector<float>> before;
  for (int c = 0; c < count; ++c)
    before.push_back(bufs.lse[static_cast<std::size_t>(c)].snapshot());
  expect_accepted([&] { merge(p, parts, o, lse ? lse->data.get() : nullptr); }, "mha::merge");

  for (int c = 0; c < count; ++c) {
    expect(bufs.lse[static_cast<std::size_t>(c)].same_as(before[static_cast<std::size_t>(c)]),
           "mha::merge wrote a part's lse");
  }
  expect_padding_untouched(*o_buf, o_mask(p), in_place ? "mha::merge in place" : "mha::merge",
                           &o_before);
  if (lse) expect_padding_untouched(*lse, lse_mask(p), "mha::merge (lse)");
  compare_merged(p, o, lse ? lse->data.get() : nullptr, want, count);
}

// mha::merge of `count` parts whose values come from the bytes, against merge's formula in
// double within a bound derived like reference/tolerance.h's: with x_c = lse_c - m, the fp32
// subtraction moves x_c by at most u |x_c| and expf (glibc, under 1 ulp) adds 2^-23, so each
// weight is within eta = exp(u max|x_c|)(1 + 2^-23) - 1; the normalized weights then move by
// weight_shift(eta), the normalization, products and sums add accumulation_factor(count)
// (both times the largest |o_c|), and lse is off by log(1 + eta) - log(1 - gamma(count))
// plus five roundings of values up to |m| + log(count) + 1. A sink counts as one more part
// (of o = 0) in all of these.
void merge_parts(const MergeBytes& bytes, const Problem& p, Values& values) {
  Parts parts = bytes.layout;
  const std::uint8_t flags = bytes.flags;
  Problem shape = p;  // the parts' layout: sized as o and lse are
  shape.o = parts.o_strides;
  shape.lse = parts.lse_strides;
  const bool strides_valid = part_strides_valid(p, parts);
  if (parts.count < 1 || (flags & 8) != 0) {
    expect_merge_rejects_no_parts(p, parts, flags);
    return;
  }
  if (!strides_valid) {
    expect_merge_rejects_unsized_parts(p, parts);
    return;
  }
  if (static_cast<double>(parts.count) * static_cast<double>(o_extent(shape) + lse_extent(shape)) >
      kMaxFloats) {
    return;
  }
  PartBuffers bufs = make_parts(shape, parts, values);
  parts.o = bufs.po.data();
  parts.lse = bufs.pl.data();
  if ((flags & 4) != 0) {
    const int null_part = bytes.null_part % parts.count;
    expect_merge_rejects_null_part(p, parts, null_part, (flags & 16) != 0, &bufs);
    return;
  }
  merge_and_compare(p, parts, bufs, flags, merge_want(p, parts, bufs));
}

// The input buffers of run_calls, as bits 0-1 of its memory byte say: separate buffers, K and V
// in one (k == v), or q, k and v all in one.
struct InputBuffers {
  std::vector<std::unique_ptr<Buffer>> buffers;
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  std::vector<std::vector<float>> snapshots;  // the buffers once their values are in

  // A call must not write into an input's buffer.
  void expect_unchanged(const std::string& what) const {
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      expect(buffers[i]->same_as(snapshots[i]), what + " wrote into an input's buffer");
    }
  }
};

InputBuffers allocate_inputs(std::uint8_t memory, const Problem& p) {
  const i64 q_ext = q_extent(p), k_ext = k_extent(p), v_ext = v_extent(p);
  InputBuffers out;
  std::vector<std::unique_ptr<Buffer>>& inputs = out.buffers;
  switch (memory & 3) {
    case 1:
      inputs.push_back(std::make_unique<Buffer>(q_ext));
      inputs.push_back(std::make_unique<Buffer>(std::max(k_ext, v_ext)));
      out.q = inputs[0]->data.get();
      out.k = out.v = inputs[1]->data.get();
      break;
    case 2:
      inputs.push_back(std::make_unique<Buffer>(std::max({q_ext, k_ext, v_ext})));
      out.q = out.k = out.v = inputs[0]->data.get();
      break;
    default:
      inputs.push_back(std::make_unique<Buffer>(q_ext));
      inputs.push_back(std::make_unique<Buffer>(k_ext));
      inputs.push_back(std::make_unique<Buffer>(v_ext));
      out.q = inputs[0]->data.get();
      out.k = inputs[1]->data.get();
      out.v = inputs[2]->data.get();
  }
  return out;
}

// The output buffers of run_calls, and where the calls write: o and lse in their own buffers
// until call_pointers moves them; lse null with bit 5 of the memory byte.
struct OutputBuffers {
  OutputBuffers(const Problem& p, std::uint8_t memory)
      : o_buf(o_extent(p)),
        lse_buf(lse_extent(p)),
        o(o_buf.data.get()),
        lse((memory & 0x20) != 0 ? nullptr : lse_buf.data.get()) {}
  Buffer o_buf, lse_buf;
  float* o;
  float* lse;
};

// Whether the memory byte's mode takes the pointer byte (call_pointers()).
bool takes_pointer_byte(std::uint8_t memory) {
  const int mode = (memory >> 2) & 7;
  return mode == 4 || mode == 5 || mode == 7 || (mode == 6 && (memory & 0x20) == 0);
}

// The pointers the calls pass (q, k, v, o, lse), as bits 2-4 of the memory byte say: o inside
// q's or v's buffer, lse inside o's (at `pointer` floats modulo the buffer's size), or one of
// q, k, v and o null (pointer % 4). Moves out->o and out->lse to match.
std::array<const float*, 5> call_pointers(std::uint8_t memory, std::uint8_t pointer,
                                          const Problem& p, const InputBuffers& inputs,
                                          OutputBuffers* out) {
  const i64 q_ext = q_extent(p), k_ext = k_extent(p), v_ext = v_extent(p), o_ext = o_extent(p);
  const float* q = inputs.q;
  const float* k = inputs.k;
  const float* v = inputs.v;
  const auto inside = [&](const float* base, i64 size) {
    return const_cast<float*>(base) + pointer % size;
  };
  const float* call_in[3] = {q, k, v};  // what the calls pass: one may be null
  switch ((memory >> 2) & 7) {
    case 4:
      out->o = inside(q, q == v ? std::max({q_ext, k_ext, v_ext}) : q_ext);
      break;
    case 5:
      out->o = inside(v, v == k ? std::max(k_ext, v_ext) : v_ext);
      break;
    case 6:
      if (out->lse != nullptr) out->lse = inside(out->o, o_ext);
      break;
    case 7: {
      const int which = pointer % 4;
      if (which == 3) {
        out->o = nullptr;
      } else {
        call_in[which] = nullptr;
      }
      break;
    }
    default:
      break;
  }
  return {call_in[0], call_in[1], call_in[2], out->o, out->lse};
}

// Values for the elements of each input; the padding keeps the NaN pattern, and so do the rows
// past a ragged sequence's lengths (a kernel that reads them carries NaN into its output),
// unless they are also rows of another sequence (broadcast, shared buffers). Then a copy of
// every input buffer, which no call may change.
void fill_inputs(const Problem& p, Values& values, InputBuffers* inputs) {
  const std::function<i64(i64)> q_rows = [&](i64 b) { return q_len_of(p, b); };
  const std::function<i64(i64)> kv_rows = [&](i64 b) { return kv_len_of(p, b); };
  const struct {
    const float* t;
    const Strides& s;
    const std::function<i64(i64)>& len;
    i64 heads;
  } tensors[] = {{inputs->q, p.q, q_rows, p.q_heads},
                 {inputs->k, p.k, kv_rows, p.kv_heads},
                 {inputs->v, p.v, kv_rows, p.kv_heads}};
  for (const auto& t : tensors) {
    float* data = const_cast<float*>(t.t);
    for_each_offset(t.s, p.batch, t.len, t.heads, p.head_dim, [&](i64 off) {
      data[off] = values.next();
      return true;
    });
  }
  for (const auto& b : inputs->buffers) inputs->snapshots.push_back(b->snapshot());
}

// Which calls run_calls makes, from three bytes: `calls`, the kernel and the threads.
struct CallChoice {
  // Bit 0: mha::attention (also when bits 0-4 are all clear); 1: mha::attention by name; 2:
  // the parallel driver; 3: the kernel alone; 4: 1 and 2 threads alike; 5: mha::merge;
  // 6: bits 1-3 for every kernel of the registry instead of the named one.
  std::uint8_t calls;
  std::uint8_t thread_byte;  // bit 0: threads - 1; bits 1-4: the workspace offset in floats
  int threads;
  const KernelInfo* named;
};

CallChoice read_calls(Bytes& in) {
  const std::uint8_t calls = in.u8();
  const std::uint8_t kernel_byte = in.u8();
  const std::uint8_t thread_byte = in.u8();
  const int threads = 1 + (thread_byte & 1);
  const KernelInfo& named = all_kernels()[kernel_byte % all_kernels().size()];
  return {calls, thread_byte, threads, &named};
}

// Pointers check_call rejects: mha::attention, with the best kernel and by name, must reject
// them with its message, before writing anything.
void expect_calls_rejected(const Problem& p, const std::string& verdict,
                           const std::array<const float*, 5>& ptr, const CallChoice& choice,
                           const InputBuffers& inputs, const OutputBuffers& out) {
  const KernelInfo& named = *choice.named;
  const int threads = choice.threads;
  float* o = out.o;
  float* lse = out.lse;
  // The output buffers as they were (a sinks or length array may sit inside one).
  const std::vector<float> o_before = out.o_buf.snapshot(), lse_before = out.lse_buf.snapshot();
  const std::string message = "mha::attention: " + verdict;
  expect_rejected([&] { attention(p, ptr[0], ptr[1], ptr[2], o, lse, threads); }, message,
                  "mha::attention");
  if (available(named)) {
    expect_rejected([&] { attention(named.name, p, ptr[0], ptr[1], ptr[2], o, lse, threads); },
                    message, std::string("mha::attention(\"") + named.name + "\")");
  }
  inputs.expect_unchanged("a rejected call");
  expect(out.o_buf.same_as(o_before), "a rejected call wrote into o's buffer");
  expect(out.lse_buf.same_as(lse_before), "a rejected call wrote into lse's buffer");
}

// The most KV chunks the driver cuts a row's keys into: plan()'s for each sequence (as
// mha::sequence describes it; those without a query or a key run no kernel).
i64 most_chunks(const Problem& p) {
  if (!ragged(p)) return plan(p).chunks;
  i64 chunks = 1;
  for (i64 b = 0; b < p.batch; ++b) {
    const Problem s = sequence(p, b);
    if (s.q_len > 0 && s.kv_len > 0) chunks = std::max(chunks, plan(s).chunks);
  }
  return chunks;
}

// Runs accepted calls on one problem's buffers and checks each: accepted, inputs and padding
// untouched, o and lse within the tolerance of the reference for the call's exp and number of
// KV chunks.
class CallCheck {
 public:
  CallCheck(const Problem& p, const InputBuffers& inputs, OutputBuffers* out)
      : p_(p),
        inputs_(inputs),
        out_(*out),
        oracle_(Inputs{p, inputs.q, inputs.k, inputs.v}),
        o_elements_(o_mask(p)),
        lse_elements_(lse_mask(p)),
        chunks_(most_chunks(p)) {}

  // `call`, named `what`, by an implementation whose exp errs by at most `exp_ulp`, through
  // the parallel driver when `driver` (which may split the KV range into chunks).
  template <typename Call>
  void operator()(const std::string& what, double exp_ulp, bool driver, Call&& call) {
    out_.o_buf.fill_pattern();
    out_.lse_buf.fill_pattern();
    expect_accepted(call, what);
    inputs_.expect_unchanged(what);
    expect_padding_untouched(out_.o_buf, o_elements_, what);
    if (out_.lse != nullptr) expect_padding_untouched(out_.lse_buf, lse_elements_, what);
    const i64 chunks = driver ? chunks_ : 1;
    const ref::Tolerance& whole = oracle_.tolerance(exp_ulp);
    // A split unit's merge counts the sink as one more part.
    const double parts = static_cast<double>(chunks + (p_.sinks != nullptr ? 1 : 0));
    const ref::Tolerance tol = chunks > 1 ? ref::merged_tolerance(whole, parts) : whole;
    compare(p_, out_.o, out_.lse, oracle_.result(), tol, oracle_.modeled(),
            what + " (" + std::to_string(chunks) + " KV chunks)");
  }

 private:
  const Problem& p_;
  const InputBuffers& inputs_;
  OutputBuffers& out_;
  Oracle oracle_;
  std::vector<bool> o_elements_, lse_elements_;
  i64 chunks_;  // KV chunks of the driver's calls
};

// One kernel's calls: by name, through the driver and alone (bits 1-3 of the calls byte), the
// last two in workspaces of exactly the size they ask for, placed at a float-aligned offset
// (all that the contract promises).
void run_kernel_calls(const KernelInfo& kernel, const Problem& p, const CallChoice& choice,
                      const InputBuffers& inputs, const OutputBuffers& out, CallCheck& run) {
  const float* q = inputs.q;
  const float* k = inputs.k;
  const float* v = inputs.v;
  float* o = out.o;
  float* lse = out.lse;
  const std::uint8_t calls = choice.calls;
  const int threads = choice.threads;
  const std::size_t ws_offset = 4 * ((choice.thread_byte >> 1) & 15);
  if ((calls & 2) != 0) {
    const std::string what = std::string("mha::attention(\"") + kernel.name + "\")";
    if (available(kernel)) {
      run(what, kernel.exp_ulp, true, [&] { attention(kernel.name, p, q, k, v, o, lse, threads); });
    } else {
      expect_rejected([&] { attention(kernel.name, p, q, k, v, o, lse, threads); },
                      std::string("kernel '") + kernel.name + "' needs " + isa_name(kernel.isa) +
                          ", which this CPU lacks or MHA_MAX_ISA excludes",
                      what);
    }
  }
  if (!available(kernel)) return;
  if ((calls & 4) != 0) {
    const std::size_t bytes = parallel_workspace(kernel.workspace, p, threads);
    std::unique_ptr<unsigned char[]> ws(new unsigned char[bytes + ws_offset]);
    run(std::string("parallel_attention of ") + kernel.name, kernel.exp_ulp, true, [&] {
      parallel_attention(kernel.fn, kernel.workspace, p, q, k, v, o, lse, threads,
                         {ws.get() + ws_offset, bytes});
    });
  }
  if ((calls & 8) != 0) {
    const std::size_t bytes = kernel.workspace(p);
    std::unique_ptr<unsigned char[]> ws(new unsigned char[bytes + ws_offset]);
    run(std::string("kernel ") + kernel.name + " alone", kernel.exp_ulp, false, [&] {
      kernel.fn(p, q, k, v, o, lse, {ws.get() + ws_offset, bytes});
    });
  }
}

// The calls `choice` names, each checked by CallCheck.
void run_accepted_calls(const Problem& p, const CallChoice& choice, const InputBuffers& inputs,
                        OutputBuffers* out) {
  const float* q = inputs.q;
  const float* k = inputs.k;
  const float* v = inputs.v;
  float* o = out->o;
  float* lse = out->lse;
  const std::uint8_t calls = choice.calls;
  const int threads = choice.threads;
  CallCheck run(p, inputs, out);
  const KernelInfo& best = best_kernel();
  const bool any = (calls & 0x1f) != 0;
  if ((calls & 1) != 0 || !any) {
    run("mha::attention on " + std::to_string(threads) + " threads", best.exp_ulp, true,
        [&] { attention(p, q, k, v, o, lse, threads); });
  }
  // The named kernel, or with bit 6 every kernel of the registry.
  for (const KernelInfo& kernel : all_kernels()) {
    if ((calls & 64) == 0 && &kernel != choice.named) continue;
    run_kernel_calls(kernel, p, choice, inputs, *out, run);
  }
  if ((calls & 16) != 0) {  // the thread count does not change a bit
    run("mha::attention on 1 thread", best.exp_ulp, true,
        [&] { attention(p, q, k, v, o, lse, 1); });
    const std::vector<float> one_o = out->o_buf.snapshot(), one_lse = out->lse_buf.snapshot();
    run("mha::attention on 2 threads", best.exp_ulp, true,
        [&] { attention(p, q, k, v, o, lse, 2); });
    expect(out->o_buf.same_as(one_o) && out->lse_buf.same_as(one_lse),
           "mha::attention on 1 and 2 threads differ");
  }
}

// run_calls' sections of the input (memory, values, calls, merge), read whatever the problem
// so that the sections after them are always in the same place.
struct RunBytes {
  std::uint8_t memory;
  std::uint8_t pointer;  // call_pointers' byte, when the memory byte's mode takes one
  Values values;
  CallChoice choice;
  MergeBytes merge;  // when choice.calls asks for mha::merge
};

RunBytes read_run_bytes(Bytes& in, const Problem& p) {
  const std::uint8_t memory = in.u8();
  const std::uint8_t pointer = takes_pointer_byte(memory) ? in.u8() : 0;
  const Values values(in);
  const CallChoice choice = read_calls(in);
  MergeBytes merge;
  if ((choice.calls & 32) != 0) merge = read_merge_bytes(in, p);
  return {memory, pointer, values, choice, merge};
}

// The problem the calls pass: p, or p with one of its arrays (extras.place_array) copied
// inside the buffer of o (or of lse) where that output goes, extras.place_offset floats in
// rounded up to 8 bytes (at the start when it does not fit there; not at all when it does not
// fit the buffer or the output goes elsewhere). check_call must then reject the call.
Problem place_array(const Problem& p, const Extras& extras, OutputBuffers* out) {
  Problem placed = p;
  if (extras.place_array == 0) return placed;
  Buffer& buf = extras.place_in_lse ? out->lse_buf : out->o_buf;
  if ((extras.place_in_lse ? out->lse : out->o) != buf.data.get()) return placed;
  const void* arrays[3] = {p.sinks, p.q_lens, p.kv_lens};
  const void* array = arrays[extras.place_array - 1];
  const i64 bytes = extras.place_array == 1 ? p.q_heads * 4 : p.batch * 8;
  if (array == nullptr || bytes > buf.size * 4) return placed;
  i64 offset = (i64{extras.place_offset} + 1) / 2 * 2;
  if (offset * 4 + bytes > buf.size * 4) offset = 0;
  float* at = buf.data.get() + offset;
  std::memcpy(at, array, static_cast<std::size_t>(bytes));
  if (extras.place_array == 1) placed.sinks = at;
  if (extras.place_array == 2) placed.q_lens = reinterpret_cast<const i64*>(at);
  if (extras.place_array == 3) placed.kv_lens = reinterpret_cast<const i64*>(at);
  return placed;
}

// The calls on real buffers, for a problem check() admitted whose buffers are small.
void run_calls(RunBytes& run, const Extras& extras, const Problem& p) {
  const std::uint8_t memory = run.memory;
  InputBuffers inputs = allocate_inputs(memory, p);
  OutputBuffers out(p, memory);
  const std::array<const float*, 5> ptr = call_pointers(memory, run.pointer, p, inputs, &out);
  const Problem placed = place_array(p, extras, &out);
  const std::string verdict = expected_verdict(placed, ptr.data());
  const bool moved =
      placed.sinks != p.sinks || placed.q_lens != p.q_lens || placed.kv_lens != p.kv_lens;
  expect(!moved || !verdict.empty(), "an array inside an output's buffer was not rejected");
  Values& values = run.values;
  fill_inputs(p, values, &inputs);
  const CallChoice& choice = run.choice;
  if (!verdict.empty()) {
    expect_calls_rejected(placed, verdict, ptr, choice, inputs, out);
    return;
  }
  run_accepted_calls(p, choice, inputs, &out);
  if ((choice.calls & 32) != 0) merge_parts(run.merge, p, values);
}

}  // namespace
}  // namespace mha::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace mha;
  using namespace mha::fuzz;
  // The whole input first: the sections check() needs last (sinks, lengths) are at its end.
  Bytes in(data, size);
  Problem p = decode_problem(in);
  const std::array<std::uintptr_t, 5> addresses = read_fake_addresses(in);
  RunBytes run = read_run_bytes(in, p);
  const Extras extras = read_extras(in, p);
  p.sinks = extras.sinks.get();
  p.q_lens = extras.q_lens.get();
  p.kv_lens = extras.kv_lens.get();
  p.window = extras.window;
  p.softcap = extras.softcap;
  p.alibi = extras.alibi.get();
  p.alibi_offset = extras.alibi_offset;

  const std::string message = check(p);
  expect(check(p) == message, "check() is not deterministic");
  const std::string modeled = expected_check(p);
  expect(message == modeled, "check said \"" + message + "\", expected \"" + modeled + "\"");
  if (message.empty()) verify_admitted(p);
  fake_addresses(addresses, extras, p);
  if (!message.empty()) return 0;
  const double floats = static_cast<double>(q_extent(p)) + static_cast<double>(k_extent(p)) +
                        static_cast<double>(v_extent(p)) + static_cast<double>(o_extent(p)) +
                        static_cast<double>(lse_extent(p));
  const double work = static_cast<double>(p.batch) * static_cast<double>(p.q_heads) *
                      static_cast<double>(p.q_len) * static_cast<double>(p.kv_len) *
                      static_cast<double>(p.head_dim);
  if (floats <= kMaxFloats && work <= kMaxWork) run_calls(run, extras, p);
  return 0;
}

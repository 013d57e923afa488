// mha/attention.h: the problem description, its validation, the kernel signature and the
// exact merge of split-KV partial results for multi-head attention on CPUs.
//
// C++17, header-only, no dependencies: one kernel file plus this header compile anywhere.
//
// What every kernel computes, for each batch element b, query head h, query row i and
// column d (query head h reads KV head h / (q_heads / kv_heads)):
//
//   s[j]      = scale * dot(q[b][i][h], k[b][j][h / g])       for every key j row i sees
//   o[b][i][h] = sum_j softmax(s)[j] * v[b][j][h / g]
//   lse[b][h][i] = log(sum_j exp(s[j]))                         (natural log)
//
// * Hkv == H is multi-head attention (MHA), 1 < Hkv < H grouped-query (GQA), Hkv == 1
//   multi-query (MQA): one code path.
// * Causal masking is BOTTOM-RIGHT aligned: query i sees keys j <= i + (kv_len - q_len).
//   With a KV cache the new queries are the last q_len positions, so a decoded token sees
//   the whole cache. When q_len == kv_len this is the usual lower triangle. (PyTorch's
//   `is_causal` aligns top-left instead; the two differ whenever q_len != kv_len.)
// * Sliding window (Problem::window = w > 0): a row sees only the w most recent of the keys
//   the causal rule lets it see, [max(0, end - w), end) for a row that sees [0, end) without
//   it; a decode step reads w keys, a prefill O(L w).
// * A row that sees no key (causal with q_len > kv_len) outputs zeros and lse = -inf,
//   never NaN.
// * Ragged batches (Problem::q_lens, kv_lens: continuous batching): sequence b has its own
//   lengths, at most q_len and kv_len (which then size the tensors), and is computed as if
//   it were a problem of its own (mha::sequence): its causal rule is bottom-right on its
//   own lengths, rows past its length are not written, padding is never read.
// * Attention sinks (Problem::sinks, gpt-oss): a logit per query head that joins the
//   softmax's denominator only, lse[b][h][i] = log(sum_j exp(s[j]) + exp(sinks[h])) and
//   o = sum_j exp(s[j] - lse) v[j]; a row that sees no key gets o = 0 and lse = sinks[h].
// * Logit soft-capping (Problem::softcap = c > 0, Gemma 2): each s[j] becomes c tanh(s[j] / c)
//   before the softmax (the sinks are not capped); o and lse are those of the capped logits.
// * ALiBi (Problem::alibi, a slope per query head): head h adds -alibi[h] |pos_i - j| to s[j],
//   pos_i = i + kv_len - q_len (+ Problem::alibi_offset) the row's position, after the
//   soft-cap; the kernels compute it, no mask is materialised, and skip the keys it leaves
//   a weight below 2^-40 of their row's largest (mha::support::AlibiReach).
// * NaN and Inf in the inputs propagate to every output they touch; nothing is silently
//   zeroed.
// * Arithmetic is fp32. No pointer needs any alignment.
// * K and V may be stored in fp16, bf16 or int8 with an fp32 scale per row (Problem::kv_type,
//   mha/kv_types.h): a kernel widens each element exactly as it reads it (i8: q s, rounded
//   once to fp32), and never expands the cache in memory.
// * Floating-point environment: every kernel, and merge, computes under the default one
//   (round to nearest, no flush-to-zero or denormals-are-zero, exceptions masked) whatever
//   the caller set, and gives the caller's back on return: FpEnvGuard below.
// * Scratch memory that cannot be allocated throws AllocationError (a std::bad_alloc that
//   says what was needed and how many bytes) before any output is written.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if !(defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__)))
#include <cfenv>
#endif

namespace mha {

/// The element type of K and V. Q, O and lse are always fp32.
enum class KvType : std::uint8_t { f32, f16, bf16, i8 };

/// "f32", "f16", "bf16" or "i8" (the names benchmarks carry, as in kv:f16).
constexpr const char* kv_type_name(KvType t) {
  switch (t) {
    case KvType::f32:
      return "f32";
    case KvType::f16:
      return "f16";
    case KvType::bf16:
      return "bf16";
    case KvType::i8:
      return "i8";
  }
  return "?";
}

/// Bytes of one stored element (an i8 row's scale is counted apart); 0 for a value outside the
/// enum.
constexpr std::size_t kv_type_bytes(KvType t) {
  switch (t) {
    case KvType::f32:
      return 4;
    case KvType::f16:
    case KvType::bf16:
      return 2;
    case KvType::i8:
      return 1;
  }
  return 0;
}

/// Element strides of a 4-D tensor indexed [batch][seq][head][dim]. The dim axis is always
/// contiguous (stride 1). Input strides may be 0 (broadcast) and inputs may share memory.
struct Strides {
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  std::int64_t head = 0;
};

/// Element strides of lse, indexed [batch][head][row]; rows are contiguous.
struct LseStrides {
  std::int64_t batch = 0;
  std::int64_t head = 0;
};

/// One attention problem: shapes, masking, scale and the strides of every tensor.
/// q: [batch][q_len][q_heads][head_dim]      o: same shape as q
/// k, v: [batch][kv_len][kv_heads][head_dim]  lse: [batch][q_heads][q_len]
struct Problem {
  std::int64_t batch = 1;
  std::int64_t q_len = 1;
  std::int64_t kv_len = 1;
  std::int64_t q_heads = 1;
  std::int64_t kv_heads = 1;
  std::int64_t head_dim = 1;
  bool causal = false;
  float scale = 1.0f;  ///< multiplies q.k; make_problem sets 1/sqrt(head_dim)
  Strides q, k, v, o;  ///< in elements of each tensor's type (k, v: kv_type's)
  LseStrides lse;
  /// The element type of k and v (mha/kv_types.h describes each). With i8, row (b, j, h) of
  /// k holds the values k_i8[..][d] * k_scale[b][j][h], the scales fp32 in their own array
  /// (KvView::scale) with strides k_scale (dim unused); likewise v. Ignored for other types.
  KvType kv_type = KvType::f32;
  Strides k_scale, v_scale;
  /// Attention sinks: null (none), or one logit per query head, sinks[h] for h < q_heads,
  /// in the units of the scaled logits s. Head h's sink joins its softmax's denominator and
  /// nothing else: lse = log(sum_j exp(s_j) + exp(sinks[h])), o = sum_j exp(s_j - lse) v_j,
  /// so a row's weights sum to less than one; a row that sees no key gets o = 0 and lse =
  /// sinks[h]. Each is finite or -inf (check()); -inf is no sink, bit for bit. lse includes
  /// the sink, so partial results over KV chunks are computed without it (sinks = null) and
  /// mha::merge adds it once. A sub-problem of heads [h0, h0 + n) takes sinks + h0.
  const float* sinks = nullptr;
  /// Ragged batches: null (every sequence has q_len queries and kv_len keys), or one length
  /// per batch element: sequence b's queries are rows [0, q_lens[b]) of q[b] (and of o[b],
  /// lse[b]) and its keys rows [0, kv_lens[b]) of k[b] and v[b], each within [0, q_len] or
  /// [0, kv_len] (check()), which size the tensors. Each sequence is computed exactly as the
  /// problem of its own that mha::sequence(p, b) describes (causal: bottom-right on its own
  /// lengths, so with a KV cache its queries are its last q_lens[b] positions); rows
  /// [q_lens[b], q_len) of o and lse are not written and padding rows of q, k and v are not
  /// read. A sequence with no key writes o = 0 and lse = its sink (-inf without), one with no
  /// query nothing. Either array may be given alone.
  const std::int64_t* q_lens = nullptr;
  const std::int64_t* kv_lens = nullptr;
  /// Sliding window: 0 (none), or the most keys a row sees: the `window` most recent of
  /// those the causal rule lets it see (without causal masking, of all of a sequence's keys),
  /// so a row that sees [0, end) without it sees [max(0, end - window), end) (Mistral,
  /// Gemma 2's local layers, gpt-oss). Counted on each sequence's own keys. Negative values
  /// are rejected (check()); a window at least as long as every row's keys is no window, bit
  /// for bit.
  std::int64_t window = 0;
  /// Logit soft-capping (Gemma 2: 50 in attention): 0 (none), or the cap c: every logit s =
  /// scale q.k becomes c tanh(s / c) before the softmax, so |s| < c (an infinite logit becomes
  /// +-c; NaN stays NaN). o and lse are those of the capped logits; sinks are not capped (they
  /// are logits of the capped softmax as given). +inf is none too, bit for bit (the limit of c
  /// tanh(s / c)). check() accepts 0, +inf and [2^-126, 2^120], so that the kernels' 1 / c,
  /// c log2(e) and 44 c (past which tanh rounds to 1) stay normal and finite. Kernels evaluate tanh
  /// to within 4 u c (u = 2^-24) of the capped logit of their computed s: mha::support::Softcap,
  /// measured in property_tests/softcap_test.cpp; reference/tolerance.h counts it.
  float softcap = 0.0f;
  /// ALiBi (Press et al.; BLOOM, MPT): null (none), or one slope per query head, alibi[h] for
  /// h < q_heads, each finite and within [0, 2^32] (check()): head h adds
  ///   -alibi[h] |pos_i - j|,  pos_i = i + kv_len - q_len + alibi_offset,
  /// to the logit of query row i and key j, after the soft-cap (the sinks get none). pos_i is
  /// the row's position among the keys, bottom-right as the causal rule aligns (with a ragged
  /// batch: on each sequence's own lengths); the distance is symmetric, so it means the same
  /// without causal masking. A sub-problem of heads [h0, h0 + n) takes alibi + h0. Zero slopes
  /// are no ALiBi, bit for bit. lse includes the bias.
  const float* alibi = nullptr;
  /// Where ALiBi's distances count from (Problem::alibi; unused without): 0 for a whole
  /// sequence. A call over a slice of a longer problem's rows or keys sets it so that its
  /// distances stay the whole problem's (mha::slice_offset; the parallel driver's units and
  /// split-KV chunks). Within [-2^62, 2^62] (check()).
  std::int64_t alibi_offset = 0;
};

/// True when p soft-caps its logits (Problem::softcap finite and positive; 0 and +inf: none).
inline bool soft_capped(const Problem& p) {
  return p.softcap > 0.0f && p.softcap < std::numeric_limits<float>::infinity();
}

/// True when p adds ALiBi biases (Problem::alibi).
inline bool has_alibi(const Problem& p) { return p.alibi != nullptr; }

/// The alibi_offset of a call over rows [r0, row_end) and keys [c0, key_end) of p (one
/// sequence: no length arrays), as a problem of row_end - r0 rows and key_end - c0 keys, so
/// that its ALiBi distances are p's. Only the ends count: the call's rows are bottom-right
/// aligned to its keys, and r0, c0 shift rows and keys alike.
inline std::int64_t slice_offset(const Problem& p, std::int64_t row_end, std::int64_t key_end) {
  return p.alibi_offset + (p.kv_len - p.q_len) + row_end - key_end;
}

/// True when p has per-sequence lengths (Problem::q_lens or kv_lens).
inline bool ragged(const Problem& p) { return p.q_lens != nullptr || p.kv_lens != nullptr; }

/// Sequence b's query and key counts: q_lens[b] and kv_lens[b], or q_len and kv_len.
inline std::int64_t q_len_of(const Problem& p, std::int64_t b) {
  return p.q_lens != nullptr ? p.q_lens[b] : p.q_len;
}
inline std::int64_t kv_len_of(const Problem& p, std::int64_t b) {
  return p.kv_lens != nullptr ? p.kv_lens[b] : p.kv_len;
}

/// Sequence b of p as a problem of its own: batch 1, its lengths, no length arrays, every
/// other field p's; its tensors start at batch element b of p's (q + b * p.q.batch, ...,
/// lse + b * p.lse.batch). Its lengths may be 0, which check() rejects: a sequence without
/// queries computes nothing, one without keys is all rows that see no key.
inline Problem sequence(const Problem& p, std::int64_t b) {
  Problem s = p;
  s.batch = 1;
  s.q_len = q_len_of(p, b);
  s.kv_len = kv_len_of(p, b);
  s.q_lens = s.kv_lens = nullptr;
  return s;
}

/// K or V as a kernel reads it: the elements, of the problem's kv_type, and for i8 the
/// per-row fp32 scales (null otherwise). Converts from any pointer, so an fp32 call reads
/// fn(p, q, k, v, o, lse, ws) with float pointers, as before reduced-precision caches.
struct KvView {
  const void* data = nullptr;
  const float* scale = nullptr;
  KvView() = default;
  KvView(const void* elements, const float* scales = nullptr) : data(elements), scale(scales) {}
};

/// x advanced by `offset` elements of type t and, for i8, its scales by `scale_offset`.
inline KvView advance(const KvView& x, KvType t, std::int64_t offset, std::int64_t scale_offset) {
  const auto bytes = static_cast<std::int64_t>(kv_type_bytes(t));
  return KvView(static_cast<const unsigned char*>(x.data) + offset * bytes,
                t == KvType::i8 ? x.scale + scale_offset : x.scale);
}

/// Row j of KV head h in batch b of x, K or V of type t with element strides st and, for
/// i8, scale strides sc (p.k and p.k_scale, or p.v and p.v_scale); j or h 0 for a head's
/// first row or a batch's first head. The scale strides of another type are not read:
/// check() does not bound them, so no offset is formed from them.
inline KvView kv_row(const KvView& x, KvType t, const Strides& st, const Strides& sc,
                     std::int64_t b, std::int64_t j, std::int64_t h) {
  const std::int64_t scale_offset = t == KvType::i8 ? b * sc.batch + j * sc.seq + h * sc.head : 0;
  return advance(x, t, b * st.batch + j * st.seq + h * st.head, scale_offset);
}

/// The two common memory layouts of one tensor.
enum class Layout {
  token_major,  ///< [B][L][H][D]: what X * W produces
  head_major,   ///< [B][H][L][D]: the usual KV cache
};

namespace detail {
// a * b for sizes >= 0, saturating at INT64_MAX so that check() reports the overflow
// instead of the layout helpers wrapping around.
inline std::int64_t sat_mul(std::int64_t a, std::int64_t b) {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  if (a <= 0 || b <= 0) return a < 0 || b < 0 ? -1 : 0;
  return a > max / b ? max : a * b;
}
}  // namespace detail

/// Dense strides of a [batch][len][heads][dim] tensor stored in `layout`.
inline Strides dense_strides(Layout layout, std::int64_t len, std::int64_t heads,
                             std::int64_t dim) {
  using detail::sat_mul;
  if (layout == Layout::token_major) {
    return {sat_mul(sat_mul(len, heads), dim), sat_mul(heads, dim), dim};
  }
  return {sat_mul(sat_mul(heads, len), dim), dim, sat_mul(len, dim)};
}

/// A problem with dense tensors in `layout` (all four alike, and i8's scale arrays too: one
/// per row), lse dense [B][H][Lq], scale = 1/sqrt(head_dim) and fp32 K and V. Change single strides
/// afterwards for mixed or padded layouts.
inline Problem make_problem(std::int64_t batch, std::int64_t q_len, std::int64_t kv_len,
                            std::int64_t q_heads, std::int64_t kv_heads, std::int64_t head_dim,
                            bool causal = false, Layout layout = Layout::token_major) {
  Problem p;
  p.batch = batch;
  p.q_len = q_len;
  p.kv_len = kv_len;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.causal = causal;
  p.scale =
      head_dim > 0 ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))) : 1.0f;
  p.q = p.o = dense_strides(layout, q_len, q_heads, head_dim);
  p.k = p.v = dense_strides(layout, kv_len, kv_heads, head_dim);
  p.k_scale = p.v_scale = dense_strides(layout, kv_len, kv_heads, 1);
  p.lse = {detail::sat_mul(q_heads, q_len), q_len};
  return p;
}

/// The end of the keys query row `row` sees: they are [first_key, visible_keys), a prefix
/// [0, visible_keys) without a sliding window. For a problem without per-sequence lengths (or
/// one sequence of it: mha::sequence).
inline std::int64_t visible_keys(const Problem& p, std::int64_t row) {
  if (!p.causal) return p.kv_len;
  const std::int64_t n = row + 1 + (p.kv_len - p.q_len);
  return n < 0 ? 0 : (n > p.kv_len ? p.kv_len : n);
}

/// The first key query row `row` sees: 0, or with a sliding window (Problem::window) the
/// first of its `window` most recent. Never decreases with the row; at most visible_keys.
inline std::int64_t first_key(const Problem& p, std::int64_t row) {
  if (p.window == 0) return 0;
  const std::int64_t first = visible_keys(p, row) - p.window;
  return first < 0 ? 0 : first;
}

/// The number of keys query row `row` sees: visible_keys - first_key.
inline std::int64_t keys_seen(const Problem& p, std::int64_t row) {
  return visible_keys(p, row) - first_key(p, row);
}

/// visible_keys for row `row` (< q_len_of(p, b)) of sequence b, ragged or not.
inline std::int64_t visible_keys(const Problem& p, std::int64_t b, std::int64_t row) {
  return visible_keys(sequence(p, b), row);
}

/// Query head h's sink logit (Problem::sinks), -inf when p has none.
inline float sink_of(const Problem& p, std::int64_t head) {
  return p.sinks != nullptr ? p.sinks[head] : -std::numeric_limits<float>::infinity();
}

/// How a row of a softmax ends: o = acc / divisor, and its lse.
struct RowEnd {
  float divisor;
  float lse;
};

/// A row's end with a sink of logit `sink` (finite; -inf needs no call) folded in, from the
/// row's sum l = sum_j exp(s_j - shift) over the keys it saw (at least one) and the shift its
/// weights were taken relative to (natural-log units; a base-2 kernel passes its shift times
/// ln 2), so that o = acc / divisor with acc = sum_j exp(s_j - shift) v_j: divisor = l +
/// exp(sink - shift), lse = log(exp(shift) l + exp(sink)), each evaluated in double and rounded
/// once (a divisor past fp32's range is inf: the row's weights all round to 0). l == 0 (every
/// logit -inf) leaves the sink alone: o = acc / inf = 0, lse = sink. NaN in l or shift
/// propagates to both.
inline RowEnd sink_row_end(double shift, float l, float sink) {
  const double inf = std::numeric_limits<double>::infinity();
  if (l == 0.0f) return {static_cast<float>(inf), sink};
  const double s = sink;
  const double lse = shift + std::log(static_cast<double>(l));
  const double hi = std::max(lse, s), lo = std::min(lse, s);
  const double sum_lse = std::isnan(lse) ? lse : hi + std::log1p(std::exp(lo - hi));
  return {static_cast<float>(static_cast<double>(l) + std::exp(s - shift)),
          static_cast<float>(sum_lse)};
}

/// Scratch memory a caller owns and lends to one kernel call: `bytes` bytes at `data`,
/// aligned at least as a float (as any allocation is; the kernels align within it). A kernel uses
/// it for its packed tiles and running sums and allocates nothing, so a caller that keeps one
/// workspace makes repeated calls allocation-free.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// How many bytes of workspace a kernel needs for p (which must pass check()). It depends on
/// the sizes only (not on causal, scale, strides or data) and never decreases when q_len
/// or kv_len grows. Compiled for its kernel's ISA: call it where the kernel may run.
/// A size that does not fit size_t is SIZE_MAX (detail::bytes_of), which no allocation
/// gives: the caller fails to allocate instead of lending a wrapped-around size.
using WorkspaceSize = std::size_t (*)(const Problem& p);

/// The kernel signature every variant shares. Preconditions: check(p) is empty, q, k.data,
/// v.data, o are non-null (and k.scale, v.scale when p.kv_type is i8), p.kv_type is one the
/// kernel reads (its registry entry's kv_types), outputs do not overlap inputs, ws holds at
/// least the kernel's WorkspaceSize(p) bytes and overlaps no tensor. lse may be null (then
/// it is not written).
/// Every kernel file defines two functions, mha_f32_attention_<name> of this type and
/// mha_f32_attention_<name>_workspace of type WorkspaceSize. The kernel holds an FpEnvGuard
/// (below) for the call, so its results do not depend on the caller's floating-point
/// environment and the caller's control bits are as they were on return.
using Kernel = void (*)(const Problem& p, const float* q, KvView k, KvView v, float* o, float* lse,
                        Workspace ws);

/// How a kernel computes a ragged problem (Problem::q_lens, kv_lens): `kernel` (itself) on
/// each sequence as the problem of its own that mha::sequence describes, so no work is spent
/// on padding and each sequence's bits are those of its own call. A sequence without a query
/// is skipped; one without a key gets o = 0 and lse = its sink (-inf without) here. ws serves
/// every sequence: a kernel's workspace depends on the sizes only (never on batch) and never
/// decreases as q_len or kv_len grows, and p's lengths bound every sequence's.
inline void each_sequence(Kernel kernel, const Problem& p, const float* q, KvView k, KvView v,
                          float* o, float* lse, Workspace ws) {
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const Problem s = sequence(p, b);
    float* const s_o = o + b * p.o.batch;
    float* const s_lse = lse != nullptr ? lse + b * p.lse.batch : nullptr;
    if (s.q_len == 0) continue;
    if (s.kv_len == 0) {
      for (std::int64_t h = 0; h < s.q_heads; ++h) {
        for (std::int64_t i = 0; i < s.q_len; ++i) {
          float* row = s_o + i * s.o.seq + h * s.o.head;
          std::fill(row, row + s.head_dim, 0.0f);
          if (s_lse != nullptr) s_lse[h * s.lse.head + i] = sink_of(s, h);
        }
      }
      continue;
    }
    kernel(s, q + b * p.q.batch, kv_row(k, p.kv_type, p.k, p.k_scale, b, 0, 0),
           kv_row(v, p.kv_type, p.v, p.v_scale, b, 0, 0), s_o, s_lse, ws);
  }
}

/// Runs the scope it lives in under the default floating-point environment, and gives the
/// caller's back when the scope ends. Frameworks may set flush-to-zero and
/// denormals-are-zero for speed, or another rounding mode, and that environment is per
/// thread: without this, a kernel's results (its exp's rounding steps, its denormal
/// weights) would follow whatever the calling thread, or an OpenMP worker, was left in.
///
/// * Control (restored exactly): x86-64 MXCSR bits 6-15 (DAZ, the exception masks, the
///   rounding mode, FTZ), which govern all SSE/AVX arithmetic, float and double (the x87
///   unit, long double only, is not used and not touched); AArch64 the whole FPCR (FZ, DN,
///   RMode, trap enables). Elsewhere only the rounding mode (std::fesetround).
/// * Status flags are neither saved nor cleared: flags the caller had raised stay raised,
///   and the guarded code may raise more, as any arithmetic does (FE_INEXACT nearly always;
///   the others as the data and discarded vector lanes make them). With every exception
///   masked inside, no trap the caller enabled fires in the guarded code.
/// * Cost: one read of the control register on entry; when the caller's control bits are
///   already the default (the usual case) nothing else, otherwise one write on entry and
///   one on exit. So kernels hold one per call, never one per tile.
///
/// The reads and writes are compiler barriers for memory, so no load of an input moves
/// above the switch and no store of an output below the restore.
class FpEnvGuard {
 public:
  FpEnvGuard() noexcept : saved_(read()) {
    if ((saved_ & ~kFlags) != kDefault) {
      changed_ = true;
      write(kDefault | (saved_ & kFlags));
    }
  }
  ~FpEnvGuard() {
    // The caller's control bits, and every flag raised before or inside the scope.
    if (changed_) write((saved_ & ~kFlags) | (read() & kFlags));
  }
  FpEnvGuard(const FpEnvGuard&) = delete;
  FpEnvGuard& operator=(const FpEnvGuard&) = delete;

 private:
#if defined(__GNUC__) && defined(__x86_64__)
  using Word = std::uint32_t;
  static constexpr Word kFlags = 0x3F;      // IE DE ZE OE UE PE: sticky status flags
  static constexpr Word kDefault = 0x1F80;  // every exception masked, nearest, no FTZ/DAZ
  static Word read() noexcept {
    Word w;
    __asm__ __volatile__("stmxcsr %0" : "=m"(w) : : "memory");
    return w;
  }
  static void write(Word w) noexcept { __asm__ __volatile__("ldmxcsr %0" : : "m"(w) : "memory"); }
#elif defined(__GNUC__) && defined(__aarch64__)
  using Word = std::uint64_t;
  static constexpr Word kFlags = 0;    // the flags live in FPSR, which is left alone
  static constexpr Word kDefault = 0;  // nearest, no flushing, IEEE NaNs, no traps
  static Word read() noexcept {
    Word w;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(w) : : "memory");
    return w;
  }
  static void write(Word w) noexcept { __asm__ __volatile__("msr fpcr, %0" : : "r"(w) : "memory"); }
#else
  using Word = int;
  static constexpr Word kFlags = 0;
  static constexpr Word kDefault = FE_TONEAREST;
  static Word read() noexcept { return std::fegetround(); }
  static void write(Word w) noexcept { std::fesetround(w); }
#endif
  Word saved_;
  bool changed_ = false;
};

/// Thrown when scratch memory cannot be allocated (the driver's workspace of
/// mha::attention, a packed matrix, the layer's scratch and KV cache, merge's row), before
/// any output is written. A std::bad_alloc, so that handlers of running out of memory catch
/// it (pybind11 turns it into MemoryError), whose what() says which call needed what and
/// how many bytes: "mha::attention: out of memory: cannot allocate 4398046512575 bytes for
/// the driver's workspace".
class AllocationError : public std::bad_alloc {
 public:
  AllocationError(const std::string& where, const std::string& what, std::size_t bytes)
      : message_(where + ": out of memory: " +
                 (bytes == std::numeric_limits<std::size_t>::max()
                      ? what + " needs more bytes than a size_t counts"
                      : "cannot allocate " + std::to_string(bytes) + " bytes for " + what)),
        bytes_(bytes) {}
  const char* what() const noexcept override { return message_.what(); }
  /// The bytes asked for; SIZE_MAX when the size itself overflows.
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::runtime_error message_;  // its string is copied without allocating, as exceptions must be
  std::size_t bytes_;
};

namespace detail {

/// allocate(), with a failure to allocate (std::bad_alloc, or std::length_error from a
/// container asked for more than it can hold) thrown as AllocationError(where, what, bytes).
template <typename F>
auto allocate_or_throw(const char* where, const char* what, std::size_t bytes, F&& allocate)
    -> decltype(allocate()) {
  try {
    return allocate();
  } catch (const AllocationError&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw AllocationError(where, what, bytes);
  } catch (const std::length_error&) {
    throw AllocationError(where, what, bytes);
  }
}

/// n * size in bytes, or SIZE_MAX when that does not fit (or n < 0): a size no allocation
/// gives, so the caller fails cleanly instead of wrapping around to a small buffer.
inline std::size_t bytes_of(std::int64_t n, std::size_t size) {
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  if (n < 0 || static_cast<std::uint64_t>(n) > max / size) return max;
  return static_cast<std::size_t>(n) * size;
}

}  // namespace detail

namespace detail {

// a * b + c for non-negative operands, or false when it does not fit in int64_t.
inline bool mul_add(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t* out) {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  if (a != 0 && b > (max - c) / a) return false;
  *out = a * b + c;
  return true;
}

// Highest element offset of a tensor with these extents and strides (all >= 0), with the
// byte offset required to fit in int64_t too. False on overflow.
inline bool highest_offset(const std::int64_t* extent, const std::int64_t* stride, int rank,
                           std::int64_t* out) {
  const std::int64_t max_elements =
      std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(sizeof(float));
  std::int64_t sum = 0;
  for (int i = 0; i < rank; ++i) {
    if (!mul_add(extent[i] - 1, stride[i], sum, &sum) || sum > max_elements) return false;
  }
  *out = sum;
  return true;
}

// True when two distinct indices can map to one offset. Exact for nested layouts (every
// stride at least the span of the smaller ones); interleaved layouts are reported as
// overlapping, which is conservative.
inline bool self_overlaps(const std::int64_t* extent, const std::int64_t* stride, int rank) {
  std::int64_t e[4], s[4];
  int n = 0;
  for (int i = 0; i < rank; ++i) {
    if (extent[i] <= 1) continue;
    if (stride[i] <= 0) return true;
    e[n] = extent[i];
    s[n] = stride[i];
    ++n;
  }
  for (int i = 1; i < n; ++i) {  // insertion sort by stride
    for (int j = i; j > 0 && s[j] < s[j - 1]; --j) {
      std::swap(s[j], s[j - 1]);
      std::swap(e[j], e[j - 1]);
    }
  }
  std::int64_t span = 0;  // highest offset reachable with the smaller strides
  for (int i = 0; i < n; ++i) {
    if (s[i] <= span) return true;
    span += (e[i] - 1) * s[i];  // cannot overflow: highest_offset was checked first
  }
  return false;
}

inline std::string str(std::int64_t v) { return std::to_string(v); }

// A float as %g gives it (1e-40, nan, inf), where std::to_string would print 0.000000.
inline std::string str_g(float v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", static_cast<double>(v));
  return text;
}

}  // namespace detail

/// Validates shapes, strides, scale, the window, the soft-cap, the ALiBi slopes and offset, the
/// sinks' values and the sequences' lengths.
/// Returns an empty string when the problem is valid, otherwise one message naming the field and
/// the constraint it breaks.
inline std::string check(const Problem& p) {
  using detail::str;
  const struct {
    const char* name;
    std::int64_t value;
  } sizes[] = {{"batch", p.batch},     {"q_len", p.q_len},       {"kv_len", p.kv_len},
               {"q_heads", p.q_heads}, {"kv_heads", p.kv_heads}, {"head_dim", p.head_dim}};
  for (const auto& s : sizes) {
    if (s.value <= 0) return std::string(s.name) + " (" + str(s.value) + ") must be positive";
  }
  if (p.q_heads % p.kv_heads != 0) {
    return "q_heads (" + str(p.q_heads) + ") must be a multiple of kv_heads (" + str(p.kv_heads) +
           ")";
  }
  if (!std::isfinite(p.scale) || p.scale == 0.0f) {
    return "scale (" + std::to_string(p.scale) + ") must be finite and non-zero";
  }

  const struct {
    const char* name;
    const Strides& st;
    std::int64_t len, heads;
    bool output;
  } tensors[] = {{"q", p.q, p.q_len, p.q_heads, false},
                 {"k", p.k, p.kv_len, p.kv_heads, false},
                 {"v", p.v, p.kv_len, p.kv_heads, false},
                 {"o", p.o, p.q_len, p.q_heads, true}};
  for (const auto& t : tensors) {
    const std::string name(t.name);
    const std::int64_t stride[4] = {t.st.batch, t.st.seq, t.st.head, 1};
    const std::int64_t extent[4] = {p.batch, t.len, t.heads, p.head_dim};
    const char* field[3] = {"batch", "seq", "head"};
    for (int i = 0; i < 3; ++i) {
      if (stride[i] < 0) {
        return name + "." + field[i] + " stride (" + str(stride[i]) + ") must be >= 0";
      }
    }
    std::int64_t highest = 0;
    if (!detail::highest_offset(extent, stride, 4, &highest)) {
      return "highest offset of " + name + " overflows int64_t bytes (strides {" + str(stride[0]) +
             ", " + str(stride[1]) + ", " + str(stride[2]) + "})";
    }
    if (t.output && detail::self_overlaps(extent, stride, 4)) {
      return name + " strides {batch " + str(stride[0]) + ", seq " + str(stride[1]) + ", head " +
             str(stride[2]) + "} make " + name +
             " overlap itself (outputs need distinct elements; head_dim " + str(p.head_dim) +
             " is contiguous)";
    }
  }

  if (kv_type_bytes(p.kv_type) == 0) {
    return "kv_type (" + str(static_cast<int>(p.kv_type)) + ") is not a KvType";
  }
  if (p.kv_type == KvType::i8) {
    const struct {
      const char* name;
      const Strides& st;
    } scales[] = {{"k_scale", p.k_scale}, {"v_scale", p.v_scale}};
    for (const auto& t : scales) {
      const std::int64_t stride[3] = {t.st.batch, t.st.seq, t.st.head};
      const std::int64_t extent[3] = {p.batch, p.kv_len, p.kv_heads};
      if (stride[0] < 0 || stride[1] < 0 || stride[2] < 0) {
        return std::string(t.name) + " strides {batch " + str(stride[0]) + ", seq " +
               str(stride[1]) + ", head " + str(stride[2]) + "} must be >= 0";
      }
      std::int64_t highest = 0;
      if (!detail::highest_offset(extent, stride, 3, &highest)) {
        return "highest offset of " + std::string(t.name) + " overflows int64_t bytes";
      }
    }
  }

  if (p.window < 0) {
    return "window (" + str(p.window) + ") must be >= 0 (0: no sliding window)";
  }
  if (p.softcap != 0.0f && p.softcap != std::numeric_limits<float>::infinity() &&
      !(p.softcap >= 0x1p-126f && p.softcap <= 0x1p120f)) {
    return "softcap (" + detail::str_g(p.softcap) +
           ") must be 0 or +inf (none), or within [2^-126, 2^120]";
  }

  if (p.alibi != nullptr) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const float a = p.alibi[h];
      if (!(a >= 0.0f && a <= 0x1p32f)) {
        return "alibi[" + str(h) + "] (" + detail::str_g(a) + ") must be within [0, 2^32]";
      }
    }
    if (p.alibi_offset < -(std::int64_t{1} << 62) || p.alibi_offset > (std::int64_t{1} << 62)) {
      return "alibi_offset (" + str(p.alibi_offset) + ") must be within [-2^62, 2^62]";
    }
  }

  if (p.sinks != nullptr) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const float s = p.sinks[h];
      if (std::isnan(s) || s == std::numeric_limits<float>::infinity()) {
        return "sinks[" + str(h) + "] (" + std::to_string(s) + ") must be finite or -inf";
      }
    }
  }

  const struct {
    const char* name;
    const std::int64_t* lens;
    std::int64_t most;
    const char* bound;
  } lengths[] = {{"q_lens", p.q_lens, p.q_len, "q_len"},
                 {"kv_lens", p.kv_lens, p.kv_len, "kv_len"}};
  for (const auto& t : lengths) {
    if (t.lens == nullptr) continue;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      if (t.lens[b] < 0 || t.lens[b] > t.most) {
        return std::string(t.name) + "[" + str(b) + "] (" + str(t.lens[b]) +
               ") must be within [0, " + t.bound + " " + str(t.most) + "]";
      }
    }
  }

  const std::int64_t lse_stride[3] = {p.lse.batch, p.lse.head, 1};
  const std::int64_t lse_extent[3] = {p.batch, p.q_heads, p.q_len};
  if (p.lse.batch < 0 || p.lse.head < 0) {
    return "lse strides {batch " + str(p.lse.batch) + ", head " + str(p.lse.head) +
           "} must be >= 0";
  }
  std::int64_t highest = 0;
  if (!detail::highest_offset(lse_extent, lse_stride, 3, &highest)) {
    return "highest offset of lse overflows int64_t bytes";
  }
  if (detail::self_overlaps(lse_extent, lse_stride, 3)) {
    return "lse strides {batch " + str(p.lse.batch) + ", head " + str(p.lse.head) +
           "} make lse overlap itself (rows of q_len " + str(p.q_len) + " are contiguous)";
  }
  return std::string();
}

/// Number of elements a tensor's buffer must hold: its highest offset + 1 (k and v: of
/// p.kv_type). Valid only for a
/// problem that passed check().
inline std::int64_t extent(const Strides& st, std::int64_t batch, std::int64_t len,
                           std::int64_t heads, std::int64_t dim) {
  return (batch - 1) * st.batch + (len - 1) * st.seq + (heads - 1) * st.head + dim;
}
inline std::int64_t q_extent(const Problem& p) {
  return extent(p.q, p.batch, p.q_len, p.q_heads, p.head_dim);
}
inline std::int64_t k_extent(const Problem& p) {
  return extent(p.k, p.batch, p.kv_len, p.kv_heads, p.head_dim);
}
inline std::int64_t v_extent(const Problem& p) {
  return extent(p.v, p.batch, p.kv_len, p.kv_heads, p.head_dim);
}
inline std::int64_t o_extent(const Problem& p) {
  return extent(p.o, p.batch, p.q_len, p.q_heads, p.head_dim);
}
/// Number of floats of an i8 problem's scale arrays: one per (batch, token, KV head) row.
inline std::int64_t k_scale_extent(const Problem& p) {
  return extent(p.k_scale, p.batch, p.kv_len, p.kv_heads, 1);
}
inline std::int64_t v_scale_extent(const Problem& p) {
  return extent(p.v_scale, p.batch, p.kv_len, p.kv_heads, 1);
}
inline std::int64_t lse_extent(const Problem& p) {
  return (p.batch - 1) * p.lse.batch + (p.q_heads - 1) * p.lse.head + p.q_len;
}

/// Partial results of one problem computed over disjoint KV chunks (split-KV decoding):
/// `count` pairs of o and lse, all with the strides given here.
struct Parts {
  int count = 0;
  const float* const* o = nullptr;
  const float* const* lse = nullptr;
  Strides o_strides;
  LseStrides lse_strides;
};

namespace detail {

// merge() without its validation and without allocating, for callers that built p and parts
// themselves (the parallel driver merges every unit of an already checked problem).
// scratch: parts.count + p.head_dim floats.
inline void merge_unchecked(const Problem& p, const Parts& parts, float* o, float* lse,
                            float* scratch) {
  // Its exp, log and division round as the tolerance assumes, whatever the caller set.
  const FpEnvGuard default_fp_env;
  float* const weight = scratch;             // [parts.count]
  float* const acc = scratch + parts.count;  // one row of o: [head_dim]
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      for (std::int64_t i = 0; i < q_len_of(p, b); ++i) {
        const std::int64_t lse_off = b * parts.lse_strides.batch + h * parts.lse_strides.head + i;
        const std::int64_t part_off =
            b * parts.o_strides.batch + i * parts.o_strides.seq + h * parts.o_strides.head;
        float* out = o + b * p.o.batch + i * p.o.seq + h * p.o.head;
        // The sink is one more part, of o = 0: it weighs in the sum once, whatever the count.
        const float sink = sink_of(p, h);
        float m = sink;
        bool nan = false;
        for (int c = 0; c < parts.count; ++c) {
          const float l = parts.lse[c][lse_off];
          nan |= std::isnan(l);
          m = l > m ? l : m;
        }
        float result_lse;
        if (nan) {
          result_lse = std::numeric_limits<float>::quiet_NaN();
          for (int c = 0; c < parts.count; ++c) weight[c] = result_lse;
        } else if (m == neg_inf) {
          result_lse = neg_inf;
          for (int c = 0; c < parts.count; ++c) weight[c] = 0.0f;
        } else {
          float sum = 0.0f;
          for (int c = 0; c < parts.count; ++c) {
            weight[c] = std::exp(parts.lse[c][lse_off] - m);  // exp(-inf) == 0
            sum += weight[c];
          }
          if (sink != neg_inf) sum += std::exp(sink - m);
          for (int c = 0; c < parts.count; ++c) weight[c] /= sum;
          result_lse = m + std::log(sum);
        }
        // Part by part over the whole row (vector loops), each element summed in part
        // order, and the row written once all parts are read (o may be parts.o[0]). Only a
        // part that saw no key is skipped (its o is zeros by contract); a weight that
        // underflowed to 0 still multiplies, so NaN in that part propagates.
        std::fill(acc, acc + p.head_dim, 0.0f);
        for (int c = 0; c < parts.count; ++c) {
          if (parts.lse[c][lse_off] == neg_inf) continue;
          const float w = weight[c];
          const float* part = parts.o[c] + part_off;
          for (std::int64_t d = 0; d < p.head_dim; ++d) acc[d] += w * part[d];
        }
        std::copy(acc, acc + p.head_dim, out);
        if (lse != nullptr) lse[b * p.lse.batch + h * p.lse.head + i] = result_lse;
      }
    }
  }
}

}  // namespace detail

/// Merges partial results exactly: with m = max_c lse_c and w_c = exp(lse_c - m),
///   o = sum_c w_c o_c / sum_c w_c,   lse = m + log(sum_c w_c).
/// A part whose lse is -inf saw no key and contributes nothing; when every part is -inf the
/// row is zeros with lse -inf. NaN in any part propagates. With sinks (p.sinks), the parts
/// are results without them (computed with sinks = null) and the sink of head h is counted
/// once, as one more part of o = 0 and lse = sinks[h]: m and the sum of w_c include it, so
/// the merged o and lse are those of the whole problem with its sinks. With per-sequence
/// lengths (Problem::q_lens) only sequence b's rows [0, q_lens[b]) are read and written. Shapes and
/// the output strides (p.o, p.lse) come from p; `lse` may be null. `o` may be parts.o[0] (in place)
/// when parts.o_strides equals p.o, since every row is read before it is written. Throws
/// std::invalid_argument on bad input: a problem check() rejects, null pointers, or part
/// strides that are negative or address more than int64_t bytes. Allocates parts.count +
/// head_dim floats of scratch per call, AllocationError when it cannot (before writing
/// anything).
inline void merge(const Problem& p, const Parts& parts, float* o, float* lse) {
  const std::string problem = check(p);
  if (!problem.empty()) throw std::invalid_argument("mha::merge: " + problem);
  if (parts.count < 1 || parts.o == nullptr || parts.lse == nullptr || o == nullptr) {
    throw std::invalid_argument(
        "mha::merge: needs parts.count >= 1 and non-null o, parts.o "
        "and parts.lse");
  }
  for (int c = 0; c < parts.count; ++c) {
    if (parts.o[c] == nullptr || parts.lse[c] == nullptr) {
      throw std::invalid_argument("mha::merge: part " + std::to_string(c) + " is null");
    }
  }
  // The parts' strides as check() takes an input's: any other would lead the reads outside
  // the parts.
  const std::int64_t o_sizes[4] = {p.batch, p.q_len, p.q_heads, p.head_dim};
  const std::int64_t o_strides[4] = {parts.o_strides.batch, parts.o_strides.seq,
                                     parts.o_strides.head, 1};
  const std::int64_t lse_sizes[3] = {p.batch, p.q_heads, p.q_len};
  const std::int64_t lse_strides[3] = {parts.lse_strides.batch, parts.lse_strides.head, 1};
  std::int64_t highest = 0;
  if (*std::min_element(o_strides, o_strides + 3) < 0 ||
      *std::min_element(lse_strides, lse_strides + 2) < 0 ||
      !detail::highest_offset(o_sizes, o_strides, 4, &highest) ||
      !detail::highest_offset(lse_sizes, lse_strides, 3, &highest)) {
    using detail::str;
    throw std::invalid_argument("mha::merge: parts.o_strides {batch " + str(o_strides[0]) +
                                ", seq " + str(o_strides[1]) + ", head " + str(o_strides[2]) +
                                "} and parts.lse_strides {batch " + str(lse_strides[0]) +
                                ", head " + str(lse_strides[1]) +
                                "} must be >= 0 with a highest offset that fits int64_t bytes");
  }
  const std::int64_t floats = parts.count + p.head_dim;
  std::vector<float> scratch = detail::allocate_or_throw(
      "mha::merge", "its scratch row", detail::bytes_of(floats, sizeof(float)),
      [&] { return std::vector<float>(static_cast<std::size_t>(floats)); });
  detail::merge_unchecked(p, parts, o, lse, scratch.data());
}

}  // namespace mha

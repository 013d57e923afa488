// The case generator (sizes at and around vector and tile edges) and how a case prints.
#include "cases.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <vector>

namespace mha::test {

namespace {

const char* name(Layout l) { return l == Layout::token_major ? "token" : "head"; }

const char* name(Storage s) {
  switch (s) {
    case Storage::separate:
      return "separate";
    case Storage::fused_qkv:
      return "fused_qkv";
    case Storage::shared_kv:
      return "shared_kv";
    case Storage::broadcast_batch:
      return "broadcast_batch";
  }
  return "?";
}

const char* name(Values v) {
  switch (v) {
    case Values::uniform:
      return "uniform";
    case Values::large_logits:
      return "large_logits";
    case Values::dominant_key:
      return "dominant_key";
    case Values::equal_keys:
      return "equal_keys";
    case Values::constant_v:
      return "constant_v";
    case Values::sensitive:
      return "sensitive";
  }
  return "?";
}

// Sizes at and around vector and tile boundaries.
constexpr std::int64_t kEdges[] = {1,  2,  3,  4,  7,  8,  9,   15,  16, 17,
                                   31, 32, 33, 63, 64, 65, 127, 128, 129};

// Keys per KV tile of the avx2, avx512 and xsimd kernels.
constexpr std::int64_t kKvTile = 128;

// A size in [lo, hi]: half the time an edge value (or hi), otherwise biased to small values
// (uniform below a random power of two), so that most cases are cheap and shrink well.
rc::Gen<std::int64_t> gen_size(std::int64_t lo, std::int64_t hi) {
  std::vector<std::int64_t> edges;
  for (std::int64_t e : kEdges) {
    if (e >= lo && e <= hi) edges.push_back(e);
  }
  edges.push_back(hi);
  int bits = 0;
  while ((std::int64_t{1} << bits) < hi - lo + 1) ++bits;
  // The bit count grows with RapidCheck's size (small cases first); the rest does not.
  auto small = rc::gen::mapcat(rc::gen::inRange(0, bits + 1), [lo, hi](int b) {
    return unsized(
        rc::gen::inRange<std::int64_t>(lo, std::min(hi, lo + (std::int64_t{1} << b) - 1) + 1));
  });
  auto edge = unsized(rc::gen::elementOf(edges));
  return rc::gen::mapcat(unsized(rc::gen::arbitrary<bool>()),
                         [edge, small](bool at_edge) { return at_edge ? edge : small; });
}

std::vector<std::int64_t> divisors(std::int64_t n, bool proper) {
  std::vector<std::int64_t> out;
  for (std::int64_t d = 1; d <= n; ++d) {
    if (n % d == 0 && !(proper && d == n)) out.push_back(d);
  }
  return out;
}

double work(const Problem& p) {
  return static_cast<double>(p.batch) * static_cast<double>(p.q_heads) *
         static_cast<double>(p.q_len) * static_cast<double>(p.kv_len) *
         static_cast<double>(p.head_dim);
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const Case& c) {
  const Problem& p = c.p;
  os << "B=" << p.batch << " H=" << p.q_heads << " Hkv=" << p.kv_heads << " Lq=" << p.q_len
     << " Lk=" << p.kv_len << " D=" << p.head_dim << " causal=" << p.causal
     << " scale=" << std::setprecision(9) << p.scale << " layouts(q,k,o)=" << name(c.q_layout)
     << "," << name(c.kv_layout) << "," << name(c.o_layout) << " v_layout=" << name(c.v_layout)
     << " pad(q,k,v)=" << c.pad << "," << c.k_pad << "," << c.v_pad << " misalign=" << c.misalign
     << " storage=" << name(c.storage) << " values=" << name(c.values)
     << " value_scale=" << c.value_scale << " seed=" << c.seed;
  if (p.window != 0) os << " window=" << p.window;
  if (p.softcap != 0.0f) os << " softcap=" << p.softcap;
  if (!c.alibi.empty()) {
    os << " alibi=";
    for (std::size_t h = 0; h < c.alibi.size(); ++h) os << (h > 0 ? "," : "") << c.alibi[h];
    if (p.alibi_offset != 0) os << " alibi_offset=" << p.alibi_offset;
  }
  if (!c.sinks.empty()) {
    os << " sinks=";
    for (std::size_t h = 0; h < c.sinks.size(); ++h) os << (h > 0 ? "," : "") << c.sinks[h];
  }
  const auto list = [&](const char* name, const std::vector<std::int64_t>& lens) {
    if (lens.empty()) return;
    os << " " << name << "=";
    for (std::size_t b = 0; b < lens.size(); ++b) os << (b > 0 ? "," : "") << lens[b];
  };
  list("q_lens", c.q_lens);
  list("kv_lens", c.kv_lens);
  return os;
}

void showValue(const Case& c, std::ostream& os) { os << c; }

rc::Gen<Case> gen_case(const CaseOptions& o) {
  return rc::gen::exec([o] {
    Case c;
    Problem& p = c.p;
    const Shape& s = o.shape;
    const bool long_case = o.long_decode || (s.long_cases && !o.q_longer && !o.equal_lengths &&
                                             *unsized(rc::gen::inRange(0, 16)) == 0);
    // 1 in 4 of the others: the keys cross into a second or third KV tile of the 128-key
    // kernels (avx2, avx512, xsimd): a second tile of 1 key, of a whole tile and one off, or
    // max_len keys; cheap, their work capped at a sixteenth by D and q_len, not by the keys.
    // Without them 1 case in 17 had more than 128 keys, and mutants of those kernels'
    // online-softmax rescale and of their last partial tile survived 100 cases in 5 to 27
    // seeds of 100.
    const bool across_tiles =
        !long_case && !o.q_longer && s.max_len > kKvTile && *unsized(rc::gen::inRange(0, 4)) == 0;

    if (o.grouped) {
      p.q_heads = *gen_size(2, std::max<std::int64_t>(2, s.max_heads));
      p.kv_heads = *unsized(rc::gen::elementOf(divisors(p.q_heads, true)));
    } else {
      p.q_heads = *gen_size(1, s.max_heads);
      p.kv_heads = *unsized(rc::gen::elementOf(divisors(p.q_heads, false)));
    }
    p.causal = o.causal < 0 ? *unsized(rc::gen::arbitrary<bool>()) : o.causal == 1;
    double max_work = s.max_work;
    if (long_case) {
      p.batch = 1;
      p.q_len = *unsized(rc::gen::inRange<std::int64_t>(1, 4));
      // A power of two from 256 to 131072 (the longest decode the benchmarks run) or one off
      // it, not sized: many KV tiles (the decode paths' are 16 to 256 keys) and the driver's
      // split-KV chunks. Drawn by gen_size like the other sizes, 19 in 20 of these cases had
      // at most 300 keys, and mutants of the decode paths' rescale survived 100 cases in 7 to
      // 9 seeds of 100. Half of them take the sensitive values (below), on which a dropped
      // tile or key shows at any length.
      const int doubling = *unsized(rc::gen::inRange(o.long_decode ? 14 : 8, 18));
      p.kv_len = std::min<std::int64_t>(
          131072, (std::int64_t{1} << doubling) + *unsized(rc::gen::inRange<std::int64_t>(-1, 2)));
      p.head_dim = *gen_size(1, 4096);
      // A sixteenth of the others' cap: the memory of long K and V, laid out, guarded and
      // compared after every call, costs more than the arithmetic.
      max_work /= 16.0;
      if (o.long_decode) {  // a quarter of the cap, spent on length: D and Lq shrink first
        p.head_dim = *gen_size(8, 256);
        max_work = s.max_work / 4.0;
        while (p.head_dim > 8 && (work(p) > max_work ||
                                  p.kv_len * p.kv_heads * p.head_dim > (std::int64_t{1} << 21))) {
          p.head_dim = std::max<std::int64_t>(8, p.head_dim / 2);
        }
        if (work(p) > max_work) p.q_len = 1;
        while (p.kv_len * p.kv_heads * p.head_dim > (std::int64_t{1} << 21)) {
          p.kv_len = (p.kv_len + 1) / 2;
        }
      }
    } else {
      p.batch = *gen_size(1, s.max_batch);
      p.head_dim = *gen_size(1, s.max_dim);
      if (o.q_longer) {
        p.kv_len = *gen_size(1, s.max_len - 1);
        p.q_len = p.kv_len + *gen_size(1, s.max_len - p.kv_len);
      } else {
        if (across_tiles) {
          std::vector<std::int64_t> lengths{s.max_len};
          for (std::int64_t n : {kKvTile + 1, 2 * kKvTile - 1, 2 * kKvTile, 2 * kKvTile + 1}) {
            if (n < s.max_len) lengths.push_back(n);
          }
          p.kv_len = *unsized(rc::gen::elementOf(lengths));
        } else {
          p.kv_len = *gen_size(1, s.max_len);
        }
        const bool equal = o.equal_lengths || *unsized(rc::gen::inRange(0, 4)) == 0;
        p.q_len = equal ? p.kv_len : *gen_size(1, s.max_len);
      }
    }
    if (across_tiles) max_work /= 16.0;
    // Keep the work per case bounded: the reference is O(B H Lq Lk D) in double.
    while (work(p) > max_work) {
      if (p.batch > 1) {
        p.batch = 1;
      } else if (!across_tiles && p.kv_len >= p.head_dim && p.kv_len >= p.q_len) {
        p.kv_len = (p.kv_len + 1) / 2;
      } else if (p.head_dim >= p.q_len) {
        p.head_dim = (p.head_dim + 1) / 2;
      } else {
        p.q_len = (p.q_len + 1) / 2;
      }
    }
    if (o.q_longer && p.q_len <= p.kv_len) p.q_len = p.kv_len + 1;
    if (o.equal_lengths) p.q_len = p.kv_len = std::min(p.q_len, p.kv_len);

    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
    if (o.any_scale && *unsized(rc::gen::inRange(0, 8)) == 0) {
      const int exponent = *unsized(rc::gen::inRange(-4, 4));
      const bool negative = *unsized(rc::gen::arbitrary<bool>());
      p.scale = std::ldexp(negative ? -p.scale : p.scale, exponent);
    }

    // Every tensor's layout and padding drawn on its own: a kernel that steps through K with
    // V's strides (or q's) meets a case where they differ.
    const auto layout =
        unsized(rc::gen::elementOf(std::vector<Layout>{Layout::token_major, Layout::head_major}));
    const auto pad = [] {
      return *unsized(rc::gen::arbitrary<bool>()) ? 0
                                                  : *unsized(rc::gen::inRange<std::int64_t>(1, 18));
    };
    c.q_layout = *layout;
    c.kv_layout = *layout;
    c.v_layout = *layout;
    c.o_layout = *layout;
    c.pad = pad();
    c.k_pad = pad();
    c.v_pad = pad();
    c.misalign = *unsized(rc::gen::inRange<std::int64_t>(0, 16));
    if (o.any_storage) {
      c.storage = *unsized(rc::gen::elementOf(
          std::vector<Storage>{Storage::separate, Storage::separate, Storage::fused_qkv,
                               Storage::shared_kv, Storage::broadcast_batch}));
      if (c.storage == Storage::fused_qkv && p.q_len != p.kv_len) c.storage = Storage::separate;
    }
    if (c.storage == Storage::shared_kv) {  // one memory: one layout
      c.v_layout = c.kv_layout;
      c.v_pad = c.k_pad;
    }
    if (o.any_values) {
      c.values = *unsized(rc::gen::weightedElement<Values>({{4, Values::uniform},
                                                            {2, Values::large_logits},
                                                            {1, Values::dominant_key},
                                                            {1, Values::equal_keys},
                                                            {1, Values::constant_v},
                                                            {1, Values::sensitive}}));
      if (o.long_decode || (long_case && *unsized(rc::gen::arbitrary<bool>()))) {
        c.values = Values::sensitive;
      }
      // Sensitive k and v are different values, and a dominant key is one batch's.
      if (c.values == Values::sensitive &&
          (c.storage == Storage::shared_kv || c.storage == Storage::broadcast_batch)) {
        c.storage = Storage::separate;
      }
    }
    // Soft-capped cases: half of the uniform ones get large logits instead, so that many
    // logits lie far past the cap (where a running max of uncapped logits loses every weight).
    const bool softcapped =
        o.only_softcaps || (o.any_softcap && *unsized(rc::gen::inRange(0, 4)) == 0);
    if (softcapped && o.any_values && c.values == Values::uniform &&
        *unsized(rc::gen::arbitrary<bool>())) {
      c.values = Values::large_logits;
    }
    double typical = 1.0;  // a typical logit's magnitude
    if (c.values == Values::large_logits) {
      // q, k uniform in [-a, a]: logits have standard deviation about a^2/3 * |scale| *
      // sqrt(D); pick a so that typical logits are 1..3000 (the largest about 1e4).
      typical = std::pow(10.0, *unsized(rc::gen::inRange(0, 349)) / 100.0);
      const double per_scale =
          std::fabs(static_cast<double>(p.scale)) * std::sqrt(static_cast<double>(p.head_dim));
      c.value_scale = std::sqrt(3.0 * typical / per_scale);
    }
    if (o.any_sinks && *unsized(rc::gen::inRange(0, 4)) == 0) {
      // Per head: 1 in 8 -inf (no sink), else within 8 typical logits either way, so that a
      // sink may weigh little, as much as the keys, or nearly everything.
      c.sinks.resize(static_cast<std::size_t>(p.q_heads));
      for (float& sink : c.sinks) {
        const int x = *unsized(rc::gen::inRange(-800, 801));
        sink = *unsized(rc::gen::inRange(0, 8)) == 0 ? -std::numeric_limits<float>::infinity()
                                                     : static_cast<float>(x / 100.0 * typical);
      }
    }
    if (o.any_ragged && *unsized(rc::gen::inRange(0, 3)) == 0) {
      // q_lens, kv_lens or both; per sequence 1 in 8 empty, else anything up to the
      // tensors' lengths (the whole length 1 in 4, as a full sequence beside short ones).
      const int which = *unsized(rc::gen::inRange(0, 3));
      const auto lens = [&](std::int64_t most) {
        std::vector<std::int64_t> out;
        for (std::int64_t b = 0; b < p.batch; ++b) {
          const int kind = *unsized(rc::gen::inRange(0, 8));
          out.push_back(kind == 0   ? 0
                        : kind <= 2 ? most
                                    : *rc::gen::inRange<std::int64_t>(1, most + 1));
        }
        return out;
      };
      if (which != 1) c.q_lens = lens(p.q_len);
      if (which != 0) c.kv_lens = lens(p.kv_len);
    }
    if (o.only_windows || (o.any_window && *unsized(rc::gen::inRange(0, 4)) == 0)) {
      // 1 key; a few, so that a block's rows start at different keys of one tile; one off a
      // KV tile each way, so that the window's edge crosses tiles; any up to the keys; or at
      // least every row's keys (no window, in effect).
      const std::vector<std::int64_t> sizes{1, kKvTile - 1, kKvTile + 1,
                                            std::max<std::int64_t>(1, p.kv_len - 1)};
      switch (*unsized(rc::gen::inRange(0, o.only_windows ? 3 : 4))) {
        case 0:
          p.window = *unsized(rc::gen::elementOf(sizes));
          break;
        case 1:
          p.window = *unsized(rc::gen::inRange<std::int64_t>(1, 9));
          break;
        case 2:
          p.window = *rc::gen::inRange<std::int64_t>(1, p.kv_len + 1);
          break;
        default:
          p.window = p.kv_len + *unsized(rc::gen::inRange<std::int64_t>(0, 3));
      }
    }
    if (softcapped) {
      // From a tenth of a typical logit (nearly every logit near +-c: the cap decides the
      // softmax) to ten times one (most logits in tanh's linear part), 1 in 8 +inf (none).
      const int x = *unsized(rc::gen::inRange(-100, 101));
      p.softcap = !o.only_softcaps && *unsized(rc::gen::inRange(0, 8)) == 0
                      ? std::numeric_limits<float>::infinity()
                      : static_cast<float>(typical * std::pow(10.0, x / 100.0));
    }
    if (o.only_alibi || (o.any_alibi && *unsized(rc::gen::inRange(0, 4)) == 0)) {
      // Per head: the slope that gives the longest distance a bias of 10^x typical logits, x
      // from -1 (a nudge) to 2 (far keys weigh nothing, and a row's max moves: a max of
      // unbiased logits loses every weight of large ones); 1 in 8 heads 0. 1 in 8 cases all
      // zeros (no ALiBi, in effect). 1 in 4 with an offset within the keys either way (the
      // rows' positions moved, as a slice of a longer problem has them).
      const double longest = static_cast<double>(p.q_len + p.kv_len);
      const bool zeros = !o.only_alibi && *unsized(rc::gen::inRange(0, 8)) == 0;
      c.alibi.resize(static_cast<std::size_t>(p.q_heads));
      for (float& slope : c.alibi) {
        const int x = *unsized(rc::gen::inRange(-100, 201));
        slope = zeros || *unsized(rc::gen::inRange(0, 8)) == 0
                    ? 0.0f
                    : static_cast<float>(typical * std::pow(10.0, x / 100.0) / longest);
      }
      if (o.only_alibi && c.alibi[0] == 0.0f) c.alibi[0] = static_cast<float>(typical / longest);
      if (*unsized(rc::gen::inRange(0, 4)) == 0) {
        p.alibi_offset = *rc::gen::inRange<std::int64_t>(-p.kv_len, p.kv_len + 1);
      }
    }
    c.seed = *rc::gen::arbitrary<std::uint64_t>();
    return c;
  });
}

}  // namespace mha::test

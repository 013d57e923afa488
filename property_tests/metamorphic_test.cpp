// Properties that need no oracle: transformations of a problem whose effect on the output
// is known exactly. Each runs once per registry kernel.
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "buffers.h"
#include "cases.h"
#include "compare.h"
#include "driver_properties.h"
#include "kernel_test.h"
#include "run.h"

namespace mha::test {
namespace {

class Metamorphic : public KernelTest {};

// The same bits in every element of o and lse (padding included): a variant's neutral value
// (a sink of -inf, a window over every key, a soft-cap of +inf, zero ALiBi slopes) is none.
void assert_same_bits(const Outputs& none, const Outputs& with) {
  const auto bytes = [](const Guarded& g) { return static_cast<std::size_t>(g.size()) * 4; };
  RC_ASSERT(std::memcmp(none.o.data(), with.o.data(), bytes(none.o)) == 0);
  RC_ASSERT(std::memcmp(none.lse.data(), with.lse.data(), bytes(none.lse)) == 0);
}

// Grouped-query attention is multi-head attention with each KV head repeated for the g
// query heads that read it.
TEST_P(Metamorphic, GqaEqualsRepeatedKvMha) {
  CaseOptions options;
  options.grouped = true;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);

    const std::int64_t g = p.q_heads / p.kv_heads;
    const Dense q = gather(in.q, p.q, p.batch, p.q_len, p.q_heads, p.head_dim);
    Dense k = gather(in.k, p.k, p.batch, p.kv_len, p.kv_heads, p.head_dim);
    Dense v = gather(in.v, p.v, p.batch, p.kv_len, p.kv_heads, p.head_dim);
    Dense k_rep = Dense::zeros(p.batch, p.kv_len, p.q_heads, p.head_dim);
    Dense v_rep = k_rep;
    for_each_element(p.batch, p.kv_len, p.q_heads, p.head_dim, [&](auto b, auto l, auto h, auto d) {
      k_rep.at(b, l, h, d) = k.at(b, l, h / g, d);
      v_rep.at(b, l, h, d) = v.at(b, l, h / g, d);
    });
    Problem mha = p;
    mha.kv_heads = p.q_heads;
    const Inputs in2 = dense_inputs(mha, q, k_rep, v_rep, c.misalign);
    const Outputs out2 = run(call_kernel(kernel()), kernel().name, in2);
    expect_close(p, out, in2.p, out2, tolerance(p, in.q, in.k, in.v, kernel().exp_ulp),
                 "GQA vs repeated-KV MHA");
  });
}

// Without a mask, the order of the keys does not matter as long as values move with them.
TEST_P(Metamorphic, KvPermutationInvariance) {
  CaseOptions options;
  options.causal = 0;
  options.any_window = false;  // a window keeps the last keys
  options.any_alibi = false;   // ALiBi's bias is the keys' distance from the row
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);

    std::vector<std::int64_t> perm(static_cast<std::size_t>(p.kv_len));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(c.seed ^ 0x5bd1e995u));
    const Dense q = gather(in.q, p.q, p.batch, p.q_len, p.q_heads, p.head_dim);
    const Dense k = gather(in.k, p.k, p.batch, p.kv_len, p.kv_heads, p.head_dim);
    const Dense v = gather(in.v, p.v, p.batch, p.kv_len, p.kv_heads, p.head_dim);
    Dense k2 = k, v2 = v;
    for_each_element(
        p.batch, p.kv_len, p.kv_heads, p.head_dim, [&](auto b, auto l, auto h, auto d) {
          k2.at(b, l, h, d) = k.x[static_cast<std::size_t>(
              ((b * p.kv_len + perm[static_cast<std::size_t>(l)]) * p.kv_heads + h) * p.head_dim +
              d)];
          v2.at(b, l, h, d) = v.x[static_cast<std::size_t>(
              ((b * p.kv_len + perm[static_cast<std::size_t>(l)]) * p.kv_heads + h) * p.head_dim +
              d)];
        });
    const Inputs in2 = dense_inputs(p, q, k2, v2, c.misalign);
    const Outputs out2 = run(call_kernel(kernel()), kernel().name, in2);
    expect_close(p, out, in2.p, out2, tolerance(p, in.q, in.k, in.v, kernel().exp_ulp),
                 "keys and values permuted");
  });
}

// Softmax weights sum to one, so a value column that is constant along the sequence comes
// out unchanged: only the accumulation errors remain, whatever the logits. (Not with sinks,
// whose weights the keys' do not include.)
TEST_P(Metamorphic, ConstantValuesComeOutUnchanged) {
  CaseOptions options;
  options.any_sinks = false;
  check_property([&] {
    Case c = *gen_case(options);
    c.values = Values::constant_v;
    if (c.storage == Storage::shared_kv) c.storage = Storage::separate;
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);
    const std::int64_t g = p.q_heads / p.kv_heads;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.q_heads; ++h)
        for (std::int64_t i = 0; i < p.q_len; ++i) {
          const std::int64_t n = ref::keys_seen(p, b, i);
          if (n == 0) continue;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            const double want = in.v[b * p.v.batch + (h / g) * p.v.head + d];
            const double bound = accumulation_factor(static_cast<double>(n)) * std::fabs(want);
            const double got = out.o_at(p, b, h, i, d);
            RC_ASSERT(std::fabs(got - want) <= bound);
          }
        }
  });
}

// Each output is a convex combination of the visible value rows, so it lies within their
// per-column minimum and maximum (up to the accumulation error); with a sink, of those rows
// and a row of zeros (the sink's weight).
TEST_P(Metamorphic, OutputWithinVisibleValueRange) {
  CaseOptions options;
  options.any_ragged = true;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);
    const Tolerance tol = tolerance(p, in.q, in.k, in.v, kernel().exp_ulp);
    const std::int64_t g = p.q_heads / p.kv_heads;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.q_heads; ++h)
        for (std::int64_t i = 0; i < q_len_of(p, b); ++i) {
          const ref::KeyRange keys = ref::key_range(p, b, i);
          const double slack = tol.accumulation[tol.row(b, h, i)];
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            double lo = std::numeric_limits<double>::infinity(), hi = -lo;
            if (sink_of(p, h) != -std::numeric_limits<float>::infinity()) lo = hi = 0.0;
            for (std::int64_t j = keys.first; j < keys.end; ++j) {
              const double x = in.v[b * p.v.batch + j * p.v.seq + (h / g) * p.v.head + d];
              lo = std::min(lo, x);
              hi = std::max(hi, x);
            }
            const double got = out.o_at(p, b, h, i, d);
            if (keys.first == keys.end) {
              RC_ASSERT(got == 0.0);
            } else if (!(got >= lo - slack && got <= hi + slack)) {
              RC_FAIL("o[b=" + std::to_string(b) + "][h=" + std::to_string(h) +
                      "][i=" + std::to_string(i) + "][d=" + std::to_string(d) +
                      "] = " + std::to_string(got) + " outside [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "]");
            }
          }
        }
  });
}

// The same logical tensors in token-major and head-major memory give the same result.
TEST_P(Metamorphic, LayoutsAgree) {
  check_property([&] {
    const Case c = *gen_case();
    Case flipped = c;
    const auto flip = [](Layout l) {
      return l == Layout::token_major ? Layout::head_major : Layout::token_major;
    };
    flipped.q_layout = flip(c.q_layout);
    flipped.kv_layout = flip(c.kv_layout);
    flipped.v_layout = flip(c.v_layout);
    flipped.o_layout = flip(c.o_layout);
    if (flipped.storage == Storage::fused_qkv) flipped.storage = Storage::separate;
    const Inputs in = make_inputs(c);
    const Inputs in2 = make_inputs(flipped);
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);
    const Outputs out2 = run(call_kernel(kernel()), kernel().name, in2);
    expect_close(in.p, out, in2.p, out2, tolerance(in.p, in.q, in.k, in.v, kernel().exp_ulp),
                 "token-major vs head-major");
  });
}

// Query rows [r0, r1) form a problem of their own: causal alignment is bottom-right, so the
// slice keeps the keys up to kv_len - q_len + r1 (none when that is <= 0); with ALiBi its
// distances are the whole's through its alibi_offset (mha::slice_offset).
TEST_P(Metamorphic, RowSlicesAreProblemsOfTheirOwn) {
  check_property([&] {
    const Case c = *gen_case();
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);
    const std::int64_t r0 = *unsized(rc::gen::inRange<std::int64_t>(0, p.q_len));
    const std::int64_t r1 = *unsized(rc::gen::inRange<std::int64_t>(r0 + 1, p.q_len + 1));
    Problem slice = p;
    slice.q_len = r1 - r0;
    if (p.causal) slice.kv_len = p.kv_len - p.q_len + r1;
    slice.alibi_offset = slice_offset(p, r1, slice.kv_len);
    if (slice.kv_len <= 0) {  // every row of the slice sees no key
      for (std::int64_t i = r0; i < r1; ++i) RC_ASSERT(visible_keys(p, i) == 0);
      return;
    }
    const Outputs part =
        run(call_kernel(kernel()), kernel().name, slice, in, in.q + r0 * p.q.seq, in.k, in.v, 7);
    expect_close(p, out, slice, part, tolerance(p, in.q, in.k, in.v, kernel().exp_ulp),
                 "rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ") alone", r0);
  });
}

// Decoding one token at a time over a growing cache gives the causal prefill: row i is the
// problem Lq = 1 over the keys it sees.
TEST_P(Metamorphic, DecodeStepsEqualCausalPrefill) {
  CaseOptions options;
  options.causal = 1;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);
    const Tolerance tol = tolerance(p, in.q, in.k, in.v, kernel().exp_ulp);
    // Every row would cost Lq kernel calls; a sample of 8 keeps the property cheap.
    for (int t = 0; t < 8; ++t) {
      const std::int64_t i = *unsized(rc::gen::inRange<std::int64_t>(0, p.q_len));
      const std::int64_t n = visible_keys(p, i);
      if (n == 0) continue;
      Problem step = p;
      step.q_len = 1;
      step.kv_len = n;
      const Outputs one =
          run(call_kernel(kernel()), kernel().name, step, in, in.q + i * p.q.seq, in.k, in.v, 3);
      expect_close(p, out, step, one, tol, "decode step for row " + std::to_string(i), i);
    }
  });
}

// Causal rows that see no key (q_len > kv_len) are exactly zero with lse = -inf (or their
// head's sink), never NaN.
TEST_P(Metamorphic, FullyMaskedRowsAreZeros) {
  CaseOptions options;
  options.causal = 1;
  options.q_longer = true;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);
    const std::int64_t masked = p.q_len - p.kv_len;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.q_heads; ++h)
        for (std::int64_t i = 0; i < masked; ++i) {
          for (std::int64_t d = 0; d < p.head_dim; ++d) RC_ASSERT(out.o_at(p, b, h, i, d) == 0.0f);
          RC_ASSERT(out.lse_at(p, b, h, i) == sink_of(p, h));
        }
  });
}

// A NaN (or an Inf in v) reaches every output it touches and no other. An infinite q or k
// element makes logits of +-inf (or NaN): -inf weighs exactly 0, +inf makes the row NaN,
// a row of only -inf is NaN; those cases are checked against the reference.
TEST_P(Metamorphic, NonFiniteInputsPropagate) {
  CaseOptions options;
  options.any_ragged = true;  // padding holds NaN already: a poisoned element there reaches nothing
  check_property([&] {
    Case c = *gen_case(options);
    c.storage = Storage::separate;  // one poisoned element must be one logical element
    Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const int tensor = *unsized(rc::gen::inRange(0, 3));  // q, k, v
    const int kind = *unsized(rc::gen::inRange(0, 3));    // NaN, +inf, -inf
    const float inf = std::numeric_limits<float>::infinity();
    const float poison =
        kind == 0 ? std::numeric_limits<float>::quiet_NaN() : (kind == 1 ? inf : -inf);
    const std::int64_t b0 = *unsized(rc::gen::inRange<std::int64_t>(0, p.batch));
    const std::int64_t heads = tensor == 0 ? p.q_heads : p.kv_heads;
    const std::int64_t h0 = *unsized(rc::gen::inRange<std::int64_t>(0, heads));
    const std::int64_t l0 =
        *unsized(rc::gen::inRange<std::int64_t>(0, tensor == 0 ? p.q_len : p.kv_len));
    const std::int64_t d0 = *unsized(rc::gen::inRange<std::int64_t>(0, p.head_dim));
    const Strides& s = tensor == 0 ? p.q : (tensor == 1 ? p.k : p.v);
    float* base = tensor == 0 ? in.q : (tensor == 1 ? in.k : in.v);
    base[b0 * s.batch + l0 * s.seq + h0 * s.head + d0] = poison;
    in.before = in.arena.snapshot();
    const Outputs out = run(call_kernel(kernel()), kernel().name, in);

    if (kind == 0 || tensor == 2) {  // the exact set of outputs it reaches is known
      const std::int64_t g = p.q_heads / p.kv_heads;
      for (std::int64_t b = 0; b < p.batch; ++b)
        for (std::int64_t h = 0; h < p.q_heads; ++h)
          for (std::int64_t i = 0; i < q_len_of(p, b); ++i) {
            const ref::KeyRange keys = ref::key_range(p, b, i);
            const std::int64_t n = keys.end - keys.first;
            const bool same_kv = b == b0 && h / g == h0 && l0 >= keys.first && l0 < keys.end;
            const bool row_hit = n > 0 && ((tensor == 0 && b == b0 && h == h0 && i == l0) ||
                                           (tensor == 1 && same_kv));
            for (std::int64_t d = 0; d < p.head_dim; ++d) {
              const bool hit = row_hit || (tensor == 2 && same_kv && d == d0);
              RC_ASSERT(std::isfinite(out.o_at(p, b, h, i, d)) != hit);
            }
            RC_ASSERT(std::isnan(out.lse_at(p, b, h, i)) == row_hit);
          }
    }
    // Everything, finite or not, matches the reference.
    expect_close(p, out, ref::attention(p, in.q, in.k, in.v),
                 tolerance(p, in.q, in.k, in.v, kernel().exp_ulp), 1.0, "with one poisoned input");
  });
}

// A batch of sequences of different lengths (Problem::q_lens, kv_lens) is its sequences'
// separate calls, bit for bit: the kernel called directly (driver_properties.cpp has the
// property; parallel_test.cpp runs it through the driver).
TEST_P(Metamorphic, RaggedBatchEqualsSeparateCalls) {
  check_property([&] {
    ragged_batch_equals_separate_calls([&](int) { return call_kernel(kernel()); }, kernel().name);
  });
}

// A sink of -inf is no sink (Problem::sinks): the same bits of o and lse.
TEST_P(Metamorphic, MinusInfiniteSinksAreNone) {
  CaseOptions options;
  options.any_sinks = false;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Outputs none = run(call_kernel(kernel()), kernel().name, in);
    const std::vector<float> sinks(static_cast<std::size_t>(in.p.q_heads),
                                   -std::numeric_limits<float>::infinity());
    Problem p = in.p;
    p.sinks = sinks.data();
    const Outputs with = run(call_kernel(kernel()), kernel().name, p, in, in.q, in.k, in.v);
    assert_same_bits(none, with);
  });
}

// A sliding window at least as long as the keys of every row is no window (Problem::window):
// the same bits of o and lse. The shortest such window, or one or two longer.
TEST_P(Metamorphic, WindowOverEveryKeyIsNone) {
  CaseOptions options;
  options.any_window = false;
  options.any_ragged = true;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Outputs none = run(call_kernel(kernel()), kernel().name, in);
    std::int64_t most = 1;
    for (std::int64_t b = 0; b < in.p.batch; ++b) {
      for (std::int64_t i = 0; i < ref::rows_of(in.p, b); ++i) {
        most = std::max(most, ref::keys_seen(in.p, b, i));
      }
    }
    Problem p = in.p;
    p.window = most + *unsized(rc::gen::inRange<std::int64_t>(0, 3));
    const Outputs with = run(call_kernel(kernel()), kernel().name, p, in, in.q, in.k, in.v);
    assert_same_bits(none, with);
  });
}

// A soft-cap of +inf is none (Problem::softcap): the same bits of o and lse.
TEST_P(Metamorphic, SoftcapOfInfinityIsNone) {
  CaseOptions options;
  options.any_softcap = false;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Outputs none = run(call_kernel(kernel()), kernel().name, in);
    Problem p = in.p;
    p.softcap = std::numeric_limits<float>::infinity();
    const Outputs with = run(call_kernel(kernel()), kernel().name, p, in, in.q, in.k, in.v);
    assert_same_bits(none, with);
  });
}

// All-zero ALiBi slopes are no ALiBi (Problem::alibi), whatever the offset: the same bits of o
// and lse.
TEST_P(Metamorphic, ZeroAlibiSlopesAreNone) {
  CaseOptions options;
  options.any_alibi = false;
  options.any_ragged = true;
  check_property([&] {
    const Case c = *gen_case(options);
    const Inputs in = make_inputs(c);
    const Outputs none = run(call_kernel(kernel()), kernel().name, in);
    const std::vector<float> zeros(static_cast<std::size_t>(in.p.q_heads), 0.0f);
    Problem p = in.p;
    p.alibi = zeros.data();
    p.alibi_offset = *rc::gen::inRange<std::int64_t>(-p.kv_len, p.kv_len + 1);
    const Outputs with = run(call_kernel(kernel()), kernel().name, p, in, in.q, in.k, in.v);
    assert_same_bits(none, with);
  });
}

// Partial results over KV chunks merged by their lse equal the whole (mha::merge). Chunks
// of a causal problem end at or before key kv_len - q_len + 1 (seen whole by every row,
// so non-causal) except the last, which stays causal. With sinks, the chunks run without
// them and the merge counts each once (one more part in the tolerance); with ALiBi each
// keeps the whole's distances (mha::slice_offset). With a sliding
// window the keys start at the first row's first key (the others' are later), and the
// problem is cut only where every row's window starts there (one query row, or windows
// that reach key 0): a cut before a row's first key would need that row's window in a
// chunk that is not the last, which no problem expresses.
TEST_P(Metamorphic, SplitKvMergedEqualsWhole) {
  check_property([&] {
    const Case c = *gen_case();
    const Inputs in = make_inputs(c);
    const Problem& p = in.p;
    const std::int64_t first = first_key(p, 0);
    const bool cuttable = first == first_key(p, p.q_len - 1);
    const std::int64_t last_split =
        p.causal ? std::min(p.kv_len, p.kv_len - p.q_len + 1) : p.kv_len;
    std::vector<std::int64_t> cuts = {first};
    if (cuttable && last_split > first + 1) {
      const int n_cuts = *unsized(rc::gen::inRange(1, 4));
      for (int t = 0; t < n_cuts; ++t) {
        cuts.push_back(*unsized(rc::gen::inRange<std::int64_t>(first + 1, last_split)));
      }
    }
    cuts.push_back(p.kv_len);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());

    std::vector<Outputs> parts;
    std::vector<const float*> part_o, part_lse;
    for (std::size_t t = 0; t + 1 < cuts.size(); ++t) {
      Problem chunk = p;
      chunk.kv_len = cuts[t + 1] - cuts[t];
      chunk.causal = p.causal && t + 2 == cuts.size();
      chunk.window = chunk.causal || !cuttable ? p.window : 0;
      chunk.sinks = nullptr;
      chunk.alibi_offset = slice_offset(p, p.q_len, cuts[t + 1]);  // the whole's distances
      parts.push_back(run(call_kernel(kernel()), kernel().name, chunk, in, in.q,
                          in.k + cuts[t] * p.k.seq, in.v + cuts[t] * p.v.seq,
                          static_cast<std::int64_t>(t)));
    }
    for (const Outputs& part : parts) {
      part_o.push_back(part.o.data());
      part_lse.push_back(part.lse.data());
    }
    Outputs merged;
    merged.o = Guarded(o_extent(p), 1);
    merged.lse = Guarded(lse_extent(p), 2);
    Parts list;
    list.count = static_cast<int>(parts.size());
    list.o = part_o.data();
    list.lse = part_lse.data();
    list.o_strides = p.o;
    list.lse_strides = p.lse;
    merge(p, list, merged.o.data(), merged.lse.data());

    const double sink_part = p.sinks != nullptr ? 1.0 : 0.0;
    const Tolerance tol = merged_tolerance(tolerance(p, in.q, in.k, in.v, kernel().exp_ulp),
                                           static_cast<double>(parts.size()) + sink_part);
    expect_close(p, merged, ref::attention(p, in.q, in.k, in.v), tol, 1.0,
                 "merged over " + std::to_string(parts.size()) + " KV chunks");

    // In place, as merge() allows (o = parts.o[0]): the same bits in every element.
    merge(p, list, parts[0].o.data(), nullptr);
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        for (std::int64_t h = 0; h < p.q_heads; ++h) {
          const std::int64_t row = b * p.o.batch + i * p.o.seq + h * p.o.head;
          RC_ASSERT(std::memcmp(parts[0].o.data() + row, merged.o.data() + row,
                                static_cast<std::size_t>(p.head_dim) * sizeof(float)) == 0);
        }
      }
    }
  });
}

MHA_INSTANTIATE_FOR_KERNELS(Metamorphic);

}  // namespace
}  // namespace mha::test

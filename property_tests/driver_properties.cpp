// The parallel driver's properties: see driver_properties.h.
#include "driver_properties.h"

#include <mha/parallel.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "buffers.h"
#include "compare.h"

namespace mha::test {

// Lengths cross the chunk size and tile edges; 2 kChunk - 1 is the longest KV range that is
// not split. Half the time the problem is causal with its first row's last key at a chunk
// edge or one key off it, where the driver's rule of which chunks every row sees whole
// (Plan) is decided: a cut one key past that edge survived 100 cases in every seed
// without these.
rc::Gen<Case> gen_split_case() {
  return rc::gen::exec([] {
    CaseOptions options;
    options.shape.long_cases = false;
    options.shape.max_len = 8;
    options.shape.max_dim = 40;
    options.shape.max_heads = 4;
    options.shape.max_batch = 2;
    Case c = *gen_case(options);
    Problem& p = c.p;
    const std::int64_t chunk = Plan::kChunk;
    p.q_len = *unsized(rc::gen::inRange<std::int64_t>(1, 9));
    if (*unsized(rc::gen::arbitrary<bool>())) {
      p.causal = true;
      const std::int64_t edge = *unsized(rc::gen::elementOf(std::vector<std::int64_t>{2, 3})) *
                                chunk;  // the first row sees keys [0, edge + off)
      const std::int64_t off = *unsized(rc::gen::inRange<std::int64_t>(-1, 2));
      p.kv_len = edge + off + p.q_len - 1;
    } else {
      p.kv_len = *unsized(rc::gen::elementOf(std::vector<std::int64_t>{
          2 * chunk - 1, 2 * chunk, 2 * chunk + 1, 3 * chunk + 17, 5 * chunk - 3}));
    }
    // 1 in 3 a sliding window of at least 2 chunks less the rows (the cut still decided):
    // with causal rows (each window starting a key later) or without.
    p.window = 0;
    if (p.kv_len > 2 * chunk && *unsized(rc::gen::inRange(0, 3)) == 0) {
      p.window = *unsized(rc::gen::inRange<std::int64_t>(2 * chunk - p.q_len + 1, p.kv_len));
    }
    if (c.storage == Storage::fused_qkv) c.storage = Storage::separate;
    return c;
  });
}

// A quarter of the driver's reference cases: 16 query heads on 1 or 2 KV heads, so that the
// driver cuts each KV head's rows into blocks of 32 or 64 (Plan::row_block), and one to
// three blocks of rows. Few generated cases had more than one block (g = 16 needs more than
// 32 rows, g = 2 more than 256), and a slice whose keys ignored its first row survived 100
// cases in 27 seeds of 100. D <= 16 and at most 17 more keys than rows keep them cheap.
rc::Gen<Case> gen_sliced_case() {
  return rc::gen::exec([] {
    CaseOptions options;
    options.shape.long_cases = false;
    options.shape.max_dim = 16;
    options.shape.max_batch = 1;
    Case c = *gen_case(options);
    Problem& p = c.p;
    p.q_heads = 16;
    p.kv_heads = *unsized(rc::gen::elementOf(std::vector<std::int64_t>{1, 2}));
    // Mostly causal: which keys a block's rows see depends on where the block starts.
    p.causal = *unsized(rc::gen::inRange(0, 4)) != 0;
    const std::int64_t rows = plan(p).row_block;
    p.q_len = rows * *unsized(rc::gen::inRange<std::int64_t>(1, 3)) +
              *unsized(rc::gen::inRange<std::int64_t>(-1, 2));
    // As many keys (prefill), a few more, or fewer: then the first blocks see none.
    p.kv_len = std::max<std::int64_t>(
        1,
        p.q_len + *unsized(rc::gen::elementOf(std::vector<std::int64_t>{-rows - 1, -1, 0, 1, 17})));
    if (c.storage == Storage::fused_qkv && p.q_len != p.kv_len) c.storage = Storage::separate;
    return c;
  });
}

void check_driver(const KernelInfo& kernel, const Case& c, int threads,
                  const ParallelDriver& driver) {
  const Inputs in = make_inputs(c);
  const Outputs out = run(call_driver(kernel, threads, driver), kernel.name, in);
  // A ragged batch's sequences are cut each on its own: the most chunks of any bounds all.
  std::int64_t chunks = 1;
  for (std::int64_t b = 0; b < in.p.batch; ++b) {
    chunks = std::max(chunks, plan(sequence(in.p, b)).chunks);
  }
  // A split unit's merge counts the sinks as one more part.
  const bool sink_part = chunks > 1 && in.p.sinks != nullptr;
  const Tolerance tol = merged_tolerance(tolerance(in.p, in.q, in.k, in.v, kernel.exp_ulp),
                                         static_cast<double>(chunks + (sink_part ? 1 : 0)));
  expect_close(
      in.p, out, ref::attention(in.p, in.q, in.k, in.v), tol, 1.0,
      std::string(kernel.name) + " through the driver (" + std::to_string(chunks) + " KV chunks)");
}

void driver_matches_reference(const KernelInfo& kernel, const ParallelDriver& driver) {
  const bool sliced = *unsized(rc::gen::inRange(0, 4)) == 0;
  CaseOptions ragged;
  ragged.any_ragged = true;
  check_driver(kernel, sliced ? *gen_sliced_case() : *gen_case(ragged), 2, driver);
}

void split_kv_decoding_matches_reference(const KernelInfo& kernel, const ParallelDriver& driver) {
  const Case c = *gen_split_case();
  RC_TAG(plan(make_inputs(c).p).chunks > 1 ? "split" : "whole");
  check_driver(kernel, c, 2, driver);
}

// The decomposition depends only on the problem, so any thread count computes the same
// operations in the same order.
void thread_count_does_not_change_a_bit(const KernelInfo& kernel, const ParallelDriver& driver) {
  const Case c = *unsized(rc::gen::arbitrary<bool>()) ? *gen_split_case() : *gen_case();
  const Inputs in = make_inputs(c);
  const Outputs one = run(call_driver(kernel, 1, driver), kernel.name, in);
  const int threads = *unsized(rc::gen::inRange(2, 5));
  const Outputs many = run(call_driver(kernel, threads, driver), kernel.name, in);
  const auto bytes = [](const Guarded& g) { return static_cast<std::size_t>(g.size()) * 4; };
  RC_ASSERT(std::memcmp(one.o.data(), many.o.data(), bytes(one.o)) == 0);
  RC_ASSERT(std::memcmp(one.lse.data(), many.lse.data(), bytes(one.lse)) == 0);
}

// The cut depends on each sequence alone, so a sequence gives the same bits whatever else is
// batched with it: sequence 0 alone and first in a batch of 2 to 24 whose other sequences
// hold other values (split cases half the time: a cut decided on the whole batch's units
// changes at 16 units).
void batch_does_not_change_a_sequence(const KernelInfo& kernel, const ParallelDriver& driver) {
  Case c = *unsized(rc::gen::arbitrary<bool>()) ? *gen_split_case() : *gen_case();
  c.p.batch = 1;
  const Inputs drawn = make_inputs(c);
  const Problem& p = drawn.p;
  const std::int64_t batch = *unsized(rc::gen::inRange<std::int64_t>(2, 25));
  RC_TAG(plan(p).chunks > 1 ? "split" : "whole");
  std::mt19937_64 rng(c.seed ^ 0x9E3779B97F4A7C15u);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  // Both runs over dense token-major copies, so that only the batch differs.
  const auto batched = [&](const float* x, const Strides& st, std::int64_t len,
                           std::int64_t heads) {
    const Dense first = gather(x, st, 1, len, heads, p.head_dim);
    Dense all = Dense::zeros(batch, len, heads, p.head_dim);
    std::copy(first.x.begin(), first.x.end(), all.x.begin());
    for (auto it = all.x.begin() + static_cast<std::ptrdiff_t>(first.x.size()); it != all.x.end();
         ++it) {
      *it = unit(rng);
    }
    return std::make_pair(first, all);
  };
  const auto [q1, qn] = batched(drawn.q, p.q, p.q_len, p.q_heads);
  const auto [k1, kn] = batched(drawn.k, p.k, p.kv_len, p.kv_heads);
  const auto [v1, vn] = batched(drawn.v, p.v, p.kv_len, p.kv_heads);
  Problem shape = p;  // its sinks stay drawn's
  const Inputs alone = dense_inputs(shape, q1, k1, v1, 0);
  shape.batch = batch;
  const Inputs among = dense_inputs(shape, qn, kn, vn, 0);
  const Outputs a = run(call_driver(kernel, 2, driver), kernel.name, alone);
  const Outputs b = run(call_driver(kernel, 2, driver), kernel.name, among);
  // Sequence 0 is the first q_len * q_heads * head_dim floats of o and q_heads * q_len of lse
  // in both (dense, batch outermost).
  const auto floats = [](std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); };
  RC_ASSERT(std::memcmp(a.o.data(), b.o.data(), floats(p.q_len * p.q_heads * p.head_dim)) == 0);
  RC_ASSERT(std::memcmp(a.lse.data(), b.lse.data(), floats(p.q_heads * p.q_len)) == 0);
}

// A batch of sequences of different lengths (Problem::q_lens, kv_lens) gives each sequence
// the bits of its call alone (mha::sequence), whatever the batch and the thread counts; a
// sequence without keys is zeros with lse its sink, one without queries is not written
// (run() fails on a write to its rows). Half the cases are split decodes, so that a sequence
// short of the split length sits beside long ones.
void ragged_batch_equals_separate_calls(const std::function<Call(int threads)>& call,
                                        const std::string& name) {
  Case c = *unsized(rc::gen::arbitrary<bool>()) ? *gen_split_case() : *gen_case();
  c.p.batch = *unsized(rc::gen::inRange<std::int64_t>(2, 7));
  c.q_lens.clear();
  c.kv_lens.clear();
  const auto length = [](std::int64_t most) {
    return *unsized(rc::gen::inRange(0, 8)) == 0 ? 0 : *rc::gen::inRange<std::int64_t>(1, most + 1);
  };
  for (std::int64_t b = 0; b < c.p.batch; ++b) {
    c.q_lens.push_back(length(c.p.q_len));
    c.kv_lens.push_back(length(c.p.kv_len));
  }
  const Inputs in = make_inputs(c);
  const Problem& p = in.p;
  const int threads = *unsized(rc::gen::inRange(1, 5));
  const Outputs all = run(call(threads), name, in);
  const auto same_bits = [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const Problem s = sequence(p, b);
    if (s.q_len == 0) continue;
    Outputs one;
    const bool keys = s.kv_len > 0;
    if (keys) {
      one = run(call(*unsized(rc::gen::inRange(1, 5))), name, s, in, in.q + b * p.q.batch,
                kv_row(in.k, p.kv_type, p.k, p.k_scale, b, 0, 0),
                kv_row(in.v, p.kv_type, p.v, p.v_scale, b, 0, 0));
    }
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      for (std::int64_t i = 0; i < s.q_len; ++i) {
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          const float want = keys ? one.o_at(s, 0, h, i, d) : 0.0f;
          MHA_RC_ASSERT(same_bits(all.o_at(p, b, h, i, d), want),
                        name << ": o[b=" << b << "][h=" << h << "][i=" << i << "][d=" << d << "] = "
                             << all.o_at(p, b, h, i, d) << " in the batch, " << want << " alone");
        }
        const float want = keys ? one.lse_at(s, 0, h, i) : sink_of(p, h);
        MHA_RC_ASSERT(same_bits(all.lse_at(p, b, h, i), want),
                      name << ": lse[b=" << b << "][h=" << h << "][i=" << i << "] = "
                           << all.lse_at(p, b, h, i) << " in the batch, " << want << " alone");
      }
    }
  }
}

void ragged_batch_equals_separate_calls(const KernelInfo& kernel, const ParallelDriver& driver) {
  ragged_batch_equals_separate_calls(
      [&](int threads) { return call_driver(kernel, threads, driver); },
      std::string(kernel.name) + " through the driver");
}

}  // namespace mha::test

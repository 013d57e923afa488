// The two factories of Calls, running a Call under guard checks, the equivalence property.
#include "run.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include <mha/support.h>

#include "compare.h"

namespace mha::test {

namespace {

// Elements of a [batch][len][heads][dim] tensor with strides s; batch element b has its
// first len(b) rows only (a ragged sequence's rows past its length are no outputs).
template <typename Len>
std::vector<bool> element_mask(std::int64_t size, const Strides& s, std::int64_t batch, Len len,
                               std::int64_t heads, std::int64_t dim) {
  std::vector<bool> mask(static_cast<std::size_t>(size), false);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t l = 0; l < len(b); ++l)
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::int64_t row = b * s.batch + l * s.seq + h * s.head;
        std::fill_n(mask.begin() + row, dim, true);
      }
  return mask;
}

}  // namespace

namespace {

// Calls f(ws) with a workspace of exactly `bytes` bytes in a guarded buffer: filled with the
// pattern, so a read before a write shows as NaN in the output, and a write past either end
// fails the property. Its start moves with the problem (0 to 15 floats past the start of
// the buffer's allocation), so the code under test cannot rely on an alignment it was not
// promised.
template <typename F>
void with_workspace(const Problem& p, std::size_t bytes, const char* name, F&& f) {
  Guarded ws(static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float)),
             (p.head_dim + p.q_len) % 16);
  f(Workspace{ws.data(), bytes});
  const std::string guard =
      ws.untouched_outside(std::vector<bool>(static_cast<std::size_t>(ws.size()), true));
  if (!guard.empty()) RC_FAIL(std::string(name) + " wrote outside its workspace: " + guard);
}

}  // namespace

Call call_kernel(const KernelInfo& kernel) {
  return [kernel](const Problem& p, const float* q, KvView k, KvView v, float* o, float* lse) {
    with_workspace(p, kernel.workspace(p), kernel.name,
                   [&](Workspace ws) { kernel.fn(p, q, k, v, o, lse, ws); });
  };
}

Call call_driver(const KernelInfo& kernel, int threads, const ParallelDriver& driver) {
  return [kernel, threads, driver](const Problem& p, const float* q, KvView k, KvView v, float* o,
                                   float* lse) {
    with_workspace(p, driver.workspace(kernel.workspace, p, threads), kernel.name,
                   [&](Workspace ws) {
                     driver.attention(kernel.fn, kernel.workspace, p, q, k, v, o, lse, threads, ws);
                   });
  };
}

Outputs run(const Call& call, const std::string& name, const Inputs& in, std::int64_t misalign) {
  return run(call, name, in.p, in, in.q, in.k, in.v, misalign);
}

Outputs run(const Call& call, const std::string& name, const Problem& p, const Inputs& in,
            const float* q, KvView k, KvView v, std::int64_t misalign) {
  Outputs out;
  out.o = Guarded(o_extent(p), misalign);
  out.lse = Guarded(lse_extent(p), (misalign + 3) % 16);
  call(p, q, k, v, out.o.data(), out.lse.data());

  RC_ASSERT_FALSE(!in.arena.same_as(in.before));  // a kernel wrote into its inputs
  const auto rows = [&](std::int64_t b) { return ref::rows_of(p, b); };
  const std::string o_guard = out.o.untouched_outside(
      element_mask(out.o.size(), p.o, p.batch, rows, p.q_heads, p.head_dim));
  if (!o_guard.empty()) RC_FAIL(name + " wrote outside o: " + o_guard);
  const Strides lse_as_tensor{p.lse.batch, 1, p.lse.head};  // [b][i][h] with d = 1
  const std::string lse_guard = out.lse.untouched_outside(
      element_mask(out.lse.size(), lse_as_tensor, p.batch, rows, p.q_heads, 1));
  if (!lse_guard.empty()) RC_FAIL(name + " wrote outside lse: " + lse_guard);
  return out;
}

void check_equivalence(const KernelInfo& kernel, const Case& c) {
  const Inputs in = make_inputs(c);
  const Outputs out = run(call_kernel(kernel), kernel.name, in, (c.misalign + 5) % 16);
  const ref::Result expected = ref::attention(in.p, in.q, in.k, in.v);
  const Tolerance tol = tolerance(in.p, in.q, in.k, in.v, kernel.exp_ulp);
  expect_close(in.p, out, expected, tol, 1.0, std::string(kernel.name) + " vs reference");
}

Inputs alibi_reach_inputs(double* bound) {
  CaseOptions options;
  options.causal = 1;
  options.only_alibi = true;
  Case c = *gen_case(options);
  if (*unsized(rc::gen::arbitrary<bool>())) {
    // Half the cases logits of typically 100 to 3000 (q, k uniform in [-a, a], as
    // gen_case's large_logits): logits spread past the margin, so that a reach that counted
    // the margin alone would drop keys that weigh.
    const double typical = std::pow(10.0, *unsized(rc::gen::inRange(200, 349)) / 100.0);
    const double per_scale =
        std::fabs(static_cast<double>(c.p.scale)) * std::sqrt(static_cast<double>(c.p.head_dim));
    c.values = Values::large_logits;
    c.value_scale = std::sqrt(3.0 * typical / per_scale);
  }
  const std::int64_t g = c.p.q_heads / c.p.kv_heads;
  const std::int64_t rows = support::ceil_div(support::AlibiReach::kMinRows, g);
  if (c.p.q_len < rows) {
    c.p.q_len = rows;
    if (c.storage == Storage::fused_qkv) c.storage = Storage::separate;  // needs Lq == Lk
  }
  Inputs in = make_inputs(c);
  const Problem& p = in.p;
  const auto largest_norm = [&](const float* x, const Strides& s, std::int64_t len,
                                std::int64_t heads) {
    double most = 0;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t l = 0; l < len; ++l)
        for (std::int64_t h = 0; h < heads; ++h) {
          double n2 = 0;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            const double e = x[b * s.batch + l * s.seq + h * s.head + d];
            n2 += e * e;
          }
          most = std::max(most, std::sqrt(n2));
        }
    return most;
  };
  const double u = std::fabs(static_cast<double>(p.scale)) *
                   largest_norm(in.q, p.q, p.q_len, p.q_heads) *
                   largest_norm(in.k, p.k, p.kv_len, p.kv_heads);
  for (float& slope : in.alibi) {  // p.alibi points here
    const double y = *unsized(rc::gen::inRange(30, 201)) / 100.0;
    slope = static_cast<float>((2 * u + 30) * std::pow(10.0, y) / static_cast<double>(p.kv_len));
  }
  if (bound != nullptr) *bound = u;
  return in;
}

void check_alibi_reach(const KernelInfo& kernel) {
  Inputs in = alibi_reach_inputs();
  const Problem& p = in.p;
  const std::int64_t window = support::AlibiReach::of(p, in.q, in.k, in.v);
  RC_TAG(window > 0 ? "reach" : "no reach");
  const bool poison = window > 0 && *unsized(rc::gen::inRange(0, 3)) == 0;
  const std::int64_t b0 = *unsized(rc::gen::inRange<std::int64_t>(0, p.batch));
  const std::int64_t h0 = *unsized(rc::gen::inRange<std::int64_t>(0, p.kv_heads));
  const std::int64_t d0 = *unsized(rc::gen::inRange<std::int64_t>(0, p.head_dim));
  if (poison) {
    in.v[b0 * p.v.batch + h0 * p.v.head + d0] = std::numeric_limits<float>::quiet_NaN();
    in.before = in.arena.snapshot();
  }
  const Outputs out = run(call_kernel(kernel), kernel.name, in);
  if (poison) {  // every row that sees key 0 (with shared K and V, its k too: the whole row)
    const std::int64_t g = p.q_heads / p.kv_heads;
    for (std::int64_t h = h0 * g; h < (h0 + 1) * g; ++h) {
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const ref::KeyRange keys = ref::key_range(p, b0, i);
        if (keys.first == 0 && keys.end > 0) RC_ASSERT(std::isnan(out.o_at(p, b0, h, i, d0)));
      }
    }
  }
  expect_close(p, out, ref::attention(p, in.q, in.k, in.v),
               tolerance(p, in.q, in.k, in.v, kernel.exp_ulp), 1.0,
               std::string(kernel.name) + " vs reference, ALiBi's reach " + std::to_string(window) +
                   (poison ? ", NaN in v at key 0" : ""));
}

}  // namespace mha::test

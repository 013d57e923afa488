// The two factories of Calls, running a Call under guard checks, the equivalence property.
#include "run.h"

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

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

}  // namespace mha::test

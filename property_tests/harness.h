// Test harness: generated attention cases, guarded buffers, running a kernel and comparing
// its outputs with the reference under the shared tolerance.
#pragma once

#include <mha/attention.h>
#include <mha/registry.h>
#include <rapidcheck.h>

#include <cstdint>
#include <string>

#include "buffers.h"
#include "cases.h"
#include "reference.h"
#include "tolerance.h"

namespace mha::test {

using ref::accumulation_factor;
using ref::Tolerance;
using ref::tolerance;

/// Runs `kernel` on the inputs (with lse requested) and asserts (RC_ASSERT) that nothing
/// outside o's and lse's elements was written, inputs included.
Outputs run(const KernelInfo& kernel, const Inputs& in, std::int64_t misalign = 0);

/// The same for a problem `p` over the inputs' arena at other pointers (slices, chunks).
Outputs run(const KernelInfo& kernel, const Problem& p, const Inputs& in, const float* q,
            const float* k, const float* v, std::int64_t misalign = 0);

/// Asserts that out matches the reference within tol: finite values within the bound,
/// non-finite values exactly where the reference has them, exact zeros and -inf for rows
/// that see no key. `scale` multiplies the tolerance (2 when both sides are kernels).
void expect_close(const Problem& p, const Outputs& out, const ref::Result& expected,
                  const Tolerance& tol, double scale, const std::string& what);

/// The same against another kernel's outputs: rows [row0, row0 + p2.q_len) of (p, out)
/// against all rows of (p2, out2), within twice the tolerance (each side is within tol of
/// the exact result). `tol` is indexed like p.
void expect_close(const Problem& p, const Outputs& out, const Problem& p2, const Outputs& out2,
                  const Tolerance& tol, const std::string& what, std::int64_t row0 = 0);

/// The tolerance of a result merged from `parts` partial results (split-KV): each part is
/// within the whole problem's tolerance (fewer keys, same maxima); merging perturbs the
/// part weights exp(lse_c - m) by at most twice the lse tolerance and adds the
/// accumulation error of `parts` terms.
Tolerance merged_tolerance(Tolerance tol, double parts);

/// Runs the parallel driver with `kernel` on `threads` threads over the inputs; the same
/// guard checks as run().
Outputs run_driver(const KernelInfo& kernel, const Inputs& in, int threads);

/// The full equivalence property: reference vs kernel on one case.
void check_equivalence(const KernelInfo& kernel, const Case& c);

/// Runs a RapidCheck property inside the current GoogleTest test, like RC_GTEST_PROP does:
/// RC_PARAMS controls counts and seeds, a failure prints the shrunk case and its
/// `reproduce` string.
template <typename Testable>
void check_property(Testable&& testable);

}  // namespace mha::test

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

template <typename Testable>
void mha::test::check_property(Testable&& testable) {
  rc::detail::checkGTest(std::forward<Testable>(testable));
}

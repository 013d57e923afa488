// Comparing outputs: with the reference or with another call under the shared tolerance
// (reference/tolerance.h), and the tolerance of a result merged from split-KV parts.
#pragma once

#include <mha/attention.h>

#include <cstdint>
#include <string>

#include "buffers.h"
#include "reference.h"
#include "tolerance.h"

namespace mha::test {

using ref::accumulation_factor;
using ref::merged_tolerance;
using ref::Tolerance;
using ref::tolerance;

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

}  // namespace mha::test

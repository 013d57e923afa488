// Row-by-row comparison of outputs within the tolerance.
#include "compare.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

namespace mha::test {

namespace {

void fail(const std::string& what, const char* quantity, std::int64_t b, std::int64_t h,
          std::int64_t i, std::int64_t d, double got, double want, double bound) {
  std::ostringstream os;
  os << std::setprecision(9) << what << ": " << quantity << "[b=" << b << "][h=" << h << "][i=" << i
     << "]";
  if (d >= 0) os << "[d=" << d << "]";
  os << " = " << got << ", expected " << want << " (|diff| " << std::fabs(got - want) << ", bound "
     << bound << ")";
  RC_FAIL(os.str());
}

// `got` must equal `want` within `bound`, with non-finite values exactly where expected.
bool close(double got, double want, double bound) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return !std::isfinite(got);
  return std::isfinite(got) && std::fabs(got - want) <= bound;
}

// Rows [row0, row0 + rows) of p, every head and column: got_* against want_* (indexed by
// p's row) within scale times the row's tolerance. A row that sees no key must be exactly
// zeros with lse = -inf (its head's sink) on both sides; an infinite expected lse must be
// matched exactly.
template <typename GotO, typename GotLse, typename WantO, typename WantLse>
void compare_rows(const Problem& p, std::int64_t row0, std::int64_t rows, const Tolerance& tol,
                  double scale, const std::string& what, GotO got_o, GotLse got_lse, WantO want_o,
                  WantLse want_lse) {
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const double empty_lse = sink_of(p, h);
      // A ragged sequence's rows past its length are no outputs (run() checks that they
      // were not written).
      for (std::int64_t i = row0; i < std::min(row0 + rows, ref::rows_of(p, b)); ++i) {
        const bool masked = ref::keys_seen(p, b, i) == 0;
        const std::size_t r = tol.row(b, h, i);
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          const double got = got_o(b, h, i, d), want = want_o(b, h, i, d);
          const bool ok = masked ? got == 0.0 && want == 0.0 : close(got, want, scale * tol.o[r]);
          if (!ok) fail(what, "o", b, h, i, d, got, want, scale * tol.o[r]);
        }
        const double got = got_lse(b, h, i), want = want_lse(b, h, i);
        const bool ok =
            masked ? got == empty_lse && want == empty_lse
                   : (std::isinf(want) ? got == want : close(got, want, scale * tol.lse[r]));
        if (!ok) fail(what, "lse", b, h, i, -1, got, want, scale * tol.lse[r]);
      }
    }
  }
}

}  // namespace

void expect_close(const Problem& p, const Outputs& out, const ref::Result& expected,
                  const Tolerance& tol, double scale, const std::string& what) {
  compare_rows(
      p, 0, p.q_len, tol, scale, what,
      [&](auto b, auto h, auto i, auto d) { return out.o_at(p, b, h, i, d); },
      [&](auto b, auto h, auto i) { return out.lse_at(p, b, h, i); },
      [&](auto b, auto h, auto i, auto d) { return expected.o_at(b, h, i, d); },
      [&](auto b, auto h, auto i) { return expected.lse_at(b, h, i); });
}

void expect_close(const Problem& p, const Outputs& out, const Problem& p2, const Outputs& out2,
                  const Tolerance& tol, const std::string& what, std::int64_t row0) {
  // Both sides are within tol of the exact result, so within 2 tol of each other.
  compare_rows(
      p, row0, p2.q_len, tol, 2.0, what,
      [&](auto b, auto h, auto i, auto d) { return out2.o_at(p2, b, h, i - row0, d); },
      [&](auto b, auto h, auto i) { return out2.lse_at(p2, b, h, i - row0); },
      [&](auto b, auto h, auto i, auto d) { return out.o_at(p, b, h, i, d); },
      [&](auto b, auto h, auto i) { return out.lse_at(p, b, h, i); });
}

}  // namespace mha::test

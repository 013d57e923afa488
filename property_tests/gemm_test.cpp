// The GEMM kernels (kernels/gemm/, mha/gemm.h), each against a reference GEMM in double, with
// the bound gamma(k + 1) (sum |a b| + |bias|) the contract states; against each other; and
// through the driver (mha::gemm) for every thread count. Parameterized over the GEMM list,
// so a new kernel is tested without touching this file.
#include <gtest/gtest.h>
#include <mha/parallel.h>
#include <mha/registry.h>
#include <mha/support.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "buffers.h"
#include "gemm_kernel_test.h"
#include "run.h"

namespace mha::test {
namespace {

using support::ceil_div;
using support::round_up;

class Gemm : public GemmKernelTest {};

// One GEMM: sizes, B's layout (plain [k][n] or transposed [n][k]), C's padding, bias.
struct Shape {
  std::int64_t m = 1, n = 1, k = 1, ldc_pad = 0;
  bool transposed = false, bias = false;
  float magnitude = 1.0f;  // values uniform in [-magnitude, magnitude]
};

void showValue(const Shape& s, std::ostream& os) {
  os << "m " << s.m << " n " << s.n << " k " << s.k << " ldc +" << s.ldc_pad
     << (s.transposed ? " B transposed" : " B plain") << (s.bias ? " bias" : "")
     << " |x| <= " << s.magnitude;
}

// A size around whole tiles of `width`: 1..3 tiles, one below, at and above each edge, or a
// prime; at most `cap`.
rc::Gen<std::int64_t> gen_size(std::int64_t width, std::int64_t cap) {
  return rc::gen::exec([=] {
    const std::int64_t tiles = *rc::gen::inRange<std::int64_t>(1, 4);
    std::int64_t n = 0;
    switch (*rc::gen::inRange(0, 3)) {
      case 0:
        n = tiles * width + *rc::gen::inRange<std::int64_t>(-1, 2);
        break;
      case 1:
        n = *rc::gen::elementOf(std::vector<std::int64_t>{1, 2, 3, 5, 7, 11, 13, 17, 31, 37, 61, 97,
                                                          127, 131, 257, 509});
        break;
      default:
        n = *rc::gen::inRange<std::int64_t>(1, 3 * width + 2);
    }
    return std::clamp<std::int64_t>(n, 1, cap);
  });
}

rc::Gen<Shape> gen_shape(const GemmInfo& g) {
  const GemmTile t = g.tile();
  // Sizes around the kernel's register tile, around the driver's tiles (gemm_plan: kRows x
  // kCols rounded up to whole panels, halved down to kMinRows x kMinCols as the thread count
  // asks) and around the depth of a pass (support::gemm_blocking: kc 64..512, 256 on a 48
  // KiB L1d at mr 12, 64 with the caches/tiny run's 4 KiB, where the B blocks are also one
  // panel wide).
  const auto driver_size = [](std::int64_t most, std::int64_t least, std::int64_t width) {
    std::vector<rc::Gen<std::int64_t>> sizes;
    for (std::int64_t n = most; n >= least; n /= 2)
      sizes.push_back(gen_size(round_up(n, width), 1 << 12));
    return rc::gen::join(rc::gen::elementOf(sizes));
  };
  const rc::Gen<std::int64_t> rows = driver_size(GemmPlan::kRows, GemmPlan::kMinRows, t.mr);
  const rc::Gen<std::int64_t> cols = driver_size(GemmPlan::kCols, GemmPlan::kMinCols, t.nr);
  return rc::gen::exec([=] {
    Shape s;
    s.m = *rc::gen::oneOf(gen_size(t.mr, 1 << 12), rows);
    s.n = *rc::gen::oneOf(gen_size(t.nr, 1 << 12), cols);
    s.k = *rc::gen::oneOf(gen_size(t.mr, 1 << 12), gen_size(64, 1 << 12), gen_size(256, 1 << 12));
    // At most 2^22 multiply-adds per case: shrink the largest sizes.
    while (s.m * s.n * s.k > (std::int64_t{1} << 22)) {
      if (s.m >= s.n && s.m >= s.k)
        s.m = (s.m + 1) / 2;
      else if (s.n >= s.k)
        s.n = (s.n + 1) / 2;
      else
        s.k = (s.k + 1) / 2;
    }
    s.ldc_pad = *rc::gen::elementOf(std::vector<std::int64_t>{0, 0, 1, 7, 16});
    s.transposed = *rc::gen::arbitrary<bool>();
    s.bias = *rc::gen::arbitrary<bool>();
    s.magnitude = *rc::gen::elementOf(std::vector<float>{1.0f, 1.0f, 1e-3f, 1e3f});
    return s;
  });
}

struct Operands {
  Shape s;
  std::vector<float> a, b, bias;  // a [m][k], b plain [k][n] or transposed [n][k]
  float b_at(std::int64_t l, std::int64_t j) const {
    return s.transposed ? b[static_cast<std::size_t>(j * s.k + l)]
                        : b[static_cast<std::size_t>(l * s.n + j)];
  }
};

Operands make_operands(const Shape& s) {
  Operands o;
  o.s = s;
  const auto fill = [&](std::vector<float>& v, std::int64_t n) {
    v = *rc::gen::container<std::vector<float>>(
        static_cast<std::size_t>(n), rc::gen::map(rc::gen::inRange(-1000, 1001), [&](int x) {
          return s.magnitude * static_cast<float>(x) / 1000.0f;
        }));
  };
  fill(o.a, s.m * s.k);
  fill(o.b, s.k * s.n);
  if (s.bias) fill(o.bias, s.n);
  return o;
}

// C through the kernel alone, with A packed by pack_a, in a guarded buffer: asserts that only
// C's m x n elements were written.
std::vector<float> run_kernel(const GemmInfo& g, const Operands& op) {
  const Shape& s = op.s;
  const GemmTile t = g.tile();
  std::vector<float> pa(static_cast<std::size_t>(packed_floats(s.m, s.k, t.mr)));
  pack_a(s.m, s.k, op.a.data(), s.k, 1, t.mr, pa.data());
  const PackedMatrix pb(g, s.k, s.n, op.b.data(), s.transposed ? 1 : s.n, s.transposed ? s.k : 1);
  const std::int64_t ldc = s.n + s.ldc_pad;
  Guarded c((s.m - 1) * ldc + s.n, (s.m + s.n) % 16);
  const GemmProblem p{s.m, s.n, s.k, ldc};
  g.fn(p, pa.data(), pb.data(), s.bias ? op.bias.data() : nullptr, c.data());
  std::vector<bool> element(static_cast<std::size_t>(c.size()), false);
  std::vector<float> dense(static_cast<std::size_t>(s.m * s.n));
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      element[static_cast<std::size_t>(i * ldc + j)] = true;
      dense[static_cast<std::size_t>(i * s.n + j)] = c.data()[i * ldc + j];
    }
  }
  const std::string outside = c.untouched_outside(element);
  MHA_RC_ASSERT(outside.empty(), g.name << " wrote outside C: " << outside);
  return dense;
}

// C through mha::gemm (packing A, the driver) on `threads` threads.
std::vector<float> run_driver(const GemmInfo& g, const Operands& op, int threads) {
  const Shape& s = op.s;
  const PackedMatrix pb(g, s.k, s.n, op.b.data(), s.transposed ? 1 : s.n, s.transposed ? s.k : 1);
  std::vector<float> c(static_cast<std::size_t>(s.m * s.n));
  gemm(s.m, op.a.data(), s.k, pb, s.bias ? op.bias.data() : nullptr, c.data(), s.n, threads);
  return c;
}

// Every element within gamma(k + 1) (sum_l |a b| + |bias|) of the exact product.
void expect_matches_reference(const Operands& op, const std::vector<float>& c,
                              const std::string& name) {
  const Shape& s = op.s;
  const double u = std::ldexp(1.0, -24), n = static_cast<double>(s.k) + 1.0;
  const double gamma = n * u / (1.0 - n * u);
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      double exact = s.bias ? op.bias[static_cast<std::size_t>(j)] : 0.0;
      double magnitude = std::fabs(exact);
      for (std::int64_t l = 0; l < s.k; ++l) {
        const double t =
            static_cast<double>(op.a[static_cast<std::size_t>(i * s.k + l)]) * op.b_at(l, j);
        exact += t;
        magnitude += std::fabs(t);
      }
      const double got = c[static_cast<std::size_t>(i * s.n + j)];
      MHA_RC_ASSERT(std::fabs(got - exact) <= gamma * magnitude,
                    name << ": c[" << i << "][" << j << "] = " << got << ", exact " << exact
                         << ", bound " << gamma * magnitude);
    }
  }
}

TEST_P(Gemm, MatchesReference) {
  check_property([&] {
    const Operands op = make_operands(*gen_shape(gemm_kernel()));
    expect_matches_reference(op, run_kernel(gemm_kernel(), op), gemm_kernel().name);
  });
}

TEST_P(Gemm, DriverMatchesKernelForEveryThreadCount) {
  check_property([&] {
    const Operands op = make_operands(*gen_shape(gemm_kernel()));
    const std::vector<float> alone = run_kernel(gemm_kernel(), op);
    for (int threads : {1, 2, 3}) {
      const std::vector<float> c = run_driver(gemm_kernel(), op, threads);
      MHA_RC_ASSERT(std::memcmp(c.data(), alone.data(), c.size() * sizeof(float)) == 0,
                    gemm_kernel().name << " through the driver on " << threads
                                       << " threads differs from the kernel alone");
    }
  });
}

// An element depends on its row of A only: a slice of rows computed alone gives the same
// bits (what makes a layer's prefill and its decode steps project tokens identically).
TEST_P(Gemm, RowsAreComputedIndependently) {
  check_property([&] {
    const Operands op = make_operands(*gen_shape(gemm_kernel()));
    const std::vector<float> all = run_kernel(gemm_kernel(), op);
    const std::int64_t r0 = *rc::gen::inRange<std::int64_t>(0, op.s.m);
    const std::int64_t r1 = *rc::gen::inRange<std::int64_t>(r0 + 1, op.s.m + 1);
    Operands rows = op;
    rows.s.m = r1 - r0;
    rows.a.assign(op.a.begin() + r0 * op.s.k, op.a.begin() + r1 * op.s.k);
    const std::vector<float> some = run_kernel(gemm_kernel(), rows);
    MHA_RC_ASSERT(
        std::memcmp(some.data(), all.data() + r0 * op.s.n, some.size() * sizeof(float)) == 0,
        gemm_kernel().name << ": rows [" << r0 << ", " << r1 << ") alone differ");
  });
}

// Kernels with hardware FMA (every kernel but portable, which on x86-64 multiplies and adds)
// compute the same accumulation, so they agree bit for bit.
TEST_P(Gemm, FmaKernelsAgreeBitForBit) {
  if (gemm_kernel().isa == Isa::scalar) GTEST_SKIP() << "portable: fused or not as compiled";
  check_property([&] {
    const Operands op = make_operands(*gen_shape(gemm_kernel()));
    const std::vector<float> mine = run_kernel(gemm_kernel(), op);
    for (const GemmInfo& other : all_gemms()) {
      if (other.isa == Isa::scalar || !available(other) || &other == &gemm_kernel()) continue;
      const std::vector<float> theirs = run_kernel(other, op);
      MHA_RC_ASSERT(std::memcmp(mine.data(), theirs.data(), mine.size() * sizeof(float)) == 0,
                    gemm_kernel().name << " and " << other.name << " differ");
    }
  });
}

MHA_INSTANTIATE_FOR_GEMMS(Gemm);

// The driver's cut: whole panels; on one thread a tile as large as kRows x kCols and the
// largest job allow; on more, halved down to kMinRows x kMinCols until every thread has two
// tiles, and never smaller than that.
RC_GTEST_PROP(GemmPlanProperty, TilesAreWholePanelsAndEnoughForTheThreads, ()) {
  const GemmTile tile{*rc::gen::elementOf(std::vector<std::int64_t>{4, 6, 8, 12}),
                      *rc::gen::elementOf(std::vector<std::int64_t>{12, 16, 32})};
  const int threads = *rc::gen::inRange(1, 65);
  std::vector<GemmJob> jobs(static_cast<std::size_t>(*rc::gen::inRange(1, 20)));
  std::int64_t most_m = 1, most_n = 1;
  for (GemmJob& j : jobs) {
    j.p.m = *rc::gen::inRange<std::int64_t>(1, 5000);
    j.p.n = *rc::gen::inRange<std::int64_t>(1, 5000);
    most_m = std::max(most_m, j.p.m);
    most_n = std::max(most_n, j.p.n);
  }
  const GemmPlan plan = gemm_plan(tile, jobs.data(), jobs.size(), threads);
  const std::int64_t top_rows = round_up(std::min(GemmPlan::kRows, most_m), tile.mr);
  const std::int64_t top_cols = round_up(std::min(GemmPlan::kCols, most_n), tile.nr);
  RC_ASSERT(plan.rows % tile.mr == 0);
  RC_ASSERT(plan.cols % tile.nr == 0);
  RC_ASSERT(plan.rows <= top_rows);
  RC_ASSERT(plan.cols <= top_cols);
  RC_ASSERT(plan.rows >= std::min(GemmPlan::kMinRows, top_rows));
  RC_ASSERT(plan.cols >= std::min(GemmPlan::kMinCols, top_cols));
  std::int64_t tiles = 0;
  for (const GemmJob& j : jobs) tiles += ceil_div(j.p.m, plan.rows) * ceil_div(j.p.n, plan.cols);
  if (threads == 1) {
    RC_ASSERT(plan.rows == top_rows);
    RC_ASSERT(plan.cols == top_cols);
  } else if (tiles < 2 * threads) {  // only when neither side may be halved again
    RC_ASSERT(plan.rows / 2 < GemmPlan::kMinRows);
    RC_ASSERT(plan.cols / 2 < GemmPlan::kMinCols);
  }
}

// A packed weight's panels start on cache lines (when a panel is a whole number of them), so
// that no vector load of B straddles two lines.
TEST(PackedMatrixStorage, PanelsStartOnCacheLines) {
  for (const GemmInfo& g : all_gemms()) {
    if (!available(g)) continue;
    for (std::int64_t k : {1, 3, 64, 257}) {
      for (std::int64_t n : {1, 33, 100}) {
        const std::vector<float> w(static_cast<std::size_t>(k * n), 1.0f);
        const PackedMatrix b(g, k, n, w.data(), n, 1);
        const auto line = [](const float* p) { return reinterpret_cast<std::uintptr_t>(p) % 64; };
        EXPECT_EQ(line(b.data()), 0u) << g.name << " k " << k << " n " << n;
        const std::int64_t nr = b.tile().nr;
        if (k * nr * 4 % 64 == 0 && n > nr) {
          EXPECT_EQ(line(b.columns(nr)), 0u) << g.name << " k " << k << " n " << n;
        }
      }
    }
  }
}

std::string gemm_error(std::int64_t m, const float* a, std::int64_t lda, const PackedMatrix& b,
                       const float* bias, float* c, std::int64_t ldc) {
  try {
    gemm(m, a, lda, b, bias, c, ldc, 1);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(GemmCheck, RejectsBadCallsWithAMessage) {
  const GemmInfo& g = best_gemm();
  std::vector<float> w(6 * 5, 1.0f), a(4 * 6, 1.0f), c(4 * 5 + 8, 0.0f), bias(5, 0.0f);
  const PackedMatrix b(g, 6, 5, w.data(), 5, 1);  // k 6, n 5
  EXPECT_EQ(gemm_error(0, a.data(), 6, b, nullptr, c.data(), 5),
            "mha::gemm: gemm: m must be positive, got 0");
  EXPECT_EQ(gemm_error(4, a.data(), 5, b, nullptr, c.data(), 5),
            "mha::gemm: lda must be >= k (6), got 5");
  EXPECT_EQ(gemm_error(4, a.data(), 6, b, nullptr, c.data(), 4),
            "mha::gemm: gemm: ldc must be >= n (5), got 4");
  EXPECT_EQ(gemm_error(4, nullptr, 6, b, nullptr, c.data(), 5),
            "mha::gemm: a and c must not be null");
  EXPECT_EQ(gemm_error(4, a.data(), 6, b, nullptr, a.data() + 3, 5), "mha::gemm: c overlaps a");
  EXPECT_EQ(gemm_error(1, a.data(), 6, b, c.data() + 2, c.data(), 5), "mha::gemm: c overlaps bias");
  EXPECT_EQ(gemm_error(4, a.data(), 6, PackedMatrix(), nullptr, c.data(), 5),
            "mha::gemm: b is an empty PackedMatrix");
  EXPECT_EQ(gemm_error(3, a.data(), std::int64_t{1} << 62, b, nullptr, c.data(), 5),
            "mha::gemm: a's highest element offset overflows int64");
  EXPECT_EQ(gemm_error(4, a.data(), 6, b, bias.data(), c.data(), 5), "");
  EXPECT_THROW(PackedMatrix(g, 0, 5, w.data(), 5, 1), std::invalid_argument);
  EXPECT_THROW(PackedMatrix(g, 6, 5, nullptr, 5, 1), std::invalid_argument);
  EXPECT_EQ(check_gemm({2, 3, 4, 3}), "");
  EXPECT_EQ(check_gemm({2, 3, 0, 3}), "gemm: k must be positive, got 0");
  EXPECT_EQ(check_gemm({3, 3, 4, std::int64_t{1} << 62}),
            "gemm: c's highest element offset overflows int64");
}

}  // namespace
}  // namespace mha::test

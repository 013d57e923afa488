// reference/sensitive.h's inputs with the shared tolerance must reject, at the decode shapes
// mha_bench runs, the answers of an implementation that dropped keys: the check before
// timing (bench/main.cpp) relies on it. Each planted error is the exact answer over fewer
// keys (the reference without them), compared as mha_bench compares a kernel's output.
#include <gtest/gtest.h>
#include <mha/attention.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "reference.h"
#include "sensitive.h"
#include "tolerance.h"

namespace mha::test {
namespace {

struct DecodeShape {
  std::int64_t heads, kv_heads, kv_len;
};

void PrintTo(const DecodeShape& s, std::ostream* os) {
  *os << "H=" << s.heads << " Hkv=" << s.kv_heads << " Lk=" << s.kv_len;
}

class SensitiveDecode : public ::testing::TestWithParam<DecodeShape> {
 protected:
  void SetUp() override {
    const DecodeShape s = GetParam();
    p_ = make_problem(1, 1, s.kv_len, s.heads, s.kv_heads, kDim, true, Layout::head_major);
    q_.resize(static_cast<std::size_t>(s.heads * kDim));
    k_.resize(static_cast<std::size_t>(s.kv_len * s.kv_heads * kDim));
    v_.resize(k_.size());
    ref::SensitiveInputs(p_, 1).fill(q_.data(), k_.data(), v_.data());
    want_ = ref::attention(p_, q_.data(), k_.data(), v_.data());
    tol_ = ref::tolerance(p_, q_.data(), k_.data(), v_.data(), 1.0);
  }

  // The largest |o - want| / tol over every row and column, o the exact answer without
  // keys [begin, end).
  double worst_without(std::int64_t begin, std::int64_t end) const {
    Problem d = p_;
    d.kv_len = p_.kv_len - (end - begin);
    d.k = d.v = dense_strides(Layout::head_major, d.kv_len, p_.kv_heads, kDim);
    std::vector<float> k, v;
    for (std::int64_t h = 0; h < p_.kv_heads; ++h) {
      for (std::int64_t j = 0; j < p_.kv_len; ++j) {
        if (j >= begin && j < end) continue;
        const auto row = static_cast<std::size_t>((h * p_.kv_len + j) * kDim);
        k.insert(k.end(), k_.begin() + row, k_.begin() + row + kDim);
        v.insert(v.end(), v_.begin() + row, v_.begin() + row + kDim);
      }
    }
    const ref::Result got = ref::attention(d, q_.data(), k.data(), v.data());
    return worst([&](std::int64_t h, std::int64_t c) { return got.o_at(0, h, 0, c); });
  }

  template <typename F>
  double worst(F&& o) const {
    double out = 0.0;
    for (std::int64_t h = 0; h < p_.q_heads; ++h) {
      for (std::int64_t c = 0; c < kDim; ++c) {
        out =
            std::max(out, std::fabs(o(h, c) - want_.o_at(0, h, 0, c)) / tol_.o[tol_.row(0, h, 0)]);
      }
    }
    return out;
  }

  static constexpr std::int64_t kDim = 128;
  Problem p_;
  std::vector<float> q_, k_, v_;
  ref::Result want_;
  ref::Tolerance tol_;
};

TEST_P(SensitiveDecode, ChecksRejectDroppedKeys) {
  const std::int64_t n = p_.kv_len;
  EXPECT_GT(worst([](std::int64_t, std::int64_t) { return 0.0; }), 1.0) << "all zeros";
  EXPECT_GT(worst_without(n - 1, n), 1.0) << "the last key";
  EXPECT_GT(worst_without(n - 16, n), 1.0) << "the last tile of 16 keys";
  EXPECT_GT(worst_without(n / 2, n / 2 + 1), 1.0) << "the middle key";
  EXPECT_GT(worst_without(0, 1), 1.0) << "the first key";
  for (std::int64_t at : {n / 3, n * 71 / 100}) {
    const std::int64_t tile = at / 128 * 128;
    EXPECT_GT(worst_without(tile, tile + 128), 1.0) << "a tile of 128 keys at " << tile;
    EXPECT_GT(worst_without(at, at + n / 100), 1.0) << "1% of the keys from " << at;
  }
}

// mha_bench's decode shapes with 8 KV heads or fewer (D = 128): MQA at 131072 keys, MHA at
// 32768, GQA at 4096.
INSTANTIATE_TEST_SUITE_P(BenchShapes, SensitiveDecode,
                         ::testing::Values(DecodeShape{8, 1, 131072}, DecodeShape{8, 8, 32768},
                                           DecodeShape{32, 8, 4096}),
                         [](const auto& param) {
                           return "H" + std::to_string(param.param.heads) + "_Hkv" +
                                  std::to_string(param.param.kv_heads) + "_Lk" +
                                  std::to_string(param.param.kv_len);
                         });

}  // namespace
}  // namespace mha::test

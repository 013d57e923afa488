#include "sensitive.h"

#include <algorithm>
#include <cmath>

namespace mha::ref {

namespace {

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1), from 24 bits of a hash.
float unit(std::uint64_t h) {
  return static_cast<float>(static_cast<double>(h >> 40) / static_cast<double>(1 << 23) - 1.0);
}

constexpr std::uint64_t kK = 1, kV = 2, kPick = 3;
constexpr double kNoise = 1.0 / 64.0;

}  // namespace

SensitiveInputs::SensitiveInputs(const Problem& p, std::uint64_t seed)
    : p_(p), seed_(seed), classes_(std::clamp<std::int64_t>(p.head_dim, 1, 128)) {
  const std::int64_t group = p.q_heads / p.kv_heads;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const std::int64_t j = dominant(b, h, i);
        if (j >= 0) boost_[{b, h / group, j}].push_back(row_class(b, h, i));
      }
    }
  }
  for (auto& [key, columns] : boost_) {
    std::sort(columns.begin(), columns.end());
    columns.erase(std::unique(columns.begin(), columns.end()), columns.end());
  }
}

std::int64_t SensitiveInputs::row_class(std::int64_t b, std::int64_t h, std::int64_t i) const {
  const std::int64_t rows = p_.batch * p_.q_heads * p_.q_len;
  const std::int64_t r = (b * p_.q_heads + h) * p_.q_len + i;
  return rows <= classes_ ? r * classes_ / rows : r % classes_;
}

std::int64_t SensitiveInputs::dominant(std::int64_t b, std::int64_t h, std::int64_t i) const {
  // Its keys [first, first + n): a sliding window's most recent, or all it sees.
  const std::int64_t first = first_key(p_, i);
  const std::int64_t n = visible_keys(p_, i) - first;
  if (n == 0) return -1;
  const std::int64_t r = (b * p_.q_heads + h) * p_.q_len + i;
  switch (r % 8) {
    case 0:
      return first + n - 1;
    case 1:
      return first + n / 2;
    case 2:
      return first;
    case 3:
      return first + (n - 1) / 2;
    default:
      return first + static_cast<std::int64_t>(
                         mix(seed_ ^ mix(kPick ^ mix(static_cast<std::uint64_t>(r)))) %
                         static_cast<std::uint64_t>(n));
  }
}

void SensitiveInputs::noise(std::uint64_t tensor, std::int64_t b, std::int64_t j, std::int64_t h,
                            float* out) const {
  std::uint64_t x = mix(seed_ ^ tensor);
  for (std::int64_t part : {b, j, h}) x = mix(x ^ static_cast<std::uint64_t>(part));
  for (std::int64_t d = 0; d < p_.head_dim; ++d)
    out[d] = unit(mix(x + static_cast<std::uint64_t>(d)));
}

void SensitiveInputs::q_row(std::int64_t b, std::int64_t i, std::int64_t h, float* out) const {
  const double scale = p_.scale != 0.0f ? static_cast<double>(p_.scale) : 1.0;
  std::fill(out, out + p_.head_dim, 0.0f);
  out[row_class(b, h, i)] = static_cast<float>(kGap / scale);
}

void SensitiveInputs::k_row(std::int64_t b, std::int64_t j, std::int64_t kv_head,
                            float* out) const {
  noise(kK, b, j, kv_head, out);
  for (std::int64_t d = 0; d < p_.head_dim; ++d) out[d] *= static_cast<float>(kNoise);
  const auto boost = boost_.find({b, kv_head, j});
  bool class_boosted = false;
  if (boost != boost_.end()) {
    for (std::int64_t d : boost->second) {  // distinct columns
      out[d] += static_cast<float>(1.0 + kDominance / kGap);
      class_boosted |= d == j % classes_;
    }
  }
  if (!class_boosted) out[j % classes_] += 1.0f;
}

void SensitiveInputs::v_row(std::int64_t b, std::int64_t j, std::int64_t kv_head,
                            float* out) const {
  noise(kV, b, j, kv_head, out);
  for (std::int64_t d = 0; d < p_.head_dim; ++d) out[d] = 1.0f + 0.5f * out[d];
}

void SensitiveInputs::fill(float* q, float* k, float* v) const {
  const Problem& p = p_;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t i = 0; i < p.q_len; ++i) {
      for (std::int64_t h = 0; h < p.q_heads; ++h) {
        q_row(b, i, h, q + b * p.q.batch + i * p.q.seq + h * p.q.head);
      }
    }
    for (std::int64_t j = 0; j < p.kv_len; ++j) {
      for (std::int64_t h = 0; h < p.kv_heads; ++h) {
        k_row(b, j, h, k + b * p.k.batch + j * p.k.seq + h * p.k.head);
        v_row(b, j, h, v + b * p.v.batch + j * p.v.seq + h * p.v.head);
      }
    }
  }
}

}  // namespace mha::ref

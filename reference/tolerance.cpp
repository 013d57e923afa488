#include "tolerance.h"

#include <algorithm>
#include <cmath>

namespace mha::ref {

namespace {
constexpr double kU = 1.0 / 16777216.0;  // 2^-24, unit roundoff of fp32
}

double gamma(double n) { return n * kU / (1.0 - n * kU); }

double weight_shift(double eta) { return eta < 0.5 ? 2.0 * eta / (1.0 - eta) : 2.0; }

double accumulation_factor(double n) {
  const double g = gamma(2.0 * n + 2.0);
  const double quotient = 2.0 * g / (1.0 - g);
  return quotient + kU * (1.0 + quotient) + n * std::ldexp(1.0, -125);
}

double o_bound(double a, double v_max, std::int64_t n, std::int64_t head_dim, double exp_ulp) {
  const double delta = gamma(static_cast<double>(head_dim) + 5.0) * a;
  const double eta = std::exp(delta) * (1.0 + exp_ulp * 2.0 * kU) - 1.0;
  return (weight_shift(eta) + accumulation_factor(static_cast<double>(n))) * v_max;
}

Tolerance tolerance(const Problem& p, const float* q, const float* k, const float* v,
                    double exp_ulp, std::int64_t row_begin, std::int64_t row_end) {
  if (row_end < 0) row_end = p.q_len;
  Tolerance t;
  t.q_heads = p.q_heads;
  t.q_len = p.q_len;
  const auto rows = static_cast<std::size_t>(p.batch * p.q_heads * p.q_len);
  t.o.assign(rows, 0.0);
  t.lse.assign(rows, 0.0);
  t.accumulation.assign(rows, 0.0);
  t.v_max.assign(rows, 0.0);
  const std::int64_t group = p.q_heads / p.kv_heads;
  const double scale = std::fabs(static_cast<double>(p.scale));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const std::int64_t kv_head = h / group;
      for (std::int64_t i = row_begin; i < row_end; ++i) {
        const std::int64_t n = visible_keys(p, i);
        if (n == 0) continue;  // exact zeros and -inf are required
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        double a = 0.0, vmax = 0.0;
        for (std::int64_t j = 0; j < n; ++j) {
          const float* k_row = k + b * p.k.batch + j * p.k.seq + kv_head * p.k.head;
          const float* v_row = v + b * p.v.batch + j * p.v.seq + kv_head * p.v.head;
          double abs_dot = 0.0;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            abs_dot += std::fabs(static_cast<double>(q_row[d]) * static_cast<double>(k_row[d]));
            vmax = std::max(vmax, std::fabs(static_cast<double>(v_row[d])));
          }
          a = std::max(a, scale * abs_dot);
        }
        const double u = kU;
        const double delta = gamma(static_cast<double>(p.head_dim) + 5.0) * a;
        const double eta = std::exp(delta) * (1.0 + exp_ulp * 2.0 * u) - 1.0;
        const double g = gamma(2.0 * static_cast<double>(n) + 2.0);
        const double accumulation = accumulation_factor(static_cast<double>(n));
        const std::size_t r = t.row(b, h, i);
        t.v_max[r] = vmax;
        t.accumulation[r] = accumulation * vmax;
        t.o[r] = o_bound(a, vmax, n, p.head_dim, exp_ulp);
        t.lse[r] = std::log1p(eta) - std::log1p(-g) +
                   (4.0 + exp_ulp) * 2.0 * u * (a + std::log(static_cast<double>(n)) + 1.0);
      }
    }
  }
  return t;
}

Tolerance merged_tolerance(Tolerance tol, double parts) {
  for (std::size_t r = 0; r < tol.o.size(); ++r) {
    const double eta = std::exp(2.0 * tol.lse[r]) * (1.0 + 2.0 * kU) - 1.0;
    tol.o[r] += (weight_shift(eta) + accumulation_factor(parts)) * tol.v_max[r];
    tol.lse[r] += std::log1p(eta) + accumulation_factor(parts);
  }
  return tol;
}

}  // namespace mha::ref

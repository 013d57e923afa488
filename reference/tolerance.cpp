#include "tolerance.h"

#include "reference.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <vector>

namespace mha::ref {

namespace {
constexpr double kU = 1.0 / 16777216.0;  // 2^-24, unit roundoff of fp32
// The depths below a row's top logit tried as the split of step 3, and the margin (in logit
// units) by which a key below the split still counts as big.
constexpr double kDepths[] = {8.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 64.0, 88.0};
constexpr double kMargin = 1e-3;
}  // namespace

const double kSoftcapError = 4.0;

double gamma(double n) { return n * kU / (1.0 - n * kU); }

double weight_shift(double eta) { return eta < 0.5 ? 2.0 * eta / (1.0 - eta) : 2.0; }

double accumulation_factor(double n, double big, double small_mass) {
  const double g = gamma(2.0 * big + 2.0);
  const double e = g + (1.0 + 2.0 * gamma(2.0 * n + 2.0)) * small_mass;
  if (e >= 0.5) return 2.0;  // more than the output's range: no information
  const double quotient = 2.0 * e / (1.0 - e);
  return quotient + kU * (1.0 + quotient) + n * std::ldexp(1.0, -125);
}

double accumulation_factor(double n) { return accumulation_factor(n, n, 0.0); }

double o_bound(double a, double v_max, std::int64_t n, std::int64_t head_dim, double exp_ulp,
               KvType kv_type) {
  const double kv_roundings = kv_type == KvType::i8 ? 1.0 : 0.0;  // step 6
  const double delta = gamma(static_cast<double>(head_dim) + 5.0 + kv_roundings) * a;
  const double eta = std::exp(delta) * (1.0 + exp_ulp * 2.0 * kU) - 1.0;
  return (weight_shift(eta) + accumulation_factor(static_cast<double>(n)) + kv_roundings * kU) *
         v_max;
}

Tolerance tolerance(const Problem& p, const float* q, KvView k, KvView v, double exp_ulp,
                    std::int64_t row_begin, std::int64_t row_end) {
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
  // Step 6: an i8 value's rounding in fp32, once per K product and once per V element.
  const double kv_roundings = p.kv_type == KvType::i8 ? 1.0 : 0.0;
  // Step 8: a soft-capped logit's tanh, within kSoftcapError u c of the cap of its computed s.
  const double cap = static_cast<double>(p.softcap);
  const double cap_error = cap > 0.0 && std::isfinite(cap) ? kSoftcapError * kU * cap : 0.0;
  std::vector<double> logit;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      const std::int64_t kv_head = h / group;
      for (std::int64_t i = row_begin; i < std::min(row_end, rows_of(p, b)); ++i) {
        const KeyRange range = key_range(p, b, i);
        const std::int64_t keys = range.end - range.first;
        if (keys == 0) continue;  // exact zeros and -inf (or the sink) are required
        // Step 7: a sink is one more key, of logit sinks[h] and value 0.
        const double sink = sink_logit(p, h);
        const bool has_sink = std::isfinite(sink);
        const std::int64_t n = keys + (has_sink ? 1 : 0);
        const float* q_row = q + b * p.q.batch + i * p.q.seq + h * p.q.head;
        // Exact logits, A, V and the most nonzero products of a dot product.
        double a = 0.0, vmax = 0.0, top = -std::numeric_limits<double>::infinity();
        double biggest_bias = 0.0;  // step 9's B
        std::int64_t nonzero = 0;
        logit.resize(static_cast<std::size_t>(keys));
        for (std::int64_t j = 0; j < keys; ++j) {
          const KvRow key = k_row(p, k, b, range.first + j, kv_head);
          const KvRow value = v_row(p, v, b, range.first + j, kv_head);
          double dot = 0.0, abs_dot = 0.0;
          std::int64_t products = 0;
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            const double x = static_cast<double>(q_row[d]) * key.at(d);
            dot += x;
            abs_dot += std::fabs(x);
            products += x != 0.0 ? 1 : 0;
            vmax = std::max(vmax, std::fabs(value.at(d)));
          }
          a = std::max(a, scale * abs_dot);
          nonzero = std::max(nonzero, products);
          const double bias = alibi_bias(p, b, h, i, range.first + j);
          biggest_bias = std::max(biggest_bias, std::fabs(bias));
          logit[static_cast<std::size_t>(j)] =
              capped_logit(p, static_cast<double>(p.scale) * dot) + bias;
          top = std::max(top, logit[static_cast<std::size_t>(j)]);
        }
        if (has_sink) {
          a = std::max(a, std::fabs(sink));
          top = std::max(top, sink);
          logit.push_back(sink);
        }
        const double u = kU;
        const double delta = gamma(static_cast<double>(nonzero) + 5.0 + kv_roundings) * a +
                             cap_error + gamma(7.0) * biggest_bias;
        const double eta = std::exp(delta) * (1.0 + exp_ulp * 2.0 * u) - 1.0;
        // Step 3 over the keys within `depth` of the top logit, the rest as small mass: the
        // split that gives the smallest bound (depth infinite: every key counted, no mass).
        double big = static_cast<double>(n), small_mass = 0.0;
        double accumulation = accumulation_factor(big);
        if (std::isfinite(top)) {
          constexpr std::size_t kSplits = std::size(kDepths);
          double sum = 0.0, mass[kSplits] = {};
          std::int64_t count[kSplits] = {};
          for (double x : logit) {
            const double w = std::exp(x - top);
            sum += w;
            for (std::size_t s = 0; s < kSplits; ++s) {
              // Keys just below the depth, whose computed logits may still raise the
              // running max, count as big too.
              if (x - top >= -kDepths[s] - 4.0 * delta - kMargin) ++count[s];
              if (x - top < -kDepths[s]) mass[s] += w;
            }
          }
          for (std::size_t s = 0; s < kSplits; ++s) {
            const double m = mass[s] / sum * (1.0 + eta) / (1.0 - std::min(eta, 0.5));
            const double f =
                accumulation_factor(static_cast<double>(n), static_cast<double>(count[s]), m);
            if (f < accumulation) {
              accumulation = f;
              big = static_cast<double>(count[s]);
              small_mass = m;
            }
          }
        }
        const double g = gamma(2.0 * big + 2.0) + (1.0 + 2.0 * gamma(2.0 * n + 2.0)) * small_mass;
        const std::size_t r = t.row(b, h, i);
        t.v_max[r] = vmax;
        t.accumulation[r] = accumulation * vmax;
        t.o[r] = (weight_shift(eta) + accumulation + kv_roundings * u) * vmax;
        t.lse[r] = std::log1p(eta) - std::log1p(-std::min(g, 0.5)) +
                   (4.0 + exp_ulp + (has_sink ? 1.0 : 0.0)) * 2.0 * u *
                       (a + biggest_bias + std::log(static_cast<double>(n)) + 1.0);
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

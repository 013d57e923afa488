#include "layer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "reference.h"
#include "tolerance.h"

namespace mha::ref {

namespace {

// Element (l, j) of a weight with `in` rows and `out` columns, as LayerWeights stores it.
double weight(const float* w, bool transposed, std::int64_t in, std::int64_t out, std::int64_t l,
              std::int64_t j) {
  return transposed ? w[j * in + l] : w[l * out + j];
}

// P = X W + b over `len` rows, and M = |X| |W| + |b|, both [len][out]. The inner loop runs
// along the weight's rows as stored (over l transposed, over j otherwise), so that a
// 2048 x 4096 x 2048 projection takes seconds, not minutes.
void project(const float* x, std::int64_t len, std::int64_t in, const float* w, const float* b,
             bool transposed, std::int64_t out, std::vector<double>& p, std::vector<double>& m) {
  p.assign(static_cast<std::size_t>(len * out), 0.0);
  m.assign(p.size(), 0.0);
  for (std::int64_t i = 0; i < len; ++i) {
    double* pi = p.data() + i * out;
    double* mi = m.data() + i * out;
    for (std::int64_t j = 0; j < out; ++j) {
      pi[j] = b != nullptr ? b[j] : 0.0;
      mi[j] = b != nullptr ? std::fabs(b[j]) : 0.0;
    }
    if (transposed) {
      for (std::int64_t j = 0; j < out; ++j) {
        for (std::int64_t l = 0; l < in; ++l) {
          const double t = static_cast<double>(x[i * in + l]) * weight(w, true, in, out, l, j);
          pi[j] += t;
          mi[j] += std::fabs(t);
        }
      }
    } else {
      for (std::int64_t l = 0; l < in; ++l) {
        const double xl = x[i * in + l];
        const float* wl = w + l * out;
        for (std::int64_t j = 0; j < out; ++j) {
          const double t = xl * static_cast<double>(wl[j]);
          pi[j] += t;
          mi[j] += std::fabs(t);
        }
      }
    }
  }
}

// K or V of one key, element by element: a row given by a cache (exact, magnitude 0) or
// the key's projection and its magnitudes |X| |W| + |b|.
struct KeyRow {
  KvRow stored;
  const double* projected = nullptr;
  const double* magnitude = nullptr;
  double at(std::int64_t e) const { return projected != nullptr ? projected[e] : stored.at(e); }
  double m(std::int64_t e) const { return projected != nullptr ? magnitude[e] : 0.0; }
};

// The layer over keys at positions [0, past + len): those below given.length read from
// `given`, the others projected from x (position past + i is x's row i).
LayerResult layer_over(const LayerConfig& c, const LayerWeights& w, const float* x,
                       std::int64_t batch, std::int64_t len, std::int64_t first, bool causal,
                       double exp_ulp, const StoredKv& given, std::int64_t past) {
  const std::int64_t d = c.d_model, H = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const std::int64_t hd = H * D, kvd = Hkv * D, g = H / Hkv;
  // The fp32 scale the layer's attention uses (make_problem's).
  const double scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const double gamma_in = gamma(static_cast<double>(d) + 1.0);
  const double gamma_out = gamma(static_cast<double>(hd) + 1.0);
  LayerResult r;
  r.rows = len - first;
  r.d_model = d;
  r.y.assign(static_cast<std::size_t>(batch * r.rows * d), 0.0);
  r.tol.assign(r.y.size(), 0.0);
  std::vector<double> q, qm, k, km, v, vm;
  std::vector<double> o(static_cast<std::size_t>(hd)), eo(static_cast<std::size_t>(H));
  const std::int64_t keys = past + len;
  const bool project_kv = given.length < keys;
  std::vector<double> s(static_cast<std::size_t>(keys));
  for (std::int64_t b = 0; b < batch; ++b) {
    const float* xb = x + b * len * d;
    project(xb + first * d, len - first, d, w.wq, w.bq, w.transposed, hd, q, qm);  // rows only
    if (project_kv) {
      project(xb, len, d, w.wk, w.bk, w.transposed, kvd, k, km);
      project(xb, len, d, w.wv, w.bv, w.transposed, kvd, v, vm);
    }
    for (std::int64_t i = first; i < len; ++i) {
      // Visible keys: positions [0, n).
      const std::int64_t n = causal ? past + i + 1 : keys;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t j = h / g;
        const auto qi = [&](std::int64_t e) {
          return static_cast<std::size_t>((i - first) * hd + h * D + e);
        };
        // Key t's K (or V) row.
        const auto key_row = [&](std::int64_t t, bool value) {
          KeyRow key;
          if (t < given.length) {
            const Strides& st = given.strides;
            const Strides& sst = given.scale_strides;
            const KvView at = advance(value ? given.v : given.k, given.type,
                                      b * st.batch + t * st.seq + j * st.head,
                                      b * sst.batch + t * sst.seq + j * sst.head);
            key.stored = {given.type, at.data,
                          given.type == KvType::i8 ? static_cast<double>(*at.scale) : 1.0};
          } else {
            const auto at = static_cast<std::size_t>((t - past) * kvd + j * D);
            key.projected = (value ? v : k).data() + at;
            key.magnitude = (value ? vm : km).data() + at;
          }
          return key;
        };
        // Exact attention, two-pass softmax.
        double max = -INFINITY;
        double sigma = 0.0, a_moved = 0.0, v_max = 0.0, ev_max = 0.0, v_moved = 0.0;
        for (std::int64_t t = 0; t < n; ++t) {
          double dot = 0.0, moved = 0.0, bound = 0.0;
          const KeyRow kt = key_row(t, false), vt = key_row(t, true);
          for (std::int64_t e = 0; e < D; ++e) {
            const double kte = kt.at(e), vte = vt.at(e);
            const double mk = kt.m(e), mv = vt.m(e);
            const double eq = gamma_in * qm[qi(e)], ek = gamma_in * mk;
            const double aq = std::fabs(q[qi(e)]), ak = std::fabs(kte);
            dot += q[qi(e)] * kte;
            moved += eq * ak + aq * ek + eq * ek;
            bound += (aq + eq) * (ak + ek);
            const double ev = gamma_in * mv, av = std::fabs(vte);
            v_max = std::max(v_max, av);
            ev_max = std::max(ev_max, ev);
            v_moved = std::max(v_moved, av + ev);
          }
          s[static_cast<std::size_t>(t)] = scale * dot;
          max = std::max(max, s[static_cast<std::size_t>(t)]);
          sigma = std::max(sigma, scale * moved);
          a_moved = std::max(a_moved, scale * bound);
        }
        double sum = 0.0;
        for (std::int64_t t = 0; t < n; ++t) sum += std::exp(s[static_cast<std::size_t>(t)] - max);
        for (std::int64_t e = 0; e < D; ++e) o[static_cast<std::size_t>(h * D + e)] = 0.0;
        for (std::int64_t t = 0; t < n; ++t) {
          const double p = std::exp(s[static_cast<std::size_t>(t)] - max) / sum;
          const KeyRow vt = key_row(t, true);
          for (std::int64_t e = 0; e < D; ++e)
            o[static_cast<std::size_t>(h * D + e)] += p * vt.at(e);
        }
        eo[static_cast<std::size_t>(h)] = o_bound(a_moved, v_moved, n, D, exp_ulp, given.type) +
                                          std::min(2.0, std::expm1(2.0 * sigma)) * v_max + ev_max;
      }
      // Y = O W^O + b^O and its bound.
      for (std::int64_t col = 0; col < d; ++col) {
        double y = w.bo != nullptr ? w.bo[col] : 0.0;
        double magnitude = w.bo != nullptr ? std::fabs(w.bo[col]) : 0.0, carried = 0.0;
        for (std::int64_t row = 0; row < hd; ++row) {
          const double wo = weight(w.wo, w.transposed, hd, d, row, col);
          const double e = eo[static_cast<std::size_t>(row / D)];
          y += o[static_cast<std::size_t>(row)] * wo;
          magnitude += (std::fabs(o[static_cast<std::size_t>(row)]) + e) * std::fabs(wo);
          carried += e * std::fabs(wo);
        }
        r.y[r.at(b, i - first, col)] = y;
        r.tol[r.at(b, i - first, col)] = gamma_out * magnitude + carried;
      }
    }
  }
  return r;
}

}  // namespace

LayerResult layer(const LayerConfig& c, const LayerWeights& w, const float* x, std::int64_t batch,
                  std::int64_t len, std::int64_t first, bool causal, double exp_ulp) {
  return layer(c, w, x, batch, len, first, causal, exp_ulp, PastKv{});
}

LayerResult layer(const LayerConfig& c, const LayerWeights& w, const float* x, std::int64_t batch,
                  std::int64_t len, std::int64_t first, bool causal, double exp_ulp,
                  const PastKv& past) {
  const StoredKv given{KvType::f32, past.k, past.v, past.strides, Strides(), past.length};
  return layer_over(c, w, x, batch, len, first, causal, exp_ulp, given, past.length);
}

LayerResult layer(const LayerConfig& c, const LayerWeights& w, const float* x, std::int64_t batch,
                  std::int64_t len, std::int64_t first, bool causal, double exp_ulp,
                  const StoredKv& stored) {
  if (len > stored.length) {
    throw std::invalid_argument("ref::layer: " + std::to_string(len) + " tokens, but the cache " +
                                "holds " + std::to_string(stored.length));
  }
  return layer_over(c, w, x, batch, len, first, causal, exp_ulp, stored, stored.length - len);
}

}  // namespace mha::ref

// The whole layer (mha/layer.h) against the double-precision layer of reference/layer.h and
// its derived bound, and the layer's own identities: prefill equals decode steps, one head
// with W^O = I is attention, GQA is MHA with repeated KV weights, the thread count changes
// no bit; and the KV cache's limits. Parameterized over the GEMM kernels; the attention
// step runs on best_kernel(). Then a cache of each KvType (LayerKvTest): append's conversion
// exact, the cache holding the fp32 projections converted, prefill and decode against the
// reference over the stored values, prefill against decode steps, threads; its size, the
// kernel picked per type and the errors.
#include <gtest/gtest.h>
#include <mha/kv_types.h>
#include <mha/layer.h>
#include <mha/registry.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gemm_kernel_test.h"
#include "layer.h"
#include "run.h"

namespace mha {
inline void PrintTo(KvType t, std::ostream* os) { *os << kv_type_name(t); }
}  // namespace mha

namespace mha::test {
namespace {

class LayerTest : public GemmKernelTest {};

// A layer and its inputs: shape, weights (as LayerWeights reads them), tokens.
struct Model {
  LayerConfig c;
  std::int64_t batch = 1, len = 1;
  bool causal = true, bias = false, transposed = false;
  std::vector<float> wq, wk, wv, wo, bq, bk, bv, bo, x;  // x [batch][len][d]

  LayerWeights weights() const {
    const auto b = [&](const std::vector<float>& v) { return bias ? v.data() : nullptr; };
    return {wq.data(), wk.data(), wv.data(), wo.data(), b(bq), b(bk), b(bv), b(bo), transposed};
  }
};

void showValue(const Model& m, std::ostream& os) {
  os << "d " << m.c.d_model << " H " << m.c.q_heads << " Hkv " << m.c.kv_heads << " D "
     << m.c.head_dim << " batch " << m.batch << " len " << m.len << (m.causal ? " causal" : "")
     << (m.bias ? " bias" : "") << (m.transposed ? " transposed" : "");
}

std::vector<float> values(std::int64_t n, float scale) {
  return *rc::gen::container<std::vector<float>>(
      static_cast<std::size_t>(n), rc::gen::map(rc::gen::inRange(-1000, 1001), [=](int v) {
        return scale * static_cast<float>(v) / 1000.0f;
      }));
}

// Weights scaled by 1/sqrt(fan-in) as initializers do, so logits stay moderate; one case
// in 8 scales Q and K up by 8 for sharp softmaxes.
void fill(Model& m) {
  const LayerConfig& c = m.c;
  const std::int64_t d = c.d_model, hd = c.q_heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const float in = 1.0f / std::sqrt(static_cast<float>(d));
  const float sharp = *rc::gen::inRange(0, 8) == 0 ? 8.0f : 1.0f;
  m.wq = values(d * hd, sharp * in);
  m.wk = values(d * kvd, sharp * in);
  m.wv = values(d * kvd, in);
  m.wo = values(hd * d, 1.0f / std::sqrt(static_cast<float>(hd)));
  m.bq = values(hd, 0.5f);
  m.bk = values(kvd, 0.5f);
  m.bv = values(kvd, 0.5f);
  m.bo = values(d, 0.5f);
  m.x = values(m.batch * m.len * d, 1.0f);
}

rc::Gen<Model> gen_model(std::int64_t max_len = 40) {
  return rc::gen::exec([=] {
    Model m;
    m.c.kv_heads = *rc::gen::inRange<std::int64_t>(1, 5);
    m.c.q_heads = m.c.kv_heads * *rc::gen::elementOf(std::vector<std::int64_t>{1, 1, 2, 3, 4});
    m.c.head_dim = *rc::gen::elementOf(std::vector<std::int64_t>{1, 3, 8, 15, 16, 17, 32, 33});
    // d: usually H D, sometimes not (the layer does not require it).
    m.c.d_model = *rc::gen::inRange(0, 4) == 0 ? *rc::gen::inRange<std::int64_t>(1, 70)
                                               : m.c.q_heads * m.c.head_dim;
    m.batch = *rc::gen::inRange<std::int64_t>(1, 4);
    m.len = *rc::gen::inRange<std::int64_t>(1, max_len + 1);
    m.causal = *rc::gen::arbitrary<bool>();
    m.bias = *rc::gen::arbitrary<bool>();
    m.transposed = *rc::gen::arbitrary<bool>();
    fill(m);
    return m;
  });
}

// Y [batch][r.rows][d] for query positions [first, first + r.rows) is within the reference
// bound r, element by element; `kv` is the cache's type.
void expect_within(const ref::LayerResult& r, const Layer& layer, const std::vector<float>& y,
                   std::int64_t batch, std::int64_t first, KvType kv, const std::string& what) {
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i < r.rows; ++i) {
      for (std::int64_t col = 0; col < r.d_model; ++col) {
        const double got = y[r.at(b, i, col)], want = r.y[r.at(b, i, col)];
        const double tol = r.tol[r.at(b, i, col)];
        MHA_RC_ASSERT(std::fabs(got - want) <= tol,
                      what << ": y[" << b << "][" << first + i << "][" << col << "] = " << got
                           << ", reference " << want << ", bound " << tol << " (gemm "
                           << layer.gemm_kernel().name << ", attention "
                           << layer.attention_kernel(kv).name << ", kv:" << kv_type_name(kv)
                           << ")");
      }
    }
  }
}

// Y for query positions [first, len) is within the reference bound, element by element.
void expect_close(const Model& m, const Layer& layer, const std::vector<float>& y,
                  std::int64_t first, const std::string& what) {
  const ref::LayerResult r = ref::layer(m.c, m.weights(), m.x.data(), m.batch, m.len, first,
                                        m.causal, layer.attention_kernel().exp_ulp);
  expect_within(r, layer, y, m.batch, first, KvType::f32, what);
}

// Positions [p0, p1) of every sequence of x, [batch][p1 - p0][d].
std::vector<float> tokens(const Model& m, std::int64_t p0, std::int64_t p1) {
  const std::int64_t d = m.c.d_model;
  std::vector<float> t;
  for (std::int64_t b = 0; b < m.batch; ++b) {
    const float* row = m.x.data() + (b * m.len + p0) * d;
    t.insert(t.end(), row, row + (p1 - p0) * d);
  }
  return t;
}

// The same model over positions [0, len) of its sequences only.
Model prefix(const Model& m, std::int64_t len) {
  Model p = m;
  p.len = len;
  p.x = tokens(m, 0, len);
  return p;
}

// Y of prefilling the whole sequences from an empty cache.
std::vector<float> prefill_all(const Model& m, const Layer& layer, KvCache& cache,
                               int threads = 2) {
  std::vector<float> y(m.x.size());
  layer.prefill(m.x.data(), m.len, y.data(), cache, m.causal, threads);
  return y;
}

// Decode step t's Y [batch][d] and prefill's row t of y [batch][len][d]: each within the bound
// r of the step's reference (the prefill's checked elsewhere), so within twice it of each other.
void expect_step_near_row(const Model& m, const std::vector<float>& step,
                          const std::vector<float>& y, const ref::LayerResult& r, std::int64_t t) {
  const std::int64_t d = m.c.d_model;
  for (std::int64_t b = 0; b < m.batch; ++b) {
    for (std::int64_t col = 0; col < d; ++col) {
      const double one = step[static_cast<std::size_t>(b * d + col)];
      const double whole = y[static_cast<std::size_t>((b * m.len + t) * d + col)];
      MHA_RC_ASSERT(std::fabs(one - whole) <= 2 * r.tol[r.at(b, 0, col)],
                    "decode step " << t << " vs prefill row " << t << ", sequence " << b
                                   << ", column " << col << ": " << one << " vs " << whole);
    }
  }
}

TEST_P(LayerTest, PrefillMatchesReference) {
  check_property([&] {
    const Model m = *gen_model();
    const Layer layer(m.c, m.weights(), gemm_kernel().name);
    KvCache cache(m.c, m.batch, m.len + *rc::gen::inRange(0, 3));
    expect_close(m, layer, prefill_all(m, layer, cache), 0, "prefill");
    RC_ASSERT(cache.length() == m.len);
  });
}

// A cache filled in chunks (a prompt, then more) holds the same bits as one prefill, and
// each chunk's output matches the reference for its positions.
TEST_P(LayerTest, ChunkedPrefillMatchesOnePrefill) {
  check_property([&] {
    Model m = *gen_model();
    m.len = std::max<std::int64_t>(m.len, 2);
    fill(m);
    const Layer layer(m.c, m.weights(), gemm_kernel().name);
    KvCache whole(m.c, m.batch, m.len), chunked(m.c, m.batch, m.len);
    prefill_all(m, layer, whole);
    const std::int64_t cut = *rc::gen::inRange<std::int64_t>(1, m.len);
    for (const auto& [p0, p1] : {std::pair{std::int64_t{0}, cut}, std::pair{cut, m.len}}) {
      const std::vector<float> x = tokens(m, p0, p1);
      std::vector<float> y(x.size());
      layer.prefill(x.data(), p1 - p0, y.data(), chunked, m.causal, 2);
      const Model part = prefix(m, p1);
      expect_close(part, layer, y, p0,
                   "chunk [" + std::to_string(p0) + ", " + std::to_string(p1) + ")");
    }
    const std::size_t floats = whole.bytes() / 2 / sizeof(float);
    RC_ASSERT(std::memcmp(whole.k(), chunked.k(), floats * sizeof(float)) == 0);
    RC_ASSERT(std::memcmp(whole.v(), chunked.v(), floats * sizeof(float)) == 0);
  });
}

// Prefill of n tokens and n decode steps from an empty cache: the same cache, bit for bit
// (every token is projected by the same GEMM accumulation), and outputs row by row within
// the reference bound each, hence within the sum of the two bounds of each other.
TEST_P(LayerTest, PrefillEqualsDecodeSteps) {
  check_property([&] {
    Model m = *gen_model(24);
    m.causal = true;  // a decode step sees the whole cache: causal prefill's rows
    const Layer layer(m.c, m.weights(), gemm_kernel().name);
    KvCache prefilled(m.c, m.batch, m.len), decoded(m.c, m.batch, m.len);
    const std::vector<float> y = prefill_all(m, layer, prefilled);
    for (std::int64_t t = 0; t < m.len; ++t) {
      const std::vector<float> x = tokens(m, t, t + 1);
      std::vector<float> yt(x.size());
      layer.decode(x.data(), yt.data(), decoded, 2);
      const Model upto = prefix(m, t + 1);
      const ref::LayerResult r = ref::layer(upto.c, upto.weights(), upto.x.data(), m.batch, t + 1,
                                            t, true, layer.attention_kernel().exp_ulp);
      expect_within(r, layer, yt, m.batch, t, KvType::f32, "decode step " + std::to_string(t));
      expect_step_near_row(m, yt, y, r, t);
    }
    const std::size_t bytes = prefilled.bytes() / 2;
    RC_ASSERT(std::memcmp(prefilled.k(), decoded.k(), bytes) == 0);
    RC_ASSERT(std::memcmp(prefilled.v(), decoded.v(), bytes) == 0);
  });
}

// H = 1, d = D, W^O = I and no output bias: the layer is attention over its own
// projections, which mha::gemm computes with the same kernel, bit for bit (W^O = I adds
// exact zeros; values compared with ==, so a -0 against a +0 is equal).
TEST_P(LayerTest, OneHeadWithIdentityOutputIsAttention) {
  check_property([&] {
    Model m = *gen_model();
    m.c.q_heads = m.c.kv_heads = 1;
    m.c.d_model = m.c.head_dim;
    fill(m);
    const std::int64_t D = m.c.head_dim;
    std::fill(m.wo.begin(), m.wo.end(), 0.0f);
    for (std::int64_t i = 0; i < D; ++i) m.wo[static_cast<std::size_t>(i * D + i)] = 1.0f;
    std::fill(m.bo.begin(), m.bo.end(), 0.0f);
    const Layer layer(m.c, m.weights(), gemm_kernel().name);
    const std::vector<float> y = [&] {
      KvCache cache(m.c, m.batch, m.len);
      return prefill_all(m, layer, cache);
    }();
    // Q, K, V = X W + b by the same GEMM kernel, then attention by the same kernel.
    const std::int64_t rows = m.batch * m.len;
    const auto project = [&](const std::vector<float>& w, const std::vector<float>& b) {
      const PackedMatrix pw(gemm_kernel(), D, D, w.data(), m.transposed ? 1 : D,
                            m.transposed ? D : 1);
      std::vector<float> out(static_cast<std::size_t>(rows * D));
      mha::gemm(rows, m.x.data(), D, pw, m.bias ? b.data() : nullptr, out.data(), D, 1);
      return out;
    };
    const std::vector<float> q = project(m.wq, m.bq), k = project(m.wk, m.bk),
                             v = project(m.wv, m.bv);
    std::vector<float> o(q.size());
    const Problem p = make_problem(m.batch, m.len, m.len, 1, 1, D, m.causal);
    attention(layer.attention_kernel().name, p, q.data(), k.data(), v.data(), o.data(), nullptr, 1);
    for (std::size_t i = 0; i < o.size(); ++i) {
      MHA_RC_ASSERT(y[i] == o[i], "element " << i << ": layer " << y[i] << ", attention " << o[i]);
    }
  });
}

// A GQA layer equals the MHA layer whose W^K and W^V repeat each KV head's columns for the
// g query heads reading it (and b^K, b^V likewise): both within their reference bounds,
// which the reference computes alike, so within twice the bound of each other.
TEST_P(LayerTest, GqaEqualsMhaWithRepeatedKvWeights) {
  check_property([&] {
    Model gqa = *gen_model();
    gqa.c.q_heads = gqa.c.kv_heads * *rc::gen::inRange<std::int64_t>(2, 5);
    gqa.transposed = false;
    fill(gqa);
    const std::int64_t d = gqa.c.d_model, D = gqa.c.head_dim, H = gqa.c.q_heads;
    const std::int64_t g = H / gqa.c.kv_heads, kvd = gqa.c.kv_heads * D;
    Model mha = gqa;
    mha.c.kv_heads = H;
    const auto repeat = [&](const std::vector<float>& w, std::int64_t rows) {
      std::vector<float> r(static_cast<std::size_t>(rows * H * D));
      for (std::int64_t l = 0; l < rows; ++l) {
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t e = 0; e < D; ++e) {
            r[static_cast<std::size_t>(l * H * D + h * D + e)] =
                w[static_cast<std::size_t>(l * kvd + (h / g) * D + e)];
          }
        }
      }
      return r;
    };
    mha.wk = repeat(gqa.wk, d);
    mha.wv = repeat(gqa.wv, d);
    mha.bk = repeat(gqa.bk, 1);
    mha.bv = repeat(gqa.bv, 1);
    const Layer lg(gqa.c, gqa.weights(), gemm_kernel().name),
        lm(mha.c, mha.weights(), gemm_kernel().name);
    KvCache cg(gqa.c, gqa.batch, gqa.len), cm(mha.c, mha.batch, mha.len);
    const std::vector<float> yg = prefill_all(gqa, lg, cg), ym = prefill_all(mha, lm, cm);
    expect_close(gqa, lg, yg, 0, "GQA");
    expect_close(mha, lm, ym, 0, "MHA with repeated KV weights");
    const ref::LayerResult r = ref::layer(gqa.c, gqa.weights(), gqa.x.data(), gqa.batch, gqa.len, 0,
                                          gqa.causal, lg.attention_kernel().exp_ulp);
    for (std::size_t i = 0; i < yg.size(); ++i) {
      MHA_RC_ASSERT(std::fabs(yg[i] - ym[i]) <= 2 * r.tol[i],
                    "element " << i << ": GQA " << yg[i] << ", MHA " << ym[i]);
    }
    RC_ASSERT(cg.bytes() * static_cast<std::size_t>(g) == cm.bytes());
  });
}

// Decode steps after a past restored with KvCache::append (K and V taken as exact): each
// step matches the reference layer that continues the same past.
TEST_P(LayerTest, DecodeAfterAnAppendedPastMatchesReference) {
  check_property([&] {
    Model m = *gen_model(6);
    m.causal = true;
    const std::int64_t past = *rc::gen::inRange<std::int64_t>(1, 300);
    const std::int64_t D = m.c.head_dim, Hkv = m.c.kv_heads, d = m.c.d_model;
    const std::vector<float> k = values(m.batch * Hkv * past * D, 1.0f);
    const std::vector<float> v = values(m.batch * Hkv * past * D, 1.0f);
    const Layer layer(m.c, m.weights(), gemm_kernel().name);
    KvCache cache(m.c, m.batch, past + m.len);
    cache.append(k.data(), v.data(), past);
    const ref::PastKv given{k.data(), v.data(), {Hkv * past * D, D, past * D}, past};
    for (std::int64_t t = 0; t < m.len; ++t) {
      const std::vector<float> x = tokens(m, t, t + 1);
      std::vector<float> y(x.size());
      layer.decode(x.data(), y.data(), cache, 2);
      const Model upto = prefix(m, t + 1);
      const ref::LayerResult r = ref::layer(upto.c, upto.weights(), upto.x.data(), m.batch, t + 1,
                                            t, true, layer.attention_kernel().exp_ulp, given);
      for (std::int64_t b = 0; b < m.batch; ++b) {
        for (std::int64_t col = 0; col < d; ++col) {
          const double got = y[static_cast<std::size_t>(b * d + col)];
          MHA_RC_ASSERT(std::fabs(got - r.y[r.at(b, 0, col)]) <= r.tol[r.at(b, 0, col)],
                        "decode step " << t << " after " << past << " past tokens, sequence " << b
                                       << ", column " << col << ": " << got << ", reference "
                                       << r.y[r.at(b, 0, col)] << ", bound "
                                       << r.tol[r.at(b, 0, col)]);
        }
      }
    }
  });
}

TEST_P(LayerTest, ThreadCountDoesNotChangeABit) {
  check_property([&] {
    const Model m = *gen_model();
    const Layer layer(m.c, m.weights(), gemm_kernel().name);
    KvCache one(m.c, m.batch, m.len);
    const std::vector<float> y1 = prefill_all(m, layer, one, 1);
    for (int threads : {2, 3, 4}) {
      KvCache cache(m.c, m.batch, m.len);
      const std::vector<float> y = prefill_all(m, layer, cache, threads);
      MHA_RC_ASSERT(std::memcmp(y.data(), y1.data(), y.size() * sizeof(float)) == 0,
                    threads << " threads differ from 1");
    }
  });
}

MHA_INSTANTIATE_FOR_GEMMS(LayerTest);

// ---- A cache of each KvType (the GEMM and attention kernels the layer picks) ----

constexpr KvType kAllKvTypes[] = {KvType::f32, KvType::f16, KvType::bf16, KvType::i8};

class LayerKvTest : public ::testing::TestWithParam<KvType> {
 protected:
  KvType kv_type() const { return GetParam(); }
};

// The cache's stored values as the reference takes them.
ref::StoredKv stored(const KvCache& cache) {
  return {cache.kv_type(), cache.k_view(),        cache.v_view(),
          cache.strides(), cache.scale_strides(), cache.length()};
}

// The rows [0, length()) of a cache as it stores them: K's and V's elements' bytes and i8's
// scales, [batch][Hkv][length].
struct Rows {
  std::vector<unsigned char> k, v;
  std::vector<float> k_scale, v_scale;
  bool operator==(const Rows& o) const {
    const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    };
    return k == o.k && v == o.v && same(k_scale, o.k_scale) && same(v_scale, o.v_scale);
  }
};

Rows rows_of(const KvCache& cache) {
  Rows r;
  const KvType t = cache.kv_type();
  const std::size_t size = kv_type_bytes(t);
  const Strides st = cache.strides(), sst = cache.scale_strides();
  const auto row_bytes = static_cast<std::size_t>(cache.head_dim()) * size;
  for (std::int64_t b = 0; b < cache.batch(); ++b) {
    for (std::int64_t j = 0; j < cache.kv_heads(); ++j) {
      for (std::int64_t p = 0; p < cache.length(); ++p) {
        const std::int64_t at = b * st.batch + j * st.head + p * st.seq;
        const std::int64_t scale_at = b * sst.batch + j * sst.head + p * sst.seq;
        for (const auto& [view, out, scales] : {std::tuple{cache.k_view(), &r.k, &r.k_scale},
                                                std::tuple{cache.v_view(), &r.v, &r.v_scale}}) {
          const KvView row = advance(view, t, at, scale_at);
          const auto* bytes = static_cast<const unsigned char*>(row.data);
          out->insert(out->end(), bytes, bytes + row_bytes);
          if (t == KvType::i8) scales->push_back(*row.scale);
        }
      }
    }
  }
  return r;
}

// Row `row` of n fp32 values x as a cache of type t must hold it: f16 and bf16 each value
// rounded to nearest, ties to even (kv::f32_to_f16, f32_to_bf16); i8 the integers and scale
// kv::quantize_i8_row gives, the scale max|x| / 127 rounded once and every value within
// s/2 + 127 ulp(s) of q s. `where` names the row.
void expect_holds(KvType t, const float* x, std::int64_t n, KvView row, const std::string& where) {
  if (t == KvType::i8) {
    std::vector<std::int8_t> q(static_cast<std::size_t>(n));
    const float s = kv::quantize_i8_row(x, n, q.data());
    const float scale = *row.scale;
    MHA_RC_ASSERT(std::memcmp(&scale, &s, sizeof s) == 0,
                  where << ": scale " << scale << ", quantize_i8_row's " << s);
    float max_abs = 0.0f;
    for (std::int64_t e = 0; e < n; ++e) max_abs = std::max(max_abs, std::fabs(x[e]));
    MHA_RC_ASSERT(scale == max_abs / 127.0f,
                  where << ": scale " << scale << " for max|x| " << max_abs);
    const double ulp = std::max(std::ldexp(static_cast<double>(scale), -23), std::ldexp(1.0, -149));
    const auto* stored_q = static_cast<const std::int8_t*>(row.data);
    for (std::int64_t e = 0; e < n; ++e) {
      const int v = stored_q[e];
      MHA_RC_ASSERT(v == q[static_cast<std::size_t>(e)] && v >= -127 && v <= 127,
                    where << ", element " << e << ": " << v << ", quantize_i8_row's "
                          << int{q[static_cast<std::size_t>(e)]});
      const double err = std::fabs(static_cast<double>(x[e]) - v * static_cast<double>(scale));
      MHA_RC_ASSERT(err <= scale / 2.0 + 127.0 * ulp, where << ", element " << e << ": " << x[e]
                                                            << " stored as " << v << " x "
                                                            << scale);
    }
    return;
  }
  for (std::int64_t e = 0; e < n; ++e) {
    std::uint32_t want = 0, got = 0;
    if (t == KvType::f32) {
      std::memcpy(&want, x + e, 4);
      std::memcpy(&got, static_cast<const float*>(row.data) + e, 4);
    } else {
      want = t == KvType::f16 ? kv::f32_to_f16(x[e]) : kv::f32_to_bf16(x[e]);
      std::uint16_t h = 0;
      std::memcpy(&h, static_cast<const std::uint16_t*>(row.data) + e, 2);
      got = h;
    }
    MHA_RC_ASSERT(got == want, where << ", element " << e << ": " << x[e] << " stored as 0x"
                                     << std::hex << got << ", expected 0x" << want);
  }
}

// Every row of `cache` at positions [p0, p0 + n) holds row t of k[b][j][t][D] (likewise v)
// converted to its type.
void expect_holds(const KvCache& cache, const float* k, const float* v, std::int64_t p0,
                  std::int64_t n) {
  const std::int64_t D = cache.head_dim(), Hkv = cache.kv_heads();
  const Strides st = cache.strides(), sst = cache.scale_strides();
  for (std::int64_t b = 0; b < cache.batch(); ++b) {
    for (std::int64_t j = 0; j < Hkv; ++j) {
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t from = ((b * Hkv + j) * n + t) * D;
        const std::int64_t at = b * st.batch + j * st.head + (p0 + t) * st.seq;
        const std::int64_t scale_at = b * sst.batch + j * sst.head + (p0 + t) * sst.seq;
        const std::string where = "kv:" + std::string(kv_type_name(cache.kv_type())) + " row (" +
                                  std::to_string(b) + ", " + std::to_string(j) + ", " +
                                  std::to_string(p0 + t) + ")";
        expect_holds(cache.kv_type(), k + from, D,
                     advance(cache.k_view(), cache.kv_type(), at, scale_at), "K " + where);
        expect_holds(cache.kv_type(), v + from, D,
                     advance(cache.v_view(), cache.kv_type(), at, scale_at), "V " + where);
      }
    }
  }
}

// Rows [0, length) of an fp32 cache, dense [batch][Hkv][length][D]: as append takes them.
std::pair<std::vector<float>, std::vector<float>> dense_rows(const KvCache& wide) {
  const Rows r = rows_of(wide);
  std::vector<float> k(r.k.size() / sizeof(float)), v(k.size());
  std::memcpy(k.data(), r.k.data(), r.k.size());
  std::memcpy(v.data(), r.v.data(), r.v.size());
  return {k, v};
}

// fp32 values of every magnitude: random bit patterns, finite, a third of them exactly half
// way between two f16 or two bf16 neighbours (ties), so that f16's overflow to infinity and its
// subnormals, and both types' ties to even, are met.
std::vector<float> any_floats(std::int64_t n) {
  const std::vector<std::uint32_t> bits = *rc::gen::container<std::vector<std::uint32_t>>(
      static_cast<std::size_t>(n), rc::gen::arbitrary<std::uint32_t>());
  std::vector<float> x(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) {
    std::uint32_t u = bits[i];
    if ((u & 0x7F800000u) == 0x7F800000u) u &= 0xBFFFFFFFu;  // no infinity or NaN
    if (i % 3 == 1) u = (u & ~0x1FFFu) | 0x1000u;            // an f16 tie (normal range)
    if (i % 3 == 2) u = (u & ~0xFFFFu) | 0x8000u;            // a bf16 tie
    std::memcpy(&x[i], &u, 4);
  }
  return x;
}

// append converts every row: f16 and bf16 to nearest even, i8 per row; appended in two parts,
// so that rows land after a length > 0 too; the cache's length and nothing else changes.
TEST_P(LayerKvTest, AppendConvertsEveryRow) {
  check_property([&] {
    const Model m = *gen_model(8);
    const std::int64_t n1 = *rc::gen::inRange<std::int64_t>(1, 6);
    const std::int64_t n2 = *rc::gen::inRange<std::int64_t>(1, 6);
    KvCache cache(m.c, m.batch, n1 + n2 + *rc::gen::inRange(0, 3), kv_type());
    const std::int64_t kvd = m.c.kv_heads * m.c.head_dim;
    const bool wide = *rc::gen::arbitrary<bool>();
    std::int64_t p0 = 0;
    for (const std::int64_t n : {n1, n2}) {
      const std::vector<float> k =
          wide ? any_floats(m.batch * n * kvd) : values(m.batch * n * kvd, 4.0f);
      const std::vector<float> v =
          wide ? any_floats(m.batch * n * kvd) : values(m.batch * n * kvd, 4.0f);
      const Rows before = rows_of(cache);
      cache.append(k.data(), v.data(), n);
      RC_ASSERT(cache.length() == p0 + n);
      expect_holds(cache, k.data(), v.data(), p0, n);
      cache.truncate(p0);
      RC_ASSERT(rows_of(cache) == before);  // the earlier rows untouched
      cache.append(k.data(), v.data(), n);
      p0 += n;
    }
  });
}

// prefill in one or two chunks: the cache holds the fp32 layer's cache rows (the GEMM's
// projections) converted, and each chunk's Y is within the reference bound over the stored
// keys and values.
TEST_P(LayerKvTest, PrefillMatchesReferenceOnStoredValues) {
  check_property([&] {
    const Model m = *gen_model();
    const Layer layer(m.c, m.weights());
    const std::int64_t capacity = m.len + *rc::gen::inRange(0, 3);
    KvCache cache(m.c, m.batch, capacity, kv_type()), wide(m.c, m.batch, capacity);
    const std::int64_t cut = m.len > 1 && *rc::gen::arbitrary<bool>()
                                 ? *rc::gen::inRange<std::int64_t>(1, m.len)
                                 : m.len;
    for (const auto& [p0, p1] : {std::pair{std::int64_t{0}, cut}, std::pair{cut, m.len}}) {
      if (p0 == p1) continue;
      const std::vector<float> x = tokens(m, p0, p1);
      std::vector<float> y(x.size()), y_wide(x.size());
      layer.prefill(x.data(), p1 - p0, y.data(), cache, m.causal, 2);
      layer.prefill(x.data(), p1 - p0, y_wide.data(), wide, m.causal, 2);
      RC_ASSERT(cache.length() == p1);
      const ref::LayerResult r =
          ref::layer(m.c, m.weights(), x.data(), m.batch, p1 - p0, 0, m.causal,
                     layer.attention_kernel(kv_type()).exp_ulp, stored(cache));
      expect_within(r, layer, y, m.batch, p0, kv_type(),
                    "chunk [" + std::to_string(p0) + ", " + std::to_string(p1) + ")");
    }
    const auto [k, v] = dense_rows(wide);
    expect_holds(cache, k.data(), v.data(), 0, m.len);
  });
}

// prefill of n tokens and n decode steps: the same stored rows, bit for bit, and every step
// within the reference bound over the stored values, and within twice it of prefill's row.
TEST_P(LayerKvTest, PrefillEqualsDecodeSteps) {
  check_property([&] {
    Model m = *gen_model(24);
    m.causal = true;
    const Layer layer(m.c, m.weights());
    const double exp_ulp = layer.attention_kernel(kv_type()).exp_ulp;
    KvCache prefilled(m.c, m.batch, m.len, kv_type()), decoded(m.c, m.batch, m.len, kv_type());
    const std::vector<float> y = prefill_all(m, layer, prefilled);
    for (std::int64_t t = 0; t < m.len; ++t) {
      const std::vector<float> x = tokens(m, t, t + 1);
      std::vector<float> yt(x.size());
      layer.decode(x.data(), yt.data(), decoded, 2);
      const ref::LayerResult r =
          ref::layer(m.c, m.weights(), x.data(), m.batch, 1, 0, true, exp_ulp, stored(decoded));
      expect_within(r, layer, yt, m.batch, t, kv_type(), "decode step " + std::to_string(t));
      expect_step_near_row(m, yt, y, r, t);
    }
    RC_ASSERT(rows_of(prefilled) == rows_of(decoded));
  });
}

// Decode steps after a past restored with append (converted): each step within the reference
// bound over the stored values; the past's rows stay as append stored them.
TEST_P(LayerKvTest, DecodeAfterAnAppendedPastMatchesReference) {
  check_property([&] {
    Model m = *gen_model(6);
    m.causal = true;
    const std::int64_t past = *rc::gen::inRange<std::int64_t>(1, 300);
    const std::int64_t kvd = m.c.kv_heads * m.c.head_dim;
    const std::vector<float> k = values(m.batch * past * kvd, 1.0f);
    const std::vector<float> v = values(m.batch * past * kvd, 1.0f);
    const Layer layer(m.c, m.weights());
    KvCache cache(m.c, m.batch, past + m.len, kv_type());
    cache.append(k.data(), v.data(), past);
    for (std::int64_t t = 0; t < m.len; ++t) {
      const std::vector<float> x = tokens(m, t, t + 1);
      std::vector<float> y(x.size());
      layer.decode(x.data(), y.data(), cache, 2);
      const ref::LayerResult r =
          ref::layer(m.c, m.weights(), x.data(), m.batch, 1, 0, true,
                     layer.attention_kernel(kv_type()).exp_ulp, stored(cache));
      expect_within(r, layer, y, m.batch, past + t, kv_type(),
                    "decode step " + std::to_string(t) + " after " + std::to_string(past));
    }
    expect_holds(cache, k.data(), v.data(), 0, past);
  });
}

TEST_P(LayerKvTest, ThreadCountDoesNotChangeABit) {
  check_property(
      [&] {
        const Model m = *gen_model();
        const Layer layer(m.c, m.weights());
        KvCache one(m.c, m.batch, m.len, kv_type()), three(m.c, m.batch, m.len, kv_type());
        const std::vector<float> y1 = prefill_all(m, layer, one, 1);
        const std::vector<float> y3 = prefill_all(m, layer, three, 3);
        RC_ASSERT(std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)) == 0);
        RC_ASSERT(rows_of(one) == rows_of(three));
      },
      25);
}

INSTANTIATE_TEST_SUITE_P(Kv, LayerKvTest, ::testing::ValuesIn(kAllKvTypes),
                         [](const ::testing::TestParamInfo<KvType>& param) {
                           return std::string(kv_type_name(param.param));
                         });

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// The full cache rejects one more token, before writing anything: its length, its K and V
// and the output stay as they were.
TEST(KvCache, FullRejectsOneMoreTokenAndKeepsItsContents) {
  const LayerConfig c{16, 4, 2, 4};
  std::vector<float> w(16 * 16, 0.25f), x(2 * 3 * 16, 0.5f), y(2 * 3 * 16, 0.0f);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 7) / 7.0f - 0.4f;
  LayerWeights weights;
  weights.wq = weights.wk = weights.wv = weights.wo = w.data();
  const Layer layer(c, weights);
  KvCache cache(c, 2, 3);
  layer.prefill(x.data(), 3, y.data(), cache);
  ASSERT_EQ(cache.length(), 3);
  const std::vector<float> k(cache.k(), cache.k() + 2 * 2 * 3 * 4),
      v(cache.v(), cache.v() + 2 * 2 * 3 * 4);
  std::vector<float> y_token(2 * 16, 7.0f);
  EXPECT_EQ(error_of([&] { layer.decode(x.data(), y_token.data(), cache); }),
            "Layer::prefill: the KV cache is full: 3 of 3 positions used, 1 more requested");
  EXPECT_EQ(cache.length(), 3);
  EXPECT_TRUE(std::equal(k.begin(), k.end(), cache.k()));
  EXPECT_TRUE(std::equal(v.begin(), v.end(), cache.v()));
  EXPECT_TRUE(std::all_of(y_token.begin(), y_token.end(), [](float f) { return f == 7.0f; }));
  EXPECT_EQ(error_of([&] { cache.append(k.data(), v.data(), 1); }),
            "KvCache::append: the KV cache is full: 3 of 3 positions used, 1 more requested");
  EXPECT_EQ(error_of([&] { cache.append(nullptr, v.data(), 1); }),
            "KvCache::append: k and v must not be null");
  EXPECT_EQ(error_of([&] { cache.truncate(4); }),
            "KvCache::truncate: length must be in [0, 3], got 4");
  // The third token forgotten: room for one more, which takes its place. Every token of x is
  // the same (all 0.5), so the cache holds the same bits again.
  cache.truncate(2);
  std::vector<float> y_again(2 * 16);
  layer.decode(x.data(), y_again.data(), cache);
  EXPECT_EQ(cache.length(), 3);
  EXPECT_TRUE(std::equal(k.begin(), k.end(), cache.k()));
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(error_of([&] { layer.prefill(x.data(), 4, y.data(), cache); }),
            "Layer::prefill: the KV cache is full: 0 of 3 positions used, 4 more requested");
  EXPECT_EQ(error_of([&] { layer.prefill(x.data(), 3, y.data(), cache); }), "");
}

TEST(KvCache, SizeIsWhatItHolds) {
  const LayerConfig mha{4096, 32, 32, 128}, gqa{4096, 32, 8, 128}, mqa{4096, 32, 1, 128};
  EXPECT_EQ(KvCache::bytes(mha, 1, 8192), std::size_t{2} * 32 * 8192 * 128 * 4);  // 256 MiB
  EXPECT_EQ(KvCache::bytes(gqa, 1, 8192) * 4, KvCache::bytes(mha, 1, 8192));
  EXPECT_EQ(KvCache::bytes(mqa, 1, 8192) * 32, KvCache::bytes(mha, 1, 8192));
  const KvCache cache(LayerConfig{8, 2, 2, 4}, 3, 5);
  EXPECT_EQ(cache.bytes(), std::size_t{2} * 3 * 2 * 5 * 4 * 4);
  EXPECT_EQ(cache.strides().batch, 2 * 5 * 4);
  EXPECT_EQ(cache.strides().head, 5 * 4);
  EXPECT_EQ(cache.strides().seq, 4);
}

// Each type's bytes: elements of its size, and i8's fp32 scale per row; the same from the
// instance as from the static function; one set of strides, counted in the type's elements.
TEST(KvCache, SizeOfEachTypeIsWhatItHolds) {
  const LayerConfig gqa{4096, 32, 8, 128};
  const std::size_t rows = std::size_t{2} * 8 * 8192;  // K and V, 8 heads, 8192 tokens
  EXPECT_EQ(KvCache::bytes(gqa, 1, 8192, KvType::f32), rows * 128 * 4);  // 64 MiB
  EXPECT_EQ(KvCache::bytes(gqa, 1, 8192, KvType::f16), rows * 128 * 2);
  EXPECT_EQ(KvCache::bytes(gqa, 1, 8192, KvType::bf16), rows * 128 * 2);
  EXPECT_EQ(KvCache::bytes(gqa, 1, 8192, KvType::i8), rows * (128 + 4));  // 3 % for the scales
  EXPECT_EQ(KvCache::bytes(gqa, 1, 8192), KvCache::bytes(gqa, 1, 8192, KvType::f32));
  const LayerConfig c{8, 2, 2, 4};
  for (KvType t : kAllKvTypes) {
    const KvCache cache(c, 3, 5, t);
    EXPECT_EQ(cache.kv_type(), t);
    EXPECT_EQ(cache.bytes(), KvCache::bytes(c, 3, 5, t)) << kv_type_name(t);
    EXPECT_EQ(cache.bytes(),
              std::size_t{2} * 3 * 2 * 5 * (4 * kv_type_bytes(t) + (t == KvType::i8 ? 4 : 0)))
        << kv_type_name(t);
    EXPECT_EQ(cache.strides().batch, 2 * 5 * 4);
    EXPECT_EQ(cache.strides().head, 5 * 4);
    EXPECT_EQ(cache.strides().seq, 4);
    EXPECT_EQ(cache.scale_strides().batch, 2 * 5);
    EXPECT_EQ(cache.scale_strides().head, 5);
    EXPECT_EQ(cache.scale_strides().seq, 1);
    EXPECT_EQ(cache.k_view().scale == nullptr, t != KvType::i8) << kv_type_name(t);
    EXPECT_EQ(cache.v_view().scale == nullptr, t != KvType::i8) << kv_type_name(t);
  }
}

// std::logic_error's message, or "" (k() on a cache whose elements are not floats).
template <typename F>
std::string logic_error_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
    return "std::invalid_argument";
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "";
}

TEST(KvCache, TypeErrorsSayWhat) {
  const LayerConfig c{8, 2, 1, 4};
  const auto bad = static_cast<KvType>(9);
  EXPECT_EQ(error_of([&] { KvCache(c, 1, 4, bad); }), "KvCache: kv_type (9) is not a KvType");
  EXPECT_EQ(error_of([&] { KvCache::bytes(c, 1, 4, bad); }),
            "KvCache::bytes: kv_type (9) is not a KvType");
  const KvCache f16(c, 1, 4, KvType::f16), i8(c, 1, 4, KvType::i8), f32(c, 1, 4);
  EXPECT_EQ(logic_error_of([&] { f16.k(); }),
            "KvCache::k: the cache holds kv_type f16, not f32 floats: read it through k_view() "
            "and v_view()");
  EXPECT_EQ(logic_error_of([&] { i8.v(); }),
            "KvCache::v: the cache holds kv_type i8, not f32 floats: read it through k_view() "
            "and v_view()");
  EXPECT_EQ(logic_error_of([&] { f32.k(); }), "");
  EXPECT_EQ(f32.k(), f32.k_view().data);
  EXPECT_EQ(f32.v(), f32.v_view().data);
}

// Without a name, each type's best kernel; with one, that kernel for the types it reads.
TEST(LayerKv, AttentionKernelPerType) {
  const LayerConfig c{8, 2, 1, 4};
  std::vector<float> w(64, 0.25f), x(16, 1.0f), y(16, 7.0f);
  LayerWeights weights;
  weights.wq = weights.wk = weights.wv = weights.wo = w.data();
  const Layer best(c, weights);
  for (KvType t : kAllKvTypes) {
    EXPECT_EQ(&best.attention_kernel(t), &best_kernel(t)) << kv_type_name(t);
  }
  EXPECT_EQ(&best.attention_kernel(), &best_kernel());
  EXPECT_EQ(error_of([&] { best.attention_kernel(static_cast<KvType>(9)); }),
            "Layer::attention_kernel: kv_type (9) is not a KvType");
  for (const KernelInfo& kernel : all_kernels()) {
    if (!available(kernel)) continue;
    const Layer named(c, weights, "", kernel.name);
    for (KvType t : kAllKvTypes) {
      if (!reads(kernel, t)) continue;  // KernelRefusesATypeItDoesNotRead
      KvCache cache(c, 2, 4, t);
      EXPECT_EQ(&named.attention_kernel(t), &kernel);
      EXPECT_EQ(error_of([&] { named.prefill(x.data(), 1, y.data(), cache); }), "");
    }
  }
}

// An attention kernel and a cache of a type it does not read: a clear error, before anything
// is written. Every registry kernel reads every KvType (kv_types in kernels/registry.inc:
// kKvAll), so each available one is given as an entry of its own restricted to f32, as a
// user's copy of a kernel may be; an f32 cache still runs through it, with the registry
// kernel's bits.
TEST(LayerKv, KernelRefusesATypeItDoesNotRead) {
  const LayerConfig c{8, 2, 1, 4};
  std::vector<float> w(64, 0.25f), x(16), y(16, 7.0f), want(16);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.5f - 0.125f * static_cast<float>(i % 9);
  LayerWeights weights;
  weights.wq = weights.wk = weights.wv = weights.wo = w.data();
  for (const KernelInfo& kernel : all_kernels()) {
    if (!available(kernel)) continue;
    KernelInfo f32_only = kernel;
    f32_only.kv_types = kKvF32;
    const Layer own(c, weights, "", f32_only);
    for (KvType t : kAllKvTypes) {
      if (t == KvType::f32) continue;
      KvCache cache(c, 2, 4, t);
      const std::string why = "attention kernel '" + std::string(kernel.name) +
                              "' does not read kv_type " + kv_type_name(t);
      EXPECT_EQ(error_of([&] { own.attention_kernel(t); }), "Layer::attention_kernel: " + why);
      std::fill(y.begin(), y.end(), 7.0f);
      EXPECT_EQ(error_of([&] { own.decode(x.data(), y.data(), cache); }), "Layer::prefill: " + why);
      EXPECT_EQ(cache.length(), 0);
      EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float f) { return f == 7.0f; }))
          << kernel.name << " " << kv_type_name(t);
    }
    EXPECT_EQ(&own.attention_kernel(), &f32_only);
    KvCache mine(c, 2, 4), theirs(c, 2, 4);
    own.prefill(x.data(), 1, y.data(), mine);
    Layer(c, weights, "", kernel.name).prefill(x.data(), 1, want.data(), theirs);
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float))) << kernel.name;
  }
  KernelInfo none = best_kernel();
  none.workspace = nullptr;
  EXPECT_EQ(error_of([&] { Layer(c, weights, "", none); }),
            "Layer: the attention kernel's KernelInfo needs a name, fn and workspace");
}

TEST(LayerCheck, RejectsBadShapesAndCallsWithAMessage) {
  EXPECT_EQ(check(LayerConfig{64, 4, 2, 16}), "");
  EXPECT_EQ(check(LayerConfig{0, 4, 2, 16}), "d_model must be positive, got 0");
  EXPECT_EQ(check(LayerConfig{64, 4, 3, 16}), "q_heads (4) must be a multiple of kv_heads (3)");
  EXPECT_EQ(check(LayerConfig{std::int64_t{1} << 40, 1 << 20, 1, 1 << 20}),
            "the weights' sizes (d 1099511627776, H 1048576, Hkv 1, D 1048576) overflow int64");
  const LayerConfig c{8, 2, 1, 4};
  std::vector<float> w(64, 0.5f), x(16, 1.0f), y(16);
  LayerWeights weights;
  weights.wq = weights.wk = weights.wv = weights.wo = w.data();
  EXPECT_EQ(error_of([&] { KvCache(c, 0, 4); }),
            "KvCache: batch and capacity must be positive, got batch 0, capacity 4");
  EXPECT_EQ(error_of([&] { Layer(c, LayerWeights{}); }),
            "Layer: wq, wk, wv and wo must not be null");
  EXPECT_EQ(error_of([&] { Layer(c, weights, "nonesuch"); }),
            "Layer: unknown gemm kernel 'nonesuch'");
  EXPECT_EQ(error_of([&] { Layer(c, weights, "", "nonesuch"); }),
            "Layer: unknown attention kernel 'nonesuch'");
  const Layer layer(c, weights);
  KvCache other(LayerConfig{8, 2, 2, 4}, 1, 4), cache(c, 1, 4);
  EXPECT_EQ(error_of([&] { layer.prefill(x.data(), 2, y.data(), other); }),
            "Layer::prefill: the cache is for another layer shape (d 8, H 2, Hkv 2, D 4; the "
            "layer's: d 8, H 2, Hkv 1, D 4)");
  EXPECT_EQ(error_of([&] { layer.prefill(x.data(), 0, y.data(), cache); }),
            "Layer::prefill: n must be positive, got 0");
  EXPECT_EQ(error_of([&] { layer.prefill(nullptr, 1, y.data(), cache); }),
            "Layer::prefill: x and y must not be null");
  EXPECT_EQ(error_of([&] { layer.prefill(x.data(), 2, x.data() + 4, cache); }),
            "Layer::prefill: y overlaps x");
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(error_of([&] { layer.forward(x.data(), 1, 0, y.data(), true); }),
            "Layer::forward: batch and n must be positive, got batch 1, n 0");
}

}  // namespace
}  // namespace mha::test

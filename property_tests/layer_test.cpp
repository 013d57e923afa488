// The whole layer (mha/layer.h) against the double-precision layer of reference/layer.h and
// its derived bound, and the layer's own identities: prefill equals decode steps, one head
// with W^O = I is attention, GQA is MHA with repeated KV weights, the thread count changes
// no bit; and the KV cache's limits. Parameterized over the GEMM kernels; the attention
// step runs on best_kernel().
#include <gtest/gtest.h>
#include <mha/layer.h>
#include <mha/registry.h>
#include <rapidcheck.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gemm_kernel_test.h"
#include "layer.h"
#include "run.h"

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

// Y for query positions [first, len) is within the reference bound, element by element.
void expect_close(const Model& m, const Layer& layer, const std::vector<float>& y,
                  std::int64_t first, const std::string& what) {
  const ref::LayerResult r = ref::layer(m.c, m.weights(), m.x.data(), m.batch, m.len, first,
                                        m.causal, layer.attention_kernel().exp_ulp);
  for (std::int64_t b = 0; b < m.batch; ++b) {
    for (std::int64_t i = 0; i < r.rows; ++i) {
      for (std::int64_t col = 0; col < m.c.d_model; ++col) {
        const double got = y[r.at(b, i, col)], want = r.y[r.at(b, i, col)];
        const double tol = r.tol[r.at(b, i, col)];
        MHA_RC_ASSERT(std::fabs(got - want) <= tol,
                      what << ": y[" << b << "][" << first + i << "][" << col << "] = " << got
                           << ", reference " << want << ", bound " << tol << " (gemm "
                           << layer.gemm_kernel().name << ", attention "
                           << layer.attention_kernel().name << ")");
      }
    }
  }
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
    const std::int64_t d = m.c.d_model;
    for (std::int64_t t = 0; t < m.len; ++t) {
      const std::vector<float> x = tokens(m, t, t + 1);
      std::vector<float> yt(x.size());
      layer.decode(x.data(), yt.data(), decoded, 2);
      const Model upto = prefix(m, t + 1);
      const ref::LayerResult r = ref::layer(upto.c, upto.weights(), upto.x.data(), m.batch, t + 1,
                                            t, true, layer.attention_kernel().exp_ulp);
      for (std::int64_t b = 0; b < m.batch; ++b) {
        for (std::int64_t col = 0; col < d; ++col) {
          const double step = yt[static_cast<std::size_t>(b * d + col)];
          const double whole = y[static_cast<std::size_t>((b * m.len + t) * d + col)];
          const double tol = r.tol[r.at(b, 0, col)];
          MHA_RC_ASSERT(std::fabs(step - r.y[r.at(b, 0, col)]) <= tol,
                        "decode step " << t << ", sequence " << b << ", column " << col);
          MHA_RC_ASSERT(std::fabs(step - whole) <= 2 * tol, "decode step "
                                                                << t << " vs prefill row " << t
                                                                << ": " << step << " vs " << whole);
        }
      }
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

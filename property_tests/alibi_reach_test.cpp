// ALiBi's reach (support::AlibiReach, mha/support.h), kernel by kernel in equivalence_test.cpp;
// here the window itself: every key it drops weighs below 2^-40 in double, and it is taken.
#include <mha/kv_types.h>
#include <mha/support.h>
#include <rapidcheck.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "buffers.h"
#include "reference.h"
#include "run.h"

namespace mha::test {
namespace {

// Every key the window drops has a logit (capped, biased) more than 40 ln 2 below its row's
// max over all the keys the row sees, in double on the exact inputs: a weight below 2^-40 of
// the largest, which the tolerance lets a kernel lose (reference/tolerance.h, step 10). K and V in
// any KV type (the window reads K's norms and V's finiteness as the kernels read them). And the
// window is taken: on f32 inputs without a cap or an offset, it is within the bound its slopes
// promise, (2 U + 105) / slope + 1 and a rounding's slack.
TEST(AlibiReach, DropsOnlyKeysBelowTwoToTheMinus40) {
  check_property([] {
    double u = 0;
    const Inputs in = alibi_reach_inputs(&u);
    Problem p = in.p;
    const KvType type = *unsized(rc::gen::elementOf(
        std::vector<KvType>{KvType::f32, KvType::f32, KvType::f16, KvType::bf16, KvType::i8}));
    // K and V narrowed, dense token-major (f32: the drawn layout as it is).
    std::vector<unsigned char> k_bytes, v_bytes;
    std::vector<float> k_scales, v_scales;
    KvView k(in.k), v(in.v);
    if (type != KvType::f32) {
      const auto narrow = [&](const float* x, const Strides& s, std::vector<unsigned char>& bytes,
                              std::vector<float>& scales) {
        const Dense dense = gather(x, s, p.batch, p.kv_len, p.kv_heads, p.head_dim);
        const std::int64_t rows = p.batch * p.kv_len * p.kv_heads;
        bytes.resize(static_cast<std::size_t>(rows * p.head_dim) * kv_type_bytes(type));
        scales.resize(static_cast<std::size_t>(rows));
        kv::narrow_rows(type, dense.x.data(), rows, p.head_dim, bytes.data(), scales.data());
      };
      narrow(in.k, p.k, k_bytes, k_scales);
      narrow(in.v, p.v, v_bytes, v_scales);
      p.kv_type = type;
      p.k = p.v = dense_strides(Layout::token_major, p.kv_len, p.kv_heads, p.head_dim);
      p.k_scale = p.v_scale = dense_strides(Layout::token_major, p.kv_len, p.kv_heads, 1);
      k = KvView(k_bytes.data(), k_scales.data());
      v = KvView(v_bytes.data(), v_scales.data());
    }
    const std::int64_t window = support::AlibiReach::of(p, in.q, k, v);
    RC_TAG(window > 0 ? "reach" : "no reach");
    const std::int64_t g = p.q_heads / p.kv_heads;
    if (type == KvType::f32 && !soft_capped(p) && p.alibi_offset == 0) {
      float smallest = std::numeric_limits<float>::infinity();
      for (std::int64_t h = 0; h < p.q_heads; ++h) smallest = std::min(smallest, p.alibi[h]);
      const double promised = (2 * u * (1 + 0x1p-8) + 30) / (smallest * (1 - 0x1p-8)) + 2;
      const std::int64_t most = p.window > 0 ? std::min(p.window, p.kv_len) : p.kv_len;
      if (promised < static_cast<double>(most)) {
        RC_ASSERT(window > 0);
        RC_ASSERT(static_cast<double>(window) <= promised);
      }
    }
    if (window == 0) return;
    const double least = -40 * std::log(2.0);
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t h = 0; h < p.q_heads; ++h) {
        for (std::int64_t i = 0; i < p.q_len; ++i) {
          const ref::KeyRange keys = ref::key_range(p, b, i);
          std::vector<double> logits;
          double most = -std::numeric_limits<double>::infinity();
          for (std::int64_t j = keys.first; j < keys.end; ++j) {
            const ref::KvRow key = ref::k_row(p, k, b, j, h / g);
            double dot = 0;
            for (std::int64_t d = 0; d < p.head_dim; ++d)
              dot += static_cast<double>(in.q[b * p.q.batch + i * p.q.seq + h * p.q.head + d]) *
                     key.at(d);
            const double s = ref::capped_logit(p, p.scale * dot) + ref::alibi_bias(p, b, h, i, j);
            logits.push_back(s);
            most = std::max(most, s);
          }
          for (std::int64_t j = keys.first; j < keys.end - window; ++j) {
            const double below = logits[static_cast<std::size_t>(j - keys.first)] - most;
            if (!(below < least)) {
              RC_FAIL("b=" + std::to_string(b) + " h=" + std::to_string(h) +
                      " i=" + std::to_string(i) + ": key " + std::to_string(j) +
                      " dropped (window " + std::to_string(window) + ") is only " +
                      std::to_string(below) + " below the row's max");
            }
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace mha::test

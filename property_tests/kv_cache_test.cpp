// K and V stored as f16, bf16 and i8 (Problem::kv_type): every kernel that reads a type
// (its registry entry's kv_types), directly and through the parallel driver, against the
// reference taking the stored values exactly; the same output bits as the fp32 path given
// the widened values; NaN and infinity as for fp32; and the validation of the new fields.
// A kernel that reads fp32 alone is skipped here, saying so.
#include <rapidcheck.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <mha/kv_types.h>

#include "buffers.h"
#include "cases.h"
#include "compare.h"
#include "driver_properties.h"
#include "kernel_test.h"
#include "run.h"

namespace mha::test {
namespace {

constexpr KvType kReducedTypes[] = {KvType::f16, KvType::bf16, KvType::i8};

// One of K or V stored as a reduced type with the fp32 tensor's strides (its layout and
// padding), each element converted (f16, bf16: to nearest, ties to even) or each row
// quantised (i8, its scale in `scales`). Elements no row addresses hold the type's NaN
// (f16, bf16) or -128 (i8: never produced by quantisation), so a kernel that reads one
// shows it.
struct Stored {
  std::vector<unsigned char> bytes;
  std::vector<float> scales;   // i8: one per row, at the problem's scale strides
  std::vector<float> widened;  // value_at of every element, fp32, at the same offsets
  KvView view() const { return KvView(bytes.data(), scales.empty() ? nullptr : scales.data()); }
};

Stored store(const Problem& p, KvType t, const float* x, const Strides& st,
             const Strides& scale_st) {
  Stored s;
  const std::int64_t elements = extent(st, p.batch, p.kv_len, p.kv_heads, p.head_dim);
  const std::size_t size = kv_type_bytes(t);
  s.bytes.assign(static_cast<std::size_t>(elements) * size, 0);
  for (std::int64_t i = 0; i < elements; ++i) {
    unsigned char* e = s.bytes.data() + static_cast<std::size_t>(i) * size;
    if (t == KvType::i8) {
      e[0] = 0x80;
    } else {
      const std::uint16_t nan = t == KvType::f16 ? 0x7E01 : 0x7FC1;
      std::memcpy(e, &nan, 2);
    }
  }
  s.widened.assign(static_cast<std::size_t>(elements), std::numeric_limits<float>::quiet_NaN());
  if (t == KvType::i8) {
    s.scales.assign(static_cast<std::size_t>(extent(scale_st, p.batch, p.kv_len, p.kv_heads, 1)),
                    0.0f);
  }
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t j = 0; j < p.kv_len; ++j) {
      for (std::int64_t h = 0; h < p.kv_heads; ++h) {
        const std::int64_t row = b * st.batch + j * st.seq + h * st.head;
        unsigned char* out = s.bytes.data() + static_cast<std::size_t>(row) * size;
        float scale = 1.0f;
        if (t == KvType::i8) {
          scale = kv::quantize_i8_row(x + row, p.head_dim, reinterpret_cast<std::int8_t*>(out));
          s.scales[static_cast<std::size_t>(b * scale_st.batch + j * scale_st.seq +
                                            h * scale_st.head)] = scale;
        } else {
          for (std::int64_t d = 0; d < p.head_dim; ++d) {
            const std::uint16_t u =
                t == KvType::f16 ? kv::f32_to_f16(x[row + d]) : kv::f32_to_bf16(x[row + d]);
            std::memcpy(out + 2 * d, &u, 2);
          }
        }
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          s.widened[static_cast<std::size_t>(row + d)] = kv::value_at(t, out, d, scale);
        }
      }
    }
  }
  return s;
}

// The case's K and V stored as t. The scale arrays: K's token-major [B][L][Hkv], V's
// head-major [B][Hkv][L] with one float of padding per head, so both orders are read.
struct TypedCase {
  Inputs in;  // the fp32 case (q, and the K and V the stored ones were made from)
  Problem p;  // in.p with kv_type t and the scale strides
  Stored k, v;
};

TypedCase typed_case(const Case& c, KvType t) {
  TypedCase tc{make_inputs(c), Problem(), Stored(), Stored()};
  Problem& p = tc.p;
  p = tc.in.p;
  p.kv_type = t;
  p.k_scale = dense_strides(Layout::token_major, p.kv_len, p.kv_heads, 1);
  p.v_scale = {p.kv_heads * (p.kv_len + 1), 1, p.kv_len + 1};
  tc.k = store(p, t, tc.in.k, p.k, p.k_scale);
  tc.v = store(p, t, tc.in.v, p.v, p.v_scale);
  return tc;
}

rc::Gen<KvType> gen_type(const KernelInfo& kernel) {
  std::vector<KvType> types;
  for (KvType t : kReducedTypes) {
    if (reads(kernel, t)) types.push_back(t);
  }
  return rc::gen::elementOf(types);
}

// Every o and lse element of `got` has the bits of `want`'s (what: got's name, whose: want's).
void expect_same_bits(const Problem& p, const Outputs& got, const Outputs& want,
                      const std::string& what, const std::string& whose) {
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.q_heads; ++h) {
      for (std::int64_t i = 0; i < p.q_len; ++i) {
        const float l1 = got.lse_at(p, b, h, i), l2 = want.lse_at(p, b, h, i);
        MHA_RC_ASSERT(std::memcmp(&l1, &l2, sizeof l1) == 0,
                      what << " lse (" << b << ", " << h << ", " << i << ") " << l1 << " against "
                           << whose << " " << l2);
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          const float o1 = got.o_at(p, b, h, i, d), o2 = want.o_at(p, b, h, i, d);
          MHA_RC_ASSERT(std::memcmp(&o1, &o2, sizeof o1) == 0,
                        what << " o (" << b << ", " << h << ", " << i << ", " << d << ") " << o1
                             << " against " << whose << " " << o2);
        }
      }
    }
  }
}

class ReducedKv : public KernelTest {
 protected:
  void SetUp() override {
    KernelTest::SetUp();
    if (IsSkipped()) return;
    bool any = false;
    for (KvType t : kReducedTypes) any |= reads(kernel(), t);
    if (!any) GTEST_SKIP() << "kernel " << kernel().name << " reads fp32 K and V only";
  }
};

// Kernel vs reference, the reference taking the stored values exactly; the tolerance is the
// fp32 one plus i8's rounding of q s (reference/tolerance.h, step 6).
void check_typed(const KernelInfo& kernel, const Call& call, const Case& c, KvType t) {
  const TypedCase tc = typed_case(c, t);
  const std::vector<unsigned char> k_before = tc.k.bytes, v_before = tc.v.bytes;
  const Outputs out = run(call, kernel.name, tc.p, tc.in, tc.in.q, tc.k.view(), tc.v.view());
  RC_ASSERT(tc.k.bytes == k_before);  // the kernel wrote into K or V
  RC_ASSERT(tc.v.bytes == v_before);
  const ref::Result expected = ref::attention(tc.p, tc.in.q, tc.k.view(), tc.v.view());
  const Tolerance tol = tolerance(tc.p, tc.in.q, tc.k.view(), tc.v.view(), kernel.exp_ulp);
  expect_close(tc.p, out, expected, tol, 1.0,
               std::string(kernel.name) + " kv:" + kv_type_name(t) + " vs reference");
}

TEST_P(ReducedKv, MatchesReference) {
  CaseOptions options;
  options.shape.long_cases = false;
  check_property([&] {
    const KvType t = *unsized(gen_type(kernel()));
    check_typed(kernel(), call_kernel(kernel()), *gen_case(options), t);
  });
}

TEST_P(ReducedKv, GroupedAndCausal) {
  CaseOptions options;
  options.shape.long_cases = false;
  options.grouped = true;
  options.causal = 1;
  options.shape.max_len = 64;
  check_property([&] {
    const KvType t = *unsized(gen_type(kernel()));
    check_typed(kernel(), call_kernel(kernel()), *gen_case(options), t);
  });
}

// Through the parallel driver on 1-3 threads: units offset K, V and the scales by rows,
// and a decode splits the keys into chunks merged by lse.
TEST_P(ReducedKv, ThroughTheDriver) {
  CaseOptions options;
  options.shape.long_cases = false;
  check_property(
      [&] {
        const KvType t = *unsized(gen_type(kernel()));
        const int threads = *rc::gen::inRange(1, 4);
        const bool split = *unsized(rc::gen::inRange(0, 2)) == 0;
        const TypedCase tc = typed_case(split ? *gen_split_case() : *gen_case(options), t);
        const Outputs out = run(call_driver(kernel(), threads), kernel().name, tc.p, tc.in, tc.in.q,
                                tc.k.view(), tc.v.view());
        const ref::Result expected = ref::attention(tc.p, tc.in.q, tc.k.view(), tc.v.view());
        const Tolerance tol =
            merged_tolerance(tolerance(tc.p, tc.in.q, tc.k.view(), tc.v.view(), kernel().exp_ulp),
                             static_cast<double>(plan(tc.p).chunks));
        expect_close(tc.p, out, expected, tol, 1.0,
                     std::string(kernel().name) + " kv:" + kv_type_name(t) + " driver");
      },
      50);
}

// The widening is exact and the arithmetic after it the fp32 path's: the same output bits
// as the fp32 kernel over an fp32 K and V holding the widened values (value_at: for i8 the
// product q s rounded to fp32). For i8 a kernel may instead scale each key's finished logit
// and each row's weight (avx2's decode does: c q.k_j s_j, w_j s_j), another order of the
// same roundings: there the property is the tolerance's, both outputs within it of the
// exact result.
TEST_P(ReducedKv, SameBitsAsFp32OfTheWidenedValues) {
  CaseOptions options;
  options.shape.long_cases = false;
  check_property([&] {
    const KvType t = *unsized(gen_type(kernel()));
    const TypedCase tc = typed_case(*gen_case(options), t);
    const Outputs typed =
        run(call_kernel(kernel()), kernel().name, tc.p, tc.in, tc.in.q, tc.k.view(), tc.v.view());
    const Outputs wide = run(call_kernel(kernel()), kernel().name, tc.in.p, tc.in, tc.in.q,
                             tc.k.widened.data(), tc.v.widened.data());
    if (t == KvType::i8) {
      expect_close(tc.p, typed, tc.in.p, wide,
                   tolerance(tc.p, tc.in.q, tc.k.view(), tc.v.view(), kernel().exp_ulp),
                   std::string(kernel().name) + " kv:i8 against fp32 of the widened values");
      return;
    }
    expect_same_bits(tc.p, typed, wide, std::string("kv:") + kv_type_name(t), "fp32's");
  });
}

// Scales are an i8 cache's only: an f16 or bf16 call without scale pointers and with scale
// strides of INT64_MAX (which check() leaves alone for those types) gives the bits it gives
// with strides of 0, directly and through the driver (two batches, three KV heads and the
// driver's split-KV chunks make every term of a row's offset non-zero). A kernel that read
// a scale for those types would read through the null pointer.
TEST_P(ReducedKv, ScaleStridesAreReadForI8Only) {
  const auto same_bits = [&](const Case& c, KvType t, const Call& call) {
    const TypedCase tc = typed_case(c, t);
    const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
    Problem zeros = tc.p, unused = tc.p;
    zeros.k_scale = zeros.v_scale = Strides{0, 0, 0};
    unused.k_scale = unused.v_scale = Strides{huge, huge, huge};
    const KvView k(tc.k.view().data), v(tc.v.view().data);
    const Outputs a = run(call, kernel().name, zeros, tc.in, tc.in.q, k, v);
    const Outputs b = run(call, kernel().name, unused, tc.in, tc.in.q, k, v);
    expect_same_bits(tc.p, b, a, "scale strides INT64_MAX", "zero strides'");
  };
  std::vector<KvType> types;
  for (KvType t : {KvType::f16, KvType::bf16}) {
    if (reads(kernel(), t)) types.push_back(t);
  }
  if (types.empty()) GTEST_SKIP() << "kernel " << kernel().name << " reads neither f16 nor bf16";
  for (const Problem& p : {make_problem(2, 1, 300, 6, 3, 24, true),  // decode, split by the driver
                           make_problem(2, 5, 40, 6, 3, 16, true)}) {  // prefill
    Case c;
    c.p = p;
    c.seed = 3;
    for (KvType t : types) {
      for (const Call& call : {call_kernel(kernel()), call_driver(kernel(), 2)}) {
        check_property([&] { same_bits(c, t, call); }, 1);
      }
    }
  }
  CaseOptions options;
  options.shape.long_cases = false;
  check_property([&] {
    const KvType t = *rc::gen::elementOf(types);
    const bool driver = *rc::gen::arbitrary<bool>();
    same_bits(driver ? *gen_split_case() : *gen_case(options), t,
              driver ? call_driver(kernel(), 2) : call_kernel(kernel()));
  });
}

// An i8 row whose scale is NaN (quantize_i8_row's answer to a row holding a NaN) makes every
// output row that sees the key NaN, and leaves the others finite; an f16 or bf16 infinity
// in V makes the rows that give it weight non-finite.
TEST_P(ReducedKv, NonFiniteRowsPropagate) {
  for (KvType t : kReducedTypes) {
    if (!reads(kernel(), t)) continue;
    Case c;
    c.p = make_problem(1, 8, 8, 2, 1, 24, true);
    c.seed = 7;
    TypedCase tc = typed_case(c, t);
    const std::int64_t poisoned = 5;  // rows i >= 5 see key 5 (causal, Lq == Lk)
    if (t == KvType::i8) {
      tc.k.scales[static_cast<std::size_t>(poisoned * tc.p.k_scale.seq)] =
          std::numeric_limits<float>::quiet_NaN();
    } else {
      const std::uint16_t inf = t == KvType::f16 ? 0x7C00 : 0x7F80;
      std::memcpy(tc.v.bytes.data() + 2 * static_cast<std::size_t>(poisoned * tc.p.v.seq), &inf, 2);
    }
    std::vector<float> o(static_cast<std::size_t>(o_extent(tc.p))), lse(16);
    std::vector<unsigned char> ws(kernel().workspace(tc.p));
    kernel().fn(tc.p, tc.in.q, tc.k.view(), tc.v.view(), o.data(), lse.data(),
                {ws.data(), ws.size()});
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t i = 0; i < 8; ++i) {
        const float x = o[static_cast<std::size_t>(i * tc.p.o.seq + h * tc.p.o.head)];
        if (i < poisoned) {
          EXPECT_TRUE(std::isfinite(x)) << kv_type_name(t) << " row " << i << ": " << x;
        } else {
          EXPECT_FALSE(std::isfinite(x)) << kv_type_name(t) << " row " << i << ": " << x;
        }
      }
    }
  }
}

MHA_INSTANTIATE_FOR_KERNELS(ReducedKv);

// The registry's side: which kernel mha::attention picks for a type, and the messages.
TEST(ReducedKvApi, BestKernelReadsTheType) {
  for (KvType t : {KvType::f32, KvType::f16, KvType::bf16, KvType::i8}) {
    const KernelInfo& best = best_kernel(t);
    EXPECT_TRUE(reads(best, t)) << best.name << " for " << kv_type_name(t);
    EXPECT_TRUE(available(best));
    for (const KernelInfo& k : all_kernels()) {
      if (available(k) && reads(k, t)) {
        EXPECT_GE(&best, &k) << k.name << ", later than " << best.name << ", reads "
                             << kv_type_name(t);
      }
    }
  }
}

TEST(ReducedKvApi, RejectsWhatIsMissingOrWrong) {
  Problem p = make_problem(1, 4, 16, 2, 1, 8);
  p.kv_type = KvType::i8;
  std::vector<float> q(64), o(64), lse(8), scales(16);
  std::vector<std::int8_t> k(128), v(128);
  const auto message = [&](const Problem& pp, KvView kk, KvView vv) {
    return check_call(pp, q.data(), kk, vv, o.data(), lse.data());
  };
  EXPECT_EQ(message(p, {k.data(), scales.data()}, {v.data(), scales.data()}), "");
  EXPECT_EQ(message(p, KvView(k.data()), {v.data(), scales.data()}),
            "k.scale (kv_type i8) must not be null");
  EXPECT_EQ(message(p, {k.data(), scales.data()}, KvView(v.data())),
            "v.scale (kv_type i8) must not be null");
  EXPECT_EQ(message(p, {k.data(), scales.data()}, {v.data(), o.data()}),
            "o overlaps v.scale: outputs must not share memory with inputs");
  Problem bad = p;
  bad.v_scale.seq = -1;
  EXPECT_EQ(check(bad), "v_scale strides {batch 16, seq -1, head 1} must be >= 0");
  bad = p;
  bad.kv_type = static_cast<KvType>(9);
  EXPECT_EQ(check(bad), "kv_type (9) is not a KvType");
  // f16 elements are 2 bytes: an o just past 64 f16 values of k does not overlap it.
  Problem f16 = make_problem(1, 4, 16, 2, 1, 4);
  f16.kv_type = KvType::f16;
  std::vector<std::uint16_t> kv16(64 + 64);
  EXPECT_EQ(check_call(f16, q.data(), kv16.data(), kv16.data(),
                       reinterpret_cast<const float*>(kv16.data() + 64), nullptr),
            "");
  EXPECT_EQ(check_call(f16, q.data(), kv16.data(), kv16.data(),
                       reinterpret_cast<const float*>(kv16.data() + 62), nullptr),
            "o overlaps k: outputs must not share memory with inputs");
}

// A kernel that does not read the type: a clear error, nothing run. Every registry kernel
// reads every KvType (kv_types in kernels/registry.inc: kKvAll), so each available one is
// given as an entry of its own restricted to f32, as a user's copy of a kernel may be; the
// f32 call through that entry still runs and gives the registry kernel's bits.
TEST(ReducedKvApi, KernelRefusesATypeItDoesNotRead) {
  std::vector<float> q(32), o(32), scales(16, 1.0f), want(32);
  std::vector<float> kv(64);  // room for 64 elements of any type
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = 0.125f * static_cast<float>(i % 5);
  for (const KernelInfo& kernel : all_kernels()) {
    if (!available(kernel)) continue;
    KernelInfo f32_only = kernel;
    f32_only.kv_types = kKvF32;
    for (KvType t : kReducedTypes) {
      Problem p = make_problem(1, 4, 16, 2, 1, 4);
      p.kv_type = t;
      std::fill(o.begin(), o.end(), 7.0f);
      EXPECT_THROW(
          try {
            attention(f32_only, p, q.data(), {kv.data(), scales.data()}, {kv.data(), scales.data()},
                      o.data());
          } catch (const std::invalid_argument& e) {
            EXPECT_EQ(std::string(e.what()), "mha::attention: kernel '" + std::string(kernel.name) +
                                                 "' does not read kv_type " + kv_type_name(t));
            throw;
          },
          std::invalid_argument);
      EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float f) { return f == 7.0f; }))
          << kernel.name << " " << kv_type_name(t);
    }
    const Problem p = make_problem(1, 4, 16, 2, 1, 4);
    attention(kernel.name, p, q.data(), kv.data(), kv.data(), want.data());
    attention(f32_only, p, q.data(), kv.data(), kv.data(), o.data());
    EXPECT_EQ(0, std::memcmp(o.data(), want.data(), o.size() * sizeof(float))) << kernel.name;
  }
  KernelInfo none = best_kernel();
  none.fn = nullptr;
  const Problem p = make_problem(1, 4, 16, 2, 1, 4);
  EXPECT_THROW(
      try {
        attention(none, p, q.data(), kv.data(), kv.data(), o.data());
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()),
                  "mha::attention: a KernelInfo needs a name, fn and workspace");
        throw;
      },
      std::invalid_argument);
}

}  // namespace
}  // namespace mha::test

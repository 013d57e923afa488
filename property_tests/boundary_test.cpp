// Every rule of mha::check and of the entry point's check_call at its exact boundary: the
// value one below, at and one above each limit, each rejection with its own message. The
// rules themselves are in mha/attention.h (check) and kernels/registry.cpp (check_call);
// check_test.cpp tests them on typical values.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mha/attention.h>
#include <mha/registry.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace mha::test {
namespace {

using ::testing::HasSubstr;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
// The largest element offset whose byte offset fits int64_t (check's "highest offset").
constexpr std::int64_t kMaxElement = kMax / static_cast<std::int64_t>(sizeof(float));

// B 2, Lq 3, Lk 5, H 4, Hkv 2, D 8, causal: every extent above 1, so every stride counts.
Problem valid() { return make_problem(2, 3, 5, 4, 2, 8, true); }

TEST(Boundary, SizesAreAtLeastOne) {
  const char* names[] = {"batch", "q_len", "kv_len", "q_heads", "kv_heads", "head_dim"};
  std::int64_t Problem::*const fields[] = {&Problem::batch,    &Problem::q_len,
                                           &Problem::kv_len,   &Problem::q_heads,
                                           &Problem::kv_heads, &Problem::head_dim};
  for (int f = 0; f < 6; ++f) {
    for (std::int64_t value : {-1, 0, 1, 2}) {
      // Dense strides for the sizes (the field at 1 where it is not positive), with q_heads
      // following kv_heads, so that only the size rule can fail.
      std::int64_t size[6] = {1, 1, 1, 1, 1, 1};
      size[f] = value > 0 ? value : 1;
      if (f == 4) size[3] = size[4];
      Problem p = make_problem(size[0], size[1], size[2], size[3], size[4], size[5]);
      p.*fields[f] = value;
      if (value < 1) {
        EXPECT_EQ(check(p),
                  std::string(names[f]) + " (" + std::to_string(value) + ") must be positive");
      } else {
        EXPECT_EQ(check(p), "") << names[f] << " = " << value;
      }
    }
  }
}

TEST(Boundary, QueryHeadsAreAMultipleOfKvHeads) {
  // kv_heads 3: 5 and 7 are one below and one above the multiple 6.
  for (std::int64_t q_heads : {5, 6, 7}) {
    const Problem p = make_problem(1, 2, 2, q_heads, 3, 4);
    if (q_heads == 6) {
      EXPECT_EQ(check(p), "");
    } else {
      EXPECT_EQ(check(p), "q_heads (" + std::to_string(q_heads) +
                              ") must be a multiple of "
                              "kv_heads (3)");
    }
  }
  // kv_heads == q_heads (MHA) and kv_heads == 1 (MQA) are the two ends of the range.
  EXPECT_EQ(check(make_problem(1, 2, 2, 7, 7, 4)), "");
  EXPECT_EQ(check(make_problem(1, 2, 2, 7, 1, 4)), "");
  EXPECT_EQ(check(make_problem(1, 2, 2, 7, 8, 4)),
            "q_heads (7) must be a multiple of kv_heads (8)");
}

TEST(Boundary, ScaleIsFiniteAndNonZero) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float huge = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  for (float ok : {tiny, -tiny, huge, -huge}) {
    Problem p = valid();
    p.scale = ok;
    EXPECT_EQ(check(p), "") << ok;
  }
  for (float bad : {0.0f, -0.0f, inf, -inf}) {
    Problem p = valid();
    p.scale = bad;
    EXPECT_EQ(check(p), "scale (" + std::to_string(bad) + ") must be finite and non-zero") << bad;
  }
}

// Each input stride at -1 (rejected), 0 (broadcast: legal for inputs) and 1.
TEST(Boundary, InputStridesAreAtLeastZero) {
  struct Field {
    const char* name;
    std::int64_t Strides::*stride;
  };
  const Field fields[] = {
      {"batch", &Strides::batch}, {"seq", &Strides::seq}, {"head", &Strides::head}};
  const struct {
    const char* name;
    Strides Problem::*tensor;
  } tensors[] = {{"q", &Problem::q}, {"k", &Problem::k}, {"v", &Problem::v}};
  for (const auto& t : tensors) {
    for (const Field& f : fields) {
      for (std::int64_t value : {-1, 0, 1}) {
        Problem p = valid();
        (p.*t.tensor).*f.stride = value;
        if (value < 0) {
          EXPECT_EQ(check(p), std::string(t.name) + "." + f.name + " stride (-1) must be >= 0");
        } else {
          EXPECT_EQ(check(p), "") << t.name << "." << f.name << " = " << value;
        }
      }
    }
  }
}

TEST(Boundary, OutputStridesAreAtLeastZero) {
  Problem p = valid();
  p.o.batch = -1;
  EXPECT_EQ(check(p), "o.batch stride (-1) must be >= 0");
  p = valid();
  p.o.seq = -1;
  EXPECT_EQ(check(p), "o.seq stride (-1) must be >= 0");
  p = valid();
  p.o.head = -1;
  EXPECT_EQ(check(p), "o.head stride (-1) must be >= 0");
  p = valid();
  p.lse.batch = -1;
  EXPECT_EQ(check(p), "lse strides {batch -1, head 3} must be >= 0");
  p = valid();
  p.lse.head = -1;
  EXPECT_EQ(check(p), "lse strides {batch 12, head -1} must be >= 0");
}

// o's elements must be distinct. Token-major o ([B][Lq][H][D], D = 8, H = 4, Lq = 3): the
// head stride may not be below D, the seq stride below H D, the batch stride below Lq H D;
// at each of those values two elements exactly touch (legal), one below two alias.
TEST(Boundary, OutputElementsTouchButNeverAlias) {
  const auto o_message = [](const Problem& p) {
    return "o strides {batch " + std::to_string(p.o.batch) + ", seq " + std::to_string(p.o.seq) +
           ", head " + std::to_string(p.o.head) +
           "} make o overlap itself (outputs need distinct elements; head_dim 8 is contiguous)";
  };
  const Problem dense = valid();
  ASSERT_EQ(dense.o.head, 8);
  ASSERT_EQ(dense.o.seq, 32);
  ASSERT_EQ(dense.o.batch, 96);
  struct Limit {
    std::int64_t Strides::*stride;
    std::int64_t at;  // the least stride that keeps the elements distinct
  };
  for (const Limit& l :
       {Limit{&Strides::head, 8}, Limit{&Strides::seq, 32}, Limit{&Strides::batch, 96}}) {
    for (std::int64_t value : {l.at - 1, l.at, l.at + 1}) {
      Problem p = dense;
      p.o.*l.stride = value;
      // Padding the head stride by one pushes the larger strides out by as much.
      if (l.stride == &Strides::head && value > l.at) {
        p.o.seq = 4 * value;
        p.o.batch = 3 * p.o.seq;
      }
      if (l.stride == &Strides::seq && value > l.at) p.o.batch = 3 * value;
      if (value < l.at) {
        EXPECT_EQ(check(p), o_message(p)) << value;
      } else {
        EXPECT_EQ(check(p), "") << value;
      }
    }
  }
  // Head-major o ([B][H][Lq][D]): the same limits in the other nesting order.
  Problem p = make_problem(2, 3, 5, 4, 2, 8, true, Layout::head_major);
  ASSERT_EQ(p.o.seq, 8);
  ASSERT_EQ(p.o.head, 24);
  EXPECT_EQ(check(p), "");
  p.o.head = 23;  // head h + 1's first row starts on head h's last row
  EXPECT_EQ(check(p), o_message(p));
  // A dimension of extent 1 may have any stride, 0 included.
  p = make_problem(1, 1, 5, 1, 1, 8);
  p.o.batch = p.o.seq = p.o.head = 0;
  EXPECT_EQ(check(p), "");
  // Disjoint but interleaved strides (not nested) are rejected: conservative, never unsafe.
  // D = 1, H = 2, Lq = 3, seq 2 and head 3 reach the offsets {0, 2, 4} + {0, 3}: distinct.
  p = make_problem(1, 3, 3, 2, 2, 1);
  p.o.seq = 2;
  p.o.head = 3;
  p.o.batch = 8;
  EXPECT_THAT(check(p), HasSubstr("make o overlap itself"));
}

// lse rows hold Lq = 3 contiguous floats: the head stride may not be below 3, the batch
// stride below H Lq = 12.
TEST(Boundary, LseRowsTouchButNeverAlias) {
  const auto lse_message = [](const Problem& p) {
    return "lse strides {batch " + std::to_string(p.lse.batch) + ", head " +
           std::to_string(p.lse.head) +
           "} make lse overlap itself (rows of q_len 3 are contiguous)";
  };
  for (std::int64_t head : {2, 3, 4}) {
    Problem p = valid();
    p.lse.head = head;
    p.lse.batch = 4 * head;
    EXPECT_EQ(check(p), head < 3 ? lse_message(p) : "") << head;
  }
  for (std::int64_t batch : {11, 12, 13}) {
    Problem p = valid();
    p.lse.batch = batch;
    EXPECT_EQ(check(p), batch < 12 ? lse_message(p) : "") << batch;
  }
}

// The highest element offset of every tensor (and of lse) must have a byte offset that fits
// int64_t: kMaxElement is accepted, kMaxElement + 1 is not. valid()'s other extents reach
// `rest` elements beyond the batch stride, so batch stride kMaxElement - rest puts the last
// element exactly at the limit.
TEST(Boundary, HighestOffsetFitsInt64Bytes) {
  const struct {
    const char* name;
    Strides Problem::*tensor;
    std::int64_t len, heads;
  } tensors[] = {{"q", &Problem::q, 3, 4},
                 {"k", &Problem::k, 5, 2},
                 {"v", &Problem::v, 5, 2},
                 {"o", &Problem::o, 3, 4}};
  for (const auto& t : tensors) {
    const Problem base = valid();
    const Strides& s = base.*t.tensor;
    const std::int64_t rest = (t.len - 1) * s.seq + (t.heads - 1) * s.head + 8 - 1;
    for (std::int64_t over : {-1, 0, 1}) {
      Problem p = base;
      (p.*t.tensor).batch = kMaxElement - rest + over;  // batch extent 2: one batch stride
      const Strides& n = p.*t.tensor;
      if (over <= 0) {
        EXPECT_EQ(check(p), "") << t.name << " " << over;
      } else {
        EXPECT_EQ(check(p), "highest offset of " + std::string(t.name) +
                                " overflows int64_t bytes (strides {" + std::to_string(n.batch) +
                                ", " + std::to_string(n.seq) + ", " + std::to_string(n.head) + "})")
            << t.name;
      }
    }
  }
  // lse: batch extent 2, heads 4 of rows of 3: the last float is at batch + 3 head + 2.
  const Problem base = valid();
  for (std::int64_t over : {-1, 0, 1}) {
    Problem p = base;
    p.lse.batch = kMaxElement - (3 * p.lse.head + 2) + over;
    EXPECT_EQ(check(p), over <= 0 ? "" : "highest offset of lse overflows int64_t bytes") << over;
  }
  // A product that itself overflows int64_t, not only the sum.
  Problem p = valid();
  p.k.seq = kMax / 2 + 1;  // (5 - 1) * stride > kMax
  EXPECT_THAT(check(p), HasSubstr("highest offset of k overflows int64_t bytes"));
}

// check_call compares the byte ranges [first element, last element] of the tensors: an
// output that ends exactly where an input begins (or begins exactly where it ends) is
// legal; one element more of overlap is not.
TEST(Boundary, OutputsMayTouchInputsButNotOverlapThem) {
  const Problem p = valid();
  const std::int64_t nq = q_extent(p), nk = k_extent(p), nv = v_extent(p), no = o_extent(p),
                     nl = lse_extent(p);
  // One buffer: [o][q][lse][k][v] with o and lse placed relative to their neighbours.
  std::vector<float> buffer(static_cast<std::size_t>(4 * (nq + nk + nv + no + nl)), 1.0f);
  float* const o = buffer.data() + no;  // room for o to move left by one
  float* const q = o + no;              // q starts where o ends
  float* const lse = q + nq;            // lse starts where q ends
  float* const k = lse + nl;            // k starts where lse ends
  float* const v = k + nk + 2 * no;     // v far from everything
  EXPECT_EQ(check_call(p, q, k, v, o, lse), "");
  EXPECT_EQ(check_call(p, q, k, v, o + 1, lse),
            "o overlaps q: outputs must not share memory with inputs");
  EXPECT_EQ(check_call(p, q, k, v, o, lse - 1),
            "lse overlaps q: outputs must not share memory with inputs");
  EXPECT_EQ(check_call(p, q, k, v, o, lse + 1),
            "lse overlaps k: outputs must not share memory with inputs");
  // o directly after v, then one float into it; and lse directly after o, then one into it.
  float* const o_after_v = v + nv;
  EXPECT_EQ(check_call(p, q, k, v, o_after_v, nullptr), "");
  EXPECT_EQ(check_call(p, q, k, v, o_after_v - 1, nullptr),
            "o overlaps v: outputs must not share memory with inputs");
  EXPECT_EQ(check_call(p, q, k, v, o_after_v, o_after_v + no), "");
  EXPECT_EQ(check_call(p, q, k, v, o_after_v, o_after_v + no - 1),
            "lse overlaps o: outputs must not share memory");
}

}  // namespace
}  // namespace mha::test

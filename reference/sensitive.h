// Inputs on which a wrong answer shows at every length: the values the benchmark's check and
// the property suite's `sensitive` cases fill q, k and v with.
//
// With uniform random inputs every key carries about 1/n of a row's weight and the output
// shrinks as 1/sqrt(n), while the tolerance (tolerance.h) grows as n u: at n = 131072 a
// kernel that dropped half the keys, or returned zeros, would pass. Here each row attends
// to a few hundred keys at most, every KV tile holds keys some row attends to, and each row
// has one dominant key:
//
// * Classes: key j belongs to class c_j = j mod P, P = min(D, 128); k_j has a 1 in column c_j
//   (plus noise of at most 1/64 in every column). Row r's q is G / scale in one column a_r
//   and 0 elsewhere, so its logits are G (1 +- 1/64) for the keys of class a_r and within
//   G / 64 of 0 for the others: n / P big keys, the others e^-G (G = 16) as heavy. The rows'
//   classes are spread evenly over the P classes, so the union of their big keys has a key
//   in every run of P / rows keys.
// * A dominant key per row, whose logit is G + 4 (about 55 big keys' weight): the row's
//   last visible key, its middle one, its first, (n - 1) / 2, then random ones, in turn
//   over the rows.
// * v = 1 + u / 2, u uniform in [-1, 1]: outputs of order one, each key different.
//
// Every q . k has one nonzero product, so the logits are nearly exact and the tolerance's
// step 3 counts the big keys only: at n = 131072, D = 128 a row's bound is about 4e-4 while
// removing 1% of the keys moves some column by about 2e-3, and removing a row's dominant key
// moves it by about 0.03.
#pragma once

#include <mha/attention.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace mha::ref {

class SensitiveInputs {
 public:
  SensitiveInputs(const Problem& p, std::uint64_t seed);

  /// Row i of query head h (head_dim floats, to `out`), and key or value j of a KV head.
  void q_row(std::int64_t b, std::int64_t i, std::int64_t h, float* out) const;
  void k_row(std::int64_t b, std::int64_t j, std::int64_t kv_head, float* out) const;
  void v_row(std::int64_t b, std::int64_t j, std::int64_t kv_head, float* out) const;

  /// Row (b, h, i)'s class and dominant key (-1: the row sees no key).
  std::int64_t row_class(std::int64_t b, std::int64_t h, std::int64_t i) const;
  std::int64_t dominant(std::int64_t b, std::int64_t h, std::int64_t i) const;

  /// Writes every element of q, k and v through p's strides (k and v may be the same
  /// memory only if the caller accepts v's values in both).
  void fill(float* q, float* k, float* v) const;

  static constexpr double kGap = 16.0;       ///< G: big logits' height over the others
  static constexpr double kDominance = 4.0;  ///< the dominant key's logit over G

 private:
  // Noise in [-1, 1) for the columns of one row of tensor `tensor`.
  void noise(std::uint64_t tensor, std::int64_t b, std::int64_t j, std::int64_t h,
             float* out) const;

  Problem p_;
  std::uint64_t seed_;
  std::int64_t classes_;
  // (batch, kv head, key) of a dominant key -> the columns it is dominant in.
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, std::vector<std::int64_t>> boost_;
};

}  // namespace mha::ref

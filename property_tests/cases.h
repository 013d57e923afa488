// Generated test cases: the problem, how its inputs are laid out and filled, the generator
// and how a case prints when a property fails.
#pragma once

#include <mha/attention.h>
#include <rapidcheck.h>

#include <cstdint>
#include <ostream>
#include <vector>

namespace mha::test {

/// How the input values are drawn; each stresses the softmax differently.
enum class Values {
  uniform,       ///< q, k, v uniform in [-1, 1]
  large_logits,  ///< q, k scaled so logits reach up to about 1e4 in magnitude
  dominant_key,  ///< one key's logit exceeds all others' by about 50 in every row
  equal_keys,    ///< every key of a head equal: all logits of a row equal
  constant_v,    ///< v constant along the sequence (per head and column)
  sensitive,     ///< reference/sensitive.h: each row's output hangs on a few hundred keys
};

/// How q, k and v sit in memory.
enum class Storage {
  separate,        ///< three buffers
  fused_qkv,       ///< one token-major [B][L][(H + 2 Hkv) D + pad] buffer (needs Lq == Lk)
  shared_kv,       ///< k and v are the same memory
  broadcast_batch  ///< k and v have batch stride 0
};

/// One generated test case: a problem plus how its inputs are laid out and filled.
struct Case {
  Problem p;
  /// Each tensor's own layout and padding: K and V may differ (a head-major K cache beside
  /// a token-major V, padded rows in one of them).
  Layout q_layout = Layout::token_major, kv_layout = Layout::token_major,
         v_layout = Layout::token_major, o_layout = Layout::token_major;
  std::int64_t pad = 0;       ///< extra elements added to every outer stride of q, o and lse
  std::int64_t k_pad = 0;     ///< the same for k
  std::int64_t v_pad = 0;     ///< the same for v
  std::int64_t misalign = 0;  ///< floats added to every base pointer (0..15)
  Storage storage = Storage::separate;
  Values values = Values::uniform;
  double value_scale = 1.0;  ///< multiplies q and k for large_logits
  std::uint64_t seed = 0;    ///< for the values
  /// Attention sinks, one per query head (empty: none): make_inputs points p.sinks at a copy.
  std::vector<float> sinks;
  /// ALiBi slopes, one per query head (empty: none): make_inputs points p.alibi at a copy.
  std::vector<float> alibi;
  /// Per-sequence lengths (Problem::q_lens, kv_lens; empty: none): make_inputs points p at
  /// copies and fills the padding past each sequence's lengths with NaN.
  std::vector<std::int64_t> q_lens, kv_lens;
};

std::ostream& operator<<(std::ostream& os, const Case& c);
void showValue(const Case& c, std::ostream& os);

/// Limits for generated shapes.
struct Shape {
  std::int64_t max_batch = 3;
  std::int64_t max_heads = 16;
  std::int64_t max_len = 300;
  std::int64_t max_dim = 300;
  double max_work = 16777216.0;  ///< cap on B * H * Lq * Lk * D (2^24)
  bool long_cases = true;        ///< 1 in 16: Lq <= 3, Lk <= 131072, D <= 4096
};

/// Options for the case generator beyond shape.
struct CaseOptions {
  Shape shape;
  int causal = -1;             ///< -1 either, 0 off, 1 on
  bool q_longer = false;       ///< force q_len > kv_len (causal: leading rows see no key)
  bool grouped = false;        ///< force 1 <= kv_heads < q_heads
  bool any_storage = true;     ///< vary Storage; false keeps separate buffers
  bool any_values = true;      ///< vary Values; false keeps uniform
  bool any_scale = true;       ///< sometimes a non-default (possibly negative) scale
  bool equal_lengths = false;  ///< force q_len == kv_len (prefill)
  bool any_sinks = true;       ///< 1 in 4: attention sinks (Problem::sinks)
  bool any_ragged = false;     ///< 1 in 3: per-sequence lengths (Problem::q_lens, kv_lens)
  bool any_window = true;      ///< 1 in 4: a sliding window (Problem::window)
  bool any_softcap = true;     ///< 1 in 4: logit soft-capping (Problem::softcap)
  bool any_alibi = true;       ///< 1 in 4: ALiBi (Problem::alibi, alibi_offset)
  bool only_windows = false;   ///< every case a sliding window that cuts some row's keys
  bool only_softcaps = false;  ///< every case soft-capped (a finite cap)
  bool only_alibi = false;     ///< every case with ALiBi (slopes not all zero)
  /// Only long decodes: Lq <= 3, Lk from 16383 to 131072, the sensitive values (reference/
  /// sensitive.h), work up to shape.max_work / 4 and K up to 2^21 floats.
  bool long_decode = false;
};

rc::Gen<Case> gen_case(const CaseOptions& options = CaseOptions());

/// RapidCheck grows most generators' ranges with the test's size (small cases first).
/// Choices of kind (layout, value distribution, storage, a position to poison, ...) must
/// keep their stated odds at every size, so they are drawn at the nominal size.
template <typename T>
rc::Gen<T> unsized(rc::Gen<T> g) {
  return rc::gen::resize(rc::kNominalSize, std::move(g));
}

}  // namespace mha::test

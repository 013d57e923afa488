// Guarded buffers: tensors in arenas whose guard zones and padding hold one NaN pattern, the
// inputs of a case laid out as it says, dense copies of logical tensors, a call's outputs.
#pragma once

#include <mha/attention.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cases.h"

namespace mha::test {

/// Strides for a [batch][len][heads][dim] tensor in `layout` with `pad` added to each outer
/// stride.
Strides padded_strides(Layout layout, std::int64_t batch, std::int64_t len, std::int64_t heads,
                       std::int64_t dim, std::int64_t pad);

/// A float buffer surrounded by guard zones and filled with one NaN bit pattern, so that
/// any write outside the tensor's elements shows as a changed bit pattern and any read of
/// a non-element shows as NaN in the output.
class Guarded {
 public:
  static constexpr std::uint32_t kPattern = 0x7FC0DEADu;  // a quiet NaN with a payload
  static constexpr std::int64_t kGuard = 64;              // floats before and after

  Guarded() = default;
  Guarded(std::int64_t elements, std::int64_t misalign);
  float* data() { return storage_.data() + kGuard + misalign_; }
  const float* data() const { return storage_.data() + kGuard + misalign_; }
  std::int64_t size() const { return elements_; }
  /// Offsets (relative to data()) that are not elements of the tensor must still hold the
  /// pattern; returns a description of the first that does not, or "".
  std::string untouched_outside(const std::vector<bool>& is_element) const;
  std::vector<float> snapshot() const { return storage_; }
  bool same_as(const std::vector<float>& snap) const;

 private:
  std::vector<float> storage_;
  std::int64_t elements_ = 0, misalign_ = 0;
};

/// The inputs of a case, laid out and filled as the case says.
struct Inputs {
  Problem p;
  Guarded arena;
  float *q = nullptr, *k = nullptr, *v = nullptr;
  std::vector<float> before;  ///< snapshot of the arena, to prove inputs are not written
  std::vector<float> sinks;   ///< p.sinks points here when the case has sinks
  std::vector<float> alibi;   ///< p.alibi points here when the case has ALiBi
  std::vector<std::int64_t> q_lens, kv_lens;  ///< p.q_lens, p.kv_lens point here (ragged)
};
Inputs make_inputs(const Case& c);

/// A dense token-major copy of one logical tensor, [batch][len][heads][dim].
struct Dense {
  std::int64_t batch = 0, len = 0, heads = 0, dim = 0;
  std::vector<float> x;
  static Dense zeros(std::int64_t batch, std::int64_t len, std::int64_t heads, std::int64_t dim) {
    return {batch, len, heads, dim,
            std::vector<float>(static_cast<std::size_t>(batch * len * heads * dim), 0.0f)};
  }
  float& at(std::int64_t b, std::int64_t l, std::int64_t h, std::int64_t d) {
    return x[static_cast<std::size_t>(((b * len + l) * heads + h) * dim + d)];
  }
};
Dense gather(const float* t, const Strides& s, std::int64_t batch, std::int64_t len,
             std::int64_t heads, std::int64_t dim);

/// Inputs for `shape` (sizes, causal, scale) holding these dense tensors, token-major, in
/// separate guarded regions of one arena.
Inputs dense_inputs(const Problem& shape, const Dense& q, const Dense& k, const Dense& v,
                    std::int64_t misalign);

/// Writes (b, l, h, d) element values of one tensor.
template <typename F>
void for_each_element(std::int64_t batch, std::int64_t len, std::int64_t heads, std::int64_t dim,
                      F&& f) {
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t l = 0; l < len; ++l)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t d = 0; d < dim; ++d) f(b, l, h, d);
}

/// Outputs of one call, in guarded buffers.
struct Outputs {
  Guarded o, lse;
  float o_at(const Problem& p, std::int64_t b, std::int64_t h, std::int64_t i,
             std::int64_t d) const {
    return o.data()[b * p.o.batch + i * p.o.seq + h * p.o.head + d];
  }
  float lse_at(const Problem& p, std::int64_t b, std::int64_t h, std::int64_t i) const {
    return lse.data()[b * p.lse.batch + h * p.lse.head + i];
  }
};

}  // namespace mha::test

// mha/gemm.h: the contract of the packed SGEMM kernels that the attention layer's projections
// and W^O run on (kernels/gemm/), the packed layout of B, and the validation of a GEMM.
//
// C++17, header-only, no dependencies: one GEMM kernel file plus this header (and
// mha/support.h) compile anywhere.
//
// What every GEMM kernel computes, for i < m and j < n:
//
//   c[i][j] = (sum over l = 0, 1, ..., k - 1 of a[i][l] * b[l][j]) + bias[j]
//
// * Both operands are packed for the kernel's register tile, mr rows by nr columns of C
//   (GemmTile, the kernel's _tile()). A (m x k, rows of activations: tokens) is packed per
//   call (pack_a) into panels of mr rows, each k steps of mr contiguous floats: step l of
//   panel p holds a[p mr + r][l] at offset l mr + r, rows past m zero. B (k x n, a weight
//   matrix) is packed once (pack_b) into panels of nr columns, each k rows of nr contiguous
//   floats, columns past n zero. So the microkernel reads both operands in order, and
//   packing costs m k + k n moves for m n k multiply-adds. X W is A = X, B = W.
// * pack_a and pack_b read their matrix through any pair of strides, so the math convention
//   (B[k][n], W of X W) and PyTorch's Linear weight (W[n][k], whose transpose is B) both
//   pack directly.
// * Panels are whole: rows [p0 mr, m) of a packed A are the packed A of those rows, from
//   panel p0 on, and columns [p0 nr, n) of a packed B the packed B of those columns
//   (packed_panel). That is how the driver cuts C into tiles.
// * C is row-major with rows ldc apart.
// * The sum over l runs in increasing l, one accumulator per element; bias (optional, n
//   floats) is added after the last product. Kernels with hardware FMA fuse every
//   multiply-add; kernels without it (the portable one on baseline x86-64) multiply and
//   add. So an element's value depends only on row i of A, column j of B and bias[j]:
//   never on m, on how rows or columns are cut, on cache sizes or on the thread count, and
//   all FMA kernels give the same bits. The layer's prefill of n tokens and n decode steps
//   project every token identically, bit for bit.
// * Error: |c - exact| <= gamma(k + 1) (sum_l |a[i][l] b[l][j]| + |bias[j]|), gamma(n) =
//   n u / (1 - n u), u = 2^-24 (Higham, Accuracy and Stability, section 3.1; an FMA
//   chain has one rounding per step, a multiply and add two, both within that bound).
// * Arithmetic is fp32. No pointer needs any alignment.
// * Every GEMM kernel runs under mha::FpEnvGuard (mha/attention.h, which mha/support.h
//   includes): the default floating-point environment, whatever the caller's, which is given
//   back on return. Packing only copies, so no environment changes a packed bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

namespace mha {

/// One GEMM: C (m x n, rows ldc apart) = A (m x k, packed) B (k x n, packed).
struct GemmProblem {
  std::int64_t m = 1;
  std::int64_t n = 1;
  std::int64_t k = 1;
  std::int64_t ldc = 1;  ///< elements between rows of C, >= n
};

/// A kernel's register tile: C is computed mr rows by nr columns at a time, and A and B are
/// packed in panels of mr rows and nr columns.
struct GemmTile {
  std::int64_t mr = 1;
  std::int64_t nr = 1;
};

/// A GEMM kernel: C = A B (+ bias, when bias is not null), A and B packed for its tile with
/// p.k steps, at least p.m rows and p.n columns. Assumes check_gemm(p) is empty, a, b and c
/// non-null, and c disjoint from a, b and bias. Never validates, never throws, needs no
/// workspace, keeps no state.
using GemmKernel = void (*)(const GemmProblem& p, const float* a, const float* b, const float* bias,
                            float* c);
/// A kernel's register tile.
using GemmTileOf = GemmTile (*)();

/// Floats of `rows` x k packed in panels of `width` rows (or columns): ceil(rows / width)
/// width k. Saturates at INT64_MAX, which check_gemm reports.
inline std::int64_t packed_floats(std::int64_t rows, std::int64_t k, std::int64_t width) {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  if (k <= 0 || rows <= 0 || width <= 0) return 0;
  const std::int64_t panels = (rows + width - 1) / width;
  if (panels > max / width || panels * width > max / k) return max;
  return panels * width * k;
}

/// The first float of panel `panel` of a matrix with k steps packed in panels of `width`.
inline const float* packed_panel(const float* packed, std::int64_t k, std::int64_t width,
                                 std::int64_t panel) {
  return packed + panel * width * k;
}

namespace detail {
// Panels of `width` lines (rows of A, columns of B) over k steps: line i, step l of the
// matrix at m[i * line_stride + l * step_stride] goes to packed[(i / width) width k + l
// width + i % width]; lines past `lines` are zero. Each panel is written in order, step by
// step, from its `width` lines read side by side: sequential stores, and as many read
// streams as lines. W > 0 is the width as a constant (the loop over lines unrolled), 0 a
// width given at run time.
template <int W>
void pack_panels_of(std::int64_t lines, std::int64_t k, const float* m, std::int64_t line_stride,
                    std::int64_t step_stride, std::int64_t width, float* packed) {
  if (W > 0) width = W;
  for (std::int64_t i0 = 0; i0 < lines; i0 += width) {
    const std::int64_t n = lines - i0 < width ? lines - i0 : width;
    float* panel = packed + i0 * k;
    const float* first = m + i0 * line_stride;
    for (std::int64_t l = 0; l < k; ++l) {
      const float* step = first + l * step_stride;
      float* out = panel + l * width;
      if (n == width) {
        for (std::int64_t i = 0; i < width; ++i) out[i] = step[i * line_stride];
      } else {
        for (std::int64_t i = 0; i < width; ++i) out[i] = i < n ? step[i * line_stride] : 0.0f;
      }
    }
  }
}

// pack_panels_of<W> for the width when it is one of Ws (the register tiles' sides in
// kernels/gemm/), else pack_panels_of<0>.
template <int... Ws>
void pack_panels_among(std::integer_sequence<int, Ws...>, std::int64_t lines, std::int64_t k,
                       const float* m, std::int64_t line_stride, std::int64_t step_stride,
                       std::int64_t width, float* packed) {
  const auto as = [&](auto w) {
    pack_panels_of<decltype(w)::value>(lines, k, m, line_stride, step_stride, width, packed);
    return true;
  };
  if (!((width == Ws && as(std::integral_constant<int, Ws>{})) || ...)) {
    as(std::integral_constant<int, 0>{});
  }
}

inline void pack_panels(std::int64_t lines, std::int64_t k, const float* m,
                        std::int64_t line_stride, std::int64_t step_stride, std::int64_t width,
                        float* packed) {
  pack_panels_among(std::integer_sequence<int, 4, 6, 8, 12, 16, 32>{}, lines, k, m, line_stride,
                    step_stride, width, packed);
}
}  // namespace detail

/// Packs A (m x k; element (i, l) at a[i * row_stride + l * col_stride]) into panels of mr
/// rows: packed_floats(m, k, mr) floats at `packed`.
inline void pack_a(std::int64_t m, std::int64_t k, const float* a, std::int64_t row_stride,
                   std::int64_t col_stride, std::int64_t mr, float* packed) {
  detail::pack_panels(m, k, a, row_stride, col_stride, mr, packed);
}

/// Packs B (k x n; element (l, j) at b[l * row_stride + j * col_stride]) into panels of nr
/// columns: packed_floats(n, k, nr) floats at `packed`. Plain B: {ldb, 1}; B given as its
/// transpose (a PyTorch Linear weight [n][k]): {1, ldk}.
inline void pack_b(std::int64_t k, std::int64_t n, const float* b, std::int64_t row_stride,
                   std::int64_t col_stride, std::int64_t nr, float* packed) {
  detail::pack_panels(n, k, b, col_stride, row_stride, nr, packed);
}

/// Why p is not a valid GEMM, or an empty string: sizes >= 1, ldc >= n, and C's highest
/// element offset and the packed sizes of A and B (for panels up to 64 wide) fit int64_t.
inline std::string check_gemm(const GemmProblem& p) {
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  const struct {
    const char* name;
    std::int64_t value;
  } sizes[] = {{"m", p.m}, {"n", p.n}, {"k", p.k}};
  for (const auto& s : sizes) {
    if (s.value < 1) {
      return std::string("gemm: ") + s.name + " must be positive, got " + std::to_string(s.value);
    }
  }
  if (p.ldc < p.n) {
    return "gemm: ldc must be >= n (" + std::to_string(p.n) + "), got " + std::to_string(p.ldc);
  }
  if (p.m - 1 > 0 && p.ldc > (max - p.n) / (p.m - 1)) {
    return "gemm: c's highest element offset overflows int64";
  }
  if (packed_floats(p.m, p.k, 64) == max || packed_floats(p.n, p.k, 64) == max) {
    return "gemm: a packed operand's size overflows int64";
  }
  return {};
}

/// Elements from c's first to its last element, plus one.
inline std::int64_t c_extent(const GemmProblem& p) { return (p.m - 1) * p.ldc + p.n; }

}  // namespace mha

// Baselines: attention composed from library sgemm calls and a vectorized softmax, the way a
// user without a fused kernel would write it. Per (batch, query head): S = scale * Q K^T by
// sgemm, an in-place softmax over each row's visible keys (masked keys set to 0; on as many
// threads as the sgemm calls), then O = P V by sgemm, in blocks of query rows; a causal
// block's products stop at the last key its last row sees. Scratch: one block of scores
// (about 1 MiB).
#pragma once

#include <mha/attention.h>

#include <cstdint>
#include <vector>

namespace mha::bench {

/// Row-major C[M][N] = alpha * A[M][K] * op(B), op(B) = B^T with B [N][K] when trans_b,
/// else B [K][N]; beta = 0.
using Sgemm = void (*)(bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                       const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                       std::int64_t ldc);

/// The libraries' sgemm as an Sgemm, and the call that sets their thread count (OpenBLAS's
/// own; oneDNN's is OpenMP's). Defined when the library was found (MHA_HAVE_OPENBLAS,
/// MHA_HAVE_ONEDNN).
void openblas_sgemm(bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                    const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                    std::int64_t ldc);
void openblas_threads(int threads);
void onednn_sgemm(bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                  const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                  std::int64_t ldc);
void onednn_threads(int threads);

class Composed {
 public:
  explicit Composed(Sgemm gemm) : gemm_(gemm) {}
  /// The kernel contract of mha/attention.h, for dense-enough layouts (every seq stride
  /// at least head_dim, as BLAS needs).
  void run(const Problem& p, const float* q, const float* k, const float* v, float* o, float* lse,
           int threads);

 private:
  Sgemm gemm_;
  std::vector<float> scores_;
};

/// The softmax's exp: declared error bound in ulp (measured exhaustively over [-104, 0] by
/// the test composed_exp_test) and the function itself, exposed for that test.
constexpr double kComposedExpUlp = 2.0;
float composed_exp(float x);

/// In-place softmax of row[0, n) (row[n, len) set to 0); returns lse = max + log(sum).
float softmax_row(float* row, std::int64_t n, std::int64_t len);

}  // namespace mha::bench

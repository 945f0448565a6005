// The kernels' float32 GEMMs: row-major blocks through PyTorch's cpublas::brgemm, which
// runs oneDNN's JIT micro-kernels where the CPU has them and PyTorch's BLAS otherwise
// (and BLAS directly under a PyTorch whose headers do not export it).
//
// brgemm takes one form, C (m × n) = A (m × k) · B (k × n) (+ C), so a product with a
// transposed factor reads a transposed copy the caller makes once per block (K and V
// transposed for Q·Kᵀ and dO·Vᵀ; the backward keeps Qᵀ and dOᵀ per tile and sums dKᵀ,
// dVᵀ). oneDNN compiles a kernel per shape the first time a thread asks for it (30-470
// µs measured for attention's blocks), so callers round a block's keys up to whole tiles
// (`tile_keys`): a decoding loop whose cache grows by one key a step meets a handful of
// shapes, not one per step.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>

#ifndef CPUBLAS_BRGEMM_F32F32F32
// A PyTorch whose headers do not say they export float32 brgemm (before 2.9): the BLAS
// PyTorch links (MKL or OpenBLAS), whose column-major sgemm_ computes Cᵀ = Bᵀ·Aᵀ.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
#endif

namespace attnkit_native {

constexpr int64_t kKeyTile = 16;  // a product's keys are a multiple of this

// n keys rounded up to whole tiles of kKeyTile.
inline int64_t tile_keys(int64_t n) { return (n + kKeyTile - 1) / kKeyTile * kKeyTile; }

// Row-major C (m × n) = A (m × k) · B (k × n), or C += A · B where `add`; an empty k
// gives C = 0 (or leaves C) without a kernel.
inline void gemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool add) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    if (!add)
      for (int64_t r = 0; r < m; ++r) std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
    return;
  }
#ifdef CPUBLAS_BRGEMM_F32F32F32
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add, a, b, c, /*is_vnni=*/false);
#else
  const char t = 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const float one = 1.0f, beta = add ? 1.0f : 0.0f;
  sgemm_(&t, &t, &M, &N, &K, &one, b, &la, a, &lb, &beta, c, &lc);
#endif
}

// Fewer query rows than this (a decoding step's) multiply in place: packing K transposed
// for brgemm would read and write the block once more than the product itself does.
constexpr int64_t kFewRows = 4;

// Row-major C (m × n) = A (m × k) · Bᵀ, B (n × k) read in place, m < kFewRows: each row
// of B loaded once for every row of A (dot products over k in vectors).
inline void gemm_nt_few(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                        const float* b, int64_t ldb, float* c, int64_t ldc) {
  using V = at::vec::Vectorized<float>;
  constexpr int64_t W = V::size();
  for (int64_t j = 0; j < n; ++j) {
    const float* bj = b + j * ldb;
    V acc[kFewRows];
    for (int64_t i = 0; i < m; ++i) acc[i] = V(0.0f);
    for (int64_t d = 0; d < k; d += W) {
      const int64_t count = std::min(W, k - d);
      const V y = V::loadu(bj + d, count);
      for (int64_t i = 0; i < m; ++i)
        acc[i] = at::vec::fmadd(V::loadu(a + i * lda + d, count), y, acc[i]);
    }
    for (int64_t i = 0; i < m; ++i)
      c[i * ldc + j] = at::vec::vec_reduce_all<float>([](V x, V y) { return x + y; }, acc[i]);
  }
}

// Row-major C (m × n) += A (m × k) · B (k × n), m < kFewRows: each row of B loaded once,
// added to every row of C at its weight.
inline void gemm_nn_add_few(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                            const float* b, int64_t ldb, float* c, int64_t ldc) {
  using V = at::vec::Vectorized<float>;
  constexpr int64_t W = V::size();
  for (int64_t j = 0; j < k; ++j) {
    const float* bj = b + j * ldb;
    for (int64_t d = 0; d < n; d += W) {
      const int64_t count = std::min(W, n - d);
      const V y = V::loadu(bj + d, count);
      for (int64_t i = 0; i < m; ++i) {
        float* ci = c + i * ldc + d;
        at::vec::fmadd(V(a[i * lda + j]), y, V::loadu(ci, count)).store(ci, count);
      }
    }
  }
}

// kt (D × ldt) = the first n rows of k (n × D, row stride ldk), transposed, columns
// [n, ldt) zero: a tile's vector loads may run past the block's last key.
inline void pack_transposed(const float* k, int64_t n, int64_t D, int64_t ldk, float* kt,
                            int64_t ldt) {
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * ldt + n, kt + (d + 1) * ldt, 0.0f);
  constexpr int64_t J = 64;  // rows of k at a time: their lines stay in L1 while d runs
  for (int64_t j0 = 0; j0 < n; j0 += J) {
    const int64_t j1 = std::min(n, j0 + J);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = j0; j < j1; ++j) kt[d * ldt + j] = k[j * ldk + d];
  }
}

// dst (cols × rows) = src (rows × cols, packed) transposed.
inline void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// Rows [0, n) of a (rows, cols) block with row stride ld followed by zero rows up to
// `keys`, in buf (keys × cols): a product over whole tiles of keys reads no key past n.
inline const float* padded_rows(const float* x, int64_t n, int64_t keys, int64_t cols, int64_t ld,
                                float* buf) {
  for (int64_t r = 0; r < n; ++r) std::copy(x + r * ld, x + r * ld + cols, buf + r * cols);
  std::fill(buf + n * cols, buf + keys * cols, 0.0f);
  return buf;
}

}  // namespace attnkit_native

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

// The BLAS PyTorch links (MKL or OpenBLAS): a decoding step's few rows multiply through
// it (PyTorch exports no float32 cpublas::gemm), and every product under a PyTorch whose
// headers do not say they export float32 brgemm (before 2.9).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

namespace attnkit_native {

constexpr int64_t kKeyTile = 16;  // a product's keys are a multiple of this

// n keys rounded up to whole tiles of kKeyTile.
inline int64_t tile_keys(int64_t n) { return (n + kKeyTile - 1) / kKeyTile * kKeyTile; }

// Row-major C (m × n) = A (m × k) · B (k × n), or · Bᵀ where `b_transposed` (B then
// n × k), by the BLAS: column-major, as sgemm_ reads memory, Cᵀ = Bᵀ · Aᵀ (or B · Aᵀ),
// each factor read where it lies; C += where `add`. m, n and k > 0.
inline void blas_gemm(bool b_transposed, int64_t m, int64_t n, int64_t k, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  const char ta = 'N', tb = b_transposed ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const float one = 1.0f, beta = add ? 1.0f : 0.0f;
  sgemm_(&tb, &ta, &M, &N, &K, &one, b, &la, a, &lb, &beta, c, &lc);
}

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
  blas_gemm(false, m, n, k, a, lda, b, ldb, c, ldc, add);
#endif
}

// At most this many stacked query rows (a decoding step's: one query of a GQA group of
// up to 8 heads) multiply K and V where they lie, through the BLAS: packing K transposed
// for brgemm reads and writes the block once more than so few rows' product does, and
// vector dot products per key are slower still (`benchmarks/native.py`'s decoding grid).
constexpr int64_t kFewRows = 8;

// Whether a call of L queries of G heads per K/V head is a decoding step's few rows, which
// the forward scores through the BLAS (only such a call: a longer call's last short tile
// takes brgemm like the rest, so the backward knows which rows to normalise anew).
inline bool few_rows(int64_t G, int64_t L) { return G * L <= kFewRows; }

// Row-major C (m × n) = A (m × k) · Bᵀ, B (n × k) read in place (an empty k: C = 0).
inline void gemm_nt_few(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                        const float* b, int64_t ldb, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    for (int64_t r = 0; r < m; ++r) std::fill(c + r * ldc, c + r * ldc + n, 0.0f);
    return;
  }
  blas_gemm(true, m, n, k, a, lda, b, ldb, c, ldc, false);
}

// Row-major C (m × n) += A (m × k) · B (k × n), B read in place.
inline void gemm_nn_add_few(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                            const float* b, int64_t ldb, float* c, int64_t ldc) {
  if (m > 0 && n > 0 && k > 0) blas_gemm(false, m, n, k, a, lda, b, ldb, c, ldc, true);
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

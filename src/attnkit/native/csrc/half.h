// Half-precision products on AVX512-BF16's dot-product unit, for bfloat16 inputs.
//
// The math is micro.h's (S = Q·Kᵀ on a tile of MR rows × NR keys, O += P·V on MR rows ×
// NR output columns) with the products in bfloat16 and the sums in float32: `vdpbf16ps`
// adds to each of 16 float32 lanes the dot product of one pair of bfloat16 values from
// each operand, c + x₀·y₀ + x₁·y₁, twice an fp32 FMA's multiply-adds on half its bytes.
//
// The blocking: the pair is the unit, one 32-bit lane (the first value in the low half).
// A query row is its own pairs along D (copied as they are, unscaled: the scale, softcap
// and ALiBi apply to the float32 scores, as in the float32 kernel); a key block is packed
// once as pairs along D, 16 keys a vector (kp: D/2 × keys, micro.h's transposed layout);
// a value block as pairs of consecutive keys, 16 columns a vector (vp: keys/2 × Dv). The
// weights P, computed in float32, are rounded to bfloat16 for P·V (as SDPA's bfloat16
// kernel and the naive computation round them) and read as pairs of consecutive keys.
// The backward's products over query rows (dV += Pᵀ·dO, dK += dSᵀ·Q) pair consecutive
// rows instead: two rows of P or dS interleaved (`interleave_rows`), two rows of dO or Q
// (`pack_value_pairs`). An odd D, key or row count is padded with a zero half. Without
// the unit (or PyTorch's 16-lane vectors) `kPairDots` is false and bfloat16 blocks are
// converted to float32.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <cstring>

#include "common.h"
#include "micro.h"

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#define ATTNKIT_PAIR_DOTS 1
#include <immintrin.h>
#endif

namespace attnkit_native {

using Pair = uint32_t;

// The fewest stacked rows whose products take AMX's tiles (brgemm) where asked: a tile
// holds 16 rows, and fewer stay on the pair dots.
constexpr int64_t kTileRows = 16;

// brgemm's AMX state on a thread that used it, released when the thread's scratch goes
// (as PyTorch's own kernels release it after their loops).
struct TileState {
  bool used = false;
  TileState() = default;
  TileState(const TileState&) = delete;
  TileState& operator=(const TileState&) = delete;
  ~TileState() {
    if (used) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  }
};

inline int64_t pair_count(int64_t n) { return (n + 1) / 2; }

#ifdef ATTNKIT_PAIR_DOTS
constexpr bool kPairDots = true;
constexpr int64_t kLanes = 16;  // float32 lanes of a vector: 16 pairs

inline Pair pair_at(const at::BFloat16* p) {
  Pair x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline Pair pair_of(const at::BFloat16* first, const at::BFloat16* second) {
  return Pair{first->x} | (second ? Pair{second->x} << 16 : Pair{0});
}

inline __mmask16 lanes_mask(int64_t n) {
  return static_cast<__mmask16>(n >= kLanes ? 0xFFFF : (1u << n) - 1);
}

// qp[d2] = (q[2·d2], q[2·d2 + 1]) of one row of D values.
inline void pack_row_pairs(const at::BFloat16* q, int64_t D, Pair* qp) {
  for (int64_t d2 = 0; d2 < D / 2; ++d2) qp[d2] = pair_at(q + 2 * d2);
  if (D % 2) qp[D / 2] = pair_of(q + D - 1, nullptr);
}

// kp[d2 · ldt + j] = (k[j, 2·d2], k[j, 2·d2 + 1]) for the first n rows of k (row stride
// ldk), keys [n, ldt) zero: a tile's vector loads may run past the block's last key.
inline void pack_key_pairs(const at::BFloat16* k, int64_t n, int64_t D, int64_t ldk, Pair* kp,
                           int64_t ldt) {
  const int64_t D2 = pair_count(D);
  for (int64_t d2 = 0; d2 < D2; ++d2) std::fill(kp + d2 * ldt + n, kp + (d2 + 1) * ldt, Pair{0});
  constexpr int64_t J = 64;  // rows of k at a time: their lines stay in L1 while d2 runs
  for (int64_t j0 = 0; j0 < n; j0 += J) {
    const int64_t j1 = std::min(n, j0 + J);
    for (int64_t d2 = 0; d2 < D / 2; ++d2)
      for (int64_t j = j0; j < j1; ++j) kp[d2 * ldt + j] = pair_at(k + j * ldk + 2 * d2);
    if (D % 2)
      for (int64_t j = j0; j < j1; ++j)
        kp[(D2 - 1) * ldt + j] = pair_of(k + j * ldk + D - 1, nullptr);
  }
}

// vp[j2 · Dv + c] = (v[2·j2, c], v[2·j2 + 1, c]) for the first n rows of v (row stride
// ldv), a missing last key zero: two rows zero-extended to 32 bits, the second shifted up.
inline void pack_value_pairs(const at::BFloat16* v, int64_t n, int64_t Dv, int64_t ldv, Pair* vp) {
  for (int64_t j = 0; j < n; j += 2) {
    const at::BFloat16* first = v + j * ldv;
    const at::BFloat16* second = j + 1 < n ? first + ldv : nullptr;
    Pair* dst = vp + j / 2 * Dv;
    int64_t c = 0;
    for (; c + kLanes <= Dv; c += kLanes) {
      const __m512i lo =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + c)));
      const __m512i hi = second ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(second + c)))
                                : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; c < Dv; ++c) dst[c] = pair_of(first + c, second ? second + c : nullptr);
  }
}

// yp[c · m2 + r2] = (y[2·r2, c], y[2·r2 + 1, c]) for the m rows of y (row stride ldy) and
// `cols` columns, m2 = pair_count(m), a missing last row zero: pairs of consecutive rows,
// one row of pairs per column (the rows' side of a product over rows on AMX's tiles).
inline void transpose_row_pairs(const at::BFloat16* y, int64_t m, int64_t cols, int64_t ldy,
                                Pair* yp) {
  const int64_t m2 = pair_count(m);
  for (int64_t r2 = 0; r2 < m2; ++r2) {
    const at::BFloat16* first = y + 2 * r2 * ldy;
    const at::BFloat16* second = 2 * r2 + 1 < m ? first + ldy : nullptr;
    for (int64_t c = 0; c < cols; ++c)
      yp[c * m2 + r2] = pair_of(first + c, second ? second + c : nullptr);
  }
}

// Whether every value of a (rows, cols) bfloat16 slab is finite: an exponent of all ones
// is an infinity or a NaN.
inline bool all_finite_half(const at::BFloat16* x, int64_t rows, int64_t cols, int64_t ld) {
  constexpr uint16_t kExp = 0x7F80;
  const __m512i e = _mm512_set1_epi16(static_cast<short>(kExp));
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* row = x + r * ld;
    int64_t c = 0;
    for (; c + 2 * kLanes <= cols; c += 2 * kLanes) {
      const __m512i h = _mm512_loadu_si512(row + c);
      if (_mm512_cmpeq_epi16_mask(_mm512_and_si512(h, e), e)) return false;
    }
    for (; c < cols; ++c)
      if ((row[c].x & kExp) == kExp) return false;
  }
  return true;
}

// Two float32 vectors (16 lanes each) times a, rounded to bfloat16 and interleaved: lane
// i holds (x[i], y[i]).
inline __m512i widened(__m512 x) {  // 16 float32 lanes rounded to bfloat16, zero-extended
  const __m256bh h = _mm512_cvtneps_pbh(x);
  return _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h));
}

inline __m512i pairs_of(__m512 x, __m512 y, __m512 a) {
  const __m512i lo = widened(_mm512_mul_ps(x, a)), hi = widened(_mm512_mul_ps(y, a));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

inline Pair pair_rounded(float x, float y) {
  return Pair{at::BFloat16(x).x} | Pair{at::BFloat16(y).x} << 16;
}

// pp[j / 2] = (p[j], p[j + 1]) rounded to bfloat16 (to nearest even) for keys [pa, pe), pa
// and pe even: a row of weights as pairs of consecutive keys.
inline void weights_pairs(const float* p, int64_t pa, int64_t pe, Pair* pp) {
  int64_t j = pa;
  for (; j + 2 * kLanes <= pe; j += 2 * kLanes) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + kLanes), _mm512_loadu_ps(p + j));
    _mm512_storeu_si512(pp + j / 2, reinterpret_cast<const __m512i&>(h));
  }
  for (; j < pe; j += 2) pp[j / 2] = pair_rounded(p[j], p[j + 1]);
}

// pp[r2 · n + j] = (a·x[2·r2, j], a·x[2·r2 + 1, j]) rounded to bfloat16, for the m rows of
// x (row stride ldx) and n columns, a missing last row zero: pairs of consecutive rows.
inline void interleave_rows(const float* x, int64_t m, int64_t n, int64_t ldx, float a, Pair* pp) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t r = 0; r < m; r += 2) {
    const float* first = x + r * ldx;
    const float* second = r + 1 < m ? first + ldx : nullptr;
    Pair* dst = pp + r / 2 * n;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      _mm512_storeu_si512(dst + j,
                          pairs_of(_mm512_loadu_ps(first + j),
                                   second ? _mm512_loadu_ps(second + j) : _mm512_setzero_ps(), va));
    for (; j < n; ++j) dst[j] = pair_rounded(a * first[j], second ? a * second[j] : 0.0f);
  }
}

inline __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// s[r, c0 .. c1) = q[r] · k[c] for MR_ rows of query pairs (qp: row stride D2) and the
// packed keys kp, c1 - c0 a multiple of 2 × 16 within ldt.
template <int MR_>
void pair_scores_tile(const Pair* qp, int64_t D2, const Pair* kp, int64_t ldt, int64_t c0,
                      int64_t c1, float* s, int64_t lds) {
  for (int64_t c = c0; c < c1; c += 2 * kLanes) {
    __m512 acc[MR_][2];
    for (int r = 0; r < MR_; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      const __m512bh b0 = as_pairs(_mm512_loadu_si512(kp + d2 * ldt + c));
      const __m512bh b1 = as_pairs(_mm512_loadu_si512(kp + d2 * ldt + c + kLanes));
#pragma GCC unroll 6
      for (int r = 0; r < MR_; ++r) {
        const __m512bh a = as_pairs(_mm512_set1_epi32(static_cast<int>(qp[r * D2 + d2])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
    for (int r = 0; r < MR_; ++r) {
      _mm512_storeu_ps(s + r * lds + c, acc[r][0]);
      _mm512_storeu_ps(s + r * lds + c + kLanes, acc[r][1]);
    }
  }
}

// c[r, :n] += Σ_{j2a <= j2 < j2e} A(r, j2) · b[j2, :n] for MR_ rows, the contraction in
// pairs: A(r, j2) = a[r · ars + j2 · aps] (a row of weights: ars its row stride, aps 1; two
// interleaved rows: ars 1, aps their length), b packed pairs (row stride n), c row stride
// ldc.
template <int MR_>
void pair_products_tile(const Pair* a, int64_t ars, int64_t aps, int64_t j2a, int64_t j2e,
                        const Pair* b, int64_t n, float* c, int64_t ldc) {
  for (int64_t col = 0; col < n; col += 2 * kLanes) {
    const __mmask16 m0 = lanes_mask(n - col),
                    m1 = lanes_mask(std::max<int64_t>(n - col - kLanes, 0));
    __m512 acc[MR_][2];
    for (int r = 0; r < MR_; ++r) {
      acc[r][0] = _mm512_maskz_loadu_ps(m0, c + r * ldc + col);
      acc[r][1] = _mm512_maskz_loadu_ps(m1, c + r * ldc + col + kLanes);
    }
    for (int64_t j2 = j2a; j2 < j2e; ++j2) {
      const Pair* bj = b + j2 * n + col;
      const __m512bh b0 = as_pairs(_mm512_maskz_loadu_epi32(m0, bj));
      const __m512bh b1 = as_pairs(_mm512_maskz_loadu_epi32(m1, bj + kLanes));
#pragma GCC unroll 6
      for (int r = 0; r < MR_; ++r) {
        const __m512bh w = as_pairs(_mm512_set1_epi32(static_cast<int>(a[r * ars + j2 * aps])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w, b1);
      }
    }
    for (int r = 0; r < MR_; ++r) {
      _mm512_mask_storeu_ps(c + r * ldc + col, m0, acc[r][0]);
      _mm512_mask_storeu_ps(c + r * ldc + col + kLanes, m1, acc[r][1]);
    }
  }
}

template <int MR_>
struct PairScores {
  static void run(const Pair* qp, int64_t D2, const Pair* kp, int64_t ldt, int64_t c0, int64_t c1,
                  float* s, int64_t lds) {
    pair_scores_tile<MR_>(qp, D2, kp, ldt, c0, c1, s, lds);
  }
};

template <int MR_>
struct PairProducts {
  static void run(const Pair* a, int64_t ars, int64_t aps, int64_t j2a, int64_t j2e, const Pair* b,
                  int64_t n, float* c, int64_t ldc) {
    pair_products_tile<MR_>(a, ars, aps, j2a, j2e, b, n, c, ldc);
  }
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C (m × n, row stride ldc >= n rounded up to 32) = A·Bᵀ: A's rows as pairs along the
// contraction (ap: row stride k2), B packed by pack_key_pairs (bp: k2 × ldt).
inline void pair_gemm_nt(int64_t m, int64_t n, int64_t k2, const Pair* ap, const Pair* bp,
                         int64_t ldt, float* c, int64_t ldc) {
  const int64_t c1 = round_up(n, 2 * kLanes);
  for (int64_t r0 = 0; r0 < m; r0 += kMicroRows)
    by_rows<PairScores>(std::min(kMicroRows, m - r0), ap + r0 * k2, k2, bp, ldt, 0, c1,
                        c + r0 * ldc, ldc);
}

// C (m × n, row stride ldc) += A·B over k2 pairs of the contraction: A as in
// pair_products_tile (row r at a + r · ars), B packed pairs (row stride n).
inline void pair_gemm_add(int64_t m, int64_t n, int64_t k2, const Pair* a, int64_t ars, int64_t aps,
                          const Pair* b, float* c, int64_t ldc) {
  for (int64_t r0 = 0; r0 < m; r0 += kMicroRows)
    by_rows<PairProducts>(std::min(kMicroRows, m - r0), a + r0 * ars, ars, aps, int64_t{0}, k2, b,
                          n, c + r0 * ldc, ldc);
}

// The same two products on AMX's tiles, through PyTorch's cpublas::brgemm: its bfloat16
// "VNNI" layout of B (K × N as [K/2][N][2]) is exactly the packed pairs above (keys:
// pairs along D × keys; values: pairs of keys × columns), and a row of pairs is a row
// of bfloat16 values, so A needs no packing. Where the CPU has no tiles
// (`cpublas::could_pack` false) brgemm refuses this layout: callers ask the CPU first.

inline const at::BFloat16* halves(const Pair* p) {
  return reinterpret_cast<const at::BFloat16*>(p);
}

// C (m × ldt) = A·Bᵀ as pair_gemm_nt, over all ldt packed keys of B (zero past its last).
inline void tile_gemm_nt(int64_t m, int64_t k2, const Pair* ap, const Pair* bp, int64_t ldt,
                         float* c, int64_t ldc, TileState& tiles) {
  tiles.used = true;
  at::native::cpublas::brgemm(m, ldt, 2 * k2, 2 * k2, ldt, ldc, false, halves(ap), halves(bp), c,
                              /*is_vnni=*/true);
}

// C (m × n) += A·B over k2 pairs as pair_gemm_add, A's rows as pairs (row stride lda).
inline void tile_gemm_add(int64_t m, int64_t n, int64_t k2, const Pair* a, int64_t lda,
                          const Pair* b, float* c, int64_t ldc, TileState& tiles) {
  tiles.used = true;
  at::native::cpublas::brgemm(m, n, 2 * k2, 2 * lda, n, ldc, true, halves(a), halves(b), c,
                              /*is_vnni=*/true);
}

#else
constexpr bool kPairDots = false;
#endif

}  // namespace attnkit_native

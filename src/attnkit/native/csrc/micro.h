// Register-blocked micro-kernels for the cut edges of a tile: a few stacked query rows
// against the keys their intervals cover, with no BLAS call and no key outside them.
//
// The math is the GEMM's: S = Q·Kᵀ on a tile of MR rows × NR keys, and O += P·V on MR
// rows × NR output columns. The blocking: MR × NR accumulators stay in vector registers
// for the whole dot product (AVX2: 6 rows × 2 vectors of 8 = 12 of 16 registers; AVX512
// the same with vectors of 16), one broadcast of a query value or weight feeds 2 FMAs, and
// K comes transposed (D × keys, packed once per key block) so a key run is one vector
// load. A BLAS call on 32 rows of a 256-key band spends most of its time outside its
// inner kernel; these tiles follow each 6-row group's own hull instead. A decoding step
// has no keys to pack: dots_tile reads each key row in place for up to MR query heads
// and sums each dot product's lanes, and values_tile reads value rows in place too.
#pragma once

#include "blas.h"
#include "common.h"

namespace attnkit_native {

constexpr int64_t kMicroRows = 6;                // MR
constexpr int64_t kMicroCols = 2 * Vec::size();  // NR

// s[r, c0 .. c1) = q[r] · kt[:, c] for MR_ rows, c1 - c0 a multiple of NR within ldt.
template <int MR_>
void scores_tile(const float* q, int64_t D, const float* kt, int64_t ldt, int64_t c0, int64_t c1,
                 float* s, int64_t lds) {
  for (int64_t c = c0; c < c1; c += kMicroCols) {
    Vec acc[MR_][2];
    for (int r = 0; r < MR_; ++r) acc[r][0] = acc[r][1] = Vec(0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec b0 = Vec::loadu(kt + d * ldt + c), b1 = Vec::loadu(kt + d * ldt + c + Vec::size());
#pragma GCC unroll 6
      for (int r = 0; r < MR_; ++r) {
        const Vec a(q[r * D + d]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR_; ++r) {
      acc[r][0].store(s + r * lds + c);
      acc[r][1].store(s + r * lds + c + Vec::size());
    }
  }
}

// o[r, :Dv] += Σ_{a <= j < e} p[r, j] · v[j, :Dv] for MR_ rows (v: row stride ldv; a half
// dtype converted as it is loaded).
template <int MR_, typename T>
void values_tile(const float* p, int64_t lds, const T* v, int64_t ldv, int64_t a, int64_t e,
                 float* o, int64_t Dv) {
  constexpr int64_t W = Vec::size();
  for (int64_t c = 0; c < Dv; c += 2 * W) {
    const int64_t n0 = std::min(W, Dv - c), n1 = std::clamp<int64_t>(Dv - c - W, 0, W);
    Vec acc[MR_][2];
    for (int r = 0; r < MR_; ++r) {
      acc[r][0] = Vec::loadu(o + r * Dv + c, n0);
      acc[r][1] = n1 ? Vec::loadu(o + r * Dv + c + W, n1) : Vec(0.0f);
    }
    for (int64_t j = a; j < e; ++j) {
      const T* vj = v + j * ldv + c;
      const Vec b0 = load_float(vj, n0);
      const Vec b1 = n1 ? load_float(vj + W, n1) : Vec(0.0f);
#pragma GCC unroll 6
      for (int r = 0; r < MR_; ++r) {
        const Vec w(p[r * lds + j]);
        acc[r][0] = at::vec::fmadd(w, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(w, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR_; ++r) {
      acc[r][0].store(o + r * Dv + c, n0);
      if (n1) acc[r][1].store(o + r * Dv + c + W, n1);
    }
  }
}

// One cache line's prefetch. GCC deletes a loop of __builtin_prefetch whose trip count it
// cannot see (a loop with no effect); an asm statement stays.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

// The rows a decoding kernel reads next (a later page run's keys and values, strides in
// bytes), prefetched a row per key scored: the pages lie anywhere in memory, where no
// hardware prefetcher looks ahead, and a burst of prefetches would wait for memory as a
// load does. The default reads nothing ahead.
struct Ahead {
  const char *k = nullptr, *v = nullptr;
  int64_t n = 0, k_ld = 0, v_ld = 0, k_bytes = 0, v_bytes = 0;
  void row(int64_t j) const {
    if (j >= n) return;
    for (int64_t b = 0; b < k_bytes; b += 64) prefetch_line(k + j * k_ld + b);
    for (int64_t b = 0; b < v_bytes; b += 64) prefetch_line(v + j * v_ld + b);
  }
};

// s[r, j] = q[r] · k[j] for MR_ rows and n keys read in place (row stride ldk), for a
// decoding step: each key row is loaded once for all MR_ rows and its MR_ vectors of
// partial sums are summed across lanes. q's rows are zero-padded to a multiple of the
// vector (row stride ldq); a key's tail past D is never loaded.
template <int MR_, typename T>
void dots_tile(const float* q, int64_t ldq, int64_t D, const T* k, int64_t ldk, int64_t n, float* s,
               int64_t lds, const Ahead& ahead) {
  constexpr int64_t W = Vec::size();
  for (int64_t j = 0; j < n; ++j) {
    ahead.row(j);
    const T* kj = k + j * ldk;
    Vec acc[MR_];
    for (int r = 0; r < MR_; ++r) acc[r] = Vec(0.0f);
    for (int64_t d = 0; d < D; d += W) {
      const Vec b = load_float(kj + d, std::min(W, D - d));
#pragma GCC unroll 6
      for (int r = 0; r < MR_; ++r) acc[r] = at::vec::fmadd(Vec::loadu(q + r * ldq + d), b, acc[r]);
    }
    for (int r = 0; r < MR_; ++r)
      s[r * lds + j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc[r]);
  }
}

// The two tiles for any row count 1..MR (the last group of a tile may be short).
template <template <int> class F, typename... A>
void by_rows(int64_t rows, A... args) {
  switch (rows) {
    case 1: return F<1>::run(args...);
    case 2: return F<2>::run(args...);
    case 3: return F<3>::run(args...);
    case 4: return F<4>::run(args...);
    case 5: return F<5>::run(args...);
    default: return F<6>::run(args...);
  }
}

template <int MR_>
struct Scores {
  static void run(const float* q, int64_t D, const float* kt, int64_t ldt, int64_t c0, int64_t c1,
                  float* s, int64_t lds) {
    scores_tile<MR_>(q, D, kt, ldt, c0, c1, s, lds);
  }
};

template <int MR_>
struct Dots {
  template <typename T>
  static void run(const float* q, int64_t ldq, int64_t D, const T* k, int64_t ldk, int64_t n,
                  float* s, int64_t lds, const Ahead* ahead) {
    dots_tile<MR_>(q, ldq, D, k, ldk, n, s, lds, *ahead);
  }
};

template <int MR_>
struct Values {
  template <typename T>
  static void run(const float* p, int64_t lds, const T* v, int64_t ldv, int64_t a, int64_t e,
                  float* o, int64_t Dv) {
    values_tile<MR_>(p, lds, v, ldv, a, e, o, Dv);
  }
};

}  // namespace attnkit_native

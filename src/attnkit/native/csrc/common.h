// Shared pieces of attnkit's kernels: the dtype dispatch, scratch buffers, and the vector
// loops of an online softmax (row max, exp and sum, softcap, rescale) on float32 rows.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

// The dtypes the kernels take, switched on by PyTorch's dispatch macros: the body sees
// the element type as scalar_t; any other dtype raises (attnkit.native's checks keep one
// from getting here).
#define ATTNKIT_DISPATCH(TYPE, NAME, ...)                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE( \
                         at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace attnkit_native {

// Scratch left uninitialised: every kernel writes it before it reads it (a zeroed
// std::vector of a thread's blocks costs more than a small call's whole work).
template <typename E>
class BufferOf {
 public:
  explicit BufferOf(int64_t n) : data_(n > 0 ? new E[n] : nullptr) {}
  E* data() const { return data_.get(); }
  E* begin() const { return data_.get(); }
  E& operator[](int64_t i) const { return data_[i]; }

 private:
  std::unique_ptr<E[]> data_;
};
using Buffer = BufferOf<float>;

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float row_max(const float* s, int64_t n) {
  Vec best(kNegInf);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) best = at::vec::maximum(best, Vec::loadu(s + j));
  float lanes[Vec::size()];
  best.store(lanes);
  float m = kNegInf;
  for (float x : lanes) m = std::isnan(x) || std::isnan(m) ? NAN : std::max(m, x);
  for (; j < n; ++j) m = std::isnan(s[j]) || std::isnan(m) ? NAN : std::max(m, s[j]);
  return m;
}

// s = exp(s − m) in place; returns Σ s.
inline float exp_sum(float* s, int64_t n, float m) {
  const Vec vm(m);
  Vec acc(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec p = (Vec::loadu(s + j) - vm).exp_u20();
    p.store(s + j);
    acc = acc + p;
  }
  float lanes[Vec::size()];
  acc.store(lanes);
  float sum = 0.0f;
  for (float x : lanes) sum += x;
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
  return sum;
}

inline void softcap_inplace(float* s, int64_t n, float cap) {
  const Vec vc(cap), inv(1.0f / cap);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size())
    (vc * (Vec::loadu(s + j) * inv).tanh()).store(s + j);
  for (; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
}

// s[j] −= a·|p − j| for j in [ra, re): ALiBi's bias on a row of a block's scores, p the
// row's aligned position less the block's first key (float32 holds every distance exactly
// below 2**24, which ops.py checks).
inline void alibi_inplace(float* s, int64_t ra, int64_t re, float a, float p) {
  const Vec va(a), vp(p);
  int64_t j = ra;
  for (; j + Vec::size() <= re; j += Vec::size()) {
    const Vec dist = (vp - Vec::arange(static_cast<float>(j), 1.0f)).abs();
    (Vec::loadu(s + j) - va * dist).store(s + j);
  }
  for (; j < re; ++j) s[j] -= a * std::abs(p - static_cast<float>(j));
}

inline void scale_inplace(float* x, int64_t n, float a) {
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * va).store(x + j);
  for (; j < n; ++j) x[j] *= a;
}

// Whether every value of a (rows, cols) slab is finite: x·0 is 0 for a finite x and NaN
// for an infinite or NaN one, so one vector sum of x·0 answers for the slab.
inline bool all_finite(const float* x, int64_t rows, int64_t cols, int64_t ld) {
  const Vec zero(0.0f);
  Vec acc(0.0f);
  float tail = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ld;
    int64_t c = 0;
    for (; c + Vec::size() <= cols; c += Vec::size())
      acc = at::vec::fmadd(Vec::loadu(row + c), zero, acc);
    for (; c < cols; ++c) tail += row[c] * 0.0f;
  }
  float lanes[Vec::size()];
  acc.store(lanes);
  for (float lane : lanes) tail += lane;
  return tail == 0.0f;
}

// The hull [kmin, kmax) of the key intervals of query rows [r0, r0 + rows) of batch row b
// (lo, hi: (B, L), or null for [0, S) every row); (0, 0) where no row sees a key.
inline std::pair<int64_t, int64_t> hull(const int64_t* lo, const int64_t* hi, int64_t b, int64_t L,
                                        int64_t S, int64_t r0, int64_t rows) {
  int64_t kmin = S, kmax = 0;
  for (int64_t i = r0; i < r0 + rows; ++i) {
    const int64_t a = lo ? lo[b * L + i] : 0, e = hi ? hi[b * L + i] : S;
    if (a < e) kmin = std::min(kmin, a), kmax = std::max(kmax, e);
  }
  return kmin < kmax ? std::pair{kmin, kmax} : std::pair<int64_t, int64_t>{0, 0};
}

// n <= Vec::size() entries at p as float32 (the rest zero): one vector load, converted
// from a half dtype on the way.
template <typename T>
inline Vec load_float(const T* p, int64_t n = Vec::size()) {
  if constexpr (std::is_same_v<T, float>) {
    return n == Vec::size() ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    if (n == Vec::size()) {
      Vec x;
      at::vec::load_to_float<T>(p, x);
      return x;
    }
    float lanes[Vec::size()] = {};
    for (int64_t i = 0; i < n; ++i) lanes[i] = static_cast<float>(p[i]);
    return Vec::loadu(lanes);
  }
}

// Rows [0, n) of a (rows, cols) slab with row stride `ld` as float32: the slab itself where
// it is float32, else converted into `buf` (n × cols, packed).
template <typename T>
const float* as_float(const T* src, int64_t n, int64_t cols, int64_t ld, float* buf,
                      int64_t* out_ld) {
  if constexpr (std::is_same_v<T, float>) {
    *out_ld = ld;
    return src;
  } else {
    for (int64_t r = 0; r < n; ++r) {
      const T* row = src + r * ld;
      float* dst = buf + r * cols;
      int64_t c = 0;
      for (; c + Vec::size() <= cols; c += Vec::size()) {
        Vec x;
        at::vec::load_to_float<T>(row + c, x);
        x.store(dst + c);
      }
      for (; c < cols; ++c) dst[c] = static_cast<float>(row[c]);
    }
    *out_ld = cols;
    return buf;
  }
}

}  // namespace attnkit_native

// attnkit's native kernel: one new token per sequence against its pages (decoding).
//
// The math. Sequence i's query (its H heads) attends the keys at positions [lo_i, hi_i)
// of its own history; position p lives in slot blocks[at_i + p / bs] · bs + p % bs of the
// keys (slots, Hkv, D) and values (slots, Hkv, Dv), any strides but a unit last one (a
// paged cache's pool holds them side by side, flash-attention's pages apart). Query head
// h reads K/V head h / G:
//
//   s_p   = softcap(scale · q_h · k_p)
//   lse_h = log Σ_p exp(s_p)                     -inf where the sequence has no key
//   out_h = Σ_p exp(s_p − lse_h) · v_p           0 there
//
// The blocking. Decoding is bound by reading K and V, so each byte is read once per step:
// a work item is one sequence's K/V head over a range of its positions; the G query heads
// of that K/V head take a chunk of its keys together: the chunk's rows copied out of their
// pages into a cache-resident float32 buffer, S = Q·Kᵀ (one GEMM), the online softmax
// (running max m, sum l, output O, as in span_attention.cpp), O += P·V (one GEMM). Each
// sequence's positions are cut into parts of kPart (flash-decoding: a long history runs on
// every thread) whose partial (m, l, O) merge by their log-sum-exp at the end; the cut
// depends on the sequence alone, so its result is the same whatever else the step holds
// (varlen_attn's packs are order-invariant). Keys outside [lo_i, hi_i) are never read.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <tuple>
#include <vector>

#include "common.h"

namespace attnkit_native {
namespace {

constexpr int64_t kChunk = 256;     // positions whose scores go through one softmax update
constexpr int64_t kPart = 2048;     // positions of a part (the last of a sequence: the rest)

// o += p · x over n entries.
void axpy(float* o, float p, const float* x, int64_t n) {
  const Vec vp(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    at::vec::fmadd(vp, Vec::loadu(x + d), Vec::loadu(o + d)).store(o + d);
  for (; d < n; ++d) o[d] += p * x[d];
}

// One part: sequence i, K/V head hkv, positions [p0, p1).
struct Part {
  int64_t i, hkv, p0, p1;
};

template <typename T>
struct Paged {
  const T* q;        // (N, H, D)
  int64_t qs[3];
  const T *keys, *values;  // (slots, Hkv, D), (slots, Hkv, Dv)
  int64_t ks[2], vs[2];     // their slot and head strides
  const int64_t *blocks, *at, *lo, *hi;
  int64_t N, H, Hkv, G, D, Dv, bs;
  float scale, softcap;

  int64_t slot(int64_t i, int64_t p) const { return blocks[at[i] + p / bs] * bs + p % bs; }

  // The part's partial result: m (G), l (G), O (G × Dv) unnormalised. A chunk's key
  // and value rows are copied side by side out of their pages into a float32 buffer
  // (kChunk rows, cache-resident), then S = Q·Kᵀ and O += P·V are one GEMM each.
  void run(const Part& part, Buffer& w, float* m, float* l, float* o) const {
    float* qf = w.data();                // G × D, scaled
    float* s = qf + G * D;               // G × kChunk
    float* kv = s + G * kChunk;          // kChunk × (D + Dv): the chunk's rows
    const int64_t width = D + Dv;
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + part.i * qs[0] + (part.hkv * G + g) * qs[1];
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(src[d]) * scale;
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.0f;
    }
    std::fill(o, o + G * Dv, 0.0f);
    for (int64_t c0 = part.p0; c0 < part.p1; c0 += kChunk) {
      const int64_t n = std::min(kChunk, part.p1 - c0);
      for (int64_t j = 0; j < n;) {  // page by page: a page's slots are consecutive
        const int64_t p = c0 + j, run = std::min(n - j, bs - p % bs), at_slot = slot(part.i, p);
        const T* key = keys + at_slot * ks[0] + part.hkv * ks[1];
        const T* value = values + at_slot * vs[0] + part.hkv * vs[1];
        for (int64_t r = 0; r < run; ++r) {
          float* dst = kv + (j + r) * width;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(key[r * ks[0] + d]);
          for (int64_t d = 0; d < Dv; ++d) dst[D + d] = static_cast<float>(value[r * vs[0] + d]);
        }
        j += run;
      }
      gemm_nt(G, n, D, qf, D, kv, width, s, kChunk, 0.0f);
      for (int64_t g = 0; g < G; ++g) update(s + g * kChunk, n, m[g], l[g], o + g * Dv);
      gemm_nn_add(G, Dv, n, s, kChunk, kv + D, width, o, Dv);
    }
  }

  // A chunk's scores into weights, the running max, sum and output rescaled.
  void update(float* s, int64_t n, float& m, float& l, float* o) const {
    if (softcap > 0) softcap_inplace(s, n, softcap);
    const float mx = row_max(s, n);
    const float m_new = std::isnan(mx) ? mx : std::max(m, mx);
    if (m_new == -std::numeric_limits<float>::infinity()) {
      std::fill(s, s + n, 0.0f);
      return;
    }
    const float alpha = std::exp(m - m_new);
    l = l * alpha + exp_sum(s, n, m_new);
    m = m_new;
    if (alpha != 1.0f) scale_inplace(o, Dv, alpha);
  }
};

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& blocks, const at::Tensor& at_, const at::Tensor& lo,
            const at::Tensor& hi, int64_t block_size, double scale, double softcap,
            at::Tensor& out, at::Tensor& lse) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = keys.size(1);
  const int64_t Dv = values.size(2), G = H / Hkv;
  Paged<T> k{q.data_ptr<T>(), {q.stride(0), q.stride(1), q.stride(2)},
             keys.data_ptr<T>(), values.data_ptr<T>(),
             {keys.stride(0), keys.stride(1)}, {values.stride(0), values.stride(1)},
             blocks.data_ptr<int64_t>(), at_.data_ptr<int64_t>(), lo.data_ptr<int64_t>(),
             hi.data_ptr<int64_t>(), N, H, Hkv, G, D, Dv, block_size,
             static_cast<float>(scale), static_cast<float>(softcap)};
  // the parts: each sequence's K/V head in runs of kPart positions, the last one longer
  // (up to 2·kPart) rather than a short tail
  const int64_t threads = at::get_num_threads();
  std::vector<Part> parts;
  std::vector<int64_t> first(N * Hkv + 1, 0);  // each item's first part
  for (int64_t i = 0; i < N; ++i)
    for (int64_t hkv = 0; hkv < Hkv; ++hkv) {
      const int64_t start = k.lo[i], len = std::max<int64_t>(0, k.hi[i] - k.lo[i]);
      const int64_t pieces = std::max<int64_t>(1, len / kPart);
      for (int64_t c = 0; c < pieces; ++c)
        parts.push_back({i, hkv, start + c * kPart, c + 1 < pieces ? start + (c + 1) * kPart : start + len});
      first[i * Hkv + hkv + 1] = static_cast<int64_t>(parts.size());
    }
  const int64_t count = static_cast<int64_t>(parts.size());
  std::vector<float> m(count * G), l(count * G), o(count * G * Dv);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min(threads, count)), 1, [&](int64_t, int64_t) {
    Buffer w(G * D + G * kChunk + kChunk * (D + Dv));
    for (int64_t t = next++; t < count; t = next++)
      k.run(parts[t], w, &m[t * G], &l[t * G], &o[t * G * Dv]);
  });
  // merge each item's parts by their log-sum-exp, and write out and lse
  T* dst = out.data_ptr<T>();
  float* lse_out = lse.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(Dv);
  for (int64_t item = 0; item < N * Hkv; ++item)
    for (int64_t g = 0; g < G; ++g) {
      float big = neg_inf;
      for (int64_t t = first[item]; t < first[item + 1]; ++t)
        big = std::isnan(m[t * G + g]) ? m[t * G + g] : std::max(big, m[t * G + g]);
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (big != neg_inf)
        for (int64_t t = first[item]; t < first[item + 1]; ++t) {
          const float weight = std::exp(m[t * G + g] - big);
          sum += l[t * G + g] * weight;
          axpy(acc.data(), weight, &o[(t * G + g) * Dv], Dv);
        }
      const int64_t i = item / Hkv, h = (item % Hkv) * G + g;
      T* row = dst + (i * H + h) * Dv;
      if (sum > 0.0f || std::isnan(sum)) {
        for (int64_t d = 0; d < Dv; ++d) row[d] = static_cast<T>(acc[d] / sum);
        lse_out[i * H + h] = big + std::log(sum);
      } else {
        for (int64_t d = 0; d < Dv; ++d) row[d] = static_cast<T>(0.0f);
        lse_out[i * H + h] = neg_inf;
      }
    }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "attnkit_native::paged_decode: ", what); }

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& keys,
                                                const at::Tensor& values,
                                                const at::Tensor& blocks, const at::Tensor& at_,
                                                const at::Tensor& lo, const at::Tensor& hi,
                                                int64_t block_size, double scale,
                                                double softcap) {
  // attnkit.native validates every input before it gets here; these guard the memory.
  check(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q (N, H, D), keys, values 3-D");
  for (const at::Tensor* t : {&q, &keys, &values}) {
    check(t->size(2) <= 1 || t->stride(2) == 1, "unit last stride");
    check(t->device().is_cpu() && t->scalar_type() == q.scalar_type(), "CPU, q's dtype");
  }
  check(keys.size(1) > 0 && q.size(1) % keys.size(1) == 0, "heads");
  check(keys.size(2) == q.size(2) && block_size > 0, "sizes");
  check(values.size(0) == keys.size(0) && values.size(1) == keys.size(1), "keys and values");
  check(keys.size(0) % block_size == 0, "whole blocks");
  for (const at::Tensor* t : {&blocks, &at_, &lo, &hi})
    check(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "int64 1-D");
  check(at_.size(0) == q.size(0) && lo.size(0) == q.size(0) && hi.size(0) == q.size(0), "N");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* a = at_.data_ptr<int64_t>();
  const int64_t *l = lo.data_ptr<int64_t>(), *h = hi.data_ptr<int64_t>();
  const int64_t num_blocks = keys.size(0) / block_size;
  for (int64_t i = 0; i < q.size(0); ++i) {
    check(0 <= l[i] && l[i] <= h[i], "0 <= lo <= hi");
    if (l[i] == h[i]) continue;
    check(a[i] >= 0 && a[i] + (h[i] - 1) / block_size < blocks.size(0), "table range");
    for (int64_t p = l[i] / block_size; p <= (h[i] - 1) / block_size; ++p)
      check(0 <= b[a[i] + p] && b[a[i] + p] < num_blocks, "block ids within the pool");
  }
  auto out = at::empty({q.size(0), q.size(1), values.size(2)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  switch (q.scalar_type()) {
    case at::kFloat:
      decode<float>(q, keys, values, blocks, at_, lo, hi, block_size, scale, softcap, out, lse);
      break;
    case at::kBFloat16:
      decode<at::BFloat16>(q, keys, values, blocks, at_, lo, hi, block_size, scale, softcap, out, lse);
      break;
    case at::kHalf:
      decode<at::Half>(q, keys, values, blocks, at_, lo, hi, block_size, scale, softcap, out, lse);
      break;
    default: TORCH_CHECK(false, "attnkit_native::paged_decode: float32, bfloat16 or float16");
  }
  return {out, lse};
}

}  // namespace
}  // namespace attnkit_native

TORCH_LIBRARY_FRAGMENT(attnkit_native, m) {
  m.def("paged_decode(Tensor q, Tensor keys, Tensor values, Tensor blocks, Tensor table_at, "
        "Tensor lo, "
        "Tensor hi, int block_size, float scale, float softcap) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("paged_decode", &attnkit_native::paged_decode);
}

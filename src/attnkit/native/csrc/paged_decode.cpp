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
// The blocking. Decoding is bound by reading K and V, so each byte is read once per step,
// in place: a work item is one sequence's range of positions (a part) for a group of its
// K/V heads. The part walks its positions in batches of kBatch, a batch page run by page
// run (a page's slots are consecutive): per K/V head the G query heads that share it
// score each run's keys together (micro.h's dots_tile: each key row loaded once, in any
// dtype, converted as it is loaded), one online-softmax update covers the whole batch
// (running max m, sum l, output O, as in span_attention.cpp; the output is rescaled only
// when the max grows), and O += P·V reads the batch's value rows run by run
// (values_tile) while they are in cache. A batch spans many small pages, so the update's
// passes over the scores run once per kBatch positions, not once per page. The pages lie
// anywhere in the pool, where no hardware prefetcher looks ahead, so the rows of the run
// kLead positions further on are prefetched a row per key scored (micro.h's Ahead).
//
// The parts: each sequence's positions are cut into parts of kPart (flash-decoding: a long
// history runs on every thread) whose partial (m, l, O) merge by their log-sum-exp at the
// end; the cut depends on the sequence alone, so its result is the same whatever else the
// step holds (varlen_attn's packs are order-invariant). The K/V heads go in groups only
// when there are fewer parts than threads (a head's result is the same in any group).
// Keys outside [lo_i, hi_i) are never read.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "micro.h"
#include "queue.h"

namespace attnkit_native {
namespace {

constexpr int64_t kBatch = 256;  // positions of a batch at most (one softmax update)
constexpr int64_t kPart = 2048;  // positions of a part (the last of a sequence: the rest)
constexpr int64_t kLead = 32;    // positions the prefetch runs ahead, at least

// o += p · x over n entries.
void axpy(float* o, float p, const float* x, int64_t n) {
  const Vec vp(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    at::vec::fmadd(vp, Vec::loadu(x + d), Vec::loadu(o + d)).store(o + d);
  for (; d < n; ++d) o[d] += p * x[d];
}

// A page run of a batch: `count` positions from `slot` on, their scores at `offset` of the
// batch's; `ahead` rows from slot `next` on to prefetch while it is scored.
struct Run {
  int64_t slot, count, offset, next, ahead;
};

// One part: sequence i, K/V heads [h0, h1), positions [p0, p1); its partial results are
// rows [row, row + (h1 - h0)·G) of m, l and O.
struct Part {
  int64_t i, h0, h1, p0, p1, row;
};

template <typename T>
struct Paged {
  const T* q;  // (N, H, D)
  int64_t qs[3];
  const T *keys, *values;  // (slots, Hkv, D), (slots, Hkv, Dv)
  int64_t ks[2], vs[2];    // their slot and head strides
  const int64_t *blocks, *at, *lo, *hi;
  int64_t N, H, Hkv, G, D, Dv, bs;
  float scale, softcap;

  static int64_t padded(int64_t d) { return (d + Vec::size() - 1) / Vec::size() * Vec::size(); }
  int64_t slot(int64_t i, int64_t p) const { return blocks[at[i] + p / bs] * bs + p % bs; }

  // The part's partial result: m, l (one per query head of its K/V heads) and O (one row
  // of Dv each) unnormalised, in one pass over its batches (the blocking above).
  void run(const Part& part, Buffer& w, float* m, float* l, float* o) const {
    const int64_t ldq = padded(D), heads = (part.h1 - part.h0) * G;
    float* qf = w.data();     // heads × ldq, scaled, zero-padded
    float* s = qf + H * ldq;  // G × kBatch: a batch's scores
    for (int64_t r = 0; r < heads; ++r) {
      const T* src = q + part.i * qs[0] + (part.h0 * G + r) * qs[1];
      for (int64_t d = 0; d < ldq; ++d)
        qf[r * ldq + d] = d < D ? static_cast<float>(src[d]) * scale : 0.0f;
      m[r] = kNegInf;
      l[r] = 0.0f;
    }
    std::fill(o, o + heads * Dv, 0.0f);
    std::vector<Run> batch;  // a batch's page runs: kBatch at most (pages of one slot)
    batch.reserve(static_cast<size_t>(std::min(kBatch, part.p1 - part.p0)));
    for (int64_t b = part.p0; b < part.p1; b += kBatch) {
      const int64_t b1 = std::min(part.p1, b + kBatch), n = b1 - b;  // the batch [b, b1)
      batch.clear();
      runs(part, b, b1, batch);
      for (int64_t hkv = part.h0; hkv < part.h1; ++hkv) {
        const int64_t r0 = (hkv - part.h0) * G;
        for (const Run& page : batch) {
          const T* k = keys + page.slot * ks[0] + hkv * ks[1];
          const Ahead fetch = prefetch(page, hkv), none;
          for (int64_t g = 0; g < G; g += kMicroRows)
            by_rows<Dots>(std::min(kMicroRows, G - g), qf + (r0 + g) * ldq, ldq, D, k, ks[0],
                          page.count, s + g * kBatch + page.offset, kBatch,
                          g == 0 ? &fetch : &none);
        }
        for (int64_t g = 0; g < G; ++g)
          update(s + g * kBatch, n, m[r0 + g], l[r0 + g], o + (r0 + g) * Dv);
        for (const Run& page : batch) {
          const T* v = values + page.slot * vs[0] + hkv * vs[1];
          for (int64_t g = 0; g < G; g += kMicroRows)
            by_rows<Values>(std::min(kMicroRows, G - g), s + g * kBatch + page.offset, kBatch, v,
                            vs[0], int64_t{0}, page.count, o + (r0 + g) * Dv, Dv);
        }
      }
    }
  }

  // The page runs of the part's positions [b0, b1) into `batch`: each run within one page
  // (a page's slots are consecutive), kBatch at most; with the rows to prefetch while it
  // is scored: the run that starts kLead positions or more past its start (none near the
  // part's end).
  void runs(const Part& part, int64_t b0, int64_t b1, std::vector<Run>& batch) const {
    const int64_t skip = bs <= kBatch ? std::max<int64_t>(0, (kLead + bs - 1) / bs - 1) * bs : 0;
    for (int64_t p = b0; p < b1;) {
      const int64_t count = std::min(b1 - p, bs - p % bs);
      const int64_t target = p + count + skip;  // a run's start: a page's, or a batch's
      const int64_t ahead =
          target < part.p1 ? std::min({part.p1 - target, bs - target % bs, kBatch}) : 0;
      batch.push_back(
          {slot(part.i, p), count, p - b0, ahead > 0 ? slot(part.i, target) : 0, ahead});
      p += count;
    }
  }

  // The key and value rows of K/V head hkv to prefetch while the run is scored.
  Ahead prefetch(const Run& run, int64_t hkv) const {
    const int64_t size = static_cast<int64_t>(sizeof(T));
    return {reinterpret_cast<const char*>(keys + run.next * ks[0] + hkv * ks[1]),
            reinterpret_cast<const char*>(values + run.next * vs[0] + hkv * vs[1]),
            run.ahead,
            ks[0] * size,
            vs[0] * size,
            D * size,
            Dv * size};
  }

  // A batch's scores into weights, the running max, sum and output rescaled (only when
  // the max grows: most batches of a long history leave it as it is).
  void update(float* s, int64_t n, float& m, float& l, float* o) const {
    if (softcap > 0) softcap_inplace(s, n, softcap);
    const float mx = row_max(s, n);
    const float m_new = std::isnan(mx) ? mx : std::max(m, mx);
    if (m_new == kNegInf) {
      std::fill(s, s + n, 0.0f);
      return;
    }
    if (m_new != m) {
      const float alpha = std::exp(m - m_new);
      l *= alpha;
      scale_inplace(o, Dv, alpha);
      m = m_new;
    }
    l += exp_sum(s, n, m);
  }
};

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
            const at::Tensor& blocks, const at::Tensor& at_, const at::Tensor& lo,
            const at::Tensor& hi, int64_t block_size, double scale, double softcap, at::Tensor& out,
            at::Tensor& lse) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = keys.size(1);
  const int64_t Dv = values.size(2), G = H / Hkv;
  Paged<T> k{q.data_ptr<T>(),
             {q.stride(0), q.stride(1), q.stride(2)},
             keys.data_ptr<T>(),
             values.data_ptr<T>(),
             {keys.stride(0), keys.stride(1)},
             {values.stride(0), values.stride(1)},
             blocks.data_ptr<int64_t>(),
             at_.data_ptr<int64_t>(),
             lo.data_ptr<int64_t>(),
             hi.data_ptr<int64_t>(),
             N,
             H,
             Hkv,
             G,
             D,
             Dv,
             block_size,
             static_cast<float>(scale),
             static_cast<float>(softcap)};
  // the parts: each sequence's positions in runs of kPart, the last one longer (up to
  // 2·kPart) rather than a short tail; its K/V heads in groups, as many as the threads need
  // to share the work (the cut of positions depends on the sequence alone, so a sequence's
  // result is the same whatever the step holds; a head's result is the same in any group)
  const int64_t threads = at::get_num_threads();
  auto pieces = [&](int64_t i) {
    return std::max<int64_t>(1, std::max<int64_t>(0, k.hi[i] - k.lo[i]) / kPart);
  };
  int64_t all = 0;
  for (int64_t i = 0; i < N; ++i) all += pieces(i);
  const int64_t groups = std::clamp<int64_t>((threads + all - 1) / all, 1, Hkv);
  const int64_t per = (Hkv + groups - 1) / groups;  // K/V heads of a group
  std::vector<Part> parts;
  std::vector<int64_t> first{0};  // each (sequence, group)'s first part
  int64_t rows = 0;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h0 = 0; h0 < Hkv; h0 += per) {
      const int64_t h1 = std::min(Hkv, h0 + per), start = k.lo[i], count = pieces(i);
      const int64_t end = std::max(start, k.hi[i]);
      for (int64_t c = 0; c < count; ++c) {
        parts.push_back(
            {i, h0, h1, start + c * kPart, c + 1 < count ? start + (c + 1) * kPart : end, rows});
        rows += (h1 - h0) * G;
      }
      first.push_back(static_cast<int64_t>(parts.size()));
    }
  const int64_t count = static_cast<int64_t>(parts.size());
  std::vector<float> m(rows), l(rows), o(rows * Dv);
  run_queue(
      count, [&] { return Buffer(H * Paged<T>::padded(D) + G * kBatch); },
      [&](int64_t t, Buffer& w) {
        const int64_t r = parts[t].row;
        k.run(parts[t], w, &m[r], &l[r], &o[r * Dv]);
      });
  // merge each query head's parts by their log-sum-exp, and write out and lse
  T* dst = out.data_ptr<T>();
  float* lse_out = lse.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(Dv);
  for (size_t item = 0; item + 1 < first.size(); ++item) {
    const Part& head = parts[first[item]];
    for (int64_t r = 0; r < (head.h1 - head.h0) * G; ++r) {
      float big = neg_inf;
      for (int64_t t = first[item]; t < first[item + 1]; ++t) {
        const float mt = m[parts[t].row + r];
        big = std::isnan(mt) ? mt : std::max(big, mt);
      }
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (big != neg_inf)
        for (int64_t t = first[item]; t < first[item + 1]; ++t) {
          const int64_t at_row = parts[t].row + r;
          const float weight = std::exp(m[at_row] - big);
          sum += l[at_row] * weight;
          axpy(acc.data(), weight, &o[at_row * Dv], Dv);
        }
      const int64_t h = head.h0 * G + r;
      T* row = dst + (head.i * H + h) * Dv;
      if (sum > 0.0f || std::isnan(sum)) {
        for (int64_t d = 0; d < Dv; ++d) row[d] = static_cast<T>(acc[d] / sum);
        lse_out[head.i * H + h] = big + std::log(sum);
      } else {
        for (int64_t d = 0; d < Dv; ++d) row[d] = static_cast<T>(0.0f);
        lse_out[head.i * H + h] = neg_inf;
      }
    }
  }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "attnkit_native::paged_decode: ", what); }

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& keys,
                                                const at::Tensor& values, const at::Tensor& blocks,
                                                const at::Tensor& at_, const at::Tensor& lo,
                                                const at::Tensor& hi, int64_t block_size,
                                                double scale, double softcap) {
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
  ATTNKIT_DISPATCH(q.scalar_type(), "attnkit_native::paged_decode", [&] {
    decode<scalar_t>(q, keys, values, blocks, at_, lo, hi, block_size, scale, softcap, out, lse);
  });
  return {out, lse};
}

}  // namespace
}  // namespace attnkit_native

TORCH_LIBRARY_FRAGMENT(attnkit_native, m) {
  m.def(
      "paged_decode(Tensor q, Tensor keys, Tensor values, Tensor blocks, Tensor table_at, "
      "Tensor lo, Tensor hi, int block_size, float scale, float softcap) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("paged_decode", &attnkit_native::paged_decode);
}

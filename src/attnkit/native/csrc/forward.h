// The forward kernel of span_attention.cpp (attention where each query row sees one
// interval of keys): its math, its blocking and its data; span_attention.cpp schedules it
// and is the op.
//
// The math (what attnkit.reference computes for such a mask). Row i of batch row b sees
// keys [lo[b,i], hi[b,i]); query head h reads K/V head h / G (G = H / Hkv, GQA):
//
//   s_j   = softcap(scale · q_i · k_j) − a_i·|p_i − j|     lo <= j < hi
//           (softcap(x) = c·tanh(x/c); ALiBi: row i's slope a_i of head h, position p_i)
//   lse_i = log Σ_j exp(s_j)                     -inf where the row sees nothing
//   out_i = Σ_j exp(s_j − lse_i) · v_j           0 where the row sees nothing
//
// The blocking (flash attention's online softmax). One work item is a tile of R query
// rows (`rows`) of the G query heads sharing one K/V head, stacked as M = G·R rows, so
// each key byte is read once for all of them. The item walks the hull of its rows'
// intervals in blocks of KB keys (`keys`; keys outside every interval are never read).
// A block every row sees whole is one piece: M rows × n keys, two GEMMs (blas.h) and no mask
// work; any other block is cut into groups of MR = 6 stacked rows (micro.h's register
// tiles) over the hull of their intervals in the block, so the masked corners of a band
// cost little. Per piece or group:
//
//   S = Q·Kᵀ                                     (Q pre-scaled)
//   rows that see part of it: p = 0 outside their interval (a row that sees none of it
//   takes p = 0 throughout)
//   m' = max(m, rowmax S);  P = exp(S − m');  l = l·exp(m − m') + rowsum P
//   O  = O·exp(m − m') + P·V
//
// and at the end out = O / l, lse = m + log l, and rest = (m − lse) + log l: what lse's
// rounding to float32 left out (m + log l = lse + rest to float32's precision twice over),
// which the backward subtracts so that its weights exp(s − lse − rest) stay exact where
// |lse| is large (at 10⁴ an ulp of lse is 10⁻³: one key's weight would be 1 ± 10⁻³).
//
// A key inside a group's hull that some row does not see could still leak into that row's
// output through 0·NaN: a group whose V rows hold a non-finite value takes an exact
// per-row loop instead, which touches only the keys each row sees.
//
// bfloat16 on the half units (half.h): K and V packed as pairs once per block, products
// in bfloat16 with float32 sums. Where the caller asks (`amx`) and the CPU has AMX
// (`cpublas::could_pack`), a block every row sees whole, for at least kTileRows stacked
// rows, multiplies on AMX's tiles through PyTorch's cpublas::brgemm (half.h: the pairs
// are brgemm's layout); the backward's five products likewise.
//
// Work items run on the threads from a list sorted longest first (queue.h): a causal
// mask's late tiles cost more.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "common.h"
#include "half.h"
#include "micro.h"
#include "stages.h"

namespace attnkit_native {
namespace {  // included by span_attention.cpp alone

struct Sizes {
  int64_t B, H, Hkv, G, L, S, D, Dv, R, KB;
  // a row of a block's scores (and of its transposed keys): the block in whole tiles of
  // keys (blas.h), plus room for a micro-tile's vector loads past its last key
  int64_t SL = tile_keys(KB) + Vec::size() + kMicroCols;
};

// One work item: query rows [r0, r0 + rows) of batch row b, the G heads of K/V head hkv,
// whose intervals' hull is [kmin, kmax).
struct Item {
  int64_t b, hkv, r0, rows, kmin, kmax;
};

// A thread's scratch: scaled queries, a block's scores, K and V as float, K transposed,
// a last block's V rows padded with zeros, the running output, max and sum of every
// stacked row; on the half units (half.h) the queries, K
// and V as pairs and the weights in bfloat16 instead.
struct Scratch {
  Buffer q, s, k, v, kt, vt, o, m, l;
  BufferOf<Pair> qp, kp, vp;
  BufferOf<Pair> ph;
  TileState tiles;
  Scratch(const Sizes& z, bool convert, bool pairs)  // convert: K and V need a float32 copy
      : q(pairs ? 0 : z.G * z.R * z.D), s(z.G * z.R * z.SL), k(convert ? z.KB * z.D : 0),
        v(convert ? z.KB * z.Dv : 0), kt(pairs ? 0 : z.D * z.SL),
        vt(pairs ? 0 : tile_keys(z.KB) * z.Dv), o(z.G * z.R * z.Dv), m(z.G * z.R), l(z.G * z.R),
        qp(pairs ? z.G * z.R * pair_count(z.D) : 0), kp(pairs ? pair_count(z.D) * z.SL : 0),
        vp(pairs ? pair_count(z.KB) * z.Dv : 0), ph(pairs ? z.G * z.R * pair_count(z.SL) : 0) {}
};

template <typename T>
struct Kernel {
  // bfloat16 products on the half units where built (half.h) and asked (`pairs`), else
  // every block in float32
  static constexpr bool kHalfUnits = kPairDots && std::is_same_v<T, at::BFloat16>;
  const Sizes z;
  bool pairs;
  bool amx;  // whole blocks of at least kTileRows stacked rows on AMX's tiles (brgemm)
  const T *q, *k, *v;
  const int64_t *lo, *hi;       // (B, L) contiguous, or null: every row sees every key
  int64_t qs[4], ks[4], vs[4];  // strides (elements); the last is 1
  float scale, softcap;
  const float* slopes;       // ALiBi (B, L, H) contiguous, or null
  const int64_t* positions;  // ALiBi's aligned positions (B, L) contiguous
  T* out;                    // (B, H, L, Dv) contiguous, or null: out32 instead
  float* out32;              // the output in float32 (a half call's, kept for its backward)
  float* lse;                // (B, H, L) contiguous
  float* rest;               // (B, H, L) contiguous: lse's remainder, (m − lse) + log l

  // The stacked row r of an item is query row r0 + r / G of query head hkv·G + r % G: a
  // run of query rows is a run of stacked rows, for every head. Scaled float32, or the
  // row's own pairs on the half units (scaled with the scores).
  void load_queries(const Item& it, Scratch& w) const {
    ATTNKIT_STAGE(kLoadQ);
    for (int64_t i = 0; i < it.rows; ++i)
      for (int64_t g = 0; g < z.G; ++g) {
        const T* src = q + it.b * qs[0] + (it.hkv * z.G + g) * qs[1] + (it.r0 + i) * qs[2];
        const int64_t r = i * z.G + g;
#ifdef ATTNKIT_PAIR_DOTS
        if constexpr (kHalfUnits) {
          if (pairs) {
            pack_row_pairs(src, z.D, w.qp.data() + r * pair_count(z.D));
            continue;
          }
        }
#endif
        float* dst = w.q.data() + r * z.D;
        for (int64_t d = 0; d < z.D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
      }
  }

  // Query row i's interval within the key block [k0, k0 + n), as [*a, *e) from k0.
  void local(const Item& it, int64_t i, int64_t k0, int64_t n, int64_t* a, int64_t* e) const {
    const int64_t row = it.b * z.L + it.r0 + i;
    const int64_t first = lo ? lo[row] : 0, last = hi ? hi[row] : z.S;
    *a = std::clamp<int64_t>(first - k0, 0, n);
    *e = std::clamp<int64_t>(last - k0, 0, n);
    if (first >= last) *a = *e = 0;
  }

  // ALiBi on stacked row r's scores s[ra, re) of the block from k0.
  void alibi(const Item& it, int64_t r, int64_t k0, float* s, int64_t ra, int64_t re) const {
    const int64_t row = it.b * z.L + it.r0 + r / z.G;
    const float a = slopes[row * z.H + it.hkv * z.G + r % z.G];
    alibi_inplace(s, ra, re, a, static_cast<float>(positions[row] - k0));
  }

  // Stacked rows [r0, r1) have their scores against keys [a, e) of the block in w.s:
  // turn them into weights P in place (0 outside each row's interval unless every row sees
  // all of them: `masked` false), rescaling each row's running max, sum and output.
  void weigh(const Item& it, Scratch& w, int64_t r0, int64_t r1, int64_t a, int64_t e, int64_t k0,
             bool masked) const {
    ATTNKIT_STAGE(kSoftmax);
    for (int64_t r = r0; r < r1; ++r) {
      float* s = w.s.data() + r * z.SL;
      int64_t ra = a, re = e;
      if (masked) {
        local(it, r / z.G, k0, z.KB, &ra, &re);
        ra = std::clamp(ra, a, e), re = std::clamp(re, a, e);
      }
      if (ra >= re) {  // sees none of these keys
        std::fill(s + a, s + e, 0.0f);
        continue;
      }
      if (pairs) scale_inplace(s + ra, re - ra, scale);  // scores of unscaled pairs
      if (softcap > 0) softcap_inplace(s + ra, re - ra, softcap);
      if (slopes != nullptr) alibi(it, r, k0, s, ra, re);
      const float mx = row_max(s + ra, re - ra);
      const float m_new = std::isnan(mx) ? mx : std::max(w.m[r], mx);  // NaN spreads
      std::fill(s + a, s + ra, 0.0f);
      std::fill(s + re, s + e, 0.0f);
      if (m_new == kNegInf) {  // every visible score is -inf: nothing to add
        std::fill(s + ra, s + re, 0.0f);
        continue;
      }
      const float alpha = std::exp(w.m[r] - m_new);  // 0 for the first visible block
      const float sum = exp_sum(s + ra, re - ra, m_new);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      if (alpha != 1.0f) scale_inplace(w.o.data() + r * z.Dv, z.Dv, alpha);
    }
  }

  // O += P·V for rows [r0, r1) whose weights over keys [a, e) may skip keys some row
  // sees: where those V rows hold a non-finite value, 0·NaN would leak it, so each row
  // then sums its own keys only.
  template <typename E>  // V's element: float32, or T where the half units read it
  void exact_values(const Item& it, Scratch& w, int64_t r0, int64_t r1, int64_t a, int64_t e,
                    int64_t k0, const E* vb, int64_t ldv) const {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t ra = 0, re = 0;
      local(it, r / z.G, k0, z.KB, &ra, &re);
      ra = std::clamp(ra, a, e), re = std::clamp(re, a, e);
      float* o = w.o.data() + r * z.Dv;
      const float* p = w.s.data() + r * z.SL;
      for (int64_t j = ra; j < re; ++j)
        for (int64_t d = 0; d < z.Dv; ++d) o[d] += p[j] * static_cast<float>(vb[j * ldv + d]);
    }
  }

  // The stages of a whole block, each its own call so that its timer covers it alone:
  // K transposed; S = Q·Kᵀ over whole tiles of keys; a decoding step's few rows' S with K
  // read in place.
  void pack_keys(const float* kb, int64_t n, int64_t ldk, Scratch& w) const {
    ATTNKIT_STAGE(kPackK);
    pack_transposed(kb, n, z.D, ldk, w.kt.data(), z.SL);
  }
  void scores(int64_t rows, int64_t keys, Scratch& w) const {
    ATTNKIT_STAGE(kScores);
    gemm(rows, keys, z.D, w.q.data(), z.D, w.kt.data(), z.SL, w.s.data(), z.SL, false);
  }
  void scores_few(int64_t rows, int64_t n, const float* kb, int64_t ldk, Scratch& w) const {
    ATTNKIT_STAGE(kScores);
    gemm_nt_few(rows, n, z.D, w.q.data(), z.D, kb, ldk, w.s.data(), z.SL);
  }

  // A block every row sees whole: two GEMMs over all stacked rows, no mask work. The
  // products run over whole tiles of keys (blas.h): past n, K's transposed copy is zero,
  // and so are the weights and the V rows the second product reads. A decoding step's
  // few rows multiply K and V in place.
  void whole(const Item& it, Scratch& w, int64_t n, int64_t k0, const float* kb, int64_t ldk,
             const float* vb, int64_t ldv) const {
    const int64_t rows = z.G * it.rows, keys = tile_keys(n);
    if (few_rows(z.G, z.L)) {  // rows = G·L
      scores_few(rows, n, kb, ldk, w);
      weigh(it, w, 0, rows, 0, n, k0, false);
      ATTNKIT_STAGE(kValues);
      gemm_nn_add_few(rows, z.Dv, n, w.s.data(), z.SL, vb, ldv, w.o.data(), z.Dv);
      return;
    }
    pack_keys(kb, n, ldk, w);
    scores(rows, keys, w);
    weigh(it, w, 0, rows, 0, n, k0, false);
    if (keys > n) {
      ATTNKIT_STAGE(kPackV);
      for (int64_t r = 0; r < rows; ++r)
        std::fill(w.s.data() + r * z.SL + n, w.s.data() + r * z.SL + keys, 0.0f);
      vb = padded_rows(vb, n, keys, z.Dv, ldv, w.vt.data());
      ldv = z.Dv;
    }
    ATTNKIT_STAGE(kValues);
    gemm(rows, z.Dv, keys, w.s.data(), z.SL, vb, ldv, w.o.data(), z.Dv, true);
  }

  // The hull [a, e) of the intervals of stacked rows [r0, r1) in the block [k0, k0 + n)
  // (a >= e where none of them sees a key of it).
  std::pair<int64_t, int64_t> group_hull(const Item& it, int64_t r0, int64_t r1, int64_t k0,
                                         int64_t n) const {
    int64_t a = n, e = 0;
    for (int64_t i = r0 / z.G; i <= (r1 - 1) / z.G; ++i) {
      int64_t ra = 0, re = 0;
      local(it, i, k0, n, &ra, &re);
      if (ra < re) a = std::min(a, ra), e = std::max(e, re);
    }
    return {a, e};
  }

  // A tile's columns [c0, c1) for keys [a, e): whole vectors from a's vector boundary, a
  // multiple of the tile's width (at most ldt: n rounded up, plus a tile).
  static std::pair<int64_t, int64_t> columns(int64_t a, int64_t e) {
    const int64_t c0 = a - a % Vec::size();
    return {c0, c0 + (e - c0 + kMicroCols - 1) / kMicroCols * kMicroCols};
  }

  // A block some row sees in part: groups of MR stacked rows (micro.h), each over the
  // hull [a, e) of its rows' intervals in the block, scores from K transposed once.
  void cut(const Item& it, Scratch& w, int64_t n, int64_t k0, const float* kb, int64_t ldk,
           const float* vb, int64_t ldv) const {
    ATTNKIT_STAGE(kCut);  // its stages together (the timers inside it count nothing)
    const int64_t ldt = z.SL;
    pack_transposed(kb, n, z.D, ldk, w.kt.data(), ldt);
    const bool finite_v = all_finite(vb, n, z.Dv, ldv);  // else each group checks its keys
    const int64_t M = z.G * it.rows;
    for (int64_t r0 = 0; r0 < M; r0 += kMicroRows) {
      const int64_t r1 = std::min(M, r0 + kMicroRows);
      const auto [a, e] = group_hull(it, r0, r1, k0, n);
      if (a >= e) continue;
      const auto [c0, c1] = columns(a, e);
      float* s = w.s.data() + r0 * z.SL;
      by_rows<Scores>(r1 - r0, w.q.data() + r0 * z.D, z.D, w.kt.data(), ldt, c0, c1, s, z.SL);
      weigh(it, w, r0, r1, a, e, k0, true);
      if (finite_v || all_finite(vb + a * ldv, e - a, z.Dv, ldv))
        by_rows<Values>(r1 - r0, s, z.SL, vb, ldv, a, e, w.o.data() + r0 * z.Dv, z.Dv);
      else
        exact_values(it, w, r0, r1, a, e, k0, vb, ldv);
    }
  }

#ifdef ATTNKIT_PAIR_DOTS
  // A block's keys and values as pairs (half.h; keys' row stride ldt), each its stage.
  void pack_pairs(const T* kb, int64_t n, int64_t ldt, const T* vb, int64_t ldv, Scratch& w) const {
    {
      ATTNKIT_STAGE(kPackK);
      pack_key_pairs(kb, n, z.D, ks[2], w.kp.data(), ldt);
    }
    ATTNKIT_STAGE(kPackV);
    pack_value_pairs(vb, n, z.Dv, ldv, w.vp.data());
  }
  bool finite_half(const T* vb, int64_t n, int64_t ldv) const {
    ATTNKIT_STAGE(kFinite);
    return all_finite_half(vb, n, z.Dv, ldv);
  }

  // A block every row sees whole, on AMX's tiles: S = Q·Kᵀ and O += P·V for all M stacked
  // rows, each one brgemm call over the pairs (half.h), the keys rounded up to whole
  // vectors of pairs (zero keys past n score 0; their weights are set to 0). V rows
  // holding a non-finite value go to `on_pairs`, whose groups sum each row's own keys.
  void whole_on_tiles(const Item& it, Scratch& w, int64_t n, int64_t k0, const T* kb,
                      const T* vb) const {
    const int64_t M = z.G * it.rows, D2 = pair_count(z.D), ldv = vs[2];
    if (!finite_half(vb, n, ldv)) return on_pairs(it, w, n, k0, kb, vb, true);
    const int64_t keys = round_up(n, 2 * kLanes), ldp = pair_count(z.SL), pe = n + n % 2;
    pack_pairs(kb, n, keys, vb, ldv, w);
    {
      ATTNKIT_STAGE(kScores);
      tile_gemm_nt(M, D2, w.qp.data(), w.kp.data(), keys, w.s.data(), z.SL, w.tiles);
    }
    weigh(it, w, 0, M, 0, n, k0, false);
    {
      ATTNKIT_STAGE(kConvert);
      for (int64_t r = 0; r < M; ++r) {
        float* p = w.s.data() + r * z.SL;
        if (pe > n) p[n] = 0.0f;  // the zero key that completes the last pair
        weights_pairs(p, 0, pe, w.ph.data() + r * ldp);
      }
    }
    ATTNKIT_STAGE(kValues);
    tile_gemm_add(M, z.Dv, pe / 2, w.ph.data(), ldp, w.vp.data(), w.o.data(), z.Dv, w.tiles);
  }

  // A key block on the half units: K and V packed as pairs once (half.h), then groups of
  // MR stacked rows, each over the hull of its rows' intervals in the block (all of it
  // where every row sees it whole: `full`), P rounded to bfloat16 for P·V. As in `cut`, a
  // group whose V rows hold a non-finite value sums each row's own keys instead.
  void on_pairs(const Item& it, Scratch& w, int64_t n, int64_t k0, const T* kb, const T* vb,
                bool full) const {
    const int64_t D2 = pair_count(z.D), ldt = z.SL, ldv = vs[2];
    pack_pairs(kb, n, ldt, vb, ldv, w);
    const bool finite_v = finite_half(vb, n, ldv);
    const int64_t M = z.G * it.rows;
    for (int64_t r0 = 0; r0 < M; r0 += kMicroRows) {
      const int64_t r1 = std::min(M, r0 + kMicroRows);
      const auto [a, e] = full ? std::pair<int64_t, int64_t>{0, n} : group_hull(it, r0, r1, k0, n);
      if (a >= e) continue;
      const auto [c0, c1] = columns(a, e);
      float* s = w.s.data() + r0 * ldt;
      {
        ATTNKIT_STAGE(kScores);
        by_rows<PairScores>(r1 - r0, w.qp.data() + r0 * D2, D2, w.kp.data(), ldt, c0, c1, s, ldt);
      }
      weigh(it, w, r0, r1, a, e, k0, !full);
      const int64_t pa = a - a % 2, pe = e + e % 2;  // whole pairs: pa <= a, e <= pe <= c1
      if (!finite_v && !all_finite_half(vb + pa * ldv, std::min(pe, n) - pa, z.Dv, ldv)) {
        exact_values(it, w, r0, r1, a, e, k0, vb, ldv);
        continue;
      }
      const int64_t ldp = pair_count(ldt);  // a row of weights as pairs
      {
        ATTNKIT_STAGE(kConvert);
        for (int64_t r = r0; r < r1; ++r) {
          float* p = w.s.data() + r * ldt;
          p[pa] = pa < a ? 0.0f : p[pa];
          p[pe - 1] = e < pe ? 0.0f : p[pe - 1];
          weights_pairs(p, pa, pe, w.ph.data() + r * ldp);
        }
      }
      ATTNKIT_STAGE(kValues);
      by_rows<PairProducts>(r1 - r0, w.ph.data() + r0 * ldp, ldp, int64_t{1}, pa / 2, pe / 2,
                            w.vp.data(), z.Dv, w.o.data() + r0 * z.Dv, z.Dv);
    }
  }
#endif

  // A key block [k0, k0 + n): whole where every row sees all of it, else cut; nothing
  // where no row sees a key of it.
  void block(const Item& it, Scratch& w, int64_t k0, int64_t n, const T* kh, const T* vh) const {
    bool any = false, full = true;
    for (int64_t i = 0; i < it.rows; ++i) {
      int64_t a = 0, e = 0;
      local(it, i, k0, n, &a, &e);
      any |= a < e;
      full &= a == 0 && e == n;
    }
    if (!any) return;
#ifdef ATTNKIT_PAIR_DOTS
    if constexpr (kHalfUnits) {
      const T *kb = kh + k0 * ks[2], *vb = vh + k0 * vs[2];
      if (amx && full && z.G * it.rows >= kTileRows) return whole_on_tiles(it, w, n, k0, kb, vb);
      if (pairs && full) return on_pairs(it, w, n, k0, kb, vb, full);
      if (pairs) {
        ATTNKIT_STAGE(kCut);  // its stages together (the timers inside it count nothing)
        return on_pairs(it, w, n, k0, kb, vb, full);
      }
    }
#endif
    int64_t ldk = 0, ldv = 0;
    const float *kb = nullptr, *vb = nullptr;
    {
      ATTNKIT_STAGE(kConvert);
      kb = as_float(kh + k0 * ks[2], n, z.D, ks[2], w.k.data(), &ldk);
      vb = as_float(vh + k0 * vs[2], n, z.Dv, vs[2], w.v.data(), &ldv);
    }
    if (full) return whole(it, w, n, k0, kb, ldk, vb, ldv);
    cut(it, w, n, k0, kb, ldk, vb, ldv);
  }

  void finish(const Item& it, const Scratch& w) const {
    ATTNKIT_STAGE(kFinish);
    for (int64_t i = 0; i < it.rows; ++i)
      for (int64_t g = 0; g < z.G; ++g) {
        const int64_t r = i * z.G + g, h = it.hkv * z.G + g;
        const int64_t row = (it.b * z.H + h) * z.L + it.r0 + i;
        const float* o = w.o.data() + r * z.Dv;
        const bool seen = w.l[r] > 0.0f || std::isnan(w.l[r]);  // else the row sees nothing
        const float inv = seen ? 1.0f / w.l[r] : 0.0f;
        if (out32 != nullptr)
          for (int64_t d = 0; d < z.Dv; ++d) out32[row * z.Dv + d] = seen ? o[d] * inv : 0.0f;
        else
          for (int64_t d = 0; d < z.Dv; ++d)
            out[row * z.Dv + d] = static_cast<T>(seen ? o[d] * inv : 0.0f);
        const float log_l = seen ? std::log(w.l[r]) : 0.0f;
        lse[row] = seen ? w.m[r] + log_l : kNegInf;
        rest[row] = seen ? (w.m[r] - lse[row]) + log_l : 0.0f;
      }
  }

  void run(const Item& it, Scratch& w) const {
    const int64_t M = z.G * it.rows;
    std::fill(w.o.begin(), w.o.begin() + M * z.Dv, 0.0f);
    std::fill(w.m.begin(), w.m.begin() + M, kNegInf);
    std::fill(w.l.begin(), w.l.begin() + M, 0.0f);
    if (it.kmin < it.kmax) load_queries(it, w);
    const T* kh = k + it.b * ks[0] + it.hkv * ks[1];
    const T* vh = v + it.b * vs[0] + it.hkv * vs[1];
    for (int64_t k0 = it.kmin; k0 < it.kmax; k0 += z.KB)
      block(it, w, k0, std::min(z.KB, it.kmax - k0), kh, vh);
    finish(it, w);
  }
};

}  // namespace
}  // namespace attnkit_native

// The backward kernel of span_attention.cpp (the gradients of q, k, v): its math, its
// blocking and its data; span_backward.cpp schedules it and is the op.
//
//
// The math. Row i of batch row b sees keys [lo[b,i], hi[b,i]) as in the forward; with its
// scores s_ij = scale·q_i·k_j, their softcap and ALiBi t_ij = c·tanh(s_ij/c) − a_i·|p_i − j|
// (t = s without them), the forward's lse_i and output o_i, and the incoming gradients do_i
// (of out) and g_i (of lse; 0 where none flows), query head h reading K/V head h / G:
//
//   P_ij  = exp(t_ij − lse_i − rest_i)           0 where row i does not see key j
//   Δ_i   = do_i · o_i − g_i
//   dv_j  = Σ_i P_ij · do_i
//   ds_ij = P_ij · (do_i · v_j − Δ_i) · t'_ij    t' = 1 − tanh²(s_ij/c), 1 without softcap
//   dq_i  = scale · Σ_j ds_ij · k_j
//   dk_j  = scale · Σ_i ds_ij · q_i
//
// (ALiBi's slopes are constants: the bias has no gradient to take; rest_i is what the
// forward's rounding of lse_i to float32 left out, span_attention.cpp, 0 where the lse
// came from elsewhere: at |lse| ~ 10⁴ it moves P by 10⁻³.)
//
// with dk and dv summed over the G query heads of their K/V head (GQA), all in float32.
// A row that sees nothing has P = 0: its dq is 0, and it adds nothing to dk or dv.
//
// The blocking. No atomic adds, so every sum runs in one fixed order and two runs give the
// same bits. Per K/V head and block of KB keys, the query tiles of R rows (their G heads
// stacked, as in the forward) whose rows see a key of the block, in order: S = Qs·Kᵀ
// (Qs = scale·Q), P, dV += Pᵀ·dO, dP = dO·Vᵀ, dS, dK += dSᵀ·Qs. Where the call has
// enough (batch row, K/V head) items for the threads, one thread takes all the blocks
// of an item in order and adds dQ += dS·K of each tile there too (five products a
// block and tile: `head_pass`); else a second pass per K/V head and query tile, as the
// forward, over the key blocks of its hull recomputes S, P, dP, dS for dQ += dS·K (seven:
// `queries_pass`). dQ is times scale at the end. P and dS are written only inside each row's
// interval (0 elsewhere), so a key a row does not see never reaches its gradients through
// 0·NaN in S or dP; where a block is cut (some row sees part of it) and the other factor
// of a product holds a non-finite value (Q or dO rows in pass 1, K rows in pass 2), an
// exact loop over each row's own keys replaces the GEMM. Half inputs take Δ_i = do_i·o_i
// from the float32 output their forward kept (autograd's case), else as Σ_j P_ij·dP_ij in
// a first pass: their output rounded to its dtype would move dP − Δ.
// bfloat16 on the half units multiplies in pairs (half.h), and in the half mode `amx` the
// products of at least kTileRows stacked rows run on AMX's tiles (brgemm).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "backward_data.h"  // and with it common.h and half.h
#include "blas.h"

namespace attnkit_native {

template <typename T>
struct Backward {
  // bfloat16 products on the half units where built (half.h) and asked (`pairs`)
  static constexpr bool kHalfUnits = kPairDots && std::is_same_v<T, at::BFloat16>;
  const Sizes z;
  bool pairs;
  bool amx;  // the products of at least kTileRows stacked rows on AMX's tiles (brgemm)
  const T *q, *k, *v, *out, *dout;  // out null where out32 holds the output
  const float* out32;               // a half call's output in float32 (its forward's), or null
  const float *lse, *rest, *glse;   // (B, H, L) contiguous; rest and glse may be null
  const int64_t *lo, *hi;           // (B, L) contiguous, or null: every row sees every key
  const float* slopes;              // ALiBi (B, L, H) contiguous, or null
  const int64_t* positions;         // ALiBi's aligned positions (B, L) contiguous
  int64_t qs[4], ks[4], vs[4], os[4], ds[4];
  float scale, softcap;
  T *dq, *dk, *dv;  // contiguous

  // Whether the forward's few rows scored through the BLAS (blas.h), in another order than
  // here, and lse is theirs (`rest` given; a context-parallel piece's covers other keys
  // too): then `renormalize`, and Δ summed from the same weights.
  bool few_rows() const { return rest != nullptr && attnkit_native::few_rows(z.G, z.L); }

  // Whether Δ = dO·O from the output: a float32 call's, or a half call's kept in float32;
  // else (a half output rounded to its dtype, or few rows) `delta_pass` sums Σ P·dP.
  bool delta_from_output() const {
    return !few_rows() && (std::is_same_v<T, float> || out32 != nullptr);
  }

  int64_t first(int64_t row) const { return lo ? lo[row] : 0; }
  int64_t last(int64_t row) const { return hi ? hi[row] : z.S; }

  // Stacked row r of a tile (query row r0 + r / G, head hkv·G + r % G): its interval in
  // the block [k0, k0 + n), as [*a, *e) from k0.
  void local(const Tile& t, int64_t r, int64_t k0, int64_t n, int64_t* a, int64_t* e) const {
    const int64_t row = t.b * z.L + t.r0 + r / z.G;
    const int64_t f = first(row), l = last(row);
    *a = std::clamp<int64_t>(f - k0, 0, n);
    *e = std::clamp<int64_t>(l - k0, 0, n);
    if (f >= l) *a = *e = 0;
  }

  // Rows of (b, h) in stacked order: scaled queries, dO, Δ = dO·O − g, lse and its rest.
  void stack(int64_t b, int64_t h, Rows& rows) const {
    const int64_t hkv = h / z.G, g = h % z.G;
    for (int64_t l = 0; l < z.L; ++l) {
      const int64_t r = ((b * z.Hkv + hkv) * z.L + l) * z.G + g, at = (b * z.H + h) * z.L + l;
      const T* qi = q + b * qs[0] + h * qs[1] + l * qs[2];
      const int64_t o_at = b * os[0] + h * os[1] + l * os[2];
      const T* di = dout + b * ds[0] + h * ds[1] + l * ds[2];
      for (int64_t d = 0; d < z.D; ++d) rows.q[r * z.D + d] = static_cast<float>(qi[d]) * scale;
      float dot = 0.0f;
      for (int64_t d = 0; d < z.Dv; ++d) {
        const float x = static_cast<float>(di[d]);
        rows.dout[r * z.Dv + d] = x;
        dot += x * (out32 ? out32[o_at + d] : static_cast<float>(out[o_at + d]));
      }
      rows.delta[r] = (delta_from_output() ? dot : 0.0f) - (glse ? glse[at] : 0.0f);
      rows.lse[r] = lse[at];
      rows.rest[r] = rest ? rest[at] : 0.0f;
#ifdef ATTNKIT_PAIR_DOTS
      if constexpr (kHalfUnits) {
        if (pairs) {
          pack_row_pairs(qi, z.D, rows.qp.data() + r * pair_count(z.D));
          pack_row_pairs(di, z.Dv, rows.dop.data() + r * pair_count(z.Dv));
          std::copy(qi, qi + z.D, rows.qh.begin() + r * z.D);
          std::copy(di, di + z.Dv, rows.doh.begin() + r * z.Dv);
        }
      }
#endif
    }
  }

  // Tile t's stacked rows of K/V head hkv transposed: Qᵀ (D × M) and dOᵀ (Dv × M) where
  // Rows keeps them (float32 products).
  void transpose_tile(Rows& rows, const Tile& t, int64_t hkv) const {
    const int64_t M = z.G * t.rows, r = ((t.b * z.Hkv + hkv) * z.L + t.r0) * z.G;
    transpose(rows.q.data() + r * z.D, M, z.D, rows.qt.data() + r * z.D);
    transpose(rows.dout.data() + r * z.Dv, M, z.Dv, rows.dot.data() + r * z.Dv);
  }

  // Keys [k0, k0 + n) of batch row b, K/V head hkv, as float.
  View block(int64_t b, int64_t hkv, int64_t k0, int64_t n, Scratch& w) const {
    View x{};  // every pointer null, the strides 0
    x.hkv = hkv;
    const T* kh = k + b * ks[0] + hkv * ks[1] + k0 * ks[2];
    const T* vh = v + b * vs[0] + hkv * vs[1] + k0 * vs[2];
#ifdef ATTNKIT_PAIR_DOTS
    if constexpr (kHalfUnits) {
      if (pairs) {  // packed once for every tile of the block
        pack_key_pairs(kh, n, z.D, ks[2], w.kp.data(), z.KW);
        pack_key_pairs(vh, n, z.Dv, vs[2], w.vp.data(), z.KW);
        pack_value_pairs(kh, n, z.D, ks[2], w.kn.data());
        x.kh = kh, x.ldk = ks[2];
        return x;
      }
    }
#endif
    x.k = as_float(kh, n, z.D, ks[2], w.k.data(), &x.ldk);
    x.v = as_float(vh, n, z.Dv, vs[2], w.v.data(), &x.ldv);
    pack_transposed(x.k, n, z.D, x.ldk, w.kt.data(), z.KW);  // zero past n
    pack_transposed(x.v, n, z.Dv, x.ldv, w.vt.data(), z.KW);
    x.kt = w.kt.data(), x.vt = w.vt.data();
    return x;
  }

  // A block's view with tile t's stacked rows.
  View with_rows(View x, const Rows& rows, const Tile& t) const {
    const int64_t r = ((t.b * z.Hkv + x.hkv) * z.L + t.r0) * z.G;
    x.q = rows.q.data() + r * z.D, x.dout = rows.dout.data() + r * z.Dv;
    x.delta = rows.delta.data() + r, x.lse = rows.lse.data() + r;
    x.rest = rows.rest.data() + r;
    if (pairs) {
      x.qp = rows.qp.data() + r * pair_count(z.D), x.dop = rows.dop.data() + r * pair_count(z.Dv);
      x.qh = rows.qh.data() + r * z.D, x.doh = rows.doh.data() + r * z.Dv;
    } else {
      x.qt = rows.qt.data() + r * z.D, x.dot = rows.dot.data() + r * z.Dv;
    }
    return x;
  }

  // Stacked row r's scores p[a, e) of the block from k0 as the forward turns them into t:
  // softcap (its derivative t' = 1 − (t/c)² kept in w.cap[a, e)), then ALiBi.
  void transform(const Tile& t, const View& x, int64_t r, int64_t k0, float* p, int64_t a,
                 int64_t e, Scratch& w) const {
    if (softcap > 0) {
      softcap_inplace(p + a, e - a, softcap);
      const Vec one(1.0f), inv(1.0f / softcap);
      int64_t j = a;
      for (; j + Vec::size() <= e; j += Vec::size()) {
        const Vec u = Vec::loadu(p + j) * inv;
        (one - u * u).store(w.cap.data() + j);
      }
      for (; j < e; ++j) w.cap[j] = 1.0f - (p[j] / softcap) * (p[j] / softcap);
    }
    if (slopes != nullptr) {
      const int64_t row = t.b * z.L + t.r0 + r / z.G;
      const float slope = slopes[row * z.H + x.hkv * z.G + r % z.G];
      alibi_inplace(p, a, e, slope, static_cast<float>(positions[row] - k0));
    }
  }

  // P and dS of the tile's M stacked rows against the block [k0, k0 + n) in w.p, w.ds
  // (row stride KB), each only inside its row's interval; dS without softcap's t' where
  // `chain` is false (delta_pass's P·dP); returns whether every row sees every key of the
  // block.
  bool weights(const Tile& t, const View& x, Scratch& w, int64_t k0, int64_t n,
               bool chain = true) const {
    const int64_t M = z.G * t.rows;
    products(x, w, M, n);
    bool full = true;
    for (int64_t r = 0; r < M; ++r) {
      int64_t a = 0, e = 0;
      local(t, r, k0, n, &a, &e);
      full &= a == 0 && e == n;
      float *p = w.p.data() + r * z.KW, *s = w.ds.data() + r * z.KW;
      std::fill(p, p + a, 0.0f), std::fill(s, s + a, 0.0f);
      std::fill(p + e, p + n, 0.0f), std::fill(s + e, s + n, 0.0f);
      if (a >= e) continue;
      if (pairs) scale_inplace(p + a, e - a, scale);  // scores of unscaled pairs
      transform(t, x, r, k0, p, a, e, w);
      gradient_weights(p + a, s + a, e - a, x.lse[r], x.rest[r], x.delta[r]);
      if (chain && softcap > 0)
        at::vec::map2<float>([](Vec d, Vec c) { return d * c; }, s + a, s + a, w.cap.data() + a,
                             e - a);
    }
    return full;
  }

  // S = Q·Kᵀ and dP = dO·Vᵀ of the tile's M stacked rows against the block's n keys, in
  // w.p and w.ds: float32 GEMMs over whole tiles of keys (blas.h; columns past n are
  // never read), or the half units' tiles (S unscaled), or AMX's (all KW packed keys).
  void products(const View& x, Scratch& w, int64_t M, int64_t n) const {
#ifdef ATTNKIT_PAIR_DOTS
    if (amx && M >= kTileRows) {
      tile_gemm_nt(M, pair_count(z.D), x.qp, w.kp.data(), z.KW, w.p.data(), z.KW, w.tiles);
      tile_gemm_nt(M, pair_count(z.Dv), x.dop, w.vp.data(), z.KW, w.ds.data(), z.KW, w.tiles);
      return;
    }
    if (pairs) {
      pair_gemm_nt(M, n, pair_count(z.D), x.qp, w.kp.data(), z.KW, w.p.data(), z.KW);
      pair_gemm_nt(M, n, pair_count(z.Dv), x.dop, w.vp.data(), z.KW, w.ds.data(), z.KW);
      return;
    }
#endif
    const int64_t keys = tile_keys(n);
    gemm(M, keys, z.D, x.q, z.D, x.kt, z.KW, w.p.data(), z.KW, false);
    gemm(M, keys, z.Dv, x.dout, z.Dv, x.vt, z.KW, w.ds.data(), z.KW, false);
  }

  // p = exp((p − m) − rest) and s = p · (s − delta) over n entries (p − m exact where p is
  // near m, so rest, lse's remainder, counts).
  static void gradient_weights(float* p, float* s, int64_t n, float m, float rest, float delta) {
    const Vec vm(m), vr(rest), vd(delta);
    int64_t j = 0;
    for (; j + Vec::size() <= n; j += Vec::size()) {
      const Vec x = ((Vec::loadu(p + j) - vm) - vr).exp_u20();
      x.store(p + j);
      (x * (Vec::loadu(s + j) - vd)).store(s + j);
    }
    for (; j < n; ++j) {
      p[j] = std::exp((p[j] - m) - rest);
      s[j] = p[j] * (s[j] - delta);
    }
  }

  // `few_rows`: scores a few ulps off the forward's (10⁻² in a weight at logits near 10⁴,
  // where a lone key weighs exactly 1) are normalised by this pass's own scores: rest_i +=
  // log Σ_j exp(t_ij − lse_i − rest_i), so Σ_j P_ij = 1 (and Δ = Σ P·dP, not dO·O).
  void renormalize(Rows& rows, const Tile& t, int64_t hkv, Scratch& w) const {
    const int64_t M = z.G * t.rows, r0 = ((t.b * z.Hkv + hkv) * z.L + t.r0) * z.G;
    std::vector<float> sum(M, 0.0f);
    for (int64_t k0 = t.kmin; k0 < t.kmax; k0 += z.KB) {
      const int64_t n = std::min(z.KB, t.kmax - k0);
      weights(t, with_rows(block(t.b, hkv, k0, n, w), rows, t), w, k0, n, false);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t j = 0; j < n; ++j) sum[r] += w.p[r * z.KW + j];
    }
    for (int64_t r = 0; r < M; ++r)
      if (sum[r] > 0.0f) rows.rest[r0 + r] += std::log(sum[r]);  // else it sees nothing
  }

  // Half inputs: Δ_i = Σ_j P_ij·dP_ij over the row's keys, in float32 (the same number as
  // dO·O, without the output's rounding to its dtype, which cancellation in dP − Δ would
  // magnify), added to the −g that stack() left there.
  void delta_pass(Rows& rows, const Tile& t, int64_t hkv, Scratch& w) const {
    const int64_t M = z.G * t.rows, r0 = ((t.b * z.Hkv + hkv) * z.L + t.r0) * z.G;
    std::vector<float> sum(M, 0.0f);
    for (int64_t k0 = t.kmin; k0 < t.kmax; k0 += z.KB) {
      const int64_t n = std::min(z.KB, t.kmax - k0);
      View x = with_rows(block(t.b, hkv, k0, n, w), rows, t);
      std::vector<float> zero(M, 0.0f);
      x.delta = zero.data();  // dS = P·(dP − 0) = P·dP
      weights(t, x, w, k0, n, false);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t j = 0; j < n; ++j) sum[r] += w.ds[r * z.KW + j];
    }
    for (int64_t r = 0; r < M; ++r) rows.delta[r0 + r] += sum[r];
  }

  // dk, dv of key block [k0, k0 + n) of (b, hkv) from every tile that sees it; with
  // `dq_rows` (the item's stacked rows × D), each tile's dq from the same dS too.
  void keys_pass(const Rows& rows, const std::vector<Tile>& tiles, int64_t b, int64_t hkv,
                 int64_t k0, int64_t n, Scratch& w, float* dq_rows = nullptr) const {
    std::fill(w.dk.begin(), w.dk.begin() + z.KW * z.D, 0.0f);
    std::fill(w.dv.begin(), w.dv.begin() + z.KW * z.Dv, 0.0f);
    const View keys = block(b, hkv, k0, n, w);
    for (const Tile& t : tiles) {
      if (t.b != b || t.kmax <= k0 || t.kmin >= k0 + n || t.kmin >= t.kmax) continue;
      const View x = with_rows(keys, rows, t);
      const int64_t M = z.G * t.rows;
      const bool full = weights(t, x, w, k0, n);
      if (dq_rows != nullptr) queries(t, x, w, k0, n, full, dq_rows + t.r0 * z.G * z.D);
      if (full || all_finite(x.dout, M, z.Dv, z.Dv))
        over_rows(w, w.p.data(), 1.0f, x.dot, x.doh, M, n, z.Dv, w.dv.data());
      else
        exact(t, w.p.data(), x.dout, z.Dv, w.dv.data(), k0, n);
      if (full || all_finite(x.q, M, z.D, z.D))
        over_rows(w, w.ds.data(), scale, x.qt, x.qh, M, n, z.D, w.dk.data());
      else
        exact(t, w.ds.data(), x.q, z.D, w.dk.data(), k0, n);
    }
    const auto [kj, kd] = acc_strides(z.D);
    const auto [vj, vd] = acc_strides(z.Dv);
    for (int64_t j = 0; j < n; ++j) {
      T* dkj = dk + ((b * z.Hkv + hkv) * z.S + k0 + j) * z.D;
      T* dvj = dv + ((b * z.Hkv + hkv) * z.S + k0 + j) * z.Dv;
      for (int64_t d = 0; d < z.D; ++d) dkj[d] = static_cast<T>(w.dk[j * kj + d * kd]);
      for (int64_t d = 0; d < z.Dv; ++d) dvj[d] = static_cast<T>(w.dv[j * vj + d * vd]);
    }
  }

  // The strides (key, column) of a block's accumulated dK or dV of `width` columns: dKᵀ
  // and dVᵀ (row stride KW) in float32 and on AMX's tiles, dK and dV on the half units.
  std::pair<int64_t, int64_t> acc_strides(int64_t width) const {
    if (pairs && !amx) return {width, 1};
    return {1, z.KW};
  }

  // acc += xᵀ·y over the M stacked rows: x a block's P or dS (M × n, row stride KW), y
  // the rows' dO or scaled Q; in float32 accᵀ (width × n, row stride KW) += yᵀ·x from
  // the tile's transposed rows (yt: width × M), on the half units acc (n × width) from
  // the rows as they are (yh, then times a: the scale Q leaves out); with AMX's tiles
  // accᵀ += yᵀ·(a·x), x's rows interleaved in pairs as brgemm reads B and yᵀ's rows as
  // pairs of y's rows (on the tiles from kTileRows rows, else on the pair dots).
  void over_rows(Scratch& w, const float* x, float a, const float* yt, const at::BFloat16* yh,
                 int64_t M, int64_t n, int64_t width, float* acc) const {
#ifdef ATTNKIT_PAIR_DOTS
    if (amx) {
      const int64_t M2 = pair_count(M);
      interleave_rows(x, M, n, z.KW, a, w.tp.data());         // (M/2 × n) pairs of rows
      transpose_row_pairs(yh, M, width, width, w.rp.data());  // (width × M/2)
      if (M >= kTileRows)
        tile_gemm_add(width, n, M2, w.rp.data(), M2, w.tp.data(), acc, z.KW, w.tiles);
      else
        pair_gemm_add(width, n, M2, w.rp.data(), M2, 1, w.tp.data(), acc, z.KW);
      return;
    }
    if (pairs) {
      interleave_rows(x, M, n, z.KW, a, w.tp.data());      // (M/2 × n) pairs of rows
      pack_value_pairs(yh, M, width, width, w.rp.data());  // (M/2 × width)
      pair_gemm_add(n, width, pair_count(M), w.tp.data(), 1, n, w.rp.data(), acc, width);
      return;
    }
#endif
    gemm(width, n, M, yt, M, x, z.KW, acc, z.KW, true);
  }

  // acc[j] += Σ_r x[r, j] · y[r] over each stacked row's own keys j (pass 1's exact loop;
  // acc laid out as over_rows sums it).
  void exact(const Tile& t, const float* x, const float* y, int64_t width, float* acc, int64_t k0,
             int64_t n) const {
    const auto [sj, sd] = acc_strides(width);
    for (int64_t r = 0; r < z.G * t.rows; ++r) {
      int64_t a = 0, e = 0;
      local(t, r, k0, n, &a, &e);
      for (int64_t j = a; j < e; ++j)
        for (int64_t d = 0; d < width; ++d)
          acc[j * sj + d * sd] += x[r * z.KW + j] * y[r * width + d];
    }
  }

  // acc (the tile's stacked rows × D) += dS·K of the block in w.ds; an exact loop over
  // each row's own keys where the block is cut and holds a non-finite key.
  void queries(const Tile& t, const View& x, Scratch& w, int64_t k0, int64_t n, bool full,
               float* acc) const {
    const int64_t M = z.G * t.rows;
#ifdef ATTNKIT_PAIR_DOTS
    if (pairs) {
      if (!full && !all_finite_half(x.kh, n, z.D, x.ldk))
        return queries_exact(t, w, k0, n, x.kh, x.ldk, acc);
      const int64_t ldp = pair_count(z.KW), pe = n + n % 2;
      for (int64_t r = 0; r < M; ++r) {
        float* s = w.ds.data() + r * z.KW;
        if (n % 2) s[n] = 0.0f;  // the last key's missing partner
        weights_pairs(s, 0, pe, w.dsp.data() + r * ldp);
      }
      if (amx && M >= kTileRows)
        tile_gemm_add(M, z.D, pe / 2, w.dsp.data(), ldp, w.kn.data(), acc, z.D, w.tiles);
      else
        pair_gemm_add(M, z.D, pe / 2, w.dsp.data(), ldp, 1, w.kn.data(), acc, z.D);
      return;
    }
#endif
    if (full || all_finite(x.k, n, z.D, x.ldk)) {
      gemm(M, z.D, n, w.ds.data(), z.KW, x.k, x.ldk, acc, z.D, true);
      return;
    }
    queries_exact(t, w, k0, n, x.k, x.ldk, acc);
  }

  // acc += dS·K over each stacked row's own keys (K float32, or bfloat16 as it is).
  template <typename E>
  void queries_exact(const Tile& t, const Scratch& w, int64_t k0, int64_t n, const E* kb,
                     int64_t ldk, float* acc) const {
    for (int64_t r = 0; r < z.G * t.rows; ++r) {
      int64_t a = 0, e = 0;
      local(t, r, k0, n, &a, &e);
      for (int64_t j = a; j < e; ++j)
        for (int64_t d = 0; d < z.D; ++d)
          acc[r * z.D + d] += w.ds[r * z.KW + j] * static_cast<float>(kb[j * ldk + d]);
    }
  }

  // dq of query rows [r0, r0 + rows) of (b, hkv) from their stacked rows' sums, times scale.
  void write_dq(const float* acc, int64_t b, int64_t hkv, int64_t r0, int64_t rows) const {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t g = 0; g < z.G; ++g) {
        T* dst = dq + (((b * z.H + hkv * z.G + g) * z.L) + r0 + i) * z.D;
        const float* src = acc + (i * z.G + g) * z.D;
        for (int64_t d = 0; d < z.D; ++d) dst[d] = static_cast<T>(src[d] * scale);
      }
  }

  // One item (b, hkv) whole: its key blocks in order, dk and dv of each, and dq of every
  // tile summed over the blocks in the same order.
  void head_pass(const Rows& rows, const std::vector<Tile>& tiles, int64_t b, int64_t hkv,
                 Scratch& w) const {
    std::vector<float> acc(z.L * z.G * z.D, 0.0f);
    for (int64_t k0 = 0; k0 < z.S; k0 += z.KB)
      keys_pass(rows, tiles, b, hkv, k0, std::min(z.KB, z.S - k0), w, acc.data());
    write_dq(acc.data(), b, hkv, 0, z.L);
  }

  // The second pass: dq of a tile over the key blocks of its hull.
  void queries_pass(const Rows& rows, const Tile& t, int64_t hkv, Scratch& w) const {
    std::fill(w.dq.begin(), w.dq.begin() + z.G * t.rows * z.D, 0.0f);
    for (int64_t k0 = t.kmin; k0 < t.kmax; k0 += z.KB) {
      const int64_t n = std::min(z.KB, t.kmax - k0);
      const View x = with_rows(block(t.b, hkv, k0, n, w), rows, t);
      queries(t, x, w, k0, n, weights(t, x, w, k0, n), w.dq.data());
    }
    write_dq(w.dq.data(), t.b, hkv, t.r0, t.rows);
  }
};

}  // namespace attnkit_native

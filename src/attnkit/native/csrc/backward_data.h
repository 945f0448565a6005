// The backward kernel's data (backward.h): its sizes, its tiles of query rows, the call's
// rows stacked as the tiles read them, a thread's scratch and one block's view.

#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "blas.h"
#include "common.h"
#include "half.h"

namespace attnkit_native {

struct Sizes {
  int64_t B, H, Hkv, G, L, S, D, Dv, R, KB;
  // a row of a block's P and dS: whole tiles of 32 keys (at least blas.h's tiles)
  int64_t KW = std::max((KB + 31) / 32 * 32, tile_keys(KB));
};

// Query rows [r0, r0 + rows) of batch row b, whose intervals' hull is [kmin, kmax).
struct Tile {
  int64_t b, r0, rows, kmin, kmax;
};

// The call's rows in float32, stacked as the tiles read them (B, Hkv, L·G: query row i's
// G heads side by side): scaled queries, dO, Δ and lse, made once for both passes, and
// each tile's scaled queries and dO transposed (qt, dot: D × M and Dv × M at the tile's
// rows, for the products over rows, blas.h); on the half units (half.h) instead the
// queries (unscaled) and dO as they are, and as pairs along D and Dv.
struct Rows {
  std::vector<float> q, dout, delta, lse, rest, qt, dot;
  std::vector<Pair> qp, dop;
  std::vector<at::BFloat16> qh, doh;
  Rows(const Sizes& z, bool pairs)
      : q(z.B * z.H * z.L * z.D), dout(z.B * z.H * z.L * z.Dv), delta(z.B * z.H * z.L),
        lse(z.B * z.H * z.L), rest(z.B * z.H * z.L), qt(pairs ? 0 : z.B * z.H * z.L * z.D),
        dot(pairs ? 0 : z.B * z.H * z.L * z.Dv), qp(pairs ? z.B * z.H * z.L * pair_count(z.D) : 0),
        dop(pairs ? z.B * z.H * z.L * pair_count(z.Dv) : 0), qh(pairs ? z.B * z.H * z.L * z.D : 0),
        doh(pairs ? z.B * z.H * z.L * z.Dv : 0) {}
};

// A thread's scratch: a block's P and dS (stacked rows × KW), a row's softcap derivative
// t', K and V as float (half dtypes) and transposed (kt, vt: D × KW, Dv × KW), and the
// accumulated gradients (dk, dv: dKᵀ and dVᵀ, D × KW and Dv × KW; on the half units dK
// and dV, KW × D and KW × Dv, but dKᵀ and dVᵀ again on AMX's tiles); on the half units
// the block's K and V as pairs along D (kp, vp: for S and dP) and K as pairs of keys (kn:
// for dQ), two rows of P or dS interleaved (tp), two rows of dO or Q (rp; on AMX's tiles
// transposed), dS as pairs of keys (dsp).
struct Scratch {
  Buffer p, ds, cap, k, v, kt, vt, dq, dk, dv;
  BufferOf<Pair> kp, vp, kn, tp, rp, dsp;
  TileState tiles;
  Scratch(const Sizes& z, bool pairs)
      : p(z.G * z.R * z.KW), ds(z.G * z.R * z.KW), cap(z.KB), k(pairs ? 0 : z.KB * z.D),
        v(pairs ? 0 : z.KB * z.Dv), kt(pairs ? 0 : z.D * z.KW), vt(pairs ? 0 : z.Dv * z.KW),
        dq(z.G * z.R * z.D), dk(z.KW * z.D), dv(z.KW * z.Dv),
        kp(pairs ? pair_count(z.D) * z.KW : 0), vp(pairs ? pair_count(z.Dv) * z.KW : 0),
        kn(pairs ? pair_count(z.KB) * z.D : 0), tp(pairs ? pair_count(z.G * z.R) * z.KB : 0),
        rp(pairs ? pair_count(z.G * z.R) * std::max(z.D, z.Dv) : 0),
        dsp(pairs ? z.G * z.R * pair_count(z.KW) : 0) {}
};

// One tile's stacked rows (of K/V head hkv) in Rows, and one block's keys and values as
// float (row strides) and transposed (row stride KW); on the half units the rows' pairs
// and bfloat16 copies, and the block's keys as they are (row stride ldk).
struct View {
  const float *q, *dout, *delta, *lse, *rest;
  const float *k, *v;
  int64_t ldk, ldv, hkv;
  const float *qt = nullptr, *dot = nullptr, *kt = nullptr, *vt = nullptr;
  const Pair *qp = nullptr, *dop = nullptr;
  const at::BFloat16 *qh = nullptr, *doh = nullptr, *kh = nullptr;
};

}  // namespace attnkit_native

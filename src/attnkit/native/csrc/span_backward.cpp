// attnkit's native kernel: the backward of span_attention.cpp as an op. backward.h holds
// the math, the blocking and the kernel; here are its schedule (which passes run, on
// which threads: queue.h) and the op's checks.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "backward.h"
#include "common.h"
#include "queue.h"

namespace attnkit_native {
namespace {

// The tiles of every batch row, each with its rows' hull (0, 0 where no row sees a key).
std::vector<Tile> tiles_of(const Sizes& z, const int64_t* lo, const int64_t* hi) {
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < z.B; ++b)
    for (int64_t r0 = 0; r0 < z.L; r0 += z.R) {
      const int64_t rows = std::min(z.R, z.L - r0);
      const auto [kmin, kmax] = hull(lo, hi, b, z.L, z.S, r0, rows);
      tiles.push_back({b, r0, rows, kmin, kmax});
    }
  return tiles;
}

// Whether `items` (batch row, K/V head) pairs keep the threads busy taken one a thread:
// every thread as many, or at least four each (the last round's idle threads then cost
// at most a fifth).
bool one_pass(int64_t items) {
  const int64_t threads = at::get_num_threads();
  return items >= threads && (items % threads == 0 || items >= 4 * threads);
}

// Items on the threads (queue.h), each thread with its own scratch.
template <typename F>
void run_items(int64_t count, const Sizes& z, bool pairs, const F& f) {
  run_queue(count, [&] { return Scratch(z, pairs); }, f);
}

template <typename T>
void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& dout, const at::Tensor& lse, const std::optional<at::Tensor>& glse,
              const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi,
              const std::optional<at::Tensor>& slopes, const std::optional<at::Tensor>& positions,
              double scale, double softcap, int64_t rows, int64_t keys, bool half, bool amx,
              const std::optional<at::Tensor>& rest, at::Tensor& dq, at::Tensor& dk,
              at::Tensor& dv) {
  const int64_t H = q.size(1), Hkv = k.size(1);
  const Sizes z{q.size(0), H, Hkv, H / Hkv, q.size(2), k.size(2), q.size(3), v.size(3), rows, keys};
  const bool pairs = Backward<T>::kHalfUnits && half;
  const bool out_in_dtype = out.scalar_type() == q.scalar_type();
  Backward<T> kern{.z = z,
                   .pairs = pairs,
                   .amx = pairs && amx && at::native::cpublas::could_pack(at::kBFloat16),
                   .q = q.data_ptr<T>(),
                   .k = k.data_ptr<T>(),
                   .v = v.data_ptr<T>(),
                   .out = out_in_dtype ? out.data_ptr<T>() : nullptr,
                   .dout = dout.data_ptr<T>(),
                   .out32 = out_in_dtype ? nullptr : out.data_ptr<float>(),
                   .lse = lse.data_ptr<float>(),
                   .rest = rest ? rest->data_ptr<float>() : nullptr,
                   .glse = glse ? glse->data_ptr<float>() : nullptr,
                   .lo = lo ? lo->data_ptr<int64_t>() : nullptr,
                   .hi = hi ? hi->data_ptr<int64_t>() : nullptr,
                   .slopes = slopes ? slopes->data_ptr<float>() : nullptr,
                   .positions = positions ? positions->data_ptr<int64_t>() : nullptr,
                   .scale = static_cast<float>(scale),
                   .softcap = static_cast<float>(softcap),
                   .dq = dq.data_ptr<T>(),
                   .dk = dk.data_ptr<T>(),
                   .dv = dv.data_ptr<T>()};  // the strides below
  for (int d = 0; d < 4; ++d) {
    kern.qs[d] = q.stride(d);
    kern.ks[d] = k.stride(d);
    kern.vs[d] = v.stride(d);
    kern.os[d] = out.stride(d);
    kern.ds[d] = dout.stride(d);
  }
  Rows stacked(z, kern.pairs);
  at::parallel_for(0, z.B * z.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) kern.stack(bh / z.H, bh % z.H, stacked);
  });
  const std::vector<Tile> tiles = tiles_of(z, kern.lo, kern.hi);
  const int64_t count = static_cast<int64_t>(tiles.size());
  if (!kern.pairs)
    at::parallel_for(0, count * z.Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        kern.transpose_tile(stacked, tiles[t / z.Hkv], t % z.Hkv);
    });
  if (kern.few_rows())  // the forward's few rows scored through the BLAS
    run_items(count * z.Hkv, z, kern.pairs, [&](int64_t t, Scratch& w) {
      kern.renormalize(stacked, tiles[t / z.Hkv], t % z.Hkv, w);
    });
  if (!kern.delta_from_output())
    run_items(count * z.Hkv, z, kern.pairs, [&](int64_t t, Scratch& w) {
      kern.delta_pass(stacked, tiles[t / z.Hkv], t % z.Hkv, w);
    });
  if (one_pass(z.B * z.Hkv)) {
    run_items(z.B * z.Hkv, z, kern.pairs, [&](int64_t t, Scratch& w) {
      kern.head_pass(stacked, tiles, t / z.Hkv, t % z.Hkv, w);
    });
    return;
  }
  const int64_t blocks = (z.S + z.KB - 1) / z.KB;
  run_items(z.B * z.Hkv * blocks, z, kern.pairs, [&](int64_t t, Scratch& w) {
    const int64_t b = t / (z.Hkv * blocks), hkv = t / blocks % z.Hkv, k0 = t % blocks * z.KB;
    kern.keys_pass(stacked, tiles, b, hkv, k0, std::min(z.KB, z.S - k0), w);
  });
  run_items(count * z.Hkv, z, kern.pairs, [&](int64_t t, Scratch& w) {
    kern.queries_pass(stacked, tiles[t / z.Hkv], t % z.Hkv, w);
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "attnkit_native::span_backward: ", what); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> span_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, const std::optional<at::Tensor>& glse,
    const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi,
    const std::optional<at::Tensor>& slopes, const std::optional<at::Tensor>& positions,
    double scale, double softcap, int64_t rows, int64_t keys, bool half, bool amx,
    const std::optional<at::Tensor>& rest) {
  // attnkit.native validates every input before it gets here; these guard the memory.
  for (const at::Tensor* t : {&q, &k, &v, &out, &dout}) {
    const bool float_out = t == &out && t->scalar_type() == at::kFloat;  // a half call's
    check(
        t->dim() == 4 && t->device().is_cpu() && (t->scalar_type() == q.scalar_type() || float_out),
        "q, k, v, dout: 4-D CPU tensors of one dtype; out in it or float32");
    check(t->size(3) <= 1 || t->stride(3) == 1, "unit last stride");
    check(t->stride(2) >= t->size(3), "rows at least a row apart (a GEMM's leading dimension)");
  }
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
  check(k.size(0) == B && v.size(0) == B && k.size(1) > 0 && H % k.size(1) == 0, "heads");
  check(v.size(1) == k.size(1) && v.size(2) == k.size(2) && k.size(3) == q.size(3), "k, v");
  check(out.sizes() == dout.sizes() && out.size(0) == B && out.size(1) == H && out.size(2) == L &&
            out.size(3) == v.size(3),
        "out, dout (B, H, L, Dv)");
  for (const at::Tensor* t : {&lse, glse ? &*glse : &lse, rest ? &*rest : &lse})
    check(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
              t->size(0) == B && t->size(1) == H && t->size(2) == L,
          "lse (B, H, L) float32");
  check(lo.has_value() == hi.has_value(), "spans take lo and hi");
  if (lo)
    for (const at::Tensor* t : {&*lo, &*hi})
      check(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 2 &&
                t->size(0) == B && t->size(1) == L,
            "spans (B, L) int64");
  check(slopes.has_value() == positions.has_value(), "ALiBi takes slopes and positions");
  if (slopes) {
    check(slopes->scalar_type() == at::kFloat && slopes->is_contiguous() && slopes->dim() == 3 &&
              slopes->size(0) == B && slopes->size(1) == L && slopes->size(2) == H,
          "slopes (B, L, H) float32");
    check(positions->scalar_type() == at::kLong && positions->is_contiguous() &&
              positions->dim() == 2 && positions->size(0) == B && positions->size(1) == L,
          "positions (B, L) int64");
  }
  check(softcap >= 0, "softcap >= 0");
  check(rows >= 1 && keys >= 1 && rows * keys * H < (int64_t{1} << 31), "blocking");
  auto dq = at::empty({B, H, L, q.size(3)}, q.options());
  auto dk = at::empty({B, k.size(1), k.size(2), k.size(3)}, q.options());
  auto dv = at::empty({B, v.size(1), v.size(2), v.size(3)}, q.options());
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0) return {dq, dk, dv};
  ATTNKIT_DISPATCH(q.scalar_type(), "attnkit_native::span_backward", [&] {
    backward<scalar_t>(q, k, v, out, dout, lse, glse, lo, hi, slopes, positions, scale, softcap,
                       rows, keys, half, amx, rest, dq, dk, dv);
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace attnkit_native

TORCH_LIBRARY_FRAGMENT(attnkit_native, m) {
  m.def(
      "span_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, "
      "Tensor? glse, Tensor? lo, Tensor? hi, Tensor? slopes, Tensor? positions, float scale, "
      "float softcap, int rows, int keys, bool half=False, bool amx=False, Tensor? rest=None) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("span_backward", &attnkit_native::span_backward);
}

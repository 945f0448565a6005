// attnkit's native kernel, the op: attention where each query row sees one interval of
// keys. forward.h is the kernel (its math and blocking); here its work items, longest
// first (queue.h: a causal mask's late tiles cost more), the op's checks and its schema.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "forward.h"
#include "queue.h"
#include "stages.h"

namespace attnkit_native {
namespace {

// The items of a call, longest first: each tile's hull of intervals.
std::vector<Item> items_of(const Sizes& z, const int64_t* lo, const int64_t* hi) {
  std::vector<Item> items;
  for (int64_t b = 0; b < z.B; ++b)
    for (int64_t r0 = 0; r0 < z.L; r0 += z.R) {
      const int64_t rows = std::min(z.R, z.L - r0);
      const auto [kmin, kmax] = hull(lo, hi, b, z.L, z.S, r0, rows);
      for (int64_t hkv = 0; hkv < z.Hkv; ++hkv) items.push_back({b, hkv, r0, rows, kmin, kmax});
    }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.kmax - x.kmin > y.kmax - y.kmin; });
  return items;
}

template <typename T>
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi,
             const std::optional<at::Tensor>& slopes, const std::optional<at::Tensor>& positions,
             double scale, double softcap, int64_t rows, int64_t keys, bool half, bool amx,
             bool float_out, at::Tensor& out, at::Tensor& lse, at::Tensor& rest) {
  const int64_t H = q.size(1), Hkv = k.size(1);
  const Sizes z{q.size(0), H, Hkv, H / Hkv, q.size(2), k.size(2), q.size(3), v.size(3), rows, keys};
  const bool pairs = Kernel<T>::kHalfUnits && half;
  Kernel<T> kern{.z = z,
                 .pairs = pairs,
                 .amx = pairs && amx && at::native::cpublas::could_pack(at::kBFloat16),
                 .q = q.data_ptr<T>(),
                 .k = k.data_ptr<T>(),
                 .v = v.data_ptr<T>(),
                 .lo = lo ? lo->data_ptr<int64_t>() : nullptr,
                 .hi = hi ? hi->data_ptr<int64_t>() : nullptr,
                 .scale = static_cast<float>(scale),
                 .softcap = static_cast<float>(softcap),
                 .slopes = slopes ? slopes->data_ptr<float>() : nullptr,
                 .positions = positions ? positions->data_ptr<int64_t>() : nullptr,
                 .out = float_out ? nullptr : out.data_ptr<T>(),
                 .out32 = float_out ? out.data_ptr<float>() : nullptr,
                 .lse = lse.data_ptr<float>(),
                 .rest = rest.data_ptr<float>()};  // the strides below
  for (int d = 0; d < 4; ++d) {
    kern.qs[d] = q.stride(d);
    kern.ks[d] = k.stride(d);
    kern.vs[d] = v.stride(d);
  }
  const std::vector<Item> items = items_of(z, kern.lo, kern.hi);
  const auto count = static_cast<int64_t>(items.size());
  ATTNKIT_STAGE(kThreads, std::clamp<int64_t>(at::get_num_threads(), 1, count));
  run_queue(
      count, [&] { return Scratch(z, !std::is_same_v<T, float> && !pairs, pairs); },
      [&](int64_t t, Scratch& w) {
        ATTNKIT_STAGE(kItem);
        kern.run(items[t], w);
      });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "attnkit_native::span_forward: ", what); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> span_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& lo, const std::optional<at::Tensor>& hi,
    const std::optional<at::Tensor>& slopes, const std::optional<at::Tensor>& positions,
    double scale, double softcap, int64_t rows, int64_t keys, bool half, bool amx, bool float_out) {
  // attnkit.native validates every input before it gets here; these guard the memory.
  check(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  check(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  check(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "one dtype");
  for (const at::Tensor* t : {&q, &k, &v}) {
    check(t->size(3) <= 1 || t->stride(3) == 1, "unit last stride");
    check(t->stride(2) >= t->size(3), "rows at least a row apart (a GEMM's leading dimension)");
  }
  check(k.size(0) == q.size(0) && v.size(0) == q.size(0), "batch sizes differ");
  check(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1), "heads");
  check(k.size(2) == v.size(2) && k.size(3) == q.size(3), "key sizes differ");
  check(lo.has_value() == hi.has_value(), "spans take lo and hi");
  if (lo) {
    check(lo->scalar_type() == at::kLong && hi->scalar_type() == at::kLong, "int64 spans");
    check(lo->is_contiguous() && hi->is_contiguous(), "contiguous spans");
    check(lo->dim() == 2 && lo->size(0) == q.size(0) && lo->size(1) == q.size(2), "spans (B, L)");
    check(hi->sizes() == lo->sizes(), "spans (B, L)");
  }
  check(slopes.has_value() == positions.has_value(), "ALiBi takes slopes and positions");
  if (slopes) {
    check(slopes->scalar_type() == at::kFloat && slopes->is_contiguous(), "float32 slopes");
    check(slopes->dim() == 3 && slopes->size(0) == q.size(0) && slopes->size(1) == q.size(2) &&
              slopes->size(2) == q.size(1),
          "slopes (B, L, H)");
    check(positions->scalar_type() == at::kLong && positions->is_contiguous(), "int64 positions");
    check(
        positions->dim() == 2 && positions->size(0) == q.size(0) && positions->size(1) == q.size(2),
        "positions (B, L)");
  }
  check(q.size(2) * q.size(1) * q.size(3) < (int64_t{1} << 31), "sizes within int32 GEMMs");
  check(rows >= 1 && keys >= 1, "blocking");
  check(rows * keys * q.size(1) < (int64_t{1} << 31), "blocking within int32");
  // float_out: the output in float32 for a half call (its backward takes Δ = dO·O from it)
  const auto out_dtype = float_out ? at::kFloat : q.scalar_type();
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options().dtype(out_dtype));
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  auto rest = at::empty_like(lse);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse, rest};
  ATTNKIT_STAGE(kCall);
  ATTNKIT_DISPATCH(q.scalar_type(), "attnkit_native::span_forward", [&] {
    forward<scalar_t>(q, k, v, lo, hi, slopes, positions, scale, softcap, rows, keys, half, amx,
                      float_out, out, lse, rest);
  });
  return {out, lse, rest};
}

// The block sizes Python's cost model and blocking must agree with (attnkit.native.ops
// names them too; a test compares the two): the stacked rows of a partly seen block's
// group, micro.h's register tile; the fewest stacked rows a whole block takes to AMX.
// Each stage's thread-nanoseconds since the last reset (stages.h), where the kernels were
// built with stage timers; else nothing.
c10::Dict<std::string, int64_t> stage_times(bool reset) {
  c10::Dict<std::string, int64_t> times;
  if constexpr (kStageTimers)
    for (int s = 0; s < kStages; ++s) {
      auto& total = stage_totals()[s];
      times.insert(kStageNames[s], reset ? total.exchange(0) : total.load());
    }
  return times;
}

c10::Dict<std::string, int64_t> block_sizes() {
  c10::Dict<std::string, int64_t> sizes;
  sizes.insert("group_rows", kMicroRows);
  sizes.insert("tile_rows", kTileRows);
  return sizes;
}

}  // namespace
}  // namespace attnkit_native

TORCH_LIBRARY(attnkit_native, m) {
  m.def("block_sizes() -> Dict(str, int)");
  m.def("stage_times(bool reset=False) -> Dict(str, int)");
  m.def(
      "span_forward(Tensor q, Tensor k, Tensor v, Tensor? lo, Tensor? hi, Tensor? slopes, "
      "Tensor? positions, float scale, float softcap, int rows, int keys, bool half=False, "
      "bool amx=False, bool float_out=False) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit_native, CPU, m) {
  m.impl("span_forward", &attnkit_native::span_forward);
}

TORCH_LIBRARY_IMPL(attnkit_native, CompositeExplicitAutograd, m) {
  m.impl("block_sizes", &attnkit_native::block_sizes);
  m.impl("stage_times", &attnkit_native::stage_times);
}

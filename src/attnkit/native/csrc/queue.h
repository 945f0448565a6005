// The thread loop of attnkit's kernels: a list of work items on at::parallel_for's
// threads, each thread taking the next item (an atomic counter) until none is left, so
// a long item (a causal mask's late tile) never holds up a thread's whole share. Each
// thread makes its scratch once; an item writes its own rows of the output only, so the
// result does not depend on which thread ran it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace attnkit_native {

// f(item, scratch) for item in [0, count), on at most min(threads, count) threads, each
// with its own `make()`.
template <typename Make, typename F>
void run_queue(int64_t count, const Make& make, const F& f) {
  if (count <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::clamp<int64_t>(at::get_num_threads(), 1, count);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto scratch = make();
    for (int64_t t = next++; t < count; t = next++) f(t, scratch);
  });
}

}  // namespace attnkit_native

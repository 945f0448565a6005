// Stage timers: where a kernel's thread-time goes, stage by stage, so that the stages that
// are not products (packing, the softmax, conversions, checks) can be measured and
// optimised on any CPU against a budget, and one run on another CPU gives its products'
// rate. Compiled in only by the build flag ATTNKIT_STAGES (`ATTNKIT_NATIVE=stages`, a
// build key of its own); elsewhere `ATTNKIT_STAGE(...)` is nothing and the op
// `stage_times` returns an empty dict.
//
// `ATTNKIT_STAGE(kScores);` times the rest of its scope (std::chrono::steady_clock) and
// adds it to the process's total for that stage (one relaxed atomic add per scope: a
// scope is a block or a group of rows, thousands of cycles). Stages nest only inside
// `kItem`, a whole work item, so the item's time less its stages is the unattributed
// rest, and the call's wall time times its threads less the items' is idle time.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace attnkit_native {

enum Stage : int {
  kCall,     // the op's wall time (one thread)
  kThreads,  // the op's wall time times the threads it ran on
  kItem,     // work items, whole (what the stages below share)
  kLoadQ,    // queries read, scaled, converted or paired
  kPackK,    // a block's keys transposed or paired
  kPackV,    // a block's values padded or paired
  kFinite,   // the checks for non-finite values
  kScores,   // S = Q·Kᵀ of whole blocks
  kSoftmax,  // scale, caps, max, exp and sums (the online softmax's update)
  kConvert,  // half to float32 (K, V) and weights to bfloat16
  kValues,   // O += P·V of whole blocks
  kCut,      // blocks some row sees in part (their products and softmax together)
  kFinish,   // out = O / l, lse and its rest
  kStages
};

inline constexpr std::array<const char*, kStages> kStageNames = {
    "call",   "threads", "item",    "load_q", "pack_k", "pack_v", "finite",
    "scores", "softmax", "convert", "values", "cut",    "finish"};

// The process's totals, in nanoseconds of thread-time per stage.
inline std::array<std::atomic<int64_t>, kStages>& stage_totals() {
  static std::array<std::atomic<int64_t>, kStages> totals{};
  return totals;
}

#ifdef ATTNKIT_STAGES
inline constexpr bool kStageTimers = true;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// This thread's open stages below kItem: a stage opened inside another (a cut block's
// scores inside `kCut`) counts nothing, so no time is counted twice.
inline int& open_stages() {
  thread_local int open = 0;
  return open;
}

// Adds the time from its making to its end to `stage` (times `factor`: kThreads).
class StageTimer {
 public:
  explicit StageTimer(Stage stage, int64_t factor = 1)
      : stage_(stage), factor_(factor), start_(now_ns()) {
    if (stage_ > kItem) counted_ = open_stages()++ == 0;
  }
  ~StageTimer() {
    if (stage_ > kItem) --open_stages();
    if (counted_)
      stage_totals()[stage_].fetch_add((now_ns() - start_) * factor_, std::memory_order_relaxed);
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  Stage stage_;
  int64_t factor_;
  int64_t start_;
  bool counted_ = true;
};

#define ATTNKIT_CONCAT_(a, b) a##b
#define ATTNKIT_CONCAT(a, b) ATTNKIT_CONCAT_(a, b)
#define ATTNKIT_STAGE(...) const StageTimer ATTNKIT_CONCAT(stage_timer_, __LINE__)(__VA_ARGS__)
#else
inline constexpr bool kStageTimers = false;
#define ATTNKIT_STAGE(...) static_cast<void>(0)
#endif

}  // namespace attnkit_native

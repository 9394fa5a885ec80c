// Batched mask filling for a decoding step: one row per request, split across a pool of
// persistent threads. Cached masks are copied (or applied) straight from the cache, so a
// steady-state step allocates nothing.
#ifndef PAVED_CC_CONSTRAINTS_BATCH_MASKER_H_
#define PAVED_CC_CONSTRAINTS_BATCH_MASKER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cc/constraints/constraint.h"

namespace paved::constraints {

// `num_threads` - 1 persistent workers plus the calling thread. Run() calls are serialized.
//
// The caller starts on the work alone and wakes the workers only once the call has run for
// `wake_after` with work left (or at once with `wake_now`). On the 2-core development VM a
// call that woke a worker for every batch took 13-15 µs for B=2..8 cached rows at V=128k, 3-7
// µs on the caller alone (cc/constraints/README.md): a wake costs more than small batches of
// cached rows, whose copy is memory-bound anyway. Slow steps (mask misses: a vocabulary walk
// each, large batches) still spread once they pass the threshold. A worker joins only a call
// that is still open, and the caller waits only for workers that joined, so a worker that
// wakes late costs nothing. Indices are handed out in chunks (about four per thread) so that
// threads do not update a shared counter per row.
class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kDefaultWakeAfter{50};

  explicit ThreadPool(int num_threads, std::chrono::microseconds wake_after = kDefaultWakeAfter);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  struct RunOptions {
    // The caller knows the work is heavy (e.g. logits rows): wake the workers at once.
    bool wake_now = false;
    // Otherwise wake them once the call has run this long with work left; negative: the
    // pool's wake_after.
    std::chrono::nanoseconds wake_after{-1};
  };

  // Calls fn(i, thread_index) for every i in [0, n), thread_index in [0, num_threads()).
  // Rethrows the first exception a call threw, after all calls returned. `wake_now`: see
  // RunOptions.
  template <typename Fn>
  void Run(int64_t n, const Fn& fn, bool wake_now = false) {
    RunOptions options;
    options.wake_now = wake_now;
    Run(n, fn, options);
  }
  template <typename Fn>
  void Run(int64_t n, const Fn& fn, const RunOptions& options) {
    RunErased(n, &CallIndex<Fn>, &fn, nullptr, nullptr, options);
  }
  // As Run, and chunk_end(thread_index) after each chunk of indices a thread ran, before the
  // thread takes another chunk or the call returns (e.g. one store fence per chunk of rows
  // written with streaming stores rather than one per row). chunk_end must not throw.
  template <typename Fn, typename End>
  void RunChunked(int64_t n, const Fn& fn, const End& chunk_end, const RunOptions& options) {
    RunErased(n, &CallIndex<Fn>, &fn, [](const void* ctx, int t) { (*static_cast<const End*>(ctx))(t); },
              &chunk_end, options);
  }

 private:
  using Clock = std::chrono::steady_clock;
  using Task = void (*)(const void* ctx, int64_t i, int thread_index);
  using ChunkEnd = void (*)(const void* ctx, int thread_index);
  template <typename Fn>
  static void CallIndex(const void* ctx, int64_t i, int t) {
    (*static_cast<const Fn*>(ctx))(i, t);
  }
  void RunErased(int64_t n, Task task, const void* ctx, ChunkEnd chunk_end, const void* end_ctx,
                 const RunOptions& options);
  void WorkerLoop(int thread_index);
  void Drain(int thread_index);
  void MaybeWakeWorkers(bool now);

  const Clock::duration wake_after_;
  std::mutex run_mu_;  // one Run() at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // Guarded by mu_: a call is open from the wake until the caller has drained it; workers
  // join only open calls, and the caller waits for joined_ to drop to zero.
  uint64_t generation_ = 0;
  bool stop_ = false;
  bool open_ = false;
  int joined_ = 0;
  // Set by the caller before workers are woken (under mu_), read-only while they run.
  Task task_ = nullptr;
  const void* ctx_ = nullptr;
  ChunkEnd chunk_end_ = nullptr;
  const void* end_ctx_ = nullptr;
  int64_t count_ = 0;
  int64_t chunk_ = 1;
  // The caller's own state for the current Run().
  Clock::time_point start_;
  Clock::duration run_wake_after_{};
  bool woke_ = false;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

// How a large FillBitmask call writes its rows: bit 0 wakes the pool's workers at once (else
// the caller copies alone, and wakes them only if the call overruns its plan's median, i.e.
// rows walk the vocabulary), bit 1 copies cached masks with streaming stores (one fence per
// chunk of rows) instead of memcpy.
//
// Which is fastest depends on the CPU and on the load, and the differences are large: at B=64,
// V=128k (1 MiB), after a 32 MiB write, the 2-core Intel Xeon VM took 79 µs with two threads
// against 122 µs alone, streaming stores were 35% slower there; on the 2-vCPU AMD EPYC VM a
// woken worker checks in ~55 µs after the wake, so two threads took 80-124 µs against 57-96
// alone, and streaming stores cut the copy of cold rows from 96 to 57 µs (a memset of the
// same bytes: 44) but made warm ones slower (40 against 28) (docs/benchmarks.md, "AMD EPYC").
// So the masker measures: per size class, each allowed plan runs a few calls, then the plan
// with the lowest median time per byte over its last kWindow calls is used, and every
// kExploreEvery-th call re-measures another plan, so a change of load moves the choice. Only
// the timing differs between plans, never the bits written.
class FillTuner {
 public:
  static constexpr int kPlans = 4;
  static constexpr int kWakeNow = 1;
  static constexpr int kStream = 2;
  // Calls that write less than this keep the default plan (0): at 256 KiB and below a call
  // costs tens of µs and two clock reads and a lock would be a visible share of it.
  static constexpr int64_t kMinBytes = int64_t{256} << 10;
  static constexpr int kWindow = 4;
  static constexpr int kWarmup = 2;
  static constexpr int kExploreEvery = 8;

  FillTuner(bool can_wake, bool can_stream);
  // The size class of a call writing `bytes` (>= kMinBytes).
  static int SizeClassOf(int64_t bytes);
  // The median ns per byte of the plan's last kWindow calls in the class, -1 before its first.
  double ExpectedNsPerByte(int size_class, int plan) const;
  // The plan for a call writing `bytes`, and its size class (pass both to Record).
  int Pick(int64_t bytes, int* size_class);
  void Record(int size_class, int plan, int64_t bytes, double seconds);
  // The plan Pick would use now outside exploration (-1 before every plan has kWarmup calls).
  int Best(int size_class) const;

 private:
  static constexpr int kClasses = 8;  // kMinBytes * 2^k, the last one open-ended
  struct Plan {
    double ns_per_byte[kWindow] = {};
    int n = 0;  // calls recorded, the window holds min(n, kWindow) of them
  };
  struct SizeClass {
    Plan plans[kPlans];
    uint64_t calls = 0;
    int next_explore = 0;
  };
  double Median(const Plan& p) const;
  int BestLocked(const SizeClass& c) const;

  bool allowed_[kPlans];
  mutable std::mutex mu_;
  SizeClass classes_[kClasses];
};

class BatchMasker {
 public:
  // Throws ConstraintError for vocab_size outside [1, kMaxVocabSize] or num_threads
  // outside [1, 256]. `wake_after`: see ThreadPool.
  BatchMasker(int32_t vocab_size, int num_threads,
              std::chrono::microseconds wake_after = ThreadPool::kDefaultWakeAfter);

  int32_t vocab_size() const { return vocab_size_; }
  int32_t num_words() const { return (vocab_size_ + 31) / 32; }

  // Throws ConstraintError unless every non-null state uses this vocabulary size. Call it
  // before FillBitmask / FillUniqueBitmask / Apply, which assume it.
  void Validate(const State* const* states, int64_t rows) const;
  // bitmask: int32 [rows, num_words()]. Rows without a state allow every token. Calls that
  // write at least FillTuner::kMinBytes pick their plan with fill_tuner().
  void FillBitmask(const State* const* states, int64_t rows, int32_t* bitmask);
  // -1 (the default): measure (FillTuner); 0-3: always this FillTuner plan, whatever the size
  // (tests, and pinning a plan by hand: PAVED_CONSTRAINTS_FILL_PLAN=0..3 in the environment
  // when the masker is built).
  void set_fill_plan(int plan);
  const FillTuner& fill_tuner() const { return tuner_; }
  // The same masks, each distinct one written once, for a consumer that gathers rows on the
  // device: row i's mask is unique[row_index[i]]. unique: int32 [rows, num_words()], of which
  // the first n (returned) rows hold the masks and the rest are scratch (unspecified
  // contents); row_index: int32 [rows]; the two must not overlap. Rows whose states share a
  // cached mask share a row (same automaton state, same budget restriction), and rows without
  // a state share one all-allowed row; a mask built for one row alone (a finished state, an
  // EOS-only last step, a catalogue walk) is never shared. In the steady state this writes n
  // rows instead of B: a batch of one schema's requests visits few automaton states (the
  // bench's B=64 rows at V=128k sit in 17), and the host->device copy shrinks by the same
  // factor. Allocation-free once the scratch vectors have grown to the batch size.
  int64_t FillUniqueBitmask(const State* const* states, int64_t rows, int32_t* unique, int32_t* row_index);
  // logits: float32 [rows, vocab_size()], -inf where not allowed. Rows without a state are
  // left untouched.
  void Apply(const State* const* states, int64_t rows, float* logits);

 private:
  // A call of a plan that does not wake the workers at once wakes them once it has run this
  // many times its plan's median (FillBitmask).
  static constexpr double kOverrun = 2.0;

  int32_t vocab_size_;
  std::chrono::microseconds wake_after_;
  ThreadPool pool_;
  FillTuner tuner_;
  std::atomic<int> forced_plan_{-1};
  std::vector<std::vector<uint32_t>> scratch_;  // one mask row per pool thread
  std::vector<uint32_t> all_allowed_;           // the mask of rows without a state
  // FillUniqueBitmask's per-call scratch, kept to avoid allocating per step (one call at a
  // time: unique_mu_).
  std::mutex unique_mu_;
  std::vector<const uint32_t*> sources_;                   // per row, then per unique row
  std::vector<std::shared_ptr<const CachedMask>> holds_;  // keeps unpinned masks alive
  std::vector<std::pair<const uint32_t*, int32_t>> seen_;  // open-addressing mask -> unique row
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_BATCH_MASKER_H_

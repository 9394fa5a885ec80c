// Batched mask filling for a decoding step: one row per request, split across a pool of
// persistent threads. Cached masks are copied (or applied) straight from the cache, so a
// steady-state step allocates nothing.
#ifndef PAVED_CC_CONSTRAINTS_BATCH_MASKER_H_
#define PAVED_CC_CONSTRAINTS_BATCH_MASKER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "cc/constraints/constraint.h"

namespace paved::constraints {

// `num_threads` - 1 persistent workers plus the calling thread. Run() calls are serialized.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i, thread_index) for every i in [0, n), thread_index in [0, num_threads()).
  // Rethrows the first exception a call threw, after all calls returned.
  template <typename Fn>
  void Run(int64_t n, const Fn& fn) {
    RunErased(n, [](const void* ctx, int64_t i, int t) { (*static_cast<const Fn*>(ctx))(i, t); }, &fn);
  }

 private:
  using Task = void (*)(const void* ctx, int64_t i, int thread_index);
  void RunErased(int64_t n, Task task, const void* ctx);
  void WorkerLoop(int thread_index);
  void Drain(int thread_index);

  std::mutex run_mu_;  // one Run() at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int busy_ = 0;
  Task task_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

class BatchMasker {
 public:
  // Throws ConstraintError for vocab_size outside [1, kMaxVocabSize] or num_threads
  // outside [1, 256].
  BatchMasker(int32_t vocab_size, int num_threads);

  int32_t vocab_size() const { return vocab_size_; }
  int32_t num_words() const { return (vocab_size_ + 31) / 32; }

  // Throws ConstraintError unless every non-null state uses this vocabulary size. Call it
  // before FillBitmask / Apply, which assume it.
  void Validate(const State* const* states, int64_t rows) const;
  // bitmask: int32 [rows, num_words()]. Rows without a state allow every token.
  void FillBitmask(const State* const* states, int64_t rows, int32_t* bitmask);
  // logits: float32 [rows, vocab_size()], -inf where not allowed. Rows without a state are
  // left untouched.
  void Apply(const State* const* states, int64_t rows, float* logits);

 private:
  int32_t vocab_size_;
  ThreadPool pool_;
  std::vector<std::vector<uint32_t>> scratch_;  // one mask row per pool thread
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_BATCH_MASKER_H_

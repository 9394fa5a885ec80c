#include "cc/constraints/batch_masker.h"

#include <cstring>
#include <memory>
#include <string>

#include "cc/constraints/limits.h"
#include "cc/constraints/token_bitmask.h"

namespace paved::constraints {

ThreadPool::ThreadPool(int num_threads) {
  for (int t = 1; t < num_threads; ++t) workers_.emplace_back([this, t] { WorkerLoop(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& w : workers_) w.join();
}

void ThreadPool::RunErased(int64_t n, Task task, const void* ctx) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  error_ = nullptr;
  task_ = task;
  ctx_ = ctx;
  count_ = n;
  next_.store(0, std::memory_order_relaxed);
  // Waking workers costs more than a few cached rows; small batches run inline.
  const bool wake_workers = !workers_.empty() && n > 1;
  if (wake_workers) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
  }
  Drain(0);
  if (wake_workers) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
  }
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::Drain(int thread_index) {
  for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < count_;) {
    try {
      task_(ctx_, i, thread_index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::WorkerLoop(int thread_index) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    Drain(thread_index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
}

namespace {

int32_t CheckedVocabSize(int32_t vocab_size) {
  if (vocab_size <= 0 || vocab_size > kMaxVocabSize)
    throw ConstraintError("vocab_size must be in [1, " + std::to_string(kMaxVocabSize) + "], got " +
                          std::to_string(vocab_size));
  return vocab_size;
}

int CheckedNumThreads(int num_threads) {
  if (num_threads < 1 || num_threads > 256)
    throw ConstraintError("num_threads must be in [1, 256], got " + std::to_string(num_threads));
  return num_threads;
}

}  // namespace

BatchMasker::BatchMasker(int32_t vocab_size, int num_threads)
    : vocab_size_(CheckedVocabSize(vocab_size)), pool_(CheckedNumThreads(num_threads)) {
  scratch_.assign(static_cast<size_t>(pool_.num_threads()), std::vector<uint32_t>(static_cast<size_t>(num_words())));
}

void BatchMasker::Validate(const State* const* states, int64_t rows) const {
  for (int64_t i = 0; i < rows; ++i) {
    if (states[i] != nullptr && states[i]->vocab().size() != vocab_size_)
      throw ConstraintError("row " + std::to_string(i) + ": the state's vocabulary has " +
                            std::to_string(states[i]->vocab().size()) + " tokens, the masker " +
                            std::to_string(vocab_size_));
  }
}

void BatchMasker::FillBitmask(const State* const* states, int64_t rows, int32_t* bitmask) {
  const int64_t words = num_words();
  pool_.Run(rows, [&](int64_t i, int) {
    auto* row = reinterpret_cast<uint32_t*>(bitmask + i * words);
    if (states[i] != nullptr) {
      states[i]->FillMask(row);
      return;
    }
    std::memset(row, 0xFF, static_cast<size_t>(words) * 4);
    if (vocab_size_ % 32 != 0) row[words - 1] = (1u << (vocab_size_ % 32)) - 1;
  });
}

void BatchMasker::Apply(const State* const* states, int64_t rows, float* logits) {
  pool_.Run(rows, [&](int64_t i, int thread_index) {
    if (states[i] == nullptr) return;
    std::shared_ptr<const CachedMask> hold;
    const uint32_t* mask = states[i]->Mask(scratch_[static_cast<size_t>(thread_index)].data(), &hold);
    ApplyMaskRow(logits + i * vocab_size_, mask, vocab_size_);
  });
}

}  // namespace paved::constraints

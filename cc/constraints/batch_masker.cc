#include "cc/constraints/batch_masker.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "cc/constraints/limits.h"
#include "cc/constraints/token_bitmask.h"

namespace paved::constraints {

ThreadPool::ThreadPool(int num_threads, std::chrono::microseconds wake_after) : wake_after_(wake_after) {
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

void ThreadPool::RunErased(int64_t n, Task task, const void* ctx, ChunkEnd chunk_end, const void* end_ctx,
                           const RunOptions& options) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  // No worker has joined (the previous call closed and waited), so these need no lock; a
  // worker reads them only after joining under mu_, which happens after open_ is set below.
  error_ = nullptr;
  task_ = task;
  ctx_ = ctx;
  chunk_end_ = chunk_end;
  end_ctx_ = end_ctx;
  count_ = n;
  chunk_ = std::max<int64_t>(1, n / (4 * int64_t{num_threads()}));
  next_.store(0, std::memory_order_relaxed);
  woke_ = false;
  run_wake_after_ = options.wake_after.count() < 0
                        ? wake_after_
                        : std::chrono::duration_cast<Clock::duration>(options.wake_after);
  start_ = Clock::now();
  if (options.wake_now && n > chunk_) MaybeWakeWorkers(true);  // one chunk: nothing to share
  Drain(0);
  if (woke_) {
    // Close the call and wait only for the workers that joined it (they are running). A
    // worker still waking up finds the call closed and goes back to sleep, so the caller never
    // waits for a sleeping CPU to wake just to learn that nothing is left.
    std::unique_lock<std::mutex> lock(mu_);
    open_ = false;
    done_.wait(lock, [this] { return joined_ == 0; });
  }
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::Drain(int thread_index) {
  for (int64_t begin; (begin = next_.fetch_add(chunk_, std::memory_order_relaxed)) < count_;) {
    const int64_t end = std::min(count_, begin + chunk_);
    for (int64_t i = begin; i < end; ++i) {
      try {
        task_(ctx_, i, thread_index);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    if (chunk_end_ != nullptr) chunk_end_(end_ctx_, thread_index);
    if (thread_index == 0) MaybeWakeWorkers(false);
  }
}

void ThreadPool::MaybeWakeWorkers(bool now) {
  if (woke_ || workers_.empty() || next_.load(std::memory_order_relaxed) >= count_) return;
  if (!now && Clock::now() - start_ < run_wake_after_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    ++generation_;
  }
  wake_.notify_all();
  woke_ = true;
}

void ThreadPool::WorkerLoop(int thread_index) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || (open_ && generation_ != seen); });
      if (stop_) return;
      seen = generation_;
      ++joined_;
    }
    Drain(thread_index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--joined_ == 0 && !open_) done_.notify_one();
    }
  }
}

FillTuner::FillTuner(bool can_wake, bool can_stream) {
  for (int p = 0; p < kPlans; ++p) allowed_[p] = (can_wake || !(p & kWakeNow)) && (can_stream || !(p & kStream));
}

double FillTuner::Median(const Plan& p) const {
  const int n = std::min(p.n, kWindow);
  double v[kWindow];
  std::copy(p.ns_per_byte, p.ns_per_byte + n, v);
  std::nth_element(v, v + n / 2, v + n);
  return v[n / 2];
}

int FillTuner::BestLocked(const SizeClass& c) const {
  int best = -1;
  double best_ns = 0;
  for (int p = 0; p < kPlans; ++p) {
    if (!allowed_[p]) continue;
    if (c.plans[p].n < kWarmup) return -1;
    const double ns = Median(c.plans[p]);
    if (best < 0 || ns < best_ns) best = p, best_ns = ns;
  }
  return best;
}

int FillTuner::Best(int size_class) const {
  std::lock_guard<std::mutex> lock(mu_);
  return BestLocked(classes_[size_class]);
}

int FillTuner::SizeClassOf(int64_t bytes) {
  int k = 0;
  while (k + 1 < kClasses && bytes >= (kMinBytes << (k + 1))) ++k;
  return k;
}

double FillTuner::ExpectedNsPerByte(int size_class, int plan) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Plan& p = classes_[size_class].plans[plan];
  return p.n == 0 ? -1 : Median(p);
}

int FillTuner::Pick(int64_t bytes, int* size_class) {
  const int k = SizeClassOf(bytes);
  *size_class = k;
  std::lock_guard<std::mutex> lock(mu_);
  SizeClass& c = classes_[k];
  ++c.calls;
  // Warm-up: the allowed plan with the fewest calls, so each gets kWarmup in turn.
  int fewest = -1;
  for (int p = 0; p < kPlans; ++p)
    if (allowed_[p] && c.plans[p].n < kWarmup && (fewest < 0 || c.plans[p].n < c.plans[fewest].n)) fewest = p;
  if (fewest >= 0) return fewest;
  const int best = BestLocked(c);
  if (c.calls % kExploreEvery == 0) {
    for (int step = 0; step < kPlans; ++step) {
      const int p = c.next_explore;
      c.next_explore = (c.next_explore + 1) % kPlans;
      if (allowed_[p] && p != best) return p;
    }
  }
  return best;
}

void FillTuner::Record(int size_class, int plan, int64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  Plan& p = classes_[size_class].plans[plan];
  p.ns_per_byte[p.n % kWindow] = 1e9 * seconds / static_cast<double>(bytes);
  ++p.n;
}

namespace {

int PlanFromEnvironment() {
  const char* v = std::getenv("PAVED_CONSTRAINTS_FILL_PLAN");
  if (v == nullptr || v[0] < '0' || v[0] > '3' || v[1] != '\0') return -1;
  return v[0] - '0';
}

// A call that writes at least this much (bitmask or logits) wakes the pool's workers at once
// rather than after wake_after. On the 2-core VM a woken worker starts tens of µs later; a
// cold-cache copy of this size takes longer than that, and two threads keep twice the cache
// misses in flight. fill_bitmask at V=128k after the bench's other methods, µs, 1 thread /
// 2 threads woken after wake_after / at once: B=16 (256 KiB) 63 / 67 / 70, B=32 112 / 116 /
// 102, B=64 (1 MiB) 186 / 195 / 160, B=128 335 / 288 / 247.
constexpr int64_t kWakeNowBytes = int64_t{1} << 20;

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

BatchMasker::BatchMasker(int32_t vocab_size, int num_threads, std::chrono::microseconds wake_after)
    : vocab_size_(CheckedVocabSize(vocab_size)),
      wake_after_(wake_after),
      pool_(CheckedNumThreads(num_threads), wake_after),
      tuner_(pool_.num_threads() > 1, HaveStreamingStores()),
      forced_plan_(PlanFromEnvironment()) {
  scratch_.assign(static_cast<size_t>(pool_.num_threads()), std::vector<uint32_t>(static_cast<size_t>(num_words())));
  all_allowed_.assign(static_cast<size_t>(num_words()), ~0u);
  if (vocab_size_ % 32 != 0) all_allowed_.back() = (1u << (vocab_size_ % 32)) - 1;
}

void BatchMasker::Validate(const State* const* states, int64_t rows) const {
  for (int64_t i = 0; i < rows; ++i) {
    if (states[i] != nullptr && states[i]->vocab().size() != vocab_size_)
      throw ConstraintError("row " + std::to_string(i) + ": the state's vocabulary has " +
                            std::to_string(states[i]->vocab().size()) + " tokens, the masker " +
                            std::to_string(vocab_size_));
  }
}

void BatchMasker::set_fill_plan(int plan) {
  if (plan < -1 || plan >= FillTuner::kPlans)
    throw ConstraintError("fill plan must be in [-1, 3], got " + std::to_string(plan));
  forced_plan_.store(plan, std::memory_order_relaxed);
}

void BatchMasker::FillBitmask(const State* const* states, int64_t rows, int32_t* bitmask) {
  const int64_t words = num_words();
  const int64_t bytes = rows * words * 4;
  int plan = forced_plan_.load(std::memory_order_relaxed);
  const int size_class = bytes >= FillTuner::kMinBytes ? FillTuner::SizeClassOf(bytes) : -1;
  if (plan < 0 && size_class >= 0) {
    int picked_class;
    plan = tuner_.Pick(bytes, &picked_class);
  }
  if (plan < 0) plan = bytes >= kWakeNowBytes ? FillTuner::kWakeNow : 0;  // the default, untuned
  // The tuner never picks streaming without AVX2; a plan pinned by hand copies with memcpy there.
  const bool stream = (plan & FillTuner::kStream) != 0 && HaveStreamingStores();
  ThreadPool::RunOptions options;
  options.wake_now = (plan & FillTuner::kWakeNow) != 0;
  if (!options.wake_now && size_class >= 0) {
    // A plan that does not wake the workers at once does not wake them for a copy of cached
    // masks either: on the AMD EPYC VM a woken worker checks in 55 µs (median; 13-108) after
    // the wake, as long as the whole 1 MiB copy, and two threads woken by a condition
    // variable took 80-124 µs against 57-96 alone (docs/benchmarks.md). They are woken once
    // the call overruns its plan's median by kOverrun, i.e. when rows miss the mask cache and
    // walk the vocabulary (hundreds of µs a row at 128k).
    const double ns_per_byte = tuner_.ExpectedNsPerByte(size_class, plan);
    if (ns_per_byte > 0) {
      const auto overrun =
          std::chrono::nanoseconds(static_cast<int64_t>(kOverrun * ns_per_byte * static_cast<double>(bytes)));
      options.wake_after = std::max<std::chrono::nanoseconds>(wake_after_, overrun);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  auto row_fn = [&](int64_t i, int) {
    auto* row = reinterpret_cast<uint32_t*>(bitmask + i * words);
    const uint32_t* mask = all_allowed_.data();
    std::shared_ptr<const CachedMask> hold;
    if (states[i] != nullptr) mask = states[i]->Mask(row, &hold);
    if (mask == row) return;  // built in place (finished state, budget-restricted miss)
    if (stream) {
      CopyMaskRowStreaming(row, mask, words);
    } else {
      std::memcpy(row, mask, static_cast<size_t>(words) * 4);
    }
  };
  if (stream) {
    pool_.RunChunked(rows, row_fn, [](int) { FenceStreamingStores(); }, options);
  } else {
    pool_.Run(rows, row_fn, options);
  }
  if (size_class >= 0)
    tuner_.Record(size_class, plan, bytes,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

int64_t BatchMasker::FillUniqueBitmask(const State* const* states, int64_t rows, int32_t* unique,
                                       int32_t* row_index) {
  std::lock_guard<std::mutex> lock(unique_mu_);
  const int64_t words = num_words();
  const size_t bytes = static_cast<size_t>(words) * 4;
  auto slot = [&](int64_t i) { return reinterpret_cast<uint32_t*>(unique + i * words); };
  if (sources_.size() < static_cast<size_t>(rows)) {
    sources_.resize(static_cast<size_t>(rows));
    holds_.resize(static_cast<size_t>(rows));
  }
  // Unpinned masks stay alive (holds_) until copied, and no longer, even if a step throws.
  struct ReleaseHolds {
    std::vector<std::shared_ptr<const CachedMask>>& holds;
    int64_t rows;
    ~ReleaseHolds() {
      for (int64_t i = 0; i < rows; ++i) holds[static_cast<size_t>(i)].reset();
    }
  } release{holds_, rows};
  // 1. Every row's mask, in parallel (a cache miss walks the vocabulary). A mask that is not
  //    in a cache is built in the row's own slot, which is at or after its unique row.
  pool_.Run(rows, [&](int64_t i, int) {
    const size_t k = static_cast<size_t>(i);
    sources_[k] = states[i] == nullptr ? all_allowed_.data() : states[i]->Mask(slot(i), &holds_[k]);
  });
  // 2. Unique rows in first-seen order, so unique row u <= every row that maps to it.
  size_t cap = 16;
  int shift = 60;  // 64 - log2(cap): the product's high bits index the table
  while (cap < 2 * static_cast<size_t>(rows)) cap *= 2, --shift;
  seen_.assign(cap, {nullptr, 0});
  int64_t n = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const uint32_t* src = sources_[static_cast<size_t>(i)];
    if (src == slot(i)) {  // built for this row alone
      sources_[static_cast<size_t>(n)] = src;
      row_index[i] = static_cast<int32_t>(n++);
      continue;
    }
    size_t h = static_cast<size_t>((uint64_t{reinterpret_cast<uintptr_t>(src)} * 0x9E3779B97F4A7C15ull) >> shift);
    while (seen_[h].first != nullptr && seen_[h].first != src) h = (h + 1) & (cap - 1);
    if (seen_[h].first == nullptr) {
      seen_[h] = {src, static_cast<int32_t>(n)};
      sources_[static_cast<size_t>(n++)] = src;
    }
    row_index[i] = seen_[h].second;
  }
  // 3. Masks built in a later row's slot move down first, in increasing order: a slot about
  //    to be overwritten holds no mask still to be moved (its own row's unique row is at or
  //    before it, so already moved). Then cached masks are copied in parallel.
  const auto begin = reinterpret_cast<uintptr_t>(slot(0));
  const auto end = reinterpret_cast<uintptr_t>(slot(rows));
  auto in_buffer = [&](const uint32_t* p) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    return at >= begin && at < end;
  };
  for (int64_t u = 0; u < n; ++u) {
    const uint32_t* src = sources_[static_cast<size_t>(u)];
    if (in_buffer(src) && src != slot(u)) std::memmove(slot(u), src, bytes);
  }
  pool_.Run(n, [&](int64_t u, int) {
    const uint32_t* src = sources_[static_cast<size_t>(u)];
    if (!in_buffer(src)) std::memcpy(slot(u), src, bytes);
  }, n * words * 4 >= kWakeNowBytes);
  return n;
}

void BatchMasker::Apply(const State* const* states, int64_t rows, float* logits) {
  // Every row is a pass over V floats (B=4, V=128k: 123-136 µs on one thread, 124 µs with the
  // worker woken after wake_after, 63 µs woken at once).
  const bool heavy = rows * int64_t{vocab_size_} * 4 >= kWakeNowBytes;
  pool_.Run(rows, [&](int64_t i, int thread_index) {
    if (states[i] == nullptr) return;
    std::shared_ptr<const CachedMask> hold;
    const uint32_t* mask = states[i]->Mask(scratch_[static_cast<size_t>(thread_index)].data(), &hold);
    ApplyMaskRow(logits + i * vocab_size_, mask, vocab_size_);
  }, heavy);
}

}  // namespace paved::constraints

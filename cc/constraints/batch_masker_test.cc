#include "cc/constraints/batch_masker.h"

#include <atomic>
#include <chrono>
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/constraints/compile.h"
#include "cc/constraints/test_util.h"
#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

struct Batch {
  std::vector<std::unique_ptr<State>> owned;
  std::vector<const State*> rows;
};

const std::shared_ptr<const Vocab>& SharedVocab() {
  static const auto vocab = testing::ByteVocab();
  return vocab;
}

// A mixed batch: regex, JSON and choice states at various points, with unconstrained rows.
Batch MakeBatch() {
  const auto& vocab = SharedVocab();
  static const auto regex = CompileRegex(vocab, "[a-z]+\\d{2}");
  static const auto json =
      CompileJsonSchema(vocab, R"({"type":"object","properties":{"a":{"type":"string"}}})", JsonWhitespace::kCompact);
  static const auto choice = CompileChoice(vocab, {"Alien", "Aliens", "Up"}, 2, ", ", true);
  Batch b;
  for (int i = 0; i < 24; ++i) {
    if (i % 5 == 4) {
      b.rows.push_back(nullptr);
      continue;
    }
    const Constraint& c = i % 3 == 0 ? *regex : i % 3 == 1 ? *json : *choice;
    auto s = c.NewState(i % 2 == 0 ? std::optional<int64_t>(40) : std::nullopt);
    const auto walk = testing::RandomWalk(c, 30, static_cast<uint32_t>(i));
    for (size_t k = 0; k < walk.text.size() * (i % 4) / 4; ++k) s->Advance(static_cast<uint8_t>(walk.text[k]));
    b.rows.push_back(s.get());
    b.owned.push_back(std::move(s));
  }
  return b;
}

TEST(BatchMasker, BitmaskRowsEqualPerStateMasks) {
  const auto& vocab = SharedVocab();
  const Batch b = MakeBatch();
  const int64_t words = vocab->num_words();
  for (int threads : {1, 3}) {
    // Workers woken at once, so that they take part even in this small batch.
    BatchMasker masker(vocab->size(), threads, std::chrono::microseconds(0));
    std::vector<int32_t> bitmask(b.rows.size() * static_cast<size_t>(words), 0x5a5a5a5a);
    masker.FillBitmask(b.rows.data(), static_cast<int64_t>(b.rows.size()), bitmask.data());
    for (size_t i = 0; i < b.rows.size(); ++i) {
      std::vector<uint32_t> expected(static_cast<size_t>(words), ~0u);
      if (b.rows[i] != nullptr) {
        b.rows[i]->FillMask(expected.data());
      } else if (vocab->size() % 32 != 0) {
        expected.back() = (1u << (vocab->size() % 32)) - 1;
      }
      for (int64_t w = 0; w < words; ++w)
        EXPECT_EQ(static_cast<uint32_t>(bitmask[i * static_cast<size_t>(words) + static_cast<size_t>(w)]),
                  expected[static_cast<size_t>(w)])
            << "row " << i << " word " << w;
    }
  }
}

// unique[row_index[i]] must equal FillBitmask's row i whatever the mix: rows sharing cached
// masks, rows without a state, and masks built for one row alone (finished states,
// budget-restricted steps, distinct-choice lists) placed before and after shared ones.
TEST(BatchMasker, UniqueBitmaskGathersToTheFullBitmask) {
  const auto& vocab = SharedVocab();
  const size_t words = static_cast<size_t>(vocab->num_words());
  Batch base = MakeBatch();
  static const auto regex = CompileRegex(vocab, "[a-z]+\\d{2}");
  static const auto choice = CompileChoice(vocab, {"Alien", "Aliens", "Up"}, 2, ", ", true);
  std::vector<std::unique_ptr<State>> extra;
  for (int i = 0; i < 6; ++i) extra.push_back(regex->NewState(std::nullopt));  // one cached start mask
  auto finished = regex->NewState(std::nullopt);
  for (char c : std::string("ab12")) finished->Advance(static_cast<uint8_t>(c));
  finished->Advance(vocab->eos_ids()[0]);
  ASSERT_TRUE(finished->is_finished());
  auto listed = choice->NewState(std::nullopt);  // second item of a distinct list: a per-row mask
  for (char c : std::string("Up, ")) listed->Advance(static_cast<uint8_t>(c));
  for (uint32_t seed = 0; seed < 40; ++seed) {
    std::vector<const State*> rows = base.rows;
    for (const auto& s : extra) rows.push_back(s.get());
    rows.push_back(finished.get());
    rows.push_back(listed.get());
    rows.push_back(base.rows[0]);  // the same state object twice
    std::mt19937 rng(seed);
    std::shuffle(rows.begin(), rows.end(), rng);
    const int64_t n = static_cast<int64_t>(rows.size());
    BatchMasker masker(vocab->size(), seed % 2 == 0 ? 1 : 3, std::chrono::microseconds(0));
    std::vector<int32_t> full(rows.size() * words);
    masker.FillBitmask(rows.data(), n, full.data());
    std::vector<int32_t> unique(rows.size() * words, 0x5a5a5a5a);
    std::vector<int32_t> index(rows.size(), -1);
    const int64_t u = masker.FillUniqueBitmask(rows.data(), n, unique.data(), index.data());
    // 6 fresh regex states share the start mask, as do the unconstrained rows.
    EXPECT_LE(u, n - 5) << "seed " << seed;
    for (size_t i = 0; i < rows.size(); ++i) {
      ASSERT_GE(index[i], 0);
      ASSERT_LT(index[i], u);
      for (size_t w = 0; w < words; ++w)
        ASSERT_EQ(unique[static_cast<size_t>(index[i]) * words + w], full[i * words + w])
            << "seed " << seed << " row " << i << " word " << w;
    }
  }
}

// Every fill plan (threads woken or not, memcpy or streaming stores) writes the same bits, at
// a size the tuner measures (>= FillTuner::kMinBytes) and in a small batch, forced or picked.
TEST(BatchMasker, EveryFillPlanWritesTheSameBits) {
  const auto& vocab = SharedVocab();
  const Batch b = MakeBatch();
  const int64_t words = vocab->num_words();
  // Odd row counts and an offset start: rows straddle 32-byte boundaries, so the streaming
  // copy's unaligned head and tail are exercised.
  for (int64_t rows : {int64_t{7}, FillTuner::kMinBytes / (words * 4) + 3}) {
    std::vector<const State*> states(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) states[static_cast<size_t>(i)] = b.rows[static_cast<size_t>(i) % b.rows.size()];
    std::vector<int32_t> expected(static_cast<size_t>(rows * words));
    BatchMasker reference(vocab->size(), 1);
    reference.set_fill_plan(0);
    reference.FillBitmask(states.data(), rows, expected.data());
    for (int threads : {1, 2}) {
      BatchMasker masker(vocab->size(), threads, std::chrono::microseconds(0));
      for (int plan = -1; plan < FillTuner::kPlans; ++plan) {
        masker.set_fill_plan(plan);
        // Auto (-1) runs enough calls to pass the warm-up and an exploration step.
        const int calls = plan < 0 ? FillTuner::kPlans * FillTuner::kWarmup + FillTuner::kExploreEvery + 1 : 2;
        for (int c = 0; c < calls; ++c) {
          std::vector<int32_t> bitmask(static_cast<size_t>(rows * words) + 1, 0x5a5a5a5a);
          masker.FillBitmask(states.data(), rows, bitmask.data() + 1);
          ASSERT_TRUE(std::equal(expected.begin(), expected.end(), bitmask.begin() + 1))
              << "rows " << rows << " threads " << threads << " plan " << plan << " call " << c;
          EXPECT_EQ(bitmask[0], 0x5a5a5a5a);
        }
      }
      EXPECT_THROW(masker.set_fill_plan(4), ConstraintError);
    }
  }
}

TEST(FillTuner, WarmsEveryAllowedPlanThenPicksTheFastest) {
  FillTuner tuner(/*can_wake=*/true, /*can_stream=*/false);  // plans 0 and 1 allowed
  const int64_t bytes = FillTuner::kMinBytes;
  int seen[FillTuner::kPlans] = {};
  for (int c = 0; c < 2 * FillTuner::kWarmup; ++c) {
    int k;
    const int plan = tuner.Pick(bytes, &k);
    ASSERT_TRUE(plan == 0 || plan == 1) << plan;
    ++seen[plan];
    tuner.Record(k, plan, bytes, plan == 1 ? 1e-5 : 2e-5);  // plan 1 is twice as fast
  }
  EXPECT_EQ(seen[0], FillTuner::kWarmup);
  EXPECT_EQ(seen[1], FillTuner::kWarmup);
  EXPECT_EQ(tuner.Best(0), 1);
  // Exploitation picks plan 1 except on every kExploreEvery-th call, which re-measures plan 0.
  int zeros = 0;
  for (int c = 0; c < 4 * FillTuner::kExploreEvery; ++c) {
    int k;
    const int plan = tuner.Pick(bytes, &k);
    zeros += plan == 0;
    tuner.Record(k, plan, bytes, plan == 1 ? 1e-5 : 2e-5);
  }
  EXPECT_EQ(zeros, 4);
  // A size class of its own: larger calls start their warm-up afresh.
  int k;
  tuner.Pick(8 * bytes, &k);
  EXPECT_EQ(k, 3);
  EXPECT_EQ(tuner.Best(3), -1);
}

// What a plan that copies alone waits for before waking the workers (FillBitmask).
TEST(FillTuner, ExpectedNsPerByteIsTheMedianOfThePlansWindow) {
  FillTuner tuner(/*can_wake=*/true, /*can_stream=*/true);
  const int64_t bytes = FillTuner::kMinBytes;
  const int k = FillTuner::SizeClassOf(bytes);
  EXPECT_EQ(FillTuner::SizeClassOf(2 * bytes - 1), k);
  EXPECT_EQ(FillTuner::SizeClassOf(2 * bytes), k + 1);
  EXPECT_EQ(tuner.ExpectedNsPerByte(k, 2), -1);
  // 1, 9, 3 ns per byte: the median is 3; a fourth and fifth value push the first two out.
  for (double ns : {1.0, 9.0, 3.0}) tuner.Record(k, 2, bytes, ns * 1e-9 * static_cast<double>(bytes));
  EXPECT_DOUBLE_EQ(tuner.ExpectedNsPerByte(k, 2), 3.0);
  for (double ns : {5.0, 7.0, 8.0}) tuner.Record(k, 2, bytes, ns * 1e-9 * static_cast<double>(bytes));
  static_assert(FillTuner::kWindow == 4, "the window below holds the last four values");
  EXPECT_DOUBLE_EQ(tuner.ExpectedNsPerByte(k, 2), 7.0);  // of 3, 5, 7, 8: the upper median
  EXPECT_EQ(tuner.ExpectedNsPerByte(k, 0), -1);           // other plans keep their own
}

TEST(BatchMasker, ApplyMasksExactlyTheDisallowedLogits) {
  const auto& vocab = SharedVocab();
  const Batch b = MakeBatch();
  const int64_t V = vocab->size();
  BatchMasker masker(vocab->size(), 2, std::chrono::microseconds(0));
  std::vector<float> logits(b.rows.size() * static_cast<size_t>(V));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 97) * 0.25f;
  const std::vector<float> before = logits;
  masker.Apply(b.rows.data(), static_cast<int64_t>(b.rows.size()), logits.data());
  for (size_t i = 0; i < b.rows.size(); ++i) {
    std::vector<uint32_t> mask(static_cast<size_t>(vocab->num_words()), ~0u);
    if (b.rows[i] != nullptr) b.rows[i]->FillMask(mask.data());
    for (int64_t t = 0; t < V; ++t) {
      const size_t k = i * static_cast<size_t>(V) + static_cast<size_t>(t);
      const bool allowed = (mask[static_cast<size_t>(t >> 5)] >> (t & 31)) & 1u;
      if (allowed) {
        EXPECT_EQ(logits[k], before[k]) << "row " << i << " token " << t;
      } else {
        EXPECT_TRUE(std::isinf(logits[k]) && logits[k] < 0) << "row " << i << " token " << t;
      }
    }
  }
}

TEST(BatchMasker, RejectsForeignVocabularyAndBadArguments) {
  const auto vocab = testing::ByteVocab();
  const auto c = CompileRegex(vocab, "a");
  const auto s = c->NewState(std::nullopt);
  BatchMasker masker(vocab->size() + 1, 2);
  const State* rows[] = {s.get()};
  EXPECT_THROW(masker.Validate(rows, 1), ConstraintError);
  EXPECT_THROW(BatchMasker(0, 1), ConstraintError);
  EXPECT_THROW(BatchMasker(10, 0), ConstraintError);
}

TEST(ThreadPool, RunsEveryIndexOnceAndPropagatesErrors) {
  ThreadPool pool(4, std::chrono::microseconds(0));
  std::vector<std::atomic<int>> hits(1000);
  for (int round = 0; round < 20; ++round) pool.Run(1000, [&](int64_t i, int) { hits[static_cast<size_t>(i)]++; });
  for (const auto& h : hits) EXPECT_EQ(h.load(), 20);
  EXPECT_THROW(pool.Run(100, [](int64_t i, int) {
    if (i == 37) throw ConstraintError("boom");
  }),
               ConstraintError);
  pool.Run(10, [](int64_t, int) {});  // still usable
}

TEST(ThreadPool, CallsShorterThanWakeAfterStayOnTheCaller) {
  ThreadPool pool(3, std::chrono::hours(1));
  std::atomic<int> off_caller{0};
  for (int round = 0; round < 20; ++round)
    pool.Run(64, [&](int64_t, int thread_index) { off_caller += thread_index != 0; });
  EXPECT_EQ(off_caller.load(), 0);
}

// Runs 8 indices (chunks of one) on a 2-thread pool through `run`. The caller's first index
// sleeps `first`; its next one waits until the worker has run an index. True iff the worker
// took part (false after a 30 s timeout instead of hanging).
template <typename RunFn>
bool WorkerTakesPart(std::chrono::milliseconds first, RunFn run) {
  std::atomic<bool> worker_ran{false};
  std::atomic<bool> timed_out{false};
  run([&](int64_t i, int thread_index) {
    if (thread_index != 0) {
      worker_ran = true;
    } else if (i == 0) {
      std::this_thread::sleep_for(first);
    } else {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!worker_ran && !timed_out) {
        if (std::chrono::steady_clock::now() > deadline) timed_out = true;
        std::this_thread::yield();
      }
    }
  });
  return worker_ran && !timed_out;
}

TEST(ThreadPool, PerCallWakeAfterOverridesThePools) {
  ThreadPool late(2, std::chrono::hours(1));
  ThreadPool::RunOptions soon;
  soon.wake_after = std::chrono::milliseconds(1);
  EXPECT_TRUE(WorkerTakesPart(std::chrono::milliseconds(5), [&](const auto& fn) { late.Run(8, fn, soon); }));

  ThreadPool eager(3, std::chrono::microseconds(0));
  ThreadPool::RunOptions never;
  never.wake_after = std::chrono::hours(1);
  std::atomic<int> off_caller{0};
  for (int round = 0; round < 20; ++round)
    eager.Run(64, [&](int64_t, int thread_index) { off_caller += thread_index != 0; }, never);
  EXPECT_EQ(off_caller.load(), 0);
}

// chunk_end runs on the thread that ran the chunk, after its indices and before the call
// returns: every thread's last event is a chunk_end, and every index ran once.
TEST(ThreadPool, RunChunkedEndsEveryChunkOnItsThread) {
  for (int threads : {1, 3}) {
    ThreadPool pool(threads, std::chrono::microseconds(0));
    ThreadPool::RunOptions now;
    now.wake_now = true;
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100}}) {
      std::vector<std::vector<int64_t>> events(static_cast<size_t>(threads));  // -1: chunk_end
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.RunChunked(
          n,
          [&](int64_t i, int t) {
            hits[static_cast<size_t>(i)]++;
            events[static_cast<size_t>(t)].push_back(i);
          },
          [&](int t) { events[static_cast<size_t>(t)].push_back(-1); }, now);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "n " << n << " i " << i;
      int64_t ends = 0;
      for (const auto& e : events) {
        if (!e.empty()) EXPECT_EQ(e.back(), -1) << "threads " << threads << " n " << n;
        ends += std::count(e.begin(), e.end(), int64_t{-1});
        // No chunk_end without indices before it, and none twice in a row.
        for (size_t j = 0; j < e.size(); ++j)
          if (e[j] == -1) EXPECT_TRUE(j > 0 && e[j - 1] != -1);
      }
      EXPECT_GE(ends, 1);
      EXPECT_LE(ends, n);
    }
  }
}

TEST(ThreadPool, WakeNowWakesWorkersAtOnce) {
  ThreadPool pool(2, std::chrono::hours(1));
  EXPECT_TRUE(WorkerTakesPart(std::chrono::milliseconds(0), [&](const auto& fn) { pool.Run(8, fn, true); }));
}

TEST(ThreadPool, WakesWorkersOnceACallRunsPastWakeAfter) {
  // The first index outlasts wake_after, so the caller wakes the worker after it.
  ThreadPool pool(2, std::chrono::milliseconds(1));
  EXPECT_TRUE(WorkerTakesPart(std::chrono::milliseconds(5), [&](const auto& fn) { pool.Run(8, fn); }));
}

}  // namespace
}  // namespace paved::constraints

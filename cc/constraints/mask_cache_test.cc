// The mask cache's memory bound, its pinned half, and masks read lock-free while other threads
// evict.
#include "cc/constraints/mask_cache.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/constraints/batch_masker.h"
#include "cc/constraints/constraint.h"
#include "cc/constraints/dfa.h"
#include "cc/constraints/regex_parser.h"
#include "cc/constraints/test_util.h"
#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

std::shared_ptr<CachedMask> MaskOf(uint32_t value) {
  auto m = std::make_shared<CachedMask>();
  m->words.assign(4, value);
  return m;
}

TEST(MaskCache, PinsAtMostHalfAndEvictsOnlyUnpinnedMasks) {
  MaskCache cache(/*num_words=*/4, /*max_bytes=*/0);  // the minimum: kMinCachedMasks masks
  const size_t capacity = cache.capacity();
  ASSERT_EQ(capacity, kMinCachedMasks);
  // Every insert asks for a pin: the first half gets one, the rest are LRU entries.
  std::vector<const CachedMask*> pinned_masks;
  for (uint64_t key = 0; key < 10 * capacity; ++key) {
    bool pinned = false;
    const auto m = cache.Insert(key, MaskOf(static_cast<uint32_t>(key)), &pinned);
    EXPECT_EQ(pinned, key < capacity / 2) << key;
    if (pinned) pinned_masks.push_back(m.get());
    const MaskCache::Stats s = cache.stats();
    EXPECT_LE(s.entries, capacity);
    EXPECT_EQ(s.bytes, s.entries * 4 * 4);
  }
  const MaskCache::Stats s = cache.stats();
  EXPECT_EQ(s.entries, capacity);
  EXPECT_EQ(s.pinned, capacity / 2);
  EXPECT_EQ(s.evictions, 10 * capacity - capacity);
  // Pinned masks survived all that eviction, at the same address.
  for (uint64_t key = 0; key < capacity / 2; ++key) EXPECT_EQ(cache.Find(key).get(), pinned_masks[key]);
  // The LRU half holds the most recent unpinned keys.
  EXPECT_NE(cache.Find(10 * capacity - 1), nullptr);
  EXPECT_EQ(cache.Find(capacity / 2), nullptr);
  // A second insert of a cached key returns the first mask and does not pin again.
  bool pinned = true;
  EXPECT_EQ(cache.Insert(0, MaskOf(7), &pinned).get(), pinned_masks[0]);
  EXPECT_FALSE(pinned);
}

// Reference masks of `[a-z]{0,N}!` after k letters, unrestricted and with a budget that only
// leaves room for "!" (a restricted mask), from a constraint with the default cache.
constexpr int kLetters = 70;

std::shared_ptr<DfaConstraint> LettersConstraint(const std::shared_ptr<const Vocab>& vocab, size_t cache_bytes) {
  Ast ast;
  const int root = ParseRegex("[a-z]{0," + std::to_string(kLetters) + "}!", &ast);
  return std::make_shared<DfaConstraint>(vocab, CompileDfa(ast, root), "regex", cache_bytes);
}

std::unique_ptr<State> LettersState(const Constraint& c, int letters, bool tight_budget) {
  // With max_tokens = letters + 2 the landing limit is 0: only tokens that reach "!" fit.
  auto s = c.NewState(tight_budget ? std::optional<int64_t>(letters + 2) : std::nullopt);
  for (int i = 0; i < letters; ++i) EXPECT_TRUE(s->Advance('a'));
  return s;
}

TEST(MaskCache, ConcurrentFillsWhileOtherThreadsEvict) {
  const auto vocab = testing::ByteVocab();
  const auto words = static_cast<size_t>(vocab->num_words());
  // The minimum cache (16 masks, 8 pinned) against 71 states x 2 budgets: constant eviction.
  const auto small = LettersConstraint(vocab, /*cache_bytes=*/0);
  const auto reference = LettersConstraint(vocab, kMaskCacheBytes);
  std::vector<std::unique_ptr<State>> states;
  std::vector<std::vector<uint32_t>> expected;
  for (int k = 0; k <= kLetters; ++k) {
    for (bool tight : {false, true}) {
      states.push_back(LettersState(*small, k, tight));
      expected.emplace_back(words);
      LettersState(*reference, k, tight)->FillMask(expected.back().data());
    }
  }
  constexpr int kThreads = 3;
  constexpr int kRounds = 300;
  constexpr int kRows = 24;
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Two threads per masker, waking at once: pool workers read and evict concurrently too.
      BatchMasker masker(vocab->size(), 2, std::chrono::microseconds(0));
      std::mt19937 rng(static_cast<uint32_t>(t));
      std::vector<const State*> rows(kRows);
      std::vector<size_t> picked(kRows);
      std::vector<int32_t> bitmask(kRows * words);
      std::vector<int32_t> row_index(kRows);
      for (int round = 0; round < kRounds; ++round) {
        for (int r = 0; r < kRows; ++r) {
          picked[static_cast<size_t>(r)] = std::uniform_int_distribution<size_t>(0, states.size() - 1)(rng);
          rows[static_cast<size_t>(r)] = states[picked[static_cast<size_t>(r)]].get();
        }
        // Odd rounds: the deduplicated fill, whose unpinned masks must outlive the other
        // threads' evictions until they are copied.
        const bool unique = round % 2 == 1;
        if (unique) {
          masker.FillUniqueBitmask(rows.data(), kRows, bitmask.data(), row_index.data());
        } else {
          masker.FillBitmask(rows.data(), kRows, bitmask.data());
        }
        for (size_t r = 0; r < kRows; ++r) {
          const std::vector<uint32_t>& want = expected[picked[r]];
          const size_t at = unique ? static_cast<size_t>(row_index[r]) : r;
          for (size_t w = 0; w < words; ++w) {
            if (static_cast<uint32_t>(bitmask[at * words + w]) != want[w]) {
              ++mismatches;
              break;
            }
          }
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  const ConstraintStats stats = small->stats();
  EXPECT_EQ(stats.cache.capacity, kMinCachedMasks);
  EXPECT_LE(stats.cache.entries, stats.cache.capacity);
  EXPECT_EQ(stats.cache.pinned, stats.cache.capacity / 2);
  EXPECT_GT(stats.cache.evictions, 0u);
}

}  // namespace
}  // namespace paved::constraints

#include "cc/constraints/token_bitmask.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

TEST(TokenBitmask, WordsRoundUp) {
  EXPECT_EQ(BitmaskWords(1), 1);
  EXPECT_EQ(BitmaskWords(32), 1);
  EXPECT_EQ(BitmaskWords(33), 2);
  EXPECT_EQ(BitmaskWords(128256), 4008);
}

TEST(TokenBitmask, SetClearTestAcrossWordBoundaries) {
  TokenBitmask m(70);
  for (int t : {0, 31, 32, 63, 64, 69}) m.Set(t);
  EXPECT_EQ(m.Count(), 6);
  EXPECT_TRUE(m.Test(32));
  EXPECT_FALSE(m.Test(33));
  m.Clear(32);
  EXPECT_EQ(m.Tokens(), (std::vector<int32_t>{0, 31, 63, 64, 69}));
  EXPECT_THROW(m.Set(70), std::out_of_range);
  EXPECT_THROW(m.Set(-1), std::out_of_range);
  EXPECT_FALSE(m.Test(1000));
}

TEST(TokenBitmask, SetAllLeavesNoPhantomTokens) {
  TokenBitmask m(70);
  m.SetAll();
  EXPECT_EQ(m.Count(), 70);
  EXPECT_EQ(m.Tokens().back(), 69);
  m.ClearAll();
  EXPECT_EQ(m.Count(), 0);
}

TEST(ApplyBitmaskRows, MasksOnlyDisallowedTokensOfSelectedRows) {
  const int64_t vocab = 40;
  const int64_t words = BitmaskWords(vocab);
  std::vector<float> logits(3 * vocab, 1.0f);
  std::vector<int32_t> mask(3 * words, 0);
  // Row 0 allows {0, 33}; row 1 is not selected; row 2 allows everything.
  mask[0] = 1;
  mask[1] = 1 << 1;
  mask[2 * words] = -1;
  mask[2 * words + 1] = -1;
  const int64_t rows[] = {0, 2};
  ApplyBitmaskRows(logits.data(), mask.data(), vocab, rows, 2);
  for (int64_t t = 0; t < vocab; ++t) {
    const bool allowed = t == 0 || t == 33;
    EXPECT_EQ(std::isinf(logits[t]), !allowed) << "token " << t;
    EXPECT_EQ(logits[vocab + t], 1.0f);
    EXPECT_EQ(logits[2 * vocab + t], 1.0f);
  }
}

TEST(ApplyMaskRow, MatchesBitByBitReferenceOnMixedWords) {
  for (const int64_t vocab : {32, 100, 1000, 4133}) {
    std::mt19937 rng(static_cast<uint32_t>(vocab));
    std::vector<uint32_t> mask(static_cast<size_t>(BitmaskWords(vocab)));
    for (uint32_t& w : mask) w = rng() % 4 == 0 ? ~0u : rng() % 3 == 0 ? 0u : rng();
    std::vector<float> row(static_cast<size_t>(vocab));
    for (size_t t = 0; t < row.size(); ++t) row[t] = static_cast<float>(t) - 50.0f;
    std::vector<float> expected = row;
    for (int64_t t = 0; t < vocab; ++t)
      if (((mask[static_cast<size_t>(t >> 5)] >> (t & 31)) & 1u) == 0)
        expected[static_cast<size_t>(t)] = -std::numeric_limits<float>::infinity();
    ApplyMaskRow(row.data(), mask.data(), vocab);
    EXPECT_EQ(row, expected) << "vocab " << vocab;
  }
}

}  // namespace
}  // namespace paved::constraints

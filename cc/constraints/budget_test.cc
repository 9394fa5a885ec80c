// Budget-aware termination: a request that samples any allowed token always ends with EOS in
// an accepting state within max_tokens.
#include <string>
#include <vector>

#include "cc/constraints/compile.h"
#include "cc/constraints/dfa.h"
#include "cc/constraints/regex_parser.h"
#include "cc/constraints/test_util.h"
#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

void ExpectWalksFinishWithinBudget(const Constraint& c, const std::vector<int64_t>& budgets, int seeds) {
  for (int64_t budget : budgets) {
    if (budget < c.min_tokens()) continue;
    for (int seed = 0; seed < seeds; ++seed) {
      const auto r = testing::RandomWalk(c, budget, static_cast<uint32_t>(seed));
      ASSERT_FALSE(r.mask_was_empty) << "budget " << budget << " seed " << seed << " text " << r.text;
      ASSERT_TRUE(r.finished) << "budget " << budget << " seed " << seed << " text " << r.text;
      EXPECT_LE(r.tokens, budget);
    }
  }
}

TEST(Budget, RegexWalksCloseBeforeTheBudget) {
  const auto vocab = testing::ByteVocab();
  const auto c = CompileRegex(vocab, "(ab|[a-z]{2,6}\\d*)+(\\.[a-z]{3})?!");
  EXPECT_EQ(c->min_tokens(), 4);  // "ab!" byte by byte, then EOS
  ExpectWalksFinishWithinBudget(*c, {4, 5, 6, 9, 17, 40}, 40);
}

TEST(Budget, JsonWalksCloseBeforeTheBudget) {
  const auto vocab = testing::ByteVocab();
  const std::string schema =
      R"({"type":"object","properties":{"name":{"type":"string"},"n":{"type":"number"},
          "list":{"type":"array","items":{"type":"string"}}},"required":["name","list"]})";
  for (const JsonWhitespace ws : {JsonWhitespace::kCompact, JsonWhitespace::kFree}) {
    const auto c = CompileJsonSchema(vocab, schema, ws);
    ExpectWalksFinishWithinBudget(*c, {c->min_tokens(), c->min_tokens() + 1, 30, 64}, 30);
  }
}

TEST(Budget, ChoiceWalksCloseBeforeTheBudget) {
  const auto vocab = testing::ByteVocab({"The ", "Alien", ", ", "s, ", "Thing"});
  const std::vector<std::string> titles = {"Alien", "Aliens", "The Thing", "The Fly", "Up", "Heat", "Her"};
  for (bool distinct : {false, true}) {
    const auto c = CompileChoice(vocab, titles, 3, ", ", distinct);
    ExpectWalksFinishWithinBudget(*c, {c->min_tokens(), c->min_tokens() + 2, 25}, 30);
  }
}

TEST(Budget, TooSmallBudgetIsRefusedUpFront) {
  const auto vocab = testing::ByteVocab();
  const auto c = CompileRegex(vocab, "abcdef");
  EXPECT_EQ(c->min_tokens(), 7);
  EXPECT_THROW(c->NewState(6), ConstraintError);
  EXPECT_THROW(c->NewState(0), ConstraintError);
  auto s = c->NewState(7);
  // Every allowed token must leave room for the rest, one byte per token, and EOS.
  EXPECT_EQ(s->AllowedTokens(), (std::vector<int32_t>{'a', 256 + 8, 256 + 9}));
}

TEST(Budget, FarBudgetUsesTheCachedMask) {
  const auto vocab = testing::ByteVocab();
  const auto c = CompileRegex(vocab, "[a-z]+");
  auto unlimited = c->NewState(std::nullopt);
  auto far = c->NewState(1000);
  EXPECT_EQ(unlimited->AllowedTokens(), far->AllowedTokens());
  std::shared_ptr<const CachedMask> hold;
  std::vector<uint32_t> scratch(static_cast<size_t>(vocab->num_words()));
  EXPECT_NE(far->Mask(scratch.data(), &hold), scratch.data());  // served from the cache
}

TEST(Budget, VocabWithoutSingleByteTokensUsesTokenDistances) {
  // No single-byte token for 'b': distances are token-level and exact.
  std::vector<std::string> tokens = {"a", "c", "ab", "bc", "abc", "bb"};
  const auto vocab = std::make_shared<Vocab>(tokens, std::vector<int32_t>{6}, 7);
  EXPECT_FALSE(vocab->has_all_byte_tokens());
  const auto c = CompileRegex(vocab, "a(bb)*c");
  EXPECT_EQ(c->min_tokens(), 3);  // "a", "c", EOS
  ExpectWalksFinishWithinBudget(*c, {2, 3, 4, 8}, 30);
  EXPECT_THROW(CompileRegex(vocab, "b"), ConstraintError);  // no token sequence spells "b"
}

TEST(Budget, TokensIntoStatesNoTokenCanCompleteAreNeverAllowed) {
  // "abd" leads to a state that needs an "e", which no token has; "a" to one that needs a
  // token starting with "b".
  const auto vocab = std::make_shared<Vocab>(std::vector<std::string>{"a", "ab", "abd", "c"}, std::vector<int32_t>{4}, 5);
  const auto c = CompileRegex(vocab, "ab(c|de)");
  for (const std::optional<int64_t> budget : {std::optional<int64_t>(), std::optional<int64_t>(10)}) {
    auto s = c->NewState(budget);
    EXPECT_EQ(s->AllowedTokens(), (std::vector<int32_t>{1}));
    EXPECT_FALSE(s->Advance(0));
    EXPECT_FALSE(s->Advance(2));
    EXPECT_TRUE(s->Advance(1));
    EXPECT_TRUE(s->Advance(3));
    EXPECT_TRUE(s->Advance(4));
  }
}

}  // namespace
}  // namespace paved::constraints

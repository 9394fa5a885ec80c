#include "cc/constraints/choice.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "cc/constraints/compile.h"
#include "cc/constraints/test_util.h"
#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

std::vector<std::string> Split(const std::string& text, const std::string& sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t at; (at = text.find(sep, start)) != std::string::npos; start = at + sep.size())
    parts.push_back(text.substr(start, at - start));
  parts.push_back(text.substr(start));
  return parts;
}

// Feeds `text` one byte token at a time; false if any byte is refused.
bool Feed(State* s, const std::string& text) {
  for (char c : text)
    if (!s->Advance(static_cast<uint8_t>(c))) return false;
  return true;
}

const std::vector<std::string> kTitles = {"Alien", "Aliens", "The Thing", "The Fly", "Up", "Heat", "Her", "It"};

TEST(Choice, SingleItemAllowsExactlyTheCatalogue) {
  const auto vocab = testing::ByteVocab();
  const auto c = CompileChoice(vocab, kTitles, 1, "", false);
  const std::set<std::string> titles(kTitles.begin(), kTitles.end());
  for (uint32_t seed = 0; seed < 40; ++seed) {
    const auto r = testing::RandomWalk(*c, std::nullopt, seed);
    ASSERT_TRUE(r.finished);
    EXPECT_TRUE(titles.count(r.text)) << r.text;
  }
  auto s = c->NewState(std::nullopt);
  ASSERT_TRUE(Feed(s.get(), "Alien"));
  EXPECT_TRUE(s->is_accepting());  // "Alien" is complete, "Aliens" still possible
  EXPECT_TRUE(Feed(s.get(), "s"));
  EXPECT_FALSE(s->Advance('s'));
}

TEST(Choice, ListModeAllowsRepeatsUnlessDistinct) {
  const auto vocab = testing::ByteVocab();
  const auto plain = CompileChoice(vocab, kTitles, 3, ", ", false);
  auto s = plain->NewState(std::nullopt);
  EXPECT_TRUE(Feed(s.get(), "Up, Up, Up"));
  EXPECT_TRUE(s->is_accepting());
  EXPECT_FALSE(s->Advance(','));  // exactly k items

  const auto distinct = CompileChoice(vocab, kTitles, 3, ", ", true);
  s = distinct->NewState(std::nullopt);
  EXPECT_TRUE(Feed(s.get(), "Up, Alien, "));
  EXPECT_FALSE(s->Advance('U'));  // "Up" is used and no other item starts with U
  EXPECT_TRUE(Feed(s.get(), "Aliens"));
  EXPECT_TRUE(s->is_accepting());
  s->Reset();
  EXPECT_TRUE(Feed(s.get(), "Alien, Alien"));  // may still become "Aliens"
  EXPECT_FALSE(s->Advance(','));                // but cannot complete "Alien" again
  EXPECT_FALSE(s->Advance(vocab->eos_ids()[0]));
}

TEST(Choice, DistinctTokenSpanningItemsCannotRepeat) {
  // "Up, Up" as one token must be refused in distinct mode, allowed otherwise.
  const auto vocab = testing::ByteVocab({"Up, Up", "Up, It", ", "});
  const int32_t up_up = 256, up_it = 257;
  auto s = CompileChoice(vocab, kTitles, 2, ", ", true)->NewState(std::nullopt);
  const std::vector<int32_t> allowed = s->AllowedTokens();
  EXPECT_EQ(std::count(allowed.begin(), allowed.end(), up_up), 0);
  EXPECT_EQ(std::count(allowed.begin(), allowed.end(), up_it), 1);
  EXPECT_FALSE(s->Advance(up_up));
  EXPECT_TRUE(s->Advance(up_it));
  EXPECT_TRUE(s->is_accepting());
  auto p = CompileChoice(vocab, kTitles, 2, ", ", false)->NewState(std::nullopt);
  EXPECT_TRUE(p->Advance(up_up));
}

TEST(Choice, DistinctRandomWalksHaveDistinctItems) {
  const auto vocab = testing::ByteVocab({"The ", "Alien", ", ", "s, ", "Up, ", "Thing"});
  const std::set<std::string> titles(kTitles.begin(), kTitles.end());
  for (int k : {1, 3, 8}) {
    const auto c = CompileChoice(vocab, kTitles, k, ", ", true);
    for (uint32_t seed = 0; seed < 30; ++seed) {
      const auto r = testing::RandomWalk(*c, std::nullopt, seed);
      ASSERT_TRUE(r.finished) << r.text;
      const std::vector<std::string> items = Split(r.text, ", ");
      EXPECT_EQ(items.size(), static_cast<size_t>(k)) << r.text;
      EXPECT_EQ(std::set<std::string>(items.begin(), items.end()).size(), items.size()) << r.text;
      for (const std::string& item : items) EXPECT_TRUE(titles.count(item)) << r.text;
    }
  }
}

TEST(Choice, CompileErrors) {
  const auto vocab = testing::ByteVocab();
  EXPECT_THROW(CompileChoice(vocab, {}, 1, ", ", false), ConstraintError);
  EXPECT_THROW(CompileChoice(vocab, kTitles, 0, ", ", false), ConstraintError);
  EXPECT_THROW(CompileChoice(vocab, kTitles, 2, "", false), ConstraintError);
  EXPECT_THROW(CompileChoice(vocab, {"a", ""}, 2, ", ", false), ConstraintError);
  EXPECT_THROW(CompileChoice(vocab, {"a", "b", "a"}, 3, ", ", true), ConstraintError);
  EXPECT_NO_THROW(CompileChoice(vocab, {"a", "b", "a"}, 3, ", ", false));
  try {
    CompileChoice(vocab, {"Up", "Up, Up and Away"}, 2, ", ", false);
    FAIL() << "ambiguous catalogue accepted";
  } catch (const ConstraintError& e) {
    EXPECT_NE(std::string(e.what()).find("\"Up\" and \"Up, Up and Away\""), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(CompileChoice(vocab, {"Up", "Up, Up and Away"}, 1, ", ", false));
  EXPECT_NO_THROW(CompileChoice(vocab, {"Up", "Up, Up and Away"}, 2, "\n", false));
  // A vocabulary without a single-byte token for 'q'.
  const auto no_q = std::make_shared<Vocab>(std::vector<std::string>{"a", "b", "qa"}, std::vector<int32_t>{3}, 4);
  EXPECT_THROW(CompileChoice(no_q, {"qa"}, 1, "", false), ConstraintError);
}

TEST(Choice, LargeCatalogueCompilesAndStaysCached) {
  const auto vocab = testing::ByteVocab();
  std::vector<std::string> items;
  for (int i = 0; i < 20000; ++i) items.push_back("title " + std::to_string(i * 7919 % 100003));
  const auto c = CompileChoice(vocab, items, 2, "\n", false);
  const auto r = testing::RandomWalk(*c, std::nullopt, 1);
  ASSERT_TRUE(r.finished);
  EXPECT_EQ(Split(r.text, "\n").size(), 2u);
  const auto before = c->stats().cache;
  testing::RandomWalk(*c, std::nullopt, 1);  // same walk: every mask is cached now
  EXPECT_EQ(c->stats().cache.misses, before.misses);
}

}  // namespace
}  // namespace paved::constraints

// The mask and Advance must agree: a token's bit is set iff advancing by it succeeds, for
// every constraint kind, with and without a token budget, at every step of random walks.
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cc/constraints/compile.h"
#include "cc/constraints/test_util.h"
#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

void ExpectMaskMatchesAdvance(const Constraint& c, std::optional<int64_t> max_tokens, uint32_t seed) {
  const Vocab& v = c.vocab();
  std::mt19937 rng(seed);
  std::vector<int32_t> prefix;
  auto state = c.NewState(max_tokens);
  std::vector<uint32_t> mask(static_cast<size_t>(v.num_words()));
  while (!state->is_finished()) {
    state->FillMask(mask.data());
    std::vector<int32_t> allowed;
    for (int32_t t = 0; t < v.size(); ++t) {
      auto probe = c.NewState(max_tokens);
      for (int32_t p : prefix) ASSERT_TRUE(probe->Advance(p));
      const bool bit = (mask[static_cast<size_t>(t >> 5)] >> (t & 31)) & 1u;
      ASSERT_EQ(bit, probe->Advance(t)) << "token " << t << " '" << v.token(t) << "' after " << prefix.size()
                                        << " tokens";
      if (bit) allowed.push_back(t);
    }
    ASSERT_FALSE(allowed.empty());
    const int32_t t = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
    ASSERT_TRUE(state->Advance(t));
    prefix.push_back(t);
  }
}

TEST(Consistency, MaskBitIffAdvanceSucceeds) {
  const auto vocab = testing::ByteVocab({"Up, ", "Up, Up", ", U", "s, The", "The ", "Alien", "ab", "\":", "{\"",
                                         "12", "\"a", "e\"", "\",\"", "true"});
  const std::vector<std::string> titles = {"Alien", "Aliens", "The Thing", "The Fly", "Up", "Heat", "Her"};
  std::vector<std::shared_ptr<Constraint>> constraints = {
      CompileRegex(vocab, "(ab|a[b-d]+)\\d{1,3}(\\.\\d+)?"),
      CompileJsonSchema(vocab,
                        R"({"type":"object","properties":{"a":{"type":"string","maxLength":4},
                            "b":{"type":"integer","minimum":-20,"maximum":300},"c":{"type":"boolean"}},
                            "required":["b"]})",
                        JsonWhitespace::kFree),
      CompileChoice(vocab, titles, 1, "", false),
      CompileChoice(vocab, titles, 3, ", ", false),
      CompileChoice(vocab, titles, 4, ", ", true),
  };
  // A vocabulary without single-byte tokens: exact token-level distances.
  const auto sparse = std::make_shared<Vocab>(std::vector<std::string>{"a", "ab", "abd", "c", "bb", "b", "de"},
                                              std::vector<int32_t>{7}, 9);
  constraints.push_back(CompileRegex(sparse, "a(bb)*(c|de)|abd?e"));
  for (const auto& c : constraints) {
    for (uint32_t seed = 0; seed < 6; ++seed) {
      SCOPED_TRACE("kind " + c->stats().kind + " seed " + std::to_string(seed));
      ExpectMaskMatchesAdvance(*c, std::nullopt, seed);
      ExpectMaskMatchesAdvance(*c, c->min_tokens() + static_cast<int64_t>(seed), seed);
    }
  }
}

}  // namespace
}  // namespace paved::constraints

// Helpers for the constraint tests: a synthetic byte-level vocabulary and random walks.
#ifndef PAVED_CC_CONSTRAINTS_TEST_UTIL_H_
#define PAVED_CC_CONSTRAINTS_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cc/constraints/constraint.h"
#include "cc/constraints/vocab.h"

namespace paved::constraints::testing {

// Multi-byte tokens typical of JSON and prose, so walks cross automaton boundaries mid-token.
inline std::vector<std::string> CommonTokens() {
  return {"{\"", "\":", "\",", "\"}", "\":\"", "true", "false", "null", "ab", "abc", "  ", "\\n", "\\u00",
          "12",  "-1",  ", ",  "\"a", "Alien", "The ", "}]", "\"]", "[{", "},{", "0.5", "e+", "\xc3\xa9"};
}

// 256 single-byte tokens, then `extra`, then one special token (empty bytes), then EOS.
inline std::shared_ptr<const Vocab> ByteVocab(const std::vector<std::string>& extra = CommonTokens(),
                                              int64_t padding = 3) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  tokens.insert(tokens.end(), extra.begin(), extra.end());
  tokens.emplace_back();
  const auto eos = static_cast<int32_t>(tokens.size());
  tokens.emplace_back("</s>");
  const auto size = static_cast<int64_t>(tokens.size()) + padding;
  return std::make_shared<Vocab>(std::move(tokens), std::vector<int32_t>{eos}, size);
}

struct WalkResult {
  std::string text;    // bytes of the ordinary tokens
  bool finished;       // ended with EOS
  int64_t tokens;      // EOS included
  bool mask_was_empty; // a step had no allowed token
};

// Samples uniformly among the allowed tokens until EOS (or `step_cap` steps), checking that
// every sampled token advances the state.
inline WalkResult RandomWalk(const Constraint& c, std::optional<int64_t> max_tokens, uint32_t seed,
                             int step_cap = 4000) {
  std::mt19937 rng(seed);
  auto state = c.NewState(max_tokens);
  WalkResult r{"", false, 0, false};
  for (int step = 0; step < step_cap && !state->is_finished(); ++step) {
    const std::vector<int32_t> allowed = state->AllowedTokens();
    if (allowed.empty()) {
      r.mask_was_empty = true;
      break;
    }
    const int32_t t = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
    if (!state->Advance(t)) break;
    if (!c.vocab().is_eos(t)) r.text += c.vocab().token(t);
  }
  r.finished = state->is_finished();
  r.tokens = state->num_generated();
  return r;
}

}  // namespace paved::constraints::testing

#endif  // PAVED_CC_CONSTRAINTS_TEST_UTIL_H_

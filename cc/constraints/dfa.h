// Byte-level DFA compiled from an Ast: Thompson NFA -> subset construction -> trimming of
// states that cannot reach acceptance -> Hopcroft minimization. Bytes that no edge tells apart
// share a byte class, so the transition table is [states x classes] rather than x 256.
#ifndef PAVED_CC_CONSTRAINTS_DFA_H_
#define PAVED_CC_CONSTRAINTS_DFA_H_

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cc/constraints/regex_ast.h"

namespace paved::constraints {

struct Dfa {
  static constexpr int32_t kDead = -1;

  int32_t num_states = 0;
  int32_t num_classes = 0;
  int32_t start = 0;
  std::array<uint8_t, 256> byte_class{};
  // transitions[state * num_classes + class]: next state or kDead. Every state reachable
  // through it can still reach an accepting state.
  std::vector<int32_t> transitions;
  std::vector<uint8_t> accepting;

  int32_t Next(int32_t state, uint8_t byte) const {
    return transitions[static_cast<size_t>(state) * static_cast<size_t>(num_classes) + byte_class[byte]];
  }
  // State after `bytes` from `state`, or kDead.
  int32_t Walk(int32_t state, std::string_view bytes) const;
  bool Matches(std::string_view bytes) const;
};

// Compiles the expression rooted at `root`. Throws ConstraintError when it matches nothing or
// exceeds kMaxNfaStates / kMaxDfaStates / kMaxSubsetEntries / kMaxDeterminizeSteps.
Dfa CompileDfa(const Ast& ast, int root);

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_DFA_H_

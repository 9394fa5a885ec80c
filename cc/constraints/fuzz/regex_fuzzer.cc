// libFuzzer target: the regex parser (any bytes as a pattern), then, for trees small enough to
// compile quickly, the DFA compiler and its structural invariants.
#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/constraints/dfa.h"
#include "cc/constraints/fuzz/fuzz_checks.h"
#include "cc/constraints/regex_ast.h"
#include "cc/constraints/regex_parser.h"

namespace pc = paved::constraints;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string pattern(reinterpret_cast<const char*>(data), size);
  pc::Ast ast;
  int root;
  try {
    root = pc::ParseRegex(pattern, &ast);
  } catch (const pc::ConstraintError&) {
    return 0;  // rejecting a pattern with a message is the expected outcome for most inputs
  }
  pc::fuzz::CheckAst(ast, root);
  if (pc::fuzz::EstimatedNfaStates(ast, root) > pc::fuzz::kCompileBudget) return 0;
  try {
    const pc::Dfa dfa = pc::CompileDfa(ast, root);
    pc::fuzz::CheckDfa(dfa);
    // Walking arbitrary bytes must stay inside the table.
    (void)dfa.Matches(pattern);
  } catch (const pc::ConstraintError&) {
  }
  return 0;
}

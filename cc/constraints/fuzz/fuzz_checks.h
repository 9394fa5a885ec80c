// Shared by the fuzz targets: invariants that must hold for any input the front ends accept.
// A violated invariant aborts (libFuzzer and the corpus replay both report an abort as a crash).
#ifndef PAVED_CC_CONSTRAINTS_FUZZ_FUZZ_CHECKS_H_
#define PAVED_CC_CONSTRAINTS_FUZZ_FUZZ_CHECKS_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cc/constraints/dfa.h"
#include "cc/constraints/regex_ast.h"

namespace paved::constraints::fuzz {

[[noreturn]] inline void Violated(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

#define PAVED_FUZZ_CHECK(cond) \
  do {                         \
    if (!(cond)) ::paved::constraints::fuzz::Violated(#cond); \
  } while (0)

// Children are added before their parents, so every child id is below its parent's; the
// expansion estimate below and the compiler's recursion both rely on the tree being acyclic.
inline void CheckAst(const Ast& ast, int root) {
  PAVED_FUZZ_CHECK(root >= 0 && static_cast<size_t>(root) < ast.size());
  for (size_t id = 0; id < ast.size(); ++id) {
    const Ast::Node& n = ast.node(static_cast<int>(id));
    for (int child : n.children) PAVED_FUZZ_CHECK(child >= 0 && static_cast<size_t>(child) < id);
    if (n.kind == Ast::Kind::kRepeat) {
      PAVED_FUZZ_CHECK(n.min >= 0);
      PAVED_FUZZ_CHECK(n.max == Ast::kUnbounded || n.max >= n.min);
    }
    if (n.kind == Ast::Kind::kSubsequence) PAVED_FUZZ_CHECK(n.required.size() + 1 == n.children.size());
    for (const CharSet::Range& r : n.chars.ranges()) {
      PAVED_FUZZ_CHECK(r.lo <= r.hi && r.hi <= kMaxCodepoint);
      PAVED_FUZZ_CHECK(r.hi < 0xD800 || r.lo > 0xDFFF);
    }
  }
}

// A cheap upper estimate of the Thompson NFA size of `root`, saturating. The fuzz targets only
// compile trees under a budget: the compiler's own limits (2M NFA / 100k DFA states) are
// correct but reaching them takes seconds per input, which would starve the bounded runs.
inline uint64_t EstimatedNfaStates(const Ast& ast, int root) {
  constexpr uint64_t kCap = uint64_t{1} << 40;
  std::vector<uint64_t> size(ast.size(), 0);
  const auto add = [&](uint64_t a, uint64_t b) { return std::min(kCap, a + b); };
  const auto mul = [&](uint64_t a, uint64_t b) { return b != 0 && a > kCap / b ? kCap : a * b; };
  for (size_t id = 0; id <= static_cast<size_t>(root); ++id) {
    const Ast::Node& n = ast.node(static_cast<int>(id));
    uint64_t s = 2;
    switch (n.kind) {
      case Ast::Kind::kEmpty:
        break;
      case Ast::Kind::kBytes:
        s = add(s, n.bytes.size());
        break;
      case Ast::Kind::kChars:
        s = add(s, mul(8, n.chars.ranges().size()));
        break;
      case Ast::Kind::kConcat:
      case Ast::Kind::kAlt:
      case Ast::Kind::kSubsequence:
        for (int child : n.children) s = add(s, mul(2, size[static_cast<size_t>(child)]));
        break;
      case Ast::Kind::kRepeat: {
        const uint64_t copies = static_cast<uint64_t>(n.max == Ast::kUnbounded ? n.min + 1 : std::max(n.min, n.max)) + 1;
        for (int child : n.children) s = add(s, mul(copies, size[static_cast<size_t>(child)]));
        break;
      }
    }
    size[id] = s;
  }
  return size[static_cast<size_t>(root)];
}

constexpr uint64_t kCompileBudget = 20000;

// The structural promises of dfa.h: a well-formed table whose every state can still reach
// acceptance (so a state is dead exactly when it is kDead).
inline void CheckDfa(const Dfa& dfa) {
  PAVED_FUZZ_CHECK(dfa.num_states > 0);
  PAVED_FUZZ_CHECK(dfa.num_classes > 0 && dfa.num_classes <= 256);
  PAVED_FUZZ_CHECK(dfa.start == 0);
  const auto n = static_cast<size_t>(dfa.num_states);
  const auto c = static_cast<size_t>(dfa.num_classes);
  PAVED_FUZZ_CHECK(dfa.transitions.size() == n * c);
  PAVED_FUZZ_CHECK(dfa.accepting.size() == n);
  for (uint8_t cls : dfa.byte_class) PAVED_FUZZ_CHECK(cls < c);
  std::vector<std::vector<int32_t>> preds(n);
  for (size_t s = 0; s < n; ++s) {
    for (size_t k = 0; k < c; ++k) {
      const int32_t t = dfa.transitions[s * c + k];
      PAVED_FUZZ_CHECK(t == Dfa::kDead || (t >= 0 && static_cast<size_t>(t) < n));
      if (t >= 0) preds[static_cast<size_t>(t)].push_back(static_cast<int32_t>(s));
    }
  }
  std::vector<char> live(n, 0);
  std::vector<int32_t> queue;
  for (size_t s = 0; s < n; ++s) {
    if (dfa.accepting[s]) {
      live[s] = 1;
      queue.push_back(static_cast<int32_t>(s));
    }
  }
  for (size_t i = 0; i < queue.size(); ++i) {
    for (int32_t p : preds[static_cast<size_t>(queue[i])]) {
      if (!live[static_cast<size_t>(p)]) {
        live[static_cast<size_t>(p)] = 1;
        queue.push_back(p);
      }
    }
  }
  PAVED_FUZZ_CHECK(queue.size() == n);
}

}  // namespace paved::constraints::fuzz

#endif  // PAVED_CC_CONSTRAINTS_FUZZ_FUZZ_CHECKS_H_

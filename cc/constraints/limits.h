// Size limits of the constraint engine. Every limit is checked before the work it bounds, and
// exceeding one raises ConstraintError (ValueError in Python) that names the limit.
#ifndef PAVED_CC_CONSTRAINTS_LIMITS_H_
#define PAVED_CC_CONSTRAINTS_LIMITS_H_

#include <cstddef>
#include <cstdint>

namespace paved::constraints {

// A regex pattern or JSON Schema document, in UTF-8 bytes.
constexpr size_t kMaxSpecBytes = size_t{1} << 20;
// Largest bound of one `{m,n}` quantifier, minLength/maxLength, minItems/maxItems.
constexpr int kMaxRepeat = 10000;
// Group nesting in a pattern (the parser is recursive).
constexpr int kMaxRegexNesting = 500;
// Intermediate byte-level NFA, and the compiled DFA (after minimization: 4 bytes per state
// and byte class, e.g. 100k states x 50 classes = 20 MB).
constexpr int32_t kMaxNfaStates = 2'000'000;
constexpr int32_t kMaxDfaStates = 100'000;
// Subset construction's own cost, which the two caps above do not bound: NFA states held by
// the DFA states' subsets in all (memory: each subset is kept twice, 8 bytes an entry), and its
// steps (time: epsilon-closure steps and transitions gathered). `(.{0,100}){0,100}` (18 bytes)
// stays under both state caps, yet its subsets hold thousands of NFA states each: it took 60 s
// and 7 GB before these limits, 1 s and ~100 MB to be refused with them. Large schemas stay
// far below (a 5000-character string: 260k entries, 3.6M closure steps; a 300-property
// object: 150k, 360k).
constexpr int64_t kMaxSubsetEntries = 10'000'000;
constexpr int64_t kMaxDeterminizeSteps = 100'000'000;
// Nodes of the expression tree a pattern or schema is parsed / lowered into (136 bytes each plus
// their vectors), checked as each node is added: the front ends expand some keywords (integer
// bounds: ~140 nodes for 45 bytes of schema), so without it a 1 MiB document could take
// gigabytes before the NFA limit was reached. Every node but concatenations (at most half of a
// tree) compiles to at least one NFA state, so a tree this large has an NFA of 500k+ states.
constexpr size_t kMaxAstNodes = 1'000'000;
// Nesting of JSON Schema subschemas (objects, arrays, anyOf, $ref); also bounds $ref recursion.
constexpr int kMaxSchemaDepth = 10;
// Nesting of a value matched by an unconstrained subschema ({} or true).
constexpr int kAnyJsonDepth = 3;
// Whitespace run allowed between JSON tokens in "free" whitespace mode.
constexpr int kFreeWhitespaceMax = 20;
// Catalogue (choice) constraints.
constexpr size_t kMaxCatalogueItems = 1'000'000;
constexpr size_t kMaxCatalogueBytes = size_t{16} << 20;
constexpr size_t kMaxItemBytes = 4096;
constexpr int kMaxListItems = 10000;
// Vocabulary: padded size, and length of one token (the trie stores depths as uint16).
constexpr int64_t kMaxVocabSize = int64_t{1} << 24;
constexpr size_t kMaxTokenBytes = 65535;
// Token masks cached per compiled constraint, in bytes (at least kMinCachedMasks masks);
// beyond it the least recently used mask is evicted and recomputed on its next use. Up to half
// of them may be pinned (never evicted; see MaskCache).
constexpr size_t kMaskCacheBytes = size_t{64} << 20;
constexpr size_t kMinCachedMasks = 16;

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_LIMITS_H_

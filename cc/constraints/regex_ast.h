// The intermediate language shared by the regex parser and the JSON Schema lowering: a
// regular-expression tree over Unicode code points (CharSet leaves) and raw byte strings.
// dfa.h compiles it to a byte-level automaton, encoding every code point as UTF-8.
#ifndef PAVED_CC_CONSTRAINTS_REGEX_AST_H_
#define PAVED_CC_CONSTRAINTS_REGEX_AST_H_

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace paved::constraints {

// Every user-facing error (bad pattern, unsupported keyword, size limit, bad argument) is a
// ConstraintError; the Python module turns it into ValueError.
class ConstraintError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

constexpr uint32_t kMaxCodepoint = 0x10FFFF;

// Appends the UTF-8 encoding of a Unicode scalar value.
void AppendUtf8(uint32_t cp, std::string* out);

// Decodes the code point starting at text[*pos] and advances *pos. Returns false (leaving *pos
// unchanged) on malformed UTF-8, overlongs and surrogates.
bool DecodeUtf8(const std::string& text, size_t* pos, uint32_t* cp);

// A set of Unicode scalar values as sorted, disjoint, non-adjacent inclusive ranges.
// Surrogates (U+D800..U+DFFF) are never members: they have no UTF-8 encoding.
class CharSet {
 public:
  struct Range {
    uint32_t lo;
    uint32_t hi;
  };

  CharSet() = default;
  static CharSet Single(uint32_t cp) { return Between(cp, cp); }
  static CharSet Between(uint32_t lo, uint32_t hi);
  // Every scalar value.
  static CharSet Any() { return Between(0, kMaxCodepoint); }

  void Add(uint32_t lo, uint32_t hi);
  void Add(const CharSet& other);
  CharSet Complement() const;
  CharSet Minus(const CharSet& other) const { return Intersect(other.Complement()); }
  CharSet Intersect(const CharSet& other) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<Range>& ranges() const { return ranges_; }

 private:
  void Normalize();
  std::vector<Range> ranges_;
};

// Arena of regex nodes; node ids are indices. Nodes are immutable once added.
class Ast {
 public:
  enum class Kind : uint8_t {
    kEmpty,   // matches ""
    kBytes,   // a literal byte string
    kChars,   // one code point from `chars`
    kConcat,  // children in sequence
    kAlt,     // any one child
    // children[0] repeated [min, max] times (max == kUnbounded for no upper bound), with
    // children[1], if present, between consecutive repetitions.
    kRepeat,
    // children[0..n-1] in order, each present or skipped (those with required[i] present),
    // consecutive present ones separated by children[n]; e.g. JSON object members. The
    // compiler instantiates each member once (a regex for it would need O(n^2) copies).
    kSubsequence,
  };
  static constexpr int kUnbounded = -1;

  struct Node {
    Kind kind;
    std::string bytes;
    CharSet chars;
    std::vector<int> children;
    std::vector<bool> required;  // kSubsequence
    int min = 0;
    int max = 0;
  };

  int Empty();
  int Bytes(std::string bytes);
  int Chars(CharSet chars);
  int Concat(std::vector<int> children);
  int Alt(std::vector<int> children);
  int Repeat(int child, int min, int max);
  int Optional(int child) { return Repeat(child, 0, 1); }
  // item (separator item)..., [min, max] items in all.
  int List(int item, int separator, int min, int max);
  int Subsequence(std::vector<int> members, std::vector<bool> required, int separator);

  const Node& node(int id) const { return nodes_[static_cast<size_t>(id)]; }
  size_t size() const { return nodes_.size(); }

 private:
  int Add(Node node);
  std::vector<Node> nodes_;
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_REGEX_AST_H_

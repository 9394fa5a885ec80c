#include "cc/constraints/regex_parser.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cc/constraints/limits.h"

namespace paved::constraints {
namespace {

CharSet Digits() { return CharSet::Between('0', '9'); }

CharSet WordChars() {
  CharSet s = CharSet::Between('a', 'z');
  s.Add('A', 'Z');
  s.Add('0', '9');
  s.Add('_', '_');
  return s;
}

CharSet SpaceChars() {
  CharSet s = CharSet::Between('\t', '\r');  // \t \n \v \f \r
  s.Add(' ', ' ');
  return s;
}

bool IsAsciiLetter(uint32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsDigit(uint32_t c) { return c >= '0' && c <= '9'; }

int HexValue(uint32_t c) {
  if (c >= '0' && c <= '9') return static_cast<int>(c - '0');
  if (c >= 'a' && c <= 'f') return static_cast<int>(c - 'a' + 10);
  if (c >= 'A' && c <= 'F') return static_cast<int>(c - 'A' + 10);
  return -1;
}

// Recursive-descent parser over the pattern's code points.
class Parser {
 public:
  Parser(std::vector<uint32_t> cps, Ast* ast) : cps_(std::move(cps)), ast_(ast) {}

  int ParseAll() {
    // Full matching is implicit, so a leading ^ and a trailing unescaped $ are redundant.
    size_t end = cps_.size();
    if (end > 0 && cps_[end - 1] == '$') {
      size_t backslashes = 0;
      while (backslashes + 1 < end && cps_[end - 2 - backslashes] == '\\') ++backslashes;
      if (backslashes % 2 == 0) --end;
    }
    cps_.resize(end);
    if (!cps_.empty() && cps_[0] == '^') pos_ = 1;
    const int root = ParseAlternation(0);
    if (pos_ < cps_.size()) Fail("unbalanced parenthesis ')'", pos_);
    return root;
  }

 private:
  [[noreturn]] void Fail(const std::string& what, size_t at) const {
    throw ConstraintError("invalid regex: " + what + " at position " + std::to_string(at));
  }
  [[noreturn]] void Unsupported(const std::string& what, size_t at) const {
    throw ConstraintError("unsupported regex syntax: " + what + " at position " + std::to_string(at));
  }

  bool AtEnd() const { return pos_ >= cps_.size(); }
  uint32_t Peek(size_t ahead = 0) const {
    return pos_ + ahead < cps_.size() ? cps_[pos_ + ahead] : 0xFFFFFFFF;
  }
  bool Lookahead(const char* text) const {
    for (size_t i = 0; text[i] != '\0'; ++i) {
      if (Peek(i) != static_cast<uint8_t>(text[i])) return false;
    }
    return true;
  }

  int ParseAlternation(int nesting) {
    if (nesting > kMaxRegexNesting)
      Fail("groups nested deeper than " + std::to_string(kMaxRegexNesting), pos_);
    std::vector<int> branches{ParseConcat(nesting)};
    while (!AtEnd() && Peek() == '|') {
      ++pos_;
      branches.push_back(ParseConcat(nesting));
    }
    return ast_->Alt(std::move(branches));
  }

  int ParseConcat(int nesting) {
    std::vector<int> items;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') items.push_back(ParseRepeat(nesting));
    return ast_->Concat(std::move(items));
  }

  int ParseRepeat(int nesting) {
    int node = ParseAtom(nesting);
    bool repeated = false;
    while (!AtEnd()) {
      const size_t q_pos = pos_;
      int min, max;
      if (!ParseQuantifier(&min, &max)) break;
      if (repeated) Unsupported("multiple repeat (nested quantifier without a group)", q_pos);
      if (!AtEnd() && Peek() == '?') Unsupported("lazy quantifier", pos_);
      if (!AtEnd() && Peek() == '+') Unsupported("possessive quantifier", pos_);
      node = ast_->Repeat(node, min, max);
      repeated = true;
    }
    return node;
  }

  // Consumes a quantifier if one starts here; `{` without a valid bound is not one.
  bool ParseQuantifier(int* min, int* max) {
    switch (Peek()) {
      case '*':
        ++pos_, *min = 0, *max = Ast::kUnbounded;
        return true;
      case '+':
        ++pos_, *min = 1, *max = Ast::kUnbounded;
        return true;
      case '?':
        ++pos_, *min = 0, *max = 1;
        return true;
      case '{':
        return ParseBraces(min, max);
      default:
        return false;
    }
  }

  bool ParseBraces(int* min, int* max) {
    const size_t start = pos_;
    size_t i = pos_ + 1;
    const auto number = [&](int64_t* value) {
      const size_t first = i;
      *value = 0;
      while (i < cps_.size() && IsDigit(cps_[i])) {
        *value = std::min<int64_t>(*value * 10 + (cps_[i] - '0'), int64_t{1} << 40);
        ++i;
      }
      return i > first;
    };
    int64_t lo = 0, hi = -1;
    const bool has_lo = number(&lo);
    if (i < cps_.size() && cps_[i] == '}') {
      if (!has_lo) return false;
      hi = lo;
    } else if (i < cps_.size() && cps_[i] == ',') {
      ++i;
      const bool has_hi = number(&hi);
      if (!has_hi) hi = -1;
      if (i >= cps_.size() || cps_[i] != '}') return false;
      if (!has_lo && !has_hi) return false;
    } else {
      return false;
    }
    pos_ = i + 1;
    if (lo > kMaxRepeat || hi > kMaxRepeat)
      Fail("repetition bound exceeds the limit of " + std::to_string(kMaxRepeat), start);
    if (hi >= 0 && hi < lo) Fail("min repeat greater than max repeat", start);
    *min = static_cast<int>(lo);
    *max = hi < 0 ? Ast::kUnbounded : static_cast<int>(hi);
    return true;
  }

  int ParseAtom(int nesting) {
    const size_t at = pos_;
    const uint32_t c = Peek();
    switch (c) {
      case '(':
        return ParseGroup(nesting);
      case '[':
        return ast_->Chars(ParseClass());
      case '.':
        ++pos_;
        return ast_->Chars(CharSet::Single('\n').Complement());
      case '\\':
        return ParseEscapeAtom();
      case '*':
      case '+':
      case '?':
        Fail("nothing to repeat", at);
      case '{': {
        int min, max;
        if (ParseBraces(&min, &max)) Fail("nothing to repeat", at);
        ++pos_;
        return ast_->Chars(CharSet::Single('{'));
      }
      case '^':
      case '$':
        Unsupported(std::string("anchor '") + static_cast<char>(c) +
                        "' (only a leading ^ and a trailing $ are allowed)",
                    at);
      default:
        ++pos_;
        return ast_->Chars(CharSet::Single(c));
    }
  }

  int ParseGroup(int nesting) {
    const size_t open = pos_;
    ++pos_;  // (
    if (Peek() == '?') {
      if (Lookahead("?:")) {
        pos_ += 2;
      } else if (Lookahead("?P<") || (Lookahead("?<") && Peek(2) != '=' && Peek(2) != '!')) {
        pos_ += Peek(1) == 'P' ? 3 : 2;
        const size_t name_start = pos_;
        while (!AtEnd() && Peek() != '>') ++pos_;
        if (AtEnd() || pos_ == name_start) Fail("bad group name", name_start);
        ++pos_;
      } else if (Lookahead("?#")) {
        while (!AtEnd() && Peek() != ')') ++pos_;
        if (AtEnd()) Fail("missing ), unterminated comment", open);
        ++pos_;
        return ast_->Empty();
      } else if (Lookahead("?=") || Lookahead("?!")) {
        Unsupported("lookahead", open);
      } else if (Lookahead("?<=") || Lookahead("?<!")) {
        Unsupported("lookbehind", open);
      } else if (Lookahead("?P=")) {
        Unsupported("backreference", open);
      } else if (Lookahead("?>")) {
        Unsupported("atomic group", open);
      } else if (Lookahead("?(")) {
        Unsupported("conditional group", open);
      } else {
        Unsupported("inline flags or unknown group extension '(?'", open);
      }
    }
    const int inner = ParseAlternation(nesting + 1);
    if (AtEnd() || Peek() != ')') Fail("missing ), unterminated subpattern", open);
    ++pos_;
    return inner;
  }

  int ParseEscapeAtom() {
    CharSet set;
    ParseEscape(/*in_class=*/false, &set);
    return ast_->Chars(std::move(set));
  }

  // Parses the escape at pos_ ('\\' included) into `out`. Returns true if it denotes a single
  // character (usable as a class range endpoint).
  bool ParseEscape(bool in_class, CharSet* out) {
    const size_t at = pos_;
    ++pos_;  // backslash
    if (AtEnd()) Fail("trailing backslash", at);
    const uint32_t c = Peek();
    ++pos_;
    const auto single = [&](uint32_t cp) {
      *out = CharSet::Single(cp);
      return true;
    };
    switch (c) {
      case 'd':
        *out = Digits();
        return false;
      case 'D':
        *out = Digits().Complement();
        return false;
      case 'w':
        *out = WordChars();
        return false;
      case 'W':
        *out = WordChars().Complement();
        return false;
      case 's':
        *out = SpaceChars();
        return false;
      case 'S':
        *out = SpaceChars().Complement();
        return false;
      case 'n':
        return single('\n');
      case 't':
        return single('\t');
      case 'r':
        return single('\r');
      case 'f':
        return single('\f');
      case 'v':
        return single('\v');
      case 'a':
        return single('\a');
      case '0':
        return single(0);
      case 'x':
        return single(ParseHex(2, at));
      case 'u':
        return single(ParseHex(4, at));
      case 'U':
        return single(ParseHex(8, at));
      case 'b':
        if (in_class) return single('\b');
        Unsupported("word boundary \\b", at);
      case 'B':
      case 'A':
      case 'Z':
      case 'z':
      case 'G':
        Unsupported(std::string("anchor \\") + static_cast<char>(c), at);
      case 'p':
      case 'P':
        Unsupported("Unicode property escape", at);
      case 'k':
        Unsupported("backreference", at);
      default:
        break;
    }
    if (IsDigit(c)) Unsupported("backreference", at);
    if (IsAsciiLetter(c)) Fail(std::string("bad escape \\") + static_cast<char>(c), at);
    return single(c);  // escaped punctuation, or any non-ASCII character
  }

  uint32_t ParseHex(int digits, size_t at) {
    uint32_t value = 0;
    for (int i = 0; i < digits; ++i) {
      const int h = AtEnd() ? -1 : HexValue(Peek());
      if (h < 0) Fail("incomplete hex escape", at);
      value = value * 16 + static_cast<uint32_t>(h);
      ++pos_;
    }
    if (value > kMaxCodepoint || (value >= 0xD800 && value <= 0xDFFF))
      Fail("escape is not a Unicode scalar value", at);
    return value;
  }

  CharSet ParseClass() {
    const size_t open = pos_;
    ++pos_;  // [
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++pos_;
    }
    CharSet set;
    bool first = true;
    while (true) {
      if (AtEnd()) Fail("unterminated character set", open);
      if (Peek() == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      if (Lookahead("[:")) Unsupported("POSIX character class", pos_);
      const size_t lo_pos = pos_;
      CharSet lo_set;
      const bool lo_single = ParseClassAtom(&lo_set);
      // A '-' before ']' or at the start is literal; otherwise it makes a range.
      if (Peek() == '-' && Peek(1) != ']' && pos_ + 1 < cps_.size()) {
        ++pos_;
        CharSet hi_set;
        const bool hi_single = ParseClassAtom(&hi_set);
        if (!lo_single || !hi_single) Fail("bad character range", lo_pos);
        const uint32_t lo = lo_set.ranges().front().lo;
        const uint32_t hi = hi_set.ranges().front().lo;
        if (lo > hi) Fail("bad character range (start > end)", lo_pos);
        set.Add(lo, hi);
      } else {
        set.Add(lo_set);
      }
    }
    return negate ? set.Complement() : set;
  }

  bool ParseClassAtom(CharSet* out) {
    if (Peek() == '\\') return ParseEscape(/*in_class=*/true, out);
    *out = CharSet::Single(Peek());
    ++pos_;
    return true;
  }

  std::vector<uint32_t> cps_;
  Ast* ast_;
  size_t pos_ = 0;
};

}  // namespace

int ParseRegex(const std::string& pattern, Ast* ast) {
  if (pattern.size() > kMaxSpecBytes)
    throw ConstraintError("regex pattern is " + std::to_string(pattern.size()) +
                          " bytes, over the limit of " + std::to_string(kMaxSpecBytes));
  std::vector<uint32_t> cps;
  cps.reserve(pattern.size());
  for (size_t i = 0; i < pattern.size();) {
    uint32_t cp;
    if (!DecodeUtf8(pattern, &i, &cp))
      throw ConstraintError("regex pattern is not valid UTF-8 at byte " + std::to_string(i));
    cps.push_back(cp);
  }
  return Parser(std::move(cps), ast).ParseAll();
}

}  // namespace paved::constraints

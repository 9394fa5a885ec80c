#include "cc/constraints/regex_ast.h"

#include <algorithm>
#include <utility>

#include "cc/constraints/limits.h"

namespace paved::constraints {
namespace {

constexpr uint32_t kSurrogateLo = 0xD800;
constexpr uint32_t kSurrogateHi = 0xDFFF;

}  // namespace

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool DecodeUtf8(const std::string& text, size_t* pos, uint32_t* cp) {
  const size_t i = *pos;
  if (i >= text.size()) return false;
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[i + k]); };
  const uint8_t b0 = byte(0);
  int len;
  uint32_t value;
  uint32_t min_value;
  if (b0 < 0x80) {
    *cp = b0;
    *pos = i + 1;
    return true;
  } else if ((b0 & 0xE0) == 0xC0) {
    len = 2, value = b0 & 0x1F, min_value = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, value = b0 & 0x0F, min_value = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, value = b0 & 0x07, min_value = 0x10000;
  } else {
    return false;
  }
  if (i + static_cast<size_t>(len) > text.size()) return false;
  for (int k = 1; k < len; ++k) {
    if ((byte(static_cast<size_t>(k)) & 0xC0) != 0x80) return false;
    value = (value << 6) | (byte(static_cast<size_t>(k)) & 0x3F);
  }
  if (value < min_value || value > kMaxCodepoint || (value >= kSurrogateLo && value <= kSurrogateHi))
    return false;
  *cp = value;
  *pos = i + static_cast<size_t>(len);
  return true;
}

CharSet CharSet::Between(uint32_t lo, uint32_t hi) {
  CharSet s;
  s.Add(lo, hi);
  return s;
}

void CharSet::Add(uint32_t lo, uint32_t hi) {
  if (lo > hi) return;
  ranges_.push_back({lo, std::min(hi, kMaxCodepoint)});
  Normalize();
}

void CharSet::Add(const CharSet& other) {
  ranges_.insert(ranges_.end(), other.ranges_.begin(), other.ranges_.end());
  Normalize();
}

CharSet CharSet::Complement() const {
  CharSet out;
  uint32_t next = 0;
  for (const Range& r : ranges_) {
    if (r.lo > next) out.ranges_.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodepoint) out.ranges_.push_back({next, kMaxCodepoint});
  out.Normalize();
  return out;
}

CharSet CharSet::Intersect(const CharSet& other) const {
  CharSet out;
  size_t i = 0, j = 0;
  while (i < ranges_.size() && j < other.ranges_.size()) {
    const Range& a = ranges_[i];
    const Range& b = other.ranges_[j];
    const uint32_t lo = std::max(a.lo, b.lo);
    const uint32_t hi = std::min(a.hi, b.hi);
    if (lo <= hi) out.ranges_.push_back({lo, hi});
    (a.hi < b.hi) ? ++i : ++j;
  }
  out.Normalize();
  return out;
}

void CharSet::Normalize() {
  // Cut out the surrogate block first, then sort and merge overlapping or adjacent ranges.
  std::vector<Range> cut;
  cut.reserve(ranges_.size() + 1);
  for (const Range& r : ranges_) {
    if (r.hi < kSurrogateLo || r.lo > kSurrogateHi) {
      cut.push_back(r);
      continue;
    }
    if (r.lo < kSurrogateLo) cut.push_back({r.lo, kSurrogateLo - 1});
    if (r.hi > kSurrogateHi) cut.push_back({kSurrogateHi + 1, r.hi});
  }
  std::sort(cut.begin(), cut.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  ranges_.clear();
  for (const Range& r : cut) {
    if (!ranges_.empty() && r.lo <= ranges_.back().hi + 1) {
      ranges_.back().hi = std::max(ranges_.back().hi, r.hi);
    } else {
      ranges_.push_back(r);
    }
  }
}

int Ast::Add(Node node) {
  if (nodes_.size() >= kMaxAstNodes)
    throw ConstraintError("constraint is too large: its expression tree exceeds " + std::to_string(kMaxAstNodes) +
                          " nodes");
  nodes_.push_back(std::move(node));
  return static_cast<int>(nodes_.size() - 1);
}

int Ast::Empty() { return Add(Node{Kind::kEmpty, {}, {}, {}, {}, 0, 0}); }

int Ast::Bytes(std::string bytes) {
  if (bytes.empty()) return Empty();
  return Add(Node{Kind::kBytes, std::move(bytes), {}, {}, {}, 0, 0});
}

int Ast::Chars(CharSet chars) { return Add(Node{Kind::kChars, {}, std::move(chars), {}, {}, 0, 0}); }

int Ast::Concat(std::vector<int> children) {
  if (children.empty()) return Empty();
  if (children.size() == 1) return children[0];
  return Add(Node{Kind::kConcat, {}, {}, std::move(children), {}, 0, 0});
}

int Ast::Alt(std::vector<int> children) {
  if (children.size() == 1) return children[0];
  return Add(Node{Kind::kAlt, {}, {}, std::move(children), {}, 0, 0});
}

int Ast::Repeat(int child, int min, int max) {
  if (min == 1 && max == 1) return child;
  return Add(Node{Kind::kRepeat, {}, {}, {child}, {}, min, max});
}

int Ast::List(int item, int separator, int min, int max) {
  return Add(Node{Kind::kRepeat, {}, {}, {item, separator}, {}, min, max});
}

int Ast::Subsequence(std::vector<int> members, std::vector<bool> required, int separator) {
  members.push_back(separator);
  return Add(Node{Kind::kSubsequence, {}, {}, std::move(members), std::move(required), 0, 0});
}

}  // namespace paved::constraints

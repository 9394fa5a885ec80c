#include "cc/constraints/json_value.h"

#include <cstdint>
#include <string>
#include <unordered_set>

#include "cc/constraints/regex_ast.h"

namespace paved::constraints {
namespace {

constexpr int kMaxJsonNesting = 256;

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  JsonValue ParseDocument() {
    SkipWhitespace();
    JsonValue v = ParseValue(0);
    SkipWhitespace();
    if (pos_ != s_.size()) Fail("trailing characters after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& what) const {
    throw ConstraintError("invalid JSON: " + what + " at byte " + std::to_string(pos_));
  }

  void SkipWhitespace() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  void Expect(char c) {
    if (pos_ >= s_.size() || s_[pos_] != c) Fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  void ExpectWord(const char* word) {
    for (const char* p = word; *p != '\0'; ++p) Expect(*p);
  }

  JsonValue ParseValue(int depth) {
    if (depth > kMaxJsonNesting) Fail("nesting deeper than " + std::to_string(kMaxJsonNesting));
    if (pos_ >= s_.size()) Fail("unexpected end of input");
    JsonValue v;
    switch (s_[pos_]) {
      case '{':
        v.type = JsonValue::Type::kObject;
        ParseObject(&v, depth);
        break;
      case '[':
        v.type = JsonValue::Type::kArray;
        ParseArray(&v, depth);
        break;
      case '"':
        v.type = JsonValue::Type::kString;
        v.text = ParseString();
        break;
      case 't':
        ExpectWord("true");
        v.type = JsonValue::Type::kBool;
        v.boolean = true;
        break;
      case 'f':
        ExpectWord("false");
        v.type = JsonValue::Type::kBool;
        break;
      case 'n':
        ExpectWord("null");
        break;
      default:
        v.type = JsonValue::Type::kNumber;
        v.text = ParseNumber();
    }
    return v;
  }

  void ParseObject(JsonValue* v, int depth) {
    Expect('{');
    SkipWhitespace();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return;
    }
    std::unordered_set<std::string> keys;
    while (true) {
      SkipWhitespace();
      if (pos_ >= s_.size() || s_[pos_] != '"') Fail("expected a string key");
      const size_t key_pos = pos_;
      std::string key = ParseString();
      if (!keys.insert(key).second) {
        pos_ = key_pos;
        Fail("duplicate key \"" + key + "\"");
      }
      SkipWhitespace();
      Expect(':');
      SkipWhitespace();
      v->members.emplace_back(std::move(key), ParseValue(depth + 1));
      SkipWhitespace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      Expect('}');
      return;
    }
  }

  void ParseArray(JsonValue* v, int depth) {
    Expect('[');
    SkipWhitespace();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return;
    }
    while (true) {
      SkipWhitespace();
      v->items.push_back(ParseValue(depth + 1));
      SkipWhitespace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      Expect(']');
      return;
    }
  }

  uint32_t ParseHex4() {
    if (pos_ + 4 > s_.size()) Fail("incomplete \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        Fail("bad hex digit in \\u escape");
      }
    }
    return v;
  }

  std::string ParseString() {
    Expect('"');
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) Fail("unterminated string");
      const auto c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) Fail("raw control character in string");
      if (c != '\\') {
        uint32_t cp;
        size_t next = pos_;
        if (!DecodeUtf8(s_, &next, &cp)) Fail("invalid UTF-8");
        out.append(s_, pos_, next - pos_);
        pos_ = next;
        continue;
      }
      ++pos_;
      if (pos_ >= s_.size()) Fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = ParseHex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (pos_ + 2 > s_.size() || s_[pos_] != '\\' || s_[pos_ + 1] != 'u') Fail("lone surrogate");
            pos_ += 2;
            const uint32_t low = ParseHex4();
            if (low < 0xDC00 || low > 0xDFFF) Fail("lone surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            Fail("lone surrogate");
          }
          AppendUtf8(cp, &out);
          break;
        }
        default:
          Fail("bad escape");
      }
    }
  }

  std::string ParseNumber() {
    const size_t start = pos_;
    const auto digits = [&] {
      const size_t first = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ > first;
    };
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (!digits()) {
      Fail("unexpected character");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digits()) Fail("digits expected after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digits()) Fail("digits expected in exponent");
    }
    return s_.substr(start, pos_ - start);
  }

  const std::string& s_;
  size_t pos_ = 0;
};

void Serialize(const JsonValue& v, const std::string& item_sep, const std::string& key_sep, std::string* out) {
  switch (v.type) {
    case JsonValue::Type::kNull:
      *out += "null";
      return;
    case JsonValue::Type::kBool:
      *out += v.boolean ? "true" : "false";
      return;
    case JsonValue::Type::kNumber:
      *out += v.text;
      return;
    case JsonValue::Type::kString:
      *out += EncodeJsonString(v.text);
      return;
    case JsonValue::Type::kArray:
      *out += '[';
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i > 0) *out += item_sep;
        Serialize(v.items[i], item_sep, key_sep, out);
      }
      *out += ']';
      return;
    case JsonValue::Type::kObject:
      *out += '{';
      for (size_t i = 0; i < v.members.size(); ++i) {
        if (i > 0) *out += item_sep;
        *out += EncodeJsonString(v.members[i].first);
        *out += key_sep;
        Serialize(v.members[i].second, item_sep, key_sep, out);
      }
      *out += '}';
      return;
  }
}

}  // namespace

const JsonValue* JsonValue::Find(const std::string& key) const {
  for (const auto& [k, v] : members)
    if (k == key) return &v;
  return nullptr;
}

JsonValue ParseJson(const std::string& text) { return JsonParser(text).ParseDocument(); }

std::string SerializeJson(const JsonValue& value, const std::string& item_sep, const std::string& key_sep) {
  std::string out;
  Serialize(value, item_sep, key_sep, &out);
  return out;
}

std::string EncodeJsonString(const std::string& utf8) {
  static const char kHex[] = "0123456789abcdef";
  std::string out = "\"";
  for (char ch : utf8) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

}  // namespace paved::constraints

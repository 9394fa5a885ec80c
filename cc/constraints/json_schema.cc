#include "cc/constraints/json_schema.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cc/constraints/json_value.h"
#include "cc/constraints/limits.h"
#include "cc/constraints/regex_parser.h"

namespace paved::constraints {
namespace {

using Type = JsonValue::Type;

const std::set<std::string>& Annotations() {
  static const std::set<std::string> kSet = {"title",    "description", "$schema",    "$id",
                                             "$comment", "examples",    "default",    "deprecated",
                                             "readOnly", "writeOnly",   "$defs",      "definitions"};
  return kSet;
}

const std::set<std::string>& SupportedKeywords() {
  static const std::set<std::string> kSet = {
      "type",      "enum",      "const",     "anyOf",     "allOf",     "$ref",
      "properties", "required", "additionalProperties",   "items",     "minItems",
      "maxItems",  "minLength", "maxLength", "pattern",   "format",    "minimum",
      "maximum",   "exclusiveMinimum",       "exclusiveMaximum"};
  return kSet;
}

// Regexes of the supported string formats (ASCII only, so no JSON escaping is needed).
// RFC 3339 full-date: the day must exist in its month and year (RFC 3339 section 5.7), so
// 30-day months stop at 30 and February at 28, or 29 in Gregorian leap years (divisible by 4
// and not by 100, or by 400). A day-31-everywhere pattern let the model write "2023-02-31",
// which date validators (Python's date.fromisoformat, jsonschema's format checker, pydantic)
// reject. Years are 0001-9999: RFC 3339 allows 0000, those validators do not.
#define PAVED_FULL_DATE \
  R"((([1-9]\d{3}|0[1-9]\d\d|00[1-9]\d|000[1-9])-)" \
  R"(((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))|)" \
  R"((\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29))"
#define PAVED_FULL_TIME R"(([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))"
const char* FormatPattern(const std::string& format) {
  static const char kDate[] = PAVED_FULL_DATE;
  static const char kTime[] = PAVED_FULL_TIME;
  static const char kDateTime[] = PAVED_FULL_DATE "T" PAVED_FULL_TIME;
  static const char kUuid[] = R"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})";
  static const char kEmail[] = R"([A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24})";
  static const char kIpv4[] = R"(((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))";
  if (format == "date") return kDate;
  if (format == "time") return kTime;
  if (format == "date-time") return kDateTime;
  if (format == "uuid") return kUuid;
  if (format == "email") return kEmail;
  if (format == "ipv4") return kIpv4;
  return nullptr;
}
#undef PAVED_FULL_DATE
#undef PAVED_FULL_TIME

class SchemaLowering {
 public:
  SchemaLowering(const JsonValue& root, JsonWhitespace ws, Ast* ast) : root_(root), ws_mode_(ws), ast_(ast) {
    switch (ws) {
      case JsonWhitespace::kCompact:
      case JsonWhitespace::kFree:
        item_sep_ = ",", key_sep_ = ":";
        break;
      case JsonWhitespace::kStandard:
        item_sep_ = ", ", key_sep_ = ": ";
        break;
    }
  }

  int Lower(const JsonValue& schema, const std::string& path, int depth) {
    if (depth > kMaxSchemaDepth)
      Fail("schema nesting exceeds the limit of " + std::to_string(kMaxSchemaDepth) +
               " levels (recursive $ref?)",
           path);
    if (schema.type == Type::kBool) {
      if (!schema.boolean) Fail("schema 'false' matches nothing", path);
      return AnyValue(kAnyJsonDepth);
    }
    if (schema.type != Type::kObject) Fail("a schema must be an object or a boolean", path);

    const std::vector<std::string> keywords = CheckKeywords(schema, path);
    if (const JsonValue* ref = schema.Find("$ref")) {
      RequireAlone(keywords, "$ref", path);
      return LowerRef(*ref, path, depth);
    }
    if (const JsonValue* all = schema.Find("allOf")) {
      RequireAlone(keywords, "allOf", path);
      if (all->type != Type::kArray || all->items.size() != 1)
        Fail("unsupported JSON Schema keyword 'allOf' with other than exactly one subschema", path);
      return Lower(all->items[0], path + ".allOf[0]", depth + 1);
    }
    if (const JsonValue* any = schema.Find("anyOf")) {
      RequireAlone(keywords, "anyOf", path);
      if (any->type != Type::kArray || any->items.empty()) Fail("'anyOf' must be a non-empty array", path);
      std::vector<int> branches;
      for (size_t i = 0; i < any->items.size(); ++i)
        branches.push_back(Lower(any->items[i], path + ".anyOf[" + std::to_string(i) + "]", depth + 1));
      return ast_->Alt(std::move(branches));
    }
    const JsonValue* c = schema.Find("const");
    const JsonValue* e = c == nullptr ? schema.Find("enum") : nullptr;
    if (e != nullptr && (e->type != Type::kArray || e->items.empty())) Fail("'enum' must be a non-empty array", path);
    if (c != nullptr || e != nullptr) {
      // A value must also be of the schema's `type`: {"type":"string","enum":["a",1]} allows
      // only "a" (writing 1 made the output invalid for the schema).
      const std::vector<std::string> types =
          schema.Find("type") != nullptr ? Types(schema, path) : std::vector<std::string>{};
      std::vector<int> values;
      const auto add = [&](const JsonValue& v) {
        if (types.empty() || HasAnyType(v, types, path)) values.push_back(Literal(v));
      };
      if (c != nullptr) {
        add(*c);
      } else {
        for (const JsonValue& v : e->items) add(v);
      }
      if (values.empty())
        Fail(std::string("no value of '") + (c != nullptr ? "const" : "enum") + "' is of the schema's 'type'", path);
      return ast_->Alt(std::move(values));
    }
    const std::vector<std::string> types = Types(schema, path);
    if (types.empty()) return AnyValue(kAnyJsonDepth);
    std::vector<int> alternatives;
    for (const std::string& type : types) alternatives.push_back(LowerType(schema, type, path, depth));
    return ast_->Alt(std::move(alternatives));
  }

 private:
  [[noreturn]] static void Fail(const std::string& what, const std::string& path) {
    throw ConstraintError(what + " at " + path);
  }

  // The non-annotation keywords of `schema`; an error for any unsupported one.
  static std::vector<std::string> CheckKeywords(const JsonValue& schema, const std::string& path) {
    std::vector<std::string> keywords;
    for (const auto& member : schema.members) {
      const std::string& key = member.first;
      if (Annotations().count(key)) continue;
      if (!SupportedKeywords().count(key)) Fail("unsupported JSON Schema keyword '" + key + "'", path);
      keywords.push_back(key);
    }
    return keywords;
  }

  // The instance types: "type" (a name or a list), else inferred from the keywords present;
  // empty for a schema that accepts any value.
  static std::vector<std::string> Types(const JsonValue& schema, const std::string& path) {
    const auto has = [&](const char* k) { return schema.Find(k) != nullptr; };
    const JsonValue* t = schema.Find("type");
    if (t == nullptr) {
      if (has("properties") || has("required") || has("additionalProperties")) return {"object"};
      if (has("items") || has("minItems") || has("maxItems")) return {"array"};
      if (has("minLength") || has("maxLength") || has("pattern") || has("format")) return {"string"};
      if (has("minimum") || has("maximum") || has("exclusiveMinimum") || has("exclusiveMaximum")) return {"number"};
      return {};
    }
    if (t->type == Type::kString) return {t->text};
    if (t->type != Type::kArray || t->items.empty())
      Fail("'type' must be a string or a non-empty list of strings", path);
    std::vector<std::string> types;
    for (const JsonValue& name : t->items) {
      if (name.type != Type::kString) Fail("'type' must be a string or a non-empty list of strings", path);
      types.push_back(name.text);
    }
    return types;
  }

  // Whether `v` is an instance of one of JSON Schema `types` ("integer": a number without a
  // fractional part, so 1.0 and 1e2 are integers).
  static bool HasAnyType(const JsonValue& v, const std::vector<std::string>& types, const std::string& path) {
    for (const std::string& type : types) {
      if (type == "integer" ? v.type == Type::kNumber && IsIntegral(v.text)
          : type == "number"  ? v.type == Type::kNumber
          : type == "string"  ? v.type == Type::kString
          : type == "boolean" ? v.type == Type::kBool
          : type == "null"    ? v.type == Type::kNull
          : type == "object"  ? v.type == Type::kObject
          : type == "array"   ? v.type == Type::kArray
                              : (Fail("unknown type '" + type + "'", path), false))
        return true;
    }
    return false;
  }

  // Whether a JSON number's text (RFC 8259 syntax) denotes an integer value.
  static bool IsIntegral(const std::string& text) {
    size_t i = text.size() > 0 && text[0] == '-' ? 1 : 0;
    std::string digits;
    int64_t fraction = 0;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) digits += text[i];
    if (i < text.size() && text[i] == '.')
      for (++i; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++fraction) digits += text[i];
    int64_t exponent = 0;
    if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
      ++i;
      const bool negative = i < text.size() && text[i] == '-';
      if (i < text.size() && (text[i] == '-' || text[i] == '+')) ++i;
      // Saturated: past 10^9 the exponent shifts every digit anyway (1 MiB documents).
      for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i)
        exponent = std::min<int64_t>(exponent * 10 + (text[i] - '0'), 1'000'000'000);
      if (negative) exponent = -exponent;
    }
    // The value is digits * 10^(exponent - fraction): integral iff the last
    // (fraction - exponent) digits are zeros.
    const int64_t dropped = fraction - exponent;
    for (int64_t k = std::max<int64_t>(0, static_cast<int64_t>(digits.size()) - std::max<int64_t>(dropped, 0));
         k < static_cast<int64_t>(digits.size()); ++k)
      if (digits[static_cast<size_t>(k)] != '0') return false;
    return true;
  }

  static void RequireAlone(const std::vector<std::string>& keywords, const char* keyword,
                           const std::string& path) {
    for (const std::string& k : keywords)
      if (k != keyword)
        Fail("unsupported JSON Schema keyword '" + k + "' alongside '" + keyword + "'", path);
  }

  int LowerType(const JsonValue& schema, const std::string& type, const std::string& path, int depth) {
    if (type == "object") return Object(schema, path, depth);
    if (type == "array") return Array(schema, path, depth);
    if (type == "string") return String(schema, path);
    if (type == "integer") return Integer(schema, path);
    if (type == "number") {
      for (const char* k : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
        if (schema.Find(k)) Fail(std::string("unsupported JSON Schema keyword '") + k + "' for type number", path);
      return Number();
    }
    if (type == "boolean") return ast_->Alt({ast_->Bytes("true"), ast_->Bytes("false")});
    if (type == "null") return ast_->Bytes("null");
    Fail("unknown type '" + type + "'", path);
  }

  int LowerRef(const JsonValue& ref, const std::string& path, int depth) {
    if (ref.type != Type::kString || ref.text.empty() || ref.text[0] != '#')
      Fail("unsupported $ref (only local '#/...' references)", path);
    // JSON Pointer (RFC 6901) into the root document.
    const JsonValue* target = &root_;
    std::string target_path = "$";
    const std::string& pointer = ref.text;
    size_t i = 1;
    if (i < pointer.size() && pointer[i] != '/') Fail("unsupported $ref '" + pointer + "'", path);
    while (i < pointer.size()) {
      const size_t next = pointer.find('/', i + 1);
      std::string token = pointer.substr(i + 1, next == std::string::npos ? std::string::npos : next - i - 1);
      std::string decoded;
      for (size_t k = 0; k < token.size(); ++k) {
        if (token[k] == '~' && k + 1 < token.size() && (token[k + 1] == '0' || token[k + 1] == '1')) {
          decoded += token[k + 1] == '0' ? '~' : '/';
          ++k;
        } else {
          decoded += token[k];
        }
      }
      if (target->type == Type::kObject) {
        target = target->Find(decoded);
      } else if (target->type == Type::kArray && !decoded.empty() &&
                 decoded.find_first_not_of("0123456789") == std::string::npos && decoded.size() < 10 &&
                 std::stoul(decoded) < target->items.size()) {
        target = &target->items[std::stoul(decoded)];
      } else {
        target = nullptr;
      }
      if (target == nullptr) Fail("$ref '" + pointer + "' does not resolve", path);
      target_path += "." + decoded;
      i = next == std::string::npos ? pointer.size() : next;
    }
    // Every use of a target at one depth shares one subtree: lowering it again per use made
    // fan-out through $ref chains exponential (4 levels of 30-way anyOf of $refs, 2.6 KB, took
    // 90 s and 1.7 GB before any limit was checked). Lowering is a function of (schema, depth)
    // (the path only names errors, and an error ends the lowering), so sharing is exact; the
    // compiler instantiates a shared node per use and its NFA limit bounds that work.
    const auto key = std::make_pair(target, depth + 1);
    if (const auto it = lowered_refs_.find(key); it != lowered_refs_.end()) return it->second;
    const int node = Lower(*target, target_path, depth + 1);
    lowered_refs_.emplace(key, node);
    return node;
  }

  // --- whitespace and punctuation -------------------------------------------------------

  int Ws() {
    if (ws_mode_ != JsonWhitespace::kFree) return ast_->Empty();
    CharSet ws = CharSet::Single(' ');
    ws.Add('\t', '\t');
    ws.Add('\n', '\n');
    ws.Add('\r', '\r');
    return ast_->Repeat(ast_->Chars(ws), 0, kFreeWhitespaceMax);
  }
  // Separator between members / items, and between a key and its value.
  int ItemSep() { return ast_->Concat({Ws(), ast_->Bytes(item_sep_), Ws()}); }
  int KeySep() { return ast_->Concat({Ws(), ast_->Bytes(key_sep_), Ws()}); }
  // open ws body ws close
  int Bracketed(char open, int body, char close) {
    return ast_->Concat({ast_->Bytes(std::string(1, open)), Ws(), body, Ws(), ast_->Bytes(std::string(1, close))});
  }
  // item (sep item)..., [min, max] items; max < 0 is unbounded.
  int List(int item, int min, int max) {
    return ast_->List(item, ItemSep(), min, max < 0 ? Ast::kUnbounded : max);
  }

  // --- values ---------------------------------------------------------------------------

  int Literal(const JsonValue& v) { return ast_->Bytes(SerializeJson(v, item_sep_, key_sep_)); }

  int Number() {
    CharSet digit = CharSet::Between('0', '9');
    const int digits = ast_->Repeat(ast_->Chars(digit), 1, Ast::kUnbounded);
    const int integer = IntegerSyntax();
    const int fraction = ast_->Optional(ast_->Concat({ast_->Bytes("."), digits}));
    CharSet e = CharSet::Single('e');
    e.Add('E', 'E');
    CharSet sign = CharSet::Single('+');
    sign.Add('-', '-');
    const int exponent =
        ast_->Optional(ast_->Concat({ast_->Chars(e), ast_->Optional(ast_->Chars(sign)), digits}));
    return ast_->Concat({integer, fraction, exponent});
  }

  int IntegerSyntax() {
    const int natural = ast_->Alt(
        {ast_->Bytes("0"), ast_->Concat({ast_->Chars(CharSet::Between('1', '9')),
                                         ast_->Repeat(ast_->Chars(CharSet::Between('0', '9')), 0, Ast::kUnbounded)})});
    return ast_->Concat({ast_->Optional(ast_->Bytes("-")), natural});
  }

  // One character of a JSON string: any scalar value but '"', '\' and controls, or an escape.
  int StringChar() {
    CharSet raw = CharSet::Any();
    raw = raw.Minus(CharSet::Between(0, 0x1F));
    raw = raw.Minus(CharSet::Single('"'));
    raw = raw.Minus(CharSet::Single('\\'));
    CharSet simple;
    for (char c : std::string("\"\\/bfnrt")) simple.Add(static_cast<uint8_t>(c), static_cast<uint8_t>(c));
    CharSet hex = CharSet::Between('0', '9');
    hex.Add('a', 'f');
    hex.Add('A', 'F');
    // Four hex digits that are not a surrogate (D800-DFFF).
    CharSet first_not_d = hex.Minus(CharSet::Single('d')).Minus(CharSet::Single('D'));
    CharSet d = CharSet::Single('d');
    d.Add('D', 'D');
    const int hex_digit = ast_->Chars(hex);
    const int code = ast_->Alt({ast_->Concat({ast_->Chars(first_not_d), ast_->Repeat(hex_digit, 3, 3)}),
                                ast_->Concat({ast_->Chars(d), ast_->Chars(CharSet::Between('0', '7')),
                                              ast_->Repeat(hex_digit, 2, 2)})});
    const int escape =
        ast_->Concat({ast_->Bytes("\\"), ast_->Alt({ast_->Chars(simple), ast_->Concat({ast_->Bytes("u"), code})})});
    return ast_->Alt({ast_->Chars(raw), escape});
  }

  int String(const JsonValue& schema, const std::string& path) {
    const JsonValue* pattern = schema.Find("pattern");
    const JsonValue* format = schema.Find("format");
    const bool has_length = schema.Find("minLength") || schema.Find("maxLength");
    if ((pattern || format) && has_length)
      Fail("unsupported JSON Schema keyword combination: pattern/format with minLength/maxLength", path);
    if (pattern && format) Fail("unsupported JSON Schema keyword combination: pattern with format", path);
    const int quote = ast_->Bytes("\"");
    if (pattern || format) {
      const JsonValue& spec = pattern ? *pattern : *format;
      if (spec.type != Type::kString) Fail(std::string("'") + (pattern ? "pattern" : "format") + "' must be a string", path);
      std::string regex = spec.text;
      if (format) {
        const char* p = FormatPattern(spec.text);
        if (p == nullptr) Fail("unsupported format '" + spec.text + "'", path);
        regex = p;
      }
      int body;
      try {
        body = ParseRegex(regex, ast_);
      } catch (const ConstraintError& e) {
        Fail(std::string(e.what()) + " in 'pattern'", path);
      }
      return ast_->Concat({quote, JsonEscaped(body), quote});
    }
    const int min = Count(schema, "minLength", 0, path);
    const int max = Count(schema, "maxLength", -1, path);
    if (max >= 0 && min > max) Fail("minLength is greater than maxLength", path);
    return ast_->Concat({quote, ast_->Repeat(StringChar(), min, max), quote});
  }

  // Rewrites a regex over string contents into one over their JSON encoding: characters that
  // JSON must escape are replaced by their canonical escape sequence.
  int JsonEscaped(int node) {
    const Ast::Node n = ast_->node(node);  // copy: the arena grows below
    switch (n.kind) {
      case Ast::Kind::kEmpty:
        return node;
      case Ast::Kind::kBytes: {
        std::vector<int> parts;
        for (char c : n.bytes) parts.push_back(JsonEscaped(ast_->Chars(CharSet::Single(static_cast<uint8_t>(c)))));
        return ast_->Concat(std::move(parts));
      }
      case Ast::Kind::kChars: {
        CharSet special = CharSet::Between(0, 0x1F);
        special.Add('"', '"');
        special.Add('\\', '\\');
        std::vector<int> options{ast_->Chars(n.chars.Minus(special))};
        const CharSet escaped = n.chars.Intersect(special);
        for (const CharSet::Range& r : escaped.ranges()) {
          for (uint32_t cp = r.lo; cp <= r.hi; ++cp) {
            const std::string encoded = EncodeJsonString(std::string(1, static_cast<char>(cp)));
            options.push_back(ast_->Bytes(encoded.substr(1, encoded.size() - 2)));
          }
        }
        return ast_->Alt(std::move(options));
      }
      case Ast::Kind::kConcat:
      case Ast::Kind::kAlt: {
        std::vector<int> children;
        for (int child : n.children) children.push_back(JsonEscaped(child));
        return n.kind == Ast::Kind::kConcat ? ast_->Concat(std::move(children)) : ast_->Alt(std::move(children));
      }
      case Ast::Kind::kRepeat:
        return ast_->Repeat(JsonEscaped(n.children[0]), n.min, n.max);
      case Ast::Kind::kSubsequence:  // never produced by the regex parser
        break;
    }
    return node;
  }

  int Integer(const JsonValue& schema, const std::string& path) {
    std::optional<int64_t> lo, hi;
    const auto bound = [&](const char* key, bool is_min, bool exclusive) {
      const JsonValue* v = schema.Find(key);
      if (v == nullptr) return;
      if (v->type != Type::kNumber) Fail(std::string("'") + key + "' must be a number", path);
      const long double x = std::strtold(v->text.c_str(), nullptr);
      if (!(std::fabs(x) <= 1e18L)) Fail(std::string("'") + key + "' is outside [-1e18, 1e18]", path);
      int64_t b;
      if (is_min) {
        b = exclusive ? static_cast<int64_t>(std::floor(x)) + 1 : static_cast<int64_t>(std::ceil(x));
        lo = lo ? std::max(*lo, b) : b;
      } else {
        b = exclusive ? static_cast<int64_t>(std::ceil(x)) - 1 : static_cast<int64_t>(std::floor(x));
        hi = hi ? std::min(*hi, b) : b;
      }
    };
    bound("minimum", true, false);
    bound("exclusiveMinimum", true, true);
    bound("maximum", false, false);
    bound("exclusiveMaximum", false, true);
    if (!lo && !hi) return IntegerSyntax();
    if (lo && hi && *lo > *hi) Fail("the integer range is empty", path);
    std::vector<int> parts;
    // Negative part: "-" followed by the magnitudes in [max(1, -hi), -lo].
    if (!lo || *lo < 0) {
      const uint64_t mag_lo = hi && *hi < 0 ? static_cast<uint64_t>(-*hi) : 1;
      const std::optional<uint64_t> mag_hi = lo ? std::optional<uint64_t>(static_cast<uint64_t>(-*lo)) : std::nullopt;
      parts.push_back(ast_->Concat({ast_->Bytes("-"), Naturals(mag_lo, mag_hi)}));
    }
    if (!hi || *hi >= 0) {
      const uint64_t from = lo && *lo > 0 ? static_cast<uint64_t>(*lo) : 0;
      const std::optional<uint64_t> to = hi ? std::optional<uint64_t>(static_cast<uint64_t>(*hi)) : std::nullopt;
      parts.push_back(Naturals(from, to));
    }
    return ast_->Alt(std::move(parts));
  }

  // Decimal numerals (no leading zeros) of [lo, hi]; no upper bound when hi is empty.
  int Naturals(uint64_t lo, std::optional<uint64_t> hi) {
    const std::string lo_text = std::to_string(lo);
    const size_t max_len = hi ? std::to_string(*hi).size() : lo_text.size();
    std::vector<int> parts;
    for (size_t len = lo_text.size(); len <= max_len; ++len) {
      const uint64_t smallest = len == 1 ? 0 : Pow10(len - 1);
      const uint64_t largest = Pow10(len) - 1;
      const uint64_t a = std::max(lo, smallest);
      const uint64_t b = hi ? std::min(*hi, largest) : largest;
      if (a <= b) parts.push_back(SameLength(std::to_string(a), std::to_string(b)));
    }
    if (!hi) {  // every longer numeral
      parts.push_back(ast_->Concat({ast_->Chars(CharSet::Between('1', '9')),
                                    ast_->Repeat(ast_->Chars(CharSet::Between('0', '9')),
                                                 static_cast<int>(lo_text.size()), Ast::kUnbounded)}));
    }
    return ast_->Alt(std::move(parts));
  }

  static uint64_t Pow10(size_t n) {
    uint64_t p = 1;
    for (size_t i = 0; i < n && p <= UINT64_MAX / 10; ++i) p *= 10;
    return p;
  }

  // Numerals between equal-length numerals x <= y, digit by digit.
  int SameLength(const std::string& x, const std::string& y) {
    const auto digit_range = [&](char a, char b) {
      return ast_->Chars(CharSet::Between(static_cast<uint8_t>(a), static_cast<uint8_t>(b)));
    };
    const size_t n = x.size();
    if (n == 1) return digit_range(x[0], y[0]);
    const std::string x_rest = x.substr(1), y_rest = y.substr(1);
    const int any_rest = ast_->Repeat(digit_range('0', '9'), static_cast<int>(n - 1), static_cast<int>(n - 1));
    if (x[0] == y[0]) return ast_->Concat({ast_->Bytes(std::string(1, x[0])), SameLength(x_rest, y_rest)});
    if (x_rest == std::string(n - 1, '0') && y_rest == std::string(n - 1, '9'))
      return ast_->Concat({digit_range(x[0], y[0]), any_rest});
    std::vector<int> parts{
        ast_->Concat({ast_->Bytes(std::string(1, x[0])), SameLength(x_rest, std::string(n - 1, '9'))})};
    if (y[0] - x[0] >= 2)
      parts.push_back(ast_->Concat({digit_range(static_cast<char>(x[0] + 1), static_cast<char>(y[0] - 1)), any_rest}));
    parts.push_back(ast_->Concat({ast_->Bytes(std::string(1, y[0])), SameLength(std::string(n - 1, '0'), y_rest)}));
    return ast_->Alt(std::move(parts));
  }

  int Object(const JsonValue& schema, const std::string& path, int depth) {
    if (const JsonValue* extra = schema.Find("additionalProperties")) {
      if (extra->type != Type::kBool || extra->boolean)
        Fail("unsupported JSON Schema keyword 'additionalProperties' (only false or absent)", path);
    }
    const JsonValue* props = schema.Find("properties");
    if (props && props->type != Type::kObject) Fail("'properties' must be an object", path);
    std::set<std::string> required;
    if (const JsonValue* req = schema.Find("required")) {
      if (req->type != Type::kArray) Fail("'required' must be an array of strings", path);
      for (const JsonValue& name : req->items) {
        if (name.type != Type::kString) Fail("'required' must be an array of strings", path);
        if (!props || !props->Find(name.text))
          Fail("required property '" + name.text + "' is not in 'properties'", path);
        required.insert(name.text);
      }
    }
    std::vector<int> members;  // "key": value, in document order
    std::vector<bool> is_required;
    if (props) {
      for (const auto& [key, sub] : props->members) {
        const int value = Lower(sub, path + ".properties." + key, depth + 1);
        members.push_back(ast_->Concat({ast_->Bytes(EncodeJsonString(key)), KeySep(), value}));
        is_required.push_back(required.count(key) > 0);
      }
    }
    return Bracketed('{', ast_->Subsequence(std::move(members), std::move(is_required), ItemSep()), '}');
  }

  int Array(const JsonValue& schema, const std::string& path, int depth) {
    int item;
    if (const JsonValue* items = schema.Find("items")) {
      if (items->type == Type::kArray)
        Fail("unsupported JSON Schema keyword 'items' with an array (tuple) value", path);
      item = Lower(*items, path + ".items", depth + 1);
    } else {
      item = AnyValue(kAnyJsonDepth);
    }
    const int min = Count(schema, "minItems", 0, path);
    const int max = Count(schema, "maxItems", -1, path);
    if (max >= 0 && min > max) Fail("minItems is greater than maxItems", path);
    return Bracketed('[', List(item, min, max), ']');
  }

  // Any JSON value with arrays/objects nested at most `depth` levels; one shared subtree per
  // depth (a fresh one per `{}` made the tree hundreds of nodes per 2 bytes of schema).
  int AnyValue(int depth) {
    int& memo = any_value_[static_cast<size_t>(depth)];
    if (memo < 0) memo = BuildAnyValue(depth);
    return memo;
  }

  int BuildAnyValue(int depth) {
    std::vector<int> options{StringValue(), Number(), ast_->Bytes("true"), ast_->Bytes("false"), ast_->Bytes("null")};
    if (depth > 0) {
      const int inner = AnyValue(depth - 1);
      options.push_back(Bracketed('[', List(inner, 0, -1), ']'));
      const int member = ast_->Concat({StringValue(), KeySep(), inner});
      options.push_back(Bracketed('{', List(member, 0, -1), '}'));
    }
    return ast_->Alt(std::move(options));
  }

  int StringValue() {
    const int quote = ast_->Bytes("\"");
    return ast_->Concat({quote, ast_->Repeat(StringChar(), 0, Ast::kUnbounded), quote});
  }

  // A non-negative integer keyword such as maxLength; `fallback` when absent.
  static int Count(const JsonValue& schema, const char* key, int fallback, const std::string& path) {
    const JsonValue* v = schema.Find(key);
    if (v == nullptr) return fallback;
    if (v->type != Type::kNumber) Fail(std::string("'") + key + "' must be a non-negative integer", path);
    const double x = std::strtod(v->text.c_str(), nullptr);
    if (!(x >= 0) || x != std::floor(x)) Fail(std::string("'") + key + "' must be a non-negative integer", path);
    if (x > kMaxRepeat)
      Fail(std::string("'") + key + "' exceeds the limit of " + std::to_string(kMaxRepeat), path);
    return static_cast<int>(x);
  }

  const JsonValue& root_;
  JsonWhitespace ws_mode_;
  Ast* ast_;
  std::map<std::pair<const JsonValue*, int>, int> lowered_refs_;
  std::vector<int> any_value_ = std::vector<int>(kAnyJsonDepth + 1, -1);  // by depth; -1: not built
  std::string item_sep_;
  std::string key_sep_;
};

}  // namespace

JsonWhitespace ParseJsonWhitespace(const std::string& name) {
  if (name == "compact") return JsonWhitespace::kCompact;
  if (name == "standard") return JsonWhitespace::kStandard;
  if (name == "free") return JsonWhitespace::kFree;
  throw ConstraintError("whitespace must be 'compact', 'standard' or 'free', got '" + name + "'");
}

int LowerJsonSchema(const std::string& schema_json, JsonWhitespace whitespace, Ast* ast) {
  if (schema_json.size() > kMaxSpecBytes)
    throw ConstraintError("JSON Schema is " + std::to_string(schema_json.size()) + " bytes, over the limit of " +
                          std::to_string(kMaxSpecBytes));
  JsonValue root;
  try {
    root = ParseJson(schema_json);
  } catch (const ConstraintError& e) {
    throw ConstraintError(std::string("JSON Schema is not valid JSON: ") + e.what());
  }
  return SchemaLowering(root, whitespace, ast).Lower(root, "$", 0);
}

}  // namespace paved::constraints

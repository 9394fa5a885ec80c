#include "cc/constraints/json_schema.h"

#include <cstdio>
#include <string>
#include <vector>

#include "cc/constraints/compile.h"
#include "cc/constraints/dfa.h"
#include "cc/constraints/limits.h"
#include "cc/constraints/test_util.h"
#include "gtest/gtest.h"

namespace paved::constraints {
namespace {

Dfa Compile(const std::string& schema, JsonWhitespace ws = JsonWhitespace::kCompact) {
  Ast ast;
  const int root = LowerJsonSchema(schema, ws, &ast);
  return CompileDfa(ast, root);
}

std::string ErrorOf(const std::string& schema) {
  try {
    CheckJsonSchema(schema);
  } catch (const ConstraintError& e) {
    return e.what();
  }
  return "";
}

void ExpectLanguage(const std::string& schema, const std::vector<std::string>& yes, const std::vector<std::string>& no,
                    JsonWhitespace ws = JsonWhitespace::kCompact) {
  const Dfa dfa = Compile(schema, ws);
  for (const std::string& s : yes) EXPECT_TRUE(dfa.Matches(s)) << schema << " should accept " << s;
  for (const std::string& s : no) EXPECT_FALSE(dfa.Matches(s)) << schema << " should reject " << s;
}

TEST(JsonSchema, ObjectPropertiesInOrderOptionalOmittable) {
  ExpectLanguage(
      R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"boolean"},"c":{"type":"null"}},"required":["b"]})",
      {R"({"b":true})", R"({"a":-3,"b":false})", R"({"b":true,"c":null})", R"({"a":0,"b":true,"c":null})"},
      {R"({})", R"({"a":1})", R"({"b":true,"a":1})", R"({"a":1,,"b":true})", R"({"b":true,})", R"({"b":true,"d":1})",
       R"({"a":01,"b":true})", R"({ "b":true})"});
  ExpectLanguage(R"({"type":"object","properties":{"x":{"type":"string"}}})", {"{}", R"({"x":""})"}, {R"({,"x":""})"});
  ExpectLanguage(R"({"type":"object"})", {"{}"}, {R"({"a":1})"});  // additionalProperties absent = false
}

TEST(JsonSchema, StringsAreStrictJson) {
  const std::string schema = R"({"type":"string"})";
  ExpectLanguage(schema,
                 {R"("")", R"("plain")", R"("q\"b\\s\/\b\f\n\r\t")", R"("\u00e9\uFFFF\u0000")", "\"caf\xc3\xa9 \xf0\x9f\x98\x80\"",
                  "\"\x7f\""},
                 {"\"a\nb\"", std::string("\"a\0b\"", 5), "\"tab\there\"", "\"\x1f\"", R"("\x41")", R"("\u12")",
                  R"("\ud800")", R"("\uDFFF")", R"("a"b")", R"("\")", "\"\xc3\"", "\"\xff\"", R"(plain)"});
}

TEST(JsonSchema, StringLengthCountsCharactersAndEscapes) {
  ExpectLanguage(R"({"type":"string","minLength":2,"maxLength":3})",
                 {R"("ab")", R"("abc")", "\"\xc3\xa9\xc3\xa9\"", R"("\n\u0041x")"},
                 {R"("a")", R"("abcd")", "\"\xc3\xa9\"", R"("\n\n\n\n")"});
}

TEST(JsonSchema, PatternIsFullMatchOverDecodedString) {
  ExpectLanguage(R"({"type":"string","pattern":"^[a-z]+\"?\\n$"})", {R"("ab\n")", R"("ab\"\n")"},
                 {"\"ab\n\"", R"("ab")", R"("AB\n")"});
  ExpectLanguage(R"({"type":"string","format":"date"})", {R"("2024-02-29")"}, {R"("2024-13-01")", R"("24-01-01")"});
  ExpectLanguage(R"({"type":"string","format":"date-time"})", {R"("2024-02-29T23:59:59Z")"},
                 {R"("2023-02-29T00:00:00Z")", R"("2024-04-31T00:00:00Z")"});
  ExpectLanguage(R"({"type":"string","format":"uuid"})", {R"("123e4567-e89b-12d3-a456-426614174000")"}, {R"("x")"});
}

// RFC 3339 dates name days that exist: every day of a few centuries, checked against the
// Gregorian calendar (days 1-31 in every month were accepted before: "2023-02-31",
// "2023-06-31"). Year 0000 is left out, as Python's date (and so pydantic) refuses it.
TEST(JsonSchema, DateFormatAcceptsExactlyTheDaysOfTheCalendar) {
  const Dfa dfa = Compile(R"({"type":"string","format":"date"})");
  const auto leap = [](int y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; };
  for (const int century : {0, 15, 16, 17, 18, 19, 20, 21, 99}) {
    for (int y = century * 100; y < century * 100 + 100; ++y) {
      for (int m = 0; m <= 13; ++m) {
        const bool short_month = m == 4 || m == 6 || m == 9 || m == 11;
        const int days = m < 1 || m > 12 ? 0 : m == 2 ? (leap(y) ? 29 : 28) : short_month ? 30 : 31;
        for (int d = 0; d <= 32; ++d) {
          char text[24];
          std::snprintf(text, sizeof(text), "\"%04d-%02d-%02d\"", y, m, d);
          ASSERT_EQ(dfa.Matches(text), y > 0 && d >= 1 && d <= days) << text;
        }
      }
    }
  }
}

// `enum` / `const` values that are not of the schema's `type` are not outputs: writing one made
// the output invalid for the schema ({"type":"string","const":1} wrote 1).
TEST(JsonSchema, EnumAndConstValuesMustBeOfTheSchemasType) {
  ExpectLanguage(R"({"type":"string","enum":["a",1,null]})", {R"("a")"}, {"1", "null"});
  ExpectLanguage(R"({"type":["integer","null"],"enum":[1,1.0,1.5,-2e1,25e-1,100E-2,0.0,"1",null,true]})",
                 {"1", "1.0", "-2e1", "100E-2", "0.0", "null"}, {"1.5", "25e-1", R"("1")", "true"});
  ExpectLanguage(R"({"type":"number","enum":[1.5,[1],{"a":1}]})", {"1.5"}, {"[1]", R"({"a":1})"});
  ExpectLanguage(R"({"type":"object","properties":{"k":{"type":"boolean","enum":[true,"true"]}},"required":["k"]})",
                 {R"({"k":true})"}, {R"({"k":"true"})"});
  ExpectLanguage(R"({"enum":[1,"a"]})", {"1", R"("a")"}, {});  // no type: every value
  EXPECT_NE(ErrorOf(R"({"type":"string","const":1})").find("no value of 'const' is of the schema's 'type' at $"),
            std::string::npos);
  EXPECT_NE(ErrorOf(R"({"properties":{"a":{"type":"null","enum":[0,false]}}})").find("'enum'"), std::string::npos);
  EXPECT_NE(ErrorOf(R"({"type":"text","enum":["a"]})").find("unknown type 'text'"), std::string::npos);
}

TEST(JsonSchema, IntegerRangesMatchExactly) {
  struct Range {
    std::string bounds;
    long lo, hi;
  };
  const std::vector<Range> ranges = {
      {R"("minimum":-37,"maximum":1234)", -37, 1234},
      {R"("minimum":0,"maximum":9)", 0, 9},
      {R"("exclusiveMinimum":-5,"exclusiveMaximum":100)", -4, 99},
      {R"("minimum":1.5,"maximum":20.5)", 2, 20},
      {R"("minimum":-1000,"maximum":-10)", -1000, -10},
      {R"("minimum":17)", 17, 100000},
      {R"("maximum":-3)", -100000, -3},
      {R"("minimum":100,"maximum":100)", 100, 100},
  };
  for (const Range& r : ranges) {
    const Dfa dfa = Compile(R"({"type":"integer",)" + r.bounds + "}");
    for (long v = -2000; v <= 2000; ++v)
      EXPECT_EQ(dfa.Matches(std::to_string(v)), v >= r.lo && v <= r.hi) << r.bounds << " value " << v;
    EXPECT_EQ(dfa.Matches("99999999999"), r.hi == 100000) << r.bounds;
    EXPECT_EQ(dfa.Matches("-99999999999"), r.lo == -100000) << r.bounds;
    EXPECT_FALSE(dfa.Matches("007")) << r.bounds;
    EXPECT_FALSE(dfa.Matches("-0")) << r.bounds;
  }
  ExpectLanguage(R"({"type":"integer"})", {"0", "-0", "12", "-7"}, {"01", "1.0", "+1", "", "-"});
}

TEST(JsonSchema, NumbersBooleansNullEnumConst) {
  ExpectLanguage(R"({"type":"number"})", {"0", "-0.5", "1e10", "2.5E-3", "10"}, {".5", "1.", "1e", "01", "NaN", "Infinity"});
  ExpectLanguage(R"({"type":["boolean","null"]})", {"true", "false", "null"}, {"True", "0"});
  ExpectLanguage(R"({"enum":["a\"b",1.50,null,{"k":[1,2]}]})", {R"("a\"b")", "1.50", "null", R"({"k":[1,2]})"},
                 {"1.5", R"({"k":[1, 2]})"});
  ExpectLanguage(R"({"enum":[{"k":[1,2]}]})", {R"({"k": [1, 2]})"}, {R"({"k":[1,2]})"}, JsonWhitespace::kStandard);
  ExpectLanguage(R"({"const":"caf\u00e9"})", {"\"caf\xc3\xa9\""}, {R"("caf\u00e9")"});
}

TEST(JsonSchema, ArraysAnyOfRefs) {
  ExpectLanguage(R"({"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3})", {"[1]", "[1,2,3]"},
                 {"[]", "[1,2,3,4]", "[1,]", "[,1]"});
  ExpectLanguage(R"({"type":"array","items":{"type":"integer"}})", {"[]", "[1,2,3,4,5,6]"}, {"[1 ,2]"});
  ExpectLanguage(R"({"anyOf":[{"type":"integer"},{"type":"string","maxLength":1}]})", {"5", R"("x")"}, {R"("xy")"});
  ExpectLanguage(
      R"({"$defs":{"P":{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}},
          "type":"array","items":{"$ref":"#/$defs/P"}})",
      {R"([{"n":1},{"n":2}])"}, {R"([{}])"});
  ExpectLanguage(R"({"type":"array","items":{}})", {R"([1,"a",[{"b":null}],{}])"}, {"[1"});
  ExpectLanguage(R"({"allOf":[{"type":"null"}],"title":"x"})", {"null"}, {"1"});
}

TEST(JsonSchema, WhitespaceModes) {
  const std::string schema = R"({"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"}}}})";
  ExpectLanguage(schema, {R"({"a":[1,2]})"}, {R"({"a": [1, 2]})"}, JsonWhitespace::kCompact);
  ExpectLanguage(schema, {R"({"a": [1, 2]})", "{}"}, {R"({"a":[1,2]})", R"({"a":  [1, 2]})"}, JsonWhitespace::kStandard);
  ExpectLanguage(schema, {R"({"a":[1,2]})", "{\n  \"a\" : [ 1,\n\t2 ]\r\n}", "{ }"},
                 {" {}", "{} ", "{" + std::string(kFreeWhitespaceMax * 2 + 1, ' ') + "}"}, JsonWhitespace::kFree);
  EXPECT_THROW(ParseJsonWhitespace("pretty"), ConstraintError);
}

TEST(JsonSchema, UnsupportedKeywordsNameKeywordAndPath) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"type":"object","properties":{"a":{"type":"object","patternProperties":{}}}})",
       "unsupported JSON Schema keyword 'patternProperties' at $.properties.a"},
      {R"({"type":"array","items":{"oneOf":[{"type":"null"}]}})", "unsupported JSON Schema keyword 'oneOf' at $.items"},
      {R"({"type":"object","additionalProperties":true})", "'additionalProperties' (only false or absent) at $"},
      {R"({"anyOf":[{"type":"null"},{"not":{}}]})", "keyword 'not' at $.anyOf[1]"},
      {R"({"type":"number","minimum":0})", "'minimum' for type number at $"},
      {R"({"type":"string","format":"hostname"})", "unsupported format 'hostname' at $"},
      {R"js({"type":"string","pattern":"(?=a)"})js", "lookahead at position 0 in 'pattern' at $"},
      {R"({"$ref":"http://example.com/s.json"})", "only local"},
      {R"({"$ref":"#/$defs/missing"})", "does not resolve"},
      {R"({"$defs":{"n":{"type":"array","items":{"$ref":"#/$defs/n"}}},"$ref":"#/$defs/n"})", "nesting exceeds"},
      {R"({"type":"object","properties":{"a":{}},"required":["b"]})", "required property 'b' is not in 'properties'"},
      {R"({"type":"widget"})", "unknown type 'widget'"},
      {R"({"type":"string","maxLength":1000000})", "exceeds the limit"},
      {R"({"type":"string","minLength":3,"maxLength":2})", "minLength is greater than maxLength"},
      {R"({"type":"integer","minimum":5,"maximum":4})", "empty"},
      {"false", "matches nothing"},
      {R"({"type":"object",})", "not valid JSON"},
      {R"({"a":1,"a":2})", "duplicate key"},
      {"[1", "not valid JSON"},
  };
  for (const auto& [schema, message] : cases) {
    const std::string error = ErrorOf(schema);
    EXPECT_NE(error.find(message), std::string::npos) << schema << " -> " << error;
  }
  EXPECT_EQ(ErrorOf(R"({"title":"t","description":"d","$schema":"x","examples":[1],"default":1,"type":"null"})"), "");
}

// `levels` definitions, each an anyOf of `fan_out` $refs to the next, the last an integer.
std::string RefFanOut(int levels, int fan_out) {
  std::string defs;
  for (int i = 0; i < levels; ++i) {
    std::string refs;
    for (int k = 0; k < fan_out; ++k) refs += std::string(k ? "," : "") + R"({"$ref":"#/$defs/d)" + std::to_string(i + 1) + R"("})";
    defs += R"("d)" + std::to_string(i) + R"(":{"anyOf":[)" + refs + "]},";
  }
  defs += R"("d)" + std::to_string(levels) + R"(":{"type":"integer"})";
  return R"({"$defs":{)" + defs + R"(},"$ref":"#/$defs/d0"})";
}

// Found while writing the fuzz targets (regression input in fuzz/corpus/json_schema): every use
// of a $ref was lowered afresh, so fan-out through a chain of $refs grew the tree exponentially
// before any limit was checked (this 2.6 KB schema: 810k copies, 90 s, 1.7 GB under ASan). Now
// a target is lowered once per depth and the compiler's NFA limit rejects the expansion.
TEST(JsonSchema, RefFanOutIsSharedAndHitsTheNfaLimit) {
  ExpectLanguage(RefFanOut(2, 3), {"7", "-12"}, {"\"a\""});
  Ast ast;
  LowerJsonSchema(RefFanOut(4, 30), JsonWhitespace::kCompact, &ast);
  EXPECT_LT(ast.size(), 1000u);
  EXPECT_NE(ErrorOf(RefFanOut(4, 30)).find("NFA states"), std::string::npos) << ErrorOf(RefFanOut(4, 30));
}

// Lowering expands keywords (integer bounds: ~140 nodes each), so a large document is stopped
// by the tree's own node limit instead of allocating gigabytes first.
TEST(JsonSchema, ExpressionTreeSizeIsLimited) {
  std::string branches;
  const std::string bounded = R"({"type":"integer","minimum":1,"maximum":1000000000000000000})";
  for (size_t i = 0; i * 100 < kMaxAstNodes; ++i) branches += (i ? "," : "") + bounded;
  const std::string schema = R"({"anyOf":[)" + branches + "]}";
  ASSERT_LE(schema.size(), kMaxSpecBytes);
  EXPECT_NE(ErrorOf(schema).find("expression tree exceeds"), std::string::npos) << ErrorOf(schema).substr(0, 200);
}

TEST(JsonSchema, RandomWalksProduceSchemaText) {
  const auto vocab = testing::ByteVocab();
  const std::string schema =
      R"({"type":"object","properties":{"id":{"type":"integer","minimum":0,"maximum":999},
          "name":{"type":"string","maxLength":8},"tags":{"type":"array","items":{"enum":["x","y"]},"maxItems":3},
          "ok":{"type":"boolean"}},"required":["id","name"]})";
  for (const JsonWhitespace ws : {JsonWhitespace::kCompact, JsonWhitespace::kStandard, JsonWhitespace::kFree}) {
    const auto c = CompileJsonSchema(vocab, schema, ws);
    const Dfa dfa = Compile(schema, ws);
    for (uint32_t seed = 0; seed < 20; ++seed) {
      const auto r = testing::RandomWalk(*c, 120, seed);
      ASSERT_TRUE(r.finished);
      EXPECT_TRUE(dfa.Matches(r.text)) << r.text;
      if (ws == JsonWhitespace::kFree) continue;  // control bytes are whitespace there
      for (char ch : r.text) EXPECT_GE(static_cast<unsigned char>(ch), 0x20) << "raw control byte in " << r.text;
    }
  }
}

}  // namespace
}  // namespace paved::constraints

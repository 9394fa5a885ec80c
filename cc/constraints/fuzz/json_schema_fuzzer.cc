// libFuzzer target: JSON Schema lowering in all three whitespace modes, then, for trees small
// enough to compile quickly, the DFA. A top-level `const` / `enum` schema without `type` must
// match the serialization of each of its values (with `type`, values of other types are left out).
#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/constraints/dfa.h"
#include "cc/constraints/fuzz/fuzz_checks.h"
#include "cc/constraints/json_schema.h"
#include "cc/constraints/json_value.h"
#include "cc/constraints/regex_ast.h"

namespace pc = paved::constraints;

namespace {

void LowerAndCompile(const std::string& text, pc::JsonWhitespace ws) {
  pc::Ast ast;
  int root;
  try {
    root = pc::LowerJsonSchema(text, ws, &ast);
  } catch (const pc::ConstraintError&) {
    return;
  }
  pc::fuzz::CheckAst(ast, root);
  if (pc::fuzz::EstimatedNfaStates(ast, root) > pc::fuzz::kCompileBudget) return;
  pc::Dfa dfa;
  try {
    dfa = pc::CompileDfa(ast, root);
  } catch (const pc::ConstraintError&) {
    return;
  }
  pc::fuzz::CheckDfa(dfa);
  (void)dfa.Matches(text);
  if (ws == pc::JsonWhitespace::kFree) return;
  const char* item_sep = ws == pc::JsonWhitespace::kCompact ? "," : ", ";
  const char* key_sep = ws == pc::JsonWhitespace::kCompact ? ":" : ": ";
  const pc::JsonValue schema = pc::ParseJson(text);  // lowering accepted it, so it parses
  if (schema.type != pc::JsonValue::Type::kObject || schema.Find("type")) return;
  if (const pc::JsonValue* c = schema.Find("const")) {
    PAVED_FUZZ_CHECK(dfa.Matches(pc::SerializeJson(*c, item_sep, key_sep)));
  } else if (const pc::JsonValue* e = schema.Find("enum"); e && !schema.Find("$ref") && !schema.Find("anyOf") && !schema.Find("allOf")) {
    for (const pc::JsonValue& v : e->items) PAVED_FUZZ_CHECK(dfa.Matches(pc::SerializeJson(v, item_sep, key_sep)));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  LowerAndCompile(text, pc::JsonWhitespace::kCompact);
  LowerAndCompile(text, pc::JsonWhitespace::kStandard);
  LowerAndCompile(text, pc::JsonWhitespace::kFree);
  return 0;
}

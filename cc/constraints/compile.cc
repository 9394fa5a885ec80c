#include "cc/constraints/compile.h"

#include <utility>

#include "cc/constraints/choice.h"
#include "cc/constraints/dfa.h"
#include "cc/constraints/regex_parser.h"

namespace paved::constraints {
namespace {

Dfa RegexDfa(const std::string& pattern) {
  Ast ast;
  const int root = ParseRegex(pattern, &ast);
  return CompileDfa(ast, root);
}

Dfa JsonSchemaDfa(const std::string& schema_json, JsonWhitespace whitespace) {
  Ast ast;
  const int root = LowerJsonSchema(schema_json, whitespace, &ast);
  return CompileDfa(ast, root);
}

}  // namespace

std::shared_ptr<Constraint> CompileRegex(std::shared_ptr<const Vocab> vocab, const std::string& pattern) {
  return std::make_shared<DfaConstraint>(std::move(vocab), RegexDfa(pattern), "regex");
}

std::shared_ptr<Constraint> CompileJsonSchema(std::shared_ptr<const Vocab> vocab, const std::string& schema_json,
                                              JsonWhitespace whitespace) {
  return std::make_shared<DfaConstraint>(std::move(vocab), JsonSchemaDfa(schema_json, whitespace), "json_schema");
}

std::shared_ptr<Constraint> CompileChoice(std::shared_ptr<const Vocab> vocab, std::vector<std::string> items, int k,
                                          std::string separator, bool distinct) {
  return std::make_shared<ChoiceConstraint>(std::move(vocab), std::move(items), k, std::move(separator), distinct);
}

void CheckRegex(const std::string& pattern) { RegexDfa(pattern); }

void CheckJsonSchema(const std::string& schema_json) { JsonSchemaDfa(schema_json, JsonWhitespace::kCompact); }

}  // namespace paved::constraints

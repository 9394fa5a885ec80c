// Entry points: compile a regex, a JSON Schema or a catalogue against a vocabulary, or only
// validate a spec (admission time, no vocabulary). All throw ConstraintError.
#ifndef PAVED_CC_CONSTRAINTS_COMPILE_H_
#define PAVED_CC_CONSTRAINTS_COMPILE_H_

#include <memory>
#include <string>
#include <vector>

#include "cc/constraints/constraint.h"
#include "cc/constraints/json_schema.h"
#include "cc/constraints/vocab.h"

namespace paved::constraints {

std::shared_ptr<Constraint> CompileRegex(std::shared_ptr<const Vocab> vocab, const std::string& pattern);
std::shared_ptr<Constraint> CompileJsonSchema(std::shared_ptr<const Vocab> vocab, const std::string& schema_json,
                                              JsonWhitespace whitespace);
// See choice.h.
std::shared_ptr<Constraint> CompileChoice(std::shared_ptr<const Vocab> vocab, std::vector<std::string> items, int k,
                                          std::string separator, bool distinct);

// Parse and compile to a DFA (so size limits are checked too), without a vocabulary.
void CheckRegex(const std::string& pattern);
void CheckJsonSchema(const std::string& schema_json);

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_COMPILE_H_

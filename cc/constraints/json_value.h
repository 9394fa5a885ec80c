// Minimal strict (RFC 8259) JSON document model, used to read JSON Schema documents. Object
// members keep document order: the lowering emits properties in that order.
#ifndef PAVED_CC_CONSTRAINTS_JSON_VALUE_H_
#define PAVED_CC_CONSTRAINTS_JSON_VALUE_H_

#include <string>
#include <utility>
#include <vector>

namespace paved::constraints {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Type type = Type::kNull;
  bool boolean = false;
  std::string text;  // kNumber: the number as written; kString: decoded UTF-8
  std::vector<JsonValue> items;
  std::vector<std::pair<std::string, JsonValue>> members;

  const JsonValue* Find(const std::string& key) const;
};

// Throws ConstraintError with the byte offset of the first error. Duplicate keys are errors.
JsonValue ParseJson(const std::string& text);

// The value as JSON text with the given separators (e.g. "," ":" or ", " ": "); numbers are
// written as in the source, strings with EncodeJsonString.
std::string SerializeJson(const JsonValue& value, const std::string& item_sep, const std::string& key_sep);

// The canonical JSON encoding of a UTF-8 string: quotes, `\"`, `\\`, short escapes for
// \b \f \n \r \t, \u00XX for other control characters, everything else raw.
std::string EncodeJsonString(const std::string& utf8);

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_JSON_VALUE_H_

// Lowers a JSON Schema document to a regular expression (Ast) over the JSON texts of its
// instances. Output is strict RFC 8259 JSON: strings never contain raw control characters
// (< 0x20), escapes are `\" \\ \/ \b \f \n \r \t` and `\uXXXX` (surrogate code points are not
// generated; non-BMP characters appear as raw UTF-8).
//
// Supported subset (anything else is an error naming the keyword and its JSON path, e.g.
// "unsupported JSON Schema keyword 'patternProperties' at $.properties.a"):
//   type (a name or a list of names), enum, const (any JSON values; other keywords are then
//     ignored), anyOf, allOf with a single subschema, $ref to a local "#/..." pointer
//     (e.g. "#/$defs/Item"; recursion stops at the depth limit),
//   object: properties (emitted in document order), required (optional properties may be
//     omitted), additionalProperties false or ABSENT (absent is treated as false: only the
//     listed properties are ever generated),
//   array: items (a schema; absent = any value), minItems, maxItems,
//   string: minLength, maxLength (in code points; an escape counts as one), pattern (full
//     match, see regex_parser.h; not combined with min/maxLength), format date, time,
//     date-time, uuid, email, ipv4,
//   integer: minimum, maximum, exclusiveMinimum, exclusiveMaximum (numbers, |bound| <= 1e18),
//   number (no bounds), boolean, null,
//   true / {} (any JSON value, nested at most kAnyJsonDepth levels).
// Annotations are ignored: title, description, $schema, $id, $comment, examples, default,
// deprecated, readOnly, writeOnly, and $defs / definitions (read through $ref).
// Subschemas nest at most kMaxSchemaDepth levels (properties, items, anyOf, $ref each add one).
//
// Whitespace: "compact" (none: {"a":1,"b":[1,2]}), "standard" (Python json.dumps style:
// {"a": 1, "b": [1, 2]}), or "free" (up to kFreeWhitespaceMax of space, \t, \n, \r wherever JSON
// allows whitespace inside the value, twice that inside an empty object or array; none before
// or after the value).
#ifndef PAVED_CC_CONSTRAINTS_JSON_SCHEMA_H_
#define PAVED_CC_CONSTRAINTS_JSON_SCHEMA_H_

#include <string>

#include "cc/constraints/regex_ast.h"

namespace paved::constraints {

enum class JsonWhitespace { kCompact, kStandard, kFree };

// "compact" | "standard" | "free"; throws ConstraintError otherwise.
JsonWhitespace ParseJsonWhitespace(const std::string& name);

// Returns the root node in `ast`. Throws ConstraintError.
int LowerJsonSchema(const std::string& schema_json, JsonWhitespace whitespace, Ast* ast);

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_JSON_SCHEMA_H_

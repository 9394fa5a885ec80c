// Regex syntax accepted by Constraint::Regex (a subset of Python `re` / ECMAScript), parsed
// into an Ast. The whole output must match (anchors are implicit).
//
// Supported:
//   literals (any Unicode character, matched as its UTF-8 bytes), `.` (any character except
//   "\n"), classes `[abc]`, `[a-z]`, `[^...]` (negation: any character not listed, "\n"
//   included), escapes `\d \D \w \W \s \S` (ASCII meaning, like Python's re.ASCII),
//   `\n \t \r \f \v \0 \a`, `\xHH`, `\uHHHH`, `\UHHHHHHHH`, `\` before any ASCII punctuation,
//   alternation `|`, groups `(...)`, `(?:...)`, `(?P<name>...)`, `(?<name>...)`, comments
//   `(?#...)`, quantifiers `* + ? {m} {m,} {,n} {m,n}` (bounds <= kMaxRepeat), and a
//   leading `^` / trailing `$` (redundant: matching is always full).
// Rejected with an error naming the construct and its position (a code point index):
//   backreferences, lookahead/lookbehind, lazy and possessive quantifiers, atomic groups,
//   conditionals, inline flags, word boundaries and other anchors, Unicode property escapes,
//   POSIX classes, anchors anywhere but the ends.
// A `{` that does not start a valid quantifier is a literal, as in Python.
#ifndef PAVED_CC_CONSTRAINTS_REGEX_PARSER_H_
#define PAVED_CC_CONSTRAINTS_REGEX_PARSER_H_

#include <string>

#include "cc/constraints/regex_ast.h"

namespace paved::constraints {

// Parses a UTF-8 pattern into `ast` and returns the root node. Throws ConstraintError.
int ParseRegex(const std::string& pattern, Ast* ast);

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_REGEX_PARSER_H_

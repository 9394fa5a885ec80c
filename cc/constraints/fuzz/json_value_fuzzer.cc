// libFuzzer target: the strict JSON reader. Accepted documents must round-trip: serializing,
// re-reading and serializing again gives the same text; any valid UTF-8 string survives
// EncodeJsonString -> ParseJson unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "cc/constraints/fuzz/fuzz_checks.h"
#include "cc/constraints/json_value.h"
#include "cc/constraints/regex_ast.h"

namespace pc = paved::constraints;

namespace {

bool IsValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    if (!pc::DecodeUtf8(s, &i, &cp)) return false;
  }
  return true;
}

void CheckRoundTrip(const pc::JsonValue& v, const char* item_sep, const char* key_sep) {
  const std::string once = pc::SerializeJson(v, item_sep, key_sep);
  pc::JsonValue again;
  try {
    again = pc::ParseJson(once);
  } catch (const pc::ConstraintError&) {
    pc::fuzz::Violated("a serialized document does not parse");
  }
  PAVED_FUZZ_CHECK(pc::SerializeJson(again, item_sep, key_sep) == once);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (IsValidUtf8(text)) {
    const std::string encoded = pc::EncodeJsonString(text);
    try {
      const pc::JsonValue s = pc::ParseJson(encoded);
      PAVED_FUZZ_CHECK(s.type == pc::JsonValue::Type::kString && s.text == text);
    } catch (const pc::ConstraintError&) {
      pc::fuzz::Violated("EncodeJsonString output does not parse");
    }
  }
  pc::JsonValue v;
  try {
    v = pc::ParseJson(text);
  } catch (const pc::ConstraintError&) {
    return 0;
  }
  CheckRoundTrip(v, ",", ":");
  CheckRoundTrip(v, ", ", ": ");
  return 0;
}

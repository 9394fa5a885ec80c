#include "cc/constraints/token_bitmask.h"

#include <bitset>
#include <limits>
#include <stdexcept>

namespace paved::constraints {

TokenBitmask::TokenBitmask(int64_t vocab_size)
    : vocab_size_(vocab_size), words_(static_cast<size_t>(BitmaskWords(vocab_size)), 0u) {
  if (vocab_size <= 0) throw std::invalid_argument("vocab_size must be positive");
}

void TokenBitmask::Set(int64_t token) {
  if (token < 0 || token >= vocab_size_) throw std::out_of_range("token id out of vocabulary");
  words_[token >> 5] |= (1u << (token & 31));
}

void TokenBitmask::Clear(int64_t token) {
  if (token < 0 || token >= vocab_size_) throw std::out_of_range("token id out of vocabulary");
  words_[token >> 5] &= ~(1u << (token & 31));
}

bool TokenBitmask::Test(int64_t token) const {
  if (token < 0 || token >= vocab_size_) return false;
  return (words_[token >> 5] >> (token & 31)) & 1u;
}

void TokenBitmask::SetAll() {
  for (auto& w : words_) w = ~0u;
  // Bits past the vocabulary stay clear so Count() and Tokens() never report phantom ids.
  const int64_t tail = vocab_size_ & 31;
  if (tail != 0) words_.back() = (1u << tail) - 1u;
}

void TokenBitmask::ClearAll() {
  for (auto& w : words_) w = 0u;
}

int64_t TokenBitmask::Count() const {
  int64_t n = 0;
  for (uint32_t w : words_) n += static_cast<int64_t>(std::bitset<32>(w).count());
  return n;
}

std::vector<int32_t> TokenBitmask::Tokens() const {
  std::vector<int32_t> out;
  for (size_t i = 0; i < words_.size(); ++i) {
    uint32_t w = words_[i];
    while (w != 0) {
      const int bit = __builtin_ctz(w);
      out.push_back(static_cast<int32_t>(i * 32 + bit));
      w &= w - 1;
    }
  }
  return out;
}

void ApplyMaskRow(float* row, const uint32_t* mask, int64_t vocab_size) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t words = BitmaskWords(vocab_size);
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t bits = mask[w];
    if (bits == ~0u) continue;  // fully allowed word: the common case for loose constraints
    const int64_t base = w * 32;
    const int n = static_cast<int>(base + 32 < vocab_size ? 32 : vocab_size - base);
    float* out = row + base;
    if (bits == 0) {  // fully masked: the common case for tight constraints
      for (int j = 0; j < n; ++j) out[j] = neg_inf;
      continue;
    }
    for (int j = 0; j < n; ++j) out[j] = ((bits >> j) & 1u) ? out[j] : neg_inf;
  }
}

void ApplyBitmaskRows(float* logits, const int32_t* bitmask, int64_t vocab_size,
                      const int64_t* row_ids, int64_t num_rows) {
  const int64_t words = BitmaskWords(vocab_size);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t r = row_ids != nullptr ? row_ids[i] : i;
    ApplyMaskRow(logits + r * vocab_size, reinterpret_cast<const uint32_t*>(bitmask + r * words), vocab_size);
  }
}

}  // namespace paved::constraints

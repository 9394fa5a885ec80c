#include "cc/constraints/token_bitmask.h"

#include <bitset>
#include <cstring>
#include <limits>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

namespace {

// kByteLanes[b][j] is all ones if bit j of b is set: a mixed mask word is applied 8 lanes at
// a time with and/or, which the compiler vectorizes (a per-bit branch does not).
struct ByteLanes {
  uint32_t lanes[256][8];
  ByteLanes() {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) lanes[b][j] = ((b >> j) & 1) ? ~0u : 0u;
  }
};
const ByteLanes kByteLanes;

}  // namespace

#if defined(__x86_64__)
namespace {

// AVX2 is enabled for this function only (the library is built for baseline x86-64); callers
// check HaveStreamingStores() first. 32-byte streaming stores: on the AMD EPYC VM the SSE2
// 16-byte form cost ~20% more per 1 MiB than these (docs/benchmarks.md).
__attribute__((target("avx2"))) void StreamCopyAvx2(uint32_t* dst, const uint32_t* src, int64_t words) {
  int64_t k = 0;
  for (; k < words && (reinterpret_cast<uintptr_t>(dst + k) & 31) != 0; ++k) dst[k] = src[k];
  for (; k + 8 <= words; k += 8)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
  for (; k < words; ++k) dst[k] = src[k];
}

}  // namespace

bool HaveStreamingStores() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}

void CopyMaskRowStreaming(uint32_t* dst, const uint32_t* src, int64_t words) {
  if (HaveStreamingStores()) {
    StreamCopyAvx2(dst, src, words);
    return;
  }
  std::memcpy(dst, src, static_cast<size_t>(words) * 4);
}

// Without the fence a reader woken after the chunk (the caller after a worker's chunk, Python
// after the call) could see stale words.
void FenceStreamingStores() { _mm_sfence(); }
#else
bool HaveStreamingStores() { return false; }

void CopyMaskRowStreaming(uint32_t* dst, const uint32_t* src, int64_t words) {
  std::memcpy(dst, src, static_cast<size_t>(words) * 4);
}

void FenceStreamingStores() {}
#endif

void ApplyMaskRow(float* row, const uint32_t* mask, int64_t vocab_size) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  uint32_t neg_inf_bits;
  std::memcpy(&neg_inf_bits, &neg_inf, 4);
  const int64_t full_words = vocab_size / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = mask[w];
    if (bits == ~0u) continue;  // fully allowed word: the common case for loose constraints
    float* out = row + w * 32;
    if (bits == 0) {  // fully masked: the common case for tight constraints
      for (int j = 0; j < 32; ++j) out[j] = neg_inf;
      continue;
    }
    for (int k = 0; k < 4; ++k) {
      const uint32_t* keep = kByteLanes.lanes[(bits >> (8 * k)) & 0xFF];
      uint32_t v[8];
      std::memcpy(v, out + 8 * k, sizeof(v));
      for (int j = 0; j < 8; ++j) v[j] = (v[j] & keep[j]) | (neg_inf_bits & ~keep[j]);
      std::memcpy(out + 8 * k, v, sizeof(v));
    }
  }
  // The partial last word, bit by bit.
  for (int64_t t = full_words * 32; t < vocab_size; ++t)
    if (((mask[t >> 5] >> (t & 31)) & 1u) == 0) row[t] = neg_inf;
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

// Packed allowed-token sets: the wire format between constraint state machines and the
// sampler. Layout matches vLLM/xgrammar bitmasks: row r of a [B, ceil(V/32)] int32 tensor,
// bit (t % 32) of word (t / 32) set <=> token t is allowed for row r.
#ifndef PAVED_CC_CONSTRAINTS_TOKEN_BITMASK_H_
#define PAVED_CC_CONSTRAINTS_TOKEN_BITMASK_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace paved::constraints {

// Number of 32-bit words needed for a vocabulary of `vocab_size` tokens.
constexpr int64_t BitmaskWords(int64_t vocab_size) { return (vocab_size + 31) / 32; }

class TokenBitmask {
 public:
  explicit TokenBitmask(int64_t vocab_size);

  int64_t vocab_size() const { return vocab_size_; }
  int64_t num_words() const { return static_cast<int64_t>(words_.size()); }
  const uint32_t* data() const { return words_.data(); }

  void Set(int64_t token);
  void Clear(int64_t token);
  bool Test(int64_t token) const;
  void SetAll();
  void ClearAll();
  int64_t Count() const;
  // Allowed tokens in ascending order.
  std::vector<int32_t> Tokens() const;

 private:
  int64_t vocab_size_;
  std::vector<uint32_t> words_;
};

// Whether CopyMaskRowStreaming uses non-temporal stores on this CPU (x86-64 with AVX2).
bool HaveStreamingStores();

// Copies `words` mask words to `dst` with non-temporal stores that bypass the caches; memcpy
// where the CPU has no such stores. The stores are weakly ordered: they are visible to other
// threads only after FenceStreamingStores() on the writing thread (one fence per chunk of rows
// is cheaper than one per row: docs/benchmarks.md). Which of copy or streaming is faster
// depends on the CPU and on what is cached: BatchMasker measures both (batch_masker.h).
void CopyMaskRowStreaming(uint32_t* dst, const uint32_t* src, int64_t words);
void FenceStreamingStores();

// Writes -inf into every logit of `row` (float32 [vocab_size]) whose bit is clear in `mask`
// (BitmaskWords(vocab_size) words).
void ApplyMaskRow(float* row, const uint32_t* mask, int64_t vocab_size);

// Writes -inf into every logit of `logits` (row-major [rows, vocab_size] float32) whose bit is
// clear in `bitmask` (row-major [rows, BitmaskWords(vocab_size)] int32). Rows whose index is
// not in `row_ids` are left untouched when `row_ids` is non-null. Pure function of its
// inputs, safe to call concurrently on disjoint rows.
void ApplyBitmaskRows(float* logits, const int32_t* bitmask, int64_t vocab_size,
                      const int64_t* row_ids, int64_t num_rows);

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_TOKEN_BITMASK_H_

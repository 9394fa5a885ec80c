// A tokenizer vocabulary as the constraint engine sees it: token id -> bytes, the EOS ids, and
// a byte trie of every ordinary token used to compute allowed-token masks.
#ifndef PAVED_CC_CONSTRAINTS_VOCAB_H_
#define PAVED_CC_CONSTRAINTS_VOCAB_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace paved::constraints {

// Byte trie of the ordinary tokens, stored in DFS preorder. A mask computation walks it as a
// linear scan, jumping over a whole subtree (`skip`) as soon as its prefix is rejected, so
// every shared prefix is stepped through the automaton once.
class VocabTrie {
 public:
  struct Node {
    int32_t skip;         // index of the first node after this node's subtree
    int32_t token_begin;  // this node's tokens: token_ids()[token_begin, next node's token_begin)
    uint16_t depth;       // 1 for the first byte of a token
    uint8_t byte;
  };

  VocabTrie() = default;
  // `tokens[id]` for every id to include (others are empty strings and skipped).
  explicit VocabTrie(const std::vector<std::string>& tokens);

  int32_t num_nodes() const { return static_cast<int32_t>(nodes_.size()) - 1; }
  // num_nodes() + 1 entries; the last is a sentinel carrying the final token_begin.
  const Node* nodes() const { return nodes_.data(); }
  const int32_t* token_ids() const { return token_ids_.data(); }
  int max_depth() const { return max_depth_; }

 private:
  std::vector<Node> nodes_;
  std::vector<int32_t> token_ids_;
  int max_depth_ = 0;
};

class Vocab {
 public:
  // `vocab_size` < 0 means token_bytes.size(). Ids at or beyond token_bytes.size() and ids with
  // empty bytes are never allowed unless they are EOS ids. Throws ConstraintError.
  Vocab(std::vector<std::string> token_bytes, std::vector<int32_t> eos_token_ids, int64_t vocab_size = -1);

  int32_t size() const { return size_; }
  int32_t num_words() const { return (size_ + 31) / 32; }
  // Bytes of an ordinary token; empty for EOS, special, and padding ids.
  const std::string& token(int32_t id) const;
  bool is_eos(int32_t id) const;
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  // True if `byte` alone is an ordinary token.
  bool has_byte_token(uint8_t byte) const { return byte_token_[byte] != 0; }
  bool has_all_byte_tokens() const { return has_all_byte_tokens_; }
  const VocabTrie& trie() const { return trie_; }

 private:
  int32_t size_;
  std::vector<std::string> tokens_;
  std::vector<int32_t> eos_ids_;
  std::vector<uint8_t> eos_flag_;
  std::array<uint8_t, 256> byte_token_{};
  bool has_all_byte_tokens_ = false;
  VocabTrie trie_;
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_VOCAB_H_

#include "cc/constraints/vocab.h"

#include <algorithm>
#include <string>
#include <utility>

#include "cc/constraints/limits.h"
#include "cc/constraints/regex_ast.h"

namespace paved::constraints {

VocabTrie::VocabTrie(const std::vector<std::string>& tokens) {
  std::vector<int32_t> ids;
  for (size_t id = 0; id < tokens.size(); ++id)
    if (!tokens[id].empty()) ids.push_back(static_cast<int32_t>(id));
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    const std::string& x = tokens[static_cast<size_t>(a)];
    const std::string& y = tokens[static_cast<size_t>(b)];
    return x != y ? x < y : a < b;
  });
  // In sorted order a prefix precedes its extensions, so each string adds the nodes past its
  // common prefix with the previous string, and nodes come out in preorder.
  std::vector<int32_t> open;  // open[d - 1]: node index at depth d on the current path
  const std::string* prev = nullptr;
  token_ids_.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string& s = tokens[static_cast<size_t>(id)];
    size_t common = 0;
    if (prev != nullptr) {
      const size_t limit = std::min(prev->size(), s.size());
      while (common < limit && (*prev)[common] == s[common]) ++common;
    }
    if (prev == nullptr || common < s.size() || prev->size() != s.size()) {
      // Close the subtrees that end here, then open the new suffix.
      while (open.size() > common) {
        nodes_[static_cast<size_t>(open.back())].skip = static_cast<int32_t>(nodes_.size());
        open.pop_back();
      }
      for (size_t d = common; d < s.size(); ++d) {
        open.push_back(static_cast<int32_t>(nodes_.size()));
        nodes_.push_back({0, static_cast<int32_t>(token_ids_.size()), static_cast<uint16_t>(d + 1),
                          static_cast<uint8_t>(s[d])});
      }
    }
    token_ids_.push_back(id);
    max_depth_ = std::max(max_depth_, static_cast<int>(s.size()));
    prev = &s;
  }
  for (int32_t node : open) nodes_[static_cast<size_t>(node)].skip = static_cast<int32_t>(nodes_.size());
  nodes_.push_back({static_cast<int32_t>(nodes_.size() + 1), static_cast<int32_t>(token_ids_.size()), 0, 0});
}

Vocab::Vocab(std::vector<std::string> token_bytes, std::vector<int32_t> eos_token_ids, int64_t vocab_size) {
  if (vocab_size < 0) vocab_size = static_cast<int64_t>(token_bytes.size());
  if (vocab_size < static_cast<int64_t>(token_bytes.size()))
    throw ConstraintError("vocab_size " + std::to_string(vocab_size) + " is smaller than the " +
                          std::to_string(token_bytes.size()) + " tokens given");
  if (vocab_size <= 0 || vocab_size > kMaxVocabSize)
    throw ConstraintError("vocab_size must be in [1, " + std::to_string(kMaxVocabSize) + "], got " +
                          std::to_string(vocab_size));
  if (eos_token_ids.empty()) throw ConstraintError("eos_token_ids must not be empty");
  size_ = static_cast<int32_t>(vocab_size);
  eos_flag_.assign(static_cast<size_t>(size_), 0);
  for (int32_t id : eos_token_ids) {
    if (id < 0 || id >= size_)
      throw ConstraintError("EOS token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                            std::to_string(size_) + ")");
    if (!eos_flag_[static_cast<size_t>(id)]) eos_ids_.push_back(id);
    eos_flag_[static_cast<size_t>(id)] = 1;
  }
  std::sort(eos_ids_.begin(), eos_ids_.end());
  tokens_ = std::move(token_bytes);
  for (size_t id = 0; id < tokens_.size(); ++id) {
    if (tokens_[id].size() > kMaxTokenBytes)
      throw ConstraintError("token " + std::to_string(id) + " is " + std::to_string(tokens_[id].size()) +
                            " bytes, over the limit of " + std::to_string(kMaxTokenBytes));
    // EOS ids are matched by id, never by their text.
    if (eos_flag_[id]) tokens_[id].clear();
    if (tokens_[id].size() == 1) byte_token_[static_cast<uint8_t>(tokens_[id][0])] = 1;
  }
  has_all_byte_tokens_ = std::all_of(byte_token_.begin(), byte_token_.end(), [](uint8_t f) { return f != 0; });
  trie_ = VocabTrie(tokens_);
}

const std::string& Vocab::token(int32_t id) const {
  static const std::string kNone;
  return id >= 0 && static_cast<size_t>(id) < tokens_.size() ? tokens_[static_cast<size_t>(id)] : kNone;
}

bool Vocab::is_eos(int32_t id) const {
  return id >= 0 && id < size_ && eos_flag_[static_cast<size_t>(id)] != 0;
}

}  // namespace paved::constraints

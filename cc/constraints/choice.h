// Catalogue constraint: the output is one string of a fixed catalogue (e.g. 100k titles), or
// a list of exactly k catalogue strings joined by a separator, optionally all distinct.
//
// The catalogue is a byte trie; the automaton position is a trie node or a position inside the
// separator, plus the number of separators still to come. Masks of the non-distinct modes are
// cached per (position, separators left, capped at what one token can cross). Distinct lists
// are not regular (the used set is per request): their mask is the cached non-distinct mask
// minus the tokens that would repeat an item, found by a walk that only enters vocab subtrees
// leading toward a used item or across a separator; near the end of the budget the mask is
// computed by a full walk instead.
//
// Restrictions (ConstraintError at compile time): items must be non-empty for k > 1 and at most
// kMaxItemBytes; the separator must be non-empty for k > 1; an item followed by the separator
// must not be a prefix of another item (e.g. "Up" and "Up, Up and Away" with ", "), which
// would make the parse ambiguous for the consumer too; distinct needs k <= number of distinct
// items; the vocabulary must have a single-byte token for every byte of the items and the
// separator (true for byte-level BPE vocabularies): distances to completion are counted in
// those tokens.
#ifndef PAVED_CC_CONSTRAINTS_CHOICE_H_
#define PAVED_CC_CONSTRAINTS_CHOICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cc/constraints/constraint.h"

namespace paved::constraints {

// The catalogue's byte trie in preorder. Items sorted by bytes are numbered by rank; the
// items of a subtree are the contiguous ranks [first_item(n), first_item(end(n))).
class CatalogueTrie {
 public:
  CatalogueTrie() = default;
  explicit CatalogueTrie(const std::vector<std::string>& sorted_unique_items);

  int32_t num_nodes() const { return static_cast<int32_t>(end_.size()); }
  int32_t num_items() const { return static_cast<int32_t>(item_len_.size()); }
  // Child of `node` on `byte`, or -1.
  int32_t Child(int32_t node, uint8_t byte) const;
  int32_t end(int32_t node) const { return end_[static_cast<size_t>(node)]; }
  int32_t depth(int32_t node) const { return depth_[static_cast<size_t>(node)]; }
  bool terminal(int32_t node) const { return terminal_[static_cast<size_t>(node)] != 0; }
  // The item ending at a terminal node is the first of its subtree.
  int32_t first_item(int32_t node) const { return first_item_[static_cast<size_t>(node)]; }
  int32_t items_end(int32_t node) const { return first_item_[static_cast<size_t>(end(node))]; }
  // Bytes from `node` to the nearest item end below it.
  int32_t nearest(int32_t node) const { return nearest_[static_cast<size_t>(node)]; }
  // Length of the longest item in the subtree of `node`.
  int32_t deepest(int32_t node) const { return deepest_[static_cast<size_t>(node)]; }
  int32_t item_len(int32_t rank) const { return item_len_[static_cast<size_t>(rank)]; }

 private:
  std::vector<uint8_t> byte_;
  std::vector<int32_t> end_;
  std::vector<uint16_t> depth_;
  std::vector<uint8_t> terminal_;
  std::vector<int32_t> first_item_;  // num_nodes() + 1 entries
  std::vector<uint16_t> nearest_;
  std::vector<uint16_t> deepest_;
  std::vector<uint16_t> item_len_;
};

class ChoiceConstraint final : public Constraint {
 public:
  // A position in the output.
  struct Position {
    int32_t pos;   // a catalogue trie node, or num_nodes + j: j bytes of a separator matched
    int32_t left;  // separators still to come (items still to complete after this one)
  };

  ChoiceConstraint(std::shared_ptr<const Vocab> vocab, std::vector<std::string> items, int k,
                   std::string separator, bool distinct);

  int64_t min_tokens() const override;
  ConstraintStats stats() const override;

  Position start() const { return {kRoot, k_ - 1}; }
  bool Accepting(Position p, const std::vector<int32_t>& used) const;
  // See State::AutomatonMask. `used`: sorted ranks of completed items (distinct mode).
  const uint32_t* Mask(Position p, const std::vector<int32_t>& used, int64_t limit, uint32_t* scratch,
                       std::shared_ptr<const CachedMask>* hold) const;
  // Consumes `bytes` from *p under the same rules; on success updates *p and *used.
  bool Advance(std::string_view bytes, int64_t limit, Position* p, std::vector<int32_t>* used) const;
  int k() const { return k_; }

 protected:
  std::unique_ptr<State> MakeState(std::optional<int64_t> max_tokens) const override;

 private:
  struct Step;
  class UsedSet;
  static constexpr int32_t kRoot = 0;  // the trie root: the start of an item

  void BuildDistinctIndex();
  bool IsTrieNode(int32_t pos) const { return pos < trie_.num_nodes(); }
  Step Next(const Step& from, uint8_t byte, UsedSet* used) const;
  int64_t Distance(Position p, const UsedSet* used) const;
  int64_t DistinctDistance(Position p, const UsedSet& used) const;
  int32_t MinLengthExcluding(int32_t lo, int32_t hi, std::vector<int32_t>* excluded) const;
  // An upper bound of the distance of any position a token leads to from `p` (in either
  // mode): with a limit at least this, no token is dropped for the budget.
  int64_t DistanceBound(Position p) const;
  // Upper bound of the total length of the `m` shortest unused items when `u` are used.
  int64_t ShortestUnusedBound(int32_t m, int32_t u) const;
  // The cached non-distinct mask of `p` (EOS included when accepting), or nullptr if the
  // budget `limit` would drop some of its tokens.
  std::shared_ptr<const CachedMask> BaseMask(Position p, int64_t limit) const;
  // Clears from a non-distinct mask of `p` the tokens that repeat a used item or lead into a
  // subtree of used items. Only explores vocab subtrees where that can happen: toward a used
  // item, or containing the separator (the start of another item).
  void RemoveRepeats(Position p, const std::vector<int32_t>& used, uint32_t* out) const;
  // Mask of `p` into `out` (EOS excluded); `used` (distinct mode) enables the distinct rules.
  void Walk(Position p, const std::vector<int32_t>* used, int64_t limit, uint32_t* out, int64_t* max_landing) const;

  CatalogueTrie trie_;
  int k_;
  std::string separator_;
  bool distinct_;
  int32_t min_item_len_;
  int32_t max_item_len_;
  // Separators one token can cross, plus one: cache keys cap `left` at this.
  int32_t left_cap_;
  // Distinct mode: item ranks by (length, rank), prefix sums of the first k lengths in that
  // order, and a min segment tree of item lengths by rank.
  std::vector<int32_t> by_length_;
  std::vector<int64_t> shortest_prefix_;
  std::vector<uint16_t> length_tree_;
  int32_t tree_leaves_ = 0;
  // Per vocab trie node: some token continues with the separator's first byte below it.
  std::vector<uint8_t> separator_below_;
  mutable MaskCache cache_;
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_CHOICE_H_

#include "cc/constraints/choice.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <utility>

#include "cc/constraints/limits.h"
#include "cc/constraints/regex_ast.h"

namespace paved::constraints {

// ---------------------------------------------------------------------------------------
// CatalogueTrie

CatalogueTrie::CatalogueTrie(const std::vector<std::string>& items) {
  const auto add_node = [&](uint8_t byte, size_t depth, int32_t rank) {
    byte_.push_back(byte);
    end_.push_back(0);
    depth_.push_back(static_cast<uint16_t>(depth));
    terminal_.push_back(0);
    first_item_.push_back(rank);
    return static_cast<int32_t>(end_.size() - 1);
  };
  std::vector<int32_t> open{add_node(0, 0, 0)};  // open[d]: node at depth d on the current path
  const std::string* prev = nullptr;
  for (size_t rank = 0; rank < items.size(); ++rank) {
    const std::string& s = items[rank];
    size_t common = 0;
    if (prev != nullptr)
      while (common < std::min(prev->size(), s.size()) && (*prev)[common] == s[common]) ++common;
    while (open.size() > common + 1) {
      end_[static_cast<size_t>(open.back())] = num_nodes();
      open.pop_back();
    }
    for (size_t d = common + 1; d <= s.size(); ++d)
      open.push_back(add_node(static_cast<uint8_t>(s[d - 1]), d, static_cast<int32_t>(rank)));
    terminal_[static_cast<size_t>(open.back())] = 1;
    item_len_.push_back(static_cast<uint16_t>(s.size()));
    prev = &s;
  }
  for (int32_t node : open) end_[static_cast<size_t>(node)] = num_nodes();
  first_item_.push_back(num_items());
  // Children come after their parent in preorder, so a reverse scan sees them first.
  nearest_.assign(end_.size(), 0);
  deepest_.assign(end_.size(), 0);
  for (int32_t n = num_nodes() - 1; n >= 0; --n) {
    int32_t best = terminal(n) ? 0 : INT32_MAX;
    int32_t deepest = depth(n);
    for (int32_t c = n + 1; c < end(n); c = end(c)) {
      best = std::min(best, nearest(c) + 1);
      deepest = std::max(deepest, this->deepest(c));
    }
    nearest_[static_cast<size_t>(n)] = static_cast<uint16_t>(best);
    deepest_[static_cast<size_t>(n)] = static_cast<uint16_t>(deepest);
  }
}

int32_t CatalogueTrie::Child(int32_t node, uint8_t byte) const {
  // Children are in byte order; catalogue fan-out is small except near the root.
  for (int32_t c = node + 1; c < end(node); c = end(c)) {
    if (byte_[static_cast<size_t>(c)] == byte) return c;
    if (byte_[static_cast<size_t>(c)] > byte) break;
  }
  return -1;
}

// ---------------------------------------------------------------------------------------
// ChoiceConstraint

// One step of a walk: the automaton position after a byte, the item completed by that byte
// (-1 if none) and how many items the current token has completed so far.
struct ChoiceConstraint::Step {
  int32_t pos;
  int32_t left;
  int32_t done;
  int32_t local;
};

// Items a distinct list may no longer use: the request's completed items (sorted) plus those
// completed earlier within the token being examined.
class ChoiceConstraint::UsedSet {
 public:
  UsedSet(const std::vector<int32_t>& sorted, int32_t* local) : sorted_(sorted), local_(local) {}

  bool Contains(int32_t rank) const {
    if (std::binary_search(sorted_.begin(), sorted_.end(), rank)) return true;
    return std::find(local_, local_ + num_local, rank) != local_ + num_local;
  }
  // Number of used items with rank in [lo, hi).
  int32_t CountIn(int32_t lo, int32_t hi) const {
    auto n = static_cast<int32_t>(std::lower_bound(sorted_.begin(), sorted_.end(), hi) -
                                  std::lower_bound(sorted_.begin(), sorted_.end(), lo));
    for (int32_t i = 0; i < num_local; ++i) n += local_[i] >= lo && local_[i] < hi;
    return n;
  }
  int32_t size() const { return static_cast<int32_t>(sorted_.size()) + num_local; }
  void AppendInto(std::vector<int32_t>* out, int32_t lo, int32_t hi) const {
    for (auto it = std::lower_bound(sorted_.begin(), sorted_.end(), lo); it != sorted_.end() && *it < hi; ++it)
      out->push_back(*it);
    for (int32_t i = 0; i < num_local; ++i)
      if (local_[i] >= lo && local_[i] < hi) out->push_back(local_[i]);
  }
  int32_t* local() { return local_; }

  int32_t num_local = 0;

 private:
  const std::vector<int32_t>& sorted_;
  int32_t* local_;
};

namespace {

class ChoiceState final : public State {
 public:
  ChoiceState(std::shared_ptr<const ChoiceConstraint> c, std::optional<int64_t> max_tokens)
      : State(c, max_tokens), c_(c.get()), p_(c->start()) {
    used_.reserve(static_cast<size_t>(c->k()));
  }

 protected:
  bool Accepting() const override { return c_->Accepting(p_, used_); }
  const uint32_t* AutomatonMask(int64_t limit, uint32_t* scratch,
                                std::shared_ptr<const CachedMask>* hold) const override {
    return c_->Mask(p_, used_, limit, scratch, hold);
  }
  bool AdvanceBytes(std::string_view bytes, int64_t limit) override {
    return c_->Advance(bytes, limit, &p_, &used_);
  }
  void ResetAutomaton() override {
    p_ = c_->start();
    used_.clear();
  }

 private:
  const ChoiceConstraint* c_;  // kept alive by State::constraint_
  ChoiceConstraint::Position p_;
  std::vector<int32_t> used_;  // sorted ranks of completed items (distinct mode)
};

}  // namespace

namespace {

// Size limits, non-empty items/separator for lists, and the single-byte tokens that the
// distances count in.
void CheckCatalogue(const std::vector<std::string>& items, int k, const std::string& separator,
                    const Vocab& vocab) {
  if (items.empty()) throw ConstraintError("the catalogue is empty");
  if (items.size() > kMaxCatalogueItems)
    throw ConstraintError("the catalogue has " + std::to_string(items.size()) + " items, over the limit of " +
                          std::to_string(kMaxCatalogueItems));
  if (k < 1 || k > kMaxListItems)
    throw ConstraintError("k must be in [1, " + std::to_string(kMaxListItems) + "], got " + std::to_string(k));
  if (k > 1 && separator.empty()) throw ConstraintError("the separator must not be empty when k > 1");
  if (separator.size() > kMaxItemBytes) throw ConstraintError("the separator is too long");
  size_t total = 0;
  std::array<bool, 256> used_bytes{};
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string& item = items[i];
    if (item.size() > kMaxItemBytes)
      throw ConstraintError("catalogue item " + std::to_string(i) + " is " + std::to_string(item.size()) +
                            " bytes, over the limit of " + std::to_string(kMaxItemBytes));
    if (item.empty() && k > 1) throw ConstraintError("catalogue item " + std::to_string(i) + " is empty");
    total += item.size();
    for (char c : item) used_bytes[static_cast<uint8_t>(c)] = true;
  }
  if (total > kMaxCatalogueBytes)
    throw ConstraintError("the catalogue is " + std::to_string(total) + " bytes, over the limit of " +
                          std::to_string(kMaxCatalogueBytes));
  if (k > 1)
    for (char c : separator) used_bytes[static_cast<uint8_t>(c)] = true;
  for (int b = 0; b < 256; ++b) {
    if (used_bytes[static_cast<size_t>(b)] && !vocab.has_byte_token(static_cast<uint8_t>(b)))
      throw ConstraintError("catalogue constraints need a single-byte token for every byte of the items and "
                            "separator; the vocabulary has none for byte " + std::to_string(b));
  }
}

}  // namespace

ChoiceConstraint::ChoiceConstraint(std::shared_ptr<const Vocab> vocab, std::vector<std::string> items, int k,
                                   std::string separator, bool distinct)
    : Constraint(std::move(vocab)),
      k_(k),
      separator_(std::move(separator)),
      // With one item nothing can repeat: distinct adds nothing.
      distinct_(distinct && k > 1),
      cache_(this->vocab().num_words()) {
  CheckCatalogue(items, k, separator_, this->vocab());
  std::sort(items.begin(), items.end());
  items.erase(std::unique(items.begin(), items.end()), items.end());
  if (distinct_ && static_cast<size_t>(k) > items.size())
    throw ConstraintError("k=" + std::to_string(k) + " distinct items requested but the catalogue has only " +
                          std::to_string(items.size()) + " distinct items");
  trie_ = CatalogueTrie(items);
  // Next() assumes that at an item's end the separator cannot also continue another item.
  for (int32_t n = 0; k > 1 && n < trie_.num_nodes(); ++n) {
    const int32_t child = trie_.terminal(n) ? trie_.Child(n, static_cast<uint8_t>(separator_[0])) : -1;
    if (child >= 0)
      throw ConstraintError("catalogue items \"" + items[static_cast<size_t>(trie_.first_item(n))] + "\" and \"" +
                            items[static_cast<size_t>(trie_.first_item(child))] +
                            "\" are ambiguous with the separator: an item followed by the separator's "
                            "first byte is a prefix of another item");
  }
  min_item_len_ = INT32_MAX;
  max_item_len_ = 0;
  for (int32_t r = 0; r < trie_.num_items(); ++r) {
    min_item_len_ = std::min(min_item_len_, trie_.item_len(r));
    max_item_len_ = std::max(max_item_len_, trie_.item_len(r));
  }
  left_cap_ = separator_.empty() ? 1 : this->vocab().trie().max_depth() / static_cast<int32_t>(separator_.size()) + 1;
  if (distinct_) BuildDistinctIndex();
}

void ChoiceConstraint::BuildDistinctIndex() {
  by_length_.resize(static_cast<size_t>(trie_.num_items()));
  for (int32_t r = 0; r < trie_.num_items(); ++r) by_length_[static_cast<size_t>(r)] = r;
  std::stable_sort(by_length_.begin(), by_length_.end(),
                   [&](int32_t a, int32_t b) { return trie_.item_len(a) < trie_.item_len(b); });
  shortest_prefix_.assign(static_cast<size_t>(k_) + 1, 0);
  for (int i = 0; i < k_; ++i)
    shortest_prefix_[static_cast<size_t>(i) + 1] =
        shortest_prefix_[static_cast<size_t>(i)] + trie_.item_len(by_length_[static_cast<size_t>(i)]);
  tree_leaves_ = 1;
  while (tree_leaves_ < trie_.num_items()) tree_leaves_ *= 2;
  length_tree_.assign(2 * static_cast<size_t>(tree_leaves_), UINT16_MAX);
  for (int32_t r = 0; r < trie_.num_items(); ++r)
    length_tree_[static_cast<size_t>(tree_leaves_ + r)] = static_cast<uint16_t>(trie_.item_len(r));
  for (int32_t i = tree_leaves_ - 1; i > 0; --i)
    length_tree_[static_cast<size_t>(i)] =
        std::min(length_tree_[2 * static_cast<size_t>(i)], length_tree_[2 * static_cast<size_t>(i) + 1]);
  // Children come after their parent in preorder: a reverse scan sees them first.
  const VocabTrie& vtrie = vocab().trie();
  const VocabTrie::Node* nodes = vtrie.nodes();
  const auto sep0 = static_cast<uint8_t>(separator_[0]);
  separator_below_.assign(static_cast<size_t>(vtrie.num_nodes()), 0);
  for (int32_t i = vtrie.num_nodes() - 1; i >= 0; --i) {
    for (int32_t c = i + 1; c < nodes[i].skip; c = nodes[c].skip) {
      if (nodes[c].byte == sep0 || separator_below_[static_cast<size_t>(c)]) {
        separator_below_[static_cast<size_t>(i)] = 1;
        break;
      }
    }
  }
}

ChoiceConstraint::Step ChoiceConstraint::Next(const Step& from, uint8_t byte, UsedSet* used) const {
  constexpr Step kDeadStep{-1, 0, -1, 0};
  Step s{-1, from.left, -1, from.local};
  const auto sep_len = static_cast<int32_t>(separator_.size());
  if (IsTrieNode(from.pos)) {
    s.pos = trie_.Child(from.pos, byte);
    if (s.pos < 0 && trie_.terminal(from.pos) && from.left > 0 && byte == static_cast<uint8_t>(separator_[0])) {
      s.done = trie_.first_item(from.pos);
      s.pos = sep_len == 1 ? kRoot : trie_.num_nodes() + 1;
      if (sep_len == 1) --s.left;
    }
  } else {
    const int32_t matched = from.pos - trie_.num_nodes();
    if (byte == static_cast<uint8_t>(separator_[static_cast<size_t>(matched)])) {
      s.pos = matched + 1 == sep_len ? kRoot : from.pos + 1;
      if (matched + 1 == sep_len) --s.left;
    }
  }
  if (s.pos < 0) return kDeadStep;
  if (used == nullptr) return s;
  used->num_local = from.local;
  if (s.done >= 0) {
    if (used->Contains(s.done)) return kDeadStep;  // a repeat
    used->local()[s.local++] = s.done;
    used->num_local = s.local;
  }
  if (IsTrieNode(s.pos)) {
    // Prune a subtree whose items are all used (cheap size test first).
    const int32_t lo = trie_.first_item(s.pos), hi = trie_.items_end(s.pos);
    if (hi - lo <= used->size() && used->CountIn(lo, hi) == hi - lo) return kDeadStep;
  }
  return s;
}

bool ChoiceConstraint::Accepting(Position p, const std::vector<int32_t>& used) const {
  if (!IsTrieNode(p.pos) || p.left != 0 || !trie_.terminal(p.pos)) return false;
  return !distinct_ || !std::binary_search(used.begin(), used.end(), trie_.first_item(p.pos));
}

int64_t ChoiceConstraint::Distance(Position p, const UsedSet* used) const {
  if (used != nullptr) return DistinctDistance(p, *used);
  const auto sep_len = static_cast<int64_t>(separator_.size());
  const int64_t unit = sep_len + min_item_len_;
  if (IsTrieNode(p.pos)) return trie_.nearest(p.pos) + p.left * unit;
  const int64_t matched = p.pos - trie_.num_nodes();
  return (sep_len - matched) + min_item_len_ + (p.left - 1) * unit;
}

// Shortest completion of a distinct list: finish the current item with some unused item y
// below the node, then the `left` shortest unused items other than y.
int64_t ChoiceConstraint::DistinctDistance(Position p, const UsedSet& used) const {
  thread_local std::vector<int32_t> top, excluded;
  const auto sep_len = static_cast<int64_t>(separator_.size());
  const bool in_item = IsTrieNode(p.pos);
  // The shortest unused items: `left` of them, plus one spare in case y is among them.
  const size_t want = static_cast<size_t>(p.left) + (in_item ? 1 : 0);
  top.clear();
  for (size_t i = 0; i < by_length_.size() && top.size() < want; ++i)
    if (!used.Contains(by_length_[i])) top.push_back(by_length_[i]);
  int64_t shortest_rest = 0;  // total length of the `left` shortest
  for (int32_t i = 0; i < p.left; ++i) shortest_rest += trie_.item_len(top[static_cast<size_t>(i)]);
  if (!in_item) {
    const int64_t matched = p.pos - trie_.num_nodes();
    return (sep_len - matched) + shortest_rest + (p.left - 1) * sep_len;
  }
  const int32_t lo = trie_.first_item(p.pos), hi = trie_.items_end(p.pos);
  excluded.clear();
  used.AppendInto(&excluded, lo, hi);
  int64_t best = kUnreachable;
  for (int32_t i = 0; i < p.left; ++i) {
    const int32_t t = top[static_cast<size_t>(i)];
    if (t < lo || t >= hi) continue;
    excluded.push_back(t);
    // y = t: the spare replaces it among the rest.
    best = std::min(best, shortest_rest + trie_.item_len(top.back()));
  }
  const int32_t other = MinLengthExcluding(lo, hi, &excluded);
  if (other != INT32_MAX) best = std::min(best, other + shortest_rest);
  if (best == kUnreachable) return kUnreachable;
  return best - trie_.depth(p.pos) + p.left * sep_len;
}

// Shortest item length among ranks [lo, hi) minus `excluded` (unsorted; sorted here).
int32_t ChoiceConstraint::MinLengthExcluding(int32_t lo, int32_t hi, std::vector<int32_t>* excluded) const {
  std::sort(excluded->begin(), excluded->end());
  const auto range_min = [&](int32_t a, int32_t b) {
    int32_t best = INT32_MAX;
    for (int32_t l = a + tree_leaves_, r = b + tree_leaves_; l < r; l >>= 1, r >>= 1) {
      if (l & 1) best = std::min<int32_t>(best, length_tree_[static_cast<size_t>(l++)]);
      if (r & 1) best = std::min<int32_t>(best, length_tree_[static_cast<size_t>(--r)]);
    }
    return best;
  };
  int32_t best = INT32_MAX;
  int32_t from = lo;
  for (int32_t e : *excluded) {
    if (e > from) best = std::min(best, range_min(from, e));
    from = std::max(from, e + 1);
  }
  if (from < hi) best = std::min(best, range_min(from, hi));
  return best;
}

int64_t ChoiceConstraint::ShortestUnusedBound(int32_t m, int32_t u) const {
  if (!distinct_) return int64_t{m} * min_item_len_;  // repeats allowed: the shortest item m times
  // Of the m + u shortest items at least m are unused, and they are no longer than the m
  // longest of those.
  return shortest_prefix_[static_cast<size_t>(m + u)] - shortest_prefix_[static_cast<size_t>(u)];
}

int64_t ChoiceConstraint::DistanceBound(Position p) const {
  const auto sep = static_cast<int64_t>(separator_.size());
  // Landing inside a separator with m items to go after it, or in an item (`finish` bytes at
  // most from its end) with m items to go after it.
  const auto in_separator = [&](int32_t m) { return sep + ShortestUnusedBound(m, k_ - m) + (m - 1) * sep; };
  const auto in_item = [&](int64_t finish, int32_t m) {
    return finish + ShortestUnusedBound(m, k_ - 1 - m) + m * sep;
  };
  int64_t bound = IsTrieNode(p.pos) ? in_item(trie_.deepest(p.pos) - trie_.depth(p.pos), p.left)
                                    : in_separator(p.left);
  // Tokens that cross a separator (both bounds grow with m, so the next item bounds the rest).
  if (p.left > 0) bound = std::max({bound, in_separator(p.left), in_item(max_item_len_, p.left - 1)});
  return bound;
}

void ChoiceConstraint::Walk(Position p, const std::vector<int32_t>* used, int64_t limit, uint32_t* out,
                            int64_t* max_landing) const {
  const VocabTrie& vtrie = vocab().trie();
  // Per-thread scratch: allocated once per thread (the batch masker's threads persist).
  thread_local std::vector<Step> path;
  thread_local std::vector<int32_t> local;
  const auto depth_slots = static_cast<size_t>(vtrie.max_depth()) + 1;
  if (path.size() < depth_slots) {
    path.resize(depth_slots);
    local.resize(depth_slots);
  }
  std::optional<UsedSet> view;
  if (used != nullptr) view.emplace(*used, local.data());
  std::memset(out, 0, static_cast<size_t>(vocab().num_words()) * 4);
  // Distances matter when the budget may cut tokens, or when the caller wants the maximum.
  const bool need_distance = max_landing != nullptr || limit < DistanceBound(p);
  const VocabTrie::Node* nodes = vtrie.nodes();
  const int32_t* token_ids = vtrie.token_ids();
  path[0] = {p.pos, p.left, -1, 0};
  int64_t max_d = 0;
  for (int32_t i = 0; i < vtrie.num_nodes();) {
    const VocabTrie::Node& node = nodes[i];
    const Step s = Next(path[node.depth - 1], node.byte, view ? &*view : nullptr);
    if (s.pos < 0) {
      i = node.skip;
      continue;
    }
    path[node.depth] = s;
    const int32_t last = nodes[i + 1].token_begin;
    if (node.token_begin != last) {
      int64_t d = 0;
      if (need_distance) {
        if (view) view->num_local = s.local;
        d = Distance({s.pos, s.left}, view ? &*view : nullptr);
      }
      if (d <= limit) {
        max_d = std::max(max_d, d);
        for (int32_t k = node.token_begin; k < last; ++k) out[token_ids[k] >> 5] |= 1u << (token_ids[k] & 31);
      }
    }
    ++i;
  }
  if (max_landing != nullptr) *max_landing = max_d;
}

std::shared_ptr<const CachedMask> ChoiceConstraint::BaseMask(Position p, int64_t limit) const {
  const Position capped{p.pos, std::min(p.left, left_cap_)};
  auto base = cache_.GetOrCompute(
      (static_cast<uint64_t>(p.pos) << 32) | static_cast<uint32_t>(capped.left), [&](CachedMask* m) {
        Walk(capped, nullptr, kNoLimit, m->words.data(), &m->max_landing_distance);
        if (IsTrieNode(p.pos) && trie_.terminal(p.pos) && capped.left == 0) SetEosBits(vocab(), m->words.data());
      });
  // Distances grow by one list unit per separator beyond the cap.
  const int64_t offset = int64_t{p.left - capped.left} * (static_cast<int64_t>(separator_.size()) + min_item_len_);
  return limit >= base->max_landing_distance + offset ? base : nullptr;
}

void ChoiceConstraint::RemoveRepeats(Position p, const std::vector<int32_t>& used, uint32_t* out) const {
  const VocabTrie& vtrie = vocab().trie();
  thread_local std::vector<Step> path;
  thread_local std::vector<int32_t> local;
  const auto depth_slots = static_cast<size_t>(vtrie.max_depth()) + 1;
  if (path.size() < depth_slots) {
    path.resize(depth_slots);
    local.resize(depth_slots);
  }
  UsedSet view(used, local.data());
  const VocabTrie::Node* nodes = vtrie.nodes();
  const int32_t* token_ids = vtrie.token_ids();
  path[0] = {p.pos, p.left, -1, 0};
  for (int32_t i = 0; i < vtrie.num_nodes();) {
    const VocabTrie::Node& node = nodes[i];
    const Step& from = path[node.depth - 1];
    const Step s = Next(from, node.byte, &view);
    if (s.pos < 0) {
      // Dead only because of the distinct rules: every token below is a repeat.
      if (Next(from, node.byte, nullptr).pos >= 0) {
        for (int32_t k = node.token_begin; k < nodes[node.skip].token_begin; ++k)
          out[token_ids[k] >> 5] &= ~(1u << (token_ids[k] & 31));
      }
      i = node.skip;
      continue;
    }
    path[node.depth] = s;
    if (IsTrieNode(s.pos) && !separator_below_[static_cast<size_t>(i)]) {
      // Below here tokens stay inside this item: only used items under it could matter.
      view.num_local = s.local;
      if (view.CountIn(trie_.first_item(s.pos), trie_.items_end(s.pos)) == 0) {
        i = node.skip;
        continue;
      }
    }
    ++i;
  }
}

const uint32_t* ChoiceConstraint::Mask(Position p, const std::vector<int32_t>& used, int64_t limit,
                                       uint32_t* scratch, std::shared_ptr<const CachedMask>* hold) const {
  const bool accepting = Accepting(p, used);
  const size_t bytes = static_cast<size_t>(vocab().num_words()) * 4;
  if (limit < 0) {  // only EOS fits in the budget
    std::memset(scratch, 0, bytes);
    if (accepting) SetEosBits(vocab(), scratch);
    return scratch;
  }
  if (!distinct_) {
    if (auto base = BaseMask(p, limit)) {
      *hold = std::move(base);
      return (*hold)->words.data();
    }
    Walk(p, nullptr, limit, scratch, nullptr);
  } else if (limit >= DistanceBound(p)) {
    // The budget cannot cut: the cached non-distinct mask minus the repeats.
    std::memcpy(scratch, BaseMask(p, kNoLimit)->words.data(), bytes);
    RemoveRepeats(p, used, scratch);
    for (int32_t id : vocab().eos_ids()) scratch[id >> 5] &= ~(1u << (id & 31));
  } else {
    Walk(p, &used, limit, scratch, nullptr);
  }
  if (accepting) SetEosBits(vocab(), scratch);
  return scratch;
}

bool ChoiceConstraint::Advance(std::string_view bytes, int64_t limit, Position* p,
                               std::vector<int32_t>* used) const {
  thread_local std::vector<int32_t> local;
  if (local.size() < bytes.size()) local.resize(bytes.size());
  std::optional<UsedSet> view;
  if (distinct_) view.emplace(*used, local.data());
  Step s{p->pos, p->left, -1, 0};
  for (char c : bytes) {
    s = Next(s, static_cast<uint8_t>(c), view ? &*view : nullptr);
    if (s.pos < 0) return false;
  }
  if (view) view->num_local = s.local;
  if (Distance({s.pos, s.left}, view ? &*view : nullptr) > limit) return false;
  *p = {s.pos, s.left};
  for (int32_t i = 0; i < s.local; ++i)
    used->insert(std::upper_bound(used->begin(), used->end(), local[static_cast<size_t>(i)]),
                 local[static_cast<size_t>(i)]);
  return true;
}

int64_t ChoiceConstraint::min_tokens() const {
  const std::vector<int32_t> none;
  std::optional<UsedSet> view;
  if (distinct_) view.emplace(none, nullptr);
  return Distance(start(), view ? &*view : nullptr) + 1;
}

ConstraintStats ChoiceConstraint::stats() const {
  const int64_t separator_states = separator_.empty() ? 0 : static_cast<int64_t>(separator_.size()) - 1;
  return {distinct_ ? "choice_distinct" : "choice", trie_.num_nodes() + separator_states, min_tokens(),
          cache_.stats()};
}

std::unique_ptr<State> ChoiceConstraint::MakeState(std::optional<int64_t> max_tokens) const {
  return std::make_unique<ChoiceState>(std::static_pointer_cast<const ChoiceConstraint>(shared_from_this()),
                                       max_tokens);
}

}  // namespace paved::constraints

#include "cc/constraints/constraint.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "cc/constraints/regex_ast.h"

namespace paved::constraints {
namespace {

// Walks the vocabulary trie alongside `dfa` from `start`, calling
// on_tokens(dfa_state, first, last) for each trie node that ends tokens
// (token_ids[first, last)) reached without dying. Dead prefixes prune their whole subtree.
template <typename OnTokens>
void WalkTrie(const VocabTrie& trie, const Dfa& dfa, int32_t start, OnTokens on_tokens) {
  // Per-thread scratch: the batch masker's threads are persistent, so this allocates once.
  thread_local std::vector<int32_t> path;
  if (path.size() < static_cast<size_t>(trie.max_depth()) + 1) path.resize(static_cast<size_t>(trie.max_depth()) + 1);
  const VocabTrie::Node* nodes = trie.nodes();
  const int32_t n = trie.num_nodes();
  const int32_t* transitions = dfa.transitions.data();
  const uint8_t* byte_class = dfa.byte_class.data();
  const auto num_classes = static_cast<size_t>(dfa.num_classes);
  int32_t* stack = path.data();
  stack[0] = start;
  for (int32_t i = 0; i < n;) {
    const VocabTrie::Node& node = nodes[i];
    const int32_t from = stack[node.depth - 1];
    const int32_t to = transitions[static_cast<size_t>(from) * num_classes + byte_class[node.byte]];
    if (to < 0) {
      i = node.skip;
      continue;
    }
    stack[node.depth] = to;
    const int32_t last = nodes[i + 1].token_begin;
    if (node.token_begin != last) on_tokens(to, node.token_begin, last);
    ++i;
  }
}

// Backward BFS from the accepting states over `preds` (unit-length edges).
std::vector<int32_t> DistancesToAcceptance(const std::vector<std::vector<int32_t>>& preds,
                                           const std::vector<uint8_t>& accepting) {
  std::vector<int32_t> distance(preds.size(), kUnreachable);
  std::vector<int32_t> queue;
  for (size_t s = 0; s < preds.size(); ++s) {
    if (accepting[s]) {
      distance[s] = 0;
      queue.push_back(static_cast<int32_t>(s));
    }
  }
  for (size_t i = 0; i < queue.size(); ++i) {
    const int32_t s = queue[i];
    for (int32_t p : preds[static_cast<size_t>(s)]) {
      if (distance[static_cast<size_t>(p)] == kUnreachable) {
        distance[static_cast<size_t>(p)] = distance[static_cast<size_t>(s)] + 1;
        queue.push_back(p);
      }
    }
  }
  return distance;
}

uint64_t MaskKey(int32_t state, int64_t limit) {
  // limit code 0 is the unrestricted mask; a restricted one is only built for a limit below
  // the state's max_landing_distance, which fits in 31 bits.
  const uint64_t code = limit >= kNoLimit ? 0 : static_cast<uint64_t>(limit) + 1;
  return (static_cast<uint64_t>(state) << 32) | code;
}

class DfaState final : public State {
 public:
  DfaState(std::shared_ptr<const DfaConstraint> c, std::optional<int64_t> max_tokens)
      : State(c, max_tokens), c_(c.get()), state_(c->dfa().start) {}

 protected:
  bool Accepting() const override { return c_->dfa().accepting[static_cast<size_t>(state_)] != 0; }
  const uint32_t* AutomatonMask(int64_t limit, uint32_t* scratch,
                                std::shared_ptr<const CachedMask>* hold) const override {
    return c_->Mask(state_, limit, scratch, hold);
  }
  bool AdvanceBytes(std::string_view bytes, int64_t limit) override {
    const int32_t next = c_->dfa().Walk(state_, bytes);
    if (next < 0 || c_->distance(next) == kUnreachable || c_->distance(next) > limit) return false;
    state_ = next;
    return true;
  }
  void ResetAutomaton() override { state_ = c_->dfa().start; }

 private:
  const DfaConstraint* c_;  // kept alive by State::constraint_
  int32_t state_;
};

}  // namespace

void SetEosBits(const Vocab& vocab, uint32_t* words) {
  for (int32_t id : vocab.eos_ids()) words[id >> 5] |= 1u << (id & 31);
}

std::unique_ptr<State> Constraint::NewState(std::optional<int64_t> max_tokens) const {
  if (max_tokens && *max_tokens < min_tokens())
    throw ConstraintError("max_tokens=" + std::to_string(*max_tokens) +
                          " is too small for this constraint: its shortest output takes " +
                          std::to_string(min_tokens()) + " tokens including EOS");
  return MakeState(max_tokens);
}

bool State::Advance(int32_t token) {
  const Vocab& v = vocab();
  if (token < 0 || token >= v.size())
    throw ConstraintError("token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                          std::to_string(v.size()) + ")");
  if (finished_) return v.is_eos(token);
  if (v.is_eos(token)) {
    if (!Accepting()) return false;
    finished_ = true;
    ++num_generated_;
    return true;
  }
  const std::string& bytes = v.token(token);
  if (bytes.empty() || !AdvanceBytes(bytes, LandingLimit())) return false;
  ++num_generated_;
  return true;
}

void State::Reset() {
  ResetAutomaton();
  num_generated_ = 0;
  finished_ = false;
}

const uint32_t* State::Mask(uint32_t* scratch, std::shared_ptr<const CachedMask>* hold) const {
  if (finished_) {
    std::memset(scratch, 0, static_cast<size_t>(vocab().num_words()) * 4);
    SetEosBits(vocab(), scratch);
    return scratch;
  }
  return AutomatonMask(LandingLimit(), scratch, hold);
}

void State::FillMask(uint32_t* out) const {
  std::shared_ptr<const CachedMask> hold;
  const uint32_t* mask = Mask(out, &hold);
  if (mask != out) std::memcpy(out, mask, static_cast<size_t>(vocab().num_words()) * 4);
}

std::vector<int32_t> State::AllowedTokens() const {
  std::vector<uint32_t> words(static_cast<size_t>(vocab().num_words()));
  FillMask(words.data());
  std::vector<int32_t> out;
  for (size_t w = 0; w < words.size(); ++w) {
    for (uint32_t bits = words[w]; bits != 0; bits &= bits - 1)
      out.push_back(static_cast<int32_t>(w * 32 + static_cast<size_t>(__builtin_ctz(bits))));
  }
  return out;
}

DfaConstraint::DfaConstraint(std::shared_ptr<const Vocab> vocab, Dfa dfa, std::string kind, size_t cache_bytes)
    : Constraint(std::move(vocab)),
      dfa_(std::move(dfa)),
      kind_(std::move(kind)),
      cache_(this->vocab().num_words(), cache_bytes),
      pinned_(new std::atomic<const CachedMask*>[static_cast<size_t>(dfa_.num_states)]) {
  for (int32_t s = 0; s < dfa_.num_states; ++s) pinned_[static_cast<size_t>(s)].store(nullptr, std::memory_order_relaxed);
  ComputeDistances();
  if (distance_[static_cast<size_t>(dfa_.start)] == kUnreachable)
    throw ConstraintError("no sequence of this vocabulary's tokens satisfies the " + kind_ + " constraint");
}

void DfaConstraint::ComputeDistances() {
  const auto N = static_cast<size_t>(dfa_.num_states);
  const auto C = static_cast<size_t>(dfa_.num_classes);
  // Classes in which some byte is a token by itself: those edges are one token long.
  std::vector<uint8_t> one_token(C, 0);
  for (int b = 0; b < 256; ++b)
    if (vocab().has_byte_token(static_cast<uint8_t>(b))) one_token[dfa_.byte_class[static_cast<size_t>(b)]] = 1;
  std::vector<std::vector<int32_t>> preds(N);
  for (size_t s = 0; s < N; ++s) {
    for (size_t c = 0; c < C; ++c) {
      const int32_t t = dfa_.transitions[s * C + c];
      if (t >= 0 && one_token[c]) preds[static_cast<size_t>(t)].push_back(static_cast<int32_t>(s));
    }
  }
  distance_ = DistancesToAcceptance(preds, dfa_.accepting);
  // Every DFA state reaches acceptance byte by byte; where single-byte tokens cannot, use exact
  // token-level distances instead. One trie walk per state (O(states x trie), at compile time,
  // only for vocabularies lacking single-byte tokens) collects the states its tokens lead to.
  if (std::find(distance_.begin(), distance_.end(), kUnreachable) == distance_.end()) return;
  for (auto& p : preds) p.clear();
  std::vector<int32_t> seen(N, -1);
  for (size_t s = 0; s < N; ++s) {
    const auto from = static_cast<int32_t>(s);
    WalkTrie(vocab().trie(), dfa_, from, [&](int32_t to, int32_t, int32_t) {
      if (seen[static_cast<size_t>(to)] == from) return;
      seen[static_cast<size_t>(to)] = from;
      preds[static_cast<size_t>(to)].push_back(from);
    });
  }
  distance_ = DistancesToAcceptance(preds, dfa_.accepting);
}

void DfaConstraint::BuildMask(int32_t state, int64_t limit, CachedMask* out) const {
  uint32_t* words = out->words.data();
  const int32_t* token_ids = vocab().trie().token_ids();
  const int32_t* distance = distance_.data();
  int64_t max_landing = 0;
  WalkTrie(vocab().trie(), dfa_, state, [&](int32_t to, int32_t first, int32_t last) {
    const int32_t d = distance[to];
    if (d > limit) return;  // also drops kUnreachable states
    max_landing = std::max<int64_t>(max_landing, d);
    for (int32_t k = first; k < last; ++k) words[token_ids[k] >> 5] |= 1u << (token_ids[k] & 31);
  });
  if (dfa_.accepting[static_cast<size_t>(state)]) SetEosBits(vocab(), words);
  out->max_landing_distance = max_landing;
}

const uint32_t* DfaConstraint::Mask(int32_t state, int64_t limit, uint32_t* scratch,
                                    std::shared_ptr<const CachedMask>* hold) const {
  // The unrestricted mask: pinned (lock-free, no hold needed: it lives as long as *this), or
  // through the cache, which pins it if the pinned half has room.
  std::shared_ptr<const CachedMask> held;
  const CachedMask* full = pinned_[static_cast<size_t>(state)].load(std::memory_order_acquire);
  if (full == nullptr) {
    bool pinned = false;
    held = cache_.GetOrCompute(
        MaskKey(state, kNoLimit), [&](CachedMask* m) { BuildMask(state, kUnreachable - 1, m); }, &pinned);
    full = held.get();
    // Release: a reader that sees the pointer sees the finished mask.
    if (pinned) pinned_[static_cast<size_t>(state)].store(full, std::memory_order_release);
  }
  if (limit >= full->max_landing_distance) {
    if (held) *hold = std::move(held);
    return full->words.data();
  }
  if (limit < 0) {  // only EOS fits in the budget
    std::memset(scratch, 0, static_cast<size_t>(vocab().num_words()) * 4);
    if (dfa_.accepting[static_cast<size_t>(state)]) SetEosBits(vocab(), scratch);
    return scratch;
  }
  *hold = cache_.GetOrCompute(MaskKey(state, limit), [&](CachedMask* m) { BuildMask(state, limit, m); });
  return (*hold)->words.data();
}

ConstraintStats DfaConstraint::stats() const {
  return {kind_, dfa_.num_states, min_tokens(), cache_.stats()};
}

std::unique_ptr<State> DfaConstraint::MakeState(std::optional<int64_t> max_tokens) const {
  return std::make_unique<DfaState>(std::static_pointer_cast<const DfaConstraint>(shared_from_this()),
                                    max_tokens);
}

}  // namespace paved::constraints

// Compiled constraints (immutable, shared across requests) and their per-request states.
//
// A constraint is a byte-level automaton bound to a vocabulary. A state allows a token iff the
// token's bytes keep the automaton alive AND, after the token, an accepting state followed by
// EOS is still reachable within the request's remaining token budget (max_tokens). EOS is
// allowed only in accepting states. Distances to acceptance are counted in single-byte tokens:
// an upper bound of the true token distance that some token path always achieves, so a
// request that follows the masks always ends with EOS in an accepting state before its budget
// runs out. While the budget is far away the cached mask of the automaton state is used as is.
#ifndef PAVED_CC_CONSTRAINTS_CONSTRAINT_H_
#define PAVED_CC_CONSTRAINTS_CONSTRAINT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cc/constraints/dfa.h"
#include "cc/constraints/limits.h"
#include "cc/constraints/mask_cache.h"
#include "cc/constraints/vocab.h"

namespace paved::constraints {

// Distance of a state from which acceptance cannot be reached with this vocabulary.
constexpr int32_t kUnreachable = std::numeric_limits<int32_t>::max();
// Landing limit of a request without max_tokens.
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max() / 4;

struct ConstraintStats {
  std::string kind;
  int64_t automaton_states;
  int64_t min_tokens;
  MaskCache::Stats cache;
};

class State;

class Constraint : public std::enable_shared_from_this<Constraint> {
 public:
  explicit Constraint(std::shared_ptr<const Vocab> vocab) : vocab_(std::move(vocab)) {}
  virtual ~Constraint() = default;
  Constraint(const Constraint&) = delete;
  Constraint& operator=(const Constraint&) = delete;

  const Vocab& vocab() const { return *vocab_; }
  // Fewest tokens, EOS included, of a complete output.
  virtual int64_t min_tokens() const = 0;
  virtual ConstraintStats stats() const = 0;
  // A fresh per-request state. Throws ConstraintError if max_tokens < min_tokens().
  std::unique_ptr<State> NewState(std::optional<int64_t> max_tokens) const;

 protected:
  virtual std::unique_ptr<State> MakeState(std::optional<int64_t> max_tokens) const = 0;

 private:
  std::shared_ptr<const Vocab> vocab_;
};

// Per-request state. Not thread-safe to mutate; const methods may run concurrently.
class State {
 public:
  virtual ~State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Consumes `token` if it is allowed, else returns false and leaves the state unchanged.
  // Throws ConstraintError for ids outside the vocabulary.
  bool Advance(int32_t token);
  // Back to the start with nothing generated (preemption replays the tokens).
  void Reset();

  bool is_accepting() const { return Accepting(); }
  bool is_finished() const { return finished_; }
  int64_t num_generated() const { return num_generated_; }
  std::optional<int64_t> max_tokens() const { return max_tokens_; }
  const Vocab& vocab() const { return constraint_->vocab(); }

  // The allowed-token mask (vocab().num_words() words): a cached mask, kept alive by *hold or
  // (pinned masks, *hold left empty) by the constraint, or `scratch` filled in. Allocation-free
  // once the automaton state's mask is cached.
  const uint32_t* Mask(uint32_t* scratch, std::shared_ptr<const CachedMask>* hold) const;
  void FillMask(uint32_t* out) const;
  std::vector<int32_t> AllowedTokens() const;

 protected:
  State(std::shared_ptr<const Constraint> constraint, std::optional<int64_t> max_tokens)
      : constraint_(std::move(constraint)), max_tokens_(max_tokens) {}

  virtual bool Accepting() const = 0;
  // Mask of the automaton state (EOS bits included when accepting) where a token is allowed
  // only if the state it leads to is at most `limit` tokens from acceptance.
  virtual const uint32_t* AutomatonMask(int64_t limit, uint32_t* scratch,
                                        std::shared_ptr<const CachedMask>* hold) const = 0;
  // Consumes an ordinary token's bytes under the same rule as AutomatonMask.
  virtual bool AdvanceBytes(std::string_view bytes, int64_t limit) = 0;
  virtual void ResetAutomaton() = 0;

 private:
  // Budget left for the state a token leads to: the rest, minus that token and the final EOS.
  int64_t LandingLimit() const {
    return max_tokens_ ? *max_tokens_ - num_generated_ - 2 : kNoLimit;
  }

  std::shared_ptr<const Constraint> constraint_;
  std::optional<int64_t> max_tokens_;
  int64_t num_generated_ = 0;
  bool finished_ = false;
};

// Sets the bits of the vocabulary's EOS ids.
void SetEosBits(const Vocab& vocab, uint32_t* words);

// A regular constraint (regex, JSON Schema): a minimal DFA and per-state distances.
class DfaConstraint final : public Constraint {
 public:
  // Throws ConstraintError if no token sequence of `vocab` is accepted. `cache_bytes` bounds
  // the mask cache (tests pass a small one to exercise eviction).
  DfaConstraint(std::shared_ptr<const Vocab> vocab, Dfa dfa, std::string kind,
                size_t cache_bytes = kMaskCacheBytes);

  int64_t min_tokens() const override { return int64_t{distance_[static_cast<size_t>(dfa_.start)]} + 1; }
  ConstraintStats stats() const override;

  const Dfa& dfa() const { return dfa_; }
  int32_t distance(int32_t state) const { return distance_[static_cast<size_t>(state)]; }
  // See State::AutomatonMask.
  const uint32_t* Mask(int32_t state, int64_t limit, uint32_t* scratch,
                       std::shared_ptr<const CachedMask>* hold) const;

 protected:
  std::unique_ptr<State> MakeState(std::optional<int64_t> max_tokens) const override;

 private:
  void ComputeDistances();
  void BuildMask(int32_t state, int64_t limit, CachedMask* out) const;

  Dfa dfa_;
  std::string kind_;
  // Tokens to acceptance: via single-byte tokens, or exact token-level BFS when single-byte
  // tokens do not reach acceptance from every state (vocabularies missing some byte tokens).
  std::vector<int32_t> distance_;
  mutable MaskCache cache_;
  // Per DFA state, its unrestricted mask once pinned in cache_ (null before): the steady-state
  // lookup is one acquire load, with no lock and no reference count, so pool threads reading
  // the same masks do not bounce a mutex or a shared_ptr control block between cores. Pinned
  // masks are never evicted while the constraint lives, which is what makes the raw pointer
  // safe; states beyond the pinned half of the cache take the locked path.
  std::unique_ptr<std::atomic<const CachedMask*>[]> pinned_;
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_CONSTRAINT_H_

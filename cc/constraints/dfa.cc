#include "cc/constraints/dfa.h"

#include <algorithm>
#include <bitset>
#include <map>
#include <tuple>
#include <string>
#include <unordered_map>
#include <utility>

#include "cc/constraints/limits.h"

namespace paved::constraints {
namespace {

// Thompson NFA: every state has one byte-range edge, or up to two epsilon edges.
struct Nfa {
  enum Kind : uint8_t { kEpsilon, kSplit, kRange, kMatch };
  struct State {
    Kind kind;
    uint8_t lo;
    uint8_t hi;
    int32_t out;
    int32_t out2;
  };
  std::vector<State> states;
  int32_t start = 0;
};

using ByteSequence = std::vector<std::pair<uint8_t, uint8_t>>;

// Splits the scalar range [lo, hi] into sequences of byte ranges whose concatenations encode
// exactly that range in UTF-8 (the classic algorithm from RE2 / utf8-ranges).
void Utf8Sequences(uint32_t lo, uint32_t hi, std::vector<ByteSequence>* out) {
  if (lo > hi) return;
  for (uint32_t boundary : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= boundary && boundary < hi) {
      Utf8Sequences(lo, boundary, out);
      Utf8Sequences(boundary + 1, hi, out);
      return;
    }
  }
  if (hi < 0x80) {
    out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  for (int i = 1; i < 4; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Utf8Sequences(lo, lo | m, out);
        Utf8Sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Utf8Sequences(lo, (hi & ~m) - 1, out);
        Utf8Sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  AppendUtf8(lo, &a);
  AppendUtf8(hi, &b);
  ByteSequence seq;
  for (size_t i = 0; i < a.size(); ++i)
    seq.emplace_back(static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i]));
  out->push_back(std::move(seq));
}

class NfaBuilder {
 public:
  explicit NfaBuilder(const Ast& ast) : ast_(ast) {}

  Nfa Build(int root) {
    const Frag f = BuildNode(root);
    const int32_t match = NewState(Nfa::kMatch);
    Patch(f, match);
    nfa_.start = f.start;
    return std::move(nfa_);
  }

 private:
  // A sub-automaton from `start` to `end`, an epsilon state whose `out` is not yet set.
  struct Frag {
    int32_t start;
    int32_t end;
  };

  int32_t NewState(Nfa::Kind kind, uint8_t lo = 0, uint8_t hi = 0, int32_t out = -1,
                   int32_t out2 = -1) {
    if (static_cast<int64_t>(nfa_.states.size()) >= kMaxNfaStates)
      throw ConstraintError("constraint is too large: its automaton exceeds " +
                            std::to_string(kMaxNfaStates) + " NFA states");
    nfa_.states.push_back({kind, lo, hi, out, out2});
    return static_cast<int32_t>(nfa_.states.size() - 1);
  }
  void Patch(Frag f, int32_t target) { nfa_.states[static_cast<size_t>(f.end)].out = target; }

  Frag BuildNode(int id) {
    const Ast::Node& n = ast_.node(id);
    switch (n.kind) {
      case Ast::Kind::kEmpty: {
        const int32_t s = NewState(Nfa::kEpsilon);
        return {s, s};
      }
      case Ast::Kind::kBytes: {
        const int32_t end = NewState(Nfa::kEpsilon);
        int32_t next = end;
        for (size_t i = n.bytes.size(); i-- > 0;) {
          const auto b = static_cast<uint8_t>(n.bytes[i]);
          next = NewState(Nfa::kRange, b, b, next);
        }
        return {next, end};
      }
      case Ast::Kind::kChars:
        return BuildChars(n.chars);
      case Ast::Kind::kConcat: {
        Frag whole = BuildNode(n.children[0]);
        for (size_t i = 1; i < n.children.size(); ++i) {
          const Frag next = BuildNode(n.children[i]);
          Patch(whole, next.start);
          whole.end = next.end;
        }
        return whole;
      }
      case Ast::Kind::kAlt: {
        std::vector<Frag> branches;
        branches.reserve(n.children.size());
        for (int child : n.children) branches.push_back(BuildNode(child));
        return Join(branches);
      }
      case Ast::Kind::kRepeat:
        return BuildRepeat(n.children[0], n.children.size() > 1 ? n.children[1] : -1, n.min, n.max);
      case Ast::Kind::kSubsequence:
        return BuildSubsequence(n);
    }
    throw std::logic_error("unknown Ast node kind");
  }

  // Alternation of already-built fragments into one fragment with a common end.
  Frag Join(const std::vector<Frag>& branches) {
    const int32_t end = NewState(Nfa::kEpsilon);
    if (branches.empty()) return {NewState(Nfa::kEpsilon), end};  // matches nothing
    int32_t start = branches.back().start;
    Patch(branches.back(), end);
    for (size_t i = branches.size() - 1; i-- > 0;) {
      Patch(branches[i], end);
      start = NewState(Nfa::kSplit, 0, 0, branches[i].start, start);
    }
    return {start, end};
  }

  Frag BuildChars(const CharSet& chars) {
    std::vector<ByteSequence> sequences;
    for (const CharSet::Range& r : chars.ranges()) Utf8Sequences(r.lo, r.hi, &sequences);
    // Sequences are built from their last byte, sharing identical tails (e.g. every 3-byte
    // character ends in [80-BF][80-BF]): fewer NFA states and far fewer raw DFA states.
    const int32_t end = NewState(Nfa::kEpsilon);
    std::map<std::tuple<uint8_t, uint8_t, int32_t>, int32_t> tails;
    std::vector<int32_t> firsts;
    firsts.reserve(sequences.size());
    for (const ByteSequence& seq : sequences) {
      int32_t next = end;
      for (size_t i = seq.size(); i-- > 1;) {
        const auto key = std::make_tuple(seq[i].first, seq[i].second, next);
        auto it = tails.find(key);
        if (it == tails.end()) it = tails.emplace(key, NewState(Nfa::kRange, seq[i].first, seq[i].second, next)).first;
        next = it->second;
      }
      firsts.push_back(NewState(Nfa::kRange, seq[0].first, seq[0].second, next));
    }
    const int32_t start = NewState(Nfa::kEpsilon);
    FanOut(start, firsts);
    return {start, end};
  }

  // `child` repeated [min, max] times, with `separator` (if >= 0) between repetitions.
  Frag BuildRepeat(int child, int separator, int min, int max) {
    if (min == 0 && max != 0) {
      const Frag some = BuildRepeat(child, separator, 1, max);
      const int32_t none = NewState(Nfa::kEpsilon);
      return Join({some, {none, none}});
    }
    Frag whole{NewState(Nfa::kEpsilon), -1};
    whole.end = whole.start;
    const auto append = [&](Frag next) {
      Patch(whole, next.start);
      whole.end = next.end;
    };
    const auto append_separator = [&] {
      if (separator >= 0) append(BuildNode(separator));
    };
    int32_t last_start = -1;  // start of the last mandatory repetition
    for (int i = 0; i < min; ++i) {
      if (i > 0) append_separator();
      const Frag body = BuildNode(child);
      last_start = body.start;
      append(body);
    }
    if (max == Ast::kUnbounded) {
      // Loop back into the last repetition (through a separator): one instance serves them all.
      const int32_t end = NewState(Nfa::kEpsilon);
      int32_t again = last_start;
      if (separator >= 0) {
        const Frag sep = BuildNode(separator);
        Patch(sep, last_start);
        again = sep.start;
      }
      const int32_t loop = NewState(Nfa::kSplit, 0, 0, again, end);
      append({loop, end});
    } else if (max > min) {
      // Nested optionals x(x(x)?)? keep the NFA linear and the DFA small.
      const int32_t end = NewState(Nfa::kEpsilon);
      int32_t tail = end;
      for (int i = 0; i < max - min; ++i) {
        Frag body = BuildNode(child);
        Patch(body, tail);
        if (separator >= 0) {
          const Frag sep = BuildNode(separator);
          Patch(sep, body.start);
          body.start = sep.start;
        }
        tail = NewState(Nfa::kSplit, 0, 0, body.start, end);
      }
      append({tail, end});
    }
    return whole;
  }

  // Epsilon edges from `from` to every state of `targets`, as a chain of splits.
  void FanOut(int32_t from, const std::vector<int32_t>& targets) {
    if (targets.empty()) return;
    int32_t next = targets.back();
    for (size_t i = targets.size() - 1; i-- > 0;) next = NewState(Nfa::kSplit, 0, 0, targets[i], next);
    nfa_.states[static_cast<size_t>(from)].out = next;
  }

  // One instance of each member, entered from the start (no separator) or from the end of an
  // earlier member (through one separator instance per member), skipping only optional ones.
  Frag BuildSubsequence(const Ast::Node& n) {
    const size_t count = n.children.size() - 1;
    const int separator = n.children.back();
    const int32_t start = NewState(Nfa::kEpsilon);
    const int32_t end = NewState(Nfa::kEpsilon);
    std::vector<int32_t> entry(count), exit(count);
    for (size_t i = 0; i < count; ++i) {
      const Frag member = BuildNode(n.children[i]);
      entry[i] = member.start;
      exit[i] = NewState(Nfa::kEpsilon);
      Patch(member, exit[i]);
    }
    // Members reachable next after member `last` (count for the start): every following one
    // up to and including the first required one; `end` too if none is required.
    const auto successors = [&](size_t first) {
      std::vector<int32_t> out;
      size_t i = first;
      for (; i < count; ++i) {
        out.push_back(entry[i]);
        if (n.required[i]) break;
      }
      return std::pair<std::vector<int32_t>, bool>(out, i == count);
    };
    {
      auto [next, may_end] = successors(0);
      if (may_end) next.push_back(end);
      FanOut(start, next);
    }
    for (size_t j = 0; j < count; ++j) {
      auto [next, may_end] = successors(j + 1);
      std::vector<int32_t> targets;
      if (!next.empty()) {
        const Frag sep = BuildNode(separator);
        const int32_t after_sep = NewState(Nfa::kEpsilon);
        Patch(sep, after_sep);
        FanOut(after_sep, next);
        targets.push_back(sep.start);
      }
      if (may_end) targets.push_back(end);
      FanOut(exit[j], targets);
    }
    return {start, end};
  }

  const Ast& ast_;
  Nfa nfa_;
};

struct VectorHash {
  size_t operator()(const std::vector<int32_t>& v) const {
    uint64_t h = 1469598103934665603ull;
    for (int32_t x : v) h = (h ^ static_cast<uint32_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// Subset construction over byte classes.
class Determinizer {
 public:
  explicit Determinizer(const Nfa& nfa) : nfa_(nfa), stamp_(nfa.states.size(), 0) {}

  Dfa Run() {
    ComputeByteClasses();
    const auto C = static_cast<size_t>(dfa_.num_classes);
    std::vector<std::vector<int32_t>> buckets(C);
    if (Intern(Closure({nfa_.start})) == Dfa::kDead) throw ConstraintError("the constraint matches no output at all");
    for (size_t d = 0; d < sets_.size(); ++d) {
      for (auto& b : buckets) b.clear();
      for (int32_t s : sets_[d]) {
        const Nfa::State& st = nfa_.states[static_cast<size_t>(s)];
        if (st.kind != Nfa::kRange) continue;
        Spend(dfa_.byte_class[st.hi] - dfa_.byte_class[st.lo] + 1);
        for (int c = dfa_.byte_class[st.lo]; c <= dfa_.byte_class[st.hi]; ++c)
          buckets[static_cast<size_t>(c)].push_back(st.out);
      }
      for (size_t c = 0; c < C; ++c) {
        int32_t target;
        if (buckets[c].empty()) {
          target = Dfa::kDead;
        } else if (c > 0 && buckets[c] == buckets[c - 1]) {
          target = dfa_.transitions[d * C + c - 1];  // neighbouring classes often agree
        } else {
          target = Intern(Closure(buckets[c]));
        }
        // Intern may grow transitions, so the slot is indexed only now.
        dfa_.transitions[d * C + c] = target;
      }
    }
    dfa_.num_states = static_cast<int32_t>(sets_.size());
    dfa_.start = 0;
    return std::move(dfa_);
  }

 private:
  void ComputeByteClasses() {
    std::bitset<257> boundary;
    for (const Nfa::State& st : nfa_.states) {
      if (st.kind != Nfa::kRange) continue;
      boundary.set(st.lo);
      boundary.set(static_cast<size_t>(st.hi) + 1);
    }
    int cls = 0;
    for (int b = 0; b < 256; ++b) {
      if (b > 0 && boundary.test(static_cast<size_t>(b))) ++cls;
      dfa_.byte_class[static_cast<size_t>(b)] = static_cast<uint8_t>(cls);
    }
    dfa_.num_classes = cls + 1;
  }

  // Counts `steps` of subset-construction work (closure steps, transitions gathered) against
  // kMaxDeterminizeSteps.
  void Spend(int64_t steps) {
    work_ += steps;
    if (work_ > kMaxDeterminizeSteps)
      throw ConstraintError("constraint is too large: building its DFA exceeds " +
                            std::to_string(kMaxDeterminizeSteps) + " steps");
  }

  // Epsilon closure, keeping only the states that matter for identity: range and match states.
  std::vector<int32_t> Closure(const std::vector<int32_t>& seeds) {
    ++generation_;
    std::vector<int32_t> out;
    stack_.assign(seeds.begin(), seeds.end());
    while (!stack_.empty()) {
      const int32_t s = stack_.back();
      stack_.pop_back();
      if (s < 0 || stamp_[static_cast<size_t>(s)] == generation_) continue;
      stamp_[static_cast<size_t>(s)] = generation_;
      Spend(1);
      const Nfa::State& st = nfa_.states[static_cast<size_t>(s)];
      switch (st.kind) {
        case Nfa::kRange:
        case Nfa::kMatch:
          out.push_back(s);
          break;
        case Nfa::kSplit:
          stack_.push_back(st.out2);
          [[fallthrough]];
        case Nfa::kEpsilon:
          stack_.push_back(st.out);
          break;
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  int32_t Intern(std::vector<int32_t> set) {
    if (set.empty()) return Dfa::kDead;
    auto it = ids_.find(set);
    if (it != ids_.end()) return it->second;
    if (static_cast<int64_t>(sets_.size()) >= kMaxDfaStates)
      throw ConstraintError("constraint is too large: its DFA exceeds " + std::to_string(kMaxDfaStates) +
                            " states");
    subset_entries_ += static_cast<int64_t>(set.size());
    if (subset_entries_ > kMaxSubsetEntries)
      throw ConstraintError("constraint is too large: building its DFA exceeds " +
                            std::to_string(kMaxSubsetEntries) + " NFA states in its subsets");
    const auto id = static_cast<int32_t>(sets_.size());
    bool accepting = false;
    for (int32_t s : set) accepting |= nfa_.states[static_cast<size_t>(s)].kind == Nfa::kMatch;
    dfa_.accepting.push_back(accepting ? 1 : 0);
    dfa_.transitions.resize(dfa_.transitions.size() + static_cast<size_t>(dfa_.num_classes), Dfa::kDead);
    ids_.emplace(set, id);
    sets_.push_back(std::move(set));
    return id;
  }

  const Nfa& nfa_;
  Dfa dfa_;
  std::vector<std::vector<int32_t>> sets_;
  std::unordered_map<std::vector<int32_t>, int32_t, VectorHash> ids_;
  std::vector<uint32_t> stamp_;
  uint32_t generation_ = 0;
  std::vector<int32_t> stack_;
  int64_t subset_entries_ = 0;
  int64_t work_ = 0;
};

// Keeps the states that can reach acceptance (others become kDead) and renumbers the rest in
// BFS order from the start state. `class_of` maps old states to new ones; states mapped to the
// same value are merged (used by minimization). Returns false if the start state is dead.
bool Rebuild(const Dfa& in, const std::vector<int32_t>& class_of, int32_t num_class_ids, Dfa* out) {
  const auto C = static_cast<size_t>(in.num_classes);
  std::vector<int32_t> rep(static_cast<size_t>(num_class_ids), -1);
  for (int32_t s = 0; s < in.num_states; ++s) {
    const int32_t k = class_of[static_cast<size_t>(s)];
    if (k >= 0 && rep[static_cast<size_t>(k)] < 0) rep[static_cast<size_t>(k)] = s;
  }
  const int32_t start_class = class_of[static_cast<size_t>(in.start)];
  if (start_class < 0) return false;
  std::vector<int32_t> new_id(static_cast<size_t>(num_class_ids), -1);
  std::vector<int32_t> order{start_class};
  new_id[static_cast<size_t>(start_class)] = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const int32_t s = rep[static_cast<size_t>(order[i])];
    for (size_t c = 0; c < C; ++c) {
      const int32_t t = in.transitions[static_cast<size_t>(s) * C + c];
      if (t < 0) continue;
      const int32_t k = class_of[static_cast<size_t>(t)];
      if (k >= 0 && new_id[static_cast<size_t>(k)] < 0) {
        new_id[static_cast<size_t>(k)] = static_cast<int32_t>(order.size());
        order.push_back(k);
      }
    }
  }
  out->num_classes = in.num_classes;
  out->byte_class = in.byte_class;
  out->num_states = static_cast<int32_t>(order.size());
  out->start = 0;
  out->transitions.assign(order.size() * C, Dfa::kDead);
  out->accepting.assign(order.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) {
    const int32_t s = rep[static_cast<size_t>(order[i])];
    out->accepting[i] = in.accepting[static_cast<size_t>(s)];
    for (size_t c = 0; c < C; ++c) {
      const int32_t t = in.transitions[static_cast<size_t>(s) * C + c];
      const int32_t k = t < 0 ? -1 : class_of[static_cast<size_t>(t)];
      out->transitions[i * C + c] = k < 0 ? Dfa::kDead : new_id[static_cast<size_t>(k)];
    }
  }
  return true;
}

// States that can reach an accepting state keep their id; the others map to -1.
std::vector<int32_t> CoaccessibleIds(const Dfa& dfa) {
  const auto N = static_cast<size_t>(dfa.num_states);
  const auto C = static_cast<size_t>(dfa.num_classes);
  std::vector<std::vector<int32_t>> preds(N);
  for (size_t s = 0; s < N; ++s) {
    for (size_t c = 0; c < C; ++c) {
      const int32_t t = dfa.transitions[s * C + c];
      if (t >= 0) preds[static_cast<size_t>(t)].push_back(static_cast<int32_t>(s));
    }
  }
  std::vector<int32_t> ids(N, -1);
  std::vector<int32_t> queue;
  for (size_t s = 0; s < N; ++s) {
    if (dfa.accepting[s]) {
      ids[s] = static_cast<int32_t>(s);
      queue.push_back(static_cast<int32_t>(s));
    }
  }
  for (size_t i = 0; i < queue.size(); ++i) {
    for (int32_t p : preds[static_cast<size_t>(queue[i])]) {
      if (ids[static_cast<size_t>(p)] < 0) {
        ids[static_cast<size_t>(p)] = p;
        queue.push_back(p);
      }
    }
  }
  return ids;
}

// Hopcroft's partition refinement on the completed DFA (a sink stands for kDead). Returns the
// block of every state; the sink's block maps to -1. Blocks are refined by the predecessors of
// each splitter block under every class; of the two halves of a split block the smaller one is
// queued, which gives O(classes * n log n).
std::vector<int32_t> MinimalClasses(const Dfa& dfa, int32_t* num_blocks) {
  const auto n = static_cast<size_t>(dfa.num_states);
  const size_t N = n + 1;  // + sink
  const size_t sink = n;
  const auto C = static_cast<size_t>(dfa.num_classes);
  const auto target = [&](size_t s, size_t c) -> size_t {
    if (s == sink) return sink;
    const int32_t t = dfa.transitions[s * C + c];
    return t < 0 ? sink : static_cast<size_t>(t);
  };

  // Predecessors per (class, target) in CSR form.
  std::vector<uint32_t> inv_start(C * (N + 1) + 1, 0);
  for (size_t s = 0; s < N; ++s)
    for (size_t c = 0; c < C; ++c) ++inv_start[c * (N + 1) + target(s, c) + 1];
  for (size_t i = 1; i < inv_start.size(); ++i) inv_start[i] += inv_start[i - 1];
  std::vector<uint32_t> inv_src(N * C);
  {
    std::vector<uint32_t> fill(inv_start.begin(), inv_start.end() - 1);
    for (size_t s = 0; s < N; ++s)
      for (size_t c = 0; c < C; ++c) inv_src[fill[c * (N + 1) + target(s, c)]++] = static_cast<uint32_t>(s);
  }

  // Refinable partition: elems grouped by block; marked elements of a block sit at its front.
  std::vector<uint32_t> elems(N), loc(N), block(N);
  std::vector<uint32_t> first, end, mid;
  {
    size_t k = 0;
    for (int pass = 0; pass < 2; ++pass) {
      const size_t begin = k;
      for (size_t s = 0; s < N; ++s) {
        const bool acc = s < n && dfa.accepting[s];
        if (acc == (pass == 0)) {
          elems[k] = static_cast<uint32_t>(s);
          loc[s] = static_cast<uint32_t>(k);
          block[s] = static_cast<uint32_t>(first.size());
          ++k;
        }
      }
      if (k > begin) {
        first.push_back(static_cast<uint32_t>(begin));
        end.push_back(static_cast<uint32_t>(k));
        mid.push_back(static_cast<uint32_t>(begin));
      }
    }
  }
  std::vector<uint32_t> worklist;
  for (uint32_t b = 0; b < first.size(); ++b) worklist.push_back(b);

  std::vector<uint32_t> splitter, touched;
  while (!worklist.empty()) {
    const uint32_t a = worklist.back();
    worklist.pop_back();
    splitter.assign(elems.begin() + first[a], elems.begin() + end[a]);
    for (size_t c = 0; c < C; ++c) {
      touched.clear();
      for (uint32_t t : splitter) {
        const size_t base = c * (N + 1) + t;
        for (uint32_t i = inv_start[base]; i < inv_start[base + 1]; ++i) {
          const uint32_t s = inv_src[i];
          const uint32_t b = block[s];
          if (loc[s] < mid[b]) continue;  // already marked
          if (mid[b] == first[b]) touched.push_back(b);
          const uint32_t other = elems[mid[b]];
          std::swap(elems[loc[s]], elems[mid[b]]);
          loc[other] = loc[s];
          loc[s] = mid[b];
          ++mid[b];
        }
      }
      for (uint32_t b : touched) {
        const uint32_t marked = mid[b] - first[b];
        const uint32_t unmarked = end[b] - mid[b];
        if (unmarked == 0) {
          mid[b] = first[b];
          continue;
        }
        // The smaller half becomes the new block (cheaper relabeling) and is queued; if b was
        // already queued, both halves end up queued.
        const auto nb = static_cast<uint32_t>(first.size());
        if (marked <= unmarked) {
          first.push_back(first[b]);
          end.push_back(mid[b]);
          first[b] = mid[b];
        } else {
          first.push_back(mid[b]);
          end.push_back(end[b]);
          end[b] = mid[b];
        }
        mid.push_back(first[nb]);
        mid[b] = first[b];
        for (uint32_t i = first[nb]; i < end[nb]; ++i) block[elems[i]] = nb;
        worklist.push_back(nb);
      }
    }
  }
  const uint32_t sink_block = block[sink];
  std::vector<int32_t> result(n);
  for (size_t s = 0; s < n; ++s)
    result[s] = block[s] == sink_block ? -1 : static_cast<int32_t>(block[s]);
  *num_blocks = static_cast<int32_t>(first.size());
  return result;
}

}  // namespace

int32_t Dfa::Walk(int32_t state, std::string_view bytes) const {
  for (char ch : bytes) {
    if (state < 0) break;
    state = Next(state, static_cast<uint8_t>(ch));
  }
  return state;
}

bool Dfa::Matches(std::string_view bytes) const {
  const int32_t s = Walk(start, bytes);
  return s >= 0 && accepting[static_cast<size_t>(s)] != 0;
}

Dfa CompileDfa(const Ast& ast, int root) {
  const Nfa nfa = NfaBuilder(ast).Build(root);
  const Dfa raw = Determinizer(nfa).Run();
  Dfa trimmed;
  if (!Rebuild(raw, CoaccessibleIds(raw), raw.num_states, &trimmed))
    throw ConstraintError("the constraint matches no output at all");
  int32_t num_blocks = 0;
  const std::vector<int32_t> blocks = MinimalClasses(trimmed, &num_blocks);
  Dfa minimal;
  Rebuild(trimmed, blocks, num_blocks, &minimal);
  return minimal;
}

}  // namespace paved::constraints

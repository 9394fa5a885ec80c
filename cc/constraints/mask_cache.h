// Bounded cache of allowed-token masks, shared by all requests of one compiled constraint.
#ifndef PAVED_CC_CONSTRAINTS_MASK_CACHE_H_
#define PAVED_CC_CONSTRAINTS_MASK_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cc/constraints/limits.h"

namespace paved::constraints {

struct CachedMask {
  std::vector<uint32_t> words;
  // Largest distance to acceptance (in tokens) among the states the allowed tokens lead to:
  // the mask stays exact as long as the remaining budget leaves room for that distance.
  int64_t max_landing_distance = 0;
};

// Masks are immutable and handed out as shared_ptr, so a reader can copy one while another
// thread evicts it. The cache holds at most `capacity` masks (`max_bytes` worth, at least
// kMinCachedMasks); inserting beyond that evicts the least recently used one. Eviction scans
// the cache, but only happens on a miss, which already costs a full vocabulary walk.
//
// Pinning: up to half the capacity may hold masks inserted with `pin` requested; those are
// never evicted while the cache lives, so their owner may keep a raw pointer and read it
// without the lock or a reference count (see DfaConstraint: the steady-state row of a batch
// then touches no shared cache line for writing). Pinned masks count toward the capacity, so
// the memory bound is unchanged; they only shrink the LRU part (to at least half).
class MaskCache {
 public:
  struct Stats {
    size_t entries;
    size_t capacity;
    size_t bytes;
    size_t pinned;
    uint64_t hits;  // lookups through Find(); reads of pinned masks by raw pointer are not counted
    uint64_t misses;
    uint64_t evictions;
  };

  explicit MaskCache(int32_t num_words, size_t max_bytes = kMaskCacheBytes);

  std::shared_ptr<const CachedMask> Find(uint64_t key);
  // Returns the cached mask for `key`: `mask` if newly inserted, or the one another thread
  // inserted first. With `pinned` non-null the mask is pinned if the pinned half has room, and
  // *pinned says whether this call pinned it (then the returned mask lives as long as the cache).
  std::shared_ptr<const CachedMask> Insert(uint64_t key, std::shared_ptr<const CachedMask> mask,
                                           bool* pinned = nullptr);

  template <typename Compute>
  std::shared_ptr<const CachedMask> GetOrCompute(uint64_t key, Compute compute, bool* pinned = nullptr) {
    if (pinned != nullptr) *pinned = false;
    if (auto hit = Find(key)) return hit;
    auto mask = std::make_shared<CachedMask>();
    mask->words.assign(static_cast<size_t>(num_words_), 0);
    compute(mask.get());
    return Insert(key, std::move(mask), pinned);
  }

  size_t capacity() const { return capacity_; }
  Stats stats() const;

 private:
  struct Slot {
    std::shared_ptr<const CachedMask> mask;
    uint64_t last_use;
    bool pinned;
  };

  const int32_t num_words_;
  const size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Slot> slots_;
  size_t pinned_ = 0;
  uint64_t clock_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_MASK_CACHE_H_

// Bounded cache of allowed-token masks, shared by all requests of one compiled constraint.
#ifndef PAVED_CC_CONSTRAINTS_MASK_CACHE_H_
#define PAVED_CC_CONSTRAINTS_MASK_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace paved::constraints {

struct CachedMask {
  std::vector<uint32_t> words;
  // Largest distance to acceptance (in tokens) among the states the allowed tokens lead to:
  // the mask stays exact as long as the remaining budget leaves room for that distance.
  int64_t max_landing_distance = 0;
};

// Masks are immutable and handed out as shared_ptr, so a reader can copy one while another
// thread evicts it. The cache holds at most `capacity` masks (kMaskCacheBytes worth, at least
// kMinCachedMasks); inserting beyond that evicts the least recently used one. Eviction scans
// the cache, but only happens on a miss, which already costs a full vocabulary walk.
class MaskCache {
 public:
  struct Stats {
    size_t entries;
    size_t capacity;
    size_t bytes;
    uint64_t hits;
    uint64_t misses;
    uint64_t evictions;
  };

  explicit MaskCache(int32_t num_words);

  std::shared_ptr<const CachedMask> Find(uint64_t key);
  // Returns the cached mask for `key`: `mask` if newly inserted, or the one another thread
  // inserted first.
  std::shared_ptr<const CachedMask> Insert(uint64_t key, std::shared_ptr<const CachedMask> mask);

  template <typename Compute>
  std::shared_ptr<const CachedMask> GetOrCompute(uint64_t key, Compute compute) {
    if (auto hit = Find(key)) return hit;
    auto mask = std::make_shared<CachedMask>();
    mask->words.assign(static_cast<size_t>(num_words_), 0);
    compute(mask.get());
    return Insert(key, std::move(mask));
  }

  Stats stats() const;

 private:
  struct Slot {
    std::shared_ptr<const CachedMask> mask;
    uint64_t last_use;
  };

  const int32_t num_words_;
  const size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Slot> slots_;
  uint64_t clock_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace paved::constraints

#endif  // PAVED_CC_CONSTRAINTS_MASK_CACHE_H_

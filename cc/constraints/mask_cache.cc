#include "cc/constraints/mask_cache.h"

#include <algorithm>
#include <utility>

#include "cc/constraints/limits.h"

namespace paved::constraints {

MaskCache::MaskCache(int32_t num_words)
    : num_words_(num_words),
      capacity_(std::max(kMinCachedMasks, kMaskCacheBytes / (static_cast<size_t>(num_words) * 4))) {
  slots_.reserve(std::min<size_t>(capacity_, 4096));
}

std::shared_ptr<const CachedMask> MaskCache::Find(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    ++misses_;
    return nullptr;
  }
  ++hits_;
  it->second.last_use = ++clock_;
  return it->second.mask;
}

std::shared_ptr<const CachedMask> MaskCache::Insert(uint64_t key, std::shared_ptr<const CachedMask> mask) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  if (it != slots_.end()) return it->second.mask;
  if (slots_.size() >= capacity_) {
    auto oldest = std::min_element(slots_.begin(), slots_.end(), [](const auto& a, const auto& b) {
      return a.second.last_use < b.second.last_use;
    });
    slots_.erase(oldest);
    ++evictions_;
  }
  slots_.emplace(key, Slot{mask, ++clock_});
  return mask;
}

MaskCache::Stats MaskCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t bytes = slots_.size() * static_cast<size_t>(num_words_) * 4;
  return {slots_.size(), capacity_, bytes, hits_, misses_, evictions_};
}

}  // namespace paved::constraints

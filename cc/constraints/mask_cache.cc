#include "cc/constraints/mask_cache.h"

#include <algorithm>
#include <utility>

namespace paved::constraints {

MaskCache::MaskCache(int32_t num_words, size_t max_bytes)
    : num_words_(num_words),
      capacity_(std::max(kMinCachedMasks, max_bytes / (static_cast<size_t>(num_words) * 4))) {
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

std::shared_ptr<const CachedMask> MaskCache::Insert(uint64_t key, std::shared_ptr<const CachedMask> mask,
                                                    bool* pinned) {
  if (pinned != nullptr) *pinned = false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(key);
  if (it != slots_.end()) return it->second.mask;
  if (slots_.size() >= capacity_) {
    // The oldest unpinned mask; at most half the capacity is pinned, so there is one.
    auto oldest = slots_.end();
    for (auto s = slots_.begin(); s != slots_.end(); ++s) {
      if (!s->second.pinned && (oldest == slots_.end() || s->second.last_use < oldest->second.last_use)) oldest = s;
    }
    slots_.erase(oldest);
    ++evictions_;
  }
  const bool pin = pinned != nullptr && pinned_ < capacity_ / 2;
  slots_.emplace(key, Slot{mask, ++clock_, pin});
  if (pin) {
    ++pinned_;
    *pinned = true;
  }
  return mask;
}

MaskCache::Stats MaskCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t bytes = slots_.size() * static_cast<size_t>(num_words_) * 4;
  return {slots_.size(), capacity_, bytes, pinned_, hits_, misses_, evictions_};
}

}  // namespace paved::constraints

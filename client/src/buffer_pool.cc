#include "client/src/buffer_pool.h"

#include <utility>
#include <vector>

namespace mainstay::client_internal {

PooledBytes PooledBytes::Unpooled(size_t size) {
  PooledBytes out;
  out.bytes_.reset(new uint8_t[size]);  // default-initialized: not zero-filled
  out.size_ = size;
  return out;
}

PooledBytes& PooledBytes::operator=(PooledBytes&& other) noexcept {
  if (this != &other) {
    Release();
    bytes_ = std::move(other.bytes_);
    size_ = std::exchange(other.size_, 0);
    pool_ = std::move(other.pool_);
    other.pool_.reset();
  }
  return *this;
}

void PooledBytes::Release() {
  if (bytes_ == nullptr) return;
  if (std::shared_ptr<BufferPool> pool = pool_.lock()) {
    pool->Return(std::move(bytes_), size_);
  }
  bytes_.reset();
  size_ = 0;
  pool_.reset();
}

std::shared_ptr<BufferPool> BufferPool::Create(int64_t max_cached_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_cached_bytes));
}

PooledBytes BufferPool::Acquire(size_t size) {
  PooledBytes out;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {  // the most recently released first
      if (it->size != size) continue;
      out.bytes_ = std::move(it->bytes);
      free_.erase(std::next(it).base());
      cached_bytes_ -= static_cast<int64_t>(size);
      ++reuses_;
      break;
    }
  }
  if (out.bytes_ == nullptr) out = PooledBytes::Unpooled(size);
  out.size_ = size;
  out.pool_ = weak_from_this();
  return out;
}

void BufferPool::Return(std::unique_ptr<uint8_t[]> bytes, size_t size) {
  if (size == 0 || static_cast<int64_t>(size) > max_cached_bytes_) return;  // freed here
  std::vector<Free> evicted;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  while (!free_.empty() && cached_bytes_ + static_cast<int64_t>(size) > max_cached_bytes_) {
    cached_bytes_ -= static_cast<int64_t>(free_.front().size);
    evicted.push_back(std::move(free_.front()));
    free_.pop_front();
  }
  free_.push_back(Free{std::move(bytes), size});
  cached_bytes_ += static_cast<int64_t>(size);
}

int64_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

int64_t BufferPool::reuses() const {
  absl::MutexLock lock(&mu_);
  return reuses_;
}

}  // namespace mainstay::client_internal

// Reusable byte buffers for pulled buckets.
//
// A pull lands in a buffer the PulledBucket then owns. Allocating it afresh costs more than the
// transfer: a large allocation is new pages from the kernel, zero-filled on first touch (1.5 GB/s
// on the CI VM, against 5-15 GB/s for the copy itself; docs/benchmarks.md, Transports). A trainer
// pulls the same buckets every step, so a buffer released by the last copy of one version's
// PulledBucket goes back to the pool and the next pull of that size takes it.
//
// Ownership: PooledBytes owns its bytes and holds a weak reference to its pool; a buffer released
// after the pool is gone (the Client destroyed while a PulledBucket lives) is freed. The pool keeps
// at most `max_cached_bytes` of released buffers (the oldest go first) and frees them when it goes.
// Contents of an acquired buffer are unspecified: callers overwrite every byte before reading.
// Thread safety: Acquire and the release of PooledBytes may run concurrently from any threads.
#ifndef MAINSTAY_CLIENT_SRC_BUFFER_POOL_H_
#define MAINSTAY_CLIENT_SRC_BUFFER_POOL_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <span>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace mainstay::client_internal {

class BufferPool;

class PooledBytes {
 public:
  PooledBytes() = default;
  // A buffer of `size` bytes that belongs to no pool (freed on release).
  static PooledBytes Unpooled(size_t size);
  PooledBytes(PooledBytes&& other) noexcept { *this = std::move(other); }
  PooledBytes& operator=(PooledBytes&& other) noexcept;
  PooledBytes(const PooledBytes&) = delete;
  PooledBytes& operator=(const PooledBytes&) = delete;
  ~PooledBytes() { Release(); }

  uint8_t* data() const { return bytes_.get(); }
  size_t size() const { return size_; }
  std::span<uint8_t> span() const { return {bytes_.get(), size_}; }

 private:
  friend class BufferPool;
  void Release();

  std::unique_ptr<uint8_t[]> bytes_;
  size_t size_ = 0;
  std::weak_ptr<BufferPool> pool_;
};

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static std::shared_ptr<BufferPool> Create(int64_t max_cached_bytes);

  // A buffer of exactly `size` bytes: a released one of that size if the pool has one, else a
  // new allocation (not zero-filled).
  PooledBytes Acquire(size_t size);

  // For tests and metrics: bytes held for reuse, and how many Acquire calls reused a buffer.
  int64_t cached_bytes() const;
  int64_t reuses() const;

 private:
  friend class PooledBytes;
  explicit BufferPool(int64_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  void Return(std::unique_ptr<uint8_t[]> bytes, size_t size);

  struct Free {
    std::unique_ptr<uint8_t[]> bytes;
    size_t size = 0;
  };
  const int64_t max_cached_bytes_;
  mutable absl::Mutex mu_;
  std::deque<Free> free_ ABSL_GUARDED_BY(mu_);  // oldest release first
  int64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reuses_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mainstay::client_internal

#endif  // MAINSTAY_CLIENT_SRC_BUFFER_POOL_H_

// An array of shard state in the daemon's state memory (kernels/memory.h): masters, moments,
// and the buffers a step stages its kernels' inputs and outputs in on a GPU.
//
// Ownership: owns its block (a View owns nothing); move-only. The StateMemory must outlive it.
// Thread safety: none (like std::vector); the job's lock and step thread order the accesses.
// The elements are host-addressable (managed memory on CUDA); read them on the host only after
// the memory's Synchronize has seen the kernels that write them.
#ifndef MAINSTAY_SERVER_DAEMON_STATE_BUFFER_H_
#define MAINSTAY_SERVER_DAEMON_STATE_BUFFER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "common/status.h"
#include "kernels/memory.h"

namespace mainstay::daemon {

template <typename T>
class StateBuffer {
 public:
  StateBuffer() = default;
  StateBuffer(StateBuffer&& other) noexcept { swap(other); }
  StateBuffer& operator=(StateBuffer&& other) noexcept {
    StateBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~StateBuffer() {
    if (memory_ != nullptr) memory_->Free(data_);
  }

  // Replaces the contents with `n` zeroes from `memory` (n = 0: empty). RESOURCE_EXHAUSTED
  // when they do not fit; the buffer is then empty.
  absl::Status Reset(kernels::StateMemory& memory, int64_t n) {
    StateBuffer().swap(*this);
    if (n <= 0) return absl::OkStatus();
    MAINSTAY_ASSIGN_OR_RETURN(void* block, memory.Allocate(n * static_cast<int64_t>(sizeof(T))));
    memory_ = &memory;
    data_ = static_cast<T*>(block);
    size_ = static_cast<size_t>(n);
    return absl::OkStatus();
  }
  // Reset to values.size() elements, then a host copy of `values`.
  absl::Status Assign(kernels::StateMemory& memory, std::span<const T> values) {
    MAINSTAY_RETURN_IF_ERROR(Reset(memory, static_cast<int64_t>(values.size())));
    if (!values.empty()) std::memcpy(data_, values.data(), values.size_bytes());
    return absl::OkStatus();
  }
  // Frees the block.
  void clear() { StateBuffer().swap(*this); }

  // A view of `n` elements another buffer owns (a move's source streams its shard's own state):
  // frees nothing; the owner must outlive it and leave the elements unchanged meanwhile.
  static StateBuffer View(const T* data, size_t n) {
    StateBuffer view;
    view.data_ = const_cast<T*>(data);
    view.size_ = n;
    return view;
  }

  // Equal sizes and elements (==, as std::vector compares).
  friend bool operator==(const StateBuffer& a, const StateBuffer& b) {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }

  void swap(StateBuffer& other) noexcept {
    std::swap(memory_, other.memory_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* begin() { return data_; }
  T* end() { return data_ + size_; }
  const T* begin() const { return data_; }
  const T* end() const { return data_ + size_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  std::span<T> span() { return {data_, size_}; }
  std::span<const T> span() const { return {data_, size_}; }

 private:
  kernels::StateMemory* memory_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_STATE_BUFFER_H_

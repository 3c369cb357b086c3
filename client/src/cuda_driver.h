// Internal: what the client asks of the CUDA driver about the buffers handed to its pushes:
// where a buffer lives (the grpc and ucx transports read pushes with the CPU, so a device
// pointer must be refused before they touch it), and waiting for the CUDA work that produces a
// buffer (PushOptions::cuda_stream / cuda_event), and exporting a buffer's allocation for the
// cuda_ipc transport.
//
// The real driver is libcuda.so.1, loaded with dlopen on first use: the client needs no CUDA to
// build, and a process without a GPU, a driver or a CUDA context gets "host memory" for every
// pointer and creates no context. Tests substitute a fake (ScopedCudaDriverForTesting).
//
// Thread safety: every method may be called from any thread.
#ifndef MAINSTAY_CLIENT_SRC_CUDA_DRIVER_H_
#define MAINSTAY_CLIENT_SRC_CUDA_DRIVER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mainstay::client_internal {

// A point in a CUDA stream that a push waits for before it reads its buffer: an event, the
// context it belongs to, and what to do with the event once the push no longer needs it
// (`release`, null for a caller's event; run once, by the destructor). Move-only.
class PendingCudaWork {
 public:
  PendingCudaWork() = default;
  PendingCudaWork(void* event, void* context, void (*release)(void* event))
      : event_(event), context_(context), release_(release) {}
  PendingCudaWork(const PendingCudaWork&) = delete;
  PendingCudaWork& operator=(const PendingCudaWork&) = delete;
  PendingCudaWork(PendingCudaWork&& other) noexcept
      : event_(std::exchange(other.event_, nullptr)),
        context_(std::exchange(other.context_, nullptr)),
        release_(std::exchange(other.release_, nullptr)) {}
  PendingCudaWork& operator=(PendingCudaWork&& other) noexcept {
    if (this != &other) {
      Reset();
      event_ = std::exchange(other.event_, nullptr);
      context_ = std::exchange(other.context_, nullptr);
      release_ = std::exchange(other.release_, nullptr);
    }
    return *this;
  }
  ~PendingCudaWork() { Reset(); }

  bool empty() const { return event_ == nullptr; }
  void* event() const { return event_; }      // CUevent
  void* context() const { return context_; }  // CUcontext current where the push was made

 private:
  void Reset() {
    if (release_ != nullptr && event_ != nullptr) release_(event_);
    event_ = context_ = nullptr;
    release_ = nullptr;
  }
  void* event_ = nullptr;
  void* context_ = nullptr;
  void (*release_)(void* event) = nullptr;
};

class CudaDriver {
 public:
  virtual ~CudaDriver() = default;

  // The ordinal of the device whose memory holds `p`; nullopt for memory the CPU can read
  // (pageable, pinned or managed), or when the process has no CUDA driver or context.
  virtual std::optional<int> DeviceOf(const void* p) const = 0;

  // Called where the push is made (the caller's thread, whose current CUDA context is the one
  // `stream` / `event` belong to): what the push must wait for.
  //   event set: that event (the caller must not record it again before the push's handle is
  //     ready);
  //   else stream set (nullptr = the legacy default stream): the work enqueued on it so far, as
  //     a new event recorded on it now;
  //   neither: nothing (an empty PendingCudaWork).
  // FAILED_PRECONDITION when a stream or event is given and this process has no CUDA driver;
  // INTERNAL with the driver's error name when recording fails.
  virtual absl::StatusOr<PendingCudaWork> Capture(std::optional<void*> stream, void* event) const = 0;

  // Blocks until `work` completed (no-op when empty), from any thread. INTERNAL with the driver's
  // error name when the work failed (e.g. a kernel fault on that stream).
  virtual absl::Status Wait(PendingCudaWork work) const = 0;

  // The device allocation that holds `p`, as another process of this node maps it (the
  // cuda_ipc transport): its CUDA IPC memory handle (64 bytes), where `p` is in it, and its size.
  struct IpcRegion {
    std::string handle;
    uint64_t offset = 0;
    uint64_t allocation_bytes = 0;
  };
  // From any thread. FAILED_PRECONDITION when this process has no CUDA driver, or the memory
  // cannot be exported (e.g. virtual-memory allocations made without an IPC handle type, as
  // PyTorch's expandable segments are), with the driver's error name; INVALID_ARGUMENT when `p`
  // is not device memory. The default (test drivers): UNIMPLEMENTED.
  // OK when ExportIpc can work in this process; else why not (FAILED_PRECONDITION).
  virtual absl::Status CanExportIpc() const {
    return absl::UnimplementedError("this CUDA driver cannot export device memory");
  }
  virtual absl::StatusOr<IpcRegion> ExportIpc(const void* p) const {
    return absl::UnimplementedError("this CUDA driver cannot export device memory");
  }
};

// The driver the client's new Clients use: the process's libcuda, or the fake a test installed.
const CudaDriver& ClientCudaDriver();

// Installs `driver` for the Clients created while it lives (tests only; not thread-safe with
// Client creation on other threads).
class ScopedCudaDriverForTesting {
 public:
  explicit ScopedCudaDriverForTesting(const CudaDriver* driver);
  ~ScopedCudaDriverForTesting();
  ScopedCudaDriverForTesting(const ScopedCudaDriverForTesting&) = delete;
  ScopedCudaDriverForTesting& operator=(const ScopedCudaDriverForTesting&) = delete;

 private:
  const CudaDriver* previous_;
};

}  // namespace mainstay::client_internal

#endif  // MAINSTAY_CLIENT_SRC_CUDA_DRIVER_H_

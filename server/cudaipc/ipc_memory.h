// The outside boundary of the cuda_ipc transport's daemon end (docs/transports.md, CUDA IPC):
// opening the CUDA IPC memory handle of a trainer's allocation in this process, and copying out
// of it (pushes) and into it (pulls). MakeCudaIpcMemory is CUDA's (cudaIpcOpenMemHandle on the
// daemon's device); tests use a fake that resolves handles to host buffers.
//
// Thread safety: every method may be called from any thread, concurrently; a Mapping may be
// copied from concurrently and must not be used after Close.
#ifndef MAINSTAY_SERVER_CUDAIPC_IPC_MEMORY_H_
#define MAINSTAY_SERVER_CUDAIPC_IPC_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mainstay::daemon {

// Bytes of a CUDA IPC memory handle (CU_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

class IpcMemory {
 public:
  // An opened allocation: where it is mapped in this process, and its size in bytes.
  struct Mapping {
    void* base = nullptr;
    uint64_t bytes = 0;
  };
  virtual ~IpcMemory() = default;

  // The CUDA device ordinal the copies run on.
  virtual int device() const = 0;
  // Maps the allocation whose handle (kCudaIpcHandleBytes) is `handle`. FAILED_PRECONDITION with
  // CUDA's error when it cannot be opened here (an allocation of another node, of this very
  // process, already freed, or of a device this one has no peer access to).
  virtual absl::StatusOr<Mapping> Open(absl::string_view handle) = 0;
  // Copies `bytes` from `offset` of `mapping` into host memory at `dest` and returns when they
  // are there (on a stream of its own, unordered with the daemon's other work). The caller
  // checked the range. INTERNAL with CUDA's error on failure.
  virtual absl::Status CopyToHost(const Mapping& mapping, uint64_t offset, void* dest, uint64_t bytes) = 0;
  // Copies `bytes` from `src` (host memory, or this process's device or managed memory) to
  // `offset` of `mapping` and returns when they are there (as CopyToHost, the other way). The
  // caller checked the range. INTERNAL with CUDA's error on failure; the destination may then
  // hold part of the bytes.
  virtual absl::Status CopyIn(const Mapping& mapping, uint64_t offset, const void* src, uint64_t bytes) = 0;
  // Unmaps it. Must come before the trainer frees the allocation: CUDA leaves a mapping of freed
  // memory undefined.
  virtual void Close(const Mapping& mapping) = 0;
};

// CUDA's: handles opened on device `device` (peer access enabled lazily for allocations of other
// devices). UNIMPLEMENTED when built without CUDA; FAILED_PRECONDITION when the device is not
// there.
absl::StatusOr<std::unique_ptr<IpcMemory>> MakeCudaIpcMemory(int device);

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_CUDAIPC_IPC_MEMORY_H_

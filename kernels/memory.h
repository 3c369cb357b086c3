// Where a daemon keeps its shard state (masters, moments, the step's staged gradients and
// casts), and how bytes cross between the host and that memory: the device allocator behind
// `mainstayd --device`.
//
//   HostStateMemory(executor)  host memory; the CPU kernels read the host buffers directly.
//   CudaStateMemory(ordinal)   CUDA managed memory preferring device `ordinal`, and one stream
//                              of its own that every kernel, copy and Synchronize uses.
//   HostStateMemory(executor, /*staged=*/true)
//                              tests only: host memory that asks the daemon to stage every kernel
//                              input and output through it, as for a GPU, so CI runs the staging.
//
// Every allocation is readable and writable from the host (managed memory on CUDA migrates to
// whoever touches it), so checkpoints, moves and state fetches read it like host memory, after
// Synchronize. In the step, the kernels' pointers (gradients, state, amax and statistics outputs,
// cast outputs) must all come from this memory when `staged()`: host bytes come in and go out
// through Copy.
//
// Ownership: a StateMemory outlives every block it allocated (the daemon owns it).
// Thread safety: Allocate and Free may be called from any thread; Copy and Synchronize share
// one stream and are meant for the step thread (calls from several threads serialize, in no
// defined order).
// Errors: RESOURCE_EXHAUSTED when an allocation does not fit; INTERNAL for a CUDA failure,
// naming the call; FAILED_PRECONDITION from CudaStateMemory when the device is not there
// (the message says how many CUDA sees), UNIMPLEMENTED in a build without CUDA.
#ifndef MAINSTAY_KERNELS_MEMORY_H_
#define MAINSTAY_KERNELS_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kernels.h"

namespace mainstay::kernels {

class StateMemory {
 public:
  virtual ~StateMemory() = default;

  // The kernels' device for work on this memory.
  virtual const Device& device() const = 0;
  // True when the kernels need their inputs and outputs in this memory (a GPU, or the test
  // fake): the daemon then copies host bytes in and out with Copy.
  virtual bool staged() const = 0;
  // "cpu", "cuda:0 (NVIDIA H200, sm_90, 139 GiB)", for logs and the CLI.
  virtual std::string Describe() const = 0;
  // Bytes this memory offers for shard state: the device's free memory when it was opened
  // (what other processes, e.g. trainers on the same GPU, left), or the host's physical memory;
  // mainstayd's --memory-bytes defaults to 80% of it. Managed memory does not fail past the
  // device's memory (it pages out to the host, slowly): admission against --memory-bytes is
  // what keeps a GPU daemon inside it.
  virtual int64_t capacity_bytes() const = 0;

  // `bytes` (> 0) zeroed, 256-byte aligned. The zeroes are written before it returns, so the
  // pages exist when a step first uses them. RESOURCE_EXHAUSTED when out of memory.
  virtual absl::StatusOr<void*> Allocate(int64_t bytes) = 0;
  // A block from Allocate (null is ignored), once no enqueued work uses it any more.
  virtual void Free(void* block) = 0;
  // Copies `bytes` in stream order (host to this memory, back, or within it); done by the next
  // Synchronize (the host memory copies at once).
  virtual absl::Status Copy(void* dst, const void* src, int64_t bytes) = 0;
  // Waits for every kernel and copy enqueued on this memory's stream (kernels.h Synchronize).
  virtual absl::Status Synchronize() = 0;
};

// Host memory. `executor` (not owned, may be null: the calling thread) runs the CPU kernels.
std::unique_ptr<StateMemory> HostStateMemory(CpuExecutor* executor, bool staged = false);

// CUDA device `ordinal`: checks the device is there and runs code built for it, then creates
// the stream. FAILED_PRECONDITION naming the visible devices when it is not.
absl::StatusOr<std::unique_ptr<StateMemory>> CudaStateMemory(int ordinal);

}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_MEMORY_H_

// Private to kernels/cuda: what every CUDA backend call (FusedAdamW, Quantize, ...) shares with
// the other calls on its stream.
//
//   StreamCall call(stream, "Quantize mxfp8");
//   MAINSTAY_ASSIGN_OR_RETURN(void* scratch, call.Workspace(bytes));
//   SomeKernel<<<grid, threads, 0, call.stream()>>>(...);
//   MAINSTAY_RETURN_IF_ERROR(call.Launched("SomeKernel"));
//
// - One call at a time per stream: a StreamCall holds its stream's lock while it enqueues (host
//   time only; the kernels then run in stream order), so calls from several host threads that
//   share a stream never interleave their use of the workspace.
// - A persistent workspace per (device, stream) replaces an allocation per call: it grows
//   (cudaMallocAsync on the stream, the old buffer freed in stream order after the work that
//   uses it) when a call needs more than any call before, and is never shrunk; it is kept for
//   the life of the process (a daemon's every step reuses it). Its size is the largest single
//   call's scratch: per-CTA partial sums (2048 x 16 bytes) or one FP32 factor per scale block.
// - Kernel names: Launched checks the launch and records the kernel; when the call ends, its
//   name and kernels become the stream's "last call". An asynchronous fault (an illegal
//   address) surfaces later, at SynchronizeStream or at the next call's launch check, and both
//   name the call and kernels enqueued before it.
//
// Thread safety: StreamCall is used by one thread; SynchronizeStream may be called from any.
#ifndef MAINSTAY_KERNELS_CUDA_STREAM_CALL_H_
#define MAINSTAY_KERNELS_CUDA_STREAM_CALL_H_

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mainstay::kernels::cuda {

struct StreamEntry;  // stream_call.cc: one per (device, stream)

class StreamCall {
 public:
  // `what`: the call, as errors name it (e.g. "Quantize mxfp8"). Blocks while another call on
  // the same stream is enqueueing.
  StreamCall(cudaStream_t stream, std::string what);
  ~StreamCall();
  StreamCall(const StreamCall&) = delete;
  StreamCall& operator=(const StreamCall&) = delete;

  cudaStream_t stream() const { return stream_; }

  // `bytes` of device scratch, valid for the work this call enqueues (the next call on the
  // stream may reuse it). INTERNAL (naming the call) when growing the workspace fails.
  absl::StatusOr<void*> Workspace(size_t bytes);

  // After each launch: records `kernel` and checks cudaGetLastError. An error names this call,
  // the kernel, and the stream's previous call (whose kernels may be the ones that faulted).
  absl::Status Launched(const char* kernel);

  // Wraps a failed CUDA runtime call of this call (e.g. a cudaMemsetAsync) the same way.
  absl::Status Check(cudaError_t error, const char* what);

 private:
  std::string Describe(cudaError_t error, const std::string& where) const;

  cudaStream_t stream_;
  std::string what_;
  StreamEntry* entry_;
  std::unique_lock<std::mutex> lock_;
  std::vector<const char*> kernels_;
};

// cudaStreamSynchronize(stream); a failure is INTERNAL with CUDA's error and the last call's
// name and kernels on that stream (kernels.h Synchronize).
absl::Status SynchronizeStream(cudaStream_t stream);

}  // namespace mainstay::kernels::cuda

#endif  // MAINSTAY_KERNELS_CUDA_STREAM_CALL_H_

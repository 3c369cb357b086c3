// One end of a two-rank NCCL communicator between a trainer (rank 0) and a daemon (rank 1): the
// nccl transport's data path (docs/transports.md, NCCL), shared by the client library and
// mainstayd. Built only with CUDA and NCCL (MAINSTAY_HAVE_NCCL).
//
// A payload of n bytes moves as ceil(n / chunk_bytes) ncclSend/ncclRecv messages in order; both
// ends must use the same chunk_bytes (the trainer sends it when it opens the channel). Host memory
// is staged through two device buffers of chunk_bytes each, so copies and NCCL transfers overlap.
//
// Nothing here can hang on a dead peer: the communicator is created non-blocking
// (ncclConfig_t.blocking = 0) and every wait polls the CUDA stream, ncclCommGetAsyncError, the
// caller's deadline and its abort check; any failure aborts the communicator (ncclCommAbort) and
// leaves the link broken (every later call: UNAVAILABLE). The owner then drops it and opens a
// new one.
//
// Errors: UNAVAILABLE for a peer that went away (ncclRemoteError, ncclSystemError) or a broken
// link; DEADLINE_EXCEEDED when a wait outlives the deadline; FAILED_PRECONDITION when NCCL
// refuses the setup (ncclInvalidUsage, e.g. "Duplicate GPU detected": NCCL allows one rank per
// CUDA device and communicator, see NcclRefusesSharedDevice); RESOURCE_EXHAUSTED when device
// memory runs out; INTERNAL with NCCL's or CUDA's message otherwise. The abort check's own
// status is returned as it is (e.g. CANCELLED).
//
// Thread safety: one operation at a time per link (callers serialize); Break() from any thread.
#ifndef MAINSTAY_COMMON_NCCL_LINK_H_
#define MAINSTAY_COMMON_NCCL_LINK_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mainstay::nccl {

inline constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
inline constexpr int64_t kMinChunkBytes = 1 << 10;
inline constexpr int64_t kMaxChunkBytes = 64 << 20;

// The linked NCCL's version code (ncclGetVersion, e.g. 22809) and as text ("2.28.9").
int Version();
std::string VersionString(int code);

// Whether `status` (from Link::Connect) is NCCL refusing two ranks of one communicator on the
// same CUDA device: "Duplicate GPU detected" (NCCL 2.28.9, the version built against here, has
// no setting that allows it), or "Multiple Ranks are using the same GPU" (later releases, which
// allow it with their experimental NCCL_MULTI_RANK_GPU_ENABLE=1; docs/transports.md).
bool NcclRefusesSharedDevice(const absl::Status& status);

// Where `p` points: its CUDA device ordinal, or -1 for host memory (pageable, pinned or unknown
// to CUDA). Managed memory counts as on its device.
absl::StatusOr<int> DeviceOf(const void* p);

// The CUDA device current on the calling thread (cudaGetDevice); UNAVAILABLE without one.
absl::StatusOr<int> CurrentDevice();

// A fresh ncclUniqueId as kUniqueIdBytes bytes. Rank 0 calls it: it also starts listening for
// the other rank's bootstrap connection.
absl::StatusOr<std::string> NewUniqueId();

class Link {
 public:
  struct Options {
    int device = 0;               // CUDA device ordinal of this end
    int rank = 0;                 // 0: the trainer, 1: the daemon
    int64_t chunk_bytes = 1 << 20;  // [kMinChunkBytes, kMaxChunkBytes]
  };
  // Polled during every wait: a non-OK status ends the wait (and breaks the link) with it.
  using AbortCheck = std::function<absl::Status()>;

  // Joins the communicator named by `unique_id` (NewUniqueId's bytes, from rank 0), waits until
  // both ranks have joined, then exchanges one small message each way (which also sets up the
  // peer connections, so the first payload does not pay for them).
  static absl::StatusOr<std::unique_ptr<Link>> Connect(const Options& options, const std::string& unique_id,
                                                       absl::Time deadline, const AbortCheck& abort);
  ~Link();  // aborts the communicator (never waits for the peer)
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  int device() const { return options_.device; }
  int64_t chunk_bytes() const { return options_.chunk_bytes; }

  // Sends `bytes` bytes at `data` to the peer: device memory of this link's device is sent as
  // it is, host memory (DeviceOf < 0) is staged. INVALID_ARGUMENT for memory of another device.
  absl::Status Send(const void* data, int64_t bytes, absl::Time deadline, const AbortCheck& abort);
  // Receives `bytes` bytes from the peer into host memory at `out` (through the staging buffers).
  absl::Status RecvToHost(void* out, int64_t bytes, absl::Time deadline, const AbortCheck& abort);

  // A link whose operation failed, or that Break() marked, moves nothing more.
  bool broken() const { return broken_.load(); }
  // Marks the link broken from any thread: an operation in flight ends at its next poll with
  // UNAVAILABLE(`reason`) and aborts the communicator; the destructor aborts it otherwise.
  void Break(absl::string_view reason);

 private:
  explicit Link(const Options& options) : options_(options) {}

  absl::Status Init(const std::string& unique_id, absl::Time deadline, const AbortCheck& abort);
  absl::Status SendChunks(const void* data, int64_t bytes, absl::Time deadline, const AbortCheck& abort);
  absl::Status RecvChunks(void* out, int64_t bytes, absl::Time deadline, const AbortCheck& abort);
  absl::Status SendStaged(const uint8_t* data, int64_t bytes, absl::Time deadline, const AbortCheck& abort);
  // The result of a non-blocking NCCL call: ncclInProgress waits until the communicator is ready.
  absl::Status Issue(ncclResult_t result, absl::string_view call, absl::Time deadline, const AbortCheck& abort);
  // Waits until `event` completes (null: until the communicator is no longer in progress).
  absl::Status Wait(cudaEvent_t event, absl::string_view what, absl::Time deadline, const AbortCheck& abort);
  // Aborts the communicator after a failure and returns `status` annotated; the link is broken.
  absl::Status Fail(const absl::Status& status, absl::string_view what);
  absl::Status CheckUsable();

  const Options options_;
  ncclComm_t comm_ = nullptr;         // null once aborted
  cudaStream_t stream_ = nullptr;       // the NCCL operations
  cudaStream_t copy_stream_ = nullptr;  // the staging copies
  uint8_t* staging_[2] = {nullptr, nullptr};
  cudaEvent_t copied_[2] = {nullptr, nullptr};  // staging_[i] filled (host -> device)
  cudaEvent_t moved_[2] = {nullptr, nullptr};   // the NCCL transfer of staging_[i] done
  cudaEvent_t done_ = nullptr;                  // the last operation on stream_ done
  uint8_t* token_ = nullptr;                    // 16 bytes of device memory for the first exchange
  std::atomic<bool> broken_{false};
  std::atomic<bool> break_requested_{false};
  absl::Mutex mu_;
  std::string break_reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mainstay::nccl

#endif  // MAINSTAY_COMMON_NCCL_LINK_H_

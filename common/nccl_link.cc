#include "common/nccl_link.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace mainstay::nccl {
namespace {

constexpr int kPeer[2] = {1, 0};  // the other rank of a two-rank communicator

absl::Status CudaError(cudaError_t e, absl::string_view call) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(call, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInvalidDevice) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

#define MAINSTAY_NCCL_CUDA(call)                                            \
  do {                                                                      \
    if (absl::Status s_ = CudaError((call), #call); !s_.ok()) return s_;    \
  } while (0)

// An NCCL result as a Status, with NCCL's own text of the last error (which names the cause,
// e.g. "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000").
absl::Status NcclError(ncclResult_t r, ncclComm_t comm, absl::string_view call) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  std::string message = absl::StrCat(call, ": ", ncclGetErrorString(r));
  if (const char* last = ncclGetLastError(comm); last != nullptr && last[0] != '\0') {
    absl::StrAppend(&message, ": ", last);
  }
  switch (r) {
    case ncclRemoteError:  // the peer failed or went away
    case ncclSystemError:  // a socket or other system call failed: usually the same
      return absl::UnavailableError(message);
    case ncclInvalidUsage:  // a setup NCCL does not support; retrying does not help
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

// Sleeps a little longer each time: tight at first (transfers of a few chunks take
// microseconds), then at most a millisecond per poll.
class Backoff {
 public:
  void Pause() {
    if (++polls_ < 64) {
      std::this_thread::yield();
      return;
    }
    absl::SleepFor(sleep_);
    sleep_ = std::min(sleep_ * 2, absl::Milliseconds(1));
  }

 private:
  int polls_ = 0;
  absl::Duration sleep_ = absl::Microseconds(20);
};

}  // namespace

int Version() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return 0;
  return code;
}

std::string VersionString(int code) {
  // NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z from 2.9 on.
  if (code >= 10000) return absl::StrCat(code / 10000, ".", code / 100 % 100, ".", code % 100);
  return absl::StrCat(code / 1000, ".", code / 100 % 10, ".", code % 100);
}

bool NcclRefusesSharedDevice(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         (absl::StrContains(status.message(), "Duplicate GPU detected") ||
          absl::StrContains(status.message(), "same GPU"));
}

absl::StatusOr<int> DeviceOf(const void* p) {
  cudaPointerAttributes attributes{};
  const cudaError_t e = cudaPointerGetAttributes(&attributes, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return CudaError(e, "cudaPointerGetAttributes");
  }
  switch (attributes.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return attributes.device;
    default:
      return -1;
  }
}

absl::StatusOr<int> CurrentDevice() {
  int count = 0;
  MAINSTAY_NCCL_CUDA(cudaGetDeviceCount(&count));
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  int device = 0;
  MAINSTAY_NCCL_CUDA(cudaGetDevice(&device));
  return device;
}

absl::StatusOr<std::string> NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return NcclError(r, nullptr, "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<Link>> Link::Connect(const Options& options, const std::string& unique_id,
                                                    absl::Time deadline, const AbortCheck& abort) {
  if (options.rank != 0 && options.rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank: 0 or 1, got ", options.rank));
  }
  if (options.chunk_bytes < kMinChunkBytes || options.chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", options.chunk_bytes, " is not in [",
                                                   kMinChunkBytes, ", ", kMaxChunkBytes, "]"));
  }
  if (unique_id.size() != kUniqueIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("ncclUniqueId: ", kUniqueIdBytes, " bytes expected, got ", unique_id.size()));
  }
  std::unique_ptr<Link> link(new Link(options));
  absl::Status s = link->Init(unique_id, deadline, abort);
  if (!s.ok() && !link->broken()) s = link->Fail(s, "joining");
  if (!s.ok()) return s;
  return link;
}

absl::Status Link::Init(const std::string& unique_id, absl::Time deadline, const AbortCheck& abort) {
  MAINSTAY_NCCL_CUDA(cudaSetDevice(options_.device));
  // Everything local first: a device out of memory fails before the peer is involved.
  MAINSTAY_NCCL_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MAINSTAY_NCCL_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  for (int i = 0; i < 2; ++i) {
    MAINSTAY_NCCL_CUDA(cudaMalloc(reinterpret_cast<void**>(&staging_[i]), static_cast<size_t>(options_.chunk_bytes)));
    MAINSTAY_NCCL_CUDA(cudaEventCreateWithFlags(&copied_[i], cudaEventDisableTiming));
    MAINSTAY_NCCL_CUDA(cudaEventCreateWithFlags(&moved_[i], cudaEventDisableTiming));
  }
  MAINSTAY_NCCL_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  MAINSTAY_NCCL_CUDA(cudaMalloc(reinterpret_cast<void**>(&token_), 16));
  MAINSTAY_NCCL_CUDA(cudaMemsetAsync(token_, options_.rank + 1, 16, stream_));

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and operations return at once; we poll (and can abort)
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, 2, id, options_.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclError(r, comm_, "ncclCommInitRankConfig"), "joining");
  if (absl::Status s = Wait(nullptr, "joining the communicator", deadline, abort); !s.ok()) return s;

  // The first exchange: both directions at once, so neither end waits for the other.
  const int peer = kPeer[options_.rank];
  if (ncclResult_t g = ncclGroupStart(); g != ncclSuccess) return Fail(NcclError(g, comm_, "ncclGroupStart"), "greeting");
  const ncclResult_t sent = ncclSend(token_, 8, ncclUint8, peer, comm_, stream_);
  const ncclResult_t received = ncclRecv(token_ + 8, 8, ncclUint8, peer, comm_, stream_);
  const ncclResult_t ended = ncclGroupEnd();
  for (ncclResult_t each : {sent, received}) {
    if (each != ncclSuccess && each != ncclInProgress) {
      return Fail(NcclError(each, comm_, "ncclSend/ncclRecv"), "greeting");
    }
  }
  MAINSTAY_RETURN_IF_ERROR(Issue(ended, "ncclGroupEnd", deadline, abort));
  return Wait(done_, "the first exchange with the peer", deadline, abort);
}

Link::~Link() {
  cudaSetDevice(options_.device);
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // local: frees the communicator without waiting for the peer
    comm_ = nullptr;
  }
  for (cudaStream_t s : {stream_, copy_stream_}) {
    if (s != nullptr) {
      cudaStreamSynchronize(s);  // nothing may still use the staging buffers
      cudaStreamDestroy(s);
    }
  }
  for (int i = 0; i < 2; ++i) {
    if (staging_[i] != nullptr) cudaFree(staging_[i]);
    if (copied_[i] != nullptr) cudaEventDestroy(copied_[i]);
    if (moved_[i] != nullptr) cudaEventDestroy(moved_[i]);
  }
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (token_ != nullptr) cudaFree(token_);
}

void Link::Break(absl::string_view reason) {
  {
    absl::MutexLock lock(&mu_);
    if (break_reason_.empty()) break_reason_ = std::string(reason);
  }
  break_requested_.store(true);
}

absl::Status Link::CheckUsable() {
  if (!broken_.load() && !break_requested_.load()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return absl::UnavailableError(
      absl::StrCat("the NCCL channel is broken", break_reason_.empty() ? "" : ": ", break_reason_));
}

absl::Status Link::Fail(const absl::Status& status, absl::string_view what) {
  broken_.store(true);
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);  // NCCL's kernels on stream_ end; the syncs below then return
    comm_ = nullptr;
  }
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  cudaGetLastError();  // an aborted kernel may leave a non-sticky error behind
  return absl::Status(status.code(), absl::StrCat("NCCL ", what, ": ", status.message()));
}

absl::Status Link::Issue(ncclResult_t result, absl::string_view call, absl::Time deadline, const AbortCheck& abort) {
  if (result == ncclSuccess) return absl::OkStatus();
  if (result != ncclInProgress) return Fail(NcclError(result, comm_, call), call);
  return Wait(nullptr, call, deadline, abort);
}

absl::Status Link::Wait(cudaEvent_t event, absl::string_view what, absl::Time deadline, const AbortCheck& abort) {
  if (event != nullptr) {
    // The event marks everything enqueued on stream_ so far (or was recorded by the caller).
    if (event == done_) MAINSTAY_NCCL_CUDA(cudaEventRecord(done_, stream_));
  }
  Backoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    if (comm_ == nullptr) return absl::UnavailableError("the NCCL channel is broken");
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
      return Fail(NcclError(r, comm_, "ncclCommGetAsyncError"), what);
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(NcclError(state, comm_, "ncclCommGetAsyncError"), what);
    }
    if (event == nullptr) {
      if (state == ncclSuccess) return absl::OkStatus();
    } else {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Fail(CudaError(e, "cudaEventQuery"), what);
    }
    if (break_requested_.load()) return Fail(CheckUsable(), what);
    if (abort) {
      if (absl::Status s = abort(); !s.ok()) return Fail(s, what);
    }
    if (absl::Now() >= deadline) {
      return Fail(absl::DeadlineExceededError("not done by the deadline (the peer stopped, or the deadline is short)"),
                  what);
    }
    backoff.Pause();
  }
}

absl::Status Link::Send(const void* data, int64_t bytes, absl::Time deadline, const AbortCheck& abort) {
  MAINSTAY_RETURN_IF_ERROR(CheckUsable());
  if (bytes == 0) return absl::OkStatus();
  // The peer expects every chunk: whatever stops this transfer half-way breaks the link.
  absl::Status s = SendChunks(data, bytes, deadline, abort);
  if (!s.ok() && !broken_.load()) s = Fail(s, "sending");
  return s;
}

absl::Status Link::SendChunks(const void* data, int64_t bytes, absl::Time deadline, const AbortCheck& abort) {
  MAINSTAY_NCCL_CUDA(cudaSetDevice(options_.device));
  absl::StatusOr<int> where = DeviceOf(data);
  if (!where.ok()) return where.status();
  if (*where < 0) return SendStaged(static_cast<const uint8_t*>(data), bytes, deadline, abort);
  if (*where != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat("the buffer is on CUDA device ", *where,
                                                   " but this NCCL channel uses device ", options_.device));
  }
  const int peer = kPeer[options_.rank];
  const auto* p = static_cast<const uint8_t*>(data);
  for (int64_t off = 0; off < bytes; off += options_.chunk_bytes) {
    const size_t n = static_cast<size_t>(std::min(options_.chunk_bytes, bytes - off));
    MAINSTAY_RETURN_IF_ERROR(Issue(ncclSend(p + off, n, ncclUint8, peer, comm_, stream_), "ncclSend", deadline, abort));
  }
  return Wait(done_, "sending", deadline, abort);
}

// Chunk i is copied into staging_[i % 2] on copy_stream_ while chunk i - 1 is being sent on
// stream_; a staging buffer is refilled only once its previous send completed.
absl::Status Link::SendStaged(const uint8_t* data, int64_t bytes, absl::Time deadline, const AbortCheck& abort) {
  const int peer = kPeer[options_.rank];
  const int64_t chunks = (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes;
  for (int64_t i = 0; i < chunks; ++i) {
    const int slot = static_cast<int>(i % 2);
    const int64_t off = i * options_.chunk_bytes;
    const size_t n = static_cast<size_t>(std::min(options_.chunk_bytes, bytes - off));
    if (i >= 2) MAINSTAY_RETURN_IF_ERROR(Wait(moved_[slot], "sending", deadline, abort));
    MAINSTAY_NCCL_CUDA(cudaMemcpyAsync(staging_[slot], data + off, n, cudaMemcpyHostToDevice, copy_stream_));
    MAINSTAY_NCCL_CUDA(cudaEventRecord(copied_[slot], copy_stream_));
    MAINSTAY_NCCL_CUDA(cudaStreamWaitEvent(stream_, copied_[slot], 0));
    MAINSTAY_RETURN_IF_ERROR(
        Issue(ncclSend(staging_[slot], n, ncclUint8, peer, comm_, stream_), "ncclSend", deadline, abort));
    MAINSTAY_NCCL_CUDA(cudaEventRecord(moved_[slot], stream_));
  }
  return Wait(done_, "sending", deadline, abort);
}

// Chunk i + 1 is received into one staging buffer while chunk i is copied out of the other.
// The copy to (pageable) host memory returns when it is done, so a buffer is free again when
// the next receive into it is posted.
absl::Status Link::RecvToHost(void* out, int64_t bytes, absl::Time deadline, const AbortCheck& abort) {
  MAINSTAY_RETURN_IF_ERROR(CheckUsable());
  if (bytes == 0) return absl::OkStatus();
  absl::Status s = RecvChunks(out, bytes, deadline, abort);
  if (!s.ok() && !broken_.load()) s = Fail(s, "receiving");
  return s;
}

absl::Status Link::RecvChunks(void* out, int64_t bytes, absl::Time deadline, const AbortCheck& abort) {
  MAINSTAY_NCCL_CUDA(cudaSetDevice(options_.device));
  const int peer = kPeer[options_.rank];
  auto* dst = static_cast<uint8_t*>(out);
  const int64_t chunks = (bytes + options_.chunk_bytes - 1) / options_.chunk_bytes;
  auto size_of = [&](int64_t i) {
    return static_cast<size_t>(std::min(options_.chunk_bytes, bytes - i * options_.chunk_bytes));
  };
  auto post = [&](int64_t i) -> absl::Status {
    const int slot = static_cast<int>(i % 2);
    MAINSTAY_RETURN_IF_ERROR(
        Issue(ncclRecv(staging_[slot], size_of(i), ncclUint8, peer, comm_, stream_), "ncclRecv", deadline, abort));
    return CudaError(cudaEventRecord(moved_[slot], stream_), "cudaEventRecord");
  };
  MAINSTAY_RETURN_IF_ERROR(post(0));
  for (int64_t i = 0; i < chunks; ++i) {
    const int slot = static_cast<int>(i % 2);
    if (i + 1 < chunks) MAINSTAY_RETURN_IF_ERROR(post(i + 1));
    MAINSTAY_RETURN_IF_ERROR(Wait(moved_[slot], "receiving", deadline, abort));
    MAINSTAY_NCCL_CUDA(cudaMemcpyAsync(dst + i * options_.chunk_bytes, staging_[slot], size_of(i),
                                       cudaMemcpyDeviceToHost, copy_stream_));
    MAINSTAY_NCCL_CUDA(cudaStreamSynchronize(copy_stream_));  // only copies there: cannot hang
  }
  return absl::OkStatus();
}

}  // namespace mainstay::nccl

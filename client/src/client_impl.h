// Client::Impl: state shared by client.cc (connect, placement, steps) and data_plane.cc
// (pushes, pulls). Internal; gRPC and protobuf live only here and in the .cc files.
//
// Locking: `mu` guards the placement cache, the per-address stubs and the step records;
// `refresh_mu` serializes placement refreshes (so concurrent retries coalesce into one
// GetPlacement). No lock is held across an RPC except refresh_mu around GetPlacement.
#ifndef MAINSTAY_CLIENT_SRC_CLIENT_IMPL_H_
#define MAINSTAY_CLIENT_SRC_CLIENT_IMPL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/src/buffer_pool.h"
#include "client/src/cuda_driver.h"
#include "client/src/thread_pool.h"
#include "client/src/transport.h"
#include "common/grpc_tls.h"
#include "common/layout.h"
#include "mainstay/client.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"

namespace mainstay {

using Deadline = std::chrono::system_clock::time_point;

namespace client_internal {

using RouteFn = std::function<absl::StatusOr<Route>()>;
// One attempt: returns the call's status (StatusFromCall) or a local error.
using AttemptFn = std::function<absl::Status(const Route& route, grpc::ClientContext* context)>;

// A push this rank made for a step, and how to make it again (FinishStep pushes the step again
// itself when a daemon gave it up: ClientOptions::step_attempts).
struct StepPush {
  int32_t bucket = 0;
  int32_t shard = 0;
  std::shared_future<absl::Status> done;
  ElementSpan data;  // the caller's, valid until FinishStep of the step returns
  int32_t num_contributors = 1;
  PushOptions options;
  // The CRC-32C of `data` as pushed, set by the push before `done` is ready; empty when the data
  // is not host-readable (device memory) or no attempt computed it: it cannot be pushed again.
  std::shared_ptr<std::optional<uint32_t>> crc;
};
// Whether `status` refuses a push of `step` because the daemons committed it already
// (FAILED_PRECONDITION whose ErrorDetail names a committed step at or past it).
inline bool CommittedAtOrPast(const absl::Status& status, int64_t step) {
  if (status.code() != absl::StatusCode::kFailedPrecondition) return false;
  const std::optional<ErrorInfo> info = GetErrorInfo(status);
  return info.has_value() && info->committed_step >= step;
}

// The trainer's copies of one push in flight to the shard's replicas (Impl::StartReplicaCopies),
// a thread each. Finish(grace) waits for them up to `grace`, cancels those still running (a
// gRPC copy; a UCX one ends at its transport's liveness check) and joins them; the destructor
// does the same with no grace. Not thread-safe: owned by the push that started them.
class ReplicaCopies {
 public:
  ReplicaCopies() = default;
  ReplicaCopies(ReplicaCopies&&) = default;
  ReplicaCopies& operator=(ReplicaCopies&&) = delete;
  ~ReplicaCopies() { Finish(std::chrono::milliseconds(0)); }
  bool empty() const { return calls_.empty(); }
  void Finish(std::chrono::milliseconds grace) {
    const absl::Time deadline = absl::Now() + absl::FromChrono(grace);
    for (auto& call : calls_) {
      if (!call->done.WaitForNotificationWithDeadline(deadline)) call->context.TryCancel();
    }
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  friend struct ::mainstay::Client::Impl;
  struct Call {
    grpc::ClientContext context;
    absl::Notification done;
  };
  std::vector<std::unique_ptr<Call>> calls_;
  std::vector<std::thread> threads_;
};

struct StepRecord {
  std::vector<StepPush> pushes;
  // Where acknowledged pushes landed: the daemon at an address, and the oldest placement epoch
  // a push there was routed at. FinishStep tells the daemon that epoch, so that a daemon
  // re-placed since (a restore replaced the job and dropped the pushes) answers ABORTED at once
  // instead of waiting for them.
  struct Landed {
    std::string daemon_id;
    int64_t epoch = 0;
  };
  std::map<std::string, Landed> daemons;  // by address
};

// Calls made together that can be given up together: FinishStep's calls at several daemons,
// once one of them answers that the step must be pushed again (the others then wait for an
// attempt that cannot succeed without this rank's new pushes). Thread-safe.
class CallGroup {
 public:
  // Cancels the group's calls in flight, and every attempt registered later is refused.
  void Abandon() {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
    for (grpc::ClientContext* context : calls_) context->TryCancel();
  }
  bool abandoned() const {
    absl::MutexLock lock(&mu_);
    return abandoned_;
  }
  // False (nothing registered) once abandoned.
  bool Register(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    if (abandoned_) return false;
    calls_.insert(context);
    return true;
  }
  void Unregister(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    calls_.erase(context);
  }

 private:
  mutable absl::Mutex mu_;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
};

// The arguments of the client's channels (message sizes, keepalive), and a channel with them.
grpc::ChannelArguments ChannelArgs();
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const ChannelSecurity& security);
StepStats StepStatsFromProto(const v1::StepStats& proto);

}  // namespace client_internal

struct __attribute__((visibility("hidden"))) Client::Impl {
  ClientOptions options;
  ChannelSecurity security;  // from options.tls, made once at Connect
  std::string job_id;
  std::string job_token;  // or the reader token, with `reader`
  bool reader = false;     // attached with ClientOptions::reader_token: pulls only
  std::shared_ptr<const Layout> layout;
  int64_t version_at_connect = 0;
  std::shared_ptr<grpc::Channel> coordinator_channel;
  std::unique_ptr<v1::Coordinator::Stub> coordinator;

  mutable absl::Mutex mu;
  v1::Placement placement ABSL_GUARDED_BY(mu);
  // Owner of (bucket, shard) at index bucket * D + shard: index into placement.daemons, or -1.
  std::vector<int> owners ABSL_GUARDED_BY(mu);
  // Per daemon address: its channel and Shard stub, shared by every call to it.
  absl::flat_hash_map<std::string, std::pair<std::shared_ptr<grpc::Channel>, std::shared_ptr<v1::Shard::Stub>>> stubs
      ABSL_GUARDED_BY(mu);
  std::map<int64_t, client_internal::StepRecord> steps ABSL_GUARDED_BY(mu);
  std::chrono::steady_clock::time_point last_refresh ABSL_GUARDED_BY(mu);

  absl::Mutex refresh_mu;

  // Data-plane transports (transport.h), made at Connect and constant afterwards. null: not
  // started (not asked for, compiled out, or UCX failed to start under "auto": see *_note).
  std::string transport_request;  // "auto", "grpc", "ucx", "nccl" or "cuda_ipc"
  // Where pushed buffers live, and the waits of PushOptions::cuda_event / cuda_stream.
  const client_internal::CudaDriver* cuda = &client_internal::ClientCudaDriver();
  std::unique_ptr<client_internal::DataTransport> grpc_transport;
  std::unique_ptr<client_internal::DataTransport> ucx_transport;
  std::unique_ptr<client_internal::DataTransport> nccl_transport;
  std::unique_ptr<client_internal::DataTransport> cuda_ipc_transport;
  std::string ucx_note;  // why there is no ucx transport under "auto"
  // Daemons (by UCX worker address) whose UCX attach failed under "auto": reached by grpc.
  absl::flat_hash_map<std::string, std::string> ucx_fallback ABSL_GUARDED_BY(mu);

  // Shutdown: set by ~Impl, which then cancels every call in flight (their operations end
  // with CANCELLED) and wakes every backoff wait.
  bool shutting_down ABSL_GUARDED_BY(mu) = false;
  absl::flat_hash_set<grpc::ClientContext*> active_calls ABSL_GUARDED_BY(mu);

  // Buffers of released PulledBuckets, reused by later pulls (ClientOptions.pull_buffer_cache_bytes).
  std::shared_ptr<client_internal::BufferPool> pull_buffers;

  // Declared last: destroyed first, so their queued tasks finish while the rest is alive.
  std::unique_ptr<client_internal::ThreadPool> push_pool;
  std::unique_ptr<client_internal::ThreadPool> pull_pool;

  ~Impl();

  Deadline DeadlineAfter(std::chrono::milliseconds timeout) const;

  // ---- Placement (client.cc).
  int64_t placement_epoch() const;
  // Installs `placement` unless it is older than the cached one.
  void SetPlacement(const v1::Placement& placement);
  // GetPlacement unless the cached epoch is already >= min_epoch (0: always).
  absl::Status RefreshPlacement(Deadline deadline, int64_t min_epoch);
  absl::StatusOr<client_internal::Route> RouteForShard(int32_t bucket, int32_t shard);
  absl::StatusOr<client_internal::Route> RouteForAddress(const std::string& address, const std::string& daemon_id);
  std::shared_ptr<v1::Shard::Stub> StubFor(const std::string& address);
  // route->stub and route->channel for route->address.
  void ConnectRoute(client_internal::Route* route);

  // FAILED_PRECONDITION for what a reader client (ClientOptions::reader_token) may not do.
  absl::Status ReaderRefusal() const;
  // One PinVersion call at `stub`: a pin of `version` for ttl_ms, or its release (ttl_ms 0).
  absl::StatusOr<v1::PinVersionResponse> PinCall(v1::Shard::Stub& stub, int64_t version, int64_t ttl_ms,
                                                 uint64_t pin_id, Deadline deadline);

  // Runs attempts until success, a non-retryable error or the deadline (see client.h).
  // `route` may be empty for coordinator calls (no placement). With `group`, the call ends with
  // CANCELLED as soon as the group is abandoned (its attempt in flight is cancelled).
  absl::Status Retry(absl::string_view what, Deadline deadline, const client_internal::RouteFn& route,
                     const client_internal::AttemptFn& attempt, client_internal::CallGroup* group = nullptr);

  // ---- Data plane (data_plane.cc).
  // Starts the transports `transport_request` needs and attaches to every daemon of the placement.
  absl::Status StartTransports(Deadline deadline);
  // The transport for `daemon` (why not the faster one in *note when given).
  absl::StatusOr<client_internal::DataTransport*> TransportFor(const v1::DaemonEndpoint& daemon,
                                                               std::string* note = nullptr);
  // The header of this rank's push of `data` (no placement epoch, CRC or flags yet).
  v1::PushGradHeader PushHeader(int32_t bucket, int32_t shard, int64_t step, v1::PushKind kind, ElementSpan data,
                                int32_t num_contributors, const PushOptions& push_options) const;
  // Pushes one shard (blocking). On success *landed is the daemon that acknowledged it.
  // *crc_out (when given): the data's CRC-32C, when it was computed (host-readable data).
  absl::StatusOr<PushResult> PushShardSync(int32_t bucket, int32_t shard, int64_t step, v1::PushKind kind,
                                           ElementSpan data, int32_t num_contributors, const PushOptions& options,
                                           Deadline deadline, client_internal::Route* landed,
                                           std::optional<uint32_t>* crc_out = nullptr, bool copies_sent = false);
  // Schedules pushes of `shards` (data[i] for shards[i]) as one handle; gradient pushes are
  // recorded for FinishStep.
  // The trainer's copies of a reduced gradient push for the shard's replicas (ClientOptions::
  // replica_copies), started at once; the caller finishes them before its push is done. `crc`
  // is the payload's CRC-32C (computed here when empty). None where the shard has no replica,
  // the push is not a reduced gradient in host memory, or the client is shutting down.
  client_internal::ReplicaCopies StartReplicaCopies(int32_t bucket, int32_t shard, int64_t step, v1::PushKind kind,
                                              ElementSpan data, int32_t num_contributors,
                                              const PushOptions& push_options, Deadline deadline,
                                              std::optional<uint32_t>* crc);
  PushHandle SchedulePushes(int32_t bucket, const std::vector<int32_t>& shards, int64_t step, v1::PushKind kind,
                            const std::vector<ElementSpan>& data, int32_t num_contributors,
                            const PushOptions& options);
  // FinishStep's attempt `attempt` at `step` failed ABORTED (`aborted`), the step changed
  // nothing: checks that each of `pushes` still holds the bytes it pushed (CRC-32C), then
  // pushes them again at the current placement and waits for them. FAILED_PRECONDITION saying
  // why when a push cannot be made again (its buffer changed or is not host-readable); the
  // pushes' error otherwise.
  absl::Status PushStepAgain(int64_t step, const std::vector<client_internal::StepPush>& pushes);
  // What a delta pull of one shard starts from: the reader's copy (data_out holds its data).
  struct DeltaBase {
    int64_t chunk_bytes = 0;
    int64_t since_version = -1;          // the copy's version: patches against it may come
    std::vector<uint64_t> have;          // XXH3-64 of each chunk of the copy's data
    std::span<const uint8_t> scales;     // the copy's block scales (empty: none)
    std::vector<uint64_t> have_scales;   // XXH3-64 of each chunk of them
  };
  // Pulls one shard into `data_out` (its slice of the packed bucket buffer), blocking. With
  // `delta`, a delta pull over the grpc transport: only the chunks of data and block scales that
  // changed come, as byte patches where the daemon still keeps delta->since_version. With
  // `on_device`, data_out is device memory (PullShardInto): only the cuda_ipc transport places
  // it (FAILED_PRECONDITION for a daemon reached otherwise), and nothing here reads it.
  absl::StatusOr<PulledShard> PullShardSync(int32_t bucket, int32_t shard, int64_t version, std::span<uint8_t> data_out,
                                            Deadline deadline, const DeltaBase* delta = nullptr,
                                            bool on_device = false);
  // PullShardInto / PullBucketInto: checks the destination (its size for shards [shard_begin,
  // shard_end), host or device memory for the transport) and the CUDA work to wait for, then
  // pulls each shard into its slice in parallel; `done` gets the shards in order (ABORTED when
  // they came at different versions), or the first error. Errors before anything is scheduled
  // are returned (done is not called).
  using PullsIntoDone = std::function<void(absl::StatusOr<std::vector<PulledShard>>)>;
  absl::Status SchedulePullsInto(int32_t bucket, int32_t shard_begin, int32_t shard_end, int64_t version,
                                 void* destination, int64_t destination_bytes, const PullIntoOptions& options,
                                 PullsIntoDone done);
  // `since`: a delta pull of the whole bucket, starting from a copy of its data.
  PullHandle SchedulePull(int32_t bucket, int32_t shard_begin, int32_t shard_end, int64_t version,
                          std::chrono::milliseconds timeout, const PulledBucket* since = nullptr);
};

}  // namespace mainstay

#endif  // MAINSTAY_CLIENT_SRC_CLIENT_IMPL_H_

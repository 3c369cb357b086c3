// The shard daemon's core (DESIGN.md section 6, `mainstayd`): the jobs it holds shards of and
// the handlers of the Shard service, with no gRPC in them (server/grpc/shard_service.cc adapts
// them). Each job is a daemon::Job with its own step thread.
//
// Ownership: the options' executor, peer factory, clock and metrics registry are not owned and
// must outlive the daemon. With a registry, the daemon records the metrics of
// server/metrics/daemon_metrics.h into it (a collector of its own refreshes the held-state
// gauges before each Render; removed by the destructor).
// Thread safety: every method is thread-safe; PullParams and FinishStep wait up to their
// deadline. Errors follow shard.proto: UNAVAILABLE when the daemon has not yet received
// the job or epoch the caller routed with (retry), NOT_FOUND for an unknown bucket,
// FAILED_PRECONDITION (with an ErrorDetail payload, common/error_detail.h) for a shard the
// daemon does not own or a step already decided, INVALID_ARGUMENT for malformed requests,
// UNAUTHENTICATED / PERMISSION_DENIED for a missing or wrong job token.
#ifndef MAINSTAY_SERVER_DAEMON_SHARD_DAEMON_H_
#define MAINSTAY_SERVER_DAEMON_SHARD_DAEMON_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "mainstay/v1/shard.pb.h"
#include "server/daemon/connection_table.h"
#include "server/daemon/job.h"
#include "server/metrics/daemon_metrics.h"
#include "server/metrics/registry.h"
#include "server/peer/peer_group.h"

namespace mainstay::daemon {

struct ShardDaemonOptions {
  // Where shard state lives and the kernels run (mainstayd --device); not owned. Null: host
  // memory, the kernels on the step's own thread.
  kernels::StateMemory* memory = nullptr;
  peer::PeerGroupFactory* peers = nullptr;  // not owned; null: only jobs placed on this daemon alone
  int retained_versions = 4;                // published versions kept per shard
  // Memory for shard state (mainstayd --memory-bytes): an AssignShard whose job would need more
  // than what other jobs leave of it (MemoryPlan, common/job_spec.h) is RESOURCE_EXHAUSTED, and
  // the coordinator places the shards elsewhere. 0: no limit.
  int64_t memory_bytes = 0;
  absl::Duration peer_timeout = absl::Seconds(120);  // bound on one step's peer reductions
  Clock* clock = RealClock::Get();
  metrics::Registry* metrics = nullptr;     // not owned; null: no metrics
  checkpoint::CheckpointFs* fs = nullptr;   // not owned; null: the POSIX file system
  // Not owned; how a job whose peer reduction failed asks its peers for the step's decision
  // and how a move copies a shard from its source (peer_client.h). Null: it gives the step up
  // alone (safe only for one-daemon jobs), and moves cannot load.
  PeerClient* peer_client = nullptr;
  StepFaults faults;                        // tests only (mainstayd --inject-fault)
  // Bytes per second that readers (pulls with a job's reader token) may take from this daemon,
  // all jobs together (mainstayd --reader-bytes-per-sec; docs/weight_serving.md). 0: no cap.
  int64_t reader_bytes_per_sec = 0;
};

// The header every transport sends before a pulled shard's data and scales.
v1::PullParamsHeader PullHeaderOf(const PullResult& result);

class ShardDaemon {
 public:
  explicit ShardDaemon(ShardDaemonOptions options);
  ~ShardDaemon();

  // The id the coordinator gave this daemon; shard assignments wait (UNAVAILABLE) until set.
  void set_daemon_id(const std::string& id);
  std::string daemon_id() const;
  // The only directory checkpoints are read from and written to (the coordinator's
  // --checkpoint-dir, learned at registration; "" allows none). Until set (a daemon core used in
  // process, without a coordinator) paths are not confined.
  void set_checkpoint_root(const std::string& root);

  // RESOURCE_EXHAUSTED (nothing changes) when the job's shards here at the request's placement
  // need more than options.memory_bytes leaves after the other jobs' plans.
  absl::StatusOr<v1::AssignShardResponse> AssignShard(const v1::AssignShardRequest& request);
  absl::Status DropShard(const v1::DropShardRequest& request);
  absl::StatusOr<std::unique_ptr<PushSession>> BeginPush(const v1::PushGradHeader& header);
  // A caller's credentials for transports that open connections (ucx, nccl): OK when the job
  // has shards here and `job_token` is its job token or its reader token (each request on the
  // connection is checked again: a reader's pushes and FinishSteps are PERMISSION_DENIED);
  // UNAVAILABLE / UNAUTHENTICATED / PERMISSION_DENIED.
  // `writer`: the job token only (a reader's token is PERMISSION_DENIED).
  absl::Status CheckJobToken(const std::string& job_id, const std::string& job_token, bool writer = false) const;
  absl::StatusOr<PullResult> PullParams(const v1::PullParamsRequest& request, absl::Time deadline);
  // Job::KeptVersion of the request's job (null when the job is unknown).
  std::shared_ptr<const QuantizedShard> KeptVersion(const v1::PullParamsRequest& request, int64_t version);
  // Job::AdmitReaderBytes of the named job (NOT_FOUND when it is unknown).
  absl::Status AdmitReaderBytes(const std::string& job_id, int64_t bytes);
  absl::StatusOr<v1::PinVersionResponse> PinVersion(const v1::PinVersionRequest& request);
  absl::StatusOr<v1::StepStats> FinishStep(const v1::FinishStepRequest& request, absl::Time deadline);
  absl::StatusOr<v1::StepStats> GetStepStats(const v1::GetStepStatsRequest& request);

  absl::StatusOr<ShardStateCopy> ReadShardState(const std::string& job_id, int32_t bucket, int32_t shard) const;
  // Job::CopyForMove of the named job (FetchShardState).
  absl::StatusOr<ShardStateCopy> CopyShardForMove(const v1::FetchShardStateRequest& request, absl::Time deadline);
  // Job::CheckReplicaInput / Job::StoreReplicaInput of the named job (ForwardStepInput);
  // NOT_FOUND when the daemon does not hold the job.
  absl::StatusOr<bool> CheckReplicaInput(const v1::ReplicaInputHeader& header) const;
  absl::StatusOr<bool> StoreReplicaInput(const v1::ReplicaInputHeader& header, std::vector<uint8_t> payload);
  // Job::AdoptTrainerCopy of the named job (ForwardStepInput with header.payload_from_trainer).
  absl::StatusOr<bool> AdoptTrainerCopy(const v1::ReplicaInputHeader& header);
  // A buffer of `bytes` an earlier step of the job used (Job::TakeSpareBuffer), emptied with its
  // memory kept, for a forwarded input to land in without page faults; an empty vector when
  // none fits or the job is not here.
  std::vector<uint8_t> SpareBuffer(const std::string& job_id, int64_t bytes);
  // Job::GetStepOutcome of the named job; UNDECIDED when the daemon does not hold the job.
  v1::GetStepOutcomeResponse GetStepOutcome(const v1::GetStepOutcomeRequest& request) const;
  // Job::WriteCheckpoint of the named job. UNAVAILABLE when the job has no shards here.
  absl::StatusOr<v1::WriteCheckpointResponse> WriteCheckpoint(const v1::WriteCheckpointRequest& request,
                                                              absl::Time deadline);

  // Progress of every job, for the heartbeat.
  std::vector<v1::JobProgress> Progress() const;
  int64_t used_bytes() const;
  // What the jobs' plans reserve of options.memory_bytes (each job's MemoryPlan bytes for the
  // shards its latest assignment gives this daemon).
  int64_t planned_bytes() const;
  int active_jobs() const;
  // The daemon's metrics (for the transport adapters' byte counts); null without a registry.
  metrics::DaemonMetrics* metrics() const { return metrics_.get(); }
  // Trainers' data-plane connections, kept by the transport adapters; reported by heartbeat.
  ConnectionTable* connections() { return &connections_; }
  // `listener(job_id)` is called whenever a job's waiting PullParams or FinishStep calls may be
  // answerable (JobOptions::on_change), from under that job's lock: it must not call into the
  // daemon. Replaces the previous listener; null removes it.
  void SetChangeListener(std::function<void(const std::string&)> listener);
  // Stops every job's step thread and ends waits with UNAVAILABLE. Idempotent.
  void Shutdown();
  // Waits until the jobs dropped so far have stopped (tests).
  void JoinDroppedJobs();

 private:
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id) const;
  // The bytes the request's placement gives this daemon to hold for its job; RESOURCE_EXHAUSTED
  // when they do not fit next to the other jobs' plans (options_.memory_bytes).
  absl::StatusOr<int64_t> AdmitLocked(const v1::AssignShardRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ShardDaemonOptions options_;
  // options_.memory, or host memory of our own when it is null.
  const std::unique_ptr<kernels::StateMemory> own_memory_;
  kernels::StateMemory* const memory_;
  ConnectionTable connections_;
  std::unique_ptr<metrics::DaemonMetrics> metrics_;  // set in the constructor, then constant
  std::unique_ptr<ReaderLimiter> reader_limiter_;    // the same; null: no reader cap
  metrics::Registry::CollectorId collector_ = 0;
  mutable absl::Mutex mu_;
  std::string daemon_id_ ABSL_GUARDED_BY(mu_);
  std::optional<std::string> checkpoint_root_ ABSL_GUARDED_BY(mu_);  // nullopt: not confined
  // INVALID_ARGUMENT unless `path` is under checkpoint_root_ (when set).
  absl::Status CheckCheckpointPath(const std::string& path, absl::string_view what) const ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Dropped jobs whose step threads are being joined off the caller's thread (a step may sit in
  // a peer reduction until its deadline, and DropShard must not block a gRPC thread that long).
  // Stops a job that left jobs_ and has a reaper thread join it.
  void ReapLocked(std::shared_ptr<Job> job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct Reaper {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Reaper> reapers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // AssignShard calls one at a time: admission (planned_) checks and reserves in one go.
  absl::Mutex assign_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::map<std::string, int64_t> planned_ ABSL_GUARDED_BY(mu_);  // job id -> bytes planned here
  // Its own lock: taken under jobs' locks, never while holding mu_.
  mutable absl::Mutex listener_mu_;
  std::function<void(const std::string&)> listener_ ABSL_GUARDED_BY(listener_mu_);
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_SHARD_DAEMON_H_

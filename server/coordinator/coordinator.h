// The coordinator's core logic (DESIGN.md section 6): membership with leases, jobs, layout,
// placement with epochs, and a small KV with compare-and-set and TTLs. No gRPC here:
// server/grpc/coordinator_service.cc adapts these methods to the Coordinator and Admin
// services; tests call them directly.
//
// Durability: every change is written ahead to the StateStore (one atomic StateBatch) before
// it is applied in memory and answered, so a coordinator killed at any point restarts with
// every acknowledged change (Create loads the store). A failed store write changes nothing.
//
// Thread safety: all methods are thread-safe (one mutex). Ownership: the options' clock,
// store and assigner are not owned and must outlive the Coordinator.
#ifndef MAINSTAY_SERVER_COORDINATOR_COORDINATOR_H_
#define MAINSTAY_SERVER_COORDINATOR_COORDINATOR_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "mainstay/v1/admin.pb.h"
#include "mainstay/v1/coordinator.pb.h"
#include "server/checkpoint/checkpoint_fs.h"
#include "server/coordinator/shard_assigner.h"
#include "server/coordinator/state_store.h"

namespace mainstay::coordinator {

struct CoordinatorOptions {
  Clock* clock = RealClock::Get();
  StateStore* store = nullptr;        // required
  ShardAssigner* assigner = nullptr;  // nullptr: daemons are not told (offline tools, tests)
  int64_t default_lease_ttl_ms = 10'000;
  int64_t min_lease_ttl_ms = 500;
  int64_t max_lease_ttl_ms = 600'000;
  int64_t snapshot_every_batches = 1000;  // compaction of the write-ahead log
  int64_t max_kv_value_bytes = 1 << 20;
  std::string coordinator_id = "coordinator";
  // Checkpoints (coordinator_checkpoints.cc): a directory the coordinator and every daemon
  // reach under the same path (a shared file system across nodes). Empty: no checkpoints.
  std::string checkpoint_dir;
  checkpoint::CheckpointFs* fs = nullptr;  // not owned; null: the POSIX file system
  // Restore a job from its newest committed checkpoint when one of its daemons loses its
  // lease (the lost ranks move to ready daemons, trainers rewind). Off: the job stays DEGRADED.
  bool restore_on_daemon_loss = true;
  // Checkpoint policy: a checkpoint of every job each time it has decided this many more steps
  // (0: off) or, if it decided any, this much time after the last one (0: off); only the newest
  // `checkpoint_keep` of those periodic checkpoints are kept (0: all). Manual ones are never
  // deleted by it.
  int64_t checkpoint_every_steps = 0;
  int64_t checkpoint_every_ms = 0;
  int checkpoint_keep = 3;
  // Called (under the coordinator's lock: it must not call back into the Coordinator) for each
  // daemon marked DOWN because its lease ran out; metrics count them. Empty: nothing.
  std::function<void(const std::string& daemon_id)> on_lease_expired;
  // Tests only (mainstay-coordinator --inject-fault crash-at:POINT): called at named moments,
  // some under the coordinator's lock (the hook must not call into the coordinator); the
  // binary's hook kills the process at the one it was given.
  // "checkpoint-shards-written": every daemon wrote its shards of a checkpoint, its manifest is
  // not written yet. "move-committed" (a drain's or a shards move's), "failover-committed",
  // "re-replication-committed": that new placement epoch is durable and no daemon was sent it
  // yet. Empty: nothing.
  std::function<void(const std::string& point)> fault_point;
  // Reconciliation: a daemon that reports a job it is placed on behind the placement epoch (or
  // not at all) for this long is sent its assignment again, and again every this long, for as
  // long as it lives. A daemon that no longer holds a started job lost its state: the job is
  // DEGRADED and recovered as if the daemon had died.
  int64_t reconcile_after_ms = 3000;
  // Bounds on one job (CreateJob answers INVALID_ARGUMENT naming the bound), checked before the
  // layout is computed: a small spec must not make the coordinator build gigabytes.
  int64_t max_job_tensors = 100'000;
  int64_t max_data_parallel_size = 65'536;
  int64_t max_job_shards = 1'000'000;              // (bucket, shard) pairs: buckets x D
  int64_t max_placement_bytes = int64_t{256} << 20;  // the serialized placement every daemon gets
};

class Coordinator {
 public:
  // Loads the durable state. A daemon whose lease expired while the coordinator was down is
  // marked DOWN at the first Tick.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const CoordinatorOptions& options);
  ~Coordinator();

  // ---- Membership.
  absl::StatusOr<v1::RegisterDaemonResponse> RegisterDaemon(const v1::RegisterDaemonRequest& request);
  // NOT_FOUND when the daemon is unknown, its lease expired or was replaced: register again.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::Status DeregisterDaemon(const v1::DeregisterDaemonRequest& request);
  v1::ListDaemonsResponse ListDaemons(const v1::ListDaemonsRequest& request);
  absl::StatusOr<v1::CordonDaemonResponse> CordonDaemon(const v1::CordonDaemonRequest& request);
  // Cordons the daemon and moves each of its shard ranks to another ready daemon (a new
  // placement epoch per job). RESOURCE_EXHAUSTED when no other daemon can take them.
  // Moves every rank off the daemon (DRAINING), state and all: each target copies its ranks from
  // the daemon, which drops them once the target reports them loaded. RESOURCE_EXHAUSTED, with
  // nothing moved, when another ready daemon cannot take one of them (e.g. the last daemon).
  absl::StatusOr<v1::DrainDaemonResponse> DrainDaemon(const v1::DrainDaemonRequest& request);
  // Moves one rank of a job (every bucket's shard of it) to a READY daemon, the same way.
  absl::StatusOr<v1::MoveShardResponse> MoveShard(const v1::MoveShardRequest& request);

  // Background checkpoint threads not yet joined (tests: finished ones are reaped).
  // Whether the coordinator's lock is free now (tests: no sync runs under it).
  bool StateLockFreeForTesting() const;
  size_t background_threads_for_testing() const;

  // ---- Jobs. INVALID_ARGUMENT (naming the spec field) for a bad spec, ALREADY_EXISTS for a
  // duplicate name, RESOURCE_EXHAUSTED (with the numbers) when the daemons cannot hold it.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::CreateJobRequest& request);
  absl::StatusOr<v1::GetJobResponse> GetJob(const v1::GetJobRequest& request);
  v1::ListJobsResponse ListJobs(const v1::ListJobsRequest& request);
  absl::Status DeleteJob(const v1::DeleteJobRequest& request);
  // The job's reader token: created (saved, and its hash sent to every daemon of the job) on
  // the first call or with request.rotate, else the saved one. PERMISSION_DENIED for a token
  // that is not the job's job_token (a reader token cannot mint or rotate one); UNAVAILABLE
  // while a move of the job is in progress.
  absl::StatusOr<v1::GetReaderTokenResponse> GetReaderToken(const v1::GetReaderTokenRequest& request);
  absl::StatusOr<v1::GetLayoutResponse> GetLayout(const v1::GetLayoutRequest& request);
  absl::StatusOr<v1::GetPlacementResponse> GetPlacement(const v1::GetPlacementRequest& request);
  // The daemon at `address` refused `request` with `status` (RESOURCE_EXHAUSTED: the job's
  // memory plan does not fit there). The ranks it was to gain (all of them before the job has
  // started or in a restore; else those a pending move brings it) go to other ready daemons
  // with room at a new placement epoch (a restore's at that epoch from the checkpoint), a move
  // back to its source when none has room. A stale request (an older epoch) changes nothing.
  // Called by the ShardAssigner (its refused handler), without locks.
  void AssignmentRefused(const std::string& address, const v1::AssignShardRequest& request, const absl::Status& status);

  // `listener()` is called after changes to the durable state (a job's placement, the KV) are
  // synced, with no lock of the coordinator's held; it must not block. Replaces the previous
  // one; null removes it. For waiting calls (server/grpc/waiters.h).
  void SetChangeListener(std::function<void()> listener);

  // The job's placement once its epoch exceeds `known_epoch`; waits until `deadline`
  // (DEADLINE_EXCEEDED). NOT_FOUND when the job does not exist or is deleted while waiting.
  absl::StatusOr<v1::Placement> WaitPlacement(const std::string& job_id, const std::string& job_token,
                                              int64_t known_epoch, absl::Time deadline);

  // ---- KV.
  absl::StatusOr<v1::KvPutResponse> KvPut(const v1::KvPutRequest& request);
  // Waits up to min(wait_ms, deadline) for a missing key / empty prefix.
  absl::StatusOr<v1::KvGetResponse> KvGet(const v1::KvGetRequest& request, absl::Time deadline);
  absl::StatusOr<v1::KvDeleteResponse> KvDelete(const v1::KvDeleteRequest& request);
  // KvWatch's next changes: those of `request.key()` (or under it, with prefix) with revision
  // > `after`, oldest first, up to `max`, and the revision read up to (the next `after`; the
  // changes may be none when only other keys changed). DEADLINE_EXCEEDED when the KV has not
  // changed since `after` (the caller waits for a change and asks again); OUT_OF_RANGE when
  // changes after `after` are no longer kept (this coordinator keeps the last 10000, from its
  // start: re-read with KvGet and watch from its revision); INVALID_ARGUMENT for a bad key or an
  // `after` in the future.
  struct KvChanges {
    std::vector<v1::KvWatchResponse> changes;
    int64_t revision = 0;
  };
  absl::StatusOr<KvChanges> KvChangesAfter(const v1::KvWatchRequest& request, int64_t after, size_t max);
  // The KV's revision now (a watch "from now" starts after it).
  int64_t KvRevision();

  // ---- Checkpoints (DESIGN.md section 8, docs/checkpoints.md). FAILED_PRECONDITION when
  // the coordinator has no checkpoint directory.
  // Picks the newest step every daemon of the job has decided, has each daemon write its
  // shards at that step (the daemons snapshot and write while training goes on; a daemon
  // already past it makes the coordinator retry at the newer step, up to 5 times), then
  // commits the manifest. With `wait`, returns the COMMITTED (or failed) checkpoint, bounded
  // by `deadline`; without, returns at once in state WRITING. UNAVAILABLE when a daemon of
  // the job is down. A failed checkpoint leaves no files.
  absl::StatusOr<v1::CreateCheckpointResponse> CreateCheckpoint(const v1::CreateCheckpointRequest& request,
                                                                absl::Time deadline);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const v1::ListCheckpointsRequest& request);
  // Verifies every file of the checkpoint (DATA_LOSS naming the file and the reason: nothing
  // changes), checks it fits the job (INVALID_ARGUMENT), then reassigns every shard of the job
  // from it at a new placement epoch: the daemons reload and republish the saved version and
  // the job resumes at the checkpoint's committed step + 1 (trainers get ABORTED with it).
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(const v1::RestoreCheckpointRequest& request);
  // FAILED_PRECONDITION while it is being written; NOT_FOUND when there is no such checkpoint.
  absl::Status DeleteCheckpoint(const v1::DeleteCheckpointRequest& request);

  // Marks daemons whose lease expired DOWN (their jobs DEGRADED) and removes expired KV
  // entries; with restore_on_daemon_loss, restores each job that lost a daemon from its newest
  // committed checkpoint. The server calls it periodically; every other method calls the
  // bookkeeping part first too.
  void Tick();

 private:
  struct Impl;
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_COORDINATOR_H_

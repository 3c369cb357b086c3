// One job on one shard daemon: its shards (FP32 masters, moments, published versions), the
// step protocol of DESIGN.md sections 1, 5 and 8, and the step thread that runs it.
//
// Step s runs when, for every (bucket, shard) the daemon owns, all `num_contributors`
// gradient pushes of step s have arrived and every rank that pushed to this daemon has
// called FinishStep(s). Then (docs/daemon.md, "A step"): partial gradient stats (with the
// amax probe, unless the last step clipped) -> peer SUM -> skip (non-finite) or clip -> the
// amax probe's dry run where not done yet -> peer MAX of the amaxes -> the update in place and
// the cast -> commit: version s+1 is published under the job's lock. Nothing is written before
// the MAX has decided the step. A failure before it (a peer lost) changes nothing: the
// step's inputs are dropped and its waiters get ABORTED, so the trainers push it again.
// Version 0 comes the same way from PUSH_KIND_INITIAL_PARAMS pushes (step -1; no FinishStep
// needed), built in scratch buffers that become the state.
//
// Replicas (replication_factor >= 2; docs/architecture.md, "Replicas"): the placement names
// each (bucket, shard)'s primary and replicas. A daemon holds both kinds in `shards_`; trainers
// reach only primaries. At the start of each attempt of a step, before the first peer reduction,
// the primary sends each replica the shard's input (ForwardStepInput: the gradient its update
// reads, the loss scale, the hyperparameters). The replica takes it after the stats reduction
// (which every forward of the attempt precedes) and applies the same update, with the same
// reduced scalars, before the amax reduction: so when any daemon commits step s, every replica
// holds the input and the decision of s. Replica-only daemons join the reductions with nothing
// to add to the sums.
//
// Memory: per owned shard, master + moments (one copy: a step updates them in place once
// decided) + `retained_versions` published snapshots + the pending gradients of at most two
// steps. Pulls get shared_ptrs to immutable snapshots, so eviction never tears a reader.
//
// Thread safety: every public method is thread-safe. Methods that wait (PullParams,
// FinishStep) wait on the job's mutex with the caller's deadline.
#ifndef MAINSTAY_SERVER_DAEMON_JOB_H_
#define MAINSTAY_SERVER_DAEMON_JOB_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/step_hyper.h"
#include "kernels/kernels.h"
#include "mainstay/v1/checkpoint.pb.h"
#include "mainstay/v1/coordinator.pb.h"
#include "mainstay/v1/shard.pb.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/daemon/peer_client.h"
#include "server/daemon/reader_limiter.h"
#include "server/daemon/reduction_plan.h"
#include "server/daemon/scaling_state.h"
#include "server/daemon/shard_state.h"
#include "server/daemon/state_buffer.h"
#include "server/peer/peer_group.h"

namespace mainstay::metrics {
class DaemonMetrics;
}  // namespace mainstay::metrics

namespace mainstay::daemon {

// A consistent copy of the job's committed state at one decided step (checkpoints).
struct JobSnapshot {
  int64_t version = -1;
  int64_t committed_step = -1;
  struct ShardCopy {
    int32_t bucket = 0, shard = 0;
    std::vector<float> master;
    std::vector<uint8_t> m, v;
  };
  std::vector<ShardCopy> shards;
  v1::CheckpointScalingState scaling;
};

struct JobOptions {
  // Not owned, required: where shard state lives and the kernels run (kernels/memory.h).
  kernels::StateMemory* memory = nullptr;
  peer::PeerGroupFactory* peers = nullptr;     // not owned; may be null for one-daemon jobs
  std::string daemon_id;                       // this daemon
  int retained_versions = 4;
  absl::Duration peer_timeout = absl::Seconds(120);
  Clock* clock = RealClock::Get();
  metrics::DaemonMetrics* metrics = nullptr;   // not owned; null: no metrics
  checkpoint::CheckpointFs* fs = nullptr;      // not owned; null: the POSIX file system
  // Not owned; null: a daemon whose peer reduction failed gives the step up without asking its
  // peers (only safe for jobs on one daemon).
  PeerClient* peer_client = nullptr;
  StepFaults faults;                           // tests only (mainstayd --inject-fault)
  ReaderLimiter* reader_limiter = nullptr;     // not owned; null: readers' pulls are not capped
  // Called with the job id, under the job's lock, whenever something a waiting PullParams or
  // FinishStep may be waiting for changed (a step decided, the job stopped, a new epoch or
  // fence): the gRPC adapter re-runs its parked calls (server/grpc/waiters.h). Must not call
  // into the job. Null: none.
  std::function<void(const std::string&)> on_change;
};

class Job;

// One PushGrad stream, between its header and its end. Nothing is stored until Finish
// succeeds, and nothing is allocated until its payload lands (a header alone holds no memory).
// Not thread-safe (one stream, one caller); holds its job alive.
class PushSession {
 public:
  // Chunks come in order without gaps: `element_offset` must equal the elements received so
  // far and `data` hold whole elements, at most 4 MiB. INVALID_ARGUMENT otherwise (the stream
  // is then dead).
  // The chunk may come in pieces (as gRPC received it), read in order.
  absl::Status AddChunk(int64_t element_offset, std::span<const std::span<const uint8_t>> pieces);
  absl::Status AddChunk(int64_t element_offset, absl::string_view data);
  // Stores the shard's push (or acknowledges a duplicate). INVALID_ARGUMENT when the stream
  // ended short or without the CRC-32C trailer its header announced (a duplicate needs none);
  // DATA_LOSS when the payload's CRC-32C (the header's or the trailer's) does not match;
  // FAILED_PRECONDITION when the step was committed meanwhile.
  absl::StatusOr<v1::PushGradResponse> Finish();

  // For transports that place the payload themselves (ucx, nccl) instead of AddChunk calls: a
  // duplicate push needs no payload; otherwise the whole payload (numel elements of the header's
  // dtype) goes to destination(), in order, and Landed(bytes) says that the next `bytes` of it
  // arrived (whole elements). The payload's CRC-32C, when checked, is extended over those bytes
  // there, while later bytes are still in flight.
  bool duplicate() const { return duplicate_; }
  int element_bytes() const { return elem_bytes_; }
  std::span<uint8_t> destination();
  void Landed(int64_t bytes);
  // A push whose header set crc32c_follows: the transport passes the PushGradTrailer's CRC-32C
  // here once it came, before Finish (0: the trainer computed none, nothing is checked). Finish
  // is INVALID_ARGUMENT for such a push, unless a duplicate, without it. Called twice: the
  // second value counts (the transports refuse a second trailer themselves).
  void SetTrailingCrc32c(uint32_t crc) {
    expected_crc_ = crc;
    trailer_received_ = true;
  }

 private:
  friend class Job;
  // Grows the buffer to `bytes` as the payload lands (a spare buffer of an earlier step when
  // one fits; else reserved address space whose pages are touched chunk by chunk).
  void Reserve(int64_t bytes);
  std::shared_ptr<Job> job_;
  v1::PushGradHeader header_;
  int64_t numel_ = 0;
  int elem_bytes_ = 4;
  bool duplicate_ = false;
  bool replica_copy_ = false;  // header_.replica_copy: kept as a TrainerCopy, no contribution
  int64_t received_ = 0;
  std::vector<uint8_t> buffer_;
  bool failed_ = false;
  // The payload's CRC-32C, computed as it arrives (a chunk is still in cache): tracked when the
  // header carries one, or a trailer will.
  bool track_crc_ = false;
  bool trailer_received_ = false;
  uint32_t crc_ = 0;
  uint32_t expected_crc_ = 0;
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  // `assign` is the first AssignShard of the job on this daemon. INVALID_ARGUMENT for a spec
  // or layout that does not resolve. With `from_checkpoint`, the manifest is read and checked
  // against the job here (NOT_FOUND / DATA_LOSS / INVALID_ARGUMENT when it cannot be loaded
  // into this job); the shards' state is then loaded by the step thread, which republishes
  // the checkpoint's version (version() stays -1 until then; calls wait or answer as they do
  // before version 0). Until the first step after the restore is decided, pushes and
  // FinishStep calls for any step but the resume step (committed_step + 1) are ABORTED with
  // ErrorDetail.committed_step: the trainers rewind to it.
  static absl::StatusOr<std::shared_ptr<Job>> Create(const v1::AssignShardRequest& assign, JobOptions options);
  ~Job();

  const std::string& job_id() const { return job_id_; }
  // A trainer's job token against the one the coordinator assigned (its SHA-256):
  // UNAUTHENTICATED when missing, PERMISSION_DENIED when wrong (the job's reader token is wrong
  // here too, with a message that says so).
  absl::Status CheckToken(const std::string& token) const;
  // The same for calls that only read published versions (PullParams, and admitting a data
  // connection): the job token or the job's current reader token. *reader (when given) tells
  // which it was.
  absl::Status CheckReadToken(const std::string& token, bool* reader = nullptr) const;

  // Later AssignShard / DropShard calls. FAILED_PRECONDITION for an epoch older than known.
  absl::Status Assign(const v1::AssignShardRequest& request);
  // Returns true when the job holds no shard any more (the daemon then forgets it).
  absl::StatusOr<bool> Drop(const v1::DropShardRequest& request);

  absl::StatusOr<std::unique_ptr<PushSession>> BeginPush(const v1::PushGradHeader& header);
  absl::StatusOr<PullResult> PullParams(const v1::PullParamsRequest& request, absl::Time deadline);
  // The request's shard as published at `version`, while this daemon still keeps it: the base
  // of a delta pull's byte patches (PullParamsRequest.delta_since_version). Null when it is not
  // kept (evicted, never published: a skipped step), or the token or route is not good. Counts
  // nothing against readers (the pull that sends the delta does).
  std::shared_ptr<const QuantizedShard> KeptVersion(const v1::PullParamsRequest& request, int64_t version);
  // Charges `bytes` of a reader's pull against the daemon's reader cap and the reader-bytes
  // metric: UNAVAILABLE with the wait when the cap is spent (the reader retries). 0 bytes pass.
  absl::Status AdmitReaderBytes(int64_t bytes);
  // Pins (or renews, or with ttl_ms 0 releases) a published version against eviction: see
  // shard.proto, PinVersion. A pinned version costs one more snapshot per shard beyond
  // retained_versions (docs/weight_serving.md, "Pins").
  absl::StatusOr<v1::PinVersionResponse> PinVersion(const v1::PinVersionRequest& request);
  absl::StatusOr<v1::StepStats> FinishStep(const v1::FinishStepRequest& request, absl::Time deadline);
  absl::StatusOr<v1::StepStats> GetStepStats(const v1::GetStepStatsRequest& request);
  // What this daemon holds of a step, for a peer in doubt about it (job_outcome.cc): DECIDED with
  // the results of the step's deciding reduction once one completed here (kept for the newest
  // steps), RUNNING while one of the step's reductions is in progress, else UNDECIDED.
  v1::GetStepOutcomeResponse GetStepOutcome(const v1::GetStepOutcomeRequest& request) const;

  // Writes the owned shards' committed state at `request.committed_step` into
  // `request.directory_uri` (job_checkpoint.cc): waits until that step is decided (the
  // deadline: DEADLINE_EXCEEDED), copies the state under the lock (the step thread is held for
  // a memcpy only), then writes without the lock while training goes on. FAILED_PRECONDITION
  // with ErrorDetail.committed_step when a later step was already decided.
  absl::StatusOr<v1::WriteCheckpointResponse> WriteCheckpoint(const v1::WriteCheckpointRequest& request,
                                                              absl::Time deadline);
  // The checkpoint this job was restored from and the epoch of that assignment ("" / -1: none).
  std::pair<std::string, int64_t> restored_from() const;

  // A primary's input of `header.step` for a replica of (bucket, shard) held here
  // (ForwardStepInput). CheckReplicaInput validates the header before the payload is read:
  // FAILED_PRECONDITION when this daemon holds no replica of the shard at that epoch (or the
  // step is decided), UNAVAILABLE when it has not received that epoch yet, INVALID_ARGUMENT for
  // a size or dtype that does not fit. StoreReplicaInput checks again and keeps the payload; a
  // newer attempt's input replaces an older one not yet applied. Returns true when the input
  // was already applied (a duplicate, nothing stored).
  absl::StatusOr<bool> CheckReplicaInput(const v1::ReplicaInputHeader& header) const;
  absl::StatusOr<bool> StoreReplicaInput(const v1::ReplicaInputHeader& header, std::vector<uint8_t> payload);
  // The same with header.payload_from_trainer: the input is the trainer's copy of its push
  // (PushGradHeader.replica_copy) held here, matched by dtype, loss scale and CRC-32C. NOT_FOUND
  // when none matches (the primary then sends the payload); the checks of CheckReplicaInput
  // otherwise.
  absl::StatusOr<bool> AdoptTrainerCopy(const v1::ReplicaInputHeader& header);
  // An input buffer of the last committed step of exactly `bytes`, its bytes unspecified (empty
  // when none fits): a push or a forwarded input lands in it without page faults.
  std::vector<uint8_t> TakeSpareBuffer(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // A consistent copy of a shard's committed state (a primary's or a replica's).
  // FAILED_PRECONDITION when the daemon holds neither.
  absl::StatusOr<ShardStateCopy> ReadShardState(int32_t bucket, int32_t shard) const;
  // A move's copy of a shard, owned or moving out (job_move.cc). When request.placement_epoch is
  // newer than the job's, this daemon first fences the job: no step at an older epoch starts any
  // more, calls routed with an older epoch are FAILED_PRECONDITION with the new epoch, and the
  // step in flight is waited for (DEADLINE_EXCEEDED by `deadline`), so the copy is final. For a
  // shard leaving this daemon (fenced, or moving out) the masters and moments are views of the
  // shard's own buffers, which no step writes (ApplyStep waits) until the copy is destroyed;
  // for a source that keeps the shard (re-replication) they are a copy.
  absl::StatusOr<ShardStateCopy> CopyForMove(const v1::FetchShardStateRequest& request, absl::Time deadline);
  std::vector<v1::ShardStatus> ShardStatuses() const;
  // Where the job stands (reported to the coordinator with the heartbeat).
  v1::JobProgress Progress() const;
  int64_t state_bytes() const;
  // Ends every wait with UNAVAILABLE and tells the step thread to stop after the step it may be
  // running (that one finishes or fails at its peer deadline); returns at once.
  void RequestStop();
  // RequestStop, then joins the step thread (up to the running step's peer deadline).
  void Shutdown();

 private:
  friend class PushSession;
  using Key = std::pair<int32_t, int32_t>;  // (bucket, shard)

  struct ShardState {
    int32_t bucket = 0;
    int32_t shard = 0;
    int64_t numel = 0;
    bool initialized = false;  // has masters (version 0 published)
    bool incoming = false;     // assigned from a peer, not copied yet (job_move.cc)
    bool replica = false;      // a replica: updated from its primary's forwarded inputs
    StateBuffer<float> master, scratch_master;
    StateBuffer<uint8_t> m, v, scratch_m, scratch_v;
    std::vector<float> grad_sum;  // for num_contributors > 1 (host; staged like a push)
    // The kernels' scalar outputs and inputs, per fragment (FragmentCast::slot): amaxes, the
    // cast's scale_inv, gradient statistics. In state memory, so that a GPU writes them.
    StateBuffer<uint8_t> scalars;
    // Staged memory only (a GPU): the step's gradient input, and the new version's data and
    // scales before they go to the host (StateMemory::staged). Allocated when the shard is
    // touched (TouchNewShards), else by its first step.
    StateBuffer<uint8_t> grad_stage, cast_stage;
    // cast_stage as cuda_ipc pulls read it (the newest cast's data): invalidated before the step
    // casts into cast_stage again or frees it (here too, before the buffers go).
    std::shared_ptr<CastOutput> cast_output = std::make_shared<CastOutput>();
    ShardState() = default;
    ShardState(const ShardState&) = delete;
    ShardState& operator=(const ShardState&) = delete;
    ~ShardState() { cast_output->Invalidate(); }
    std::map<int64_t, std::shared_ptr<const QuantizedShard>> versions;
    // The data buffer of the last version evicted while nobody else held it: the next version
    // is cast into it (no allocation and no page faults in the step). Step thread and commit.
    std::vector<uint8_t> spare_data;

    // The commit of a step, version 0 or a restore: `published` becomes the newest version
    // (keeping the newest `retained` versions, and older ones that are in `pinned`). Version 0
    // and restores built the state in the scratch buffers, which become the state (and are
    // then freed); a step updated the state in place (`in_place`). Under the job's lock.
    void Commit(std::shared_ptr<const QuantizedShard> published, int retained, bool in_place,
                const std::set<int64_t>& pinned) {
      if (!in_place) {
        master.swap(scratch_master);
        m.swap(scratch_m);
        v.swap(scratch_v);
        scratch_master.clear();
        scratch_m.clear();
        scratch_v.clear();
      }
      initialized = true;
      versions[published->version] = std::move(published);
      // The newest `retained` stay; older ones go unless pinned.
      size_t older = versions.size() - std::min(versions.size(), static_cast<size_t>(std::max(retained, 1)));
      for (auto it = versions.begin(); older > 0; --older) {
        if (pinned.count(it->first)) {
          ++it;
          continue;
        }
        std::shared_ptr<const QuantizedShard>& oldest = it->second;
        if (oldest.use_count() == 1) {
          // Ours alone (a pull still sending it holds another reference, and so does gRPC's
          // message until the socket took its bytes: common/grpc_chunk.h), and made mutable by
          // NewSnapshot (std::make_shared<QuantizedShard>): its buffer is reused. use_count() is
          // a relaxed load: the fence orders the last reader's accesses before our writes.
          std::atomic_thread_fence(std::memory_order_acquire);
          spare_data = std::move(const_cast<QuantizedShard&>(*oldest).data);
        }
        it = versions.erase(it);
      }
    }
  };
  struct ShardInputs {
    int32_t num_contributors = 1;
    ElementType dtype = ElementType::kFloat32;
    double loss_scale = 1.0;  // multiplied into these gradients by the trainers (1 = none)
    std::map<int32_t, std::vector<uint8_t>> by_rank;
    // A reduced push's payload CRC-32C as checked when it landed (0: not known).
    uint32_t crc32c = 0;
    // Whether the trainer sent copies of that push to the shard's replicas (copies_sent).
    bool copies_sent = false;
    // Adds `rank`'s payload unless it has one; the first payload sets the push's description.
    // True when added.
    bool Add(int32_t rank, int32_t contributors, ElementType type, double scale, std::vector<uint8_t>&& payload) {
      if (by_rank.empty()) {
        num_contributors = contributors;
        dtype = type;
        loss_scale = scale;
        crc32c = 0;  // not known for a payload added this way
        copies_sent = false;
      }
      return by_rank.emplace(rank, std::move(payload)).second;
    }
  };
  // A restore in progress: what the step thread loads before republishing.
  struct Restore {
    std::string checkpoint_id;
    std::string dir;
    v1::CheckpointManifest manifest;
  };
  struct StepInputs {
    std::map<Key, ShardInputs> shards;
    // A restore (then step is -1): the loaded state is in the shards' scratch buffers.
    bool restored = false;
    int64_t publish_version = -1;  // a restore: the version to republish
    std::map<int32_t, StepHyper> finished;  // rank -> its FinishStep's hyperparameters, per group
    int64_t first_push_ms = 0;
  };
  // A primary's forwarded input of one step for a replica shard (ForwardStepInput).
  struct ReplicaInput {
    ElementType dtype = ElementType::kFloat32;
    double loss_scale = 1.0;
    StepHyper hyper;  // per param group; empty for step -1
    std::vector<uint8_t> data;
  };
  // A trainer's copy of its reduced push for a replica shard (PushGradHeader.replica_copy),
  // CRC-checked as it landed, until the primary's forward names it.
  struct TrainerCopy {
    ElementType dtype = ElementType::kFloat32;
    double loss_scale = 1.0;
    uint32_t crc32c = 0;
    std::vector<uint8_t> data;
  };
  // What one fragment's cast needs once the step is decided.
  struct FragmentCast {
    const TensorFragment* f = nullptr;
    kernels::Fragment frag;       // the tensor's 2D view and the fragment's element range
    int64_t offset = 0;           // of the fragment inside the shard, elements
    IndexRange blocks;            // its scale blocks (FragmentScaleBlocks)
    int64_t slot = 0;             // its bytes in ShardState::scalars (layout: job_step.cc)
    std::vector<float> block_amax;  // reduced, per block of `blocks` (block-scaled formats)
    float tensor_scale = 1.0f;    // fp8 delayed: the scale to cast with
    float tensor_amax = 0.0f;     // reduced whole-tensor amax (before the MAX: this fragment's)
    bool probed = false;          // block_amax / tensor_amax hold this step's dry run already
  };
  // A decided step's update, applied in place after the decision (ApplyStep): the state is
  // written only once nothing can fail any more, so the job keeps one copy of it.
  struct StepUpdate {
    std::vector<kernels::GradView> grads;   // per shard
    std::vector<float> multipliers;         // per shard: clip factor / loss scale
    StepHyper hyper;                        // per param group
    std::vector<std::vector<FragmentCast>> casts;  // per shard, per fragment
    std::map<Key, ReplicaInput> replica_in;        // owns the replica shards' gradients
    // The new versions, allocated (and zeroed) before the apply, which allocates nothing.
    std::vector<std::shared_ptr<QuantizedShard>> snapshots;  // per shard
  };
  struct StepResult {
    bool skipped = false;
    v1::StepStats stats;
    // One per shard when not skipped: the new version (version 0 and restores), or empty
    // until ApplyStep has run `update` (every step >= 0).
    std::vector<std::shared_ptr<const QuantizedShard>> published;
    std::optional<StepUpdate> update;
    // Buffers the step no longer needs (the replicas' forwarded inputs, once applied): they
    // serve the next steps' inputs (spare_buffers_).
    std::vector<std::vector<uint8_t>> spent;
  };

  Job(std::string job_id, ResolvedJob resolved, std::string token_sha256, JobOptions options);

  // "(bucket b, shard r)", for messages.
  static std::string ShardName(int32_t bucket, int32_t shard) {
    return absl::StrCat("(bucket ", bucket, ", shard ", shard, ")");
  }
  // Routing checks shared by every data-plane call: epoch, bucket, shard ownership.
  absl::Status CheckRoute(int64_t epoch, int32_t bucket, int32_t shard) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // CheckReplicaInput under the lock.
  absl::StatusOr<bool> CheckReplicaInputLocked(const v1::ReplicaInputHeader& header) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The primary's half of replication (job_replica.cc): sends each replica of a primary shard in
  // `shards` its input of `step` (`data[i]`, the bytes the update reads). Runs while the caller
  // computes the gradient statistics; the first error, if any.
  struct Forward {
    size_t index;  // into the step's shards
    const uint8_t* data;
    ElementType dtype;
    double loss_scale;
    uint32_t crc32c = 0;        // of data, when known already (0: computed)
    bool trainer_copy = false;  // a trainer's reduced push whose copies it sent the replicas
  };
  absl::Status ForwardInputs(int64_t step, int64_t epoch, const std::vector<Forward>& forwards,
                             const std::vector<std::shared_ptr<ShardState>>& shards, const StepHyper& hyper,
                             const std::map<Key, std::vector<v1::DaemonEndpoint>>& replicas_of, absl::Time deadline,
                             int64_t* payload_bytes = nullptr);
  // The replica's half: waits (until `deadline`) for the inputs of `step` of the replica shards
  // `wanted`, then takes them. UNAVAILABLE when the job stops, DEADLINE_EXCEEDED naming the
  // shards still missing (the step then fails everywhere before its decision).
  // ABORTED when the placement moves past `epoch` (the attempt's) meanwhile.
  absl::StatusOr<std::map<Key, ReplicaInput>> TakeReplicaInputs(int64_t step, int64_t epoch,
                                                                const std::vector<Key>& wanted, absl::Time deadline);
  absl::Status ApplyPlacement(const v1::AssignShardRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::PushGradResponse> StorePush(PushSession& session);
  // UNAVAILABLE for a push of the step executing here that its attempt does not include.
  absl::Status RunsWithoutPushError(const v1::PushGradHeader& h) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // BeginPush / StorePush of a trainer's copy for a replica shard (job_replica.cc).
  absl::Status BeginTrainerCopyLocked(const v1::PushGradHeader& h, PushSession& session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::PushGradResponse> StoreTrainerCopyLocked(PushSession& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a replica's input of `step` for `key` at `epoch` must agree with, for `call`: the
  // routing and step checks of CheckReplicaInput. True when the step is decided already.
  absl::StatusOr<bool> CheckReplicaStepLocked(const char* call, int64_t epoch, const Key& key, int64_t step) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool Decided(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool Ready(int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool ShouldWake() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Tells options_.on_change (waiting calls may be answerable now).
  void Changed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.on_change) options_.on_change(job_id_);
  }
  absl::Status ErrorWithDetail(absl::Status status) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // ABORTED for a call about `step` right after a restore, when it is not the resume step.
  absl::Status RewoundError(const char* call, int64_t step) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  void RunSteps();
  // Moves (job_move.cc). The fence of CopyForMove; the error of a call routed below it.
  bool Fenced() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return fence_epoch_ > epoch_; }
  // Whether a move fenced this daemon past `epoch` (an attempt of a step at `epoch` then cannot
  // rebuild its group: the peers have gone to the newer placement).
  bool MovedOn(int64_t epoch) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return fence_epoch_ > epoch;
  }
  absl::Status FencedError(const char* call) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Called by the step thread with mu_ held while moves_in_ is not empty: copies the incoming
  // shards from their sources and installs them (releases mu_ while it copies; a failed copy is
  // retried on the next turn).
  void RunMovesIn() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step thread's scaling state from a checkpoint's or a move's copy (by tensor name).
  void ApplyScaling(const v1::CheckpointScalingState& scaling);
  // The step thread's restore (job_checkpoint.cc): loads the owned shards from the checkpoint
  // into their scratch buffers (setting `inputs.restored`) and the scaling state into the step
  // thread's copies.
  absl::Status LoadRestore(const Restore& restore, const std::vector<std::shared_ptr<ShardState>>& shards,
                           StepInputs& inputs);
  // Called by the step thread with mu_ held when restore_ is set: loads, republishes and
  // commits the restored version (or records why it failed). Releases mu_ while it works.
  void RunRestore() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Called by the step thread with mu_ held while shards_to_touch_ is not empty: allocates and
  // writes, with mu_ released, the buffers a newly assigned shard's version 0 and first step
  // write (its state, one published version, one pushed FP32 gradient), so that their page
  // faults are taken when the shard is assigned and not inside a step (docs/daemon.md, "Memory").
  void TouchNewShards() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<JobSnapshot> SnapshotAt(int64_t committed_step, absl::Time deadline);
  // The step thread's scaling state as it goes into a checkpoint.
  v1::CheckpointScalingState ScalingProto() const;
  // The unlocked part of a step (job_step.cc): everything up to the commit.
  // `is_replica`: each shard's role, read under the lock that took `inputs` (a newer placement
  // may promote a replica meanwhile; the attempt keeps the roles its inputs were taken for).
  // `replicas_of`: the replicas of the primary shards among `shards` (their forwards' targets).
  absl::StatusOr<StepResult> ExecuteStep(int64_t step, const StepInputs& inputs,
                                         const std::vector<std::shared_ptr<ShardState>>& shards,
                                         const std::vector<char>& is_replica, const std::vector<std::string>& members,
                                         int64_t epoch,
                                         const std::map<Key, std::vector<v1::DaemonEndpoint>>& replicas_of);
  // Each of `shards`' role now (1: replica), for ExecuteStep.
  std::vector<char> RolesLocked(const std::vector<std::shared_ptr<ShardState>>& shards) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    std::vector<char> roles;
    for (const auto& s : shards) roles.push_back(s->replica ? 1 : 0);
    return roles;
  }
  // Version `version` of `s`, its data and scale buffers allocated and zeroed for `casts`
  // (reusing the shard's spare buffer). Step thread.
  // One FragmentCast per fragment of `s`, in shard order, with no amaxes yet, and each its
  // slot in s.scalars.
  std::vector<FragmentCast> FragmentCasts(const ShardState& s) const;
  // Makes the shard's step buffers in state memory exist: s.scalars for `casts` and, on staged
  // memory, the cast staging (StageGradient makes the gradient's). Allocates only once;
  // RESOURCE_EXHAUSTED (nothing written) when they do not fit. Step thread.
  absl::Status EnsureStepBuffers(ShardState& s, const std::vector<FragmentCast>& casts);
  // Where the kernels write fragment `c`'s amaxes: its slots in s.scalars.
  static kernels::AmaxOutputs AmaxSlots(ShardState& s, const FragmentCast& c);
  // After the memory's Synchronize: the amaxes the kernels wrote to the slots, into `c`.
  static void TakeAmaxes(const ShardState& s, FragmentCast& c);
  // On staged memory: copies `grad` (host bytes of `numel` elements) into s.grad_stage and
  // returns the view of the copy there; on host memory, `grad` itself.
  absl::StatusOr<kernels::GradView> StageGradient(ShardState& s, kernels::GradView grad);
  std::shared_ptr<QuantizedShard> NewSnapshot(ShardState& s, const std::vector<FragmentCast>& casts,
                                              int64_t version);
  // Fills `snapshot` (from NewSnapshot) from the fragments' casts: quantized from the scratch
  // state (version 0, restores: `update` null) or, for step snapshot.version - 1, with
  // `update` (shard index `i` of it) applied to the state in place, in the cast's pass where
  // the format allows. Fails only on arguments the kernels refuse, which the layout rules out.
  absl::Status CastShard(ShardState& s, const std::vector<FragmentCast>& casts, QuantizedShard& snapshot,
                         const StepUpdate* update, size_t i);
  // Applies a decided step (ExecuteStep's result.update) to `shards` in place and quantizes
  // their new versions into result.published: the update and the cast in one pass where the
  // format allows. Runs with applying_ set, so that nothing copies the state meanwhile. It
  // allocates nothing (ExecuteStep did) and cannot fail: the kernels refuse only arguments
  // that the layout rules out (the probe, where there is one, passed the same ones). A kernel
  // error here is a bug, and the process aborts rather than keep a half-updated shard; being
  // deterministic, the replicas would fail alike, so the job falls back to its checkpoint.
  void ApplyStep(int64_t step, StepResult& result, const std::vector<std::shared_ptr<ShardState>>& shards,
                 const std::vector<char>& is_replica);
  // The job's peer group for `members` at `epoch` (job_outcome.cc): the current one, or a new
  // one at the generation the members agree on (PeerGroupFactory::Generation); true when new.
  absl::StatusOr<bool> EnsureGroup(const std::vector<std::string>& members, int64_t epoch, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Leaves a group that failed, so that peers still in its reductions fail at once, and raises
  // the shared generation past it, so that everyone rebuilds at the same key.
  void BreakGroup();
  // Tests only (mainstayd --inject-fault crash-at:...): SIGKILLs this process, after logging
  // what(), when options_.faults hold a crash at `phase` for progress `s` and a daemon that holds
  // a primary shard of the job (`holds_primary`) or a replica (`holds_replica`). The Locked
  // form reads the roles from shards_.
  void CrashIfInjected(StepFault::Phase phase, int64_t s, bool holds_primary, bool holds_replica,
                       absl::FunctionRef<std::string()> what) const;
  void CrashIfInjectedLocked(StepFault::Phase phase, int64_t s, absl::FunctionRef<std::string()> what) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Runs one of step `step`'s peer reductions (`index` 0: stats SUM, 1: amax MAX). GetStepOutcome
  // answers RUNNING meanwhile; when it completes, `decided` says whether its result fixes the
  // step's outcome and fills the decision, which is recorded before anyone can ask.
  absl::Status RunReduction(int64_t step, int index, const std::function<absl::Status()>& reduce,
                            const std::function<bool(v1::StepDecision*)>& decided);
  // A reduction of `step` failed here with `cause`: leaves the group, then asks the step's other
  // `members` (those of the placement it runs at, not a newer one's) until one holds the step's
  // decision (returned; this daemon finishes the step with it) or every one answers UNDECIDED
  // (returns `cause`: every daemon gives the step up). Waits while a member still in the
  // placement is unreachable or still reducing; one that has left it (dead, or moved away) and
  // cannot be reached in three rounds counts as UNDECIDED. UNAVAILABLE when the job stops
  // meanwhile.
  absl::StatusOr<v1::StepDecision> LearnDecision(int64_t step, const std::vector<std::string>& members,
                                                 const absl::Status& cause);
  // With replicas, before a decided step is committed and acknowledged: makes sure every member
  // holds its decision, so that no replica can give up a step a trainer was told is committed
  // (docs/architecture.md, "Replicas"). A one-value barrier on the group, which each member
  // enters only once it holds the decision; if it fails (or the group is already broken), asks
  // the step's other `members` (GetStepOutcome) until each one still in the placement answers
  // DECIDED. A daemon that joined the placement since (a new replica, a move's target) took no
  // part in the step and is not asked. UNAVAILABLE when the job stops meanwhile.
  absl::Status ConfirmDecisionHeld(int64_t step, const std::vector<std::string>& members);
  // A FinishStep's hyperparameters, one entry per param group, checked (INVALID_ARGUMENT).
  absl::StatusOr<StepHyper> RequestHyper(const v1::FinishStepRequest& request) const;
  // The other daemons of `members`, with their endpoints (just the id where none is known).
  std::vector<v1::DaemonEndpoint> PeersLocked(const std::vector<std::string>& members) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  bool IsMemberLocked(const std::string& daemon_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return std::find(members_.begin(), members_.end(), daemon_id) != members_.end();
  }

  const std::string job_id_;
  const ResolvedJob job_;
  const std::string token_sha256_;
  std::string reader_sha256_ ABSL_GUARDED_BY(mu_);  // of the reader token; empty: none
  struct Pin {
    int64_t version = 0;
    int64_t expires_unix_ms = 0;
  };
  std::map<uint64_t, Pin> pins_ ABSL_GUARDED_BY(mu_);  // by pin id
  // The versions of the pins that have not expired (expired ones are forgotten).
  std::set<int64_t> PinnedVersionsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PullParams once the token is checked.
  absl::StatusOr<PullResult> PullAfterTokenCheck(const v1::PullParamsRequest& request, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  const JobOptions options_;
  const ReductionPlan plan_;
  const int32_t num_groups_;  // NumParamGroups(job_.layout)

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Key, std::string> owners_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::vector<std::string>> replicas_ ABSL_GUARDED_BY(mu_);  // daemon ids, by shard
  // Forwarded inputs of replica shards not applied yet: step -> shard -> input (the newest
  // attempt's). Taken by the step thread; dropped once the step is decided.
  std::map<int64_t, std::map<Key, ReplicaInput>> replica_inputs_ ABSL_GUARDED_BY(mu_);
  // Trainers' copies of their pushes for replica shards: step -> shard -> copy (the newest).
  // Taken by AdoptTrainerCopy; dropped once the step is decided or the shard's role changes.
  std::map<int64_t, std::map<Key, TrainerCopy>> trainer_copies_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> copy_miss_logged_{false};  // a primary's first forward that sent the payload after all
  std::vector<std::string> members_ ABSL_GUARDED_BY(mu_);  // sorted daemon ids of the placement
  std::map<std::string, v1::DaemonEndpoint> endpoints_ ABSL_GUARDED_BY(mu_);  // of the members
  std::map<Key, std::shared_ptr<ShardState>> shards_ ABSL_GUARDED_BY(mu_);
  // Moves: shards the placement gave to another daemon, kept for its copy until DropShard;
  // shards to copy from their sources; the epoch this daemon was fenced at by a copy.
  std::map<Key, std::shared_ptr<ShardState>> moving_out_ ABSL_GUARDED_BY(mu_);
  // Shards this daemon let go since it last installed them: given to another daemon by a
  // placement, or copied away under a fence. Given back with `from_peer`, they are copied anew.
  std::set<Key> released_ ABSL_GUARDED_BY(mu_);
  struct MoveIn {
    v1::DaemonEndpoint source;
    std::vector<Key> keys;
    int64_t epoch = 0;
  };
  std::vector<MoveIn> moves_in_ ABSL_GUARDED_BY(mu_);
  // Why the last attempt to load state (a copy from a peer, a restore) failed; cleared when one
  // succeeds. Reported in Progress while loading (JobProgress.load_error).
  absl::Status load_error_ ABSL_GUARDED_BY(mu_);
  int64_t fence_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_step_ ABSL_GUARDED_BY(mu_) = -1;       // the step the engine waits for
  int64_t executing_step_ ABSL_GUARDED_BY(mu_) = -2;  // the step running unlocked, or -2
  int64_t executing_epoch_ ABSL_GUARDED_BY(mu_) = 0;  // the placement epoch it runs at
  std::set<std::tuple<int32_t, int32_t, int32_t>> executing_keys_ ABSL_GUARDED_BY(mu_);
  // Its hyperparameters, when a trainer's FinishStep gave them (a replica-only attempt has them
  // from its primaries, mid-step).
  std::optional<StepHyper> executing_hyper_ ABSL_GUARDED_BY(mu_);
  int64_t committed_step_ ABSL_GUARDED_BY(mu_) = -1;  // last decided step (committed or skipped)
  int64_t version_ ABSL_GUARDED_BY(mu_) = -1;         // newest published version
  std::map<int64_t, StepInputs> pending_ ABSL_GUARDED_BY(mu_);
  // Input buffers of the last committed step, reused by pushes of the same size (BeginPush).
  std::vector<std::vector<uint8_t>> spare_buffers_ ABSL_GUARDED_BY(mu_);
  // Shards assigned empty (not moved in, not restored) whose buffers the step thread has not
  // touched yet (TouchNewShards).
  std::vector<std::shared_ptr<ShardState>> shards_to_touch_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, v1::StepStats> stats_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, absl::Status> failures_ ABSL_GUARDED_BY(mu_);
  // Failed attempts of each undecided step, and the last one's status. Unlike failures_, a new
  // push does not clear it: a FinishStep that waited through a failed attempt learns of it even
  // when another rank's push has already started the next attempt (RecordFailureLocked).
  std::map<int64_t, std::pair<int64_t, absl::Status>> failed_attempts_ ABSL_GUARDED_BY(mu_);
  // The pushes, (shard, rank), that failed attempts of each undecided step dropped here (or
  // found lost with a move's source). A rank's FinishStep that finds one of its own not pushed
  // again is ABORTED at once: it would wait for a push its trainer will not send.
  std::map<int64_t, std::set<std::pair<Key, int32_t>>> dropped_pushes_ ABSL_GUARDED_BY(mu_);
  void RecordFailureLocked(int64_t step, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    failures_[step] = status;
    auto& [count, last] = failed_attempts_[step];
    ++count;
    last = std::move(status);
  }
  // The agreed results of the newest steps' deciding reductions (GetStepOutcome), and whether a
  // reduction of executing_step_ is running now.
  std::map<int64_t, v1::StepDecision> decisions_ ABSL_GUARDED_BY(mu_);
  bool reducing_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Restore> restore_ ABSL_GUARDED_BY(mu_);  // taken by the step thread
  absl::Status restore_error_ ABSL_GUARDED_BY(mu_);         // a restore that failed
  bool restoring_ ABSL_GUARDED_BY(mu_) = false;             // from Create until the restore ends
  // The step thread is writing the shards' state in place (ApplyStep): readers of master and
  // moments (ReadShardState, SnapshotAt, CopyForMove) wait until it has committed.
  bool applying_ ABSL_GUARDED_BY(mu_) = false;
  // Copies for moves alive now (CopyForMove's views of the shards' state): ApplyStep waits for 0.
  int copies_out_ ABSL_GUARDED_BY(mu_) = 0;
  std::string restored_from_ ABSL_GUARDED_BY(mu_);
  int64_t restored_epoch_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t restored_version_ ABSL_GUARDED_BY(mu_) = -1;  // the version the restore publishes
  bool rewound_ ABSL_GUARDED_BY(mu_) = false;  // restored, and no step decided since
  v1::CheckpointScalingState committed_scaling_ ABSL_GUARDED_BY(mu_);  // as of committed_step_

  // Owned by the step thread (no lock needed).
  std::vector<DelayedScaling> delayed_;
  std::vector<float> cast_scale_;  // per tensor: the delayed scale the newest version was cast with
  LossScaleState loss_scale_;
  // Whether the last decided step clipped its gradients. While it did not, a step probes its
  // amaxes before the stats SUM, betting on no clipping, and takes the gradient statistics from
  // that pass (job_step.cc, "The probe's bet").
  bool last_step_clipped_ = false;
  std::unique_ptr<peer::PeerGroup> group_;
  int64_t group_epoch_ = -1;
  std::string group_base_;        // the key of the group's generations ("mainstay/peer/JOB/EPOCH")
  int64_t group_generation_ = 0;  // the generation group_ was built at
  std::vector<std::string> group_members_;
  bool fault_fired_ = false;      // options_.faults' lost reduction fired
  int restore_attempts_ = 0;      // failed attempts of the restore in progress (for the log)
  absl::Time restore_failing_since_;  // its first failed attempt (at restore_failing_epoch_)
  int64_t restore_failing_epoch_ = 0;

  double loss_scale_now_ ABSL_GUARDED_BY(mu_) = 1.0;  // copy for push validation
  std::thread step_thread_;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_JOB_H_

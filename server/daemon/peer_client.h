// The calls a daemon makes to its peer daemons: the agreed outcome of a step (DESIGN.md section
// 8; docs/architecture.md, "Agreed outcome of a step": a daemon whose peer reduction failed asks
// its peers whether one of them completed the step's deciding reduction, and finishes the step
// with that result instead of giving it up alone), and the copy of a shard's state that a move
// loads (docs/daemon.md, "Moves"), and a primary's forward of a step's input to its replicas
// (docs/architecture.md, "Replicas").
//
// Also the test-only fault that makes the split happen on demand (mainstayd --inject-fault).
//
// Ownership: the daemon's options hold a PeerClient they do not own.
// Thread safety: implementations are thread-safe (every job's step thread may ask at once).
#ifndef MAINSTAY_SERVER_DAEMON_PEER_CLIENT_H_
#define MAINSTAY_SERVER_DAEMON_PEER_CLIENT_H_

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "mainstay/v1/common.pb.h"
#include "mainstay/v1/shard.pb.h"
#include "server/daemon/shard_state.h"

namespace mainstay::daemon {

class PeerClient {
 public:
  virtual ~PeerClient() = default;
  // Asks `peer`'s Shard service what it holds of a step (GetStepOutcome). Errors are the
  // peer's or the transport's: UNAVAILABLE when it cannot be reached, DEADLINE_EXCEEDED when it
  // did not answer by `deadline`. The caller treats any error as "unknown" and asks again.
  virtual absl::StatusOr<v1::GetStepOutcomeResponse> GetStepOutcome(const v1::DaemonEndpoint& peer,
                                                                    const v1::GetStepOutcomeRequest& request,
                                                                    absl::Time deadline) = 0;
  // Copies a shard's whole state from `peer` (FetchShardState) for a move: the peer fences the
  // job at request.placement_epoch first (shard.proto). The masters and moments land in `land`
  // (the caller's state memory; ShardStateReader, with the layout's `shard_numel`). Errors as
  // above, plus the peer's own (FAILED_PRECONDITION when it does not hold the shard), DATA_LOSS
  // for a short stream or a copy of another size, and
  // RESOURCE_EXHAUSTED only when `land` cannot hold the copy (the transport's own
  // RESOURCE_EXHAUSTED, e.g. a message over a size limit, is reported as UNAVAILABLE).
  virtual absl::StatusOr<ShardStateCopy> FetchShardState(const v1::DaemonEndpoint& peer,
                                                         const v1::FetchShardStateRequest& request, absl::Time deadline,
                                                         kernels::StateMemory& land, int64_t shard_numel) = 0;
  // Sends a replica its primary's input of a step (ForwardStepInput): `header`, then `payload`
  // (header.total_bytes bytes) in chunks. Errors as above, plus the peer's (FAILED_PRECONDITION:
  // it holds no replica of the shard at that epoch; DATA_LOSS: the CRC did not match).
  virtual absl::Status ForwardStepInput(const v1::DaemonEndpoint& peer, const v1::ReplicaInputHeader& header,
                                        std::span<const uint8_t> payload, absl::Time deadline) = 0;
};

// A fault for tests, at `step`, of one of three kinds:
// - kLoseReduction: the daemon throws away the result of its peer reduction number `reduction`
//   (0: the gradient statistics' SUM, 1: the amaxes' MAX) after it completed, and acts as if the
//   reduction had timed out, while the other daemons got the result. That is the split the
//   agreed-outcome protocol exists for. Fires once, on the step's first attempt.
// - kDropReplicaInput: the daemon's replica shards update with a zero gradient instead of their
//   primary's forwarded input (every attempt of the step): the replicas silently diverge. The
//   mutation check of replication: the failover tests must catch it.
// - kCrash: the daemon SIGKILLs itself at `phase` of `step` (the fault matrix of
//   docs/architecture.md), if it holds the job in `role` at that moment:
//   - kInput: a trainer's push of `step` (a primary) or a primary's forward of it (a replica) was
//     stored, and not yet answered: a daemon lost mid-push;
//   - kFinish: a FinishStep of `step` arrived: lost while the trainers wait for the step;
//   - kUpdate: the update of `step` wrote the first of the daemon's shards and not the others:
//     lost mid-update, with its state half written;
//   - kDecision: its deciding reduction of `step` returned (the decision is recorded, nothing is
//     committed or acknowledged yet): lost between the last reduction and the commit;
//   - kCopy: a move's target asks it for a copy of a shard (FetchShardState) once the job has
//     committed `step`: a move's source lost mid-move;
//   - kInstall: as a move's target it fetched every shard of a copy made once `step` was
//     committed, and has not installed it: a move's (or a re-replication's) target lost mid-move;
//   - kPull: a trainer's pull of version `step` + 1 arrived, `step` decided here: lost after
//     the trainers' FinishStep returned, before they loaded the new version.
//   With `once_file`, the daemon fires only if it is the first to create that file: daemons
//   given the same file (and the same fault) crash one of them, whichever reaches it first.
struct StepFault {
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min();
  enum class Kind { kLoseReduction, kDropReplicaInput, kCrash };
  enum class Phase { kInput, kFinish, kUpdate, kDecision, kCopy, kInstall, kPull };
  enum class Role { kAny, kPrimary, kReplicaOnly };  // kPrimary: holds a primary shard of the job
  Kind kind = Kind::kLoseReduction;
  int64_t step = kNever;
  int reduction = 1;
  Phase phase = Phase::kInput;
  Role role = Role::kAny;
  std::string once_file;
  bool armed() const { return step != kNever; }
  bool Is(Kind k, int64_t s) const { return armed() && kind == k && step == s; }
};

// The faults a daemon is given (several at once: e.g. a crash and the replication mutation).
struct StepFaults {
  std::vector<StepFault> list;
  bool armed() const { return !list.empty(); }
  // Whether one of them is a `kind` fault at `step`.
  bool Is(StepFault::Kind kind, int64_t step) const;
  // Whether one of them is kLoseReduction of reduction `index` at `step`.
  bool LosesReduction(int64_t step, int index) const;
  // Whether one of them is a kCrash at `phase` that applies when the job's progress is `s` (the
  // step for kInput..kDecision, the committed step for kCopy and kInstall) and the daemon holds
  // the job's shards as said (and, with its once_file, this daemon creates that file first).
  bool CrashesAt(StepFault::Phase phase, int64_t s, bool holds_primary, bool holds_replica) const;
};

// Parses a comma-separated list of "lose-reduction:STEP:stats", "lose-reduction:STEP:amax",
// "drop-replica-input:STEP" or "crash-at:PHASE:STEP[:ROLE]" with PHASE one of input, finish,
// update, decision, copy, install and ROLE one of any (the default), primary, replica-only
// ("" or "none": no fault); `once_file` goes to the crashes. INVALID_ARGUMENT naming the
// accepted forms otherwise.
absl::StatusOr<StepFaults> ParseStepFaults(absl::string_view spec, const std::string& once_file);

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_PEER_CLIENT_H_

// Reductions among the daemons of one job (DESIGN.md sections 4, 5 and 7): the gradient
// statistics (sum of squares, non-finite count) and the amaxes whose scale spans daemons.
// Every daemon of the job takes part in every reduction of a step, in the same order, with
// vectors of the same length (a daemon that owns nothing of a tensor contributes 0).
//
// Implementations: LocalPeerGroup (a job on one daemon: reductions are the identity),
// in-process fakes for tests (fake_peer_group.h), and Gloo over TCP with rendezvous through
// the coordinator's KV (gloo_peer_group.h).
//
// Ownership: the caller owns the group Create() returns; destroying it closes this member's
// connections, which breaks the group for the other members.
// Thread safety: one PeerGroup is used by one thread at a time (the job's step thread);
// factories are thread-safe.
// Errors: a peer that dies or does not answer before the deadline gives UNAVAILABLE or
// DEADLINE_EXCEEDED; the group is then broken (every later call returns an error) and must be
// replaced (PeerGroupFactory::Create with a new generation); the step that failed changes
// nothing, and a failed reduction leaves `values` untouched. Members that disagree on a
// reduction's length or kind all get INVALID_ARGUMENT (a bug; the group stays usable).
#ifndef MAINSTAY_SERVER_PEER_PEER_GROUP_H_
#define MAINSTAY_SERVER_PEER_PEER_GROUP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mainstay::peer {

class PeerGroup {
 public:
  virtual ~PeerGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: every member ends with the elementwise sum / max over all members. The result is
  // identical on every member and does not depend on timing (a fixed reduction order).
  virtual absl::Status AllReduceSum(std::span<double> values, absl::Time deadline) = 0;
  // MAX with fmax semantics for amaxes (all inputs are >= 0 or +inf; NaN never occurs).
  virtual absl::Status AllReduceMax(std::span<float> values, absl::Time deadline) = 0;
};

// The identity group of a job on a single daemon.
class LocalPeerGroup : public PeerGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllReduceSum(std::span<double>, absl::Time) override { return absl::OkStatus(); }
  absl::Status AllReduceMax(std::span<float>, absl::Time) override { return absl::OkStatus(); }
};

// Builds the group of one job. `group_key` is unique per (job, placement epoch, generation)
// and the same on every member; `rank` is the member's index among `size` members (daemons
// sorted by daemon id). Blocks until every member has joined or `deadline` passes, or until
// `abort` (asked every few hundred milliseconds while waiting for members; may be empty)
// returns an error, which Create then returns: a member that knows the others will not come
// (they moved to a newer placement epoch or generation) leaves at once rather than at the
// deadline, so that daemons whose attempts started apart do not keep missing each other.
//
// Generations: a broken group is replaced by the next generation of its base key, and the
// members agree on which one through Generation(), never through a count of their own (a
// daemon that failed twice and one that failed once would otherwise join different keys and
// wait for each other forever). The counter is shared by every member (the coordinator's KV for
// Gloo), and only ever rises.
using AbortCheck = std::function<absl::Status()>;

class PeerGroupFactory {
 public:
  virtual ~PeerGroupFactory() = default;
  virtual absl::StatusOr<std::unique_ptr<PeerGroup>> Create(const std::string& group_key, int rank, int size,
                                                            absl::Time deadline, const AbortCheck& abort = {}) = 0;
  // The generation of `base_key` to join now, after raising it to at least `at_least`
  // (0: only read it; a member whose group of generation g broke passes g + 1). Atomic against
  // the other members' calls; UNAVAILABLE / DEADLINE_EXCEEDED when the shared counter cannot be
  // reached by `deadline`.
  virtual absl::StatusOr<int64_t> Generation(const std::string& base_key, int64_t at_least, absl::Time deadline) = 0;
};

}  // namespace mainstay::peer

#endif  // MAINSTAY_SERVER_PEER_PEER_GROUP_H_

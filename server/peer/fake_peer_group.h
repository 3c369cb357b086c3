// An in-process PeerGroupFactory: the members of a group are threads of one process that
// call Create() on the same factory with the same group_key; they meet in memory instead of
// over the network. For tests of code that uses a PeerGroup, and the yardstick for the Gloo
// implementation (same contract, no sockets).
//
// Reductions combine the members' vectors in rank order (((x0 + x1) + x2) + ...), so the result
// is the same on every member, and the same from run to run. Members that disagree on the
// length or the kind of a reduction all get INVALID_ARGUMENT and their values stay as they
// were; the group stays usable (every member saw the same failure).
//
// Ownership: the caller owns each group Create() returns. Groups share their state with the
// factory through reference counts, so either may be destroyed first. Destroying a group is
// the member's death: the other members' pending and later reductions fail with UNAVAILABLE.
//
// Thread safety: the factory is thread-safe (every member thread calls Create and Kill on the
// same instance). Each group object is used by one thread at a time, as PeerGroup requires.
//
// Errors: Create gives INVALID_ARGUMENT for a bad rank/size/key, a size that differs from the
// other members' or a rank that has already joined; DEADLINE_EXCEEDED when not every member
// joined by the deadline; UNAVAILABLE when a member was killed before the group formed. A
// reduction gives DEADLINE_EXCEEDED when this member's deadline passed first, UNAVAILABLE when
// another member died or gave up. After either, the group is broken: every later call on every
// member returns an error (the first one it saw, on this member).
#ifndef MAINSTAY_SERVER_PEER_FAKE_PEER_GROUP_H_
#define MAINSTAY_SERVER_PEER_FAKE_PEER_GROUP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/peer/peer_group.h"

namespace mainstay::peer {

class InProcessPeerGroupFactory : public PeerGroupFactory {
 public:
  InProcessPeerGroupFactory();
  ~InProcessPeerGroupFactory() override;
  InProcessPeerGroupFactory(const InProcessPeerGroupFactory&) = delete;
  InProcessPeerGroupFactory& operator=(const InProcessPeerGroupFactory&) = delete;

  // Size 1 gives a LocalPeerGroup at once. Group keys are single-use, like the generations
  // they name: a rank may join a key once.
  absl::StatusOr<std::unique_ptr<PeerGroup>> Create(const std::string& group_key, int rank, int size,
                                                    absl::Time deadline, const AbortCheck& abort = {}) override;

  // Test hook: member `rank` of `group_key` dies now, as a crashed daemon would. Its own group
  // object and every other member fail with UNAVAILABLE from now on, including calls that are
  // waiting; a Create() of the key that has not completed fails too. Works before the group
  // exists (the member then dies before joining).
  void Kill(const std::string& group_key, int rank);

  // Test hook: while held, every reduction (with `max_only`, every AllReduceMax) of every group
  // of this factory (groups of size 1 excepted) waits, ignoring its deadline, until released:
  // the members stopped between two collectives. reductions_held() says how many wait now.
  void HoldReductions(bool hold, bool max_only = false);
  int reductions_held() const;

  // An in-memory counter per base key, shared by the factory's members.
  absl::StatusOr<int64_t> Generation(const std::string& base_key, int64_t at_least, absl::Time deadline) override;

 private:
  struct Registry;
  std::shared_ptr<Registry> registry_;
};

}  // namespace mainstay::peer

#endif  // MAINSTAY_SERVER_PEER_FAKE_PEER_GROUP_H_

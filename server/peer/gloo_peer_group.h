// PeerGroupFactory over Gloo (Debian's libgloo, 0.5.0 from git 2022-05-18) with the TCP
// transport: the members rendezvous through the coordinator's KV (each publishes its pairs'
// addresses under "<group_key>/<gloo key>"), connect a full mesh, and reduce with Gloo's ring
// allreduce. Gloo stays out of this header; it is an implementation detail.
//
// Results: every element of the result is reduced on exactly one member and then copied to
// the others, so every member gets bit-identical values and the order of the additions is a
// function of (size, length) only, never of timing. That order is not rank order, so a sum may
// differ in its last bits from InProcessPeerGroupFactory's for the same inputs.
//
// Ownership: the factory does not own `kv`, which must outlive every Create() call (it may be
// null when every group has size 1). The caller owns each group Create() returns; a group owns
// its sockets and its Gloo event thread, and destroying it closes them (the other members'
// reductions then fail).
//
// Thread safety: the factory is thread-safe and keeps no state between calls. Each group is
// used by one thread at a time, as PeerGroup requires.
//
// Errors: Gloo's exceptions never escape; they become a Status. Create gives INVALID_ARGUMENT
// for a bad rank/size/key, DEADLINE_EXCEEDED when not every member published its address or
// connected by the deadline, UNAVAILABLE when the KV or a socket failed (retry with a new
// group_key). A reduction gives INVALID_ARGUMENT on every member when they disagree on its length
// or kind (the group stays usable; the values are untouched), and otherwise DEADLINE_EXCEEDED
// (a timeout on this member) or UNAVAILABLE (a peer closed its connection, or a socket error);
// after those the group is broken and returns the same error for every later call. INTERNAL
// means a Gloo invariant failed (a bug). On any error the caller's values are untouched.
//
// Signals: Gloo writes with writev(2), which raises SIGPIPE when the peer has gone. Creating a
// group and each reduction block SIGPIPE in the calling thread for their duration (and discard
// one they raised), and Gloo's event thread starts with it blocked, so a dead peer cannot kill
// the daemon; the process's signal dispositions are never changed.
#ifndef MAINSTAY_SERVER_PEER_GLOO_PEER_GROUP_H_
#define MAINSTAY_SERVER_PEER_GLOO_PEER_GROUP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/peer/kv_client.h"
#include "server/peer/peer_group.h"

namespace mainstay::peer {

struct GlooPeerGroupOptions {
  // The address this member listens on and publishes to its peers: a host name or an IP
  // literal that resolves on this machine. Ignored when `interface` is set.
  std::string hostname = "127.0.0.1";
  // A network interface ("eth0") whose first address to use instead of `hostname`.
  std::string interface;
  // Time to live of the rendezvous keys in the KV: long enough for the slowest member to join,
  // short enough that the coordinator forgets the generations of a long job.
  absl::Duration kv_ttl = absl::Hours(1);
};

class GlooPeerGroupFactory : public PeerGroupFactory {
 public:
  explicit GlooPeerGroupFactory(KvClient* kv, GlooPeerGroupOptions options = GlooPeerGroupOptions());

  // Size 1 gives a LocalPeerGroup without touching the KV or the network. Otherwise blocks
  // until every member has connected or `deadline` passes. Every member's group_key must be
  // new (a new generation): keys of an earlier attempt are still in the KV.
  // One overrun remains: Gloo fixes each socket's connect timeout when Create() starts, so a
  // member that stalls after publishing its address but before connecting can make the others
  // return up to (deadline - start) late.
  absl::StatusOr<std::unique_ptr<PeerGroup>> Create(const std::string& group_key, int rank, int size,
                                                    absl::Time deadline, const AbortCheck& abort = {}) override;
  // The counter `base_key`/generation in the KV (KvClient::RaiseCounter).
  absl::StatusOr<int64_t> Generation(const std::string& base_key, int64_t at_least, absl::Time deadline) override;

 private:
  KvClient* const kv_;
  const GlooPeerGroupOptions options_;
};

}  // namespace mainstay::peer

#endif  // MAINSTAY_SERVER_PEER_GLOO_PEER_GROUP_H_

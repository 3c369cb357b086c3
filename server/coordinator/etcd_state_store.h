// Coordinators on etcd (docs/coordinator.md, "State on etcd"): the leader election among
// coordinators that share one etcd, and the StateStore that keeps the leader's state there.
//
// Keys, under EtcdOptions::prefix P:
//   P + "leader"              the leader's id and address, attached to its lease
//   P + "state/head"          the sequence of the last batch written (its mod revision is the
//                             store's compare-and-swap token)
//   P + "state/snapshot"      a CoordinatorState (the base; absent until the first snapshot)
//   P + "state/log/<seq>"     a StateBatch, seq zero-padded to 20 digits, after the snapshot
//
// Every write is one etcd transaction that succeeds only if the leader key still has the
// create revision this coordinator's election gave it, and the head key the mod revision this
// store last wrote: so only the current leader writes, and two coordinators can never both
// commit a batch (a placement epoch, a job) on top of the same state.
#ifndef MAINSTAY_SERVER_COORDINATOR_ETCD_STATE_STORE_H_
#define MAINSTAY_SERVER_COORDINATOR_ETCD_STATE_STORE_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/coordinator/etcd_client.h"
#include "server/coordinator/state_store.h"

namespace mainstay::coordinator {

// Holding the leader key. Thread safety: Start once; the rest may be called from any thread.
class EtcdLeadership {
 public:
  // One attempt to become the leader, as `value` (id and address, shown to standbys). Returns
  // the leadership, or nullptr with *holder set to the current leader's value (a standby).
  // UNAVAILABLE when etcd does not answer.
  static absl::StatusOr<std::unique_ptr<EtcdLeadership>> TryAcquire(EtcdClient* etcd, const std::string& value,
                                                                   std::string* holder);
  // The current leader's value, or "" when nobody leads (a standby polls this, cheaply, and
  // tries TryAcquire only when it is empty). UNAVAILABLE when etcd does not answer.
  static absl::StatusOr<std::string> Holder(EtcdClient* etcd);
  // Stops the keep-alive and revokes the lease, so that a standby takes over at once.
  ~EtcdLeadership();

  // Keeps the lease alive (every TTL / 3) from a thread of its own. `on_lost` runs once, on
  // that thread, when the lease expired or could not be renewed within its TTL: from then on
  // this coordinator's writes fail (the store's fence) and it must stop.
  void Start(std::function<void(const absl::Status&)> on_lost);

  const std::string& key() const { return key_; }
  int64_t revision() const { return revision_; }  // the leader key's create revision
  int64_t lease() const { return lease_; }

 private:
  EtcdLeadership(EtcdClient* etcd, std::string key, int64_t lease, int64_t revision, absl::Time granted)
      : etcd_(etcd), key_(std::move(key)), lease_(lease), revision_(revision), granted_(granted) {}
  void KeepAliveLoop(std::function<void(const absl::Status&)> on_lost);

  EtcdClient* const etcd_;
  const std::string key_;
  const int64_t lease_;
  const int64_t revision_;
  const absl::Time granted_;  // before the lease was asked for: it runs out TTL after this at the latest
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keep_alive_;
};

// The state store of the leader holding `leadership` (which must outlive it). Nothing is read
// before Load.
std::unique_ptr<StateStore> NewEtcdStateStore(EtcdClient* etcd, const EtcdLeadership* leadership);

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_ETCD_STATE_STORE_H_

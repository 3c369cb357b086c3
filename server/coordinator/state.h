// The coordinator's in-memory state and how a StateBatch changes it. Shared by the
// coordinator (which applies every batch after the store has made it durable) and the
// stores (which replay batches on Load), so both apply changes the same way.
//
// Thread safety: a plain value; the coordinator guards its instance with its mutex.
#ifndef MAINSTAY_SERVER_COORDINATOR_STATE_H_
#define MAINSTAY_SERVER_COORDINATOR_STATE_H_

#include <map>
#include <string>

#include "mainstay/v1/state.pb.h"

namespace mainstay::coordinator {

struct State {
  int64_t sequence = 0;                            // last batch applied
  std::map<std::string, v1::DaemonInfo> daemons;   // by daemon id
  std::map<std::string, v1::StoredJob> jobs;       // by job id
  std::map<std::string, v1::KvEntry> kv;           // by key
  v1::StateCounters counters;

  void Apply(const v1::StateBatch& batch);
  v1::CoordinatorState ToProto() const;
  static State FromProto(const v1::CoordinatorState& proto);
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_STATE_H_

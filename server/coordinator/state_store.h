// Where the coordinator's state survives restarts (DESIGN.md section 6).
//
// The coordinator is write-ahead: it builds a StateBatch for a change, Appends it, and only
// when Append returns OK applies it in memory and answers the caller. Load returns the
// state as of the last batch whose Append returned OK (and possibly one more whose Append
// was interrupted by a crash after the data reached the disk).
//
// Implementations: NewMemoryStateStore (tests), OpenFileStateStore (the embedded default: a
// directory with a write-ahead log and snapshots, fsync and atomic rename). An etcd store
// would implement the same interface.
//
// Thread safety: the coordinator calls a store from one thread at a time.
#ifndef MAINSTAY_SERVER_COORDINATOR_STATE_STORE_H_
#define MAINSTAY_SERVER_COORDINATOR_STATE_STORE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mainstay/v1/state.pb.h"

namespace mainstay::coordinator {

class StateStore {
 public:
  virtual ~StateStore() = default;
  // The durable state. DATA_LOSS when the stored data is corrupt beyond a torn final write
  // (the coordinator then refuses to start rather than run on a wrong state).
  virtual absl::StatusOr<v1::CoordinatorState> Load() = 0;
  // Makes `batch` durable before returning. On error nothing of it is stored.
  virtual absl::Status Append(const v1::StateBatch& batch) = 0;
  // Stores `state` as the new base and drops the log up to state.sequence(). Atomic.
  virtual absl::Status WriteSnapshot(const v1::CoordinatorState& state) = 0;
};

std::unique_ptr<StateStore> NewMemoryStateStore();

// Opens (creating if needed) a store in `dir`: files `snapshot` and `wal`. Load replays the
// log onto the snapshot; a torn frame at the end of the log (a crash mid-append) is cut off.
absl::StatusOr<std::unique_ptr<StateStore>> OpenFileStateStore(const std::string& dir);

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_STATE_STORE_H_

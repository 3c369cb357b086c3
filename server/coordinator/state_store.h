// Where the coordinator's state survives restarts (DESIGN.md section 6).
//
// The coordinator is write-ahead with group commit: under its lock it Writes a StateBatch for
// a change (into the log, not yet durable) and, when Write returns OK, applies it in memory;
// then, without its lock, one caller at a time Syncs everything written so far, and nothing
// that depends on a batch (an answer, an assignment sent to a daemon) leaves the coordinator
// before a Sync covered it. So no fdatasync ever runs under the coordinator's lock, and one
// fdatasync covers the batches of every call that came meanwhile. Load returns the state as of
// the last batch a Sync covered (and possibly later ones whose data reached the disk before a
// crash: never acknowledged, harmless to replay).
//
// Snapshots: StartSnapshot (under the lock) takes the state as of the last batch written and
// switches later Writes to a new log; the next Sync writes the snapshot and retires the old
// log, without the lock.
//
// Implementations: NewMemoryStateStore (tests), OpenFileStateStore (the embedded default: a
// directory with a write-ahead log and snapshots, fdatasync and atomic rename). An etcd store
// would implement the same interface.
//
// Thread safety: Write and StartSnapshot are called by one thread at a time (the coordinator's
// lock), Sync by one thread at a time, and a Sync may run while a Write does. Load before
// anything else.
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
  // Adds `batch` to the log (durable at the next Sync). On error nothing of it is stored.
  virtual absl::Status Write(const v1::StateBatch& batch) = 0;
  // Makes every batch written so far durable, and completes a started snapshot. An error means
  // the log's durability is unknown and leaves the store broken (every later call
  // FAILED_PRECONDITION): the coordinator must stop. A snapshot that cannot be written is not
  // an error: it is dropped with a warning, the log stays whole, and a later one tries again.
  virtual absl::Status Sync() = 0;
  // `state` (as of the last batch written) becomes the new base at the next Sync, which drops
  // the log before it. FAILED_PRECONDITION while an earlier snapshot is not complete.
  virtual absl::Status StartSnapshot(const v1::CoordinatorState& state) = 0;

  // Write then Sync.
  absl::Status Append(const v1::StateBatch& batch) {
    absl::Status written = Write(batch);
    return written.ok() ? Sync() : written;
  }
  // StartSnapshot then Sync.
  absl::Status WriteSnapshot(const v1::CoordinatorState& state) {
    absl::Status started = StartSnapshot(state);
    return started.ok() ? Sync() : started;
  }
};

std::unique_ptr<StateStore> NewMemoryStateStore();

// Opens (creating if needed) a store in `dir`: files `snapshot`, `wal` and, while a snapshot is
// being written, `wal.next` (the log after it). Load replays the logs onto the snapshot; a torn
// frame at the end of the last log (a crash mid-append) is cut off, and a torn end of `wal`
// also drops `wal.next` (nothing in it was ever synced).
absl::StatusOr<std::unique_ptr<StateStore>> OpenFileStateStore(const std::string& dir);

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_STATE_STORE_H_

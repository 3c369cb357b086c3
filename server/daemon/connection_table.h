// The daemon's view of its trainers' data-plane connections, by transport, for the heartbeat
// (DaemonInfo.connections, `mainstayctl connections`). Connections with a lifetime (ucx) are
// opened and closed; gRPC has calls, not connections, so a (job, rank, peer) seen in a gRPC push
// or pull counts as one until it has been idle for a minute.
//
// Thread safety: every method is thread-safe.
#ifndef MAINSTAY_SERVER_DAEMON_CONNECTION_TABLE_H_
#define MAINSTAY_SERVER_DAEMON_CONNECTION_TABLE_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay::daemon {

class ConnectionTable {
 public:
  // Counts bytes for (job, rank, transport, peer); `open` adds a holder (until Close).
  void Record(const std::string& job, int32_t rank, v1::Transport transport, const std::string& peer,
              int64_t pushed_bytes, int64_t pulled_bytes, bool open = false) {
    absl::MutexLock lock(&mu_);
    Entry& e = entries_[Key{job, rank, transport, peer}];
    e.pushed += pushed_bytes;
    e.pulled += pulled_bytes;
    e.last_active = absl::Now();
    if (open) ++e.holders;
  }
  void Close(const std::string& job, int32_t rank, v1::Transport transport, const std::string& peer) {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(Key{job, rank, transport, peer});
    if (it != entries_.end() && --it->second.holders <= 0) entries_.erase(it);
  }
  // The live connections (and forgets idle call-only ones).
  std::vector<v1::DataConnection> Snapshot() {
    absl::MutexLock lock(&mu_);
    std::vector<v1::DataConnection> out;
    const absl::Time now = absl::Now();
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.holders <= 0 && now - it->second.last_active > absl::Minutes(1)) {
        it = entries_.erase(it);
        continue;
      }
      v1::DataConnection& c = out.emplace_back();
      std::tie(*c.mutable_job_id(), std::ignore, std::ignore, *c.mutable_peer()) = it->first;
      c.set_rank(std::get<1>(it->first));
      c.set_transport(std::get<2>(it->first));
      c.set_pushed_bytes(it->second.pushed);
      c.set_pulled_bytes(it->second.pulled);
      c.set_last_active_unix_ms(absl::ToUnixMillis(it->second.last_active));
      ++it;
    }
    return out;
  }

 private:
  using Key = std::tuple<std::string, int32_t, v1::Transport, std::string>;
  struct Entry {
    int64_t pushed = 0, pulled = 0;
    int holders = 0;
    absl::Time last_active;
  };
  absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_CONNECTION_TABLE_H_

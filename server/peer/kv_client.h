// The daemon's view of the coordinator's KV (coordinator.proto KvPut / KvGet), used for peer
// rendezvous. An interface so the peer group can be tested without a coordinator.
//
// Thread safety: implementations are thread-safe.
#ifndef MAINSTAY_SERVER_PEER_KV_CLIENT_H_
#define MAINSTAY_SERVER_PEER_KV_CLIENT_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mainstay::peer {

class KvClient {
 public:
  virtual ~KvClient() = default;
  // Sets key = value (overwriting), with a time to live (0 = none).
  virtual absl::Status Put(const std::string& key, const std::string& value, absl::Duration ttl) = 0;
  // The value of `key`, waiting for it to appear until `deadline` (DEADLINE_EXCEEDED).
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline) = 0;
  // Raises the decimal integer stored at `key` (absent: 0) to at least `at_least`, atomically
  // against other callers (compare-and-set), and returns the value after the call. The key has
  // no time to live. INVALID_ARGUMENT when the stored value is not an integer.
  virtual absl::StatusOr<int64_t> RaiseCounter(const std::string& key, int64_t at_least, absl::Time deadline) = 0;
};

// In-memory KV (tests, and a standalone daemon with an embedded coordinator in one process).
class InMemoryKvClient : public KvClient {
 public:
  absl::Status Put(const std::string& key, const std::string& value, absl::Duration) override {
    absl::MutexLock lock(&mu_);
    kv_[key] = value;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    auto present = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return kv_.count(key) > 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&present), deadline)) {
      return absl::DeadlineExceededError("kv: key '" + key + "' did not appear before the deadline");
    }
    return kv_.at(key);
  }
  absl::StatusOr<int64_t> RaiseCounter(const std::string& key, int64_t at_least, absl::Time) override {
    absl::MutexLock lock(&mu_);
    int64_t value = 0;
    if (auto it = kv_.find(key); it != kv_.end() && !absl::SimpleAtoi(it->second, &value)) {
      return absl::InvalidArgumentError("kv: key '" + key + "' does not hold an integer");
    }
    value = std::max(value, at_least);
    kv_[key] = std::to_string(value);
    return value;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mainstay::peer

#endif  // MAINSTAY_SERVER_PEER_KV_CLIENT_H_

// A daemon's connection to mainstay-coordinator: registration (retried until the coordinator
// answers), the lease heartbeat (re-registering under the same daemon id when the lease was
// lost), deregistration at shutdown, and the coordinator's KV as a peer::KvClient for the
// peer group's rendezvous.
//
// Thread safety: all methods are thread-safe. The heartbeat runs on a thread of its own from
// Start until Shutdown (idempotent; the destructor calls it).
#ifndef MAINSTAY_SERVER_GRPC_COORDINATOR_LINK_H_
#define MAINSTAY_SERVER_GRPC_COORDINATOR_LINK_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_tls.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "server/peer/kv_client.h"

namespace mainstay::daemon {

class CoordinatorLink : public peer::KvClient {
 public:
  struct Options {
    std::string coordinator_address;           // "host:port"
    ChannelSecurity security;                  // plaintext, TLS or mutual TLS (common/grpc_tls.h)
    v1::RegisterDaemonRequest registration;    // address, node name, transports, resources
    absl::Duration register_timeout = absl::Seconds(60);  // keep retrying UNAVAILABLE this long
    absl::Duration call_timeout = absl::Seconds(10);
    // Called with the daemon id after every (re-)registration.
    std::function<void(const v1::RegisterDaemonResponse&)> on_registered;
    // Fills the heartbeat's payload (used bytes, active jobs, job progress).
    std::function<void(v1::HeartbeatRequest*)> report;
  };

  // Registers and starts the heartbeat. UNAVAILABLE when the coordinator did not answer
  // within register_timeout; the coordinator's error otherwise.
  static absl::StatusOr<std::unique_ptr<CoordinatorLink>> Start(Options options);
  ~CoordinatorLink() override;

  std::string daemon_id() const;
  // True while the coordinator renewed the lease (registration or heartbeat) less than its TTL
  // ago; false after Shutdown and while a lost lease could not be registered again.
  bool has_live_lease() const {
    absl::MutexLock lock(&mu_);
    return !stopping_ && !lease_id_.empty() && absl::Now() - lease_renewed_ < lease_ttl_;
  }
  // Stops the heartbeat and deregisters (best effort, bounded by call_timeout).
  void Shutdown();

  absl::Status Put(const std::string& key, const std::string& value, absl::Duration ttl) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline) override;
  // KvGet, then a KvPut with expected_version, until one applies or the value is high enough.
  absl::StatusOr<int64_t> RaiseCounter(const std::string& key, int64_t at_least, absl::Time deadline) override;

  // Admin CreateCheckpoint(wait) of a job this daemon serves (checkpoint on stop), with the
  // admin token when the coordinator requires one.
  absl::StatusOr<v1::CheckpointInfo> CreateCheckpoint(const std::string& job_id, const std::string& admin_token,
                                                      absl::Time deadline);

 private:
  explicit CoordinatorLink(Options options);
  absl::Status Register(absl::Time deadline);
  void RunHeartbeat();

  const Options options_;
  std::shared_ptr<::grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::unique_ptr<v1::Admin::Stub> admin_;
  mutable absl::Mutex mu_;
  std::string daemon_id_ ABSL_GUARDED_BY(mu_);
  std::string daemon_key_ ABSL_GUARDED_BY(mu_);  // proves daemon_id_ when registering again; never logged
  std::string lease_id_ ABSL_GUARDED_BY(mu_);
  int64_t heartbeat_ms_ ABSL_GUARDED_BY(mu_) = 1000;
  absl::Time lease_renewed_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration lease_ttl_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread heartbeat_;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_GRPC_COORDINATOR_LINK_H_

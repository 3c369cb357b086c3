// The coordinator's client of etcd (docs/coordinator.md, "State on etcd"): etcd's v3 gRPC API
// (KV and Lease), over stubs generated at build time from the .proto files Debian's
// golang-etcd-server-dev ships. Only what the state store and the leader election need.
//
// Endpoints: every call goes to the endpoint that answered last; UNAVAILABLE (or no answer
// within the call's timeout) moves to the next one, until every endpoint was tried once. A
// member of a healthy etcd cluster forwards writes to its leader, so any member serves. With one
// endpoint a call waits for it to reconnect (a restart) within its timeout; with several, a
// member that is down fails at once. A keep-alive round gives each endpoint a quarter of the
// lease TTL at most, so a dead member cannot make the leader miss its renewal.
//
// Thread safety: every method may be called from any thread.
#ifndef MAINSTAY_SERVER_COORDINATOR_ETCD_CLIENT_H_
#define MAINSTAY_SERVER_COORDINATOR_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace etcdserverpb {
class RangeRequest;
class RangeResponse;
class TxnRequest;
class TxnResponse;
}  // namespace etcdserverpb

namespace mainstay::coordinator {

struct EtcdOptions {
  // "host:port" or "http://host:port" ("https://" needs ca_file). Empty: no etcd.
  std::vector<std::string> endpoints;
  // Every key the coordinator writes starts with it (several clusters can share one etcd).
  std::string prefix = "/mainstay/";
  // One call to one endpoint (it waits for a connection that long: a member restarting).
  absl::Duration call_timeout = absl::Seconds(2);
  // The leader's lease: a leader that dies is replaced within about this long.
  absl::Duration lease_ttl = absl::Seconds(5);
  // TLS to etcd: CA that verifies its members, and a client certificate if they require one.
  std::string ca_file, cert_file, key_file;
};

// Parses "--etcd-endpoints" (comma-separated): INVALID_ARGUMENT naming a bad entry.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(const std::string& text);

class EtcdClient {
 public:
  // Makes channels (no call yet): INVALID_ARGUMENT for bad options or unreadable TLS files.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(const EtcdOptions& options);
  ~EtcdClient();

  const EtcdOptions& options() const { return options_; }

  // KV.Range and KV.Txn. UNAVAILABLE when no endpoint answered; etcd's own errors otherwise.
  absl::StatusOr<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& request);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request);
  // Lease.LeaseGrant: a new lease of `ttl` (whole seconds, at least 1); its id.
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl);
  // One Lease.LeaseKeepAlive round: the lease's remaining TTL in seconds (<= 0: it expired).
  absl::StatusOr<int64_t> KeepAlive(int64_t lease);
  // Lease.LeaseRevoke (its keys go at once). Best effort.
  absl::Status RevokeLease(int64_t lease);

 private:
  struct Endpoint;
  explicit EtcdClient(EtcdOptions options);
  // Runs `call` on each endpoint in turn from the current one until one answers (anything but
  // UNAVAILABLE or DEADLINE_EXCEEDED); that one becomes current. Each try gets
  // min(`timeout`, call_timeout).
  template <typename Fn>
  absl::Status OnSomeEndpoint(const char* what, Fn call, absl::Duration timeout = absl::InfiniteDuration());

  const EtcdOptions options_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::atomic<size_t> current_{0};
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_ETCD_CLIENT_H_

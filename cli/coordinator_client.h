// How mainstayctl reaches the coordinator: address from --coordinator, else the
// MAINSTAY_COORDINATOR environment variable, else 127.0.0.1:7070; every call has a deadline
// (--timeout-ms, default 10000). Errors keep gRPC's code and say which coordinator answered.
//
// Security: --tls-ca-file / --tls-cert-file / --tls-key-file / --tls-server-name (defaults
// $MAINSTAY_TLS_CA_FILE, $MAINSTAY_TLS_CERT_FILE, $MAINSTAY_TLS_KEY_FILE) connect with TLS or
// mutual TLS (common/grpc_tls.h); --admin-token-file (default $MAINSTAY_ADMIN_TOKEN_FILE) is
// read once and sent with every call as `authorization: Bearer TOKEN` metadata, which the
// coordinator accepts in place of the requests' admin_token fields. --cluster-secret-file
// (default $MAINSTAY_CLUSTER_SECRET_FILE) presents the cluster secret (common/cluster_secret.h),
// which only `kv get` needs, on a coordinator that has one. A file that cannot be read is
// INVALID_ARGUMENT naming it (exit 2).
#ifndef MAINSTAY_CLI_COORDINATOR_CLIENT_H_
#define MAINSTAY_CLI_COORDINATOR_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cli/command.h"
#include "common/grpc_status.h"
#include "common/tls.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"

namespace mainstay::cli {

// Flags every remote command takes.
inline const std::vector<std::string> kRemoteFlags = {"coordinator",   "timeout-ms",   "json",
                                                      "yes",           "tls-ca-file",  "tls-cert-file",
                                                      "tls-key-file",  "tls-server-name", "admin-token-file",
                                                      "cluster-secret-file"};

// OK when every flag given is one of `own` or kRemoteFlags; INVALID_ARGUMENT naming the others.
inline absl::Status CheckRemoteFlags(const Args& args, std::vector<std::string> own) {
  own.insert(own.end(), kRemoteFlags.begin(), kRemoteFlags.end());
  return args.CheckKnown(own);
}

class CoordinatorConnection {
 public:
  static absl::StatusOr<CoordinatorConnection> FromArgs(const Args& args);

  const std::string& address() const { return address_; }
  v1::Coordinator::Stub& coordinator() { return *coordinator_; }
  v1::Admin::Stub& admin() { return *admin_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  const TlsOptions& tls() const { return tls_; }  // as --tls-* gave them (export's data plane)

  // A context with this connection's deadline.
  std::unique_ptr<grpc::ClientContext> Context() const;
  // `status` as absl::Status, naming the coordinator.
  absl::Status Check(const grpc::Status& status) const;

 private:
  std::string address_;
  std::string admin_token_;  // empty: none
  TlsOptions tls_;
  int64_t timeout_ms_ = 10000;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Coordinator::Stub> coordinator_;
  std::shared_ptr<v1::Admin::Stub> admin_;
};

}  // namespace mainstay::cli

#endif  // MAINSTAY_CLI_COORDINATOR_CLIENT_H_

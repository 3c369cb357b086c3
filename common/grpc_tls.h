// gRPC credentials from TlsOptions (common/tls.h): the one place where Mainstay's servers and
// clients choose between plaintext, TLS and mutual TLS.
//
// The PEM files are read and checked once, when the credentials are made (at startup), so a
// missing, unreadable or mismatched file stops the process with the path and the reason
// instead of failing every handshake later: INVALID_ARGUMENT naming the option and the path
// ("TLS certificate file /etc/x.pem: cannot read: No such file or directory", "TLS key file
// ...: does not match the certificate in ..."), also for inconsistent options (a key without a
// certificate, require_client_cert without a CA file). Binaries map INVALID_ARGUMENT to exit 2.
//
// Thread safety: the functions keep no state; a ChannelSecurity is immutable after Create and
// may be shared by threads.
#ifndef MAINSTAY_COMMON_GRPC_TLS_H_
#define MAINSTAY_COMMON_GRPC_TLS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/cluster_secret.h"
#include "common/tls.h"

namespace mainstay {

// Credentials for ServerBuilder::AddListeningPort: TLS when options.ServerEnabled() (client
// certificates required and verified against ca_file with require_client_cert), plaintext
// otherwise.
absl::StatusOr<std::shared_ptr<::grpc::ServerCredentials>> MakeServerCredentials(const TlsOptions& options);

// How a client dials servers: plaintext, or TLS verifying the server against ca_file (or the
// system's roots) and presenting cert_file when set (mutual TLS).
class ChannelSecurity {
 public:
  // Plaintext.
  ChannelSecurity();
  static absl::StatusOr<ChannelSecurity> Create(const TlsOptions& options);

  // A channel to `address` ("host:port") with these credentials and `args` (the server name
  // override is added to them when set).
  // Every call on it carries the cluster secret when one is set (WithClusterSecret).
  std::shared_ptr<::grpc::Channel> CreateChannel(const std::string& address, ::grpc::ChannelArguments args) const;
  bool tls() const { return tls_; }
  // A channel to the coordinator(s) at `addresses`: one "host:port" (or a gRPC target such as
  // dns:///name:port, whose every address is tried), or a comma-separated list of them, e.g.
  // the coordinators sharing one etcd. Calls go to the first that accepts connections (a
  // standby forwards them to the leader), and move on when it goes (gRPC's pick_first over the list's
  // addresses, resolved once here; reconnecting within a second). INVALID_ARGUMENT for a bad
  // entry or a name that does not resolve.
  absl::StatusOr<std::shared_ptr<::grpc::Channel>> CreateCoordinatorChannel(const std::string& addresses,
                                                                          ::grpc::ChannelArguments args) const;

  // The same security, presenting `secret` on every call of the channels made from it: for
  // the servers' calls to each other (common/cluster_secret.h), never for trainers or admins.
  ChannelSecurity WithClusterSecret(ClusterSecret secret) const;

 private:
  std::shared_ptr<::grpc::ChannelCredentials> credentials_;
  ClusterSecret secret_;
  std::string server_name_;
  bool tls_ = false;
};

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_GRPC_TLS_H_

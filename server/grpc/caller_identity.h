// Who a call comes from (DESIGN.md section 8): the admin token it presents, and whether it is
// one of the cluster's own servers.
//
// The admin token: the request's admin_token field when set, else the call's
// `authorization: Bearer TOKEN` metadata (calls whose request has no such field, and clients
// such as mainstayctl that set it once per connection); server/coordinator/admin_auth.h checks it.
//
// Internal peers: with mutual TLS every
// client holds a certificate from the cluster's CA, trainers included; the calls meant only for
// the coordinator and the daemons (registration, heartbeats, the KV of peer rendezvous, shard
// assignment, shard state copies) also need the caller's certificate to name
// `internal_peer_name` (its subject common name or a subject alternative name), which only the
// servers' certificates carry. Without certificates, the cluster secret does the same job:
// every server presents it (InternalPeers below).
//
// Thread safety: stateless.
#ifndef MAINSTAY_SERVER_GRPC_CALLER_IDENTITY_H_
#define MAINSTAY_SERVER_GRPC_CALLER_IDENTITY_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/cluster_secret.h"
#include "common/logging.h"

namespace mainstay::grpc_server {

// The admin token the call presents (`field`: the request's admin_token, empty when it has none).
inline std::string AdminTokenOf(const ::grpc::ServerContextBase* context, const std::string& field) {
  if (!field.empty()) return field;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  return absl::StartsWith(value, kBearer) ? std::string(value.substr(kBearer.size())) : "";
}

// Who may make the internal calls: callers whose verified client certificate names `tls_name`
// (mutual TLS), and/or callers presenting the cluster secret (common/cluster_secret.h). When
// both are set, both are required; when neither is, anyone may (a server started that way says
// so at start-up, and listens on loopback only unless --insecure: docs/operations.md).
struct InternalPeers {
  std::string tls_name;
  ClusterSecret secret;
  bool open() const { return tls_name.empty() && !secret.enabled(); }
};

// Metadata a standby coordinator adds to the calls it passes to the leader
// (server/grpc/standby_forwarder.h): its id, and the mark of a caller that is not an internal
// peer there. The leader sees the standby's certificate, so the mark is what keeps a trainer's
// call from becoming internal on the way; a caller sending the mark itself only loses rights.
inline constexpr char kForwardedByMetadata[] = "mainstay-forwarded-by";
inline constexpr char kNotInternalMetadata[] = "mainstay-not-internal";

// True when the call meets `internal` (always, when it is open) and no standby marked it as
// coming from elsewhere.
inline bool IsInternalPeer(const ::grpc::ServerContextBase* context, const InternalPeers& internal) {
  if (context->client_metadata().count(kNotInternalMetadata) != 0) return false;
  if (internal.secret.enabled()) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kClusterSecretMetadata);
    if (it == metadata.end() || !internal.secret.Matches(absl::string_view(it->second.data(), it->second.size()))) {
      return false;
    }
  }
  if (internal.tls_name.empty()) return true;
  const std::shared_ptr<const ::grpc::AuthContext> auth = context->auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return false;
  for (const char* property : {"x509_subject_alternative_name", "x509_common_name"}) {
    for (const ::grpc::string_ref& value : auth->FindPropertyValues(property)) {
      if (absl::string_view(value.data(), value.size()) == internal.tls_name) return true;
    }
  }
  return false;
}

// The start-up rule for a server whose internal calls are `internal`: when they are open to
// anyone, a listener that others can reach is INVALID_ARGUMENT unless `insecure`, and any open
// server logs a warning. `server` names it in the messages ("mainstayd", "mainstay-coordinator").
inline absl::Status CheckListenerIsSafe(const InternalPeers& internal, const std::string& listen_address, bool insecure,
                                        absl::string_view server) {
  if (!internal.open()) return absl::OkStatus();
  const bool loopback = IsLoopbackListenAddress(listen_address);
  if (!loopback && !insecure) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to listen on ", listen_address,
        " with its internal calls (shard assignment, state copies, registration) open to anyone who can reach it: "
        "give the coordinator and every daemon the same --cluster-secret-file (the coordinator creates the file "
        "if it does not exist), or mutual TLS with --tls-internal-name; --insecure accepts the risk"));
  }
  Log(LogLevel::kWarning, "security",
      absl::StrCat("INSECURE: ", server, " on ", listen_address,
                   " accepts internal calls (shard assignment, shard state copies, registration) from anyone who can "
                   "reach it: no --cluster-secret-file and no --tls-internal-name",
                   loopback ? " (loopback only)" : " (--insecure)"));
  return absl::OkStatus();
}

// How the internal calls are checked, for the servers' start-up line.
inline std::string DescribeInternalPeers(const InternalPeers& internal) {
  if (internal.open()) return "internal calls open to anyone";
  if (!internal.secret.enabled()) return absl::StrCat("internal calls need a certificate naming ", internal.tls_name);
  if (internal.tls_name.empty()) return "internal calls need the cluster secret";
  return absl::StrCat("internal calls need the cluster secret and a certificate naming ", internal.tls_name);
}

// OK for an internal peer; PERMISSION_DENIED naming `call` and what is missing otherwise.
inline absl::Status CheckInternalPeer(const ::grpc::ServerContextBase* context, const InternalPeers& internal,
                                      absl::string_view call) {
  if (IsInternalPeer(context, internal)) return absl::OkStatus();
  std::string needs;
  if (internal.secret.enabled()) needs = "the cluster secret (--cluster-secret-file)";
  if (!internal.tls_name.empty()) {
    absl::StrAppend(&needs, needs.empty() ? "" : " and ", "a client certificate naming '", internal.tls_name,
                    "' (--tls-internal-name)");
  }
  return absl::PermissionDeniedError(
      absl::StrCat(call, " is for the coordinator and daemons only: the call does not present ", needs));
}

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_CALLER_IDENTITY_H_

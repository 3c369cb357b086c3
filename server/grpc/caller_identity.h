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
// servers' certificates carry. Empty name: no such check (plaintext clusters, TLS without it).
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

// True when `internal_peer_name` is empty or the call's verified client certificate names it.
inline bool IsInternalPeer(const ::grpc::ServerContextBase* context, const std::string& internal_peer_name) {
  if (internal_peer_name.empty()) return true;
  const std::shared_ptr<const ::grpc::AuthContext> auth = context->auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return false;
  for (const char* property : {"x509_subject_alternative_name", "x509_common_name"}) {
    for (const ::grpc::string_ref& value : auth->FindPropertyValues(property)) {
      if (absl::string_view(value.data(), value.size()) == internal_peer_name) return true;
    }
  }
  return false;
}

// OK for an internal peer; PERMISSION_DENIED naming `call` otherwise.
inline absl::Status CheckInternalPeer(const ::grpc::ServerContextBase* context, const std::string& internal_peer_name,
                                      absl::string_view call) {
  if (IsInternalPeer(context, internal_peer_name)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      call, " is for the coordinator and daemons only: the client certificate does not name '", internal_peer_name,
      "' (--tls-internal-name)"));
}

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_CALLER_IDENTITY_H_

// The coordinator's admin token (DESIGN.md section 8): who may call the Admin service and the
// Coordinator calls that are not scoped by a job token (ListDaemons, ListJobs, CreateJob,
// DeleteJob, and GetJob / GetLayout / GetPlacement / WatchPlacement without a job token).
// Transport-free: the gRPC adapter (server/grpc/coordinator_service.cc) finds the presented
// token (the request's admin_token field, or the call's `authorization: Bearer TOKEN`
// metadata) and asks Check.
//
// Without a configured token every call passes (a cluster secured by its network or by mutual
// TLS alone). Neither token ever appears in a returned message or a log line.
//
// Thread safety: immutable after construction; Check may be called from any thread.
#ifndef MAINSTAY_SERVER_COORDINATOR_ADMIN_AUTH_H_
#define MAINSTAY_SERVER_COORDINATOR_ADMIN_AUTH_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mainstay::coordinator {

// Shorter tokens are refused at startup: the token is the only secret of admin calls.
inline constexpr size_t kMinAdminTokenBytes = 16;

class AdminAuth {
 public:
  // No token: every call passes.
  AdminAuth() = default;
  // `token` empty: no token. Keeps only the token's SHA-256.
  explicit AdminAuth(absl::string_view token);

  // The token in `path`, trailing whitespace (the file's newline) removed. INVALID_ARGUMENT
  // with the path and the reason when the file cannot be read, is empty or is shorter than
  // kMinAdminTokenBytes; the message never contains the file's content.
  static absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

  bool enabled() const { return enabled_; }

  // OK when no token is configured or `presented` is the token (compared in constant time,
  // as SHA-256 digests, so neither the length nor a prefix leaks). PERMISSION_DENIED otherwise,
  // naming `call` and saying how to pass the token.
  absl::Status Check(absl::string_view presented, absl::string_view call) const;

 private:
  bool enabled_ = false;
  std::string digest_;  // SHA-256 of the token
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_ADMIN_AUTH_H_

// The cluster secret (docs/operations.md, "Threat model"): a random string that the coordinator
// and every daemon hold in a file (--cluster-secret-file) and present on their calls to each
// other, so that the internal-only calls (registration, heartbeats, the peer-rendezvous KV,
// shard assignment, shard state copies, replica forwards) refuse everyone else, trainers and
// admins included, without certificates. It authenticates; it does not encrypt: on a network
// that others can read, use mutual TLS with --tls-internal-name (common/grpc_tls.h) as well.
//
// The secret travels as the `x-mainstay-cluster-secret` metadata of each internal call
// (ChannelSecurity adds it to every call of its channels once set). Servers compare digests
// in constant time and never log the value.
//
// Thread safety: ClusterSecret is immutable after it is made and may be shared by threads.
#ifndef MAINSTAY_COMMON_CLUSTER_SECRET_H_
#define MAINSTAY_COMMON_CLUSTER_SECRET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mainstay {

inline constexpr char kClusterSecretMetadata[] = "x-mainstay-cluster-secret";
inline constexpr size_t kMinClusterSecretBytes = 32;

class ClusterSecret {
 public:
  // No secret: internal calls are not checked by it (and carry none).
  ClusterSecret() = default;

  // The secret in `path` (trailing whitespace, the file's newline, removed). When the file does
  // not exist and `create` is set, a new one is made first: 32 random bytes as 64 hex digits,
  // written with mode 0600 to a temporary name, synced and renamed into place (a concurrent
  // creator's file wins; both then read the same one). Errors, all INVALID_ARGUMENT naming
  // the path and never the content: the file cannot be read or made, is empty, or is shorter
  // than kMinClusterSecretBytes. A file that other users may read is accepted with a
  // warning (Kubernetes mounts secrets 0644 unless told otherwise).
  static absl::StatusOr<ClusterSecret> Load(const std::string& path, bool create);

  // For tests and in-process servers.
  static absl::StatusOr<ClusterSecret> FromValue(absl::string_view value);

  bool enabled() const { return !value_.empty(); }
  // What a client presents (empty when disabled).
  const std::string& value() const { return value_; }
  // True when `presented` is the secret (SHA-256 digests compared in constant time, so neither
  // the length nor a prefix leaks). False when disabled.
  bool Matches(absl::string_view presented) const;

 private:
  std::string value_;
  std::string digest_;
};

// True for listen addresses only this machine can reach: 127.0.0.0/8, localhost, [::1] and
// unix: sockets ("host:port" as the --listen flags take it). 0.0.0.0, [::] and any other host
// are not.
bool IsLoopbackListenAddress(absl::string_view address);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CLUSTER_SECRET_H_

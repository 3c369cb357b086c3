#include "cli/coordinator_client.h"

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_tls.h"
#include "common/status.h"

namespace mainstay::cli {
namespace {

// --flag, else the environment variable, else empty.
std::string FlagOrEnv(const Args& args, absl::string_view flag, const char* variable) {
  const char* env = std::getenv(variable);
  return args.Get(flag, env != nullptr ? env : "");
}

absl::StatusOr<std::string> ReadAdminToken(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--admin-token-file ", path, ": cannot read: ", std::strerror(errno)));
  }
  std::string token;
  char buffer[1024];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0 && token.size() < (1 << 16)) token.append(buffer, n);
  std::fclose(f);
  absl::StripTrailingAsciiWhitespace(&token);
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--admin-token-file ", path, ": is empty"));
  return token;
}

}  // namespace

absl::StatusOr<CoordinatorConnection> CoordinatorConnection::FromArgs(const Args& args) {
  CoordinatorConnection c;
  const char* env = std::getenv("MAINSTAY_COORDINATOR");
  c.address_ = args.Get("coordinator", env != nullptr && *env != '\0' ? env : "127.0.0.1:7070");
  MAINSTAY_ASSIGN_OR_RETURN(c.timeout_ms_, args.GetInt("timeout-ms", 10000));
  if (c.timeout_ms_ <= 0) return absl::InvalidArgumentError("--timeout-ms: must be > 0");
  TlsOptions tls;
  tls.ca_file = FlagOrEnv(args, "tls-ca-file", "MAINSTAY_TLS_CA_FILE");
  tls.cert_file = FlagOrEnv(args, "tls-cert-file", "MAINSTAY_TLS_CERT_FILE");
  tls.key_file = FlagOrEnv(args, "tls-key-file", "MAINSTAY_TLS_KEY_FILE");
  tls.server_name = args.Get("tls-server-name");
  c.tls_ = tls;
  MAINSTAY_ASSIGN_OR_RETURN(ChannelSecurity security, ChannelSecurity::Create(tls));
  if (const std::string path = FlagOrEnv(args, "cluster-secret-file", "MAINSTAY_CLUSTER_SECRET_FILE"); !path.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(ClusterSecret secret, ClusterSecret::Load(path, /*create=*/false));
    security = security.WithClusterSecret(std::move(secret));
  }
  if (const std::string path = FlagOrEnv(args, "admin-token-file", "MAINSTAY_ADMIN_TOKEN_FILE"); !path.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(c.admin_token_, ReadAdminToken(path));
  }
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(256 << 20);
  MAINSTAY_ASSIGN_OR_RETURN(c.channel_, security.CreateCoordinatorChannel(c.address_, channel_args));
  c.coordinator_ = v1::Coordinator::NewStub(c.channel_);
  c.admin_ = v1::Admin::NewStub(c.channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> CoordinatorConnection::Context() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms_));
  if (!admin_token_.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", admin_token_));
  return context;
}

absl::Status CoordinatorConnection::Check(const grpc::Status& status) const {
  return Annotate(FromGrpcStatus(status), absl::StrCat("coordinator ", address_));
}

}  // namespace mainstay::cli

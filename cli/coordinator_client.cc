#include "cli/coordinator_client.h"

#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace mainstay::cli {

absl::StatusOr<CoordinatorConnection> CoordinatorConnection::FromArgs(const Args& args) {
  CoordinatorConnection c;
  const char* env = std::getenv("MAINSTAY_COORDINATOR");
  c.address_ = args.Get("coordinator", env != nullptr && *env != '\0' ? env : "127.0.0.1:7070");
  MAINSTAY_ASSIGN_OR_RETURN(c.timeout_ms_, args.GetInt("timeout-ms", 10000));
  if (c.timeout_ms_ <= 0) return absl::InvalidArgumentError("--timeout-ms: must be > 0");
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(256 << 20);
  c.channel_ = grpc::CreateCustomChannel(c.address_, grpc::InsecureChannelCredentials(), channel_args);
  c.coordinator_ = v1::Coordinator::NewStub(c.channel_);
  c.admin_ = v1::Admin::NewStub(c.channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> CoordinatorConnection::Context() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms_));
  return context;
}

absl::Status CoordinatorConnection::Check(const grpc::Status& status) const {
  return Annotate(FromGrpcStatus(status), absl::StrCat("coordinator ", address_));
}

}  // namespace mainstay::cli

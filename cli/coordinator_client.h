// How mainstayctl reaches the coordinator: address from --coordinator, else the
// MAINSTAY_COORDINATOR environment variable, else 127.0.0.1:7070; every call has a deadline
// (--timeout-ms, default 10000). Errors keep gRPC's code and say which coordinator answered.
#ifndef MAINSTAY_CLI_COORDINATOR_CLIENT_H_
#define MAINSTAY_CLI_COORDINATOR_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cli/command.h"
#include "common/grpc_status.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"

namespace mainstay::cli {

// Flags every remote command takes.
inline const std::vector<std::string> kRemoteFlags = {"coordinator", "timeout-ms", "json", "yes"};

class CoordinatorConnection {
 public:
  static absl::StatusOr<CoordinatorConnection> FromArgs(const Args& args);

  const std::string& address() const { return address_; }
  v1::Coordinator::Stub& coordinator() { return *coordinator_; }
  v1::Admin::Stub& admin() { return *admin_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

  // A context with this connection's deadline.
  std::unique_ptr<grpc::ClientContext> Context() const;
  // `status` as absl::Status, naming the coordinator.
  absl::Status Check(const grpc::Status& status) const;

 private:
  std::string address_;
  int64_t timeout_ms_ = 10000;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::Coordinator::Stub> coordinator_;
  std::shared_ptr<v1::Admin::Stub> admin_;
};

}  // namespace mainstay::cli

#endif  // MAINSTAY_CLI_COORDINATOR_CLIENT_H_

// A plaintext port that serves nothing but grpc.health.v1, mirroring the statuses of a server
// whose own port speaks TLS: Kubernetes' native gRPC probes (and grpc_health_probe without
// flags) cannot do TLS, let alone present a client certificate. Health statuses are no secret;
// every other service stays on the TLS port only.
//
// Thread safety: every method is thread-safe; Shutdown is idempotent (the destructor calls
// it), after it the statuses no longer change.
#ifndef MAINSTAY_SERVER_GRPC_HEALTH_PORT_H_
#define MAINSTAY_SERVER_GRPC_HEALTH_PORT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mainstay::grpc_server {

class HealthPort {
 public:
  // "host:port" (port 0 picks one). UNAVAILABLE when it cannot be bound. Every service starts
  // NOT_SERVING.
  static absl::StatusOr<std::unique_ptr<HealthPort>> Start(const std::string& listen_address);
  ~HealthPort();

  int port() const { return port_; }
  void SetServingStatus(const std::string& service, bool serving);
  // Every service at once.
  void SetServingStatus(bool serving);
  void Shutdown();

 private:
  HealthPort() = default;
  absl::Mutex mu_;
  std::unique_ptr<::grpc::Server> server_ ABSL_GUARDED_BY(mu_);
  int port_ = 0;
};

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_HEALTH_PORT_H_

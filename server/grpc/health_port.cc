#include "server/grpc/health_port.h"

#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mainstay::grpc_server {

absl::StatusOr<std::unique_ptr<HealthPort>> HealthPort::Start(const std::string& listen_address) {
  std::unique_ptr<HealthPort> health(new HealthPort());
  ::grpc::EnableDefaultHealthCheckService(true);
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(listen_address, ::grpc::InsecureServerCredentials(), &health->port_);
  std::unique_ptr<::grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || health->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("health port: cannot listen on ", listen_address,
                                               " (address in use or not local?)"));
  }
  if (::grpc::HealthCheckServiceInterface* service = server->GetHealthCheckService(); service != nullptr) {
    service->SetServingStatus(false);
  }
  absl::MutexLock lock(&health->mu_);
  health->server_ = std::move(server);
  return health;
}

HealthPort::~HealthPort() { Shutdown(); }

void HealthPort::SetServingStatus(const std::string& service, bool serving) {
  absl::MutexLock lock(&mu_);
  if (server_ == nullptr) return;
  if (::grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(service, serving);
  }
}

void HealthPort::SetServingStatus(bool serving) {
  absl::MutexLock lock(&mu_);
  if (server_ == nullptr) return;
  if (::grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(serving);
  }
}

void HealthPort::Shutdown() {
  std::unique_ptr<::grpc::Server> server;
  {
    absl::MutexLock lock(&mu_);
    server = std::move(server_);
  }
  if (server == nullptr) return;
  if (::grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService(); health != nullptr) {
    health->Shutdown();
  }
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
  server->Wait();
}

}  // namespace mainstay::grpc_server

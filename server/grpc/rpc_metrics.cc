#include "server/grpc/rpc_metrics.h"

#include <string>

#include "absl/status/status.h"

namespace mainstay::grpc_server {
namespace {

class RpcCounter final : public ::grpc::experimental::Interceptor {
 public:
  RpcCounter(metrics::CoordinatorMetrics* metrics, const char* method)
      : metrics_(metrics), method_(method != nullptr && method[0] == '/' ? method + 1 : (method ? method : "")) {}

  void Intercept(::grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(::grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const auto code = static_cast<absl::StatusCode>(methods->GetSendStatus().error_code());
      metrics_->RpcFinished(method_, absl::StatusCodeToString(code));
    }
    methods->Proceed();
  }

 private:
  metrics::CoordinatorMetrics* const metrics_;
  const std::string method_;
};

class RpcCounterFactory final : public ::grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcCounterFactory(metrics::CoordinatorMetrics* metrics) : metrics_(metrics) {}
  ::grpc::experimental::Interceptor* CreateServerInterceptor(::grpc::experimental::ServerRpcInfo* info) override {
    return new RpcCounter(metrics_, info->method());
  }

 private:
  metrics::CoordinatorMetrics* const metrics_;
};

}  // namespace

std::unique_ptr<::grpc::experimental::ServerInterceptorFactoryInterface> MakeRpcCounter(
    metrics::CoordinatorMetrics* metrics) {
  return std::make_unique<RpcCounterFactory>(metrics);
}

}  // namespace mainstay::grpc_server

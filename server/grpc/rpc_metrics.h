// Counts every finished RPC of a gRPC server by method and status code (the coordinator's
// mainstay_coordinator_rpcs_total), as a server interceptor, so no handler has to remember it.
//
// Ownership: the returned factory is handed to ServerBuilder; `metrics` is not owned and must
// outlive the server. Thread safety: interceptors run on gRPC's threads; CoordinatorMetrics
// is thread-safe.
#ifndef MAINSTAY_SERVER_GRPC_RPC_METRICS_H_
#define MAINSTAY_SERVER_GRPC_RPC_METRICS_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "server/metrics/coordinator_metrics.h"

namespace mainstay::grpc_server {

std::unique_ptr<::grpc::experimental::ServerInterceptorFactoryInterface> MakeRpcCounter(
    metrics::CoordinatorMetrics* metrics);

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_RPC_METRICS_H_

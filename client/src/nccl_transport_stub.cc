// The nccl transport in a build without CUDA and NCCL.
#include "client/src/transport.h"

namespace mainstay::client_internal {

absl::StatusOr<std::unique_ptr<DataTransport>> MakeNcclTransport(const TransportContext&) {
  return absl::UnimplementedError("this client was built without NCCL (MAINSTAY_ENABLE_CUDA); use transport ucx or grpc");
}

}  // namespace mainstay::client_internal

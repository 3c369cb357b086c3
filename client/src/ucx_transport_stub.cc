// The ucx transport in a build without UCX (MAINSTAY_ENABLE_UCX=OFF or UCX not found).
#include "client/src/transport.h"

namespace mainstay::client_internal {

absl::StatusOr<std::unique_ptr<DataTransport>> MakeUcxTransport(const TransportContext&) {
  return absl::UnimplementedError("this client was built without UCX (MAINSTAY_ENABLE_UCX); use transport grpc");
}

}  // namespace mainstay::client_internal

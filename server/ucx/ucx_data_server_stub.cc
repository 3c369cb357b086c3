// The daemon's UCX data server in a build without UCX.
#include "server/ucx/ucx_data_server.h"

namespace mainstay::daemon {

absl::StatusOr<std::unique_ptr<UcxDataServer>> UcxDataServer::Start(Options) {
  return absl::UnimplementedError("this mainstayd was built without UCX (MAINSTAY_ENABLE_UCX)");
}

}  // namespace mainstay::daemon

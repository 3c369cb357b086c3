// The daemon's nccl transport in a build without CUDA and NCCL.
#include "server/nccl/nccl_channel_server.h"

namespace mainstay::daemon {

absl::StatusOr<std::unique_ptr<NcclChannelServer>> NcclChannelServer::Start(Options) {
  return absl::UnimplementedError("this mainstayd was built without NCCL (MAINSTAY_ENABLE_CUDA, MAINSTAY_ENABLE_NCCL)");
}

}  // namespace mainstay::daemon

// IpcMemory without CUDA (ipc_memory.h).
#include "server/cudaipc/ipc_memory.h"

namespace mainstay::daemon {

absl::StatusOr<std::unique_ptr<IpcMemory>> MakeCudaIpcMemory(int device) {
  return absl::UnimplementedError("this mainstayd was built without CUDA: no cuda_ipc transport");
}

}  // namespace mainstay::daemon

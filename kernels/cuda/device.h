// What the CUDA runtime sees: used by the daemon to decide where shards live, and by gpu
// tests to skip without a device.
//
// Thread safety: every function may be called from any thread.
#ifndef MAINSTAY_KERNELS_CUDA_DEVICE_H_
#define MAINSTAY_KERNELS_CUDA_DEVICE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mainstay::cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;            // e.g. "NVIDIA H200"
  int compute_capability = 0;  // major * 10 + minor, e.g. 90
  size_t total_memory = 0;     // bytes
};

// Visible devices; an empty list (not an error) when there is no device or no driver.
absl::StatusOr<std::vector<DeviceInfo>> ListDevices();

// Runs a tiny kernel on `ordinal` and checks its result: proves the fatbinary holds code
// for this device's architecture. INTERNAL with CUDA's message otherwise.
absl::Status SelfTest(int ordinal);

}  // namespace mainstay::cuda

#endif  // MAINSTAY_KERNELS_CUDA_DEVICE_H_

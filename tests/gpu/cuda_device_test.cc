// Proves the CUDA build: the fatbinary runs on the device that is present.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/cuda/device.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::cuda {
namespace {

using ::mainstay::testing::IsOk;

std::vector<DeviceInfo> DevicesOrSkip() {
  absl::StatusOr<std::vector<DeviceInfo>> devices = ListDevices();
  EXPECT_THAT(devices, IsOk());
  return devices.ok() ? *devices : std::vector<DeviceInfo>{};
}

TEST(CudaDeviceTest, KernelRunsOnEveryDevice) {
  std::vector<DeviceInfo> devices = DevicesOrSkip();
  if (devices.empty()) GTEST_SKIP() << "no CUDA device";
  for (const DeviceInfo& d : devices) {
    SCOPED_TRACE(d.name);
    std::printf("device %d: %s sm_%d %.1f GiB\n", d.ordinal, d.name.c_str(), d.compute_capability,
                d.total_memory / 1073741824.0);
    EXPECT_GT(d.total_memory, 0u);
    EXPECT_THAT(SelfTest(d.ordinal), IsOk());
  }
}

}  // namespace
}  // namespace mainstay::cuda

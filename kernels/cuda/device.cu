#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_status.h"

namespace mainstay::cuda {
namespace {

__global__ void FillIota(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i * 3 + 1;
}

}  // namespace

absl::StatusOr<std::vector<DeviceInfo>> ListDevices() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();  // clear the sticky error
    return std::vector<DeviceInfo>{};
  }
  MAINSTAY_CUDA_RETURN_IF_ERROR(error);
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    MAINSTAY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i));
    devices.push_back({i, prop.name, prop.major * 10 + prop.minor, prop.totalGlobalMem});
  }
  return devices;
}

absl::Status SelfTest(int ordinal) {
  constexpr int kN = 1000;
  MAINSTAY_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  int* device = nullptr;
  MAINSTAY_CUDA_RETURN_IF_ERROR(cudaMalloc(&device, kN * sizeof(int)));
  FillIota<<<(kN + 255) / 256, 256>>>(device, kN);
  absl::Status status = CudaStatus(cudaGetLastError(), "FillIota<<<>>>");
  std::vector<int> host(kN, 0);
  if (status.ok()) {
    status = CudaStatus(cudaMemcpy(host.data(), device, kN * sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  (void)cudaFree(device);
  if (!status.ok()) return status;
  for (int i = 0; i < kN; ++i) {
    if (host[i] != i * 3 + 1) {
      return absl::InternalError(absl::StrCat("SelfTest: element ", i, " is ", host[i], ", expected ", i * 3 + 1));
    }
  }
  return absl::OkStatus();
}

}  // namespace mainstay::cuda

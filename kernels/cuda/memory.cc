// CudaStateMemory: shard state in CUDA managed memory that prefers one device, and the stream
// the daemon's step runs on there.
#include "kernels/memory.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device.h"

namespace mainstay::kernels {
namespace {

using ::mainstay::cuda::CudaStatus;

class CudaMemory final : public StateMemory {
 public:
  CudaMemory(int ordinal, cudaStream_t stream, std::string description, int64_t capacity)
      : description_(std::move(description)), capacity_(capacity) {
    device_.kind = Device::Kind::kCuda;
    device_.ordinal = ordinal;
    device_.stream = stream;
  }
  ~CudaMemory() override {
    (void)cudaSetDevice(device_.ordinal);
    (void)cudaStreamSynchronize(stream());
    (void)cudaStreamDestroy(stream());
  }

  const Device& device() const override { return device_; }
  bool staged() const override { return true; }
  std::string Describe() const override { return description_; }
  int64_t capacity_bytes() const override { return capacity_; }

  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("Allocate: ", bytes, " bytes (must be > 0)"));
    MAINSTAY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_.ordinal));
    void* block = nullptr;
    const cudaError_t e = cudaMallocManaged(&block, static_cast<size_t>(bytes), cudaMemAttachGlobal);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("out of CUDA managed memory allocating ", bytes, " bytes of shard state on ", description_));
    }
    MAINSTAY_RETURN_IF_ERROR(CudaStatus(e, "cudaMallocManaged"));
    cudaMemLocation here{};
    here.type = cudaMemLocationTypeDevice;
    here.id = device_.ordinal;
    // The pages live on the device; the host's reads (checkpoints, moves) migrate them there
    // and back. Zeroed and made resident on the device now, not by the step's first kernel.
    absl::Status s = CudaStatus(
        cudaMemAdvise(block, static_cast<size_t>(bytes), cudaMemAdviseSetPreferredLocation, here), "cudaMemAdvise");
    if (s.ok()) {
      s = CudaStatus(cudaMemPrefetchAsync(block, static_cast<size_t>(bytes), here, 0, stream()),
                     "cudaMemPrefetchAsync");
    }
    if (s.ok()) s = CudaStatus(cudaMemsetAsync(block, 0, static_cast<size_t>(bytes), stream()), "cudaMemsetAsync");
    if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    if (!s.ok()) {
      (void)cudaFree(block);
      return s;
    }
    return block;
  }
  void Free(void* block) override {
    if (block == nullptr) return;
    (void)cudaSetDevice(device_.ordinal);
    (void)cudaFree(block);  // synchronizes with the device's work
  }
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes <= 0) return absl::OkStatus();
    MAINSTAY_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_.ordinal));
    return CudaStatus(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream()),
                      "cudaMemcpyAsync");
  }
  absl::Status Synchronize() override { return kernels::Synchronize(device_); }

 private:
  cudaStream_t stream() const { return static_cast<cudaStream_t>(device_.stream); }

  Device device_;
  const std::string description_;
  const int64_t capacity_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StateMemory>> CudaStateMemory(int ordinal) {
  absl::StatusOr<std::vector<mainstay::cuda::DeviceInfo>> devices = mainstay::cuda::ListDevices();
  if (!devices.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal, ": CUDA cannot list its devices: ", devices.status().message()));
  }
  if (ordinal < 0 || ordinal >= static_cast<int>(devices->size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal, ": no such CUDA device; CUDA sees ", devices->size(),
                     devices->empty() ? " (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)" : "",
                     devices->empty() ? "" : absl::StrCat(" (cuda:0..cuda:", devices->size() - 1, ")")));
  }
  if (absl::Status s = mainstay::cuda::SelfTest(ordinal); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cuda:", ordinal,
                                                      ": the device does not run this build's "
                                                      "kernels (built for other architectures?): ",
                                                      s.message()));
  }
  int concurrent = 0;
  MAINSTAY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, ordinal));
  if (concurrent == 0) {
    // Without it the host may not touch managed memory while any kernel runs, and the daemon's
    // checkpoints and moves read shard state beside the step.
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal,
                     ": the device lacks concurrent managed access (cudaDevAttrConcurrentManagedAccess = 0), "
                     "which the daemon's shard state needs; run with --device cpu"));
  }
  MAINSTAY_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  MAINSTAY_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  cudaStream_t stream = nullptr;
  MAINSTAY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const mainstay::cuda::DeviceInfo& info = (*devices)[static_cast<size_t>(ordinal)];
  return std::make_unique<CudaMemory>(
      ordinal, stream,
      absl::StrFormat("cuda:%d (%s, sm_%d, %.0f GiB)", ordinal, info.name, info.compute_capability,
                      static_cast<double>(total_bytes) / (1 << 30)),
      static_cast<int64_t>(free_bytes));
}

}  // namespace mainstay::kernels

// CUDA's IpcMemory (ipc_memory.h): cudaIpcOpenMemHandle on the daemon's device, the allocation's
// size from the driver (cuMemGetAddressRange, reached through the runtime's entry-point query so
// that mainstayd does not link libcuda), each copy on a non-blocking stream of its own (it waits
// for nothing else the daemon runs; the push and pull threads are short-lived, so no stream is
// kept).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/cudaipc/ipc_memory.h"

namespace mainstay::daemon {
namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr p);

std::string CudaError(cudaError_t e) { return absl::StrCat(cudaGetErrorName(e), ": ", cudaGetErrorString(e)); }

class CudaIpcMemory final : public IpcMemory {
 public:
  CudaIpcMemory(int device, GetAddressRange range) : device_(device), range_(range) {}

  int device() const override { return device_; }

  absl::StatusOr<Mapping> Open(absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("a CUDA IPC memory handle has ", sizeof(cudaIpcMemHandle_t), " bytes, got ", handle.size()));
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaSetDevice(", device_, "): ", CudaError(e)));
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* base = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it for the next call
      return absl::FailedPreconditionError(absl::StrCat(
          "cudaIpcOpenMemHandle on CUDA device ", device_, ": ", CudaError(e),
          " (the allocation must be another process's on this node, alive, and on a device this one can reach)"));
    }
    CUdeviceptr begin = 0;
    size_t bytes = 0;
    if (CUresult r = range_(&begin, &bytes, reinterpret_cast<CUdeviceptr>(base)); r != CUDA_SUCCESS) {
      cudaIpcCloseMemHandle(base);
      return absl::InternalError(absl::StrCat("cuMemGetAddressRange of an opened IPC handle: CUresult ", r));
    }
    return Mapping{base, static_cast<uint64_t>(bytes)};
  }

  absl::Status CopyToHost(const Mapping& mapping, uint64_t offset, void* dest, uint64_t bytes) override {
    return Copy(dest, static_cast<const char*>(mapping.base) + offset, bytes, cudaMemcpyDeviceToHost,
                "out of a trainer's CUDA IPC memory");
  }

  // cudaMemcpyDefault: the source is host memory (a version's host copy) or the daemon's managed
  // state memory (the cast output), which unified addressing tells apart.
  absl::Status CopyIn(const Mapping& mapping, uint64_t offset, const void* src, uint64_t bytes) override {
    return Copy(static_cast<char*>(mapping.base) + offset, src, bytes, cudaMemcpyDefault,
                "into a trainer's CUDA IPC memory");
  }

  void Close(const Mapping& mapping) override {
    if (mapping.base == nullptr) return;
    cudaSetDevice(device_);
    if (cudaIpcCloseMemHandle(mapping.base) != cudaSuccess) cudaGetLastError();
  }

 private:
  // One copy on a stream of its own, waited for.
  absl::Status Copy(void* dest, const void* src, uint64_t bytes, cudaMemcpyKind kind, const char* what) {
    if (bytes == 0) return absl::OkStatus();
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaSetDevice(", device_, "): ", CudaError(e)));
    }
    cudaStream_t stream = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(dest, src, bytes, kind, stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat("copying ", bytes, " bytes ", what, ": ", CudaError(e)));
    }
    return absl::OkStatus();
  }

  const int device_;
  const GetAddressRange range_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<IpcMemory>> MakeCudaIpcMemory(int device) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device: ", CudaError(e)));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " is not one of the ", count, " visible devices"));
  }
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found);
      e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return absl::FailedPreconditionError("the CUDA driver has no cuMemGetAddressRange");
  }
  return std::unique_ptr<IpcMemory>(new CudaIpcMemory(device, reinterpret_cast<GetAddressRange>(fn)));
}

}  // namespace mainstay::daemon

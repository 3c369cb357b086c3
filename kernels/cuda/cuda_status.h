// CUDA error codes -> absl::Status, where the call is made.
//
//   MAINSTAY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, stream));
//
// A CUDA failure becomes INTERNAL with the call text and CUDA's own error name and string,
// except "no device" / "insufficient driver", which become UNAVAILABLE (the caller may run
// on the CPU instead).
#ifndef MAINSTAY_KERNELS_CUDA_CUDA_STATUS_H_
#define MAINSTAY_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mainstay::cuda {

inline absl::Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(call, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

}  // namespace mainstay::cuda

#define MAINSTAY_CUDA_RETURN_IF_ERROR(call)                                          \
  do {                                                                               \
    ::absl::Status mainstay_cuda_status_ = ::mainstay::cuda::CudaStatus((call), #call); \
    if (!mainstay_cuda_status_.ok()) return mainstay_cuda_status_;                   \
  } while (0)

#endif  // MAINSTAY_KERNELS_CUDA_CUDA_STATUS_H_

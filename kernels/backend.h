// Internal: the functions each backend implements. kernels.cc validates every argument once
// (fragment bounds, span sizes, format support) and then calls the backend chosen by
// Device::kind, so backends may assume valid input. Not a public header.
#ifndef MAINSTAY_KERNELS_BACKEND_H_
#define MAINSTAY_KERNELS_BACKEND_H_

#include "kernels/kernels.h"

#define MAINSTAY_KERNELS_BACKEND_FUNCTIONS                                                                        \
  absl::Status ComputePartialAmax(const Device& device, Format format, Format model_dtype,                        \
                                  const Fragment& fragment, std::span<const float> master,                        \
                                  const AmaxOutputs& out);                                                         \
  absl::Status Quantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,         \
                        std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out);    \
  absl::Status Dequantize(const Device& device, Format format, const Fragment& fragment,                          \
                          const QuantizedInputs& in, std::span<float> out);                                        \
  absl::Status FusedAdamW(const Device& device, Format format, Format model_dtype, const Fragment& fragment,       \
                          GradView grad, const OptimizerState& state, const AdamWHyper& hyper,                     \
                          const StepOutputs& out);                                                                 \
  absl::Status FusedAdamWQuantize(const Device& device, Format format, Format model_dtype,                        \
                                  const Fragment& fragment, GradView grad, const OptimizerState& state,            \
                                  const AdamWHyper& hyper, const ScaleInputs& scales, const StepOutputs& out,      \
                                  const QuantizedOutputs& quantized);                                              \
  absl::Status FusedSgd(const Device& device, Format format, Format model_dtype, const Fragment& fragment,         \
                        GradView grad, const OptimizerState& state, const SgdHyper& hyper, const StepOutputs& out); \
  absl::Status GradStats(const Device& device, GradView grad, int64_t n, float multiplier, double* sum_squares,    \
                         int64_t* nonfinite);

namespace mainstay::kernels {
namespace cpu {
MAINSTAY_KERNELS_BACKEND_FUNCTIONS
}  // namespace cpu
namespace cuda {
// kernels/cuda/*.cu when CUDA is built, kernels/cuda_stub.cc (UNIMPLEMENTED) otherwise.
MAINSTAY_KERNELS_BACKEND_FUNCTIONS
absl::Status Synchronize(const Device& device);  // kernels.h Synchronize, for kCuda
}  // namespace cuda
}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_BACKEND_H_

// The CUDA backend when Mainstay is built without CUDA: every call is UNIMPLEMENTED.
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/memory.h"

namespace mainstay::kernels::cuda {
namespace {
absl::Status NotBuilt() {
  return absl::UnimplementedError("this Mainstay was built without CUDA (MAINSTAY_ENABLE_CUDA=OFF or no nvcc)");
}
}  // namespace

absl::Status ComputePartialAmax(const Device&, Format, Format, const Fragment&, std::span<const float>,
                                const AmaxOutputs&) {
  return NotBuilt();
}
absl::Status Quantize(const Device&, Format, Format, const Fragment&, std::span<const float>, const ScaleInputs&,
                      const QuantizedOutputs&) {
  return NotBuilt();
}
absl::Status Dequantize(const Device&, Format, const Fragment&, const QuantizedInputs&, std::span<float>) {
  return NotBuilt();
}
absl::Status FusedAdamW(const Device&, Format, Format, const Fragment&, GradView, const OptimizerState&,
                        const AdamWHyper&, const StepOutputs&) {
  return NotBuilt();
}
absl::Status FusedAdamWQuantize(const Device&, Format, Format, const Fragment&, GradView, const OptimizerState&,
                                const AdamWHyper&, const ScaleInputs&, const StepOutputs&, const QuantizedOutputs&) {
  return NotBuilt();
}
absl::Status FusedSgd(const Device&, Format, Format, const Fragment&, GradView, const OptimizerState&, const SgdHyper&,
                      const StepOutputs&) {
  return NotBuilt();
}
absl::Status GradStats(const Device&, GradView, int64_t, float, double*, int64_t*) { return NotBuilt(); }
absl::Status Synchronize(const Device&) { return NotBuilt(); }

}  // namespace mainstay::kernels::cuda

namespace mainstay::kernels {
absl::StatusOr<std::unique_ptr<StateMemory>> CudaStateMemory(int ordinal) {
  return absl::UnimplementedError(absl::StrCat("cuda:", ordinal,
                                               ": this Mainstay was built without CUDA "
                                               "(MAINSTAY_ENABLE_CUDA=OFF or no nvcc); run with --device cpu"));
}
}  // namespace mainstay::kernels

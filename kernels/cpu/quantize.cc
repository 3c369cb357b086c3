// PLACEHOLDER being replaced by the real implementation.
#include "kernels/backend.h"

namespace mainstay::kernels::cpu {
static absl::Status Todo() { return absl::UnimplementedError("in progress"); }
absl::Status ComputePartialAmax(const Device&, Format, Format, const Fragment&, std::span<const float>,
                                const AmaxOutputs&) { return Todo(); }
absl::Status Quantize(const Device&, Format, Format, const Fragment&, std::span<const float>, const ScaleInputs&,
                      const QuantizedOutputs&) { return Todo(); }
absl::Status Dequantize(const Device&, Format, const Fragment&, const QuantizedInputs&, std::span<float>) { return Todo(); }
}  // namespace mainstay::kernels::cpu

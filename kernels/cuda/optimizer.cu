// PLACEHOLDER being replaced by the real implementation.
#include "kernels/backend.h"

namespace mainstay::kernels::cuda {
static absl::Status Todo() { return absl::UnimplementedError("in progress"); }
absl::Status FusedAdamW(const Device&, Format, Format, const Fragment&, GradView, const OptimizerState&,
                        const AdamWHyper&, const StepOutputs&) { return Todo(); }
absl::Status FusedAdamWQuantize(const Device&, Format, Format, const Fragment&, GradView, const OptimizerState&,
                                const AdamWHyper&, const ScaleInputs&, const StepOutputs&, const QuantizedOutputs&) { return Todo(); }
absl::Status FusedSgd(const Device&, Format, Format, const Fragment&, GradView, const OptimizerState&, const SgdHyper&,
                      const StepOutputs&) { return Todo(); }
absl::Status GradStats(const Device&, GradView, int64_t, float, double*, int64_t*) { return Todo(); }
}  // namespace mainstay::kernels::cuda

// MakeAdamWConstants (optimizer_math.h): the one definition, built with MAINSTAY_KERNEL_FLAGS
// (-ffp-contract=off), linked by the CPU and the CUDA backends.
#include "kernels/optimizer_math.h"

namespace mainstay::kernels {

AdamWConstants MakeAdamWConstants(const AdamWHyper& h) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  return {1.0f - h.beta1, 1.0f - h.beta2, 1.0f - h.lr * h.weight_decay,
          static_cast<float>(static_cast<double>(h.lr) / bc1), static_cast<float>(std::sqrt(bc2))};
}

}  // namespace mainstay::kernels

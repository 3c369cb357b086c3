// Per-element optimizer arithmetic shared by the CPU and CUDA backends, so both produce the
// same FP32 bits (every operation is a single IEEE operation; kernels build without FMA
// contraction). Per-step constants are computed once on the host by the *Constants helpers.
//
// AdamW follows PyTorch's torch.optim.AdamW (decoupled decay, bias correction):
//   g      = grad * grad_multiplier
//   m      = beta1 * m + (1 - beta1) * g
//   v      = beta2 * v + (1 - beta2) * g * g
//   master = master * (1 - lr * weight_decay)
//   master = master - step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with step_size = lr / (1 - beta1^step) and bc2_sqrt = sqrt(1 - beta2^step).
// SGD with momentum (PyTorch's torch.optim.SGD, dampening 0, not Nesterov):
//   g = grad * grad_multiplier + weight_decay * master;  buf = step == 1 ? g : momentum * buf + g
//   master = master - lr * buf
//
// Thread safety: pure functions.
#ifndef MAINSTAY_KERNELS_OPTIMIZER_MATH_H_
#define MAINSTAY_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>
#include <cstdint>

#include "kernels/casts.h"
#include "kernels/kernels.h"

namespace mainstay::kernels {

struct AdamWConstants {
  float one_minus_beta1;
  float one_minus_beta2;
  float decay;      // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

// Host-side: bias corrections in double, then rounded once to FP32. Defined once, in
// optimizer_math.cc, built with -ffp-contract=off for the CPU and CUDA backends alike (an inline
// definition would be compiled with each includer's flags, and `1 - lr * weight_decay` could
// become one fused multiply-add in one of them).
AdamWConstants MakeAdamWConstants(const AdamWHyper& h);

// One element. `g` already includes grad_multiplier. Updates master, m, v in place (FP32).
MAINSTAY_HD void AdamWElement(const AdamWHyper& h, const AdamWConstants& c, float g, float& master, float& m,
                              float& v) {
  m = h.beta1 * m + c.one_minus_beta1 * g;
  v = h.beta2 * v + c.one_minus_beta2 * (g * g);
  master = master * c.decay;
  const float denom = sqrtf(v) / c.bc2_sqrt + h.eps;
  master = master - c.step_size * (m / denom);
}

MAINSTAY_HD void SgdElement(const SgdHyper& h, float g, float& master, float& buf) {
  const float d = g + h.weight_decay * master;
  buf = h.step == 1 ? d : h.momentum * buf + d;
  master = master - h.lr * buf;
}

// Gradient element -> FP32 (before grad_multiplier).
MAINSTAY_HD float LoadGrad(const void* data, ElementType type, int64_t i) {
  switch (type) {
    case ElementType::kBFloat16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case ElementType::kFloat16:
      return Fp16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

// Moments stored as FP32 or BF16 (round to nearest even on store).
MAINSTAY_HD float LoadMoment(const void* data, ElementType type, int64_t i) {
  return type == ElementType::kBFloat16 ? Bf16ToFloat(static_cast<const uint16_t*>(data)[i])
                                        : static_cast<const float*>(data)[i];
}

MAINSTAY_HD void StoreMoment(void* data, ElementType type, int64_t i, float value) {
  if (type == ElementType::kBFloat16) {
    static_cast<uint16_t*>(data)[i] = FloatToBf16(value);
  } else {
    static_cast<float*>(data)[i] = value;
  }
}

// The model-dtype value of a master: bf16 or fp16 bits, and its FP32 value.
MAINSTAY_HD uint16_t ToModelBits(float master, Format model_dtype) {
  return model_dtype == Format::kFP16 ? FloatToFp16(master) : FloatToBf16(master);
}
MAINSTAY_HD float ModelBitsToFloat(uint16_t bits, Format model_dtype) {
  return model_dtype == Format::kFP16 ? Fp16ToFloat(bits) : Bf16ToFloat(bits);
}

}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_OPTIMIZER_MATH_H_

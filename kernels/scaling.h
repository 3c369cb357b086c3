// Scale computations of every format (FORMATS.md), as scalar functions shared by the CPU
// and CUDA backends and by the daemon's per-tensor scaling state. Every expression keeps
// FORMATS.md's FP32 operation order; nothing here may be contracted into an FMA (there is no
// multiply-add in these expressions).
//
// Thread safety: pure functions. (The delayed-scaling history lives with the daemon,
// server/daemon/scaling_state.h.)
#ifndef MAINSTAY_KERNELS_SCALING_H_
#define MAINSTAY_KERNELS_SCALING_H_

#include <cfloat>
#include <cstdint>

#include "kernels/casts.h"

namespace mainstay::kernels {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr float kE2M1Max = 6.0f;

// fminf(x, FLT_MAX): NaN -> FLT_MAX, +inf -> FLT_MAX, everything else unchanged.
MAINSTAY_HD float MinFltMax(float x) { return x <= FLT_MAX ? x : FLT_MAX; }

// FP8 per-tensor current scaling (also fp8_block per tile, with pow2 = true).
//   a = max(amax, eps); a inf/NaN/0 -> 1; else RN(fp8_max / a), inf -> FLT_MAX; pow2 keeps
//   only sign and exponent bits.
MAINSTAY_HD float CurrentScalingScale(float amax, float fp8_max, bool pow2, float eps = 0.0f) {
  float a = amax;
  if (a < eps) a = eps;  // NaN stays NaN (the comparison is false)
  float scale;
  if (IsNan(a) || !IsFinite(a) || a == 0.0f) {
    scale = 1.0f;
  } else {
    scale = fp8_max / a;
    if (!IsFinite(scale)) scale = FLT_MAX;
  }
  if (pow2) scale = BitsFloat(FloatBits(scale) & 0xFF800000u);
  return scale;
}

// scale_inv = RN(1 / scale).
MAINSTAY_HD float ScaleInv(float scale) { return 1.0f / scale; }

// NVFP4 global encode scale: S_enc = fminf(fl(2688 / A), FLT_MAX); A == 0 or S_enc == 0 -> 1.
MAINSTAY_HD float Nvfp4GlobalEncodeScale(float tensor_amax) {
  if (tensor_amax == 0.0f) return 1.0f;
  float s = MinFltMax(2688.0f / tensor_amax);
  if (s == 0.0f) s = 1.0f;
  return s;
}

// NVFP4 tile scale (stored E4M3): s_t = fl(a_t * fl(S_enc * fl(1/6))), cast saturating.
MAINSTAY_HD uint8_t Nvfp4TileScaleE4M3(float tile_amax, float s_enc) {
  const float one_sixth = 1.0f / 6.0f;
  const float factor = s_enc * one_sixth;
  return FloatToE4M3(MinFltMax(tile_amax * factor));
}

// NVFP4 element encode factor of a tile: s_e4m3 > 0 ? fminf(1 / fl(float(s_e4m3) * S_dec), FLT_MAX) : FLT_MAX.
MAINSTAY_HD float Nvfp4TileEncode(uint8_t s_e4m3, float s_dec) {
  const float s = E4M3ToFloat(s_e4m3);
  if (!(s > 0.0f)) return FLT_MAX;
  return MinFltMax(1.0f / (s * s_dec));
}

// MXFP8 block scale: e8m0_round_up(fl(block_amax * fl(1 / fp8_max))).
MAINSTAY_HD uint8_t MxfpBlockScale(float block_amax, float fp8_max) {
  const float inv_max = 1.0f / fp8_max;
  return E8M0RoundUp(block_amax * inv_max);
}

}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_SCALING_H_

// Scalar conversions between FP32 and every element type Mainstay publishes, exactly as
// ../shared/FORMATS.md states them (round to nearest even, saturate to finite). Shared by the
// CPU kernels and the CUDA kernels (MAINSTAY_HD = __host__ __device__ under nvcc), so both
// produce the same bits. Tested against the CUDA toolkit's host conversions over every FP32
// bit pattern (tests/unit/cast_oracle_test.cc).
//
// Thread safety: pure functions.
#ifndef MAINSTAY_KERNELS_CASTS_H_
#define MAINSTAY_KERNELS_CASTS_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MAINSTAY_HD __host__ __device__ __forceinline__
#else
#define MAINSTAY_HD inline
#endif

namespace mainstay::kernels {

MAINSTAY_HD uint32_t FloatBits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

MAINSTAY_HD float BitsFloat(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

MAINSTAY_HD bool IsNan(float x) { return (FloatBits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
MAINSTAY_HD bool IsFinite(float x) { return (FloatBits(x) & 0x7F800000u) != 0x7F800000u; }
MAINSTAY_HD float AbsF(float x) { return BitsFloat(FloatBits(x) & 0x7FFFFFFFu); }

// amax update with fmax semantics: NaN is ignored, +inf propagates.
MAINSTAY_HD float AmaxUpdate(float amax, float x) {
  const float a = AbsF(x);
  return a > amax ? a : amax;  // a NaN compares false and is skipped
}

// ---- BF16 / FP16 (round to nearest even; NaN -> canonical quiet NaN, as CUDA's host code).

MAINSTAY_HD uint16_t FloatToBf16(float x) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

MAINSTAY_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

MAINSTAY_HD uint16_t FloatToFp16(float x) {
  const uint32_t u = FloatBits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFFu;                          // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                         // below 2^-14: subnormal or zero
    // value * 2^24 as an integer, round to nearest even.
    const uint32_t exp = a >> 23;
    if (exp < 102) return sign;                                  // < 2^-25: rounds to zero
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exp;                            // 14..24 (+ implicit)
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rebased = a - 0x38000000u;                      // exponent bias 127 -> 15
  const uint32_t r = (rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | r);
}

MAINSTAY_HD float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return BitsFloat(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // 2^-24
    return BitsFloat(FloatBits(v) | sign);
  }
  return BitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

// ---- Minifloats with saturation to the largest finite value (SATFINITE).
//
// Generic E<exp_bits>M<mant_bits> with exponent bias `bias`: round to nearest even, values
// (and infinities) beyond `max_code`'s magnitude become +-max_code, NaN becomes `nan_code`,
// -0.0 keeps its sign bit.
template <int kExpBits, int kMantBits, int kBias>
MAINSTAY_HD uint8_t FloatToMinifloatSat(float x, uint8_t max_code, uint8_t nan_code) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 31) << (kExpBits + kMantBits));
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return nan_code;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  uint32_t code;
  if (a < kMinNormalBits) {
    // Subnormal range: count units of the smallest subnormal 2^(1 - bias - mant_bits),
    // rounding to nearest even. Scaling by a power of two is exact.
    constexpr int kShift = kBias + kMantBits - 1;  // multiply by 2^kShift
    const float scaled = BitsFloat(a) * BitsFloat(static_cast<uint32_t>(127 + kShift) << 23);
    const uint32_t s = FloatBits(scaled);
    if (s < 0x3F000000u) {
      code = 0;  // below 0.5 units (the tie at exactly 0.5 rounds to even = 0 as well)
    } else {
      const uint32_t e = s >> 23;  // 126 (0.5..1) up to 127 + kMantBits
      const uint32_t mant = (s & 0x7FFFFFu) | 0x800000u;
      const uint32_t shift = 150 - e;  // integer part of mant * 2^(e-150)
      const uint32_t q = mant >> shift;
      const uint32_t rem = mant & ((1u << shift) - 1u);
      const uint32_t half = 1u << (shift - 1);
      code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);  // may reach the min normal
    }
  } else {
    constexpr int kDrop = 23 - kMantBits;
    const uint32_t rebased = a - (static_cast<uint32_t>(127 - kBias) << 23);
    code = (rebased + ((1u << (kDrop - 1)) - 1u) + ((rebased >> kDrop) & 1u)) >> kDrop;
  }
  if (code > max_code) code = max_code;
  return static_cast<uint8_t>(sign | code);
}

// E4M3 (bias 7, max 448 = 0x7E, no infinities, NaN 0x7F).
MAINSTAY_HD uint8_t FloatToE4M3(float x) { return FloatToMinifloatSat<4, 3, 7>(x, 0x7E, 0x7F); }
// E5M2 (bias 15, max 57344 = 0x7B; SATFINITE also maps +-inf to +-max; NaN 0x7F).
MAINSTAY_HD uint8_t FloatToE5M2(float x) { return FloatToMinifloatSat<5, 2, 15>(x, 0x7B, 0x7F); }
// E2M1 (bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6; NaN -> +6 = 0x7), a 4-bit code in the low nibble.
MAINSTAY_HD uint8_t FloatToE2M1(float x) { return FloatToMinifloatSat<2, 1, 1>(x, 0x7, 0x7) & 0xF; }

template <int kExpBits, int kMantBits, int kBias>
MAINSTAY_HD float MinifloatToFloat(uint32_t code) {
  const uint32_t sign = (code >> (kExpBits + kMantBits)) & 1u;
  const uint32_t exp = (code >> kMantBits) & ((1u << kExpBits) - 1u);
  const uint32_t mant = code & ((1u << kMantBits) - 1u);
  float v;
  if (exp == 0) {
    v = static_cast<float>(mant) * BitsFloat(static_cast<uint32_t>(127 + 1 - kBias - kMantBits) << 23);
  } else {
    v = BitsFloat(((exp + 127 - kBias) << 23) | (mant << (23 - kMantBits)));
  }
  return sign ? -v : v;
}

MAINSTAY_HD float E4M3ToFloat(uint8_t q) {
  if ((q & 0x7F) == 0x7F) return BitsFloat(0x7FC00000u);
  return MinifloatToFloat<4, 3, 7>(q);
}

MAINSTAY_HD float E5M2ToFloat(uint8_t q) {
  const uint32_t exp = (q >> 2) & 0x1F;
  if (exp == 0x1F) {
    if (q & 0x3) return BitsFloat(0x7FC00000u);
    return BitsFloat((q & 0x80) ? 0xFF800000u : 0x7F800000u);
  }
  return MinifloatToFloat<5, 2, 15>(q);
}

MAINSTAY_HD float E2M1ToFloat(uint8_t q) { return MinifloatToFloat<2, 1, 1>(q & 0xF); }

// ---- E8M0 (MXFP8 block scales): 2^(e - 127); 0xFF is NaN; no zero.

// TE's rounding-up rule (FORMATS.md): exponent field of `x`, plus one if any mantissa bit is
// set (unless already 0xFE); NaN -> 0xFF, inf -> 0xFE, values <= 2^-127 (and 0) -> 0x00.
MAINSTAY_HD uint8_t E8M0RoundUp(float x) {
  const uint32_t a = FloatBits(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0xFF;
  if (a == 0x7F800000u) return 0xFE;
  if (a <= 0x00400000u) return 0x00;  // 2^-127 and below
  uint32_t e = a >> 23;
  if ((a & 0x7FFFFFu) != 0 && e < 0xFE) ++e;
  return static_cast<uint8_t>(e);
}

MAINSTAY_HD float E8M0ToFloat(uint8_t e) {
  if (e == 0xFF) return BitsFloat(0x7FC00000u);
  if (e == 0) return BitsFloat(0x00400000u);  // 2^-127, a float subnormal
  return BitsFloat(static_cast<uint32_t>(e) << 23);
}

// The MXFP8 element multiplier 2^(127 - e): exact for e < 254, the FP32 denormal 2^-127 for
// e = 254, NaN for e = 255 (FORMATS.md).
MAINSTAY_HD float MxfpMultiplier(uint8_t e) {
  if (e == 0xFF) return BitsFloat(0x7FC00000u);
  if (e == 0xFE) return BitsFloat(0x00400000u);
  return BitsFloat(static_cast<uint32_t>(254 - e) << 23);
}

}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_CASTS_H_

// Branch-free forms of the scalar conversions in kernels/casts.h and kernels/scaling.h, for
// the CPU kernels' streaming loops: every function is straight-line integer / FP32 code with
// selects, so GCC can vectorize a loop that calls it. Each one returns exactly the bits of
// its casts.h / scaling.h counterpart (checked over all FP32 bit patterns when written;
// tests/unit/quantize_test.cc keeps a sampled check against CUDA's host conversions).
//
// Tricks used (all exact in IEEE FP32 with round-to-nearest-even, which the kernels keep:
// -ffp-contract=off, no -ffast-math, and the FPU's default mode without flush-to-zero):
//   * subnormal minifloat codes: fl(|y| + M), where M's ulp is the minifloat's smallest
//     subnormal, rounds |y| to that grid; the code is bits(sum) - bits(M);
//   * minifloat decoding: the code's exponent/mantissa bits placed at the top of an FP32
//     pattern with the exponent rebased by an integer add; subnormal codes as the mantissa
//     converted to float times a power of two (no FP32 subnormal is ever an operand).
//
// The CUDA kernels use the same functions on the device (kernels/cuda/fragment_visit.cuh):
// straight-line code keeps a warp's lanes together whatever their values' ranges (casts.h's
// E2M1 takes its subnormal branch for |y| < 1, which splits nearly every warp). Every one is
// checked against CUDA's host conversions on all 2^32 FP32 bit patterns
// (tests/unit/cast_oracle_test.cc).
//
// Internal to kernels/ (and its tests). Thread safety: pure functions.
#ifndef MAINSTAY_KERNELS_CPU_VECTOR_CASTS_H_
#define MAINSTAY_KERNELS_CPU_VECTOR_CASTS_H_

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "kernels/casts.h"

// The streaming loops are compiled twice, for AVX2 and for the x86-64 baseline (SSE2), and
// the copy to run is picked once at load time (GCC function multiversioning): the baseline
// copy executes about three times as many instructions. Both clones perform the same IEEE operations in
// the same order (the avx2 target does not enable FMA, and contraction is off), so results
// do not depend on the CPU. Building with -DMAINSTAY_VECTOR_CLONES= keeps the baseline only.
#if !defined(MAINSTAY_VECTOR_CLONES)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define MAINSTAY_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define MAINSTAY_VECTOR_CLONES
#endif
#endif

// The casts below are the bodies of vectorized loops: a call left out of line keeps the whole
// loop scalar (GCC's inliner gave up on MinifloatSatBits once a translation unit had enough
// callers, and the one-loop fp8 pass fell from 0.70 to 0.12 G elem/s), so they always inline.
#if defined(__CUDACC__)
#define MAINSTAY_CAST_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define MAINSTAY_CAST_INLINE inline __attribute__((always_inline))
#else
#define MAINSTAY_CAST_INLINE inline
#endif

namespace mainstay::kernels::cpu {

// c ? a : b as mask arithmetic, for selects that follow an FP operation: from a plain ?:
// GCC sinks the FP operation into a branch that it then cannot if-convert under
// -ftrapping-math (the default), and the loop no longer vectorizes.
MAINSTAY_CAST_INLINE uint32_t SelectBits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return b + ((a - b) & mask);
}

// For |x| bits `a` (sign cleared): a NaN? As an int32 compare, which SSE2 has.
MAINSTAY_CAST_INLINE bool IsNanBits(uint32_t a) { return static_cast<int32_t>(a) > 0x7F800000; }
// a < b for |x| bits (both below 2^31).
MAINSTAY_CAST_INLINE bool LessBits(uint32_t a, uint32_t b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b); }

// FP32 bits of float(model_dtype(master)), master given as bits `u`: the value every kernel
// quantizes. kFp16 = false: bf16 (FloatToBf16 then Bf16ToFloat); true: fp16.
template <bool kFp16>
MAINSTAY_CAST_INLINE uint32_t ModelValueBits(uint32_t u) {
  const uint32_t a = u & 0x7FFFFFFFu;
  if constexpr (!kFp16) {
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return SelectBits(IsNanBits(a), 0x7FFF0000u, rounded);
  } else {
    const uint32_t sign = u & 0x80000000u;
    // Normal fp16 range: keep 10 mantissa bits, round to nearest even (may carry into the
    // exponent, which is still the right value).
    const uint32_t normal = (a + 0xFFFu + ((a >> 13) & 1u)) & 0xFFFFE000u;
    // Below 2^-14: round to a multiple of 2^-24 (the ulp of 0.5), then subtract 0.5 exactly.
    const uint32_t sub = FloatBits((BitsFloat(a) + 0.5f) - 0.5f);
    uint32_t r = SelectBits(LessBits(a, 0x38800000u), sub, normal);
    r = SelectBits(!LessBits(a, 0x477FF000u), 0x7F800000u, r);  // rounds beyond 65504: inf
    r |= sign;
    return SelectBits(IsNanBits(a), 0x7FFFE000u, r);  // NaN -> fp16 0x7FFF -> this FP32 NaN
  }
}

// |x| as ordered integer bits, NaN -> 0: max over these is the fmax-semantics amax
// (AmaxUpdate) of the values, as FP32 bits. Fits in int32 (at most 0x7F800000 = +inf).
MAINSTAY_CAST_INLINE int32_t AmaxBits(uint32_t value_bits) {
  const uint32_t a = value_bits & 0x7FFFFFFFu;
  return static_cast<int32_t>(IsNanBits(a) ? 0u : a);
}

// The amax of model-dtype values from the amax of the FP32 values they round from: for a max
// `raw` over AmaxBits(FloatBits(x)) of some x, returns the max over
// AmaxBits(ModelValueBits(FloatBits(x))) of the same x. Rounding to the model dtype (round to
// nearest even, overflow to inf) never puts two magnitudes in the other order, and NaNs count
// 0 either way, so rounding the largest magnitude once gives the largest rounded magnitude: the
// loops take a plain integer max and round once per block or chunk, not once per element.
template <bool kFp16>
MAINSTAY_CAST_INLINE int32_t ModelAmaxOfRaw(int32_t raw) {
  return AmaxBits(ModelValueBits<kFp16>(static_cast<uint32_t>(raw)));
}

// FloatToBf16 / FloatToFp16 of a value given as FP32 bits.
MAINSTAY_CAST_INLINE uint16_t Bf16Bits(uint32_t u) {
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(IsNanBits(a) ? 0x7FFFu : r);
}

MAINSTAY_CAST_INLINE uint16_t Fp16Bits(uint32_t u) {
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  const uint32_t sub = FloatBits(BitsFloat(a) + 0.5f) - 0x3F000000u;  // units of 2^-24
  uint32_t r = SelectBits(LessBits(a, 0x38800000u), sub, normal);
  r = SelectBits(!LessBits(a, 0x477FF000u), 0x7C00u, r);
  r |= sign;
  return static_cast<uint16_t>(SelectBits(IsNanBits(a), 0x7FFFu, r));
}

// FloatToMinifloatSat: round to nearest even, saturate to +-kMaxCode, NaN -> kNanCode.
// Normal range: integer rounding of the rebased exponent and mantissa. Subnormal range:
// fl(|y| + M), where M is the power of two whose ulp is the smallest subnormal
// 2^(1 - bias - mant_bits), rounds |y| onto the subnormal grid; bits(sum) - bits(M) is the code.
template <int kExpBits, int kMantBits, int kBias, uint32_t kMaxCode, uint32_t kNanCode>
MAINSTAY_CAST_INLINE uint8_t MinifloatSatBits(float y) {
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr int kDrop = 23 - kMantBits;
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + 1 - kBias - kMantBits + 23) << 23;
  const uint32_t u = FloatBits(y);
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t rebased = a - (static_cast<uint32_t>(127 - kBias) << 23);  // wraps when unused
  const uint32_t normal = (rebased + ((1u << (kDrop - 1)) - 1u) + ((rebased >> kDrop) & 1u)) >> kDrop;
  const uint32_t sub = FloatBits(BitsFloat(a) + BitsFloat(kMagicBits)) - kMagicBits;
  // Both fit in int32 (normal <= bits(inf) >> kDrop), so the clamp is a signed min.
  const int32_t code = static_cast<int32_t>(SelectBits(LessBits(a, kMinNormalBits), sub, normal));
#if defined(__CUDA_ARCH__)
  const uint32_t clamped = static_cast<uint32_t>(min(code, static_cast<int32_t>(kMaxCode)));
#else
  const uint32_t clamped = static_cast<uint32_t>(std::min(code, static_cast<int32_t>(kMaxCode)));
#endif
  const uint32_t sign = (u >> 31) << (kExpBits + kMantBits);
  return static_cast<uint8_t>(SelectBits(IsNanBits(a), kNanCode, clamped | sign));
}

MAINSTAY_CAST_INLINE uint8_t E4M3Bits(float y) { return MinifloatSatBits<4, 3, 7, 0x7E, 0x7F>(y); }
MAINSTAY_CAST_INLINE uint8_t E5M2Bits(float y) { return MinifloatSatBits<5, 2, 15, 0x7B, 0x7F>(y); }
// A 4-bit code in the low nibble (NaN -> +6 = 0x7).
MAINSTAY_CAST_INLINE uint8_t E2M1Bits(float y) { return MinifloatSatBits<2, 1, 1, 0x7, 0x7>(y); }

// Minifloat decoding (E4M3ToFloat, E5M2ToFloat, E2M1ToFloat). Normal codes: the exponent is
// rebased by an integer add on the code's bits placed at the top of the FP32 mantissa.
// Subnormal codes (exponent field 0): the mantissa converted to float times the smallest
// subnormal's power of two, both exact. No step handles an FP32 subnormal: on Intel cores an
// FP32 subnormal operand costs a microcode assist of ~100 cycles per vector, which made the
// earlier decoding (the code's bits as a subnormal-range FP32, times 2^k) run at a fifth of the
// speed of memory whenever the data held small codes (E2M1's 0.5 is one).
template <int kMantBits, int kBias>
MAINSTAY_CAST_INLINE uint32_t MinifloatMagnitudeBits(uint32_t mag) {
  constexpr int kShift = 23 - kMantBits;
  const uint32_t normal = (mag << kShift) + (static_cast<uint32_t>(127 - kBias) << 23);
  // The smallest subnormal is 2^(1 - kBias - kMantBits).
  const float sub = static_cast<float>(static_cast<int32_t>(mag)) *
                    BitsFloat(static_cast<uint32_t>(127 + 1 - kBias - kMantBits) << 23);
  return SelectBits(mag < (1u << kMantBits), FloatBits(sub), normal);
}

MAINSTAY_CAST_INLINE float E4M3Value(uint8_t q) {
  const uint32_t mag = static_cast<uint32_t>(q & 0x7F);
  const uint32_t bits = MinifloatMagnitudeBits<3, 7>(mag) | (static_cast<uint32_t>(q & 0x80) << 24);
  return BitsFloat(SelectBits(mag == 0x7F, 0x7FC00000u, bits));
}

MAINSTAY_CAST_INLINE float E5M2Value(uint8_t q) {
  const uint32_t mag = static_cast<uint32_t>(q & 0x7F);
  const uint32_t sign = static_cast<uint32_t>(q & 0x80) << 24;
  uint32_t bits = MinifloatMagnitudeBits<2, 15>(mag) | sign;
  bits = SelectBits(mag == 0x7C, 0x7F800000u | sign, bits);
  return BitsFloat(SelectBits(mag > 0x7C, 0x7FC00000u, bits));
}

MAINSTAY_CAST_INLINE float E2M1Value(uint8_t q) {
  const uint32_t mag = static_cast<uint32_t>(q & 0x7);
  return BitsFloat(MinifloatMagnitudeBits<1, 1>(mag) | (static_cast<uint32_t>(q & 0x8) << 28));
}

// E8M0RoundUp of a value given as FP32 bits.
MAINSTAY_CAST_INLINE uint8_t E8M0RoundUpBits(uint32_t x_bits) {
  const uint32_t a = x_bits & 0x7FFFFFFFu;
  const uint32_t e = a >> 23;
  const uint32_t up = static_cast<uint32_t>((a & 0x7FFFFFu) != 0u) & static_cast<uint32_t>(e < 0xFEu);
  uint32_t r = e + up;
  r = SelectBits(LessBits(a, 0x00400001u), 0u, r);
  r = SelectBits(a == 0x7F800000u, 0xFEu, r);
  return static_cast<uint8_t>(SelectBits(IsNanBits(a), 0xFFu, r));
}

// MxfpMultiplier: 2^(127 - e); 2^-127 for e = 254; NaN for e = 255.
MAINSTAY_CAST_INLINE float MxfpMultiplierValue(uint8_t e) {
  const uint32_t x = e;
  uint32_t bits = (254u - x) << 23;
  bits = x == 0xFEu ? 0x00400000u : bits;
  return BitsFloat(x == 0xFFu ? 0x7FC00000u : bits);
}

// E8M0ToFloat: 2^(e - 127); 0 -> 2^-127; 0xFF -> NaN.
MAINSTAY_CAST_INLINE float E8M0Value(uint8_t e) {
  const uint32_t x = e;
  uint32_t bits = x << 23;
  bits = x == 0u ? 0x00400000u : bits;
  return BitsFloat(x == 0xFFu ? 0x7FC00000u : bits);
}

// Fp16ToFloat (subnormal halves without FP32 subnormal arithmetic, as above).
MAINSTAY_CAST_INLINE float Fp16Value(uint16_t h) {
  const uint32_t mag = static_cast<uint32_t>(h & 0x7FFFu);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t bits = SelectBits(mag >= 0x7C00u, 0x7F800000u | (mag << 13), MinifloatMagnitudeBits<10, 15>(mag));
  return BitsFloat(bits | sign);
}

// fminf(x, FLT_MAX) (MinFltMax): NaN and +inf -> FLT_MAX.
MAINSTAY_CAST_INLINE float MinFltMaxValue(float x) {
  return BitsFloat(SelectBits(x <= FLT_MAX, FloatBits(x), FloatBits(FLT_MAX)));
}

// Software prefetch for the streaming loops: they run over slices of kPrefetchSlice elements
// and, before each slice, ask for the lines of the slice kPrefetchAhead elements on, in every
// array they stream. Where a loop does real arithmetic per element it fills the core's
// out-of-order window, the hardware prefetcher alone leaves the core waiting on memory between
// bursts of work (512 ahead measured best of 0, 512, 1024 and 2048 on AdamW + fp8 cast: 2048,
// 32 KiB in four arrays, thrashes L1).
inline constexpr int64_t kPrefetchSlice = 64;
inline constexpr int64_t kPrefetchAhead = 512;

// Prefetches the lines of elements [i, i + kPrefetchSlice) of an array of kBytes-byte elements
// at `base`. Those may lie past the array's end: the address is formed as an integer, and a
// prefetch never faults.
template <int kBytes, bool kWrite>
MAINSTAY_CAST_INLINE void PrefetchSlice(const void* base, int64_t i) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(i) * kBytes;
  for (int64_t b = 0; b < kPrefetchSlice * kBytes; b += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a + static_cast<uintptr_t>(b)), kWrite ? 1 : 0, 3);
  }
}

}  // namespace mainstay::kernels::cpu

#endif  // MAINSTAY_KERNELS_CPU_VECTOR_CASTS_H_

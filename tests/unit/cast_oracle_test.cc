// Checks kernels/casts.h and kernels/scaling.h against the CUDA toolkit's host-side
// conversions (cuda_fp8.h, cuda_fp4.h, cuda_bf16.h, cuda_fp16.h compiled by the host compiler),
// the oracle FORMATS.md names for single-value casts:
//   - every FP32 bit pattern (2^32) through each encoder, on all hardware threads: casts.h's,
//     and the branch-free forms (kernels/cpu/vector_casts.h) that the CPU loops and the CUDA
//     kernels run;
//   - every code of each decoder;
//   - hand-derived special values from FORMATS.md "Pitfalls to test" and the scale rules.
// Built only when MAINSTAY_CUDA_INCLUDE_DIR is set (the CUDA headers, not a GPU, are needed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/casts.h"
#include "kernels/cpu/vector_casts.h"
#include "kernels/scaling.h"

namespace mainstay::kernels {
namespace {

// ---- The oracle: the CUDA toolkit's host conversions, one function per Mainstay cast.

uint8_t OracleE4M3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
uint8_t OracleE5M2(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); }
uint8_t OracleE2M1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }
uint8_t OracleE8M0(float x) { return __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf); }
uint16_t OracleBf16(float x) { return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x; }
uint16_t OracleFp16(float x) { return static_cast<__half_raw>(__float2half_rn(x)).x; }

float HalfRawToFloat(__half_raw h) { return __half2float(__half(h)); }
float Bf16RawToFloat(__nv_bfloat16_raw b) { return __bfloat162float(__nv_bfloat16(b)); }

float OracleE4M3ToFloat(uint8_t q) { return HalfRawToFloat(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)); }
float OracleE5M2ToFloat(uint8_t q) { return HalfRawToFloat(__nv_cvt_fp8_to_halfraw(q, __NV_E5M2)); }
float OracleE2M1ToFloat(uint8_t q) { return HalfRawToFloat(__nv_cvt_fp4_to_halfraw(q, __NV_E2M1)); }
float OracleE8M0ToFloat(uint8_t q) { return Bf16RawToFloat(__nv_cvt_e8m0_to_bf16raw(q)); }
float OracleBf16ToFloat(uint16_t h) {
  __nv_bfloat16_raw r;
  r.x = h;
  return Bf16RawToFloat(r);
}
float OracleFp16ToFloat(uint16_t h) {
  __half_raw r;
  r.x = h;
  return HalfRawToFloat(r);
}

std::string Hex(uint64_t v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%0*" PRIX64, digits, v);
  return buf;
}

// ---- Exhaustive encoder check.

enum Kind {
  kE4M3, kE5M2, kE2M1, kE8M0, kBf16, kFp16,
  // The branch-free forms (kernels/cpu/vector_casts.h) that the CPU loops and the CUDA kernels run.
  kE4M3Bits, kE5M2Bits, kE2M1Bits, kBf16Bits, kFp16Bits, kKinds
};
constexpr const char* kKindNames[kKinds] = {
    "FloatToE4M3 vs __nv_cvt_float_to_fp8(SATFINITE, E4M3)",
    "FloatToE5M2 vs __nv_cvt_float_to_fp8(SATFINITE, E5M2)",
    "FloatToE2M1 vs __nv_cvt_float_to_fp4(E2M1, cudaRoundNearest)",
    "E8M0RoundUp vs __nv_cvt_float_to_e8m0(SATFINITE, cudaRoundPosInf)",
    "FloatToBf16 vs __float2bfloat16_rn",
    "FloatToFp16 vs __float2half_rn",
    "cpu::E4M3Bits vs __nv_cvt_float_to_fp8(SATFINITE, E4M3)",
    "cpu::E5M2Bits vs __nv_cvt_float_to_fp8(SATFINITE, E5M2)",
    "cpu::E2M1Bits vs __nv_cvt_float_to_fp4(E2M1, cudaRoundNearest)",
    "cpu::Bf16Bits vs __float2bfloat16_rn",
    "cpu::Fp16Bits vs __float2half_rn",
};
constexpr int kKindDigits[kKinds] = {2, 2, 1, 2, 4, 4, 2, 2, 1, 4, 4};

struct Mismatches {
  uint64_t count = 0;
  uint64_t first_input = UINT64_MAX;  // lowest FP32 bit pattern that disagreed
  uint32_t ours = 0;
  uint32_t theirs = 0;

  void Record(uint32_t input, uint32_t mine, uint32_t oracle) {
    if (count++ == 0 || input < first_input) {
      first_input = input;
      ours = mine;
      theirs = oracle;
    }
  }
  void Merge(const Mismatches& other) {
    if (other.count == 0) return;
    if (other.first_input < first_input) {
      first_input = other.first_input;
      ours = other.ours;
      theirs = other.theirs;
    }
    count += other.count;
  }
};

struct Tally {
  Mismatches kinds[kKinds];
};

// Compares every encoder on the bit patterns [begin, end) (end exclusive, 64-bit).
void CheckRange(uint64_t begin, uint64_t end, Tally& tally) {
  for (uint64_t i = begin; i < end; ++i) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float x = BitsFloat(u);
    const uint32_t ours[kKinds] = {FloatToE4M3(x),   FloatToE5M2(x),   FloatToE2M1(x),   E8M0RoundUp(x),
                                   FloatToBf16(x),   FloatToFp16(x),   cpu::E4M3Bits(x), cpu::E5M2Bits(x),
                                   cpu::E2M1Bits(x), cpu::Bf16Bits(u), cpu::Fp16Bits(u)};
    const uint32_t theirs[kKinds] = {OracleE4M3(x), OracleE5M2(x), OracleE2M1(x), OracleE8M0(x),
                                     OracleBf16(x), OracleFp16(x), OracleE4M3(x), OracleE5M2(x),
                                     OracleE2M1(x), OracleBf16(x), OracleFp16(x)};
    for (int k = 0; k < kKinds; ++k) {
      if (ours[k] != theirs[k]) [[unlikely]] tally.kinds[k].Record(u, ours[k], theirs[k]);
    }
  }
}

TEST(CastOracleTest, EveryFloatBitPatternEncodesAsCuda) {
  const auto start = std::chrono::steady_clock::now();
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  // Small chunks handed out dynamically: NaN and subnormal ranges cost differently.
  constexpr uint64_t kTotal = uint64_t{1} << 32;
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::atomic<uint64_t> next{0};
  std::vector<Tally> tallies(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (;;) {
        const uint64_t begin = next.fetch_add(kChunk);
        if (begin >= kTotal) return;
        CheckRange(begin, std::min(begin + kChunk, kTotal), tallies[t]);
      }
    });
  }
  for (std::thread& th : pool) th.join();
  Tally total;
  for (const Tally& t : tallies) {
    for (int k = 0; k < kKinds; ++k) total.kinds[k].Merge(t.kinds[k]);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("checked 2^32 FP32 bit patterns x %d casts on %d threads in %.1f s\n", kKinds, threads, seconds);
  for (int k = 0; k < kKinds; ++k) {
    const Mismatches& m = total.kinds[k];
    std::printf("  %-66s mismatches: %" PRIu64 "\n", kKindNames[k], m.count);
    EXPECT_EQ(m.count, 0u) << kKindNames[k] << ": " << m.count << " mismatches; first at x = "
                           << Hex(m.first_input, 8) << " (" << BitsFloat(static_cast<uint32_t>(m.first_input))
                           << "): ours " << Hex(m.ours, kKindDigits[k]) << ", CUDA "
                           << Hex(m.theirs, kKindDigits[k]);
  }
}

// ---- Every decoder code.

// Same value: identical bits, or both NaN (payloads may differ).
bool SameFloat(float a, float b) { return (std::isnan(a) && std::isnan(b)) || FloatBits(a) == FloatBits(b); }

template <typename Ours, typename Oracle>
void CheckEveryCode(const char* name, uint32_t codes, Ours ours, Oracle oracle) {
  int mismatches = 0;
  for (uint32_t c = 0; c < codes; ++c) {
    const float a = ours(c);
    const float b = oracle(c);
    if (!SameFloat(a, b) && mismatches++ == 0) {
      ADD_FAILURE() << name << "(" << Hex(c, codes > 256 ? 4 : 2) << ") = " << Hex(FloatBits(a), 8) << " (" << a
                    << "), CUDA " << Hex(FloatBits(b), 8) << " (" << b << ")";
    }
  }
  EXPECT_EQ(mismatches, 0) << name << ": " << mismatches << " of " << codes << " codes differ";
}

TEST(CastOracleTest, EveryCodeDecodesAsCuda) {
  CheckEveryCode("E4M3ToFloat", 256, [](uint32_t c) { return E4M3ToFloat(static_cast<uint8_t>(c)); },
                 [](uint32_t c) { return OracleE4M3ToFloat(static_cast<uint8_t>(c)); });
  CheckEveryCode("E5M2ToFloat", 256, [](uint32_t c) { return E5M2ToFloat(static_cast<uint8_t>(c)); },
                 [](uint32_t c) { return OracleE5M2ToFloat(static_cast<uint8_t>(c)); });
  CheckEveryCode("E2M1ToFloat", 16, [](uint32_t c) { return E2M1ToFloat(static_cast<uint8_t>(c)); },
                 [](uint32_t c) { return OracleE2M1ToFloat(static_cast<uint8_t>(c)); });
  CheckEveryCode("E8M0ToFloat", 256, [](uint32_t c) { return E8M0ToFloat(static_cast<uint8_t>(c)); },
                 [](uint32_t c) { return OracleE8M0ToFloat(static_cast<uint8_t>(c)); });
  CheckEveryCode("Bf16ToFloat", 65536, [](uint32_t c) { return Bf16ToFloat(static_cast<uint16_t>(c)); },
                 [](uint32_t c) { return OracleBf16ToFloat(static_cast<uint16_t>(c)); });
  CheckEveryCode("Fp16ToFloat", 65536, [](uint32_t c) { return Fp16ToFloat(static_cast<uint16_t>(c)); },
                 [](uint32_t c) { return OracleFp16ToFloat(static_cast<uint16_t>(c)); });
}

// ---- Hand-derived special values (FORMATS.md "Pitfalls to test"). Each is also checked
// against the oracle, so a wrong expectation here shows up as an oracle disagreement.

const float kNan = std::nanf("");
const float kInf = INFINITY;
float Pow2(int e) { return std::ldexp(1.0f, e); }
float NextUp(float x) { return std::nextafter(x, kInf); }

struct Case8 {
  float x;
  uint8_t want;
};

void ExpectCases(const char* name, uint8_t (*ours)(float), uint8_t (*oracle)(float), std::initializer_list<Case8> cases) {
  for (const Case8& c : cases) {
    EXPECT_EQ(ours(c.x), c.want) << name << "(" << c.x << " = " << Hex(FloatBits(c.x), 8) << ")";
    EXPECT_EQ(oracle(c.x), c.want) << "CUDA oracle for " << name << "(" << Hex(FloatBits(c.x), 8) << ")";
  }
}

TEST(CastSpecialValuesTest, E4M3TiesSignsNanInfAndSaturation) {
  ExpectCases("FloatToE4M3", FloatToE4M3, OracleE4M3,
              {{0.0f, 0x00},
               {-0.0f, 0x80},
               {Pow2(-10), 0x00},          // tie at half the smallest subnormal 2^-9 -> even = 0
               {-Pow2(-10), 0x80},         // ... keeping the sign bit
               {NextUp(Pow2(-10)), 0x01},  // just above the tie
               {Pow2(-9), 0x01},           // smallest subnormal
               {3 * Pow2(-10), 0x02},      // 1.5 units: tie -> even 2
               {Pow2(-6), 0x08},           // smallest normal
               {1.0f, 0x38},
               {448.0f, 0x7E},             // max finite
               {-448.0f, 0xFE},
               {464.0f, 0x7E},             // halfway to the (absent) 480: saturates
               {1e30f, 0x7E},
               {kInf, 0x7E},               // no inf in E4M3: saturate
               {-kInf, 0xFE},
               {kNan, 0x7F},
               {-kNan, 0x7F}});
}

TEST(CastSpecialValuesTest, E5M2TiesSignsNanInfAndSaturation) {
  ExpectCases("FloatToE5M2", FloatToE5M2, OracleE5M2,
              {{0.0f, 0x00},
               {-0.0f, 0x80},
               {Pow2(-17), 0x00},  // tie at half of 2^-16 -> 0
               {-Pow2(-17), 0x80},
               {NextUp(Pow2(-17)), 0x01},
               {Pow2(-16), 0x01},
               {Pow2(-14), 0x04},  // smallest normal
               {1.0f, 0x3C},
               {57344.0f, 0x7B},   // max finite
               {61440.0f, 0x7B},   // halfway to 65536 (would be inf): SATFINITE keeps max
               {kInf, 0x7B},
               {-kInf, 0xFB},
               {kNan, 0x7F},
               {-kNan, 0x7F}});
}

TEST(CastSpecialValuesTest, E2M1TiesSignsNanInfAndSaturation) {
  ExpectCases("FloatToE2M1", FloatToE2M1, OracleE2M1,
              {{0.0f, 0x0},
               {-0.0f, 0x8},
               {0.25f, 0x0},  // tie at half the smallest subnormal 0.5 -> 0
               {-0.25f, 0x8},
               {NextUp(0.25f), 0x1},
               {0.5f, 0x1},
               {0.75f, 0x2},  // tie 0.5 | 1.0 -> even code 2 (1.0)
               {1.25f, 0x2},  // tie 1.0 | 1.5 -> 1.0
               {2.5f, 0x4},   // tie 2 | 3 -> 2
               {3.5f, 0x6},   // tie 3 | 4 -> 4
               {5.0f, 0x6},   // tie 4 | 6 -> 4
               {6.0f, 0x7},   // max finite
               {-6.0f, 0xF},
               {7.0f, 0x7},
               {kInf, 0x7},
               {-kInf, 0xF},
               {kNan, 0x7},   // NaN -> +6
               {-kNan, 0x7}});
}

TEST(CastSpecialValuesTest, E8M0RoundsUpAndMapsSpecials) {
  ExpectCases("E8M0RoundUp", E8M0RoundUp, OracleE8M0,
              {{0.0f, 0x00},
               {-0.0f, 0x00},
               {BitsFloat(0x00000001u), 0x00},  // smallest FP32 denormal
               {Pow2(-127), 0x00},              // 2^-127 is code 0
               {Pow2(-126), 0x01},
               {1.0f, 0x7F},
               {-1.0f, 0x7F},                   // sign dropped: the amax is |x|
               {NextUp(1.0f), 0x80},            // any mantissa bit rounds up
               {1.75f, 0x80},
               {NextUp(1.75f), 0x80},           // above 1.75: round-up and the OCP floor rule differ
               {1.75f * Pow2(20), 127 + 21},
               {NextUp(1.75f * Pow2(20)), 127 + 21},
               {Pow2(127), 0xFE},
               {1.5f * Pow2(126), 0xFE},
               {FLT_MAX, 0xFE},                 // already 0xFE: no carry into NaN
               {kInf, 0xFE},
               {-kInf, 0xFE},
               {kNan, 0xFF}});
  EXPECT_EQ(FloatBits(E8M0ToFloat(0x00)), 0x00400000u);  // 2^-127, no zero in E8M0
  EXPECT_EQ(E8M0ToFloat(0x7F), 1.0f);
  EXPECT_EQ(E8M0ToFloat(0xFE), Pow2(127));
  EXPECT_TRUE(std::isnan(E8M0ToFloat(0xFF)));
}

TEST(CastSpecialValuesTest, Bf16AndFp16RoundToNearestEven) {
  const struct {
    float x;
    uint16_t bf16, fp16;
  } cases[] = {
      {0.0f, 0x0000, 0x0000},
      {-0.0f, 0x8000, 0x8000},
      {1.0f, 0x3F80, 0x3C00},
      {BitsFloat(0x3F808000u), 0x3F80, 0x3C04},  // bf16 tie -> even (down); fp16 exact
      {BitsFloat(0x3F818000u), 0x3F82, 0x3C0C},  // bf16 tie -> even (up)
      {65504.0f, 0x4780, 0x7BFF},                // fp16 max finite
      {65520.0f, 0x4780, 0x7C00},                // fp16 tie above max -> inf
      {NextUp(65504.0f), 0x4780, 0x7BFF},
      {Pow2(-25), 0x3300, 0x0000},               // fp16: tie at half 2^-24 -> 0
      {NextUp(Pow2(-25)), 0x3300, 0x0001},
      {Pow2(-24), 0x3380, 0x0001},
      {kInf, 0x7F80, 0x7C00},
      {-kInf, 0xFF80, 0xFC00},
      {kNan, 0x7FFF, 0x7FFF},
      {-kNan, 0x7FFF, 0x7FFF},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(FloatToBf16(c.x), c.bf16) << Hex(FloatBits(c.x), 8);
    EXPECT_EQ(OracleBf16(c.x), c.bf16) << "CUDA " << Hex(FloatBits(c.x), 8);
    EXPECT_EQ(FloatToFp16(c.x), c.fp16) << Hex(FloatBits(c.x), 8);
    EXPECT_EQ(OracleFp16(c.x), c.fp16) << "CUDA " << Hex(FloatBits(c.x), 8);
  }
}

// ---- scaling.h on special inputs; expectations derived by hand from FORMATS.md.

TEST(ScalingSpecialValuesTest, CurrentScalingScale) {
  EXPECT_EQ(CurrentScalingScale(0.0f, kE4M3Max, false), 1.0f);
  EXPECT_EQ(CurrentScalingScale(kInf, kE4M3Max, false), 1.0f);
  EXPECT_EQ(CurrentScalingScale(kNan, kE4M3Max, false), 1.0f);
  EXPECT_EQ(CurrentScalingScale(kNan, kE4M3Max, false, 0.5f), 1.0f);  // NaN stays NaN past eps
  EXPECT_EQ(CurrentScalingScale(2.0f, kE4M3Max, false), 224.0f);
  EXPECT_EQ(CurrentScalingScale(448.0f, kE4M3Max, false), 1.0f);
  EXPECT_EQ(CurrentScalingScale(2.0f, kE5M2Max, false), 28672.0f);
  EXPECT_EQ(CurrentScalingScale(0.0f, kE4M3Max, false, 0.5f), 896.0f);   // eps floors the amax
  // Tiny amax: 448 / 2^-149 overflows -> FLT_MAX; pow2 keeps 2^127.
  EXPECT_EQ(CurrentScalingScale(BitsFloat(1), kE4M3Max, false), FLT_MAX);
  EXPECT_EQ(CurrentScalingScale(BitsFloat(1), kE4M3Max, true), Pow2(127));
  // pow2: 2^floor(log2(scale)).
  EXPECT_EQ(CurrentScalingScale(1.0f, kE4M3Max, true), 256.0f);   // 448 -> 256
  EXPECT_EQ(CurrentScalingScale(3.0f, kE4M3Max, true), 128.0f);   // 149.33 -> 128
  EXPECT_EQ(CurrentScalingScale(3.5f, kE4M3Max, true), 128.0f);   // exactly 128
  EXPECT_EQ(CurrentScalingScale(0.0f, kE4M3Max, true), 1.0f);
  EXPECT_EQ(CurrentScalingScale(1e30f, kE4M3Max, true), Pow2(-91));  // 4.48e-28 in [2^-91, 2^-90)
  EXPECT_EQ(ScaleInv(224.0f), 1.0f / 224.0f);
  EXPECT_EQ(ScaleInv(FLT_MAX), BitsFloat(0x00200000u));  // RN(1/FLT_MAX) = 2^-128 (denormal)
}

TEST(ScalingSpecialValuesTest, Nvfp4GlobalEncodeScale) {
  EXPECT_EQ(Nvfp4GlobalEncodeScale(0.0f), 1.0f);
  EXPECT_EQ(Nvfp4GlobalEncodeScale(2688.0f), 1.0f);
  EXPECT_EQ(Nvfp4GlobalEncodeScale(448.0f), 6.0f);
  EXPECT_EQ(Nvfp4GlobalEncodeScale(kInf), 1.0f);                          // 2688/inf = 0 -> 1
  EXPECT_EQ(Nvfp4GlobalEncodeScale(FLT_MAX), 2688.0f / FLT_MAX);          // tiny but nonzero
  EXPECT_GT(Nvfp4GlobalEncodeScale(FLT_MAX), 0.0f);
  EXPECT_EQ(Nvfp4GlobalEncodeScale(BitsFloat(1)), FLT_MAX);               // overflow -> FLT_MAX
}

TEST(ScalingSpecialValuesTest, Nvfp4TileScaleAndEncode) {
  // S_enc = 1: tile amax 6 -> fl(6 * fl(1/6)) = 1.0 (the error is under half an ulp) -> 0x38.
  EXPECT_EQ(Nvfp4TileScaleE4M3(6.0f, 1.0f), 0x38);
  EXPECT_EQ(Nvfp4TileEncode(0x38, 1.0f), 1.0f);
  // Largest tile of the tensor (a_t = A = 2688): s_t = 448 exactly -> max E4M3.
  EXPECT_EQ(Nvfp4TileScaleE4M3(2688.0f, 1.0f), 0x7E);
  EXPECT_EQ(Nvfp4TileScaleE4M3(0.0f, 1.0f), 0x00);
  // A tile amax 1e-6 with S_enc = 1: s_t ~ 1.7e-7 < 2^-10 underflows to E4M3 0, so the encode
  // factor is FLT_MAX and every nonzero element saturates to +-6.
  const uint8_t s = Nvfp4TileScaleE4M3(1e-6f, 1.0f);
  EXPECT_EQ(s, 0x00);
  EXPECT_EQ(Nvfp4TileEncode(s, 1.0f), FLT_MAX);
  EXPECT_EQ(FloatToE2M1(1e-6f * Nvfp4TileEncode(s, 1.0f)), 0x7);
  EXPECT_EQ(FloatToE2M1(-1e-6f * Nvfp4TileEncode(s, 1.0f)), 0xF);
  EXPECT_EQ(Nvfp4TileEncode(0x80, 1.0f), FLT_MAX);  // -0 scale
  EXPECT_EQ(Nvfp4TileEncode(0x7F, 1.0f), FLT_MAX);  // NaN scale
  // 1 / (2^-9 * 2^-140) = 2^149 overflows -> FLT_MAX.
  EXPECT_EQ(Nvfp4TileEncode(0x01, Pow2(-140)), FLT_MAX);
  // Infinite tile amax saturates the stored scale.
  EXPECT_EQ(Nvfp4TileScaleE4M3(kInf, 1.0f), 0x7E);
}

TEST(ScalingSpecialValuesTest, MxfpMultiplierAndBlockScale) {
  EXPECT_EQ(FloatBits(MxfpMultiplier(0)), 0x7F000000u);    // 2^127
  EXPECT_EQ(MxfpMultiplier(127), 1.0f);
  EXPECT_EQ(FloatBits(MxfpMultiplier(253)), 0x00800000u);  // 2^-126
  EXPECT_EQ(FloatBits(MxfpMultiplier(254)), 0x00400000u);  // 2^-127, an FP32 denormal
  EXPECT_TRUE(std::isnan(MxfpMultiplier(255)));
  // 448 * fl(1/448) rounds to exactly 1.0 (fl(1/7) is 1/7 + 3*2^-26/7) -> e = 127.
  EXPECT_EQ(MxfpBlockScale(448.0f, kE4M3Max), 127);
  EXPECT_EQ(MxfpBlockScale(449.0f, kE4M3Max), 128);
  EXPECT_EQ(MxfpBlockScale(0.0f, kE4M3Max), 0);
  EXPECT_EQ(MxfpBlockScale(kInf, kE4M3Max), 0xFE);
  EXPECT_EQ(MxfpBlockScale(kNan, kE4M3Max), 0xFF);
}

}  // namespace
}  // namespace mainstay::kernels

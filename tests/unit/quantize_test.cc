// The CPU quantize kernels (ComputePartialAmax, Quantize, Dequantize) against a scalar
// reference written here from FORMATS.md, whose element casts are CUDA's host conversions
// (cuda_fp8.h, cuda_fp4.h, cuda_bf16.h, cuda_fp16.h), not kernels/casts.h: an independent oracle.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/format.h"
#include "kernels/cpu/executor.h"
#include "kernels/cpu/vector_casts.h"
#include "kernels/kernels.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::kernels {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;

constexpr Format kFormats[] = {Format::kBF16,           Format::kFP16,           Format::kFP8E4M3Delayed,
                               Format::kFP8E5M2Delayed, Format::kFP8E4M3Current, Format::kFP8E5M2Current,
                               Format::kMXFP8,          Format::kFP8Block,       Format::kNVFP4};
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t Bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
float FromBits(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

// ---- The reference: FORMATS.md with CUDA's host conversions.

float RefModel(float master, Format dt) {
  return dt == Format::kFP16 ? __half2float(__float2half_rn(master)) : __bfloat162float(__float2bfloat16_rn(master));
}
uint16_t Ref16Bits(float x, Format format) {
  return format == Format::kFP16 ? __half_as_ushort(__float2half_rn(x)) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
float Ref16Value(uint16_t h, Format format) {
  return format == Format::kFP16 ? __half2float(__ushort_as_half(h)) : __bfloat162float(__ushort_as_bfloat16(h));
}
uint8_t RefFp8(float x, bool e5m2) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3); }
float RefFp8Value(uint8_t q, bool e5m2) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, e5m2 ? __NV_E5M2 : __NV_E4M3)));
}
uint8_t RefE2M1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }
float RefE2M1Value(uint8_t q) { return __half2float(__half(__nv_cvt_fp4_to_halfraw(q, __NV_E2M1))); }
uint8_t RefE8M0(float x) { return __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf); }
float RefE8M0Value(uint8_t e) { return e == 0xFF ? kNan : std::ldexp(1.0f, e - 127); }

float RefAmaxUpdate(float amax, float x) { return std::isnan(x) ? amax : std::fmax(amax, std::fabs(x)); }

float RefCurrentScale(float amax, float fp8_max, bool pow2) {
  float scale = 1.0f;
  if (std::isfinite(amax) && amax != 0.0f) {
    scale = fp8_max / amax;
    if (std::isinf(scale)) scale = FLT_MAX;
  }
  return pow2 ? FromBits(Bits(scale) & 0xFF800000u) : scale;
}

bool IsE5M2(Format f) { return f == Format::kFP8E5M2Delayed || f == Format::kFP8E5M2Current; }
bool HasBlocks(Format f) { return f == Format::kMXFP8 || f == Format::kFP8Block || f == Format::kNVFP4; }

struct Settings {
  float delayed_scale = 1.0f;  // fp8 delayed
  bool pow2 = false;           // fp8 current
};

// Everything a whole-tensor quantization produces.
struct Quantized {
  float tensor_amax = 0.0f;
  std::vector<float> block_amax;  // compact grid, row-major
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;  // compact grid, row-major
  float scale_inv = -1.0f;      // -1: not produced
  std::vector<float> dequant;
};

Quantized RefQuantize(Format f, Format dt, Matrix2D v, const std::vector<float>& master, const Settings& s) {
  const int64_t n = v.numel();
  std::vector<float> x(n);
  Quantized r;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = RefModel(master[i], dt);
    r.tensor_amax = RefAmaxUpdate(r.tensor_amax, x[i]);
  }
  const int64_t br = f == Format::kMXFP8 ? 1 : f == Format::kFP8Block ? 128 : 16;
  const int64_t bc = f == Format::kMXFP8 ? 32 : f == Format::kFP8Block ? 128 : 16;
  const int64_t gc = (v.cols + bc - 1) / bc;
  auto block = [&](int64_t i) { return (i / v.cols / br) * gc + (i % v.cols) / bc; };
  if (HasBlocks(f)) {
    r.block_amax.assign(((v.rows + br - 1) / br) * gc, 0.0f);
    for (int64_t i = 0; i < n; ++i) r.block_amax[block(i)] = RefAmaxUpdate(r.block_amax[block(i)], x[i]);
  }
  r.dequant.resize(n);
  if (f == Format::kBF16 || f == Format::kFP16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = Ref16Bits(x[i], f);
      r.data.push_back(static_cast<uint8_t>(h));
      r.data.push_back(static_cast<uint8_t>(h >> 8));
      r.dequant[i] = Ref16Value(h, f);
    }
  } else if (!HasBlocks(f)) {
    const bool e5m2 = IsE5M2(f);
    const bool delayed = f == Format::kFP8E4M3Delayed || f == Format::kFP8E5M2Delayed;
    const float scale = delayed ? s.delayed_scale : RefCurrentScale(r.tensor_amax, e5m2 ? 57344.0f : 448.0f, s.pow2);
    r.scale_inv = 1.0f / scale;
    for (int64_t i = 0; i < n; ++i) {
      r.data.push_back(RefFp8(x[i] * scale, e5m2));
      r.dequant[i] = RefFp8Value(r.data[i], e5m2) * r.scale_inv;
    }
  } else if (f == Format::kMXFP8) {
    for (float a : r.block_amax) r.scales.push_back(RefE8M0(a * (1.0f / 448.0f)));
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t e = r.scales[block(i)];
      const float mult = e < 254 ? std::ldexp(1.0f, 127 - e) : e == 254 ? std::ldexp(1.0f, -127) : kNan;
      r.data.push_back(RefFp8(x[i] * mult, false));
      r.dequant[i] = RefFp8Value(r.data[i], false) * RefE8M0Value(e);
    }
  } else if (f == Format::kFP8Block) {
    std::vector<float> scale, inv;
    for (float a : r.block_amax) {
      scale.push_back(RefCurrentScale(a, 448.0f, true));
      inv.push_back(1.0f / scale.back());
      const uint32_t b = Bits(inv.back());
      for (int k = 0; k < 4; ++k) r.scales.push_back(static_cast<uint8_t>(b >> (8 * k)));
    }
    for (int64_t i = 0; i < n; ++i) {
      r.data.push_back(RefFp8(x[i] * scale[block(i)], false));
      r.dequant[i] = RefFp8Value(r.data[i], false) * inv[block(i)];
    }
  } else {  // nvfp4
    const float a = r.tensor_amax;
    float s_enc = std::fmin(2688.0f / a, FLT_MAX);
    if (a == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    const float s_dec = 1.0f / s_enc;
    r.scale_inv = s_dec;
    std::vector<float> enc, sv;
    for (float t : r.block_amax) {
      r.scales.push_back(RefFp8(std::fmin(t * (s_enc * (1.0f / 6.0f)), FLT_MAX), false));
      sv.push_back(RefFp8Value(r.scales.back(), false));
      enc.push_back(sv.back() > 0.0f ? std::fmin(1.0f / (sv.back() * s_dec), FLT_MAX) : FLT_MAX);
    }
    r.data.assign((n + 1) / 2, 0);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t q = RefE2M1(x[i] * enc[block(i)]);
      r.data[i / 2] |= static_cast<uint8_t>(q << (4 * (i % 2)));
      r.dequant[i] = (RefE2M1Value(q) * sv[block(i)]) * s_dec;
    }
  }
  return r;
}

// ---- Running the kernels.

int ScaleEntryBytes(Format f) { return f == Format::kFP8Block ? 4 : HasBlocks(f) ? 1 : 0; }

// Amax, quantize and dequantize of one fragment on its own (its amaxes are not reduced).
Quantized RunFragment(Format f, Format dt, Matrix2D v, IndexRange elements, const std::vector<float>& master,
                      const Settings& s, CpuExecutor* executor = nullptr) {
  const Fragment fragment{v, elements};
  const Device device{Device::Kind::kCpu, executor};
  const std::span<const float> src(master.data() + elements.begin, elements.size());
  const IndexRange range = ScaleBlockRange(f, v, elements);
  Quantized r;
  r.block_amax.assign(range.size(), -1.0f);
  EXPECT_THAT(ComputePartialAmax(device, f, dt, fragment, src, {&r.tensor_amax, r.block_amax}), IsOk());
  float tensor_amax_only = -1.0f;  // the same without block outputs (another code path)
  EXPECT_THAT(ComputePartialAmax(device, f, dt, fragment, src, {&tensor_amax_only, {}}), IsOk());
  EXPECT_EQ(Bits(tensor_amax_only), Bits(r.tensor_amax));
  ScaleInputs in{s.delayed_scale, r.tensor_amax, r.block_amax, s.pow2};
  r.data.assign(DataBytes(f, elements.size()), 0xCD);
  r.scales.assign(range.size() * ScaleEntryBytes(f), 0xCD);
  EXPECT_THAT(Quantize(device, f, dt, fragment, src, in, {r.data, r.scales, &r.scale_inv}), IsOk());
  r.dequant.assign(elements.size(), -1.0f);
  EXPECT_THAT(Dequantize(device, f, fragment, {r.data, r.scales, r.scale_inv}, r.dequant), IsOk());
  return r;
}

Quantized RunWhole(Format f, Format dt, Matrix2D v, const std::vector<float>& master, const Settings& s,
                   CpuExecutor* executor = nullptr) {
  return RunFragment(f, dt, v, {0, v.numel()}, master, s, executor);
}

// The distributed recipe: partial amaxes per fragment, MAX-reduced (per block by global
// index), then each fragment quantized with the reduced values; outputs assembled.
Quantized RunFragments(Format f, Format dt, Matrix2D v, const std::vector<int64_t>& cuts,
                       const std::vector<float>& master, const Settings& s) {
  const Device device;
  const Matrix2D grid = ScaleGrid(f, v);
  Quantized r;
  r.block_amax.assign(grid.numel(), 0.0f);
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    const Fragment fragment{v, {cuts[k], cuts[k + 1]}};
    const IndexRange range = ScaleBlockRange(f, v, fragment.elements);
    float amax = -1.0f;
    std::vector<float> block_amax(range.size(), -1.0f);
    EXPECT_THAT(ComputePartialAmax(device, f, dt, fragment, {master.data() + cuts[k], size_t(fragment.size())},
                                   {&amax, block_amax}),
                IsOk());
    r.tensor_amax = std::max(r.tensor_amax, amax);
    for (int64_t i = 0; i < range.size(); ++i) {
      r.block_amax[range.begin + i] = std::max(r.block_amax[range.begin + i], block_amax[i]);
    }
  }
  r.data.assign(DataBytes(f, v.numel()), 0);
  r.scales.assign(grid.numel() * ScaleEntryBytes(f), 0);
  r.dequant.assign(v.numel(), 0.0f);
  std::vector<bool> written(grid.numel(), false);
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    const Fragment fragment{v, {cuts[k], cuts[k + 1]}};
    const IndexRange range = ScaleBlockRange(f, v, fragment.elements);
    const int entry = ScaleEntryBytes(f);
    const ScaleInputs in{s.delayed_scale, r.tensor_amax,
                         {r.block_amax.data() + range.begin, size_t(range.size())}, s.pow2};
    std::vector<uint8_t> data(DataBytes(f, fragment.size())), scales(range.size() * entry);
    EXPECT_THAT(Quantize(device, f, dt, fragment, {master.data() + cuts[k], size_t(fragment.size())}, in,
                         {data, scales, &r.scale_inv}),
                IsOk());
    std::copy(data.begin(), data.end(), r.data.begin() + DataBytes(f, cuts[k]));
    // A block shared by several fragments must get the same scale bytes from each.
    for (int64_t b = 0; b < range.size(); ++b) {
      for (int64_t i = 0; i < entry; ++i) {
        uint8_t& dst = r.scales[(range.begin + b) * entry + i];
        if (written[range.begin + b]) {
          EXPECT_EQ(dst, scales[b * entry + i]) << "shared block " << range.begin + b;
        }
        dst = scales[b * entry + i];
      }
      written[range.begin + b] = true;
    }
    EXPECT_THAT(Dequantize(device, f, fragment, {data, scales, r.scale_inv},
                           {r.dequant.data() + cuts[k], size_t(fragment.size())}),
                IsOk());
  }
  return r;
}

bool SameFloat(float a, float b) { return Bits(a) == Bits(b) || (std::isnan(a) && std::isnan(b)); }

void ExpectSameFloats(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int shown = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!SameFloat(got[i], want[i]) && shown++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " (0x" << std::hex << Bits(got[i]) << "), want "
                    << want[i] << " (0x" << Bits(want[i]) << ")" << std::dec;
    }
  }
}

void ExpectSameBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int shown = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && shown++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: got 0x" << std::hex << int(got[i]) << ", want 0x" << int(want[i])
                    << std::dec;
    }
  }
}

void ExpectSame(const Quantized& got, const Quantized& want) {
  EXPECT_TRUE(SameFloat(got.tensor_amax, want.tensor_amax)) << got.tensor_amax << " vs " << want.tensor_amax;
  ExpectSameFloats(got.block_amax, want.block_amax, "block_amax");
  ExpectSameBytes(got.data, want.data, "data");
  ExpectSameBytes(got.scales, want.scales, "block_scales");
  EXPECT_TRUE(SameFloat(got.scale_inv, want.scale_inv)) << got.scale_inv << " vs " << want.scale_inv;
  ExpectSameFloats(got.dequant, want.dequant, "dequant");
}

// Whole-tensor quantization against the reference, for both model dtypes.
void CheckAgainstReference(Format f, Matrix2D v, const std::vector<float>& master, const Settings& s = {}) {
  for (Format dt : {Format::kBF16, Format::kFP16}) {
    SCOPED_TRACE(::testing::Message() << FormatName(f) << " model " << FormatName(dt) << " " << v.rows << "x"
                                      << v.cols);
    ExpectSame(RunWhole(f, dt, v, master, s), RefQuantize(f, dt, v, master, s));
  }
}

std::vector<float> RandomMaster(int64_t n, float magnitude, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> m(n);
  for (int64_t i = 0; i < n; ++i) m[i] = normal(rng) * magnitude * (i % 97 == 5 ? 37.0f : 1.0f);
  return m;
}

// ---- The branch-free casts the kernels use, against CUDA's, on every FP32 bit pattern
// whose low 12 bits are one of a few (all rounding boundaries of these types are above).

TEST(QuantizeTest, BranchFreeCastsMatchCudaOnSampledBitPatterns) {
  const uint32_t lows[] = {0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFF, 0x5A3};
  int64_t bad = 0;
  for (uint64_t high = 0; high < (uint64_t{1} << 20); ++high) {
    for (uint32_t low : lows) {
      const uint32_t u = static_cast<uint32_t>(high << 12) | low;
      const float x = FromBits(u);
      bad += cpu::ModelValueBits<false>(u) != Bits(RefModel(x, Format::kBF16)) && !std::isnan(x);
      bad += !SameFloat(FromBits(cpu::ModelValueBits<true>(u)), RefModel(x, Format::kFP16));
      bad += cpu::Bf16Bits(u) != Ref16Bits(x, Format::kBF16);
      bad += cpu::Fp16Bits(u) != Ref16Bits(x, Format::kFP16);
      bad += cpu::E4M3Bits(x) != RefFp8(x, false);
      bad += cpu::E5M2Bits(x) != RefFp8(x, true);
      bad += cpu::E2M1Bits(x) != RefE2M1(x);
      bad += cpu::E8M0RoundUpBits(u) != RefE8M0(std::fabs(x));
      bad += !SameFloat(FromBits(static_cast<uint32_t>(cpu::AmaxBits(u))), RefAmaxUpdate(0.0f, x));
    }
  }
  EXPECT_EQ(bad, 0);
  for (int q = 0; q < 256; ++q) {
    EXPECT_TRUE(SameFloat(cpu::E4M3Value(q), RefFp8Value(q, false))) << q;
    EXPECT_TRUE(SameFloat(cpu::E5M2Value(q), RefFp8Value(q, true))) << q;
    EXPECT_TRUE(SameFloat(cpu::E2M1Value(q & 0xF), RefE2M1Value(q & 0xF))) << q;
    EXPECT_TRUE(SameFloat(cpu::E8M0Value(q), RefE8M0Value(q))) << q;
  }
  for (int h = 0; h < 65536; ++h) EXPECT_TRUE(SameFloat(cpu::Fp16Value(h), Ref16Value(h, Format::kFP16))) << h;
}

// The amax loops take the largest FP32 magnitude and round it once (ModelAmaxOfRaw). That
// equals the largest rounded magnitude exactly when rounding never reorders two magnitudes:
// checked here on every non-NaN magnitude, +0 to +inf, for both model dtypes (and ModelValueBits
// is CUDA's rounding, above).
TEST(QuantizeTest, ModelRoundingNeverReordersMagnitudesSoAmaxesRoundOnce) {
  int64_t bad16 = 0, bad_bf16 = 0;
  uint32_t prev16 = 0, prev_bf16 = 0;
  for (uint32_t a = 0; a <= 0x7F800000u; ++a) {
    const uint32_t r16 = cpu::ModelValueBits<true>(a), rbf16 = cpu::ModelValueBits<false>(a);
    bad16 += r16 < prev16;
    bad_bf16 += rbf16 < prev_bf16;
    prev16 = r16;
    prev_bf16 = rbf16;
  }
  EXPECT_EQ(bad16, 0);
  EXPECT_EQ(bad_bf16, 0);
  // And on values the loops see: specials, both signs, NaNs of both signs in between.
  const float values[] = {0.0f, -0.0f, kNan, -kNan, 1e-30f, -3.0f, 65519.0f, 65520.0f, -70000.0f, 3.3895e38f, kInf};
  for (size_t n = 1; n <= std::size(values); ++n) {
    int32_t raw = 0, bf16 = 0, fp16 = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = Bits(values[i]);
      raw = std::max(raw, cpu::AmaxBits(u));
      bf16 = std::max(bf16, cpu::AmaxBits(cpu::ModelValueBits<false>(u)));
      fp16 = std::max(fp16, cpu::AmaxBits(cpu::ModelValueBits<true>(u)));
    }
    EXPECT_EQ(cpu::ModelAmaxOfRaw<false>(raw), bf16) << n;
    EXPECT_EQ(cpu::ModelAmaxOfRaw<true>(raw), fp16) << n;
  }
}

// ---- Whole tensors against the reference.

TEST(QuantizeTest, WholeTensorMatchesReferenceOnRandomDataOfSeveralMagnitudes) {
  // Odd widths put row starts (and 4-bit pieces) on odd elements; 4113 columns split rows
  // into several pieces, and 40 x 4113 spans three 64K-element chunks.
  const Matrix2D shapes[] = {{64, 96}, {130, 272}, {256, 384}, {33, 45}, {40, 4113}};
  uint32_t seed = 1;
  for (const Matrix2D& v : shapes) {
    for (float magnitude : {1e-30f, 1e-3f, 1.0f, 300.0f, 1e30f}) {
      if (v.numel() > 100000 && magnitude != 1.0f) continue;
      const std::vector<float> master = RandomMaster(v.numel(), magnitude, seed++);
      for (Format f : kFormats) {
        CheckAgainstReference(f, v, master, {0.5f, false});
        if (f == Format::kFP8E4M3Current || f == Format::kFP8E5M2Current) {
          CheckAgainstReference(f, v, master, {1.0f, true});
        }
      }
    }
  }
}

std::vector<float> SpecialValues() {
  return {0.0f,        -0.0f,         kNan,         -kNan,           kInf,           -kInf,
          FLT_MAX,     -FLT_MAX,      3.38e38f,     1e-40f,          -1e-40f,        FLT_TRUE_MIN,
          448.0f,      -448.0f,       464.0f,       57344.0f,        65504.0f,       65520.0f,
          0x1p-10f,    -0x1p-10f,     0x1.8p-10f,   0x1p-9f,         0x1p-17f,       0x1p-16f,
          0.25f,       0.75f,         5.0f,         6.0f,            -7.0f,          0x1p-24f,
          0x1p-25f,    0x1.8p-25f,    0x1p-14f,     0x1p-126f,       0x1p-127f,      1.0f};
}

TEST(QuantizeTest, SpecialValuesMatchReferenceInEveryFormat) {
  const std::vector<float> specials = SpecialValues();
  const Matrix2D v{32, 64};
  // Specials everywhere; one variant keeps the infinities out so amaxes stay finite.
  std::vector<float> with_inf = RandomMaster(v.numel(), 1.0f, 7), finite = with_inf;
  for (int64_t i = 0; i < v.numel(); i += 3) with_inf[i] = specials[(i / 3) % specials.size()];
  for (int64_t i = 0; i < v.numel(); i += 3) {
    const float x = specials[(i / 3) % specials.size()];
    finite[i] = std::isinf(x) || std::fabs(x) > 1e38f ? 0.5f : x;
  }
  for (Format f : kFormats) {
    CheckAgainstReference(f, v, with_inf);
    CheckAgainstReference(f, v, finite);
    CheckAgainstReference(f, v, finite, {1e-20f, true});
  }
}

TEST(QuantizeTest, SpecialValuesGiveTheDocumentedBytes) {
  const std::vector<float> m = {0.0f, -0.0f, kNan, kInf, -kInf, 448.0f, 0x1p-10f, 0x1.8p-10f, FLT_MAX, 0x1p-17f};
  const Matrix2D v{1, static_cast<int64_t>(m.size())};
  const Quantized e4m3 = RunWhole(Format::kFP8E4M3Delayed, Format::kBF16, v, m, {1.0f, false});
  EXPECT_THAT(e4m3.data, ::testing::ElementsAre(0x00, 0x80, 0x7F, 0x7E, 0xFE, 0x7E, 0x00, 0x01, 0x7E, 0x00));
  const Quantized e5m2 = RunWhole(Format::kFP8E5M2Delayed, Format::kBF16, v, m, {1.0f, false});
  EXPECT_THAT(e5m2.data, ::testing::ElementsAre(0x00, 0x80, 0x7F, 0x7B, 0xFB, 0x5F, 0x14, 0x16, 0x7B, 0x00));
  const Quantized bf16 = RunWhole(Format::kBF16, Format::kBF16, v, m, {});
  EXPECT_EQ(bf16.data[4], 0xFF);  // NaN -> 0x7FFF
  EXPECT_EQ(bf16.data[5], 0x7F);
  EXPECT_EQ(bf16.data[17], 0x7F);  // FLT_MAX rounds to bf16 +inf 0x7F80
  EXPECT_EQ(bf16.data[16], 0x80);
  EXPECT_FLOAT_EQ(e4m3.scale_inv, 1.0f);
  // Current scaling with an infinite amax uses scale 1.
  EXPECT_EQ(RunWhole(Format::kFP8E4M3Current, Format::kBF16, v, m, {}).scale_inv, 1.0f);
}

TEST(QuantizeTest, ZeroTinyAndHugeAmaxMatchReference) {
  const Matrix2D v{48, 160};
  for (float amax : {0.0f, 1e-40f, 1e-38f, 1e-20f, 1e20f, 3e38f, 3.38e38f}) {
    std::vector<float> master = RandomMaster(v.numel(), 1.0f, 11);
    float peak = 0.0f;
    for (float x : master) peak = std::max(peak, std::fabs(x));
    for (float& x : master) x = x / peak * amax;
    for (Format f : kFormats) CheckAgainstReference(f, v, master);
  }
  // amax 0 gives scale 1 everywhere.
  const std::vector<float> zeros(v.numel(), 0.0f);
  EXPECT_EQ(RunWhole(Format::kFP8E4M3Current, Format::kBF16, v, zeros, {}).scale_inv, 1.0f);
  EXPECT_EQ(RunWhole(Format::kNVFP4, Format::kBF16, v, zeros, {}).scale_inv, 1.0f);
  for (uint8_t e : RunWhole(Format::kMXFP8, Format::kBF16, v, zeros, {}).scales) EXPECT_EQ(e, 0);
}

TEST(QuantizeTest, Nvfp4UnderflowingTileScaleSaturatesNanTileIsPlusSixAndTiesGoToEven) {
  const Matrix2D v{32, 32};
  std::vector<float> master(v.numel(), 0.004f);
  master[0] = 2688.0f;  // tile (0, 0) sets S_enc = 1
  for (int64_t r = 0; r < 16; ++r) {
    for (int64_t c = 16; c < 32; ++c) master[r * 32 + c] = (c % 2) ? -0.004f : 0.004f;  // tile (0, 1)
  }
  for (int64_t r = 16; r < 32; ++r) {
    for (int64_t c = 16; c < 32; ++c) master[r * 32 + c] = kNan;  // tile (1, 1)
  }
  // Tile (1, 0): amax 6 gives s = 1.0 and enc = 1, so these land on E2M1's ties.
  const float ties[] = {6.0f, 0.25f, 0.75f, -0.25f, 5.0f, 2.5f};
  for (int c = 0; c < 6; ++c) master[16 * 32 + c] = ties[c];
  const Quantized q = RunWhole(Format::kNVFP4, Format::kBF16, v, master, {});
  EXPECT_EQ(q.scales[2], 0x38);  // 1.0
  EXPECT_EQ(q.data[256], 0x07);  // 6 -> 6 (0x7); 0.25 -> 0 (tie to even)
  EXPECT_EQ(q.data[257], 0x82);  // 0.75 -> 1.0 (0x2); -0.25 -> -0 (0x8)
  EXPECT_EQ(q.data[258], 0x46);  // 5 -> 4 (0x6); 2.5 -> 2 (0x4)
  EXPECT_EQ(q.scales[1], 0);  // s_t = 0.004 / 6 < 2^-10: the E4M3 scale underflows
  EXPECT_EQ(q.data[8], 0xF7);  // +6 in the low nibble, -6 in the high one
  EXPECT_EQ(q.scales[3], 0);
  EXPECT_EQ(q.data[16 * 16 + 8], 0x77);  // NaN -> +6
  CheckAgainstReference(Format::kNVFP4, v, master);
  for (Format f : kFormats) CheckAgainstReference(f, v, master);
  // MXFP8: an all-NaN block (row 3, columns 32..63) gets amax 0, so e = 0, and NaN elements.
  const Matrix2D wide{32, 64};
  std::vector<float> mx_master = RandomMaster(wide.numel(), 1.0f, 13);
  for (int64_t c = 32; c < 64; ++c) mx_master[3 * 64 + c] = kNan;
  const Quantized mx = RunWhole(Format::kMXFP8, Format::kBF16, wide, mx_master, {});
  EXPECT_EQ(mx.scales[3 * 2 + 1], 0);
  EXPECT_EQ(mx.data[3 * 64 + 32], 0x7F);
  for (Format f : kFormats) CheckAgainstReference(f, wide, mx_master);
}

// ---- Fragments, threads, bad arguments.

TEST(QuantizeTest, FragmentsWithReducedAmaxesEqualWholeTensorInEveryFormat) {
  std::mt19937 rng(3);
  for (const Matrix2D& v : {Matrix2D{200, 96}, Matrix2D{130, 272}, Matrix2D{70, 45}}) {
    const std::vector<float> master = RandomMaster(v.numel(), 2.0f, 5);
    for (Format f : kFormats) {
      for (Format dt : {Format::kBF16, Format::kFP16}) {
        const Settings s{0.25f, f == Format::kFP8E5M2Current};
        const Quantized whole = RunWhole(f, dt, v, master, s);
        for (int k = 1; k <= 8; ++k) {
          // k fragments, cut at distinct multiples of 64 (mostly off rows and tiles).
          std::vector<int64_t> cuts = {0, v.numel()};
          std::uniform_int_distribution<int64_t> pick(1, v.numel() / 64 - 1);
          while (static_cast<int>(cuts.size()) < k + 1) {
            const int64_t c = pick(rng) * 64;
            if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
          }
          std::sort(cuts.begin(), cuts.end());
          SCOPED_TRACE(::testing::Message() << FormatName(f) << " " << FormatName(dt) << " " << v.rows << "x"
                                            << v.cols << " k=" << k << " second cut " << cuts[1]);
          ExpectSame(RunFragments(f, dt, v, cuts, master, s), whole);
        }
      }
    }
  }
}

TEST(QuantizeTest, ResultsDoNotDependOnTheThreadCount) {
  const Matrix2D v{1000, 1040};  // 16 chunks of 64K elements
  const std::vector<float> master = RandomMaster(v.numel(), 3.0f, 9);
  CpuExecutor one(1), two(2), four(4);
  for (Format f : kFormats) {
    for (IndexRange elements : {IndexRange{0, v.numel()}, IndexRange{64 * 37, v.numel() - 64 * 11}}) {
      SCOPED_TRACE(::testing::Message() << FormatName(f) << " [" << elements.begin << ", " << elements.end << ")");
      const Quantized inline_run = RunFragment(f, Format::kBF16, v, elements, master, {0.5f, true});
      for (CpuExecutor* executor : {&one, &two, &four}) {
        ExpectSame(RunFragment(f, Format::kBF16, v, elements, master, {0.5f, true}, executor), inline_run);
      }
    }
  }
}

TEST(QuantizeTest, BadArgumentsAreInvalidAndWriteNothing) {
  const Device device;
  const Matrix2D v{64, 64};
  const std::vector<float> master(v.numel(), 1.0f);
  for (Format f : kFormats) {
    SCOPED_TRACE(FormatName(f));
    const Fragment whole{v, {0, v.numel()}};
    const int64_t blocks = ScaleBlockRange(f, v, whole.elements).size();
    std::vector<float> block_amax(blocks, 1.0f);
    std::vector<uint8_t> data(DataBytes(f, v.numel()), 0xAB), scales(blocks * ScaleEntryBytes(f), 0xAB);
    float scale_inv = -7.0f, amax = -7.0f;
    const ScaleInputs in{1.0f, 1.0f, block_amax, false};
    auto untouched = [&] {
      EXPECT_EQ(scale_inv, -7.0f);
      EXPECT_EQ(amax, -7.0f);
      for (uint8_t b : data) ASSERT_EQ(b, 0xAB);
      for (uint8_t b : scales) ASSERT_EQ(b, 0xAB);
    };
    const std::span<uint8_t> short_data(data.data(), data.size() - 1);
    EXPECT_THAT(Quantize(device, f, Format::kBF16, whole, master, in, {short_data, scales, &scale_inv}),
                StatusIs(absl::StatusCode::kInvalidArgument));
    const std::span<const float> short_master(master.data(), master.size() - 1);
    EXPECT_THAT(Quantize(device, f, Format::kBF16, whole, short_master, in, {data, scales, &scale_inv}),
                StatusIs(absl::StatusCode::kInvalidArgument));
    const Fragment beyond{v, {64, v.numel() + 64}};
    EXPECT_THAT(Quantize(device, f, Format::kBF16, beyond, master, in, {data, scales, &scale_inv}),
                StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(ComputePartialAmax(device, f, Format::kBF16, beyond, master, {&amax, {}}),
                StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(Quantize(device, f, Format::kFP8E4M3Current, whole, master, in, {data, scales, &scale_inv}),
                StatusIs(absl::StatusCode::kInvalidArgument));  // not a model dtype
    std::vector<float> out(v.numel(), -7.0f);
    EXPECT_THAT(Dequantize(device, f, whole, {data, scales, 1.0f}, {out.data(), out.size() - 1}),
                StatusIs(absl::StatusCode::kInvalidArgument));
    for (float x : out) ASSERT_EQ(x, -7.0f);
    if (HasBlocks(f)) {
      const ScaleInputs short_amax{1.0f, 1.0f, {block_amax.data(), block_amax.size() - 1}, false};
      EXPECT_THAT(Quantize(device, f, Format::kBF16, whole, master, short_amax, {data, scales, &scale_inv}),
                  StatusIs(absl::StatusCode::kInvalidArgument));
      const std::span<uint8_t> short_scales(scales.data(), scales.size() - 1);
      EXPECT_THAT(Quantize(device, f, Format::kBF16, whole, master, in, {data, short_scales, &scale_inv}),
                  StatusIs(absl::StatusCode::kInvalidArgument));
      std::vector<float> long_amax(blocks + 1, 1.0f);
      EXPECT_THAT(ComputePartialAmax(device, f, Format::kBF16, whole, master, {&amax, long_amax}),
                  StatusIs(absl::StatusCode::kInvalidArgument));
      for (float a : long_amax) EXPECT_EQ(a, 1.0f);
    } else {
      std::vector<float> one_block(1, 1.0f);
      EXPECT_THAT(ComputePartialAmax(device, f, Format::kBF16, whole, master, {&amax, one_block}),
                  StatusIs(absl::StatusCode::kInvalidArgument));
    }
    untouched();
  }
  // A 4-bit fragment must start on an even element.
  const Fragment odd{v, {1, 65}};
  const IndexRange range = ScaleBlockRange(Format::kNVFP4, v, odd.elements);
  std::vector<float> block_amax(range.size(), 1.0f);
  std::vector<uint8_t> data(DataBytes(Format::kNVFP4, 64), 0xAB), scales(range.size(), 0xAB);
  float scale_inv = -7.0f;
  EXPECT_THAT(Quantize(device, Format::kNVFP4, Format::kBF16, odd, {master.data(), 64},
                       {1.0f, 1.0f, block_amax, false}, {data, scales, &scale_inv}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(scale_inv, -7.0f);
  for (uint8_t b : data) EXPECT_EQ(b, 0xAB);
  for (uint8_t b : scales) EXPECT_EQ(b, 0xAB);
}

}  // namespace
}  // namespace mainstay::kernels

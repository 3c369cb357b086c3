// CPU backend of ComputePartialAmax, Quantize and Dequantize: dispatch by format, and the
// per-tensor formats (bf16, fp16, fp8 delayed and current). The block-scaled formats live in
// block_quantize.cc. FORMATS.md states the math; quantize_internal.h the chunking.
//
// The inner loops are plain loops over contiguous arrays calling the branch-free casts of
// vector_casts.h, templated on the model dtype and the element type, so GCC vectorizes them
// (and clones them for AVX2, see MAINSTAY_VECTOR_CLONES). On a CPU with AVX-512 the hand-written
// loops of avx512_loops.h run instead (same bits).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/avx512_loops.h"
#include "kernels/cpu/executor.h"
#include "kernels/cpu/quantize_internal.h"
#include "kernels/cpu/vector_casts.h"
#include "kernels/scaling.h"

namespace mainstay::kernels::cpu {
namespace {

// The largest FP32 magnitude, rounded to the model dtype once (ModelAmaxOfRaw).
template <bool kFp16Model>
int32_t AmaxLoop(const float* src, int64_t n) {
  return ModelAmaxOfRaw<kFp16Model>(RawAmax(src, n));
}

// bf16 / fp16 data: the value's bits in the format's type, little-endian. When the format
// is the model dtype this is the model-dtype bits themselves (the casts are idempotent).
template <bool kFp16Model, bool kFp16Out>
MAINSTAY_VECTOR_CLONES void Cast16Loop(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = FloatBits(src[i]);
    uint16_t h;
    if constexpr (kFp16Model == kFp16Out) {
      h = kFp16Out ? Fp16Bits(u) : Bf16Bits(u);
    } else {
      const uint32_t v = ModelValueBits<kFp16Model>(u);
      h = kFp16Out ? Fp16Bits(v) : Bf16Bits(v);
    }
    dst[2 * i] = static_cast<uint8_t>(h);
    dst[2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
}

template <bool kFp16Model, bool kE5M2>
MAINSTAY_VECTOR_CLONES void Fp8Loop(const float* src, uint8_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = BitsFloat(ModelValueBits<kFp16Model>(FloatBits(src[i]))) * scale;
    dst[i] = kE5M2 ? E5M2Bits(y) : E4M3Bits(y);
  }
}

template <bool kFp16>
MAINSTAY_VECTOR_CLONES void Dequant16Loop(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8));
    dst[i] = kFp16 ? Fp16Value(h) : Bf16ToFloat(h);
  }
}

template <bool kE5M2>
MAINSTAY_VECTOR_CLONES void DequantFp8Loop(const uint8_t* src, float* dst, int64_t n, float scale_inv) {
  for (int64_t i = 0; i < n; ++i) dst[i] = (kE5M2 ? E5M2Value(src[i]) : E4M3Value(src[i])) * scale_inv;
}

// Runs fn(offset, size) over the fixed chunks of n elements.
template <typename Fn>
void ForEachChunk(CpuExecutor* executor, int64_t n, const Fn& fn) {
  ParallelFor(executor, CeilDiv(n, kChunkElements), [&](int64_t c) {
    const int64_t begin = c * kChunkElements;
    fn(begin, std::min(kChunkElements, n - begin));
  });
}

bool IsFp16(Format model_dtype) { return model_dtype == Format::kFP16; }

bool IsE5M2(Format format) { return format == Format::kFP8E5M2Delayed || format == Format::kFP8E5M2Current; }

void QuantizeTensorScaled(CpuExecutor* executor, Format format, Format model_dtype, const float* src, int64_t n,
                          float scale, uint8_t* dst) {
  using LoopFn = void (*)(const float*, uint8_t*, int64_t, float);
  const bool e5m2 = IsE5M2(format);
  if (avx512::Enabled()) {
    const bool fp16 = IsFp16(model_dtype);
    ForEachChunk(executor, n, [&](int64_t off, int64_t size) {
      avx512::QuantizeFp8(src + off, dst + off, size, scale, fp16, e5m2);
    });
    return;
  }
  const LoopFn loop = IsFp16(model_dtype) ? (e5m2 ? Fp8Loop<true, true> : Fp8Loop<true, false>)
                                          : (e5m2 ? Fp8Loop<false, true> : Fp8Loop<false, false>);
  ForEachChunk(executor, n, [&](int64_t off, int64_t size) { loop(src + off, dst + off, size, scale); });
}

void QuantizeTensor16(CpuExecutor* executor, Format format, Format model_dtype, const float* src, int64_t n,
                      uint8_t* dst) {
  using LoopFn = void (*)(const float*, uint8_t*, int64_t);
  const bool out16 = format == Format::kFP16;
  if (avx512::Enabled()) {
    const bool fp16 = IsFp16(model_dtype);
    ForEachChunk(executor, n, [&](int64_t off, int64_t size) {
      avx512::Cast16(src + off, dst + 2 * off, size, fp16, out16);
    });
    return;
  }
  const LoopFn loop = IsFp16(model_dtype) ? (out16 ? Cast16Loop<true, true> : Cast16Loop<true, false>)
                                          : (out16 ? Cast16Loop<false, true> : Cast16Loop<false, false>);
  ForEachChunk(executor, n, [&](int64_t off, int64_t size) { loop(src + off, dst + 2 * off, size); });
}

MAINSTAY_VECTOR_CLONES int32_t RawAmaxLoop(const float* src, int64_t n) {
  int32_t m = 0;
  for (int64_t t = 0; t < n; t += kPrefetchSlice) {
    PrefetchSlice<4, false>(src, t + kPrefetchAhead);
    const int64_t end = std::min(n, t + kPrefetchSlice);
    for (int64_t i = t; i < end; ++i) {
      const int32_t a = AmaxBits(FloatBits(src[i]));
      m = a > m ? a : m;
    }
  }
  return m;
}

}  // namespace

// A plain function around the cloned loop: the clones (and their resolver) stay in this file.
int32_t RawAmax(const float* src, int64_t n) { return RawAmaxLoop(src, n); }

int32_t PartialAmaxBits(CpuExecutor* executor, bool fp16_model, const float* master, int64_t n) {
  std::vector<int32_t> partial(static_cast<size_t>(CeilDiv(n, kChunkElements)), 0);
  const auto loop = fp16_model ? AmaxLoop<true> : AmaxLoop<false>;
  ForEachChunk(executor, n, [&](int64_t off, int64_t size) {
    partial[static_cast<size_t>(off / kChunkElements)] = loop(master + off, size);
  });
  int32_t m = 0;
  for (int32_t p : partial) m = std::max(m, p);
  return m;
}

absl::Status ComputePartialAmax(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                std::span<const float> master, const AmaxOutputs& out) {
  if (Describe(format).has_block_scales() && !out.block_amax.empty()) {
    return BlockPartialAmax(device, format, model_dtype, fragment, master, out);
  }
  if (out.tensor_amax != nullptr) {
    *out.tensor_amax =
        BitsFloat(static_cast<uint32_t>(PartialAmaxBits(device.executor, IsFp16(model_dtype), master.data(),
                                                        fragment.size())));
  }
  return absl::OkStatus();
}

absl::Status Quantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                      std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out) {
  const FormatDescriptor& d = Describe(format);
  if (d.has_block_scales()) return BlockQuantize(device, format, model_dtype, fragment, master, scales, out);
  const int64_t n = fragment.size();
  switch (d.scaling) {
    case ScalingMode::kNone:
      QuantizeTensor16(device.executor, format, model_dtype, master.data(), n, out.data.data());
      return absl::OkStatus();
    case ScalingMode::kDelayed:
    case ScalingMode::kCurrent: {
      const float fp8_max = IsE5M2(format) ? kE5M2Max : kE4M3Max;
      const float scale = d.scaling == ScalingMode::kDelayed
                              ? scales.tensor_scale
                              : CurrentScalingScale(scales.tensor_amax, fp8_max, scales.pow2_scales);
      QuantizeTensorScaled(device.executor, format, model_dtype, master.data(), n, scale, out.data.data());
      if (out.tensor_scale_inv != nullptr) *out.tensor_scale_inv = ScaleInv(scale);
      return absl::OkStatus();
    }
    case ScalingMode::kBlock:
      break;
  }
  return absl::InternalError("quantize: format without a CPU kernel");
}

absl::Status Dequantize(const Device& device, Format format, const Fragment& fragment, const QuantizedInputs& in,
                        std::span<float> out) {
  const FormatDescriptor& d = Describe(format);
  if (d.has_block_scales()) return BlockDequantize(device, format, fragment, in, out);
  const uint8_t* src = in.data.data();
  float* dst = out.data();
  if (d.scaling == ScalingMode::kNone && avx512::Enabled()) {
    const bool fp16 = format == Format::kFP16;
    const bool stream = avx512::StreamOutput(fragment.size() * 4);
    ForEachChunk(device.executor, fragment.size(), [&](int64_t off, int64_t size) {
      avx512::Dequantize16(src + 2 * off, dst + off, size, fp16, stream);
    });
  } else if (d.scaling == ScalingMode::kNone) {
    const auto loop = format == Format::kFP16 ? Dequant16Loop<true> : Dequant16Loop<false>;
    ForEachChunk(device.executor, fragment.size(),
                 [&](int64_t off, int64_t size) { loop(src + 2 * off, dst + off, size); });
  } else if (avx512::Enabled()) {
    const bool e5m2 = IsE5M2(format);
    const bool stream = avx512::StreamOutput(fragment.size() * 4);
    ForEachChunk(device.executor, fragment.size(), [&](int64_t off, int64_t size) {
      avx512::DequantizeFp8(src + off, dst + off, size, in.tensor_scale_inv, e5m2, stream);
    });
  } else {
    const auto loop = IsE5M2(format) ? DequantFp8Loop<true> : DequantFp8Loop<false>;
    ForEachChunk(device.executor, fragment.size(),
                 [&](int64_t off, int64_t size) { loop(src + off, dst + off, size, in.tensor_scale_inv); });
  }
  return absl::OkStatus();
}

}  // namespace mainstay::kernels::cpu

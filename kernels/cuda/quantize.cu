// CUDA backend of kernels.h: partial amax, quantize and dequantize of a fragment, for every
// format. Element math comes from the shared casts.h / scaling.h, so the bytes equal the CPU
// backend's (FORMATS.md). All pointers are device pointers; work is enqueued on the
// device's stream and the calls return before it runs.
//
// Design (fragment_visit.cuh has the visitors):
//   ComputePartialAmax: with per-block amax, TileKernel (one thread group per block of the
//     range, one plain store per block); tensor amax only, FlatKernel + one atomicMax per CTA.
//   Quantize: block formats first turn each block amax into its stored scale and its element
//     multiplier (BlockFactorKernel, one thread per block, multipliers in the stream's
//     persistent workspace, stream_call.h); then FlatKernel casts runs of 4 elements, looking up each element's block.
//   Dequantize: FlatKernel, decoding each element's block scale in place.
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/cuda/fragment_visit.cuh"

namespace mainstay::kernels::cuda {
namespace {

// ---- Amax.

struct ModelValueOp {
  const float* master;
  Format model_dtype;
  bool vec_ok;  // master is 16-byte aligned

  __device__ __forceinline__ void operator()(int64_t j, int cnt, bool vec, float (&x)[4], GradAccum&) const {
    float m[4];
    LoadF32x4(master, j, cnt, vec && vec_ok, m);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = ModelValue(m[k], model_dtype);
  }
};

// ---- Quantize.

enum class QuantKind { k16Bit, kFp8Tensor, kFp8Blocks, kNvfp4 };

template <QuantKind K>
struct QuantizeOp {
  const float* master;
  Format model_dtype;
  Format format;        // k16Bit: the data format (bf16 / fp16)
  bool e5m2;            // kFp8Tensor
  float scale;          // kFp8Tensor: the per-tensor scale
  const float* factor;  // kFp8Blocks, kNvfp4: element multiplier per block of the range
  BlockGeometry geo;
  uint8_t* data;
  // Vector accesses on aligned runs, each array by its own base address.
  bool vec_master;  // 16-byte aligned
  bool vec_data;    // aligned as DataAlignment(format)

  __device__ __forceinline__ void operator()(int64_t j, int cnt, bool vec, float (&x)[4], GradAccum&) const {
    float m[4];
    LoadF32x4(master, j, cnt, vec && vec_master, m);
    vec = vec && vec_data;  // below, only data is accessed
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = ModelValue(m[k], model_dtype);
    if constexpr (K == QuantKind::k16Bit) {
      uint16_t b[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) b[k] = DeviceModelBits(x[k], format);
      StoreU16x4Bytes(data, j, cnt, vec, b);
    } else {
      float y[4];
      if constexpr (K == QuantKind::kFp8Tensor) {
#pragma unroll
        for (int k = 0; k < 4; ++k) y[k] = x[k] * scale;
      } else {
        int64_t lb[4];
        geo.LocalBlocks4(j, lb);
#pragma unroll
        for (int k = 0; k < 4; ++k) y[k] = k < cnt ? x[k] * factor[lb[k]] : 0.0f;
      }
      uint8_t q[4];
      if constexpr (K == QuantKind::kNvfp4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) q[k] = cpu::E2M1Bits(y[k]);
        StoreNibbles4(data, j, cnt, vec, q);
      } else {
        CastFp8x4(y, e5m2, q);
        StoreU8x4(data, j, cnt, vec, q);
      }
    }
  }
};

// Per block of the range: the stored scale (mxfp8 E8M0, fp8_block FP32 scale_inv as 4
// little-endian bytes, nvfp4 E4M3) and the element multiplier.
__global__ void __launch_bounds__(kThreads)
    BlockFactorKernel(Format format, const float* block_amax, int64_t nblocks, float s_enc, float s_dec,
                      uint8_t* scales, float* factor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < nblocks; i += stride) {
    const float a = block_amax[i];
    if (format == Format::kMXFP8) {
      const uint8_t e = MxfpBlockScale(a, kE4M3Max);
      scales[i] = e;
      factor[i] = MxfpMultiplier(e);
    } else if (format == Format::kFP8Block) {
      const float scale = CurrentScalingScale(a, kE4M3Max, /*pow2=*/true);
      const uint32_t inv = FloatBits(ScaleInv(scale));
#pragma unroll
      for (int b = 0; b < 4; ++b) scales[4 * i + b] = static_cast<uint8_t>(inv >> (8 * b));
      factor[i] = scale;
    } else {  // nvfp4
      const uint8_t s = Nvfp4TileScaleE4M3(a, s_enc);
      scales[i] = s;
      factor[i] = Nvfp4TileEncode(s, s_dec);
    }
  }
}

template <QuantKind K>
absl::Status LaunchQuantize(const QuantizeOp<K>& op, int64_t n, const ReduceOutputs& red, StreamCall& call) {
  FlatKernel<<<FlatGridFor(n), kThreads, 0, call.stream()>>>(op, n, red);
  return call.Launched("FlatKernel<Quantize>");
}

// ---- Dequantize.

enum class DequantKind { k16Bit, kFp8Tensor, kMxfp8, kFp8Block, kNvfp4 };

__device__ __forceinline__ float LoadF32Bytes(const uint8_t* p) {
  return BitsFloat(p[0] | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
                   (static_cast<uint32_t>(p[3]) << 24));
}

template <DequantKind K>
struct DequantizeOp {
  const uint8_t* data;
  const uint8_t* scales;  // block scales of the range
  float scale_inv;        // fp8 per-tensor scale_inv, nvfp4 S_dec
  Format format;          // k16Bit: bf16 / fp16
  bool e5m2;              // kFp8Tensor
  BlockGeometry geo;
  float* out;
  // Vector accesses on aligned runs, each array by its own base address.
  bool vec_data;  // aligned as DataAlignment(format)
  bool vec_out;   // 16-byte aligned

  __device__ __forceinline__ void operator()(int64_t j, int cnt, bool vec, float (&x)[4], GradAccum&) const {
    const bool vec_in = vec && vec_data;
    float y[4];
    if constexpr (K == DequantKind::k16Bit) {
      uint16_t b[4];
      LoadU16x4Bytes(data, j, cnt, vec_in, b);
#pragma unroll
      for (int k = 0; k < 4; ++k) y[k] = ModelBitsToFloat(b[k], format);
    } else if constexpr (K == DequantKind::kNvfp4) {
      uint8_t b0, b1 = 0;
      if (vec_in) {
        const uint16_t t = *reinterpret_cast<const uint16_t*>(data + j / 2);
        b0 = static_cast<uint8_t>(t & 0xFF);
        b1 = static_cast<uint8_t>(t >> 8);
      } else {
        b0 = data[j / 2];
        if (cnt > 2) b1 = data[j / 2 + 1];
      }
      const uint8_t q[4] = {static_cast<uint8_t>(b0 & 0xF), static_cast<uint8_t>(b0 >> 4),
                            static_cast<uint8_t>(b1 & 0xF), static_cast<uint8_t>(b1 >> 4)};
      int64_t lb[4];
      geo.LocalBlocks4(j, lb);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        y[k] = k < cnt ? E2M1ToFloat(q[k]) * E4M3ToFloat(scales[lb[k]]) * scale_inv : 0.0f;
      }
    } else {
      uint8_t q[4];
      LoadU8x4(data, j, cnt, vec_in, q);
      if constexpr (K == DequantKind::kFp8Tensor) {
#pragma unroll
        for (int k = 0; k < 4; ++k) y[k] = (e5m2 ? E5M2ToFloat(q[k]) : E4M3ToFloat(q[k])) * scale_inv;
      } else {
        int64_t lb[4];
        geo.LocalBlocks4(j, lb);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (k >= cnt) {
            y[k] = 0.0f;
          } else if constexpr (K == DequantKind::kMxfp8) {
            y[k] = E4M3ToFloat(q[k]) * E8M0ToFloat(scales[lb[k]]);
          } else {
            y[k] = E4M3ToFloat(q[k]) * LoadF32Bytes(scales + 4 * lb[k]);
          }
        }
      }
    }
    StoreF32x4(out, j, cnt, vec && vec_out, y);
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = 0.0f;
  }
};

template <DequantKind K>
absl::Status LaunchDequantize(const DequantizeOp<K>& op, int64_t n, StreamCall& call) {
  FlatKernel<<<FlatGridFor(n), kThreads, 0, call.stream()>>>(op, n, ReduceOutputs{});
  return call.Launched("FlatKernel<Dequantize>");
}

uintptr_t DataAlignment(Format format) {
  switch (Describe(format).bits_per_element) {
    case 16:
      return 8;
    case 8:
      return 4;
    default:
      return 2;
  }
}

}  // namespace

absl::Status ComputePartialAmax(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                std::span<const float> master, const AmaxOutputs& out) {
  StreamCall call(StreamOf(device), absl::StrCat("ComputePartialAmax ", FormatName(format)));
  const int64_t n = fragment.size();
  if (out.tensor_amax != nullptr) {
    MAINSTAY_RETURN_IF_ERROR(
        call.Check(cudaMemsetAsync(out.tensor_amax, 0, sizeof(float), call.stream()), "cudaMemsetAsync(tensor_amax)"));
  }
  const ModelValueOp op{master.data(), model_dtype, Aligned(master.data(), 16)};
  ReduceOutputs red;
  red.tensor_amax = out.tensor_amax;
  if (!out.block_amax.empty()) {
    return LaunchTiles<false>(format, MakeTileGeometry(format, fragment), op, out.block_amax.data(), red, MxfpCast{},
                              call, nullptr);
  }
  if (out.tensor_amax == nullptr || n == 0) return absl::OkStatus();
  FlatKernel<<<FlatGridFor(n), kThreads, 0, call.stream()>>>(op, n, red);
  return call.Launched("FlatKernel<Amax>");
}

absl::Status Quantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                      std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out) {
  StreamCall call(StreamOf(device), absl::StrCat("Quantize ", FormatName(format)));
  const int64_t n = fragment.size();
  const FormatDescriptor& d = Describe(format);
  const bool e5m2 = d.element == ElementType::kE5M2;
  const float fp8_max = e5m2 ? kE5M2Max : kE4M3Max;

  // Per-tensor scales are host values: computed here with the same functions as the CPU.
  float scale = 1.0f;
  if (d.scaling == ScalingMode::kDelayed) scale = scales.tensor_scale;
  if (d.scaling == ScalingMode::kCurrent) scale = CurrentScalingScale(scales.tensor_amax, fp8_max, scales.pow2_scales);
  const float s_enc = format == Format::kNVFP4 ? Nvfp4GlobalEncodeScale(scales.tensor_amax) : 1.0f;
  const float s_dec = ScaleInv(s_enc);
  ReduceOutputs red;
  if (d.tensor_scale && out.tensor_scale_inv != nullptr) {
    red.scalar_out = out.tensor_scale_inv;  // written by CTA 0 of the cast kernel
    red.scalar_value = format == Format::kNVFP4 ? s_dec : ScaleInv(scale);
  }

  const bool vec_master = Aligned(master.data(), 16);
  const bool vec_data = Aligned(out.data.data(), DataAlignment(format));
  const BlockGeometry geo = MakeBlockGeometry(format, fragment);
  const float* factor = nullptr;
  if (d.has_block_scales()) {
    const int64_t nblocks = ScaleBlockRange(format, fragment.view, fragment.elements).size();
    if (nblocks > 0) {
      MAINSTAY_ASSIGN_OR_RETURN(void* w, call.Workspace(static_cast<size_t>(nblocks) * sizeof(float)));
      BlockFactorKernel<<<GridFor(nblocks, kThreads), kThreads, 0, call.stream()>>>(
          format, scales.block_amax.data(), nblocks, s_enc, s_dec, out.block_scales.data(), static_cast<float*>(w));
      MAINSTAY_RETURN_IF_ERROR(call.Launched("BlockFactorKernel"));
      factor = static_cast<const float*>(w);
    }
  }

  switch (format) {
    case Format::kBF16:
    case Format::kFP16:
      return LaunchQuantize(QuantizeOp<QuantKind::k16Bit>{master.data(), model_dtype, format, false, 1.0f, nullptr, geo,
                                                          out.data.data(), vec_master, vec_data},
                            n, red, call);
    case Format::kMXFP8:
    case Format::kFP8Block:
      return LaunchQuantize(QuantizeOp<QuantKind::kFp8Blocks>{master.data(), model_dtype, format, false, 1.0f, factor,
                                                              geo, out.data.data(), vec_master, vec_data},
                            n, red, call);
    case Format::kNVFP4:
      return LaunchQuantize(QuantizeOp<QuantKind::kNvfp4>{master.data(), model_dtype, format, false, 1.0f, factor, geo,
                                                          out.data.data(), vec_master, vec_data},
                            n, red, call);
    default:  // fp8 per-tensor, delayed or current
      return LaunchQuantize(QuantizeOp<QuantKind::kFp8Tensor>{master.data(), model_dtype, format, e5m2, scale, nullptr,
                                                              geo, out.data.data(), vec_master, vec_data},
                            n, red, call);
  }
}

absl::Status Dequantize(const Device& device, Format format, const Fragment& fragment, const QuantizedInputs& in,
                        std::span<float> out) {
  const int64_t n = fragment.size();
  if (n == 0) return absl::OkStatus();
  StreamCall call(StreamOf(device), absl::StrCat("Dequantize ", FormatName(format)));
  const bool e5m2 = Describe(format).element == ElementType::kE5M2;
  const bool vec_data = Aligned(in.data.data(), DataAlignment(format));
  const bool vec_out = Aligned(out.data(), 16);
  const BlockGeometry geo = MakeBlockGeometry(format, fragment);
  const uint8_t* data = in.data.data();
  const uint8_t* scales = in.block_scales.data();
  const float inv = in.tensor_scale_inv;
  switch (format) {
    case Format::kBF16:
    case Format::kFP16:
      return LaunchDequantize(
          DequantizeOp<DequantKind::k16Bit>{data, scales, inv, format, false, geo, out.data(), vec_data, vec_out}, n,
          call);
    case Format::kMXFP8:
      return LaunchDequantize(
          DequantizeOp<DequantKind::kMxfp8>{data, scales, inv, format, false, geo, out.data(), vec_data, vec_out}, n,
          call);
    case Format::kFP8Block:
      return LaunchDequantize(
          DequantizeOp<DequantKind::kFp8Block>{data, scales, inv, format, false, geo, out.data(), vec_data, vec_out}, n,
          call);
    case Format::kNVFP4:
      return LaunchDequantize(
          DequantizeOp<DequantKind::kNvfp4>{data, scales, inv, format, false, geo, out.data(), vec_data, vec_out}, n,
          call);
    default:
      return LaunchDequantize(
          DequantizeOp<DequantKind::kFp8Tensor>{data, scales, inv, format, e5m2, geo, out.data(), vec_data, vec_out}, n,
          call);
  }
}

}  // namespace mainstay::kernels::cuda

// CUDA backend of kernels.h: fused AdamW / SGD updates (optionally casting the updated values
// in the same pass) and gradient statistics. The per-element arithmetic is optimizer_math.h,
// shared with the CPU backend and built without FMA contraction (--fmad=false), so masters,
// moments, model values and quantized bytes equal the CPU's bit for bit.
//
// Design (fragment_visit.cuh has the visitors):
//   One pass reads grad + master + m (+ v) and writes master + m (+ v), model values and cast
//   bytes, in runs of 4 elements (16-byte accesses when aligned).
//   No per-block amax wanted: FlatKernel. Per-block amax wanted (or the mxfp8 in-pass cast,
//   which needs each 1x32 block's amax before its cast): TileKernel, one thread group per
//   block; for mxfp8 8 lanes hold a block's 32 updated values, reduce the amax with shuffles,
//   then cast and store them.
//   Gradient stats: per-thread FP64 sums, reduced per CTA in a fixed tree into per-CTA
//   partials (in the stream's persistent workspace, stream_call.h), then FinalizeStatsKernel
//   adds them in a fixed order.
//   Grid sizes depend only on the fragment, so the sum is reproducible run to run.
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/cuda/fragment_visit.cuh"

namespace mainstay::kernels::cuda {
namespace {

// Gradient runs as FP32, already multiplied by grad_multiplier.
struct GradSource {
  const void* data;
  ElementType type;
  float multiplier;

  __device__ __forceinline__ void Load(int64_t j, int cnt, bool vec, float (&g)[4]) const {
    if (type == ElementType::kFloat32) {
      LoadF32x4(static_cast<const float*>(data), j, cnt, vec, g);
    } else {
      uint16_t b[4];
      LoadU16x4(static_cast<const uint16_t*>(data), j, cnt, vec, b);
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] = type == ElementType::kBFloat16 ? Bf16ToFloat(b[k]) : Fp16ToFloat(b[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) g[k] = g[k] * multiplier;
  }
};

bool GradAligned(const GradView& grad) {
  return Aligned(grad.data, grad.type == ElementType::kFloat32 ? 16 : 8);
}

__device__ __forceinline__ void LoadMoments(const void* p, ElementType type, int64_t j, int cnt, bool vec,
                                            float (&v)[4]) {
  if (type == ElementType::kBFloat16) {
    uint16_t b[4];
    LoadU16x4(static_cast<const uint16_t*>(p), j, cnt, vec, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = Bf16ToFloat(b[k]);
  } else {
    LoadF32x4(static_cast<const float*>(p), j, cnt, vec, v);
  }
}

__device__ __forceinline__ void StoreMoments(void* p, ElementType type, int64_t j, int cnt, bool vec,
                                             const float (&v)[4]) {
  if (type == ElementType::kBFloat16) {
    uint16_t b[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) b[k] = DeviceModelBits(v[k], Format::kBF16);
    StoreU16x4(static_cast<uint16_t*>(p), j, cnt, vec, b);
  } else {
    StoreF32x4(static_cast<float*>(p), j, cnt, vec, v);
  }
}

// The cast FlatKernel can do in the pass (scales known before it): bf16/fp16 data or fp8
// with the delayed scale.
enum class PassCast { kNone, k16Bit, kFp8 };

struct FlatCast {
  PassCast mode = PassCast::kNone;
  Format format = Format::kBF16;  // k16Bit: the data format
  bool e5m2 = false;
  float scale = 1.0f;
  uint8_t* data = nullptr;
};

// Which arrays take 16-byte (8 for 16-bit and packed arrays) accesses on aligned runs: each
// array by its own base address, so one misaligned array costs only its own accesses.
struct VectorArrays {
  bool grad = false;
  bool master = false;
  bool m = false;
  bool v = false;
  bool model = false;  // model_values
  bool cast = false;   // FlatCast::data
};

template <bool kAdam>
struct OptimizerOp {
  GradSource grad;
  float* master;
  void* m;
  void* v;  // AdamW only
  ElementType moment_type;
  AdamWHyper adam;
  AdamWConstants adam_c;
  SgdHyper sgd;
  Format model_dtype;
  uint16_t* model_values;  // nullptr = not written
  FlatCast cast;
  bool stats;    // accumulate gradient stats
  bool dry_run;  // StepOutputs::dry_run: the state is read, not written
  VectorArrays vec_arrays;

  __device__ __forceinline__ void operator()(int64_t j, int cnt, bool vec, float (&x)[4], GradAccum& acc) const {
    float g[4];
    grad.Load(j, cnt, vec && vec_arrays.grad, g);
    if (stats) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k < cnt) acc.Add(g[k]);
      }
    }
    float p[4], mm[4], vv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    LoadF32x4(master, j, cnt, vec && vec_arrays.master, p);
    LoadMoments(m, moment_type, j, cnt, vec && vec_arrays.m, mm);
    if constexpr (kAdam) LoadMoments(v, moment_type, j, cnt, vec && vec_arrays.v, vv);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < cnt) {
        if constexpr (kAdam) {
          AdamWElement(adam, adam_c, g[k], p[k], mm[k], vv[k]);
        } else {
          SgdElement(sgd, g[k], p[k], mm[k]);
        }
      }
    }
    if (!dry_run) {
      StoreF32x4(master, j, cnt, vec && vec_arrays.master, p);
      StoreMoments(m, moment_type, j, cnt, vec && vec_arrays.m, mm);
      if constexpr (kAdam) StoreMoments(v, moment_type, j, cnt, vec && vec_arrays.v, vv);
    }
    uint16_t bits[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      bits[k] = DeviceModelBits(p[k], model_dtype);
      x[k] = ModelBitsToFloat(bits[k], model_dtype);
    }
    if (model_values != nullptr) StoreU16x4(model_values, j, cnt, vec && vec_arrays.model, bits);
    if (cast.mode == PassCast::k16Bit) {
      uint16_t b[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) b[k] = DeviceModelBits(x[k], cast.format);
      StoreU16x4Bytes(cast.data, j, cnt, vec && vec_arrays.cast, b);
    } else if (cast.mode == PassCast::kFp8) {
      float y[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) y[k] = x[k] * cast.scale;
      uint8_t q[4];
      CastFp8x4(y, cast.e5m2, q);
      StoreU8x4(cast.data, j, cnt, vec && vec_arrays.cast, q);
    }
  }
};

struct GradStatsOp {
  GradSource grad;
  bool vec_ok;

  __device__ __forceinline__ void operator()(int64_t j, int cnt, bool vec, float (&x)[4], GradAccum& acc) const {
    float g[4];
    grad.Load(j, cnt, vec && vec_ok, g);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < cnt) acc.Add(g[k]);
      x[k] = 0.0f;
    }
  }
};

// Adds the per-CTA partials in a fixed order (one CTA, fixed tree) and writes the results.
__global__ void __launch_bounds__(kThreads)
    FinalizeStatsKernel(const double* part_sums, const long long* part_counts, int parts, double* sum_out,
                        int64_t* count_out) {
  __shared__ double s_sum[kThreads];
  __shared__ long long s_count[kThreads];
  const int t = static_cast<int>(threadIdx.x);
  double s = 0.0;
  long long c = 0;
  for (int p = t; p < parts; p += kThreads) {
    s += part_sums[p];
    c += part_counts[p];
  }
  s_sum[t] = s;
  s_count[t] = c;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (t < w) {
      s_sum[t] += s_sum[t + w];
      s_count[t] += s_count[t + w];
    }
    __syncthreads();
  }
  if (t == 0) {
    if (sum_out != nullptr) *sum_out = s_sum[0];
    if (count_out != nullptr) *count_out = static_cast<int64_t>(s_count[0]);
  }
}

// Per-CTA partials of the gradient stats, then their sum into the caller's scalars.
// (In the call's workspace: `grid` doubles, then `grid` counts.)
class StatsPartials {
 public:
  StatsPartials(StreamCall& call, int grid) : call_(call), grid_(grid) {}

  absl::Status Allocate(ReduceOutputs& red) {
    MAINSTAY_ASSIGN_OR_RETURN(void* w,
                              call_.Workspace(static_cast<size_t>(grid_) * (sizeof(double) + sizeof(long long))));
    sums_ = static_cast<double*>(w);
    counts_ = reinterpret_cast<long long*>(sums_ + grid_);
    red.part_sum_squares = sums_;
    red.part_nonfinite = counts_;
    return absl::OkStatus();
  }

  absl::Status Finalize(double* sum_squares, int64_t* nonfinite) {
    FinalizeStatsKernel<<<1, kThreads, 0, call_.stream()>>>(sums_, counts_, grid_, sum_squares, nonfinite);
    return call_.Launched("FinalizeStatsKernel");
  }

 private:
  StreamCall& call_;
  int grid_;
  double* sums_ = nullptr;
  long long* counts_ = nullptr;
};

template <bool kAdam>
OptimizerOp<kAdam> MakeOp(Format model_dtype, GradView grad, float multiplier, const OptimizerState& state,
                          const StepOutputs& out) {
  OptimizerOp<kAdam> op{};
  op.grad = GradSource{grad.data, grad.type, multiplier};
  op.master = state.master;
  op.m = state.m;
  op.v = state.v;
  op.moment_type = state.moment_type;
  op.model_dtype = model_dtype;
  op.model_values = out.model_values.empty() ? nullptr : out.model_values.data();
  op.stats = out.grad_sum_squares != nullptr || out.grad_nonfinite != nullptr;
  op.dry_run = out.dry_run;
  const uintptr_t moment_align = state.moment_type == ElementType::kBFloat16 ? 8 : 16;
  op.vec_arrays.grad = GradAligned(grad);
  op.vec_arrays.master = Aligned(state.master, 16);
  op.vec_arrays.m = Aligned(state.m, moment_align);
  op.vec_arrays.v = kAdam && Aligned(state.v, moment_align);
  op.vec_arrays.model = Aligned(op.model_values, 8);
  return op;
}

// One optimizer pass over the fragment. `what`: the kernels.h call, as errors name it;
// `mx_cast`: the mxfp8 in-pass cast (AdamW only); `scale_inv_out` / `scale_inv`: a per-tensor
// scale_inv to store (fp8 delayed).
template <bool kAdam>
absl::Status RunOptimizer(const Device& device, const char* what, Format format, const Fragment& fragment,
                          const OptimizerOp<kAdam>& op, const StepOutputs& out, const MxfpCast* mx_cast,
                          float* scale_inv_out, float scale_inv) {
  StreamCall call(StreamOf(device), absl::StrCat(what, " ", FormatName(format)));
  const cudaStream_t stream = call.stream();
  const int64_t n = fragment.size();
  if (out.amax.tensor_amax != nullptr) {
    MAINSTAY_RETURN_IF_ERROR(
        call.Check(cudaMemsetAsync(out.amax.tensor_amax, 0, sizeof(float), stream), "cudaMemsetAsync(tensor_amax)"));
  }
  float* block_amax = out.amax.block_amax.empty() ? nullptr : out.amax.block_amax.data();
  const bool tiles = n > 0 && (block_amax != nullptr || mx_cast != nullptr);
  TileGeometry geometry;
  int grid = FlatGridFor(n);
  if (tiles) {
    geometry = MakeTileGeometry(format, fragment);
    grid = TileGridFor(format, geometry.nblocks);
  }
  ReduceOutputs red;
  red.tensor_amax = out.amax.tensor_amax;
  red.scalar_out = scale_inv_out;
  red.scalar_value = scale_inv;
  StatsPartials partials(call, grid);
  if (op.stats) MAINSTAY_RETURN_IF_ERROR(partials.Allocate(red));

  if (tiles) {
    int launched = 0;
    if constexpr (kAdam) {
      if (mx_cast != nullptr) {
        MAINSTAY_RETURN_IF_ERROR(
            LaunchTiles<true>(format, geometry, op, block_amax, red, *mx_cast, call, &launched));
      }
    }
    if (mx_cast == nullptr) {
      MAINSTAY_RETURN_IF_ERROR(LaunchTiles<false>(format, geometry, op, block_amax, red, MxfpCast{}, call, &launched));
    }
    if (launched != grid) return absl::InternalError("tile grid mismatch");
  } else {
    FlatKernel<<<grid, kThreads, 0, stream>>>(op, n, red);
    MAINSTAY_RETURN_IF_ERROR(call.Launched(kAdam ? "FlatKernel<AdamW>" : "FlatKernel<SGD>"));
  }
  if (op.stats) MAINSTAY_RETURN_IF_ERROR(partials.Finalize(out.grad_sum_squares, out.grad_nonfinite));
  return absl::OkStatus();
}

}  // namespace

absl::Status FusedAdamW(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                        GradView grad, const OptimizerState& state, const AdamWHyper& hyper, const StepOutputs& out) {
  OptimizerOp<true> op = MakeOp<true>(model_dtype, grad, hyper.grad_multiplier, state, out);
  op.adam = hyper;
  op.adam_c = MakeAdamWConstants(hyper);
  return RunOptimizer(device, "FusedAdamW", format, fragment, op, out, nullptr, nullptr, 0.0f);
}

absl::Status FusedAdamWQuantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                GradView grad, const OptimizerState& state, const AdamWHyper& hyper,
                                const ScaleInputs& scales, const StepOutputs& out,
                                const QuantizedOutputs& quantized) {
  OptimizerOp<true> op = MakeOp<true>(model_dtype, grad, hyper.grad_multiplier, state, out);
  op.adam = hyper;
  op.adam_c = MakeAdamWConstants(hyper);
  uint8_t* data = quantized.data.data();
  if (format == Format::kMXFP8) {
    // The block amax is computed in the pass, so no block may reach outside the fragment
    // (the CPU backend refuses the same fragments).
    if (!MxfpBlocksInFragment(fragment)) {
      return InvalidArgumentError("fragment", "mxfp8 in one pass needs cols and fragment bounds that are ",
                                  "multiples of 32, got cols ", fragment.view.cols, " and [",
                                  fragment.elements.begin, ", ", fragment.elements.end, ")");
    }
    const MxfpCast mx{data, quantized.block_scales.data(), Aligned(data, 4)};
    return RunOptimizer(device, "FusedAdamWQuantize", format, fragment, op, out, &mx, nullptr, 0.0f);
  }
  const FormatDescriptor& d = Describe(format);
  float* scale_inv_out = nullptr;
  float scale_inv = 0.0f;
  if (d.scaling == ScalingMode::kNone) {  // bf16 / fp16
    op.cast = FlatCast{PassCast::k16Bit, format, false, 1.0f, data};
    op.vec_arrays.cast = Aligned(data, 8);
  } else {  // fp8 delayed or current (kernels.cc admits nothing else here)
    const bool e5m2 = d.element == ElementType::kE5M2;
    const float scale = d.scaling == ScalingMode::kCurrent
                            ? CurrentScalingScale(scales.tensor_amax, e5m2 ? kE5M2Max : kE4M3Max, scales.pow2_scales)
                            : scales.tensor_scale;
    op.cast = FlatCast{PassCast::kFp8, format, e5m2, scale, data};
    op.vec_arrays.cast = Aligned(data, 4);
    scale_inv_out = quantized.tensor_scale_inv;
    scale_inv = ScaleInv(scale);
  }
  return RunOptimizer(device, "FusedAdamWQuantize", format, fragment, op, out, nullptr, scale_inv_out, scale_inv);
}

absl::Status FusedSgd(const Device& device, Format format, Format model_dtype, const Fragment& fragment, GradView grad,
                      const OptimizerState& state, const SgdHyper& hyper, const StepOutputs& out) {
  OptimizerOp<false> op = MakeOp<false>(model_dtype, grad, hyper.grad_multiplier, state, out);
  op.sgd = hyper;
  return RunOptimizer(device, "FusedSgd", format, fragment, op, out, nullptr, nullptr, 0.0f);
}

absl::Status Synchronize(const Device& device) { return SynchronizeStream(StreamOf(device)); }

absl::Status GradStats(const Device& device, GradView grad, int64_t n, float multiplier, double* sum_squares,
                       int64_t* nonfinite) {
  StreamCall call(StreamOf(device), "GradStats");
  const int grid = FlatGridFor(n);
  ReduceOutputs red;
  StatsPartials partials(call, grid);
  MAINSTAY_RETURN_IF_ERROR(partials.Allocate(red));
  const GradStatsOp op{GradSource{grad.data, grad.type, multiplier}, GradAligned(grad)};
  FlatKernel<<<grid, kThreads, 0, call.stream()>>>(op, n, red);
  MAINSTAY_RETURN_IF_ERROR(call.Launched("FlatKernel<GradStats>"));
  return partials.Finalize(sum_squares, nonfinite);
}

}  // namespace mainstay::kernels::cuda

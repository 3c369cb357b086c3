// CPU backend of the fused optimizer kernels and GradStats (kernels.h; arguments were
// validated by kernels.cc).
//
// One pass per fragment. The fragment is cut into fixed chunks of kChunkElements (the
// ParallelFor tasks, independent of the thread count); a chunk walks L1-resident sub-blocks
// and, for each, runs the gradient statistics, the update (grad + master + moments read,
// master + moments written), the model-dtype cast of the updated masters, their amax, and
// the quantized output, each as a tight loop over the sub-block (optimizer_loops.h). Every
// reduction has a fixed shape: sums of squares use kSumLanes FP64 lanes per chunk and chunk
// totals are added in chunk order; amaxes and counts are exact. So every output is bit for
// bit the same for any number of threads.
// GCC 12 warns (-Wdangling-pointer) when the address of a target_clones function (an ifunc
// symbol, MAINSTAY_VECTOR_CLONES) is stored in a struct, as if it were a local: a false
// positive, the address is the resolved global function.
#pragma GCC diagnostic ignored "-Wdangling-pointer"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/format.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cpu/avx512_loops.h"
#include "kernels/cpu/executor.h"
#include "kernels/cpu/optimizer_loops.h"

namespace mainstay::kernels::cpu {
namespace {

// The update loop of each (gradient type, moment type, in place or dry) triple, picked once
// per call.
template <ElementType kGrad, ElementType kMoment, bool kInPlace>
struct AdamWKernel {
  using Args = AdamWArgs;
  static void Run(const Args& args, const void* grad, int64_t begin, int64_t n, const SpanOut& out) {
    AdamWSpan<kGrad, kMoment, kInPlace>(args, grad, begin, n, out);
  }
};

template <ElementType kGrad, ElementType kMoment, bool kInPlace>
struct SgdKernel {
  using Args = SgdArgs;
  static void Run(const Args& args, const void* grad, int64_t begin, int64_t n, const SpanOut& out) {
    SgdSpan<kGrad, kMoment, kInPlace>(args, grad, begin, n, out);
  }
};

template <typename Args>
using UpdateFn = void (*)(const Args&, const void*, int64_t, int64_t, const SpanOut&);

template <template <ElementType, ElementType, bool> class K, ElementType kGrad, ElementType kMoment>
auto PickPlace(bool dry_run) {
  return dry_run ? &K<kGrad, kMoment, false>::Run : &K<kGrad, kMoment, true>::Run;
}

template <template <ElementType, ElementType, bool> class K, ElementType kGrad>
auto PickForGrad(ElementType moment, bool dry_run) {
  return moment == ElementType::kBFloat16 ? PickPlace<K, kGrad, ElementType::kBFloat16>(dry_run)
                                          : PickPlace<K, kGrad, ElementType::kFloat32>(dry_run);
}

// FP16 gradients reach the loops widened to FP32 (GradSpan), so they use the FP32 loops.
template <template <ElementType, ElementType, bool> class K>
auto PickUpdate(ElementType grad, ElementType moment, bool dry_run) {
  return grad == ElementType::kBFloat16 ? PickForGrad<K, ElementType::kBFloat16>(moment, dry_run)
                                        : PickForGrad<K, ElementType::kFloat32>(moment, dry_run);
}

using StatsFn = int64_t (*)(const void*, int64_t, float, double*);

StatsFn PickStats(ElementType grad) {
  return grad == ElementType::kBFloat16 ? &AccumulateGradStats<ElementType::kBFloat16>
                                        : &AccumulateGradStats<ElementType::kFloat32>;
}

// The gradients of [begin, begin + n) as the loops read them: in place, or widened into
// `scratch` (kSubBlockElements floats) when they are FP16.
const void* GradSpan(GradView grad, int64_t begin, int64_t n, float* scratch) {
  switch (grad.type) {
    case ElementType::kFloat16:
      WidenFp16Grad(grad.data, begin, n, scratch);
      return scratch;
    case ElementType::kBFloat16:
      return static_cast<const uint16_t*>(grad.data) + begin;
    default:
      return static_cast<const float*>(grad.data) + begin;
  }
}


using WalkFn = float (*)(const BlockAmaxTarget&, const uint16_t*, int64_t, int64_t, int64_t, int64_t);
using AdamWCastFn = void (*)(const AdamWArgs&, const void*, int64_t, int64_t, float, uint8_t*, uint8_t*);

struct PassKernels {
  StatsFn stats = nullptr;
  void (*model_bits)(const float*, int64_t, uint16_t*) = nullptr;
  uint16_t (*max_bits)(const uint16_t*, int64_t) = nullptr;
  WalkFn walk = nullptr;  // block amax; nullptr when not wanted
  void (*cast16)(const uint16_t*, int64_t, uint8_t*) = nullptr;
  void (*cast_fp8)(const uint16_t*, int64_t, float, uint8_t*) = nullptr;
  void (*cast_mxfp8)(const uint16_t*, int64_t, uint8_t*, uint8_t*) = nullptr;
  // AdamW in place + the cast as one loop, when the pass wants nothing else (PickAdamWCast).
  AdamWCastFn adamw_cast = nullptr;
};

struct Pass {
  Format format = Format::kBF16;
  Format model_dtype = Format::kBF16;
  Fragment fragment;
  GradView grad;
  float multiplier = 1.0f;
  const float* master = nullptr;  // updated in place by the update loop before it is read here
  bool dry_run = false;           // the update writes to per-sub-block scratch instead
  StepOutputs out;
  bool want_stats = false;
  bool want_bits = false;
  BlockAmaxTarget blocks;
  CastKind cast = CastKind::kNone;
  float tensor_scale = 1.0f;
  QuantizedOutputs quantized;
  PassKernels k;
  // The AVX-512 dry run for the amax (avx512::AdamWDryRunAmax) runs the whole chunk.
  bool avx512_dry_amax = false;
};

struct ChunkResult {
  double sum_squares = 0.0;
  int64_t nonfinite = 0;
  float amax = 0.0f;
};

// Block shapes as the format descriptors state them (common/format.cc), as constants.
template <Format kModel>
WalkFn PickWalk(Format format) {
  switch (format) {
    case Format::kMXFP8:
      return &WalkBlockAmax<kModel, 1, 32>;
    case Format::kFP8Block:
      return &WalkBlockAmax<kModel, 128, 128>;
    case Format::kNVFP4:
      return &WalkBlockAmax<kModel, 16, 16>;
    default:
      return nullptr;
  }
}

template <Format kModel>
void FillModelKernels(Pass& pass) {
  PassKernels& k = pass.k;
  k.model_bits = &ModelBitsSpan<kModel>;
  k.max_bits = &MaxMagnitudeBits<kModel>;
  if (pass.blocks.slots != nullptr) k.walk = PickWalk<kModel>(pass.format);
  switch (pass.cast) {
    case CastKind::kBF16:
      k.cast16 = &Cast16Span<kModel, Format::kBF16>;
      break;
    case CastKind::kFP16:
      k.cast16 = &Cast16Span<kModel, Format::kFP16>;
      break;
    case CastKind::kFP8E4M3:
      k.cast_fp8 = &CastFp8Span<kModel, false>;
      break;
    case CastKind::kFP8E5M2:
      k.cast_fp8 = &CastFp8Span<kModel, true>;
      break;
    case CastKind::kMXFP8:
      k.cast_mxfp8 = &CastMxfp8Span<kModel>;
      break;
    case CastKind::kNone:
      break;
  }
}

template <typename Args>
void ProcessChunk(const Pass& p, UpdateFn<Args> update, const Args& args, int64_t chunk, ChunkResult* result) {
  const int64_t lo = chunk * kChunkElements;
  const int64_t hi = std::min(lo + kChunkElements, p.fragment.size());
  const int64_t base = p.fragment.elements.begin;
  double lanes[kSumLanes] = {};
  int64_t nonfinite = 0;
  float amax = 0.0f;
  if constexpr (std::is_same_v<Args, AdamWArgs>) {
    if (p.avx512_dry_amax) {
      const int32_t bits = avx512::AdamWDryRunAmax(
          args.hyper, args.consts, static_cast<const float*>(p.grad.data) + lo, args.master + lo,
          static_cast<const float*>(args.m) + lo, static_cast<const float*>(args.v) + lo, hi - lo,
          p.model_dtype == Format::kFP16, p.want_stats ? lanes : nullptr, &nonfinite);
      result->sum_squares = CombineLanes(lanes);
      result->nonfinite = nonfinite;
      result->amax = BitsFloat(static_cast<uint32_t>(bits));
      return;
    }
  }
  uint16_t scratch[kSubBlockElements];
  float widened[kSubBlockElements];
  // A dry run's updated values (moments as FP32 or bf16; the widest is 4 bytes).
  float dry_master[kSubBlockElements], dry_m[kSubBlockElements], dry_v[kSubBlockElements];
  for (int64_t s = lo; s < hi; s += kSubBlockElements) {
    const int64_t n = std::min(kSubBlockElements, hi - s);
    const void* grad = GradSpan(p.grad, s, n, widened);
    if constexpr (std::is_same_v<Args, AdamWArgs>) {
      if (p.k.adamw_cast != nullptr) {
        const bool wide = p.cast == CastKind::kBF16 || p.cast == CastKind::kFP16;
        // mxfp8: the fragment starts on a block boundary of a row (checked), so local block = s / 32.
        uint8_t* scales = p.cast == CastKind::kMXFP8 ? p.quantized.block_scales.data() + s / 32 : nullptr;
        p.k.adamw_cast(args, grad, s, n, p.tensor_scale, p.quantized.data.data() + (wide ? 2 : 1) * s, scales);
        continue;
      }
    }
    if (p.want_stats) nonfinite += p.k.stats(grad, n, p.multiplier, lanes);
    update(args, grad, s, n, SpanOut{dry_master, dry_m, dry_v});
    if (!p.want_bits) continue;
    uint16_t* bits = p.out.model_values.empty() ? scratch : p.out.model_values.data() + s;
    p.k.model_bits(p.dry_run ? dry_master : p.master + s, n, bits);
    if (p.k.walk != nullptr) {
      amax = std::max(amax, p.k.walk(p.blocks, bits, base + s, n, base + lo, base + hi));
    } else if (p.out.amax.tensor_amax != nullptr) {
      amax = std::max(amax, ModelBitsToFloat(p.k.max_bits(bits, n), p.model_dtype));
    }
    uint8_t* data = p.quantized.data.data();
    switch (p.cast) {
      case CastKind::kBF16:
      case CastKind::kFP16:
        p.k.cast16(bits, n, data + 2 * s);
        break;
      case CastKind::kFP8E4M3:
      case CastKind::kFP8E5M2:
        p.k.cast_fp8(bits, n, p.tensor_scale, data + s);
        break;
      case CastKind::kMXFP8:
        // The fragment starts on a block boundary of a row (checked), so local block = s / 32.
        p.k.cast_mxfp8(bits, n, data + s, p.quantized.block_scales.data() + s / 32);
        break;
      case CastKind::kNone:
        break;
    }
  }
  result->sum_squares = CombineLanes(lanes);
  result->nonfinite = nonfinite;
  result->amax = amax;
}

Pass MakePass(Format format, Format model_dtype, const Fragment& fragment, GradView grad, float multiplier,
              const OptimizerState& state, const StepOutputs& out) {
  Pass p;
  p.format = format;
  p.model_dtype = model_dtype;
  p.fragment = fragment;
  p.grad = grad;
  p.multiplier = multiplier;
  p.master = state.master;
  p.dry_run = out.dry_run;
  p.out = out;
  p.want_stats = out.grad_sum_squares != nullptr || out.grad_nonfinite != nullptr;
  p.k.stats = PickStats(grad.type);
  if (!out.amax.block_amax.empty()) {
    const FormatDescriptor& d = Describe(format);
    p.blocks.slots = out.amax.block_amax.data();
    p.blocks.range_begin = ScaleBlockRange(format, fragment.view, fragment.elements).begin;
    p.blocks.rows = fragment.view.rows;
    p.blocks.cols = fragment.view.cols;
    p.blocks.tile_cols = (fragment.view.cols + d.block_cols - 1) / d.block_cols;
    p.blocks.fragment_begin = fragment.elements.begin;
    p.blocks.fragment_end = fragment.elements.end;
  }
  return p;
}

// Call after the cast is set: picks the model-dtype kernels.
void FinishPass(Pass& p) {
  p.want_bits = !p.out.model_values.empty() || p.out.amax.tensor_amax != nullptr || p.blocks.slots != nullptr ||
                p.cast != CastKind::kNone;
  if (p.model_dtype == Format::kFP16) {
    FillModelKernels<Format::kFP16>(p);
  } else {
    FillModelKernels<Format::kBF16>(p);
  }
}

template <typename Args>
void RunPass(const Device& device, const Pass& pass, UpdateFn<Args> update, const Args& args) {
  std::fill(pass.out.amax.block_amax.begin(), pass.out.amax.block_amax.end(), 0.0f);
  const int64_t chunks = ChunkCount(pass.fragment.size());
  std::vector<ChunkResult> results(static_cast<size_t>(chunks));
  ParallelFor(device.executor, chunks,
              [&](int64_t c) { ProcessChunk(pass, update, args, c, &results[static_cast<size_t>(c)]); });
  double sum_squares = 0.0;
  int64_t nonfinite = 0;
  float amax = 0.0f;
  for (const ChunkResult& r : results) {  // chunk order
    sum_squares += r.sum_squares;
    nonfinite += r.nonfinite;
    amax = std::max(amax, r.amax);
  }
  if (pass.out.grad_sum_squares != nullptr) *pass.out.grad_sum_squares = sum_squares;
  if (pass.out.grad_nonfinite != nullptr) *pass.out.grad_nonfinite = nonfinite;
  if (pass.out.amax.tensor_amax != nullptr) *pass.out.amax.tensor_amax = amax;
}

template <ElementType kGrad, ElementType kMoment, Format kModel>
AdamWCastFn PickCastOut(CastKind cast) {
  constexpr bool kFp32 = kGrad == ElementType::kFloat32 && kMoment == ElementType::kFloat32;
  switch (cast) {
    case CastKind::kFP8E4M3:
      if (kFp32 && avx512::Enabled()) return &AdamWCastFp8SpanAvx512<kModel, CastKind::kFP8E4M3>;
      return &AdamWCastSpan<kGrad, kMoment, kModel, CastKind::kFP8E4M3>;
    case CastKind::kFP8E5M2:
      if (kFp32 && avx512::Enabled()) return &AdamWCastFp8SpanAvx512<kModel, CastKind::kFP8E5M2>;
      return &AdamWCastSpan<kGrad, kMoment, kModel, CastKind::kFP8E5M2>;
    case CastKind::kBF16:
      return &AdamWCastSpan<kGrad, kMoment, kModel, CastKind::kBF16>;
    case CastKind::kFP16:
      return &AdamWCastSpan<kGrad, kMoment, kModel, CastKind::kFP16>;
    case CastKind::kMXFP8:
      return &AdamWCastSpan<kGrad, kMoment, kModel, CastKind::kMXFP8>;
    case CastKind::kNone:
      break;
  }
  return nullptr;
}

template <ElementType kGrad, ElementType kMoment>
AdamWCastFn PickCastModel(Format model, CastKind cast) {
  return model == Format::kFP16 ? PickCastOut<kGrad, kMoment, Format::kFP16>(cast)
                                : PickCastOut<kGrad, kMoment, Format::kBF16>(cast);
}

template <ElementType kGrad>
AdamWCastFn PickCastMoment(ElementType moment, Format model, CastKind cast) {
  return moment == ElementType::kBFloat16 ? PickCastModel<kGrad, ElementType::kBFloat16>(model, cast)
                                          : PickCastModel<kGrad, ElementType::kFloat32>(model, cast);
}

// The one-loop AdamW + cast, for a pass that updates in place and wants nothing but the cast
// (no stats, amaxes or model values: the daemon's apply); else nullptr.
AdamWCastFn PickAdamWCast(const Pass& p, ElementType grad, ElementType moment) {
  if (p.dry_run || p.want_stats || p.blocks.slots != nullptr || p.out.amax.tensor_amax != nullptr ||
      !p.out.model_values.empty()) {
    return nullptr;
  }
  // FP16 gradients reach the loops widened to FP32 (GradSpan).
  return grad == ElementType::kBFloat16 ? PickCastMoment<ElementType::kBFloat16>(moment, p.model_dtype, p.cast)
                                        : PickCastMoment<ElementType::kFloat32>(moment, p.model_dtype, p.cast);
}

void RunAdamW(const Device& device, Pass& pass, const OptimizerState& state, GradView grad,
              const AdamWHyper& hyper) {
  pass.k.adamw_cast = PickAdamWCast(pass, grad.type, state.moment_type);
  // A dry run that wants only the tensor amax (and the statistics), on FP32 data: one AVX-512
  // loop that stores nothing, where the portable pass writes the update to scratch, rounds it
  // to model bits and reads those back.
  pass.avx512_dry_amax = pass.dry_run && grad.type == ElementType::kFloat32 &&
                         state.moment_type == ElementType::kFloat32 && pass.blocks.slots == nullptr &&
                         pass.out.amax.tensor_amax != nullptr && pass.out.model_values.empty() &&
                         pass.cast == CastKind::kNone && avx512::Enabled();
  const AdamWArgs args{hyper, MakeAdamWConstants(hyper), state.master, state.m, state.v};
  RunPass(device, pass, PickUpdate<AdamWKernel>(grad.type, state.moment_type, pass.dry_run), args);
}

}  // namespace

absl::Status FusedAdamW(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                        GradView grad, const OptimizerState& state, const AdamWHyper& hyper, const StepOutputs& out) {
  Pass pass = MakePass(format, model_dtype, fragment, grad, hyper.grad_multiplier, state, out);
  FinishPass(pass);
  RunAdamW(device, pass, state, grad, hyper);
  return absl::OkStatus();
}

absl::Status FusedAdamWQuantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                GradView grad, const OptimizerState& state, const AdamWHyper& hyper,
                                const ScaleInputs& scales, const StepOutputs& out, const QuantizedOutputs& quantized) {
  Pass pass = MakePass(format, model_dtype, fragment, grad, hyper.grad_multiplier, state, out);
  pass.quantized = quantized;
  pass.tensor_scale = scales.tensor_scale;
  switch (format) {
    case Format::kBF16:
      pass.cast = CastKind::kBF16;
      break;
    case Format::kFP16:
      pass.cast = CastKind::kFP16;
      break;
    case Format::kFP8E4M3Delayed:
      pass.cast = CastKind::kFP8E4M3;
      break;
    case Format::kFP8E5M2Delayed:
      pass.cast = CastKind::kFP8E5M2;
      break;
    case Format::kFP8E4M3Current:
      pass.cast = CastKind::kFP8E4M3;
      pass.tensor_scale = CurrentScalingScale(scales.tensor_amax, kE4M3Max, scales.pow2_scales);
      break;
    case Format::kFP8E5M2Current:
      pass.cast = CastKind::kFP8E5M2;
      pass.tensor_scale = CurrentScalingScale(scales.tensor_amax, kE5M2Max, scales.pow2_scales);
      break;
    case Format::kMXFP8:
      // The block amax is computed in the pass (scales.block_amax is not read), so no block
      // may reach outside the fragment.
      if (!MxfpBlocksInFragment(fragment)) {
        return InvalidArgumentError("fragment", "mxfp8 in one pass needs cols and fragment bounds that are ",
                                    "multiples of 32, got cols ", fragment.view.cols, " and [", fragment.elements.begin,
                                    ", ", fragment.elements.end, ")");
      }
      pass.cast = CastKind::kMXFP8;
      break;
    default:
      return InvalidArgumentError("format", FormatName(format), " cannot be cast in the optimizer pass");
  }
  FinishPass(pass);
  RunAdamW(device, pass, state, grad, hyper);
  if ((pass.cast == CastKind::kFP8E4M3 || pass.cast == CastKind::kFP8E5M2) && quantized.tensor_scale_inv != nullptr) {
    *quantized.tensor_scale_inv = ScaleInv(pass.tensor_scale);
  }
  return absl::OkStatus();
}

absl::Status FusedSgd(const Device& device, Format format, Format model_dtype, const Fragment& fragment, GradView grad,
                      const OptimizerState& state, const SgdHyper& hyper, const StepOutputs& out) {
  Pass pass = MakePass(format, model_dtype, fragment, grad, hyper.grad_multiplier, state, out);
  FinishPass(pass);
  const SgdArgs args{hyper, state.master, state.m};
  RunPass(device, pass, PickUpdate<SgdKernel>(grad.type, state.moment_type, pass.dry_run), args);
  return absl::OkStatus();
}

absl::Status GradStats(const Device& device, GradView grad, int64_t n, float multiplier, double* sum_squares,
                       int64_t* nonfinite) {
  // The same chunks and lanes as the optimizer pass, so a fragment's GradStats equals the
  // grad_sum_squares of its FusedAdamW bit for bit.
  const StatsFn stats = PickStats(grad.type);
  const int64_t chunks = ChunkCount(n);
  std::vector<ChunkResult> results(static_cast<size_t>(chunks));
  ParallelFor(device.executor, chunks, [&](int64_t c) {
    const int64_t lo = c * kChunkElements;
    const int64_t hi = std::min(lo + kChunkElements, n);
    double lanes[kSumLanes] = {};
    float widened[kSubBlockElements];
    ChunkResult& r = results[static_cast<size_t>(c)];
    for (int64_t s = lo; s < hi; s += kSubBlockElements) {
      const int64_t len = std::min(kSubBlockElements, hi - s);
      r.nonfinite += stats(GradSpan(grad, s, len, widened), len, multiplier, lanes);
    }
    r.sum_squares = CombineLanes(lanes);
  });
  double total = 0.0;
  int64_t bad = 0;
  for (const ChunkResult& r : results) {
    total += r.sum_squares;
    bad += r.nonfinite;
  }
  *sum_squares = total;
  *nonfinite = bad;
  return absl::OkStatus();
}

}  // namespace mainstay::kernels::cpu

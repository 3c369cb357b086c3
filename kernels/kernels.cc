// Argument validation and backend dispatch for kernels.h.
#include "kernels/kernels.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/backend.h"

namespace mainstay::kernels {
namespace {

int ScaleEntryBytes(Format format) {
  const FormatDescriptor& d = Describe(format);
  return d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
}

absl::Status CheckModelDtype(Format model_dtype) {
  if (model_dtype != Format::kBF16 && model_dtype != Format::kFP16) {
    return InvalidArgumentError("model_dtype", "must be bf16 or fp16, got ", FormatName(model_dtype));
  }
  return absl::OkStatus();
}

absl::Status CheckFormat(Format format) {
  if (static_cast<size_t>(format) >= AllFormats().size()) {
    return InvalidArgumentError("format", "unknown format value ", static_cast<int>(format));
  }
  return absl::OkStatus();
}

absl::Status CheckFragment(Format format, const Fragment& f) {
  MAINSTAY_RETURN_IF_ERROR(CheckFormat(format));
  if (f.view.rows < 1 || f.view.cols < 1) {
    return InvalidArgumentError("fragment.view", "rows and cols must be >= 1, got ", f.view.rows, " x ", f.view.cols);
  }
  if (f.elements.begin < 0 || f.elements.begin > f.elements.end || f.elements.end > f.view.numel()) {
    return InvalidArgumentError("fragment.elements", "[", f.elements.begin, ", ", f.elements.end,
                                ") is not inside the tensor's ", f.view.numel(), " elements");
  }
  if (Describe(format).bits_per_element == 4 && f.elements.begin % 2 != 0) {
    return InvalidArgumentError("fragment.elements", "a 4-bit fragment must start on an even element, got ",
                                f.elements.begin);
  }
  return absl::OkStatus();
}

int64_t BlockCount(Format format, const Fragment& f) {
  return ScaleBlockRange(format, f.view, f.elements).size();
}

absl::Status CheckSize(absl::string_view what, int64_t got, int64_t want) {
  if (got != want) return InvalidArgumentError(what, "has ", got, " entries, expected ", want);
  return absl::OkStatus();
}

absl::Status CheckAmaxOutputs(Format format, const Fragment& f, const AmaxOutputs& out) {
  if (!out.block_amax.empty()) {
    if (!Describe(format).has_block_scales()) {
      return InvalidArgumentError("block_amax", FormatName(format), " has no blocks");
    }
    MAINSTAY_RETURN_IF_ERROR(CheckSize("block_amax", out.block_amax.size(), BlockCount(format, f)));
  }
  return absl::OkStatus();
}

absl::Status CheckScaleInputs(Format format, const Fragment& f, const ScaleInputs& s) {
  if (Describe(format).has_block_scales()) {
    MAINSTAY_RETURN_IF_ERROR(CheckSize("scales.block_amax", s.block_amax.size(), BlockCount(format, f)));
  }
  return absl::OkStatus();
}

absl::Status CheckQuantizedOutputs(Format format, const Fragment& f, const QuantizedOutputs& out) {
  MAINSTAY_RETURN_IF_ERROR(CheckSize("out.data", out.data.size(), DataBytes(format, f.size())));
  MAINSTAY_RETURN_IF_ERROR(
      CheckSize("out.block_scales", out.block_scales.size(), BlockCount(format, f) * ScaleEntryBytes(format)));
  return absl::OkStatus();
}

absl::Status CheckOptimizer(Format format, Format model_dtype, const Fragment& f, GradView grad,
                            const OptimizerState& state, const StepOutputs& out, bool needs_v) {
  MAINSTAY_RETURN_IF_ERROR(CheckFragment(format, f));
  MAINSTAY_RETURN_IF_ERROR(CheckModelDtype(model_dtype));
  if (grad.data == nullptr && f.size() > 0) return InvalidArgumentError("grad.data", "is null");
  if (grad.type != ElementType::kFloat32 && grad.type != ElementType::kBFloat16 && grad.type != ElementType::kFloat16) {
    return InvalidArgumentError("grad.type", "must be fp32, bf16 or fp16, got ", ElementTypeName(grad.type));
  }
  if (state.moment_type != ElementType::kFloat32 && state.moment_type != ElementType::kBFloat16) {
    return InvalidArgumentError("state.moment_type", "must be fp32 or bf16, got ", ElementTypeName(state.moment_type));
  }
  if (f.size() > 0 && (state.master == nullptr || state.m == nullptr || (needs_v && state.v == nullptr))) {
    return InvalidArgumentError("state", "master, m", needs_v ? " and v" : "", " must be set");
  }
  if (!out.model_values.empty()) {
    MAINSTAY_RETURN_IF_ERROR(CheckSize("out.model_values", out.model_values.size(), f.size()));
  }
  return CheckAmaxOutputs(format, f, out.amax);
}

absl::Status CheckAdamW(const AdamWHyper& h) {
  if (h.step < 1) return InvalidArgumentError("hyper.step", "must be >= 1, got ", h.step);
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return InvalidArgumentError("hyper.beta1", "must be in [0, 1), got ", h.beta1);
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return InvalidArgumentError("hyper.beta2", "must be in [0, 1), got ", h.beta2);
  if (!(h.eps > 0)) return InvalidArgumentError("hyper.eps", "must be > 0, got ", h.eps);
  return absl::OkStatus();
}

}  // namespace

#define MAINSTAY_DISPATCH(call)                                      \
  return device.kind == Device::Kind::kCuda ? cuda::call : cpu::call

absl::Status ComputePartialAmax(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                std::span<const float> master, const AmaxOutputs& out) {
  MAINSTAY_RETURN_IF_ERROR(CheckFragment(format, fragment));
  MAINSTAY_RETURN_IF_ERROR(CheckModelDtype(model_dtype));
  MAINSTAY_RETURN_IF_ERROR(CheckSize("master", master.size(), fragment.size()));
  MAINSTAY_RETURN_IF_ERROR(CheckAmaxOutputs(format, fragment, out));
  MAINSTAY_DISPATCH(ComputePartialAmax(device, format, model_dtype, fragment, master, out));
}

absl::Status Quantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                      std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out) {
  MAINSTAY_RETURN_IF_ERROR(CheckFragment(format, fragment));
  MAINSTAY_RETURN_IF_ERROR(CheckModelDtype(model_dtype));
  MAINSTAY_RETURN_IF_ERROR(CheckSize("master", master.size(), fragment.size()));
  MAINSTAY_RETURN_IF_ERROR(CheckScaleInputs(format, fragment, scales));
  MAINSTAY_RETURN_IF_ERROR(CheckQuantizedOutputs(format, fragment, out));
  MAINSTAY_DISPATCH(Quantize(device, format, model_dtype, fragment, master, scales, out));
}

absl::Status Dequantize(const Device& device, Format format, const Fragment& fragment, const QuantizedInputs& in,
                        std::span<float> out) {
  MAINSTAY_RETURN_IF_ERROR(CheckFragment(format, fragment));
  MAINSTAY_RETURN_IF_ERROR(CheckSize("in.data", in.data.size(), DataBytes(format, fragment.size())));
  MAINSTAY_RETURN_IF_ERROR(
      CheckSize("in.block_scales", in.block_scales.size(), BlockCount(format, fragment) * ScaleEntryBytes(format)));
  MAINSTAY_RETURN_IF_ERROR(CheckSize("out", out.size(), fragment.size()));
  MAINSTAY_DISPATCH(Dequantize(device, format, fragment, in, out));
}

absl::Status FusedAdamW(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                        GradView grad, const OptimizerState& state, const AdamWHyper& hyper, const StepOutputs& out) {
  MAINSTAY_RETURN_IF_ERROR(CheckOptimizer(format, model_dtype, fragment, grad, state, out, /*needs_v=*/true));
  MAINSTAY_RETURN_IF_ERROR(CheckAdamW(hyper));
  MAINSTAY_DISPATCH(FusedAdamW(device, format, model_dtype, fragment, grad, state, hyper, out));
}

absl::Status FusedAdamWQuantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                GradView grad, const OptimizerState& state, const AdamWHyper& hyper,
                                const ScaleInputs& scales, const StepOutputs& out, const QuantizedOutputs& quantized) {
  MAINSTAY_RETURN_IF_ERROR(CheckOptimizer(format, model_dtype, fragment, grad, state, out, /*needs_v=*/true));
  MAINSTAY_RETURN_IF_ERROR(CheckAdamW(hyper));
  const ScalingMode mode = Describe(format).scaling;
  if (out.dry_run) return InvalidArgumentError("out.dry_run", "cannot be set with a cast (FusedAdamWQuantize)");
  if (!(mode == ScalingMode::kNone || mode == ScalingMode::kDelayed || mode == ScalingMode::kCurrent ||
        format == Format::kMXFP8)) {
    return InvalidArgumentError("format", FormatName(format),
                                " needs a reduced amax before the cast: use FusedAdamW, reduce, then Quantize");
  }
  MAINSTAY_RETURN_IF_ERROR(CheckQuantizedOutputs(format, fragment, quantized));
  MAINSTAY_DISPATCH(FusedAdamWQuantize(device, format, model_dtype, fragment, grad, state, hyper, scales, out, quantized));
}

absl::Status FusedSgd(const Device& device, Format format, Format model_dtype, const Fragment& fragment, GradView grad,
                      const OptimizerState& state, const SgdHyper& hyper, const StepOutputs& out) {
  MAINSTAY_RETURN_IF_ERROR(CheckOptimizer(format, model_dtype, fragment, grad, state, out, /*needs_v=*/false));
  if (hyper.step < 1) return InvalidArgumentError("hyper.step", "must be >= 1, got ", hyper.step);
  MAINSTAY_DISPATCH(FusedSgd(device, format, model_dtype, fragment, grad, state, hyper, out));
}

absl::Status GradStats(const Device& device, GradView grad, int64_t n, float multiplier, double* sum_squares,
                       int64_t* nonfinite) {
  if (n < 0) return InvalidArgumentError("n", "must be >= 0, got ", n);
  if (grad.data == nullptr && n > 0) return InvalidArgumentError("grad.data", "is null");
  if (grad.type != ElementType::kFloat32 && grad.type != ElementType::kBFloat16 && grad.type != ElementType::kFloat16) {
    return InvalidArgumentError("grad.type", "must be fp32, bf16 or fp16, got ", ElementTypeName(grad.type));
  }
  if (sum_squares == nullptr || nonfinite == nullptr) {
    return InvalidArgumentError("sum_squares", "and nonfinite must not be null");
  }
  MAINSTAY_DISPATCH(GradStats(device, grad, n, multiplier, sum_squares, nonfinite));
}

absl::Status Synchronize(const Device& device) {
  if (device.kind == Device::Kind::kCpu) return absl::OkStatus();
  return cuda::Synchronize(device);
}

}  // namespace mainstay::kernels

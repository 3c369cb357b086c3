// The daemon's arithmetic: partial amax, quantize / dequantize for every published format,
// the fused AdamW and SGD updates, and gradient statistics. One device-agnostic API: the CPU
// backend (kernels/cpu, always built, production code for CPU-only daemons) and the CUDA
// backend (kernels/cuda) implement it; `Device` picks one per call.
//
// Unit of work: a FRAGMENT [begin, end) of one flattened 2D tensor (rows x cols, row-major).
// Fragments come from the layout: they start on multiples of 64 elements but not on rows or
// tiles. Block-scaled formats (mxfp8 1x32, fp8_block 128x128, nvfp4 16x16) keep per-block
// values for the fragment's block range, `ScaleBlockRange(format, view, elements)` (compact
// row-major scale-grid indices, common/format.h): arrays named `block_*` hold exactly
// `range.size()` entries, entry i belonging to block `range.begin + i`. Blocks in the range
// that the fragment does not touch get amax 0 (the MAX reduction's identity).
//
// Quantizing a tensor that spans several fragments (possibly on several daemons):
//   1. each fragment: ComputePartialAmax (or the amax outputs of FusedAdamW);
//   2. MAX-reduce the tensor amax and, per block, the block amaxes across fragments;
//   3. each fragment: Quantize with the reduced values. Byte-identical to quantizing whole.
// Delayed scaling needs no reduction before the cast (the scale comes from the history), so
// FusedAdamWQuantize does update and cast in one pass.
//
// The value quantized is the master cast to the model dtype first: float(bf16_rne(master))
// (or fp16), as Transformer Engine does (FORMATS.md "Common rules").
//
// Memory: every pointer / span is caller-owned and must stay valid until the call returns
// (CPU) or until the stream reaches the work (CUDA: device pointers, asynchronous on
// `Device::stream`; scalar outputs such as `tensor_amax` are device pointers too).
// Thread safety: calls on distinct buffers may run concurrently (CUDA calls that share a stream
// enqueue one at a time; each stream keeps one persistent device workspace for the calls'
// scratch, sized by the largest call: kernels/cuda/stream_call.h).
// Errors: INVALID_ARGUMENT for a bad fragment or a span of the wrong size (nothing written);
// UNIMPLEMENTED for a backend that is not compiled in; INTERNAL for a CUDA failure, naming the
// call and its kernel. A fault inside a kernel shows later (CUDA reports it asynchronously):
// at Synchronize, or at the next call's launch on any stream, and both name the call and
// kernels last enqueued on the stream.
#ifndef MAINSTAY_KERNELS_KERNELS_H_
#define MAINSTAY_KERNELS_KERNELS_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "common/format.h"

namespace mainstay::kernels {

class CpuExecutor;  // kernels/cpu/executor.h

struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  // kCpu: the thread pool to run on; nullptr = the calling thread only. Results never depend
  // on the thread count (reductions combine fixed-size chunks in a fixed order).
  CpuExecutor* executor = nullptr;
  // kCuda: the cudaStream_t to enqueue on (nullptr = the legacy default stream), and the
  // device it belongs to: each call makes it the calling thread's current device (-1: the
  // calling thread's current device is the stream's).
  void* stream = nullptr;
  int ordinal = -1;
};

// One fragment of one tensor.
struct Fragment {
  Matrix2D view;        // the WHOLE tensor's 2D view: rows x cols
  IndexRange elements;  // [begin, end) of the flattened tensor; 0 <= begin <= end <= rows*cols
  int64_t size() const { return elements.size(); }
};

// Whether every mxfp8 1x32 block that the fragment touches lies wholly inside it (rows a
// multiple of 32 wide, fragment bounds on multiples of 32): the condition for casting mxfp8
// in the optimizer pass (FusedAdamWQuantize).
inline bool MxfpBlocksInFragment(const Fragment& f) {
  return f.view.cols % 32 == 0 && f.elements.begin % 32 == 0 && f.elements.end % 32 == 0;
}

// Whether FusedAdamWQuantize casts `format` on this fragment in the update's pass: bf16/fp16,
// fp8 with a per-tensor scale (delayed, or current with its reduced amax), and mxfp8 whose
// blocks lie inside the fragment.
inline bool CastsInAdamWPass(Format format, const Fragment& f) {
  const ScalingMode mode = Describe(format).scaling;
  return mode == ScalingMode::kNone || mode == ScalingMode::kDelayed || mode == ScalingMode::kCurrent ||
         (format == Format::kMXFP8 && MxfpBlocksInFragment(f));
}

// ---- Amax.

struct AmaxOutputs {
  float* tensor_amax = nullptr;       // max |x| over the fragment; nullptr = not wanted
  std::span<float> block_amax;        // per block of the fragment's block range; empty = not wanted
};

// Partial amax of the model-dtype values of `master` (the fragment's FP32 masters) with fmax
// semantics (NaN ignored, +inf propagates). `format` decides the block shape.
absl::Status ComputePartialAmax(const Device& device, Format format, Format model_dtype,
                                const Fragment& fragment, std::span<const float> master,
                                const AmaxOutputs& out);

// ---- Quantize / dequantize.

// Scale inputs, all already reduced over the whole tensor / whole block.
struct ScaleInputs {
  float tensor_scale = 1.0f;          // fp8 delayed: the current scale (from the amax history)
  float tensor_amax = 0.0f;           // fp8 current scaling, nvfp4 (global scale): tensor amax
  std::span<const float> block_amax;  // mxfp8, fp8_block, nvfp4: per block of the block range
  bool pow2_scales = false;           // fp8 current scaling only (fp8_block is always pow2)
};

struct QuantizedOutputs {
  std::span<uint8_t> data;          // DataBytes(format, fragment.size()) bytes; bf16/fp16: 2 B each
  // Block scales of the block range, one entry per block: mxfp8 E8M0 (1 B), nvfp4 E4M3 (1 B),
  // fp8_block FP32 scale_inv (4 B, little-endian). Empty for formats without block scales.
  std::span<uint8_t> block_scales;
  // fp8 per-tensor formats: scale_inv = RN(1/scale); nvfp4: the global S_dec. May be nullptr.
  float* tensor_scale_inv = nullptr;
};

// Quantizes the fragment's model-dtype values. For 4-bit data the fragment must start at an
// even element (layouts guarantee 64); a fragment ending on an odd element leaves the high
// nibble of its last byte 0.
absl::Status Quantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                      std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out);

struct QuantizedInputs {
  std::span<const uint8_t> data;
  std::span<const uint8_t> block_scales;
  float tensor_scale_inv = 1.0f;
};

// Inverse of Quantize (exact: every quantized value times its scales is representable in FP32
// except for results that overflow, which become +-inf). `out` has fragment.size() floats.
absl::Status Dequantize(const Device& device, Format format, const Fragment& fragment,
                        const QuantizedInputs& in, std::span<float> out);

// ---- Optimizer.

struct GradView {
  const void* data = nullptr;
  ElementType type = ElementType::kFloat32;  // kFloat32, kBFloat16 or kFloat16
};

struct OptimizerState {
  float* master = nullptr;                          // FP32 masters, read and written
  void* m = nullptr;                                // AdamW first moment / SGD momentum buffer
  void* v = nullptr;                                // AdamW second moment; unused by SGD
  ElementType moment_type = ElementType::kFloat32;  // kFloat32 or kBFloat16 (RNE on store)
};

struct AdamWHyper {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: master -= lr * weight_decay * master
  int64_t step = 1;           // 1-based, for bias correction 1 - beta^step
  // Multiplies every gradient element before use: clip factor x (1 / loss scale).
  float grad_multiplier = 1.0f;
};

struct SgdHyper {
  float lr = 0.0f;
  float momentum = 0.9f;      // buf = momentum * buf + g (buf = g at step 1)
  float weight_decay = 0.0f;  // coupled L2: g += weight_decay * master
  int64_t step = 1;
  float grad_multiplier = 1.0f;
};

// What one optimizer pass reports besides the updated state.
struct StepOutputs {
  // The updated master in the model dtype (bf16/fp16 bits); empty = not written.
  std::span<uint16_t> model_values;
  // Partial amax of the updated model-dtype values (as ComputePartialAmax would give).
  AmaxOutputs amax;
  // Of the gradient as used (after grad_multiplier): sum of squares and non-finite count.
  double* grad_sum_squares = nullptr;
  int64_t* grad_nonfinite = nullptr;
  // Computes every output above from the values the update would produce, and writes nothing
  // of the optimizer state (the daemon learns the amaxes a step will publish before it
  // decides the step, then updates in place: server/daemon/job_step.cc). Not with a cast.
  bool dry_run = false;
};

// One AdamW step over the fragment, in one pass (grad + master + m + v read, master + m + v
// written). `format` and `model_dtype` define the amax outputs.
absl::Status FusedAdamW(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                        GradView grad, const OptimizerState& state, const AdamWHyper& hyper,
                        const StepOutputs& out);

// FusedAdamW plus the cast of the updated values, in the same pass. Only for formats whose
// scales are known before the pass: bf16/fp16, fp8 delayed (scales.tensor_scale), fp8
// current scaling with the tensor amax already reduced (scales.tensor_amax and pow2_scales,
// e.g. from a dry run of the same update) and mxfp8 (its 1x32 blocks never straddle
// fragments: the block amax is computed in the pass). Other formats, and out.dry_run:
// INVALID_ARGUMENT (use FusedAdamW, reduce, Quantize).
absl::Status FusedAdamWQuantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                                GradView grad, const OptimizerState& state, const AdamWHyper& hyper,
                                const ScaleInputs& scales, const StepOutputs& out, const QuantizedOutputs& quantized);

absl::Status FusedSgd(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                      GradView grad, const OptimizerState& state, const SgdHyper& hyper, const StepOutputs& out);

// Sum of squares (FP64 accumulation) and count of non-finite elements of `n` gradient
// elements times `multiplier`: the partial stats a daemon computes when a shard arrives.
absl::Status GradStats(const Device& device, GradView grad, int64_t n, float multiplier, double* sum_squares,
                       int64_t* nonfinite);

// Waits until the work enqueued on `device` has run: kCpu returns at once (its calls are
// synchronous); kCuda waits for Device::stream. INTERNAL when that work failed (a kernel
// fault), naming CUDA's error and the last call and kernels enqueued on the stream.
absl::Status Synchronize(const Device& device);

}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_KERNELS_H_

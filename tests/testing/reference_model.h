// The unsharded reference a daemon's results are checked against: the whole model's masters
// and moments, stepped with the same kernels (kernels/kernels.h) as the daemon runs on its
// fragments, and quantized whole. Used by the in-process step-engine tests and the end-to-end
// tests through the real binaries.
//
// Values are deterministic functions of (tensor, element, step, rank), so trainer processes or
// threads can compute their gradients without sharing memory with the reference.
// Thread safety: none (one test thread).
#ifndef MAINSTAY_TESTS_TESTING_REFERENCE_MODEL_H_
#define MAINSTAY_TESTS_TESTING_REFERENCE_MODEL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/job_spec.h"
#include "common/step_hyper.h"
#include "kernels/kernels.h"
#include "kernels/scaling.h"
#include "server/daemon/scaling_state.h"

namespace mainstay::testing {

// Deterministic pseudo-random value in [-scale, scale).
inline float Value(uint64_t a, uint64_t b, uint64_t c, float scale) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^ c * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86653DA0Bull;
  x ^= x >> 29;
  return (static_cast<float>(x >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f) * scale;
}

inline float InitialValue(int64_t tensor, int64_t i) { return Value(tensor, i, 999, 0.5f); }
// Rank `rank`'s gradient of element i of tensor `tensor` at `step`. rank -1 is the already
// reduced gradient a reduce-scattering trainer pushes.
inline float GradValue(int64_t tensor, int64_t i, int64_t step, int rank = -1) {
  return Value(tensor, i, static_cast<uint64_t>(step * 64 + rank + 1), 0.01f);
}

// Tensors whose shapes make shard boundaries cut 16x16 and 128x128 tiles (so cross-daemon
// tile reductions are exercised), plus 1-D tensors that stay in the model dtype.
inline std::vector<TensorSpec> TestTensors() {
  return {{"layers.0.mlp.fc1.weight", {96, 64}},   {"layers.0.norm.weight", {64}},
          {"layers.0.mlp.fc2.weight", {64, 96}},   {"layers.1.attn.qkv.weight", {320, 144}},
          {"layers.1.attn.proj.weight", {80, 64}}, {"layers.1.mlp.fc1.bias", {96}}};
}

class ReferenceModel {
 public:
  explicit ReferenceModel(ResolvedJob job) : job_(std::move(job)) {
    for (size_t t = 0; t < job_.layout.tensors.size(); ++t) {
      const int64_t n = job_.layout.tensors[t].numel;
      master_.emplace_back(n);
      for (int64_t i = 0; i < n; ++i) master_[t][static_cast<size_t>(i)] = InitialValue(static_cast<int64_t>(t), i);
      m_.emplace_back(n, 0.0f);
      v_.emplace_back(n, 0.0f);
      delayed_.emplace_back(job_.recipe.fp8_amax_history_len);
    }
  }

  const ResolvedJob& job() const { return job_; }
  const std::vector<float>& master(size_t t) const { return master_[t]; }

  kernels::Fragment Whole(size_t t) const {
    const LayoutTensor& tensor = job_.layout.tensors[t];
    return {View2D(tensor.shape), {0, tensor.numel}};
  }

  // One AdamW step. `contributors` = 0: the reduced gradient GradValue(.., -1); n > 0: the FP32
  // sum of ranks 0..n-1 in rank order, as the daemon sums unreduced pushes. `grad_multiplier`:
  // the clip factor (the daemon's StepStats.clip_factor, rounded to FP32 as the daemon does).
  void Step(int64_t step, float lr, float weight_decay = 0.0f, int contributors = 0, float grad_multiplier = 1.0f) {
    Step(step, StepHyper(static_cast<size_t>(NumParamGroups(job_.layout)), GroupHyper{lr, weight_decay}), contributors,
         grad_multiplier);
  }
  // The same with each tensor's param group's hyperparameters (groups[param_group]).
  void Step(int64_t step, const StepHyper& groups, int contributors = 0, float grad_multiplier = 1.0f) {
    for (size_t t = 0; t < master_.size(); ++t) {
      const GroupHyper& g = groups.at(static_cast<size_t>(job_.layout.tensors[t].param_group));
      const float lr = static_cast<float>(g.lr), weight_decay = static_cast<float>(g.weight_decay);
      std::vector<float> grad(master_[t].size());
      for (size_t i = 0; i < grad.size(); ++i) {
        const int64_t ti = static_cast<int64_t>(t), ii = static_cast<int64_t>(i);
        if (contributors == 0) {
          grad[i] = GradValue(ti, ii, step) * grad_scale_;
        } else {
          float sum = GradValue(ti, ii, step, 0);
          for (int r = 1; r < contributors; ++r) sum = sum + GradValue(ti, ii, step, r);
          grad[i] = sum;
        }
      }
      const OptimizerSpec& o = job_.spec.optimizer;
      if (o.type == OptimizerType::kSGD) {
        kernels::SgdHyper h{lr, o.momentum, weight_decay, step + 1, grad_multiplier};
        ASSERT_TRUE(kernels::FusedSgd({}, job_.layout.tensors[t].format, job_.recipe.model_dtype, Whole(t),
                                      {grad.data(), ElementType::kFloat32},
                                      {master_[t].data(), m_[t].data(), nullptr, ElementType::kFloat32}, h, {})
                        .ok());
        continue;
      }
      kernels::AdamWHyper h{lr, o.beta1, o.beta2, o.eps, weight_decay, step + 1, grad_multiplier};
      ASSERT_TRUE(kernels::FusedAdamW({}, job_.layout.tensors[t].format, job_.recipe.model_dtype, Whole(t),
                                      {grad.data(), ElementType::kFloat32},
                                      {master_[t].data(), m_[t].data(), v_[t].data(), ElementType::kFloat32}, h, {})
                      .ok());
    }
  }

  // Multiplies the reduced gradients (contributors = 0) of the following steps, in FP32, as
  // Cluster::PushGrads's `scale` does.
  void SetGradScale(float scale) { grad_scale_ = scale; }

  // The global norm of step `step`'s reduced gradients (GradValue(.., -1) * the grad scale),
  // summed in FP64.
  double GradNorm(int64_t step) const {
    double sum = 0.0;
    for (size_t t = 0; t < master_.size(); ++t) {
      for (size_t i = 0; i < master_[t].size(); ++i) {
        const double g = GradValue(static_cast<int64_t>(t), static_cast<int64_t>(i), step) * grad_scale_;
        sum += g * g;
      }
    }
    return std::sqrt(sum);
  }

  // Data and scale bytes (the tensor's whole compact scale grid) of tensor t quantized whole.
  // Call once per version, in order, for every tensor: it advances the delayed-scaling state.
  void Quantize(size_t t, std::vector<uint8_t>& data, std::vector<uint8_t>& scales) {
    const Format format = job_.layout.tensors[t].format;
    const FormatDescriptor& d = Describe(format);
    const kernels::Fragment whole = Whole(t);
    const IndexRange blocks = ScaleBlockRange(format, whole.view, whole.elements);
    std::vector<float> block_amax(static_cast<size_t>(blocks.size()));
    float amax = 0.0f;
    ASSERT_TRUE(kernels::ComputePartialAmax({}, format, job_.recipe.model_dtype, whole, master_[t], {&amax, block_amax}).ok());
    kernels::ScaleInputs in;
    in.tensor_scale = delayed_[t].scale;
    in.tensor_amax = amax;
    in.block_amax = block_amax;
    data.assign(static_cast<size_t>(DataBytes(format, whole.size())), 0);
    scales.assign(static_cast<size_t>(blocks.size() * (d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0)), 0);
    ASSERT_TRUE(kernels::Quantize({}, format, job_.recipe.model_dtype, whole, master_[t], in, {data, scales, nullptr}).ok());
    if (d.scaling == ScalingMode::kDelayed) {
      delayed_[t].Record(amax, format == Format::kFP8E5M2Delayed ? kernels::kE5M2Max : kernels::kE4M3Max,
                         job_.recipe.fp8_amax_compute_algo, job_.recipe.fp8_margin);
    }
  }

 private:
  ResolvedJob job_;
  std::vector<std::vector<float>> master_, m_, v_;
  std::vector<daemon::DelayedScaling> delayed_;
  float grad_scale_ = 1.0f;
};

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_TESTING_REFERENCE_MODEL_H_

// The per-job state that makes published bytes depend on history: FP8 delayed scaling
// (FORMATS.md "FP8 per-tensor, delayed scaling") and dynamic loss scaling of the fp16
// recipes (DESIGN.md section 4). Every daemon of a job keeps identical copies: they are
// updated only from reduced values (the MAX-reduced amax, the SUM-reduced non-finite count).
//
// Thread safety: plain values; the owning job serializes access.
#ifndef MAINSTAY_SERVER_DAEMON_SCALING_STATE_H_
#define MAINSTAY_SERVER_DAEMON_SCALING_STATE_H_

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "common/recipe.h"
#include "kernels/casts.h"
#include "kernels/scaling.h"

namespace mainstay::daemon {

// One tensor's delayed-scaling state. The cast of a step uses `scale`; then Record(amax)
// stores the step's reduced amax and derives the scale of the next step.
struct DelayedScaling {
  std::vector<float> history;  // newest first; history[0] collects the current step
  float scale = 1.0f;

  DelayedScaling(int history_len = 1) : history(static_cast<size_t>(std::max(history_len, 1)), 0.0f) {}

  void Record(float amax, float fp8_max, AmaxComputeAlgo algo, int margin) {
    history[0] = std::max(history[0], amax);
    const float a = algo == AmaxComputeAlgo::kMax ? *std::max_element(history.begin(), history.end()) : history[0];
    // Roll: new[i] = old[i + 1], last = old[0]; then the slot of the next step starts at 0.
    std::rotate(history.begin(), history.begin() + 1, history.end());
    history[0] = 0.0f;
    if (a > 0.0f && kernels::IsFinite(a)) {
      float s = (fp8_max / a) / std::ldexp(1.0f, margin);
      if (!kernels::IsFinite(s)) s = FLT_MAX;
      scale = s;
    }
  }
};

// Dynamic loss scaling (fp16 recipes). Off (scale 1, never changes) for the other recipes.
struct LossScaleState {
  LossScaling config;
  double scale = 1.0;
  int good_steps = 0;
  int hysteresis_left = 0;

  explicit LossScaleState(const LossScaling& c = {}) : config(c) {
    scale = c.dynamic ? c.initial_scale : 1.0;
    hysteresis_left = c.hysteresis;
  }

  // After a step: `overflow` when a gradient was non-finite (the step was skipped).
  void Update(bool overflow) {
    if (!config.dynamic) return;
    if (overflow) {
      good_steps = 0;
      if (--hysteresis_left <= 0) {
        scale = std::max(scale / 2.0, static_cast<double>(config.min_scale));
        hysteresis_left = config.hysteresis;
      }
      return;
    }
    if (++good_steps >= config.growth_interval && config.growth_interval > 0) {
      scale *= 2.0;
      good_steps = 0;
      hysteresis_left = config.hysteresis;
    }
  }
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_SCALING_STATE_H_

// A step's hyperparameters: one (lr, weight_decay) per optimizer param group of the job.
//
// Tensors name their group in TensorSpec::param_group (0 when the job has one group); the
// trainer sends one GroupHyper per group with each FinishStep (docs/protocol.md, "Steps"), the
// daemons agree on them across ranks and daemons and update each tensor with its group's values.
// Thread safety: plain values and pure functions.
#ifndef MAINSTAY_COMMON_STEP_HYPER_H_
#define MAINSTAY_COMMON_STEP_HYPER_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/layout.h"

namespace mainstay {

struct GroupHyper {
  double lr = 0.0;            // learning rate, finite and >= 0
  double weight_decay = 0.0;  // decoupled weight decay, finite and >= 0
  friend bool operator==(const GroupHyper&, const GroupHyper&) = default;
};

// Index = param group. Every group of the job has an entry (NumParamGroups).
using StepHyper = std::vector<GroupHyper>;

// 1 + the largest param_group of the layout's tensors (1 for a job without groups).
inline int32_t NumParamGroups(const Layout& layout) {
  int32_t n = 1;
  for (const LayoutTensor& t : layout.tensors) n = std::max(n, t.param_group + 1);
  return n;
}

// "lr 0.001 weight_decay 0.1" for one group; "lr [0.001, 0.002] weight_decay [0.1, 0]" for several.
inline std::string StepHyperString(std::span<const GroupHyper> groups) {
  if (groups.size() == 1) return absl::StrCat("lr ", groups[0].lr, " weight_decay ", groups[0].weight_decay);
  std::string lr = "lr [", wd = " weight_decay [";
  for (size_t g = 0; g < groups.size(); ++g) {
    absl::StrAppend(&lr, g ? ", " : "", groups[g].lr);
    absl::StrAppend(&wd, g ? ", " : "", groups[g].weight_decay);
  }
  return lr + "]" + wd + "]";
}

// OK when every value is finite and >= 0; else INVALID_ARGUMENT naming the group ("`what`: ...").
inline absl::Status CheckStepHyper(std::span<const GroupHyper> groups, const std::string& what) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupHyper& h = groups[g];
    if (!(h.lr >= 0.0) || !(h.weight_decay >= 0.0) || !std::isfinite(h.lr) || !std::isfinite(h.weight_decay)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": lr ", h.lr, " and weight_decay ", h.weight_decay,
                                                     groups.size() > 1 ? absl::StrCat(" of param group ", g) : "",
                                                     " must be finite and >= 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_STEP_HYPER_H_

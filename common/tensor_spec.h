// A named model parameter as a job declares it: the input of recipes and layouts.
#ifndef MAINSTAY_COMMON_TENSOR_SPEC_H_
#define MAINSTAY_COMMON_TENSOR_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/format.h"

namespace mainstay {

inline constexpr int32_t kMaxParamGroups = 1024;

struct TensorSpec {
  std::string name;            // unique within a job, e.g. "decoder.layers.0.mlp.fc1.weight"
  std::vector<int64_t> shape;  // every dimension >= 1; the flattened order is row-major
  Format format = Format::kBF16;  // published format, filled in by ResolveFormats
  // The optimizer param group whose per-step hyperparameters (lr, weight_decay) the tensor's
  // update uses, in [0, kMaxParamGroups). Groups are numbered by the job: 0 when it has one.
  int32_t param_group = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_TENSOR_SPEC_H_

// Mixed-precision recipes: which format each tensor of a job is published in.
//
// A Recipe is a named bundle of settings in the vocabulary of Megatron Bridge's
// `get_mixed_precision_config` (bf16_mixed, bf16_with_fp8_current_scaling_mixed, ...), so a
// job can name the same recipe its trainer uses. The registry is a fixed table compiled in;
// FindRecipe returns a copy that the caller may tune with ApplyRecipeOptions. ResolveFormats
// then decides, tensor by tensor, the published format: user overrides first, then the
// built-in "keep in the model dtype" rules (norms, biases, embeddings, 1-D tensors), then the
// first/last-layers rule, then the recipe's weight format; a tensor whose shape the chosen
// format cannot hold falls back to the model dtype with the reason recorded.
//
// Weights always use E4M3 (FORMATS.md), so fp8 recipes publish fp8_e4m3_delayed or
// fp8_e4m3_current whatever Bridge's `fp8` ("hybrid" / "e4m3") says about activations.
//
// Thread safety: every function is pure and reentrant; the registry is immutable static data.
// Recipe and the other structs are plain values with no hidden sharing.
//
// Errors: INVALID_ARGUMENT only (bad names, option values or overrides; never retry). The
// message names the offending field ("recipe_options.fp8_margin", "overrides[2].pattern").
#ifndef MAINSTAY_COMMON_RECIPE_H_
#define MAINSTAY_COMMON_RECIPE_H_

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format.h"
#include "common/tensor_spec.h"

namespace mainstay {

// How a delayed-scaling amax is read from its history (Bridge's `fp8_amax_compute_algo`).
enum class AmaxComputeAlgo {
  kMax,         // "max": the largest amax in the history
  kMostRecent,  // "most_recent": the amax of the latest step
};

// "max" / "most_recent".
absl::string_view AmaxComputeAlgoName(AmaxComputeAlgo algo);
// Inverse of AmaxComputeAlgoName; anything else -> INVALID_ARGUMENT.
absl::StatusOr<AmaxComputeAlgo> ParseAmaxComputeAlgo(absl::string_view name);

// Loss scaling of the gradients a trainer pushes (fp16 recipes only). The defaults mean
// "no loss scaling": a fixed scale of 1.
struct LossScaling {
  bool dynamic = false;
  float initial_scale = 1.0f;
  float min_scale = 1.0f;
  int growth_interval = 0;  // steps without overflow before the scale doubles
  int hysteresis = 0;       // overflowing steps tolerated before the scale halves

  friend bool operator==(const LossScaling&, const LossScaling&) = default;
};

struct Recipe {
  std::string name;                      // canonical name, e.g. "bf16_with_fp8_mixed"
  Format model_dtype = Format::kBF16;    // kBF16 or kFP16: the format of unquantized tensors
  Format weight_format = Format::kBF16;  // format of the weights the recipe quantizes

  // Delayed scaling only (Bridge's defaults elsewhere: 1 and most_recent).
  int fp8_amax_history_len = 1;
  AmaxComputeAlgo fp8_amax_compute_algo = AmaxComputeAlgo::kMostRecent;
  int fp8_margin = 0;  // scale = (fp8_max / amax) / 2^margin

  // When set, the first `num_layers_at_start_in_bf16` and the last
  // `num_layers_at_end_in_bf16` transformer layers stay in the model dtype (bf16 or fp16,
  // despite the name, which is Bridge's).
  bool first_last_layers_bf16 = false;
  int num_layers_at_start_in_bf16 = 0;
  int num_layers_at_end_in_bf16 = 0;

  LossScaling loss_scaling;

  // Bridge's `fp8_param_gather`: the trainer keeps and all-gathers its weights in the
  // quantized format. Carried for the trainer's benefit; ResolveFormats does not read it.
  bool fp8_param_gather = false;

  friend bool operator==(const Recipe&, const Recipe&) = default;
};

// The registered recipe called `name`. Bridge's spellings are accepted too: hyphens for
// underscores ("bf16-mixed") and the delayed-scaling long names
// ("bf16_with_fp8_delayed_scaling_mixed" = "bf16_with_fp8_mixed"); the returned
// Recipe::name is always canonical. Unknown -> INVALID_ARGUMENT listing the canonical names.
absl::StatusOr<Recipe> FindRecipe(absl::string_view name);

// Canonical names of every registered recipe, sorted. The views point at static storage.
std::vector<absl::string_view> RecipeNames();

// Bridge's knobs a job may set on top of a named recipe; unset fields keep the recipe's value.
struct RecipeOptions {
  std::optional<int> fp8_amax_history_len;  // 1 .. 65536
  std::optional<AmaxComputeAlgo> fp8_amax_compute_algo;
  std::optional<int> fp8_margin;  // >= 0
  std::optional<bool> first_last_layers_bf16;
  std::optional<int> num_layers_at_start_in_bf16;  // >= 0
  std::optional<int> num_layers_at_end_in_bf16;    // >= 0
};

// `recipe` with the set fields of `options` applied. A value out of range ->
// INVALID_ARGUMENT naming the field ("recipe_options.fp8_amax_history_len: ..."). Options
// that do not affect the recipe's format (an amax history on a non-delayed recipe, layer
// counts with first_last_layers_bf16 off) are accepted and stored, as Bridge does.
absl::StatusOr<Recipe> ApplyRecipeOptions(Recipe recipe, const RecipeOptions& options);

// Publish every tensor whose whole name matches `pattern` in `format`. The pattern is a
// glob: `*` matches any run of characters (dots included), `?` exactly one, everything
// else itself. Any format is allowed, quantized or not.
struct FormatOverride {
  std::string pattern;
  Format format = Format::kBF16;
};

// True if the glob `pattern` (see FormatOverride) matches all of `name`.
bool MatchesGlob(absl::string_view pattern, absl::string_view name);

// The published format of one tensor and why.
struct ResolvedFormat {
  Format format = Format::kBF16;
  bool fell_back = false;  // the chosen format could not hold the shape; model dtype instead
  std::string reason;      // the rule that chose the format, or the shape check's message

  friend bool operator==(const ResolvedFormat&, const ResolvedFormat&) = default;
};

// One ResolvedFormat per entry of `tensors`, in the same order (TensorSpec::format is
// ignored on input). For each tensor the first rule that applies wins:
//   1. the first override whose pattern matches the name;
//   2. model dtype for tensors of rank < 2, names containing "norm", ending in ".bias", or
//      naming an embedding / output layer ("embed", "wte", "wpe", "lm_head",
//      "output_layer"); substrings match case-insensitively (HF's "LayerNorm");
//   3. model dtype when recipe.first_last_layers_bf16 and the tensor's layer index is
//      < num_layers_at_start_in_bf16 or >= num_layers - num_layers_at_end_in_bf16; the
//      layer index is the first dot-separated, all-digit component of the name
//      ("decoder.layers.3.mlp.linear_fc1.weight" -> 3);
//   4. recipe.weight_format.
// Then, if CheckShapeSupported rejects the shape, the model dtype with fell_back = true.
//
// `num_layers` = 0 infers it as the largest layer index + 1 (a job declares a whole
// model; pass it explicitly when the tensors are only part of one).
//
// Errors (INVALID_ARGUMENT): recipe.model_dtype not bf16/fp16 ("recipe.model_dtype"); an
// empty override pattern ("overrides[i].pattern"); a shape dimension < 1
// ("tensors[i].shape[j]"); num_layers < 0; a layer index >= an explicit num_layers
// ("tensors[i].name").
absl::StatusOr<std::vector<ResolvedFormat>> ResolveFormats(
    const Recipe& recipe, std::span<const FormatOverride> overrides,
    std::span<const TensorSpec> tensors, int num_layers);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_RECIPE_H_

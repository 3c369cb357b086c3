#include "common/recipe.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace mainstay {
namespace {

// One row of the registry. Everything not listed here takes Bridge's MixedPrecisionConfig
// defaults; delayed-scaling rows get Bridge's delayed settings (history 1024, "max",
// margin 0) in MakeRecipe.
struct RecipeDef {
  absl::string_view name;
  absl::string_view bridge_alias;  // Bridge's own name when it differs from ours; else empty
  Format model_dtype;
  Format weight_format;
  int layers_at_start_in_bf16;  // both 0: first_last_layers_bf16 off
  int layers_at_end_in_bf16;
  bool fp8_param_gather;
};

constexpr Format kBF16 = Format::kBF16;
constexpr Format kFP16 = Format::kFP16;

// Bridge's fp8_recipe -> our weight format: "delayed" -> fp8_e4m3_delayed, "tensorwise" ->
// fp8_e4m3_current, "mxfp8" -> mxfp8, "blockwise" -> fp8_block (128x128 weight tiles).
// nanov2 says "current scaling" in its name but Bridge configures it as blockwise.
constexpr std::array<RecipeDef, 13> kRecipes = {{
    {"bf16_mixed", "", kBF16, kBF16, 0, 0, false},
    {"fp16_mixed", "", kFP16, kFP16, 0, 0, false},
    {"bf16_with_fp8_mixed", "bf16_with_fp8_delayed_scaling_mixed", kBF16, Format::kFP8E4M3Delayed,
     0, 0, true},
    {"fp16_with_fp8_mixed", "fp16_with_fp8_delayed_scaling_mixed", kFP16, Format::kFP8E4M3Delayed,
     0, 0, true},
    {"bf16_with_fp8_current_scaling_mixed", "", kBF16, Format::kFP8E4M3Current, 1, 1, true},
    {"fp16_with_fp8_current_scaling_mixed", "", kFP16, Format::kFP8E4M3Current, 1, 1, true},
    {"nemotron_h_bf16_with_fp8_current_scaling_mixed", "", kBF16, Format::kFP8E4M3Current, 2, 2,
     true},
    {"nanov2_bf16_with_fp8_current_scaling_mixed", "", kBF16, Format::kFP8Block, 2, 2, true},
    {"bf16_with_mxfp8_mixed", "", kBF16, Format::kMXFP8, 0, 0, true},
    {"fp16_with_mxfp8_mixed", "", kFP16, Format::kMXFP8, 0, 0, true},
    {"bf16_with_fp8_subchannel_scaling_mixed", "", kBF16, Format::kFP8Block, 0, 0, false},
    {"fp16_with_fp8_subchannel_scaling_mixed", "", kFP16, Format::kFP8Block, 0, 0, false},
    // Ours; Bridge has no NVFP4 weight recipe of this name.
    {"bf16_with_nvfp4_mixed", "", kBF16, Format::kNVFP4, 0, 0, false},
}};

// Bridge's fp16 loss scaler: initial 2^32, min 1, window 1000, hysteresis 2.
constexpr LossScaling kFP16DynamicLossScaling = {
    .dynamic = true,
    .initial_scale = 4294967296.0f,
    .min_scale = 1.0f,
    .growth_interval = 1000,
    .hysteresis = 2,
};

constexpr int kMaxAmaxHistoryLen = 65536;

Recipe MakeRecipe(const RecipeDef& def) {
  Recipe r;
  r.name = std::string(def.name);
  r.model_dtype = def.model_dtype;
  r.weight_format = def.weight_format;
  if (Describe(def.weight_format).scaling == ScalingMode::kDelayed) {
    r.fp8_amax_history_len = 1024;
    r.fp8_amax_compute_algo = AmaxComputeAlgo::kMax;
    r.fp8_margin = 0;
  }
  r.first_last_layers_bf16 = def.layers_at_start_in_bf16 > 0 || def.layers_at_end_in_bf16 > 0;
  r.num_layers_at_start_in_bf16 = def.layers_at_start_in_bf16;
  r.num_layers_at_end_in_bf16 = def.layers_at_end_in_bf16;
  if (def.model_dtype == Format::kFP16) r.loss_scaling = kFP16DynamicLossScaling;
  r.fp8_param_gather = def.fp8_param_gather;
  return r;
}

bool IsModelDtype(Format f) { return f == Format::kBF16 || f == Format::kFP16; }

// Built-in rule 2 of ResolveFormats: a reason when the tensor stays in the model dtype.
std::optional<std::string> KeepInModelDtypeReason(const TensorSpec& t, absl::string_view dtype) {
  if (t.shape.size() < 2) {
    return absl::StrCat(t.shape.size(), "-D tensor kept in ", dtype);
  }
  // Case-insensitive, for HF names such as "LayerNorm".
  const std::string lower = absl::AsciiStrToLower(t.name);
  if (absl::StrContains(lower, "norm")) {
    return absl::StrCat("normalization weight ('norm' in name) kept in ", dtype);
  }
  if (absl::EndsWith(lower, ".bias")) {
    return absl::StrCat("bias kept in ", dtype);
  }
  for (absl::string_view key : {"embed", "wte", "wpe", "lm_head", "output_layer"}) {
    if (absl::StrContains(lower, key)) {
      return absl::StrCat("embedding or output layer ('", key, "' in name) kept in ", dtype);
    }
  }
  return std::nullopt;
}

// The first dot-separated component of `name` made only of digits, or -1 when there is
// none. An index too large for int64 is an error.
absl::StatusOr<int64_t> LayerIndex(absl::string_view name) {
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    if (part.empty() || !std::all_of(part.begin(), part.end(), absl::ascii_isdigit)) continue;
    int64_t index = 0;
    if (!absl::SimpleAtoi(part, &index)) {
      return absl::InvalidArgumentError(absl::StrCat("layer index '", part, "' is out of range"));
    }
    return index;
  }
  return -1;
}

}  // namespace

absl::string_view AmaxComputeAlgoName(AmaxComputeAlgo algo) {
  switch (algo) {
    case AmaxComputeAlgo::kMax:
      return "max";
    case AmaxComputeAlgo::kMostRecent:
      return "most_recent";
  }
  return "?";
}

absl::StatusOr<AmaxComputeAlgo> ParseAmaxComputeAlgo(absl::string_view name) {
  if (name == "max") return AmaxComputeAlgo::kMax;
  if (name == "most_recent") return AmaxComputeAlgo::kMostRecent;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown amax compute algo '", name, "'; known: max, most_recent"));
}

absl::StatusOr<Recipe> FindRecipe(absl::string_view name) {
  // Bridge registers every recipe under its hyphenated spelling too, and maps '-' to '_'
  // before looking up; do the same so any mix is accepted.
  std::string normalized(name);
  std::replace(normalized.begin(), normalized.end(), '-', '_');
  for (const RecipeDef& def : kRecipes) {
    if (normalized == def.name || (!def.bridge_alias.empty() && normalized == def.bridge_alias)) {
      return MakeRecipe(def);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown recipe '", name, "'; known recipes: ", absl::StrJoin(RecipeNames(), ", "),
      " (hyphens may replace underscores)"));
}

std::vector<absl::string_view> RecipeNames() {
  std::vector<absl::string_view> names;
  names.reserve(kRecipes.size());
  for (const RecipeDef& def : kRecipes) names.push_back(def.name);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<Recipe> ApplyRecipeOptions(Recipe recipe, const RecipeOptions& options) {
  if (options.fp8_amax_history_len.has_value()) {
    const int len = *options.fp8_amax_history_len;
    if (len < 1 || len > kMaxAmaxHistoryLen) {
      return InvalidArgumentError("recipe_options.fp8_amax_history_len", "must be in [1, ",
                                  kMaxAmaxHistoryLen, "], got ", len);
    }
    recipe.fp8_amax_history_len = len;
  }
  if (options.fp8_amax_compute_algo.has_value()) {
    recipe.fp8_amax_compute_algo = *options.fp8_amax_compute_algo;
  }
  if (options.fp8_margin.has_value()) {
    if (*options.fp8_margin < 0) {
      return InvalidArgumentError("recipe_options.fp8_margin", "must be >= 0, got ",
                                  *options.fp8_margin);
    }
    recipe.fp8_margin = *options.fp8_margin;
  }
  if (options.first_last_layers_bf16.has_value()) {
    recipe.first_last_layers_bf16 = *options.first_last_layers_bf16;
  }
  if (options.num_layers_at_start_in_bf16.has_value()) {
    if (*options.num_layers_at_start_in_bf16 < 0) {
      return InvalidArgumentError("recipe_options.num_layers_at_start_in_bf16",
                                  "must be >= 0, got ", *options.num_layers_at_start_in_bf16);
    }
    recipe.num_layers_at_start_in_bf16 = *options.num_layers_at_start_in_bf16;
  }
  if (options.num_layers_at_end_in_bf16.has_value()) {
    if (*options.num_layers_at_end_in_bf16 < 0) {
      return InvalidArgumentError("recipe_options.num_layers_at_end_in_bf16", "must be >= 0, got ",
                                  *options.num_layers_at_end_in_bf16);
    }
    recipe.num_layers_at_end_in_bf16 = *options.num_layers_at_end_in_bf16;
  }
  return recipe;
}

bool MatchesGlob(absl::string_view pattern, absl::string_view name) {
  // Greedy match with one backtrack point: on a mismatch, let the last '*' swallow one more
  // character. Linear in practice and never exponential.
  size_t p = 0, n = 0;
  size_t star = absl::string_view::npos, star_n = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (star != absl::string_view::npos) {
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

absl::StatusOr<std::vector<ResolvedFormat>> ResolveFormats(
    const Recipe& recipe, std::span<const FormatOverride> overrides,
    std::span<const TensorSpec> tensors, int num_layers) {
  if (!IsModelDtype(recipe.model_dtype)) {
    return InvalidArgumentError("recipe.model_dtype", "must be bf16 or fp16, got ",
                                FormatName(recipe.model_dtype));
  }
  for (size_t i = 0; i < overrides.size(); ++i) {
    if (overrides[i].pattern.empty()) {
      return InvalidArgumentError(absl::StrCat("overrides[", i, "].pattern"),
                                  "must be a non-empty glob");
    }
  }
  if (num_layers < 0) {
    return InvalidArgumentError("num_layers", "must be >= 0 (0 = infer), got ", num_layers);
  }

  // Layer indices first: both the inferred count and the explicit-count check need all.
  std::vector<int64_t> layer(tensors.size(), -1);
  int64_t max_layer = -1;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    for (size_t j = 0; j < t.shape.size(); ++j) {
      if (t.shape[j] < 1) {
        return InvalidArgumentError(absl::StrCat("tensors[", i, "].shape[", j, "]"),
                                    "must be >= 1, got ", t.shape[j]);
      }
    }
    absl::StatusOr<int64_t> index = LayerIndex(t.name);
    if (!index.ok()) {
      return Annotate(index.status(), absl::StrCat("tensors[", i, "].name"));
    }
    layer[i] = *index;
    max_layer = std::max(max_layer, *index);
    if (num_layers > 0 && *index >= num_layers) {
      return InvalidArgumentError(absl::StrCat("tensors[", i, "].name"), "layer index ", *index,
                                  " of '", t.name, "' is not below num_layers ", num_layers);
    }
  }
  const int64_t total_layers = num_layers > 0 ? num_layers : max_layer + 1;

  const absl::string_view dtype = FormatName(recipe.model_dtype);
  std::vector<ResolvedFormat> result;
  result.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    ResolvedFormat r;
    const FormatOverride* match = nullptr;
    for (const FormatOverride& o : overrides) {
      if (MatchesGlob(o.pattern, t.name)) {
        match = &o;
        break;
      }
    }
    if (match != nullptr) {
      r.format = match->format;
      r.reason = absl::StrCat("override '", match->pattern, "'");
    } else if (std::optional<std::string> keep = KeepInModelDtypeReason(t, dtype)) {
      r.format = recipe.model_dtype;
      r.reason = *std::move(keep);
    } else if (recipe.first_last_layers_bf16 && layer[i] >= 0 &&
               layer[i] < recipe.num_layers_at_start_in_bf16) {
      r.format = recipe.model_dtype;
      r.reason = absl::StrCat("layer ", layer[i], " is one of the first ",
                              recipe.num_layers_at_start_in_bf16, " layer(s) kept in ", dtype);
    } else if (recipe.first_last_layers_bf16 && layer[i] >= 0 &&
               layer[i] >= total_layers - recipe.num_layers_at_end_in_bf16) {
      r.format = recipe.model_dtype;
      r.reason =
          absl::StrCat("layer ", layer[i], " is one of the last ", recipe.num_layers_at_end_in_bf16,
                       " of ", total_layers, " layer(s) kept in ", dtype);
    } else {
      r.format = recipe.weight_format;
      r.reason = absl::StrCat("recipe '", recipe.name, "' weight format");
    }
    if (absl::Status shape_ok = CheckShapeSupported(r.format, t.shape); !shape_ok.ok()) {
      r.format = recipe.model_dtype;
      r.fell_back = true;
      r.reason = std::string(shape_ok.message());
    }
    result.push_back(std::move(r));
  }
  return result;
}

}  // namespace mainstay

#include "common/recipe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr int kLayers = 6;

// A small GPT in Megatron-core's TE naming: 6 layers, hidden 256, ffn 1024, vocab 1024.
// Every shape is a multiple of 32, so no format falls back.
std::vector<TensorSpec> SmallGpt() {
  std::vector<TensorSpec> t;
  t.push_back({"embedding.word_embeddings.weight", {1024, 256}});
  t.push_back({"embedding.position_embeddings.weight", {512, 256}});
  for (int i = 0; i < kLayers; ++i) {
    const std::string p = absl::StrCat("decoder.layers.", i, ".");
    t.push_back({p + "self_attention.linear_qkv.layer_norm_weight", {256}});
    t.push_back({p + "self_attention.linear_qkv.weight", {768, 256}});
    t.push_back({p + "self_attention.linear_qkv.bias", {768}});
    t.push_back({p + "self_attention.linear_proj.weight", {256, 256}});
    t.push_back({p + "mlp.linear_fc1.layer_norm_weight", {256}});
    t.push_back({p + "mlp.linear_fc1.weight", {1024, 256}});
    t.push_back({p + "mlp.linear_fc2.weight", {256, 1024}});
  }
  t.push_back({"decoder.final_layernorm.weight", {256}});
  t.push_back({"output_layer.weight", {1024, 256}});
  return t;
}

bool IsLayerLinear(const std::string& name) {
  return name.starts_with("decoder.layers.") && name.ends_with(".weight") &&
         name.find("layer_norm") == std::string::npos;
}

std::map<std::string, ResolvedFormat> ByName(const std::vector<TensorSpec>& tensors,
                                             const std::vector<ResolvedFormat>& resolved) {
  std::map<std::string, ResolvedFormat> m;
  for (size_t i = 0; i < tensors.size(); ++i) m[tensors[i].name] = resolved[i];
  return m;
}

struct RecipeCase {
  std::string name;
  Format model_dtype;
  Format weight_format;
  // Per layer of SmallGpt: 'Q' = linear weights in weight_format, 'M' = in the model dtype.
  std::string layers;
  bool fp8_param_gather;
};

const std::vector<RecipeCase>& AllRecipeCases() {
  static const std::vector<RecipeCase> cases = {
      {"bf16_mixed", Format::kBF16, Format::kBF16, "QQQQQQ", false},
      {"fp16_mixed", Format::kFP16, Format::kFP16, "QQQQQQ", false},
      {"bf16_with_fp8_mixed", Format::kBF16, Format::kFP8E4M3Delayed, "QQQQQQ", true},
      {"fp16_with_fp8_mixed", Format::kFP16, Format::kFP8E4M3Delayed, "QQQQQQ", true},
      {"bf16_with_fp8_current_scaling_mixed", Format::kBF16, Format::kFP8E4M3Current, "MQQQQM",
       true},
      {"fp16_with_fp8_current_scaling_mixed", Format::kFP16, Format::kFP8E4M3Current, "MQQQQM",
       true},
      {"nemotron_h_bf16_with_fp8_current_scaling_mixed", Format::kBF16, Format::kFP8E4M3Current,
       "MMQQMM", true},
      {"nanov2_bf16_with_fp8_current_scaling_mixed", Format::kBF16, Format::kFP8Block, "MMQQMM",
       true},
      {"bf16_with_mxfp8_mixed", Format::kBF16, Format::kMXFP8, "QQQQQQ", true},
      {"fp16_with_mxfp8_mixed", Format::kFP16, Format::kMXFP8, "QQQQQQ", true},
      {"bf16_with_fp8_subchannel_scaling_mixed", Format::kBF16, Format::kFP8Block, "QQQQQQ", false},
      {"fp16_with_fp8_subchannel_scaling_mixed", Format::kFP16, Format::kFP8Block, "QQQQQQ", false},
      {"bf16_with_nvfp4_mixed", Format::kBF16, Format::kNVFP4, "QQQQQQ", false},
  };
  return cases;
}

TEST(RecipeTest, RecipeNamesAreTheThirteenCanonicalNamesSorted) {
  std::vector<absl::string_view> names = RecipeNames();
  EXPECT_THAT(names, ElementsAre("bf16_mixed", "bf16_with_fp8_current_scaling_mixed",
                                 "bf16_with_fp8_mixed", "bf16_with_fp8_subchannel_scaling_mixed",
                                 "bf16_with_mxfp8_mixed", "bf16_with_nvfp4_mixed", "fp16_mixed",
                                 "fp16_with_fp8_current_scaling_mixed", "fp16_with_fp8_mixed",
                                 "fp16_with_fp8_subchannel_scaling_mixed", "fp16_with_mxfp8_mixed",
                                 "nanov2_bf16_with_fp8_current_scaling_mixed",
                                 "nemotron_h_bf16_with_fp8_current_scaling_mixed"));
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(names.size(), AllRecipeCases().size());
}

TEST(RecipeTest, EveryRecipeResolvesSmallGptToItsFormats) {
  const std::vector<TensorSpec> gpt = SmallGpt();
  for (const RecipeCase& c : AllRecipeCases()) {
    SCOPED_TRACE(c.name);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(c.name));
    EXPECT_EQ(recipe.name, c.name);
    EXPECT_EQ(recipe.model_dtype, c.model_dtype);
    EXPECT_EQ(recipe.weight_format, c.weight_format);
    EXPECT_EQ(recipe.fp8_param_gather, c.fp8_param_gather);

    MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> resolved,
                                  ResolveFormats(recipe, {}, gpt, /*num_layers=*/0));
    ASSERT_EQ(resolved.size(), gpt.size());
    for (size_t i = 0; i < gpt.size(); ++i) {
      const TensorSpec& t = gpt[i];
      SCOPED_TRACE(t.name);
      EXPECT_FALSE(resolved[i].fell_back) << resolved[i].reason;
      EXPECT_FALSE(resolved[i].reason.empty());
      if (IsLayerLinear(t.name)) {
        const int layer = t.name[std::string("decoder.layers.").size()] - '0';
        const Format want = c.layers[layer] == 'Q' ? c.weight_format : c.model_dtype;
        EXPECT_EQ(resolved[i].format, want) << resolved[i].reason;
      } else {
        // Embeddings, norms, biases and the output layer never leave the model dtype.
        EXPECT_EQ(resolved[i].format, c.model_dtype) << resolved[i].reason;
      }
    }
  }
}

TEST(RecipeTest, Fp8RecipesPublishE4M3Weights) {
  for (const RecipeCase& c : AllRecipeCases()) {
    SCOPED_TRACE(c.name);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(c.name));
    const FormatDescriptor& d = Describe(recipe.weight_format);
    if (d.bits_per_element == 8) {
      EXPECT_EQ(d.element, ElementType::kE4M3);
    }
  }
}

TEST(RecipeTest, DelayedScalingRecipesUseBridgeHistorySettings) {
  for (const char* name : {"bf16_with_fp8_mixed", "fp16_with_fp8_mixed"}) {
    SCOPED_TRACE(name);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(name));
    EXPECT_EQ(recipe.weight_format, Format::kFP8E4M3Delayed);
    EXPECT_EQ(recipe.fp8_amax_history_len, 1024);
    EXPECT_EQ(recipe.fp8_amax_compute_algo, AmaxComputeAlgo::kMax);
    EXPECT_EQ(recipe.fp8_margin, 0);
    EXPECT_FALSE(recipe.first_last_layers_bf16);
  }
  // Other recipes keep Bridge's MixedPrecisionConfig defaults.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe current, FindRecipe("bf16_with_fp8_current_scaling_mixed"));
  EXPECT_EQ(current.fp8_amax_history_len, 1);
  EXPECT_EQ(current.fp8_amax_compute_algo, AmaxComputeAlgo::kMostRecent);
}

TEST(RecipeTest, CurrentScalingRecipesKeepFirstAndLastLayersOutOfFp8) {
  struct Want {
    const char* name;
    int start, end;
  };
  for (const Want& w : {Want{"bf16_with_fp8_current_scaling_mixed", 1, 1},
                        Want{"fp16_with_fp8_current_scaling_mixed", 1, 1},
                        Want{"nemotron_h_bf16_with_fp8_current_scaling_mixed", 2, 2},
                        Want{"nanov2_bf16_with_fp8_current_scaling_mixed", 2, 2}}) {
    SCOPED_TRACE(w.name);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(w.name));
    EXPECT_TRUE(recipe.first_last_layers_bf16);
    EXPECT_EQ(recipe.num_layers_at_start_in_bf16, w.start);
    EXPECT_EQ(recipe.num_layers_at_end_in_bf16, w.end);
  }
}

TEST(RecipeTest, Fp16RecipesUseDynamicLossScalingAndBf16RecipesNone) {
  for (const RecipeCase& c : AllRecipeCases()) {
    SCOPED_TRACE(c.name);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(c.name));
    if (c.model_dtype == Format::kFP16) {
      EXPECT_TRUE(recipe.loss_scaling.dynamic);
      EXPECT_EQ(recipe.loss_scaling.initial_scale, 4294967296.0f);  // 2^32
      EXPECT_EQ(recipe.loss_scaling.min_scale, 1.0f);
      EXPECT_EQ(recipe.loss_scaling.growth_interval, 1000);
      EXPECT_EQ(recipe.loss_scaling.hysteresis, 2);
    } else {
      EXPECT_FALSE(recipe.loss_scaling.dynamic);
      EXPECT_EQ(recipe.loss_scaling.initial_scale, 1.0f);
    }
  }
}

TEST(RecipeTest, HyphenatedAndBridgeDelayedNamesFindTheCanonicalRecipe) {
  for (absl::string_view name : RecipeNames()) {
    const std::string hyphenated = absl::StrReplaceAll(name, {{"_", "-"}});
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(hyphenated));
    EXPECT_EQ(recipe.name, name) << hyphenated;
  }
  struct Alias {
    const char* spelled;
    const char* canonical;
  };
  for (const Alias& a : {Alias{"bf16-mixed", "bf16_mixed"},
                         Alias{"bf16_with_fp8_delayed_scaling_mixed", "bf16_with_fp8_mixed"},
                         Alias{"fp16_with_fp8_delayed_scaling_mixed", "fp16_with_fp8_mixed"},
                         Alias{"bf16-with-fp8-delayed-scaling-mixed", "bf16_with_fp8_mixed"},
                         Alias{"fp16-with-fp8_delayed-scaling_mixed", "fp16_with_fp8_mixed"}}) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(a.spelled));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe canonical, FindRecipe(a.canonical));
    EXPECT_EQ(recipe, canonical) << a.spelled;
  }
}

TEST(RecipeTest, UnknownRecipeIsInvalidArgumentListingEveryCanonicalName) {
  for (const char* bad : {"bf16_with_fp4_mixed", "", "bf16"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<Recipe> r = FindRecipe(bad);
    ASSERT_THAT(r, StatusIs(absl::StatusCode::kInvalidArgument));
    const std::string message(r.status().message());
    EXPECT_THAT(message, HasSubstr(absl::StrCat("'", bad, "'")));
    for (absl::string_view name : RecipeNames()) EXPECT_THAT(message, HasSubstr(std::string(name)));
  }
}

TEST(RecipeTest, BuiltInRulesKeepNormsBiasesEmbeddingsAndOutputLayerInModelDtype) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_with_mxfp8_mixed"));
  // All 2-D and mxfp8-compatible, so only the name rules can keep them out of mxfp8.
  const std::vector<TensorSpec> tensors = {
      {"bert.encoder.layer.0.attention.output.LayerNorm.weight", {128, 128}},
      {"model.layers.0.q_norm.weight", {128, 128}},
      {"model.layers.0.mlp.gate.bias", {128, 128}},
      {"model.embed_tokens.weight", {128, 128}},
      {"transformer.wte.weight", {128, 128}},
      {"transformer.wpe.weight", {128, 128}},
      {"lm_head.weight", {128, 128}},
      {"output_layer.weight", {128, 128}},
      {"model.layers.0.mlp.up_proj.weight", {128, 128}},
      {"model.layers.0.mlp.biased_proj.weight", {128, 128}},  // "bias" but not ".bias"
  };
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(recipe, {}, tensors, 0));
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(r[i].format, Format::kBF16) << tensors[i].name << ": " << r[i].reason;
    EXPECT_FALSE(r[i].fell_back);
  }
  EXPECT_THAT(r[0].reason, HasSubstr("norm"));
  EXPECT_THAT(r[2].reason, HasSubstr("bias"));
  EXPECT_THAT(r[3].reason, HasSubstr("embed"));
  EXPECT_THAT(r[4].reason, HasSubstr("wte"));
  EXPECT_THAT(r[6].reason, HasSubstr("lm_head"));
  EXPECT_THAT(r[7].reason, HasSubstr("output_layer"));
  EXPECT_EQ(r[8].format, Format::kMXFP8);
  EXPECT_THAT(r[8].reason, HasSubstr("bf16_with_mxfp8_mixed"));
  EXPECT_EQ(r[9].format, Format::kMXFP8);
}

TEST(RecipeTest, OneDimensionalTensorsStayInModelDtypeWithoutFallingBack) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("fp16_with_fp8_mixed"));
  const std::vector<TensorSpec> tensors = {{"decoder.layers.0.mlp.router.expert_bias", {64}},
                                           {"scalar", {}}};
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(recipe, {}, tensors, 0));
  EXPECT_EQ(r[0].format, Format::kFP16);
  EXPECT_FALSE(r[0].fell_back);
  EXPECT_THAT(r[0].reason, HasSubstr("1-D"));
  EXPECT_EQ(r[1].format, Format::kFP16);
  EXPECT_THAT(r[1].reason, HasSubstr("0-D"));
}

TEST(RecipeTest, FirstMatchingOverrideWinsOverEveryOtherRule) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_with_fp8_current_scaling_mixed"));
  const std::vector<TensorSpec> gpt = SmallGpt();
  const std::vector<FormatOverride> overrides = {
      {"*.linear_fc1.weight", Format::kFP8Block},
      {"decoder.layers.*", Format::kBF16},      // would also match fc1: listed later, loses
      {"output_layer.weight", Format::kMXFP8},  // beats the built-in output-layer rule
      {"decoder.layers.?.mlp.linear_fc1.layer_norm_weight", Format::kFP8E4M3Delayed},
  };
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> resolved,
                                ResolveFormats(recipe, overrides, gpt, 0));
  auto by_name = ByName(gpt, resolved);
  // Layer 0 would be bf16 by the first-layer rule; the override comes first.
  EXPECT_EQ(by_name["decoder.layers.0.mlp.linear_fc1.weight"].format, Format::kFP8Block);
  EXPECT_EQ(by_name["decoder.layers.3.mlp.linear_fc1.weight"].format, Format::kFP8Block);
  EXPECT_EQ(by_name["decoder.layers.3.mlp.linear_fc1.weight"].reason,
            "override '*.linear_fc1.weight'");
  EXPECT_EQ(by_name["decoder.layers.3.mlp.linear_fc2.weight"].format, Format::kBF16);
  EXPECT_EQ(by_name["decoder.layers.3.mlp.linear_fc2.weight"].reason,
            "override 'decoder.layers.*'");
  EXPECT_EQ(by_name["output_layer.weight"].format, Format::kMXFP8);
  EXPECT_EQ(by_name["output_layer.weight"].reason, "override 'output_layer.weight'");
  EXPECT_EQ(by_name["embedding.word_embeddings.weight"].format, Format::kBF16);
  // "decoder.layers.*" matched the layer-norm weights first, so the 4th override never applies.
  EXPECT_EQ(by_name["decoder.layers.2.mlp.linear_fc1.layer_norm_weight"].reason,
            "override 'decoder.layers.*'");
}

TEST(RecipeTest, OverrideToQuantizedFormatOnUnsupportedShapeFallsBack) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_mixed"));
  const std::vector<TensorSpec> tensors = {
      {"decoder.final_layernorm.weight", {256}},             // 1-D: nvfp4 needs 2-D
      {"decoder.layers.0.mlp.linear_fc1.weight", {48, 40}},  // 40 is no multiple of 16
      {"decoder.layers.0.mlp.linear_fc2.weight", {48, 64}},
  };
  const std::vector<FormatOverride> overrides = {{"*", Format::kNVFP4}};
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(recipe, overrides, tensors, 0));
  EXPECT_EQ(r[0].format, Format::kBF16);
  EXPECT_TRUE(r[0].fell_back);
  EXPECT_THAT(r[0].reason, AllOf(HasSubstr("nvfp4"), HasSubstr("2-D")));
  EXPECT_EQ(r[1].format, Format::kBF16);
  EXPECT_TRUE(r[1].fell_back);
  EXPECT_THAT(r[1].reason, HasSubstr("16"));
  EXPECT_EQ(r[2].format, Format::kNVFP4);
  EXPECT_FALSE(r[2].fell_back);
}

TEST(RecipeTest, Mxfp8OnRowsNotMultipleOf32FallsBackToModelDtype) {
  const std::vector<TensorSpec> tensors = {{"decoder.layers.0.mlp.linear_fc1.weight", {50, 64}},
                                           {"decoder.layers.0.mlp.linear_fc2.weight", {64, 64}}};
  for (const char* name : {"bf16_with_mxfp8_mixed", "fp16_with_mxfp8_mixed"}) {
    SCOPED_TRACE(name);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe(name));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                  ResolveFormats(recipe, {}, tensors, 0));
    EXPECT_EQ(r[0].format, recipe.model_dtype);
    EXPECT_TRUE(r[0].fell_back);
    EXPECT_THAT(r[0].reason, AllOf(HasSubstr("mxfp8"), HasSubstr("32")));
    EXPECT_EQ(r[0].reason,
              std::string(CheckShapeSupported(Format::kMXFP8, tensors[0].shape).message()));
    EXPECT_EQ(r[1].format, Format::kMXFP8);
    EXPECT_FALSE(r[1].fell_back);
  }
  // 128x128 block scaling takes any shape (partial tiles are padded).
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe block, FindRecipe("bf16_with_fp8_subchannel_scaling_mixed"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(block, {}, tensors, 0));
  EXPECT_EQ(r[0].format, Format::kFP8Block);
  EXPECT_FALSE(r[0].fell_back);
}

TEST(RecipeTest, LayerRuleInfersLayerCountFromHighestIndexInGpt2Names) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_with_fp8_current_scaling_mixed"));
  std::vector<TensorSpec> tensors = {{"transformer.wte.weight", {1024, 768}}};
  for (int i = 0; i < 12; ++i) {
    tensors.push_back({absl::StrCat("transformer.h.", i, ".attn.c_attn.weight"), {768, 2304}});
  }
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(recipe, {}, tensors, 0));
  EXPECT_EQ(r[1].format, Format::kBF16);  // layer 0
  EXPECT_THAT(r[1].reason, HasSubstr("layer 0"));
  for (int i = 1; i <= 10; ++i) EXPECT_EQ(r[1 + i].format, Format::kFP8E4M3Current) << i;
  EXPECT_EQ(r[12].format, Format::kBF16);  // layer 11 = the last of 12
  EXPECT_THAT(r[12].reason, AllOf(HasSubstr("layer 11"), HasSubstr("12")));
}

TEST(RecipeTest, ExplicitLayerCountMovesTheLastLayersRule) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe,
                                FindRecipe("nemotron_h_bf16_with_fp8_current_scaling_mixed"));
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < 6; ++i) {
    tensors.push_back({absl::StrCat("decoder.layers.", i, ".mixer.in_proj.weight"), {256, 256}});
  }
  // Inferred: 6 layers, so 4 and 5 are the last two.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> inferred,
                                ResolveFormats(recipe, {}, tensors, 0));
  std::string got;
  for (const ResolvedFormat& f : inferred) got += f.format == Format::kBF16 ? 'M' : 'Q';
  EXPECT_EQ(got, "MMQQMM");
  // Explicit 10 layers (these tensors are a prefix of the model): only the first two stay.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> explicit_ten,
                                ResolveFormats(recipe, {}, tensors, 10));
  got.clear();
  for (const ResolvedFormat& f : explicit_ten) got += f.format == Format::kBF16 ? 'M' : 'Q';
  EXPECT_EQ(got, "MMQQQQ");
  // Explicit 6 agrees with inference.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> explicit_six,
                                ResolveFormats(recipe, {}, tensors, 6));
  EXPECT_EQ(explicit_six, inferred);
  // A layer index at or past an explicit count is a caller mistake.
  EXPECT_THAT(ResolveFormats(recipe, {}, tensors, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensors[5].name"), HasSubstr("num_layers 5"))));
  EXPECT_THAT(ResolveFormats(recipe, {}, tensors, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_layers")));
}

TEST(RecipeTest, LayerIndexIsFirstAllDigitComponent) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_with_fp8_current_scaling_mixed"));
  const std::vector<TensorSpec> tensors = {
      // Expert 7 of layer 1: the layer is the first numeric component, not the expert.
      {"decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight", {256, 256}},
      // "h2" and "fc10" are not all digits.
      {"blocks.h2.layers.2.fc10.weight", {256, 256}},
      {"decoder.layers.3.mlp.linear_fc1.weight", {256, 256}},
      {"decoder.layers.0.mlp.linear_fc1.weight", {256, 256}},
  };
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(recipe, {}, tensors, 0));
  EXPECT_EQ(r[0].format, Format::kFP8E4M3Current) << r[0].reason;  // layer 1 of 4
  EXPECT_EQ(r[1].format, Format::kFP8E4M3Current) << r[1].reason;  // layer 2 of 4
  EXPECT_EQ(r[2].format, Format::kBF16);                           // layer 3 = last
  EXPECT_EQ(r[3].format, Format::kBF16);                           // layer 0 = first
}

TEST(RecipeTest, TensorsWithoutLayerIndexIgnoreTheLayerRule) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_with_fp8_current_scaling_mixed"));
  const std::vector<TensorSpec> tensors = {{"vision.proj.weight", {256, 256}},
                                           {"adapter.down.weight", {256, 256}}};
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r,
                                ResolveFormats(recipe, {}, tensors, 0));
  EXPECT_EQ(r[0].format, Format::kFP8E4M3Current);
  EXPECT_EQ(r[1].format, Format::kFP8E4M3Current);
}

TEST(RecipeTest, ApplyRecipeOptionsSetsOnlyTheGivenKnobs) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe base, FindRecipe("bf16_with_fp8_mixed"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe same, ApplyRecipeOptions(base, RecipeOptions{}));
  EXPECT_EQ(same, base);

  RecipeOptions options;
  options.fp8_amax_history_len = 16;
  options.fp8_amax_compute_algo = AmaxComputeAlgo::kMostRecent;
  options.fp8_margin = 2;
  options.first_last_layers_bf16 = true;
  options.num_layers_at_start_in_bf16 = 2;
  options.num_layers_at_end_in_bf16 = 0;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe tuned, ApplyRecipeOptions(base, options));
  EXPECT_EQ(tuned.name, "bf16_with_fp8_mixed");
  EXPECT_EQ(tuned.weight_format, Format::kFP8E4M3Delayed);
  EXPECT_EQ(tuned.fp8_amax_history_len, 16);
  EXPECT_EQ(tuned.fp8_amax_compute_algo, AmaxComputeAlgo::kMostRecent);
  EXPECT_EQ(tuned.fp8_margin, 2);
  EXPECT_TRUE(tuned.first_last_layers_bf16);

  const std::vector<TensorSpec> gpt = SmallGpt();
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r, ResolveFormats(tuned, {}, gpt, 0));
  auto by_name = ByName(gpt, r);
  EXPECT_EQ(by_name["decoder.layers.1.mlp.linear_fc2.weight"].format, Format::kBF16);
  EXPECT_EQ(by_name["decoder.layers.2.mlp.linear_fc2.weight"].format, Format::kFP8E4M3Delayed);
  EXPECT_EQ(by_name["decoder.layers.5.mlp.linear_fc2.weight"].format, Format::kFP8E4M3Delayed);
}

TEST(RecipeTest, TurningOffFirstLastLayersQuantizesEveryLayer) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe base,
                                FindRecipe("nanov2_bf16_with_fp8_current_scaling_mixed"));
  RecipeOptions options;
  options.first_last_layers_bf16 = false;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, ApplyRecipeOptions(base, options));
  EXPECT_EQ(recipe.num_layers_at_start_in_bf16, 2);  // kept, but unused
  const std::vector<TensorSpec> gpt = SmallGpt();
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> r, ResolveFormats(recipe, {}, gpt, 0));
  for (size_t i = 0; i < gpt.size(); ++i) {
    if (IsLayerLinear(gpt[i].name)) {
      EXPECT_EQ(r[i].format, Format::kFP8Block) << gpt[i].name;
    }
  }
}

TEST(RecipeTest, ApplyRecipeOptionsRejectsOutOfRangeValuesNamingTheField) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe base, FindRecipe("bf16_with_fp8_mixed"));
  struct Bad {
    RecipeOptions options;
    const char* field;
  };
  std::vector<Bad> bad(6);
  bad[0].options.fp8_amax_history_len = 0;
  bad[0].field = "recipe_options.fp8_amax_history_len";
  bad[1].options.fp8_amax_history_len = 65537;
  bad[1].field = "recipe_options.fp8_amax_history_len";
  bad[2].options.fp8_margin = -1;
  bad[2].field = "recipe_options.fp8_margin";
  bad[3].options.num_layers_at_start_in_bf16 = -1;
  bad[3].field = "recipe_options.num_layers_at_start_in_bf16";
  bad[4].options.num_layers_at_end_in_bf16 = -3;
  bad[4].field = "recipe_options.num_layers_at_end_in_bf16";
  bad[5].options.fp8_margin = 1;
  bad[5].options.fp8_amax_history_len = -5;  // the bad one among good ones
  bad[5].field = "recipe_options.fp8_amax_history_len";
  for (const Bad& b : bad) {
    EXPECT_THAT(ApplyRecipeOptions(base, b.options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(b.field)));
  }
  RecipeOptions edges;
  edges.fp8_amax_history_len = 65536;
  edges.fp8_margin = 0;
  edges.num_layers_at_start_in_bf16 = 0;
  EXPECT_THAT(ApplyRecipeOptions(base, edges), IsOk());
  edges.fp8_amax_history_len = 1;
  EXPECT_THAT(ApplyRecipeOptions(base, edges), IsOk());
}

TEST(RecipeTest, ResolveFormatsRejectsBadInput) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Recipe recipe, FindRecipe("bf16_with_nvfp4_mixed"));
  const std::vector<TensorSpec> gpt = SmallGpt();
  const std::vector<FormatOverride> empty_pattern = {{"*.bias", Format::kBF16},
                                                     {"", Format::kNVFP4}};
  EXPECT_THAT(ResolveFormats(recipe, empty_pattern, gpt, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overrides[1].pattern")));

  const std::vector<TensorSpec> zero_dim = {{"a.weight", {16, 16}}, {"b.weight", {16, 0}}};
  EXPECT_THAT(ResolveFormats(recipe, {}, zero_dim, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensors[1].shape[1]")));

  Recipe broken = recipe;
  broken.model_dtype = Format::kNVFP4;
  EXPECT_THAT(ResolveFormats(broken, {}, gpt, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("recipe.model_dtype")));

  const std::vector<TensorSpec> huge = {{"layers.99999999999999999999999.w", {16, 16}}};
  EXPECT_THAT(ResolveFormats(recipe, {}, huge, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensors[0].name")));

  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<ResolvedFormat> none,
                                ResolveFormats(recipe, {}, {}, 0));
  EXPECT_THAT(none, IsEmpty());
}

TEST(RecipeTest, GlobMatchesWholeNameWithStarAndQuestionMark) {
  EXPECT_TRUE(MatchesGlob("*", ""));
  EXPECT_TRUE(MatchesGlob("*", "decoder.layers.0.mlp.linear_fc1.weight"));
  EXPECT_TRUE(MatchesGlob("decoder.layers.*.weight", "decoder.layers.0.mlp.linear_fc1.weight"));
  EXPECT_TRUE(MatchesGlob("decoder.layers.1?.*", "decoder.layers.12.mlp.weight"));
  EXPECT_FALSE(MatchesGlob("decoder.layers.1?.*", "decoder.layers.1.mlp.weight"));
  EXPECT_TRUE(MatchesGlob("a*b*c", "abc"));
  EXPECT_TRUE(MatchesGlob("a*b*c", "axxbyybzzc"));
  EXPECT_FALSE(MatchesGlob("a*b*c", "axxbyybzzcd"));
  EXPECT_TRUE(MatchesGlob("**.bias", "x.bias"));
  EXPECT_TRUE(MatchesGlob("?", "x"));
  EXPECT_FALSE(MatchesGlob("?", ""));
  EXPECT_FALSE(MatchesGlob("?", "xy"));
  // Anchored at both ends: a pattern naming a middle part does not match.
  EXPECT_FALSE(MatchesGlob("layers.1", "decoder.layers.1.mlp.weight"));
  EXPECT_FALSE(MatchesGlob("output_layer", "output_layer.weight"));
  EXPECT_TRUE(MatchesGlob("output_layer.weight", "output_layer.weight"));
  // Literal characters other than * and ? match only themselves; case matters.
  EXPECT_FALSE(MatchesGlob("Output_layer.weight", "output_layer.weight"));
  EXPECT_FALSE(MatchesGlob("a.b", "axb"));
  // Backtracking over a long run stays correct.
  EXPECT_TRUE(MatchesGlob("*a*a*a*a*b", std::string(200, 'a') + "b"));
  EXPECT_FALSE(MatchesGlob("*a*a*a*a*b", std::string(200, 'a')));
}

TEST(RecipeTest, AmaxComputeAlgoNamesRoundTrip) {
  for (AmaxComputeAlgo algo : {AmaxComputeAlgo::kMax, AmaxComputeAlgo::kMostRecent}) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(AmaxComputeAlgo parsed,
                                  ParseAmaxComputeAlgo(AmaxComputeAlgoName(algo)));
    EXPECT_EQ(parsed, algo);
  }
  EXPECT_EQ(AmaxComputeAlgoName(AmaxComputeAlgo::kMostRecent), "most_recent");
  EXPECT_THAT(ParseAmaxComputeAlgo("mean"), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace mainstay

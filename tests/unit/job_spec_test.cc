#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/step_hyper.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kSpec[] = R"({
  // comments are allowed
  "name": "tiny",
  "recipe": "bf16_with_fp8_current_scaling_mixed",
  "recipe_options": {"num_layers_at_start_in_bf16": 0, "fp8_amax_compute_algo": "max"},
  "overrides": [{"pattern": "*.fc2.weight", "format": "nvfp4"}],
  "optimizer": {"type": "adamw", "beta1": 0.8, "moment_dtype": "bf16", "max_grad_norm": 0},
  "data_parallel_size": 4,
  "layout_policy": "whole_tensor",
  "bucket_numel": 4e6,
  "tensors": [
    {"name": "embed.weight", "shape": [1000, 64]},
    {"name": "layers.0.fc1.weight", "shape": [256, 64]},
    {"name": "layers.0.fc2.weight", "shape": [64, 256]},
    {"name": "layers.1.fc1.weight", "shape": [256, 64]},
    {"name": "layers.1.fc2.weight", "shape": [64, 256]},
    {"name": "layers.1.norm.weight", "shape": [64], "param_group": 1}
  ]
})";

TEST(JobSpecTest, ParsesEveryField) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec spec, ParseJobSpecJson(kSpec));
  EXPECT_EQ(spec.name, "tiny");
  EXPECT_EQ(spec.recipe, "bf16_with_fp8_current_scaling_mixed");
  EXPECT_EQ(spec.recipe_options.num_layers_at_start_in_bf16, 0);
  EXPECT_EQ(spec.recipe_options.fp8_amax_compute_algo, AmaxComputeAlgo::kMax);
  ASSERT_EQ(spec.overrides.size(), 1u);
  EXPECT_EQ(spec.overrides[0].format, Format::kNVFP4);
  EXPECT_FLOAT_EQ(spec.optimizer.beta1, 0.8f);
  EXPECT_EQ(spec.optimizer.moment_dtype, ElementType::kBFloat16);
  EXPECT_EQ(spec.optimizer.max_grad_norm, 0.0f);
  EXPECT_EQ(spec.data_parallel_size, 4);
  EXPECT_EQ(spec.layout_policy, LayoutPolicy::kWholeTensor);
  EXPECT_EQ(spec.bucket_numel, 4'000'000);
  ASSERT_EQ(spec.tensors.size(), 6u);
  EXPECT_EQ(spec.tensors[2].shape, (std::vector<int64_t>{64, 256}));
  EXPECT_EQ(spec.tensors[2].param_group, 0);
  EXPECT_EQ(spec.tensors[5].param_group, 1);
}

TEST(JobSpecTest, JsonRoundTrips) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec spec, ParseJobSpecJson(kSpec));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec again, ParseJobSpecJson(JobSpecToJson(spec)));
  EXPECT_EQ(JobSpecToJson(again), JobSpecToJson(spec));
  EXPECT_EQ(again.tensors, spec.tensors);
  EXPECT_EQ(again.optimizer, spec.optimizer);
  EXPECT_EQ(again.recipe_options.fp8_amax_compute_algo, spec.recipe_options.fp8_amax_compute_algo);
}

TEST(JobSpecTest, ResolveJobAppliesRecipeOverridesAndLayout) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec spec, ParseJobSpecJson(kSpec));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(ResolvedJob job, ResolveJob(spec));
  EXPECT_EQ(job.formats[0].format, Format::kBF16) << "embedding";
  EXPECT_EQ(job.formats[1].format, Format::kFP8E4M3Current) << "layer 0 kept: start count set to 0";
  EXPECT_EQ(job.formats[2].format, Format::kNVFP4) << "override";
  EXPECT_EQ(job.formats[3].format, Format::kBF16) << "last layer stays bf16";
  EXPECT_EQ(job.formats[5].format, Format::kBF16) << "norm";
  EXPECT_EQ(job.layout.data_parallel_size, 4);
  EXPECT_EQ(job.layout.policy, LayoutPolicy::kWholeTensor);
  for (size_t i = 0; i < spec.tensors.size(); ++i) EXPECT_EQ(job.layout.tensors[i].format, job.formats[i].format);
  EXPECT_EQ(job.layout.tensors[5].param_group, 1);
  EXPECT_EQ(NumParamGroups(job.layout), 2);
}

TEST(JobSpecTest, ParamGroupsSurviveTheProtoOfTheCoordinator) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec spec, ParseJobSpecJson(kSpec));
  v1::JobSpec proto;
  JobSpecToProto(spec, &proto);
  EXPECT_EQ(proto.tensors(5).param_group(), 1);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec back, JobSpecFromProto(proto));
  EXPECT_EQ(back.tensors, spec.tensors);
}

TEST(JobSpecTest, BadSpecsNameTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "spec: not valid JSON"},
      {"[1, 2]", "spec: must be a JSON object"},
      {R"({"tensors": []})", "name: is required"},
      {R"({"name": "a b", "tensors": []})", "name: may hold only"},
      {R"({"name": "j", "recipe": "bf16_with_fp9", "tensors": []})", "recipe: unknown"},
      {R"({"name": "j", "tensors": [{"name": "a", "shape": [2]}], "typo": 1})", "typo: unknown field"},
      {R"({"name": "j", "data_parallel_size": 0, "tensors": []})", "data_parallel_size: must be in [1, 65536]"},
      {R"({"name": "j", "data_parallel_size": 2.5, "tensors": []})", "data_parallel_size: must be an integer"},
      {R"({"name": "j", "layout_policy": "striped", "tensors": []})", "layout_policy: unknown layout policy"},
      {R"({"name": "j", "optimizer": {"type": "lion"}, "tensors": []})", "optimizer.type: unknown optimizer"},
      {R"({"name": "j", "optimizer": {"beta2": 1.5}, "tensors": []})", "optimizer.beta2: must be in"},
      {R"({"name": "j", "optimizer": {"moment_dtype": "fp8"}, "tensors": []})", "optimizer.moment_dtype"},
      {R"({"name": "j", "recipe_options": {"fp8_margin": -1}, "tensors": []})", "recipe_options.fp8_margin"},
      {R"({"name": "j", "recipe_options": {"fp8_amax_compute_algo": "avg"}, "tensors": []})",
       "recipe_options.fp8_amax_compute_algo"},
      {R"({"name": "j", "overrides": [{"pattern": "*", "format": "fp6"}], "tensors": []})", "overrides[0].format"},
      {R"({"name": "j", "overrides": [{"pattern": "", "format": "bf16"}], "tensors": []})", "overrides[0].pattern"},
      {R"({"name": "j"})", "tensors: is required"},
      {R"({"name": "j", "tensors": [{"name": "a"}]})", "tensors[0].shape: is required"},
      {R"({"name": "j", "tensors": [{"name": 7, "shape": [1]}]})", "tensors[0].name: must be a string"},
      {R"({"name": "j", "tensors": [{"name": "a", "shape": [1], "param_group": -1}]})",
       "tensors[0].param_group: must be in [0, 1023]"},
      {R"({"name": "j", "tensors": [{"name": "a", "shape": [1], "param_group": 1024}]})",
       "tensors[0].param_group: must be in [0, 1023]"},
      {R"({"name": "j", "tensors": [{"name": "a", "shape": [2, "x"]}]})", "tensors[0].shape[1]: must be an integer"},
      {R"({"name": "j", "tensors": [{"name": "a", "shape": 5}]})", "tensors[0].shape: must be an array"},
  };
  for (const auto& [text, prefix] : cases) {
    SCOPED_TRACE(text);
    EXPECT_THAT(ParseJobSpecJson(text), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith(prefix)));
  }
}

// Found by job_spec_fuzzer: a number beyond a double made the parser throw out_of_range past
// the catch (std::terminate in mainstayctl, the client library or the coordinator).
TEST(JobSpecTest, NumberTooLargeForADoubleIsInvalidArgumentNotACrash) {
  EXPECT_THAT(ParseJobSpecJson(R"({"name": "j", "bucket_numel": 1e400, "tensors": [{"name": "a", "shape": [2]}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("spec: not valid JSON")));
  EXPECT_THAT(ParseJobSpecJson(R"({"name": "j", "optimizer": {"eps": -1e608}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("number overflow")));
}

TEST(JobSpecTest, ResolveRejectsBadShapesAndDuplicatesWithFieldPaths) {
  auto resolve = [](const std::string& tensors) {
    absl::StatusOr<JobSpec> spec = ParseJobSpecJson(R"({"name": "j", "tensors": )" + tensors + "}");
    EXPECT_THAT(spec, IsOk());
    return ResolveJob(*spec).status();
  };
  EXPECT_THAT(resolve(R"([])"), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("tensors: ")));
  EXPECT_THAT(resolve(R"([{"name": "a", "shape": [3, 0]}])"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("tensors[0].shape[1]: ")));
  EXPECT_THAT(resolve(R"([{"name": "a", "shape": [-2]}])"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("tensors[0].shape[0]: ")));
  EXPECT_THAT(resolve(R"([{"name": "a", "shape": [2]}, {"name": "a", "shape": [2]}])"),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("tensors[1].name: duplicate")));
  EXPECT_THAT(resolve(R"([{"name": "a", "shape": [2097152, 1048576]}])"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2^40")));
}

TEST(JobSpecTest, ExampleSpecsLoad) {
  for (const char* file : {"gpt2_small.json", "llama3_8b.json"}) {
    const std::string path = std::string(MAINSTAY_SOURCE_DIR) + "/docs/examples/" + file;
    MAINSTAY_ASSERT_OK_AND_ASSIGN(JobSpec spec, LoadJobSpecFile(path));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(ResolvedJob job, ResolveJob(spec));
    int64_t params = 0;
    for (const TensorSpec& t : spec.tensors) params += t.numel();
    if (spec.name == "gpt2-small") {
      EXPECT_EQ(params, 124'439'808);
    } else {
      EXPECT_EQ(params, 8'030'261'248);
    }
    EXPECT_EQ(TotalDataNumel(job.layout), params);
  }
  EXPECT_THAT(LoadJobSpecFile("/nonexistent/spec.json"), StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace mainstay

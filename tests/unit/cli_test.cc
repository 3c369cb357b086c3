// mainstayctl through its RunCommand library, in-process.
#include "cli/command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/testing/status_matchers.h"

namespace mainstay::cli {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

const std::string kLlama = std::string(MAINSTAY_SOURCE_DIR) + "/docs/examples/llama3_8b.json";
const std::string kGpt2 = std::string(MAINSTAY_SOURCE_DIR) + "/docs/examples/gpt2_small.json";

absl::Status RunCtl(const std::vector<std::string>& args, std::string* out) {
  std::ostringstream stream;
  Output output{stream, false};
  absl::Status status = RunCommand(args, output);
  *out = stream.str();
  return status;
}

TEST(CliTest, LayoutPrintsBucketsTensorsAndFragments) {
  std::string out;
  ASSERT_THAT(RunCtl({"layout", "--spec", kLlama, "--dp", "8"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("job llama3-8b  recipe bf16_with_mxfp8_mixed  policy flat  D=8"));
  EXPECT_THAT(out, HasSubstr("291 tensors, 8.03G elements"));
  EXPECT_THAT(out, HasSubstr("BUCKET  FORMAT"));
  EXPECT_THAT(out, HasSubstr("model.layers.31.mlp.down_proj.weight"));
  EXPECT_THAT(out, HasSubstr("TENSOR_ELEMENTS"));
  EXPECT_THAT(out, HasSubstr("1-D tensor kept in bf16"));
}

TEST(CliTest, LayoutJsonIsTheWholeLayout) {
  std::string out;
  ASSERT_THAT(RunCtl({"layout", "--spec", kGpt2, "--dp=3", "--policy", "whole_tensor", "--json"}, &out), IsOk());
  nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j["data_parallel_size"], 3);
  EXPECT_EQ(j["policy"], "whole_tensor");
  EXPECT_EQ(j["data_numel"], 124439808);
  EXPECT_EQ(j["tensors"].size(), 148u);
  for (const auto& bucket : j["buckets"]) {
    EXPECT_EQ(bucket["shards"].size(), 3u);
    for (const auto& shard : bucket["shards"]) {
      for (const auto& f : shard["fragments"]) {
        const int t = f["tensor"];
        EXPECT_EQ(f["elements"][0], 0) << "whole_tensor never splits";
        EXPECT_EQ(f["elements"][1], j["tensors"][t]["numel"]);
      }
    }
  }
}

TEST(CliTest, BadInvocationsAreUsageErrors) {
  std::string out;
  EXPECT_THAT(RunCtl({"frobnicate"}, &out), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown command")));
  EXPECT_THAT(RunCtl({"layout"}, &out), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--spec FILE (offline) or --job ID (live) is required")));
  EXPECT_THAT(RunCtl({"layout", "--spec", kGpt2, "--dp", "two"}, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--dp: expected an integer")));
  EXPECT_THAT(RunCtl({"layout", "--spec", kGpt2, "--dp", "0"}, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data_parallel_size")));
  EXPECT_THAT(RunCtl({"layout", "--spec", kGpt2, "--policy", "striped"}, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--policy: unknown layout policy")));
  EXPECT_THAT(RunCtl({"layout", "--spec", kGpt2, "--color", "red"}, &out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown flag --color")));
  EXPECT_THAT(RunCtl({"layout", "--spec", "/no/such.json"}, &out), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(RunCtl({"layout", "--spec"}, &out), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs a value")));
}

TEST(CliTest, HelpListsCommands) {
  std::string out;
  EXPECT_THAT(RunCtl({"help"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("layout"));
  EXPECT_THAT(RunCtl({"help", "layout"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("--bucket-numel"));
  EXPECT_THAT(RunCtl({"layout", "--help"}, &out), IsOk());
}

TEST(CliTest, ExitCodesFollowStatusCodes) {
  EXPECT_EQ(ExitCode(absl::OkStatus()), 0);
  EXPECT_EQ(ExitCode(absl::InvalidArgumentError("x")), 2);
  EXPECT_EQ(ExitCode(absl::NotFoundError("x")), 3);
  EXPECT_EQ(ExitCode(absl::FailedPreconditionError("x")), 4);
  EXPECT_EQ(ExitCode(absl::UnavailableError("x")), 5);
  EXPECT_EQ(ExitCode(absl::InternalError("x")), 1);
}

}  // namespace
}  // namespace mainstay::cli

// Checkpoints through the shard daemon core (server/daemon/job_checkpoint.cc), in process:
// a job checkpointed under one data-parallel size and layout is restored into another and
// must go on exactly as the unsharded reference does (masters, moments and scaling state
// bit for bit, or the continued steps would differ), and every damaged input is refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/error_detail.h"
#include "tests/testing/daemon_cluster.h"

namespace mainstay::testing {
namespace {

using checkpoint::MemFs;

constexpr char kDir[] = "/ckpt/c1";

float Lr(int64_t step) { return 1e-3f * static_cast<float>(step + 1); }

// Runs steps [from, to) on the cluster and the reference, checking every version.
void RunSteps(Cluster& c, Reference& ref, int64_t from, int64_t to) {
  for (int64_t step = from; step < to; ++step) {
    c.PushGrads(step);
    for (const auto& stats : c.Finish(step, Lr(step))) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(step, Lr(step));
    ExpectMatchesReference(c, ref, step + 1);
  }
}

struct Case {
  std::string recipe;
  LayoutPolicy policy;  // of the job restored into
  int64_t d;            // its data-parallel size
  int daemons;          // its daemons
};

class CheckpointRestoreTest : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointRestoreTest, ARestoreIntoAnotherLayoutContinuesBitForBit) {
  const Case& p = GetParam();
  MemFs fs;
  Cluster a(MakeSpec(p.recipe, LayoutPolicy::kFlat, 2), 2, &fs);
  Reference ref(a.resolved());
  a.PushInitial(ref);
  ExpectMatchesReference(a, ref, 0);
  RunSteps(a, ref, 0, 2);
  // Step 2 by hand, keeping the reference as it stands before version 3 is quantized (the
  // restored job republishes version 3 with the scaling state it was cast with).
  a.PushGrads(2);
  for (const auto& stats : a.Finish(2, Lr(2))) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(2, Lr(2));
  Reference at_version_3 = ref;
  ExpectMatchesReference(a, ref, 3);

  absl::StatusOr<v1::CheckpointManifest> manifest = a.Checkpoint(fs, kDir, "c1", 2);
  ASSERT_THAT(manifest.status(), IsOk());
  EXPECT_EQ(manifest->version(), 3);
  EXPECT_EQ(manifest->committed_step(), 2);
  EXPECT_EQ(manifest->files_size(), static_cast<int>(a.layout().buckets.size()) * 2);
  // Training goes on after the checkpoint; it must not leak into the files.
  RunSteps(a, ref, 3, 4);

  Cluster b(MakeSpec(p.recipe, p.policy, p.d), p.daemons, &fs);
  ASSERT_THAT(b.Restore(kDir, "c1"), IsOk());
  ExpectMatchesReference(b, at_version_3, 3);
  RunSteps(b, at_version_3, 3, 5);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointRestoreTest,
    ::testing::Values(Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat, 3, 3},
                      Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 4, 2},
                      Case{"bf16_with_fp8_subchannel_scaling_mixed", LayoutPolicy::kWholeTensor, 3, 2},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, 1, 1},
                      Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2, 1}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.recipe, "_to_", LayoutPolicyName(info.param.policy), "_d", info.param.d, "_",
                          info.param.daemons, "daemons");
    });

class CheckpointProtocolTest : public ::testing::Test {
 protected:
  CheckpointProtocolTest()
      : a_(MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2), 2, &fs_), ref_(a_.resolved()) {
    a_.PushInitial(ref_);
    ExpectMatchesReference(a_, ref_, 0);
    RunSteps(a_, ref_, 0, 2);
  }
  MemFs fs_;
  Cluster a_;
  Reference ref_;
};

TEST_F(CheckpointProtocolTest, AfterARestoreTrainersAheadAreAbortedWithTheStepToResumeFrom) {
  ASSERT_THAT(a_.Checkpoint(fs_, kDir, "c1", 1).status(), IsOk());
  RunSteps(a_, ref_, 2, 4);  // the job moves on to version 4, then is rewound to version 2
  ASSERT_THAT(a_.Restore(kDir, "c1"), IsOk());
  absl::StatusOr<PullResult> latest = [&] {
    v1::PullParamsRequest req;
    req.set_job_id(kJob);
    req.set_job_token(kToken);
    req.set_placement_epoch(a_.epoch());
    req.set_latest(true);
    return a_.daemon(0).PullParams(req, absl::Now() + absl::Seconds(10));
  }();
  ASSERT_THAT(latest.status(), IsOk());
  EXPECT_EQ(latest->shard->version, 2);
  std::vector<float> zeros(static_cast<size_t>(a_.layout().buckets[0].shard_numel), 0.0f);
  absl::StatusOr<v1::PushGradResponse> ahead = a_.Push(0, 0, 4, 0, zeros, v1::PUSH_KIND_GRADIENT);
  EXPECT_THAT(ahead.status(), StatusIs(absl::StatusCode::kAborted));
  std::optional<v1::ErrorDetail> detail = GetErrorDetail(ahead.status());
  ASSERT_TRUE(detail.has_value());
  EXPECT_EQ(detail->committed_step(), 1);
  EXPECT_THAT(std::string(ahead.status().message()), ::testing::HasSubstr("resume at step 2"));
  // Initial parameters are refused too: the state comes from the checkpoint.
  EXPECT_THAT(a_.Push(0, 0, -1, 0, zeros, v1::PUSH_KIND_INITIAL_PARAMS).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // The resume step is taken and publishes version 3 again.
  a_.PushGrads(2);
  for (const auto& stats : a_.Finish(2, Lr(2))) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_EQ(stats->version(), 3);
  }
}

// Pushes of the resume step that landed before the restore replaced the job are gone with it: a
// FinishStep from the old epoch is ABORTED at once ("push again", with the step to resume
// from), instead of waiting for pushes that will never come; pushed again, the step runs.
TEST_F(CheckpointProtocolTest, AFinishStepWhosePushesARestoreDroppedIsAbortedAtOnce) {
  ASSERT_THAT(a_.Checkpoint(fs_, kDir, "c1", 1).status(), IsOk());
  a_.PushGrads(2);  // at epoch 1
  const int64_t old_epoch = a_.epoch();
  ASSERT_THAT(a_.Restore(kDir, "c1"), IsOk());
  v1::FinishStepRequest req;
  req.set_job_id(kJob);
  req.set_job_token(kToken);
  req.set_placement_epoch(old_epoch);
  req.set_step(2);
  req.set_rank(0);
  req.set_lr(Lr(2));
  const absl::Time start = absl::Now();
  absl::Status finish = a_.daemon_of(0).FinishStep(req, absl::Now() + absl::Seconds(20)).status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "FinishStep waited for pushes that the restore dropped";
  EXPECT_THAT(finish, StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("re-placed at epoch")));
  std::optional<v1::ErrorDetail> detail = GetErrorDetail(finish);
  ASSERT_TRUE(detail.has_value());
  EXPECT_EQ(detail->committed_step(), 1);
  EXPECT_EQ(detail->placement_epoch(), a_.epoch());
  a_.PushGrads(2);
  for (const auto& stats : a_.Finish(2, Lr(2))) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_EQ(stats->version(), 3);
  }
}

TEST_F(CheckpointProtocolTest, ACheckpointOfAStepAlreadyPassedIsFailedPreconditionWithTheStep) {
  absl::StatusOr<v1::CheckpointManifest> old = a_.Checkpoint(fs_, kDir, "c1", 0);
  EXPECT_THAT(old.status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  std::optional<v1::ErrorDetail> detail = GetErrorDetail(old.status());
  ASSERT_TRUE(detail.has_value());
  EXPECT_EQ(detail->committed_step(), 1);
}

TEST_F(CheckpointProtocolTest, ACheckpointOfAStepNotYetDecidedWaitsForIt) {
  absl::StatusOr<v1::WriteCheckpointResponse> written;
  std::thread writer([&] {
    v1::WriteCheckpointRequest req;
    req.set_job_id(kJob);
    req.set_placement_epoch(a_.epoch());
    req.set_checkpoint_id("c1");
    req.set_directory_uri(kDir);
    req.set_committed_step(2);
    written = a_.daemon(0).WriteCheckpoint(req, absl::Now() + absl::Seconds(20));
  });
  absl::SleepFor(absl::Milliseconds(100));
  RunSteps(a_, ref_, 2, 3);
  writer.join();
  ASSERT_THAT(written.status(), IsOk());
  EXPECT_EQ(written->committed_step(), 2);
  EXPECT_EQ(written->version(), 3);
}

TEST_F(CheckpointProtocolTest, AFullDiskFailsTheCheckpointAndLeavesNoFile) {
  fs_.FailWritesAfter(1000);
  EXPECT_THAT(a_.Checkpoint(fs_, kDir, "c1", 1).status(), StatusIs(absl::StatusCode::kResourceExhausted));
  fs_.FailWritesAfter(-1);
  EXPECT_FALSE(fs_.Exists(checkpoint::JoinPath(kDir, checkpoint::DataFileName(0, 0))));
  EXPECT_FALSE(fs_.Exists(checkpoint::JoinPath(kDir, checkpoint::kManifestName)));
}

TEST_F(CheckpointProtocolTest, ACorruptDataFileFailsTheRestoreNamingTheFileAndServesNothing) {
  ASSERT_THAT(a_.Checkpoint(fs_, kDir, "c1", 1).status(), IsOk());
  const std::string file = checkpoint::JoinPath(kDir, checkpoint::DataFileName(0, 1));
  fs_.Corrupt(file, 40);
  ASSERT_THAT(a_.Restore(kDir, "c1"), IsOk());  // the manifest is fine; the data is read by the step thread
  absl::StatusOr<PullResult> pulled = a_.Pull(0, 1, 2);
  EXPECT_THAT(pulled.status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(pulled.status().message()), ::testing::HasSubstr(file));
  EXPECT_THAT(std::string(pulled.status().message()), ::testing::HasSubstr("CRC-32C mismatch"));
}

TEST_F(CheckpointProtocolTest, ARestoreWithoutAManifestIsNotFoundAndKeepsTheJob) {
  EXPECT_THAT(a_.Restore("/ckpt/none", "none"), StatusIs(absl::StatusCode::kNotFound));
  // The job was not replaced: it serves its version 2 as before.
  v1::PullParamsRequest req;
  req.set_job_id(kJob);
  req.set_job_token(kToken);
  req.set_placement_epoch(1);
  req.set_bucket(0);
  req.set_shard(0);
  req.set_version(2);
  absl::StatusOr<PullResult> pulled = a_.daemon(0).PullParams(req, absl::Now() + absl::Seconds(5));
  ASSERT_THAT(pulled.status(), IsOk());
  EXPECT_EQ(pulled->shard->version, 2);
}

TEST_F(CheckpointProtocolTest, ARestoreIntoAJobWithOtherTensorsIsInvalidArgument) {
  ASSERT_THAT(a_.Checkpoint(fs_, kDir, "c1", 1).status(), IsOk());
  JobSpec other = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2);
  other.tensors.back().name = "renamed";
  Cluster b(other, 1, &fs_);
  absl::Status restored = b.Restore(kDir, "c1");
  EXPECT_THAT(restored, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(restored.message()), ::testing::HasSubstr("renamed"));
}

}  // namespace
}  // namespace mainstay::testing

// The shard daemon's step engine (server/daemon), in process: several ShardDaemons joined by
// the in-process peer group, trainers simulated by the test. The reference runs the same
// kernels on the unsharded model, so masters and moments must be bit-identical (no clipping:
// clipping depends on the norm, whose summation order differs between the sharded and the
// whole model) and the published bytes must equal quantizing the reference masters whole.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "kernels/kernels.h"
#include "kernels/memory.h"
#include "server/daemon/scaling_state.h"
#include "server/daemon/shard_daemon.h"
#include "server/peer/fake_peer_group.h"
#include "tests/testing/daemon_cluster.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::GradValue;
using Reference = ::mainstay::testing::ReferenceModel;
using ::mainstay::testing::Cluster;
using ::mainstay::testing::ExpectMatchesReference;
using ::mainstay::testing::kJob;
using ::mainstay::testing::kToken;
using ::mainstay::testing::MakeSpec;
using ::mainstay::testing::AssignParamGroups;
using ::mainstay::testing::ParamGroupSchedule;

struct Case {
  std::string recipe;
  LayoutPolicy policy;
  int daemons;
  // The daemons stage every kernel input and output through their state memory, as on a GPU
  // (mainstayd --device cuda:N), with the CPU kernels: the staging must change no bit.
  bool staged = false;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.recipe, "_", LayoutPolicyName(info.param.policy), "_", info.param.daemons, "d",
                      info.param.staged ? "_staged" : "");
}

// The state memory of a case's daemons: null (host memory) unless staged.
kernels::StateMemory* MemoryFor(const Case& c) {
  static kernels::StateMemory* const staged = kernels::HostStateMemory(nullptr, /*staged=*/true).release();
  return c.staged ? staged : nullptr;
}

class StepEngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(StepEngineTest, ShardedStepsEqualTheUnshardedReferenceBitForBit) {
  const Case& p = GetParam();
  const JobSpec spec = MakeSpec(p.recipe, p.policy, 2);
  Cluster cluster(spec, p.daemons, nullptr, {}, true, MemoryFor(p));
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  // Six steps: from version 5 on, versions are cast into evicted versions' buffers (4 retained).
  for (int64_t step = 0; step < 6; ++step) {
    const float lr = 1e-3f * static_cast<float>(step + 1);
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, lr)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_EQ(stats->version(), step + 1);
      EXPECT_FALSE(stats->skipped());
      EXPECT_GT(stats->grad_norm(), 0.0);
      EXPECT_EQ(stats->tensor_amax_size(), static_cast<int>(spec.tensors.size()));
    }
    ref.Step(step, lr);
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, StepEngineTest,
                         ::testing::Values(Case{"bf16_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kWholeTensor, 2},
                                           Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_subchannel_scaling_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, 1},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, 2},
                                           Case{"bf16_mixed", LayoutPolicy::kFlat, 2, true},
                                           Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2, true},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2, true},
                                           Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2, true},
                                           Case{"bf16_with_fp8_subchannel_scaling_mixed", LayoutPolicy::kFlat, 2, true},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, 2, true}),
                         CaseName);

// Clipping against the probe's bet (job_step.cc): a step after an unclipped one probes its
// amaxes before it knows the clip factor, betting on 1; a clipped step loses the bet and probes
// again, and a step after a clipped one does not bet. Whichever way a step went, its version
// equals the reference stepped with the daemon's clip factor, bit for bit, and the factor is
// max_grad_norm / norm of the reference's FP64 norm.
class ClipStepEngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(ClipStepEngineTest, StepsThatBetOnNoClippingAndStepsThatLostEqualTheReferenceBitForBit) {
  const Case& p = GetParam();
  JobSpec spec = MakeSpec(p.recipe, p.policy, 2);
  // Adam divides the clip factor out of m / sqrt(v) unless eps is of the size of sqrt(v): so
  // that a clipped step's amaxes differ from the bet's, eps dominates here and lr is large.
  spec.optimizer.eps = 0.1f;
  // Gradients x4 clip (factor about 1/2); after a clipped step a step does not bet.
  const std::vector<float> scales = {1, 4, 4, 1, 1, 4, 1, 1};
  const std::vector<bool> bets = {true, true, false, false, true, true, false, true};
  spec.optimizer.max_grad_norm = static_cast<float>(2 * Reference(*ResolveJob(spec)).GradNorm(0));
  Cluster cluster(spec, p.daemons, nullptr, {}, true, MemoryFor(p));
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  for (int64_t step = 0; step < static_cast<int64_t>(scales.size()); ++step) {
    const float lr = 5.0f, scale = scales[static_cast<size_t>(step)];
    ref.SetGradScale(scale);
    const double norm = ref.GradNorm(step);
    cluster.PushGrads(step, 0.0f, scale);
    double clip = -1.0;
    for (const auto& stats : cluster.Finish(step, lr)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_NEAR(stats->grad_norm(), norm, norm * 1e-6);
      if (clip >= 0.0) {
        EXPECT_EQ(stats->clip_factor(), clip) << "the daemons disagree on the clip factor";
      }
      clip = stats->clip_factor();
    }
    EXPECT_EQ(clip < 1.0, scale > 1.0f) << "step " << step << " (bet: " << bets[static_cast<size_t>(step)] << ")";
    EXPECT_NEAR(clip, std::min(1.0, spec.optimizer.max_grad_norm / norm), 1e-6);
    ref.Step(step, lr, 0.0f, 0, static_cast<float>(clip));
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, ClipStepEngineTest,
                         ::testing::Values(Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_subchannel_scaling_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, 2},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2, true},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, 2, true}),
                         CaseName);

// Param groups: each tensor is updated with its group's lr and weight_decay of the step, bit for
// bit as the unsharded reference (with the probe, one-loop and after-update casts alike).
class ParamGroupStepEngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(ParamGroupStepEngineTest, EachTensorStepsWithItsGroupsHyperparameters) {
  const Case& p = GetParam();
  JobSpec spec = MakeSpec(p.recipe, p.policy, 2);
  AssignParamGroups(spec);
  Cluster cluster(spec, p.daemons);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  for (int64_t step = 0; step < 3; ++step) {
    const StepHyper groups = ParamGroupSchedule(step);
    cluster.PushGrads(step);
    for (const auto& stats : cluster.FinishGroups(step, groups)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_EQ(stats->version(), step + 1);
      ASSERT_EQ(stats->groups_size(), 3);
      for (int g = 0; g < 3; ++g) {
        EXPECT_EQ(stats->groups(g).lr(), groups[static_cast<size_t>(g)].lr);
        EXPECT_EQ(stats->groups(g).weight_decay(), groups[static_cast<size_t>(g)].weight_decay);
      }
      EXPECT_EQ(stats->lr(), groups[0].lr);
    }
    ref.Step(step, groups);
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, ParamGroupStepEngineTest,
                         ::testing::Values(Case{"bf16_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, 2}),
                         CaseName);

TEST(ParamGroupProtocolTest, BadGroupHyperparametersAreInvalidArgumentWithNothingChanged) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  AssignParamGroups(spec);
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  cluster.PushGrads(0);
  auto finish_one = [&](const std::function<void(v1::FinishStepRequest&)>& fill) {
    v1::FinishStepRequest req;
    req.set_job_id(kJob);
    req.set_job_token(kToken);
    req.set_placement_epoch(1);
    req.set_step(0);
    req.set_rank(0);
    fill(req);
    return cluster.daemon_of(0).FinishStep(req, absl::Now() + absl::Seconds(1)).status();
  };
  auto add = [](v1::FinishStepRequest& r, double lr, double wd) {
    v1::GroupHyperparams* g = r.add_groups();
    g->set_lr(lr);
    g->set_weight_decay(wd);
  };
  EXPECT_THAT(finish_one([&](v1::FinishStepRequest& r) { add(r, 1e-3, 0.1); add(r, 1e-3, 0.0); }),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("has 3 param groups")));
  EXPECT_THAT(finish_one([&](v1::FinishStepRequest& r) {
                r.set_lr(1e-3);
                for (int g = 0; g < 3; ++g) add(r, 1e-3, 0.0);
              }),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("not both")));
  EXPECT_THAT(finish_one([&](v1::FinishStepRequest& r) { add(r, 1e-3, 0.1); add(r, -1.0, 0.0); add(r, 1e-3, 0.0); }),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("of param group 1")));
  // Ranks that disagree on one group's lr (each finishing on its own daemon): the peer check
  // fails the step, naming the group.
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      v1::FinishStepRequest req;
      req.set_job_id(kJob);
      req.set_job_token(kToken);
      req.set_placement_epoch(1);
      req.set_step(0);
      req.set_rank(r);
      add(req, 1e-3, 0.1);
      add(req, r == 0 ? 1e-3 : 2e-3, 0.0);
      add(req, 1e-3, 0.0);
      results[static_cast<size_t>(r)] = cluster.daemon_of(r).FinishStep(req, absl::Now() + absl::Seconds(10)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("(param group 1)")));
  }
  ExpectMatchesReference(cluster, ref, 0);  // nothing changed
  // Agreeing values run the step.
  cluster.PushGrads(0);
  for (const auto& stats : cluster.FinishGroups(0, ParamGroupSchedule(0))) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(0, ParamGroupSchedule(0));
  ExpectMatchesReference(cluster, ref, 1);
}

// SGD: no one-pass cast, so every block-scaled format casts after the update with the block
// amaxes of the probe (mxfp8 included, whose AdamW pass finds its own).
class SgdStepEngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(SgdStepEngineTest, ShardedSgdStepsEqualTheUnshardedReferenceBitForBit) {
  const Case& p = GetParam();
  JobSpec spec = MakeSpec(p.recipe, p.policy, 2);
  spec.optimizer.type = OptimizerType::kSGD;
  spec.optimizer.momentum = 0.9f;
  Cluster cluster(spec, p.daemons, nullptr, {}, true, MemoryFor(p));
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  for (int64_t step = 0; step < 3; ++step) {
    const float lr = 1e-2f * static_cast<float>(step + 1);
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, lr)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_EQ(stats->version(), step + 1);
    }
    ref.Step(step, lr);
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, SgdStepEngineTest,
                         ::testing::Values(Case{"bf16_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, 2},
                                           Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2, true}),
                         CaseName);

class StepProtocolTest : public ::testing::Test {
 protected:
  StepProtocolTest() : cluster_(MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2), 2),
                       ref_(cluster_.resolved()) {
    cluster_.PushInitial(ref_);
  }
  Cluster cluster_;
  Reference ref_;
};

TEST_F(StepProtocolTest, NonFiniteGradientOnOneRankSkipsTheStepEverywhere) {
  cluster_.PushGrads(0, std::nanf(""));
  for (const auto& stats : cluster_.Finish(0, 1e-3)) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_TRUE(stats->skipped());
    EXPECT_EQ(stats->version(), 0);
    EXPECT_EQ(stats->nonfinite_count(), 1);
  }
  // Version 1 will not exist: a pull of it says unchanged and serves version 0.
  absl::StatusOr<PullResult> pulled = cluster_.Pull(0, 1, 1);
  ASSERT_THAT(pulled.status(), IsOk());
  EXPECT_TRUE(pulled->unchanged);
  EXPECT_EQ(pulled->shard->version, 0);
  ExpectMatchesReference(cluster_, ref_, 0);  // masters untouched
  // The next step runs normally and publishes version 2.
  cluster_.PushGrads(1);
  for (const auto& stats : cluster_.Finish(1, 1e-3)) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_EQ(stats->version(), 2);
  }
}

TEST_F(StepProtocolTest, DuplicatePushIsAcknowledgedAndIgnored) {
  const Bucket& b = cluster_.layout().buckets[0];
  std::vector<float> ones(static_cast<size_t>(b.shard_numel), 1.0f);
  ASSERT_THAT(cluster_.Push(0, 0, 0, 0, ones, v1::PUSH_KIND_GRADIENT).status(), IsOk());
  std::vector<float> other(static_cast<size_t>(b.shard_numel), 7.0f);
  absl::StatusOr<v1::PushGradResponse> again = cluster_.Push(0, 0, 0, 0, other, v1::PUSH_KIND_GRADIENT);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_TRUE(again->duplicate());
}

TEST_F(StepProtocolTest, BadPushesAreRejectedWithNothingStored) {
  const Bucket& b = cluster_.layout().buckets[0];
  std::vector<float> short_values(static_cast<size_t>(b.shard_numel - 64), 1.0f);
  v1::PushGradHeader h;
  h.set_job_id(kJob);
  h.set_job_token(kToken);
  h.set_placement_epoch(1);
  h.set_bucket(0);
  h.set_shard(0);
  h.set_step(0);
  h.set_kind(v1::PUSH_KIND_GRADIENT);
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_total_bytes(b.shard_numel * 4 + 4);
  EXPECT_THAT(cluster_.daemon_of(0).BeginPush(h).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  h.set_total_bytes(b.shard_numel * 4);
  h.set_dtype(v1::ELEMENT_TYPE_E4M3);
  EXPECT_THAT(cluster_.daemon_of(0).BeginPush(h).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_bucket(99);
  EXPECT_THAT(cluster_.daemon_of(0).BeginPush(h).status(), StatusIs(absl::StatusCode::kNotFound));
  h.set_bucket(0);
  h.set_shard(1);  // owned by the other daemon
  absl::Status wrong = cluster_.daemon_of(0).BeginPush(h).status();
  EXPECT_THAT(wrong, StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_TRUE(GetErrorDetail(wrong).has_value());
  EXPECT_EQ(GetErrorDetail(wrong)->placement_epoch(), 1);
  h.set_shard(0);
  h.set_job_id("no-such-job");
  EXPECT_THAT(cluster_.daemon_of(0).BeginPush(h).status(), StatusIs(absl::StatusCode::kUnavailable));
  // A stream that ends short stores nothing: the real push afterwards is not a duplicate.
  EXPECT_THAT(cluster_.Push(0, 0, 0, 0, short_values, v1::PUSH_KIND_GRADIENT).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> full(static_cast<size_t>(b.shard_numel), 1.0f);
  absl::StatusOr<v1::PushGradResponse> ok = cluster_.Push(0, 0, 0, 0, full, v1::PUSH_KIND_GRADIENT);
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_FALSE(ok->duplicate());
  // Out-of-order chunks are refused.
  v1::PushGradHeader g = h;
  g.set_job_id(kJob);
  g.set_shard(0);
  g.set_step(1);
  absl::StatusOr<std::unique_ptr<PushSession>> session = cluster_.daemon_of(0).BeginPush(g);
  ASSERT_THAT(session.status(), IsOk());
  EXPECT_THAT((*session)->AddChunk(64, std::string(256, '\0')), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Found by bad_input_test: the daemon took chunks over shard.proto's 4 MiB.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4096;
}

TEST(PushChunkTest, HeaderOnlyStreamsHoldNoShardMemory) {
  // One bucket of 8M elements over D = 2: each rank's gradient shard is 16 MiB of FP32. 200
  // streams that sent only their header used to hold 3.2 GB between them.
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.bucket_numel = 1 << 24;
  spec.tensors = {{"w", {4096, 2048}}};
  Cluster cluster(spec, 1);
  const Bucket& b = cluster.layout().buckets[0];
  ASSERT_GE(b.shard_numel, int64_t{1} << 22);
  const int64_t before = ResidentBytes();
  std::vector<std::unique_ptr<PushSession>> open;
  for (int i = 0; i < 200; ++i) {
    v1::PushGradHeader h;
    h.set_job_id(kJob);
    h.set_job_token(kToken);
    h.set_placement_epoch(1);
    h.set_bucket(0);
    h.set_shard(i % 2);
    h.set_step(-1);
    h.set_rank(i % 2);
    h.set_kind(v1::PUSH_KIND_INITIAL_PARAMS);
    h.set_dtype(v1::ELEMENT_TYPE_FP32);
    h.set_total_bytes(b.shard_numel * 4);
    absl::StatusOr<std::unique_ptr<PushSession>> session = cluster.daemon(0).BeginPush(h);
    ASSERT_THAT(session.status(), IsOk());
    open.push_back(*std::move(session));
  }
  EXPECT_LT(ResidentBytes() - before, int64_t{64} << 20) << "header-only streams allocated their shards";
  // A stream's memory grows with what lands: one 4 MiB chunk, about 4 MiB.
  const std::string chunk(4 << 20, '\0');
  ASSERT_THAT(open[0]->AddChunk(0, chunk), IsOk());
  EXPECT_LT(ResidentBytes() - before, int64_t{64} << 20);
}

TEST(PushChunkTest, ChunkOverFourMebibytesIsRefusedWithNothingStored) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 1);
  spec.bucket_numel = 0;  // one bucket: a 5 MiB shard
  spec.tensors = {{"layers.0.mlp.fc1.weight", {1280, 1024}}};
  Cluster cluster(spec, 1);
  const Bucket& b = cluster.layout().buckets[0];
  constexpr int64_t kMaxChunkElements = (4 << 20) / 4;
  ASSERT_GT(b.shard_numel, kMaxChunkElements);
  std::vector<float> g(static_cast<size_t>(b.shard_numel), 1e-3f);
  EXPECT_THAT(cluster.Push(0, 0, 0, 0, g, v1::PUSH_KIND_GRADIENT, 1, kMaxChunkElements + 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  absl::StatusOr<v1::PushGradResponse> ok = cluster.Push(0, 0, 0, 0, g, v1::PUSH_KIND_GRADIENT, 1, kMaxChunkElements);
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_FALSE(ok->duplicate());
}

TEST_F(StepProtocolTest, AnEvictedVersionIsFailedPreconditionNamingTheNewest) {
  // The daemon keeps the newest 4 versions (ShardDaemonOptions::retained_versions).
  for (int64_t step = 0; step < 5; ++step) {
    cluster_.PushGrads(step);
    for (const auto& stats : cluster_.Finish(step, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  }
  absl::Status evicted = cluster_.Pull(0, 0, 0).status();
  EXPECT_THAT(evicted, StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("newest is 5")));
  ASSERT_TRUE(GetErrorDetail(evicted).has_value());
  EXPECT_EQ(GetErrorDetail(evicted)->version(), 5);
  EXPECT_THAT(cluster_.Pull(0, 0, 2).status(), IsOk());
}

TEST_F(StepProtocolTest, DroppingAJobReturnsAtOnceWhileItsStepWaitsForAPeer) {
  cluster_.PushGrads(0);
  // Rank 0 finishes on daemon 0 only: its step waits in the peer reduction for daemon 1
  // (until the 2 s peer timeout).
  absl::Status finish;
  std::thread waiter([&] {
    v1::FinishStepRequest req;
    req.set_job_id(kJob);
    req.set_job_token(kToken);
    req.set_placement_epoch(1);
    req.set_step(0);
    req.set_rank(0);
    req.set_lr(1e-3);
    finish = cluster_.daemon_of(0).FinishStep(req, absl::Now() + absl::Seconds(30)).status();
  });
  absl::SleepFor(absl::Milliseconds(300));
  v1::DropShardRequest drop;
  drop.set_job_id(kJob);
  drop.set_placement_epoch(2);
  const absl::Time start = absl::Now();
  EXPECT_THAT(cluster_.daemon_of(0).DropShard(drop), IsOk());
  // The step thread is stuck until the 2 s peer timeout; DropShard must not wait for it.
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500)) << "DropShard waited for the step thread";
  waiter.join();
  EXPECT_THAT(finish, StatusIs(absl::StatusCode::kUnavailable));
  cluster_.daemon_of(0).JoinDroppedJobs();
}

TEST_F(StepProtocolTest, PullOfAVersionNotPublishedInTimeIsDeadlineExceeded) {
  EXPECT_THAT(cluster_.Pull(0, 0, 1, absl::Milliseconds(200)).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(StepProtocolTest, PushForACommittedStepIsFailedPreconditionWithTheStep) {
  cluster_.PushGrads(0);
  for (const auto& stats : cluster_.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  const Bucket& b = cluster_.layout().buckets[0];
  std::vector<float> ones(static_cast<size_t>(b.shard_numel), 1.0f);
  absl::Status late = cluster_.Push(0, 0, 0, 0, ones, v1::PUSH_KIND_GRADIENT).status();
  EXPECT_THAT(late, StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_TRUE(GetErrorDetail(late).has_value());
  EXPECT_EQ(GetErrorDetail(late)->committed_step(), 0);
}

TEST_F(StepProtocolTest, LrThatDiffersBetweenRanksFailsTheStepWithNothingChanged) {
  cluster_.PushGrads(0);
  // Rank 0 finishes on daemon 0 and rank 1 on daemon 1, with different learning rates: each
  // daemon alone sees one value; the peer reduction finds the disagreement.
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      v1::FinishStepRequest req;
      req.set_job_id(kJob);
      req.set_job_token(kToken);
      req.set_placement_epoch(1);
      req.set_step(0);
      req.set_rank(r);
      req.set_lr(r == 0 ? 1e-3 : 2e-3);
      results[static_cast<size_t>(r)] = cluster_.daemon_of(r).FinishStep(req, absl::Now() + absl::Seconds(10)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("different hyperparameters")));
  }
  ExpectMatchesReference(cluster_, ref_, 0);  // nothing changed
  // The step can be pushed again and run with agreeing values.
  cluster_.PushGrads(0);
  for (const auto& stats : cluster_.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  ref_.Step(0, 1e-3f);
  ExpectMatchesReference(cluster_, ref_, 1);
}

TEST_F(StepProtocolTest, APeerThatDiesMidStepAbortsTheStepWithNothingChanged) {
  cluster_.PushGrads(0);
  // Daemon 1's rank never finishes; daemon 0 runs the step and times out in the reduction.
  v1::FinishStepRequest req;
  req.set_job_id(kJob);
  req.set_job_token(kToken);
  req.set_placement_epoch(1);
  req.set_step(0);
  req.set_rank(0);
  req.set_lr(1e-3);
  absl::Status s = cluster_.daemon_of(0).FinishStep(req, absl::Now() + absl::Seconds(30)).status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("push step 0 again")));
}

// mainstayd --inject-fault: several faults at once, the crash's phases and roles, and a clear
// error naming the accepted forms.
TEST(StepFaultsTest, ParsesListsOfFaultsAndRefusesAnythingElse) {
  absl::StatusOr<StepFaults> none = ParseStepFaults("none", "");
  ASSERT_THAT(none.status(), IsOk());
  EXPECT_FALSE(none->armed());
  const std::string once = ::testing::TempDir() + "/step_faults_test.once";
  std::remove(once.c_str());
  absl::StatusOr<StepFaults> f = ParseStepFaults("crash-at:update:5:primary,drop-replica-input:2", once);
  ASSERT_THAT(f.status(), IsOk());
  ASSERT_EQ(f->list.size(), 2u);
  EXPECT_TRUE(f->Is(StepFault::Kind::kDropReplicaInput, 2));
  EXPECT_FALSE(f->Is(StepFault::Kind::kDropReplicaInput, 3));
  // The role decides: a daemon holding only replicas does not match "primary".
  EXPECT_FALSE(f->CrashesAt(StepFault::Phase::kUpdate, 5, /*holds_primary=*/false, /*holds_replica=*/true));
  EXPECT_FALSE(f->CrashesAt(StepFault::Phase::kDecision, 5, true, false));
  EXPECT_FALSE(f->CrashesAt(StepFault::Phase::kUpdate, 4, true, false));
  // The first to create the once-file fires; everyone after it does not.
  EXPECT_TRUE(f->CrashesAt(StepFault::Phase::kUpdate, 5, true, true));
  EXPECT_FALSE(f->CrashesAt(StepFault::Phase::kUpdate, 5, true, true));
  std::remove(once.c_str());
  // copy and install fire from the committed step on; replica-only needs no primary.
  absl::StatusOr<StepFaults> g = ParseStepFaults("crash-at:install:2,crash-at:input:1:replica-only", "");
  ASSERT_THAT(g.status(), IsOk());
  EXPECT_TRUE(g->CrashesAt(StepFault::Phase::kInstall, 7, false, false));
  EXPECT_FALSE(g->CrashesAt(StepFault::Phase::kInstall, 1, false, false));
  EXPECT_TRUE(g->CrashesAt(StepFault::Phase::kInput, 1, false, true));
  EXPECT_FALSE(g->CrashesAt(StepFault::Phase::kInput, 1, true, true));
  for (const char* bad : {"crash-at:update", "crash-at:later:3", "crash-at:update:-1", "crash-at:update:3:leader",
                          "drop-replica-input:2,", "lose-reduction:3:norm", "crash-after-decision:5"}) {
    EXPECT_THAT(ParseStepFaults(bad, "").status(),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("crash-at:PHASE:STEP[:ROLE]")))
        << bad;
  }
}

// The agreed outcome of a step (docs/architecture.md): a daemon whose copy of a reduction is
// lost after the reduction completed on the others must end the step as they do.
StepFault LoseReduction(int64_t step, int reduction) {
  StepFault f;
  f.step = step;
  f.reduction = reduction;
  return f;
}

// A two-daemon cluster with `fault` on daemon 1 (and peers asked or not), past version 0 and
// step 0 (no fault fires before step 1), with its reference one step along.
struct FaultedCluster {
  explicit FaultedCluster(StepFault fault, bool ask_peers = true)
      : cluster(MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2), 2, nullptr, {{1, fault}},
                ask_peers),
        ref(cluster.resolved()) {
    cluster.PushInitial(ref);
    cluster.PushGrads(0);
    for (const auto& stats : cluster.Finish(0, 1e-3)) EXPECT_THAT(stats.status(), IsOk());
    ref.Step(0, 1e-3f);
  }
  Cluster cluster;
  Reference ref;
};

TEST(AgreedOutcomeTest, ADaemonThatLosesTheLastReductionLearnsTheCommitFromItsPeer) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 2, nullptr, {{1, LoseReduction(1, 1)}});
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  for (int64_t step = 0; step < 4; ++step) {
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, 1e-3)) {
      ASSERT_THAT(stats.status(), IsOk()) << "step " << step;  // no split, no retry by the trainers
      EXPECT_EQ(stats->version(), step + 1);
    }
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(cluster, ref, step + 1);  // the same bytes on both daemons
  }
}

TEST(AgreedOutcomeTest, ADaemonThatLosesTheStatsReductionOfASkippedStepSkipsItToo) {
  FaultedCluster f(LoseReduction(1, 0));
  Cluster& cluster = f.cluster;
  cluster.PushGrads(1, std::nanf(""));
  for (const auto& stats : cluster.Finish(1, 1e-3)) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_TRUE(stats->skipped());
    EXPECT_EQ(stats->version(), 1);
  }
  cluster.PushGrads(2);
  for (const auto& stats : cluster.Finish(2, 1e-3)) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_EQ(stats->version(), 3);
  }
  f.ref.Step(2, 1e-3f);
  ExpectMatchesReference(cluster, f.ref, 3);
}

TEST(AgreedOutcomeTest, ALostStatsReductionOfAnUpdatingStepFailsItEverywhereAndTheRetryCommits) {
  // Nobody can complete the amax reduction without daemon 1, so nobody decides step 1: both
  // daemons give it up (ABORTED), and the trainers' retry meets in the next peer group.
  FaultedCluster f(LoseReduction(1, 0));
  Cluster& cluster = f.cluster;
  cluster.PushGrads(1);
  for (const auto& stats : cluster.Finish(1, 1e-3)) {
    EXPECT_THAT(stats.status(), StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("push step 1 again")));
  }
  ExpectMatchesReference(cluster, f.ref, 1);  // nothing changed anywhere
  cluster.PushGrads(1);
  for (const auto& stats : cluster.Finish(1, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  f.ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, f.ref, 2);
}

// Rank `rank`'s FinishStep(1) at daemon `daemon` (epoch 1, lr 1e-3), waiting up to 30 s.
absl::Status FinishStep1(Cluster& cluster, int32_t rank, int daemon) {
  v1::FinishStepRequest req;
  req.set_job_id(kJob);
  req.set_job_token(kToken);
  req.set_placement_epoch(1);
  req.set_step(1);
  req.set_rank(rank);
  req.set_lr(1e-3);
  return cluster.daemon(daemon).FinishStep(req, absl::Now() + absl::Seconds(30)).status();
}

TEST(AgreedOutcomeTest, AFinishStepWhosePushAFailedAttemptDroppedIsAbortedAtOnce) {
  // Unreduced pushes (every rank pushes every shard, half of the reduced gradient each). Step 1
  // fails everywhere (the lost stats reduction) and drops its pushes; rank 1 pushes it again,
  // which clears the failure, and rank 0's FinishStep arrives without rank 0's new pushes (a
  // trainer that was still waiting elsewhere). It must not wait until its deadline for pushes
  // that will not come: ABORTED at once, and the retry commits.
  FaultedCluster f(LoseReduction(1, 0));
  Cluster& cluster = f.cluster;
  auto push_unreduced = [&](int32_t rank) {
    for (const Bucket& b : cluster.layout().buckets) {
      for (const Shard& s : b.shards) {
        auto values = cluster.ShardValues(b, s, [&](int32_t t, int64_t i) { return GradValue(t, i, 1) * 0.5f; });
        ASSERT_THAT(cluster.Push(b.index, s.rank, 1, rank, values, v1::PUSH_KIND_GRADIENT, 2).status(), IsOk());
      }
    }
  };
  auto finish = [&](int32_t rank, int daemon) { return FinishStep1(cluster, rank, daemon); };
  // Every rank finishes on every daemon (each holds pushes of both), in parallel.
  auto finish_all = [&] {
    std::vector<absl::Status> out(4);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { out[static_cast<size_t>(i)] = finish(i / 2, i % 2); });
    for (std::thread& t : threads) t.join();
    return out;
  };
  push_unreduced(0);
  push_unreduced(1);
  for (const absl::Status& s : finish_all()) {
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("push step 1 again")));
  }
  push_unreduced(1);
  const absl::Time start = absl::Now();
  EXPECT_THAT(finish(0, 0),
              StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("a failed attempt of the step dropped them")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  push_unreduced(0);
  for (const absl::Status& s : finish_all()) ASSERT_THAT(s, IsOk());
  f.ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, f.ref, 2);
}

TEST(AgreedOutcomeTest, ARankWhosePushesAnotherRankMadeIsNotTakenForOneWhoseFailedAttemptDroppedThem) {
  // Reduced pushes through the general form (PushShard): rank 0 pushes every shard, rank 1 none.
  // Step 1 fails everywhere and drops rank 0's pushes. Rank 0 starts pushing it again (which
  // starts the next attempt), and rank 1's trainer, which has nothing to push, calls FinishStep
  // again. Rank 1 lost no push, so the call waits for the step and gets its stats; the old rule
  // took shard (b, 1) for rank 1's own and answered ABORTED, again at every retry, until rank 0's
  // pushes were all in.
  FaultedCluster f(LoseReduction(1, 0));
  Cluster& cluster = f.cluster;
  std::vector<std::pair<int32_t, int32_t>> shards;  // (bucket, shard)
  for (const Bucket& b : cluster.layout().buckets) {
    for (const Shard& s : b.shards) shards.emplace_back(b.index, s.rank);
  }
  auto push_from_rank0 = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const Bucket& b = cluster.layout().buckets[static_cast<size_t>(shards[i].first)];
      const Shard& s = b.shards[static_cast<size_t>(shards[i].second)];
      auto values = cluster.ShardValues(b, s, [&](int32_t t, int64_t e) { return GradValue(t, e, 1); });
      ASSERT_THAT(cluster.Push(b.index, s.rank, 1, /*rank=*/0, values, v1::PUSH_KIND_GRADIENT, 1).status(), IsOk());
    }
  };
  auto finish = [&](int32_t rank, int daemon) { return FinishStep1(cluster, rank, daemon); };
  push_from_rank0(0, shards.size());
  {
    std::vector<absl::Status> out(2);
    std::thread a([&] { out[0] = finish(0, 0); });
    std::thread b([&] { out[1] = finish(0, 1); });
    a.join();
    b.join();
    for (const absl::Status& s : out) {
      EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("push step 1 again")));
    }
  }
  // Each daemon gets one shard of rank 0's new pushes (daemon i owns shard i of every bucket),
  // which starts the next attempt on both; the rest comes later.
  ASSERT_GE(shards.size(), 3u);
  std::set<int32_t> first;
  size_t split = 0;
  while (split < shards.size() && first.size() < 2) first.insert(cluster.Owner(shards[split++].second));
  push_from_rank0(0, split);
  std::vector<absl::Status> rank1(2);
  std::thread w0([&] { rank1[0] = finish(1, 0); });
  std::thread w1([&] { rank1[1] = finish(1, 1); });
  absl::SleepFor(absl::Milliseconds(300));
  push_from_rank0(split, shards.size());
  std::vector<absl::Status> rank0(2);
  std::thread r0a([&] { rank0[0] = finish(0, 0); });
  std::thread r0b([&] { rank0[1] = finish(0, 1); });
  for (std::thread* t : {&r0a, &r0b, &w0, &w1}) t->join();
  for (const absl::Status& s : rank0) ASSERT_THAT(s, IsOk());
  for (const absl::Status& s : rank1) {
    EXPECT_THAT(s, IsOk()) << "rank 1 lost no push: it waits for the step";
  }
  f.ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, f.ref, 2);
}

TEST(AgreedOutcomeTest, WithoutAskingPeersTheLostReductionSplitsTheStep) {
  // The behaviour the protocol removes, kept as a check that the fault really splits the step:
  // daemon 0 commits step 1, daemon 1 gives it up.
  FaultedCluster f(LoseReduction(1, 1), /*ask_peers=*/false);
  Cluster& cluster = f.cluster;
  cluster.PushGrads(1);
  std::vector<absl::StatusCode> codes;
  for (const auto& stats : cluster.Finish(1, 1e-3)) codes.push_back(stats.status().code());
  EXPECT_THAT(codes, ::testing::UnorderedElementsAre(absl::StatusCode::kOk, absl::StatusCode::kAborted));
}

TEST(AgreedOutcomeTest, GetStepOutcomeAnswersDecidedOnlyWithTheDecidingResults) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  cluster.PushGrads(0);
  std::vector<absl::StatusOr<v1::StepStats>> stats = cluster.Finish(0, 1e-3);
  ASSERT_THAT(stats[0].status(), IsOk());
  v1::GetStepOutcomeRequest request;
  request.set_job_id(kJob);
  request.set_step(0);
  for (int d = 0; d < 2; ++d) {
    const v1::GetStepOutcomeResponse answer = cluster.daemon(d).GetStepOutcome(request);
    EXPECT_EQ(answer.state(), v1::STEP_OUTCOME_STATE_DECIDED);
    EXPECT_FALSE(answer.decision().skipped());
    ASSERT_EQ(answer.decision().stats_sums_size(), 2);
    EXPECT_DOUBLE_EQ(std::sqrt(answer.decision().stats_sums(0)), stats[0]->grad_norm());
    EXPECT_EQ(answer.decision().reduced_max_size(),
              cluster.daemon(1 - d).GetStepOutcome(request).decision().reduced_max_size());
  }
  request.set_step(1);  // not pushed yet
  EXPECT_EQ(cluster.daemon(0).GetStepOutcome(request).state(), v1::STEP_OUTCOME_STATE_UNDECIDED);
  request.set_job_id("no-such-job");
  EXPECT_EQ(cluster.daemon(0).GetStepOutcome(request).state(), v1::STEP_OUTCOME_STATE_UNDECIDED);
}

TEST(JobTokenTest, AnAssignmentWithoutAJobTokenHashIsRefusedAndCreatesNoJob) {
  // A job without a token would let any client push, pull and finish its steps.
  const JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 1);
  const ResolvedJob resolved = *ResolveJob(spec);
  ShardDaemon daemon{ShardDaemonOptions{}};
  daemon.set_daemon_id("d0");
  v1::AssignShardRequest assign;
  assign.set_job_id(kJob);
  assign.set_placement_epoch(1);
  JobSpecToProto(spec, assign.mutable_spec());
  LayoutToProto(resolved.layout, assign.mutable_layout());
  assign.mutable_from_trainer();
  v1::ShardPlacement* p = assign.mutable_placement()->add_shards();
  p->mutable_shard()->set_bucket(0);
  p->set_daemon_id("d0");
  *assign.add_shards() = p->shard();
  EXPECT_THAT(daemon.AssignShard(assign).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("job_token_sha256")));
  assign.set_job_token_sha256("short");
  EXPECT_THAT(daemon.AssignShard(assign).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(daemon.active_jobs(), 0);
  // With the hash, the job exists and checks tokens.
  assign.set_job_token_sha256(::mainstay::testing::TokenSha256());
  ASSERT_THAT(daemon.AssignShard(assign).status(), IsOk());
  EXPECT_THAT(daemon.CheckJobToken(kJob, kToken), IsOk());
  EXPECT_THAT(daemon.CheckJobToken(kJob, ""), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(daemon.CheckJobToken(kJob, "test-tokeN"), StatusIs(absl::StatusCode::kPermissionDenied));
}

// Memory admission (issue 18, item 9): an assignment whose memory plan does not fit next to
// the other jobs' plans is RESOURCE_EXHAUSTED and changes nothing.
v1::AssignShardRequest AssignmentOf(const JobSpec& spec, const std::string& job_id, const std::string& daemon) {
  const ResolvedJob resolved = *ResolveJob(spec);
  v1::AssignShardRequest assign;
  assign.set_job_id(job_id);
  assign.set_placement_epoch(1);
  JobSpecToProto(spec, assign.mutable_spec());
  LayoutToProto(resolved.layout, assign.mutable_layout());
  assign.mutable_from_trainer();
  assign.set_job_token_sha256(::mainstay::testing::TokenSha256());
  for (const Bucket& b : resolved.layout.buckets) {
    for (int32_t r = 0; r < spec.data_parallel_size; ++r) {
      v1::ShardPlacement* p = assign.mutable_placement()->add_shards();
      p->mutable_shard()->set_bucket(b.index);
      p->mutable_shard()->set_shard(r);
      p->set_daemon_id(daemon);
      *assign.add_shards() = p->shard();
    }
  }
  return assign;
}

// A reader token pulls published versions and does nothing else; the daemons learn it (and its
// rotation) from AssignShard, and a rotated-out token pulls nothing more.
TEST(ReaderTokenTest, AReaderTokenPullsVersionsAndIsRefusedForEverythingElse) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  cluster.PushGrads(0);
  for (const auto& stats : cluster.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  auto pull = [&](const std::string& token, int32_t bucket, int32_t shard) {
    v1::PullParamsRequest req;
    req.set_job_id(kJob);
    req.set_job_token(token);
    req.set_placement_epoch(cluster.epoch());
    req.set_bucket(bucket);
    req.set_shard(shard);
    req.set_version(1);
    return cluster.daemon_of(shard).PullParams(req, absl::Now() + absl::Seconds(5));
  };
  // No reader token yet: a guess is refused.
  EXPECT_THAT(pull("reader-1", 0, 0), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(cluster.daemon(0).CheckJobToken(kJob, "reader-1"), StatusIs(absl::StatusCode::kPermissionDenied));
  cluster.AssignAll("reader-1");
  // It pulls every shard, the same bytes as the trainers' token.
  for (const Bucket& b : cluster.layout().buckets) {
    for (const Shard& s : b.shards) {
      absl::StatusOr<PullResult> read = pull("reader-1", b.index, s.rank);
      ASSERT_THAT(read, IsOk());
      absl::StatusOr<PullResult> trained = cluster.Pull(b.index, s.rank, 1);
      ASSERT_THAT(trained, IsOk());
      EXPECT_EQ(read->shard.get(), trained->shard.get()) << "one immutable snapshot serves both";
    }
  }
  // It opens data connections (ucx, nccl check this), but pushes, FinishStep and step stats
  // are refused, saying why.
  EXPECT_THAT(cluster.daemon(0).CheckJobToken(kJob, "reader-1"), IsOk());
  v1::PushGradHeader push;
  push.set_job_id(kJob);
  push.set_job_token("reader-1");
  push.set_placement_epoch(cluster.epoch());
  push.set_bucket(0);
  push.set_shard(0);
  push.set_step(1);
  push.set_kind(v1::PUSH_KIND_GRADIENT);
  push.set_dtype(v1::ELEMENT_TYPE_FP32);
  push.set_total_bytes(cluster.layout().buckets[0].shard_numel * 4);
  push.set_num_contributors(1);
  absl::Status pushed = cluster.daemon_of(0).BeginPush(push).status();
  EXPECT_THAT(pushed, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(std::string(pushed.message()), ::testing::HasSubstr("reader token can only pull"));
  v1::FinishStepRequest finish;
  finish.set_job_id(kJob);
  finish.set_job_token("reader-1");
  finish.set_placement_epoch(cluster.epoch());
  finish.set_step(1);
  finish.set_lr(1e-3);
  EXPECT_THAT(cluster.daemon(0).FinishStep(finish, absl::Now() + absl::Seconds(1)),
              StatusIs(absl::StatusCode::kPermissionDenied));
  v1::GetStepStatsRequest stats;
  stats.set_job_id(kJob);
  stats.set_job_token("reader-1");
  stats.set_latest(true);
  EXPECT_THAT(cluster.daemon(0).GetStepStats(stats), StatusIs(absl::StatusCode::kPermissionDenied));
  // Nothing was stored: the trainers' step 1 goes on as if the reader had never been there.
  cluster.PushGrads(1);
  for (const auto& s : cluster.Finish(1, 1e-3)) ASSERT_THAT(s.status(), IsOk());
  // A rotation: the old token is refused, the new one pulls.
  cluster.AssignAll("reader-2");
  EXPECT_THAT(pull("reader-1", 0, 0), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(pull("reader-2", 0, 0), IsOk());
}

// Pins: a pinned version outlives retained_versions until released (or expired); an unpinned
// old one is FAILED_PRECONDITION naming the newest; at most 4 versions are pinned at once.
TEST(PinVersionTest, APinnedVersionOutlivesEvictionUntilReleased) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  auto step = [&](int64_t s) {
    cluster.PushGrads(s);
    for (const auto& stats : cluster.Finish(s, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  };
  auto pin = [&](int64_t version, int64_t ttl_ms, uint64_t id = 0) {
    v1::PinVersionRequest req;
    req.set_job_id(kJob);
    req.set_job_token(kToken);
    req.set_version(version);
    req.set_ttl_ms(ttl_ms);
    req.set_pin_id(id);
    return cluster.daemon(0).PinVersion(req);
  };
  step(0);
  absl::StatusOr<v1::PinVersionResponse> one = pin(1, 60000);
  ASSERT_THAT(one, IsOk());
  EXPECT_NE(one->pin_id(), 0u);
  // Renewed with its id; a wrong version for the id, a bad ttl, a token of nobody: refused.
  EXPECT_THAT(pin(1, 60000, one->pin_id()), IsOk());
  EXPECT_THAT(pin(2, 60000, one->pin_id()), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(pin(1, 600001), StatusIs(absl::StatusCode::kInvalidArgument));
  v1::PinVersionRequest stranger;
  stranger.set_job_id(kJob);
  stranger.set_job_token("nobody");
  stranger.set_version(1);
  stranger.set_ttl_ms(1000);
  EXPECT_THAT(cluster.daemon(0).PinVersion(stranger), StatusIs(absl::StatusCode::kPermissionDenied));
  for (int64_t s = 1; s < 7; ++s) step(s);  // versions 2..7: the daemon keeps 4
  for (const Shard& sh : cluster.layout().buckets[0].shards) {
    if (cluster.Owner(sh.rank) == 0) {
      EXPECT_THAT(cluster.Pull(0, sh.rank, 1), IsOk()) << "the pinned version";
      absl::StatusOr<PullResult> gone = cluster.Pull(0, sh.rank, 2);
      EXPECT_THAT(gone, StatusIs(absl::StatusCode::kFailedPrecondition));
      EXPECT_THAT(std::string(gone.status().message()), ::testing::HasSubstr("newest is 7"));
    }
  }
  EXPECT_THAT(pin(2, 60000), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(pin(9, 60000), StatusIs(absl::StatusCode::kFailedPrecondition));  // not published yet
  // Four versions at most (1 and three of 4..7); a fifth is RESOURCE_EXHAUSTED.
  EXPECT_THAT(pin(4, 60000), IsOk());
  EXPECT_THAT(pin(5, 60000), IsOk());
  EXPECT_THAT(pin(6, 60000), IsOk());
  EXPECT_THAT(pin(7, 60000), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(pin(5, 60000), IsOk()) << "a second pin of a pinned version is no new version";
  // Released: the next commit evicts it.
  EXPECT_THAT(pin(1, 0, one->pin_id()), IsOk());
  EXPECT_THAT(pin(1, 0, one->pin_id()), IsOk()) << "releasing twice is harmless";
  step(7);
  for (const Shard& sh : cluster.layout().buckets[0].shards) {
    if (cluster.Owner(sh.rank) == 0) {
      EXPECT_THAT(cluster.Pull(0, sh.rank, 1), StatusIs(absl::StatusCode::kFailedPrecondition));
    }
  }
  // An expired pin keeps nothing: version 5's two pins expire, and it goes at the next commits.
  absl::StatusOr<v1::PinVersionResponse> brief = pin(8, 1);
  ASSERT_THAT(brief, IsOk());
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_THAT(pin(8, 1000, brief->pin_id()), StatusIs(absl::StatusCode::kNotFound));
}

TEST(MemoryAdmissionTest, AnAssignmentThatDoesNotFitBesideTheOtherJobsIsRefusedAndChangesNothing) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.unreduced_pushes = false;
  const ResolvedJob resolved = *ResolveJob(spec);
  const int64_t reduced = 2 * RankMemoryBytes(resolved.layout, PlanMemory(spec));  // both ranks on one daemon
  spec.unreduced_pushes = true;
  const int64_t unreduced = 2 * RankMemoryBytes(resolved.layout, PlanMemory(spec));
  ASSERT_GT(unreduced, reduced);  // D gradient buffers per shard and step, and their sum
  ShardDaemonOptions options;
  options.memory_bytes = reduced + unreduced - 1;
  ShardDaemon daemon(options);
  daemon.set_daemon_id("d0");
  spec.unreduced_pushes = false;
  ASSERT_THAT(daemon.AssignShard(AssignmentOf(spec, "job-a", "d0")).status(), IsOk());
  EXPECT_EQ(daemon.planned_bytes(), reduced);
  // A second job whose plan does not fit beside the first: refused, naming the numbers.
  spec.unreduced_pushes = true;
  spec.name = "b";
  const absl::Status refused = daemon.AssignShard(AssignmentOf(spec, "job-b", "d0")).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted, ::testing::HasSubstr("--memory-bytes")));
  EXPECT_THAT(refused.message(), ::testing::HasSubstr(absl::StrCat("needs ", unreduced, " bytes")));
  ASSERT_TRUE(GetErrorDetail(refused).has_value()) << "the coordinator tells this refusal by its detail";
  EXPECT_EQ(GetErrorDetail(refused)->memory_needed_bytes(), unreduced);
  EXPECT_EQ(daemon.active_jobs(), 1);
  EXPECT_EQ(daemon.planned_bytes(), reduced);
  // Once the first job is gone the second fits, and a new epoch of it is not counted twice.
  v1::DropShardRequest drop;
  drop.set_job_id("job-a");
  drop.set_placement_epoch(2);
  ASSERT_THAT(daemon.DropShard(drop), IsOk());
  v1::AssignShardRequest b = AssignmentOf(spec, "job-b", "d0");
  ASSERT_THAT(daemon.AssignShard(b).status(), IsOk());
  b.set_placement_epoch(2);
  b.mutable_placement()->set_epoch(2);
  ASSERT_THAT(daemon.AssignShard(b).status(), IsOk());
  EXPECT_EQ(daemon.planned_bytes(), unreduced);
  daemon.Shutdown();
}

TEST(PushContributorsTest, UnreducedPushesNeedTheSpecToDeclareThem) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.unreduced_pushes = false;
  Cluster cluster(spec, 1);
  const Bucket& b = cluster.layout().buckets[0];
  v1::PushGradHeader h;
  h.set_job_id(kJob);
  h.set_job_token(kToken);
  h.set_placement_epoch(1);
  h.set_bucket(0);
  h.set_shard(0);
  h.set_step(0);
  h.set_kind(v1::PUSH_KIND_GRADIENT);
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_total_bytes(b.shard_numel * 4);
  h.set_num_contributors(2);
  EXPECT_THAT(cluster.daemon_of(0).BeginPush(h).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("\"unreduced_pushes\": true")));
  h.set_num_contributors(1);
  EXPECT_THAT(cluster.daemon_of(0).BeginPush(h).status(), IsOk());
}

// Moves (docs/daemon.md, "Moves"): a rank's shards go to another daemon between steps, state
// and all, and the job goes on bit for bit.
class MoveRecipeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(MoveRecipeTest, AMovedRankGoesOnBitForBitOnItsNewDaemon) {
  // D = 2 on three daemons: ranks on d0 and d1, d2 empty; tensors straddle the ranks.
  const JobSpec spec = MakeSpec(GetParam(), LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 3);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);  // (each version is compared once: delayed scaling)
  for (int64_t step = 0; step < 5; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    if (step == 2) {
      std::vector<std::shared_ptr<const QuantizedShard>> before;
      for (const Bucket& b : cluster.layout().buckets) before.push_back(cluster.Pull(b.index, 1, 2)->shard);
      ASSERT_THAT(cluster.Move(1, 2), IsOk());  // d1's rank to d2, which copies it from d1
      EXPECT_EQ(cluster.daemon(1).active_jobs(), 0) << "d1 dropped the job once d2 had loaded it";
      for (const Bucket& b : cluster.layout().buckets) {  // d2 serves version 2 as d1 did
        absl::StatusOr<PullResult> after = cluster.Pull(b.index, 1, 2);
        ASSERT_THAT(after.status(), IsOk());
        const QuantizedShard& was = *before[static_cast<size_t>(b.index)];
        EXPECT_EQ(after->shard->version, 2);
        EXPECT_EQ(after->shard->data, was.data);
        EXPECT_EQ(after->shard->scales, was.scales);
        ASSERT_EQ(after->shard->fragments.size(), was.fragments.size());
        for (size_t f = 0; f < was.fragments.size(); ++f) {
          EXPECT_EQ(after->shard->fragments[f].scale, was.fragments[f].scale);
          EXPECT_EQ(after->shard->fragments[f].scale_inv, was.fragments[f].scale_inv);
          EXPECT_EQ(after->shard->fragments[f].amax, was.fragments[f].amax);
        }
      }
    }
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, 1e-3)) {
      ASSERT_THAT(stats.status(), IsOk()) << "step " << step;
      EXPECT_EQ(stats->version(), step + 1);
    }
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoveRecipeTest,
                         ::testing::Values("bf16_with_fp8_mixed", "bf16_with_fp8_current_scaling_mixed",
                                           "bf16_with_nvfp4_mixed"));

// Found by assign_shard_fuzzer's author: a move re-sent at a newer epoch while its shards still
// waited for their copy queued no copy for them, so the target reported itself loaded with the
// shards still empty, and the source was told to drop them.
TEST(MoveTest, AMoveReSentAfterAFailedCopyCopiesTheShardsAndTheJobGoesOnBitForBit) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 3);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  for (int64_t step = 0; step < 3; ++step) {
    if (step == 1) {
      ASSERT_THAT(cluster.MoveWithResend(1, 2), IsOk());
    }
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, 1e-3)) ASSERT_THAT(stats.status(), IsOk()) << "step " << step;
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

TEST(MoveTest, TheSourceRefusesCallsOfTheOldEpochOnceFencedAndTheTargetServesTheNewOne) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 3);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);  // version 0 is published everywhere
  // Fence d1 by hand, as the target's copy at epoch 2 does.
  v1::FetchShardStateRequest fetch;
  fetch.set_job_id(kJob);
  fetch.set_placement_epoch(2);
  fetch.mutable_shard()->set_shard(1);
  absl::StatusOr<ShardStateCopy> copy = cluster.daemon(1).CopyShardForMove(fetch, absl::Now() + absl::Seconds(10));
  ASSERT_THAT(copy.status(), IsOk());
  EXPECT_EQ(copy->version, 0);
  ASSERT_NE(copy->newest, nullptr);
  EXPECT_EQ(copy->newest->version, 0);
  // A push of epoch 1 to d1 is now FAILED_PRECONDITION naming epoch 2: the trainer re-reads the
  // placement instead of feeding a step that can no longer run there.
  const Bucket& b = cluster.layout().buckets[0];
  absl::Status refused =
      cluster.Push(0, 1, 0, 1, std::vector<float>(static_cast<size_t>(b.shard_numel), 0.5f), v1::PUSH_KIND_GRADIENT)
          .status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("moving to placement epoch 2")));
  ASSERT_TRUE(GetErrorDetail(refused).has_value());
  EXPECT_EQ(GetErrorDetail(refused)->placement_epoch(), 2);
}

TEST(MoveTest, PushesStoredOnTheSourceGoWithTheMoveAndTheStepGoesOnAtTheTarget) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 3);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  cluster.PushGrads(0);
  for (const auto& stats : cluster.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(0, 1e-3f);
  // Step 1's pushes land on d0 and d1; then d1's rank moves to d2 before anyone finishes step 1.
  cluster.PushGrads(1);
  ASSERT_THAT(cluster.Move(1, 2), IsOk());
  // Rank 1 finishes step 1 at d2 without pushing again: d2 holds the pushes d1 had stored.
  for (const auto& stats : cluster.Finish(1, 1e-3, /*redirected=*/true)) {
    ASSERT_THAT(stats.status(), IsOk());
    EXPECT_EQ(stats->version(), 2);
  }
  ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, ref, 2);
  // A redirected FinishStep where none of the rank's pushes are (they were lost with a daemon)
  // is ABORTED at once, instead of waiting for pushes that will never come.
  auto lost = cluster.Finish(2, 1e-3, /*redirected=*/true);
  EXPECT_THAT(lost[1].status(), StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("lacks pushes of rank 1")));
}

}  // namespace
}  // namespace mainstay::daemon

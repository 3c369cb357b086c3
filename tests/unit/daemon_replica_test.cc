// Replicas in the step engine (docs/architecture.md, "Replicas"), in process: with
// replication_factor R > 1 every shard's replicas apply the same steps as its primary from the
// inputs it forwards, so their masters and moments stay bit-identical to it and to the unsharded
// reference; and when a daemon is lost, its replicas take over its shards at the next epoch and
// the job goes on from the last committed step, with nothing rewound.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "kernels/memory.h"
#include "server/checkpoint/checkpoint_fs.h"
#include "tests/testing/daemon_cluster.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::Cluster;
using ::mainstay::testing::ExpectMatchesReference;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::kJob;
using ::mainstay::testing::MakeSpec;
using ::mainstay::testing::AssignParamGroups;
using ::mainstay::testing::ParamGroupSchedule;
using ::mainstay::testing::StatusIs;
using Reference = ::mainstay::testing::ReferenceModel;

// Daemon `d`'s copy of (bucket, shard) once it has reached `step` and `version`: a replica
// commits a step a little after the primary's FinishStep returns (both hold the decision by
// then; each commits on its own step thread). The last read after 10 s otherwise.
absl::StatusOr<ShardStateCopy> StateAt(Cluster& c, int d, int32_t bucket, int32_t shard, int64_t step,
                                       int64_t version) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    absl::StatusOr<ShardStateCopy> state = c.daemon(d).ReadShardState(kJob, bucket, shard);
    if (!state.ok() || (state->committed_step >= step && state->version >= version) || absl::Now() > deadline) {
      return state;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

// Whether every replica's state of every shard equals its primary's, byte for byte.
bool ReplicasEqualPrimaries(Cluster& c) {
  for (const Bucket& b : c.layout().buckets) {
    for (const Shard& s : b.shards) {
      absl::StatusOr<ShardStateCopy> primary = c.daemon(c.Owner(s.rank)).ReadShardState(kJob, b.index, s.rank);
      if (!primary.ok()) return false;
      for (int r : c.Replicas(s.rank)) {
        absl::StatusOr<ShardStateCopy> replica = StateAt(c, r, b.index, s.rank, primary->committed_step, primary->version);
        if (!replica.ok() || replica->master != primary->master || replica->m != primary->m ||
            replica->v != primary->v) {
          return false;
        }
      }
    }
  }
  return true;
}

// Every replica's state of every shard equals its primary's, byte for byte.
void ExpectReplicasEqualPrimaries(Cluster& c) {
  for (const Bucket& b : c.layout().buckets) {
    for (const Shard& s : b.shards) {
      absl::StatusOr<ShardStateCopy> primary = c.daemon(c.Owner(s.rank)).ReadShardState(kJob, b.index, s.rank);
      ASSERT_THAT(primary.status(), IsOk());
      for (int r : c.Replicas(s.rank)) {
        absl::StatusOr<ShardStateCopy> replica = StateAt(c, r, b.index, s.rank, primary->committed_step, primary->version);
        ASSERT_THAT(replica.status(), IsOk()) << "replica on d" << r;
        EXPECT_EQ(replica->committed_step, primary->committed_step);
        ASSERT_EQ(replica->master.size(), primary->master.size());
        EXPECT_EQ(0, std::memcmp(replica->master.data(), primary->master.data(), primary->master.size() * 4))
            << "master of (bucket " << b.index << ", shard " << s.rank << ") on d" << r;
        EXPECT_EQ(replica->m, primary->m) << "m on d" << r;
        EXPECT_EQ(replica->v, primary->v) << "v on d" << r;
      }
    }
  }
}

// Steps *step .. *step + n - 1: pushed, finished (every call OK), then the reference's step
// and the published versions checked against it.
void RunSteps(Cluster& c, Reference& ref, int64_t* step, int64_t n) {
  for (const int64_t end = *step + n; *step < end; ++*step) {
    SCOPED_TRACE(absl::StrCat("step ", *step));
    c.PushGrads(*step);
    for (const auto& stats : c.Finish(*step, 1e-3f)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(*step, 1e-3f);
    ExpectMatchesReference(c, ref, *step + 1);
  }
}

// `finished`: an attempt of `step` that ran beside a placement change. If it failed, the step
// is pushed and finished again, as trainers do. Returns whether the first attempt committed.
bool FinishAgainIfFailed(Cluster& c, int64_t step, std::vector<absl::StatusOr<v1::StepStats>>& finished) {
  if (std::all_of(finished.begin(), finished.end(), [](const auto& s) { return s.ok(); })) return true;
  c.PushGrads(step);
  finished = c.Finish(step, 1e-3f);
  return false;
}

struct Case {
  std::string recipe;
  int d;        // trainer ranks
  int daemons;
  int replication;
  bool staged = false;  // state memory staged as on a GPU (kernels/memory.h), CPU kernels
};

class ReplicaTest : public ::testing::TestWithParam<Case> {};

TEST_P(ReplicaTest, ReplicasStayBitIdenticalToTheirPrimariesAndTheReference) {
  const Case& p = GetParam();
  JobSpec spec = MakeSpec(p.recipe, LayoutPolicy::kFlat, p.d);
  spec.replication_factor = p.replication;
  AssignParamGroups(spec);  // the replicas get every group's hyperparameters from their primary
  const std::unique_ptr<kernels::StateMemory> staged = kernels::HostStateMemory(nullptr, /*staged=*/true);
  Cluster cluster(spec, p.daemons, nullptr, {}, true, p.staged ? staged.get() : nullptr);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  ExpectReplicasEqualPrimaries(cluster);
  for (int64_t step = 0; step < 3; ++step) {
    const StepHyper groups = ParamGroupSchedule(step);
    cluster.PushGrads(step);
    for (const auto& stats : cluster.FinishGroups(step, groups)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_EQ(stats->version(), step + 1);
      EXPECT_DOUBLE_EQ(stats->lr(), groups[0].lr);
      EXPECT_EQ(stats->groups_size(), 3);
    }
    ref.Step(step, groups);
    ExpectMatchesReference(cluster, ref, step + 1);
    ExpectReplicasEqualPrimaries(cluster);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, ReplicaTest,
                         ::testing::Values(Case{"bf16_with_fp8_mixed", 2, 2, 2},  // each daemon a primary and a replica
                                           Case{"bf16_with_fp8_current_scaling_mixed", 3, 3, 2},
                                           Case{"bf16_with_nvfp4_mixed", 2, 3, 3},  // a daemon holding replicas only
                                           Case{"bf16_with_mxfp8_mixed", 3, 3, 3},
                                           Case{"bf16_with_fp8_mixed", 3, 4, 2},  // primaries, replicas and both
                                           Case{"bf16_with_nvfp4_mixed", 2, 3, 3, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat(info.param.recipe, "_d", info.param.d, "_", info.param.daemons,
                                               "daemons_r", info.param.replication, info.param.staged ? "_staged" : "");
                         });

TEST(ReplicaTest, TrainersCannotPushToOrPullFromAReplica) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  // Rank 0's primary is d0, its replica d1.
  v1::PullParamsRequest pull;
  pull.set_job_id(kJob);
  pull.set_job_token(::mainstay::testing::kToken);
  pull.set_placement_epoch(cluster.epoch());
  pull.set_bucket(0);
  pull.set_shard(0);
  pull.set_version(0);
  absl::StatusOr<PullResult> pulled = cluster.daemon(1).PullParams(pull, absl::Now() + absl::Seconds(5));
  EXPECT_THAT(pulled.status(), StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("replica")));
}

TEST(ReplicaTest, AForwardForAShardThatIsNotAReplicaHereIsRefusedWithNothingStored) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 2);
  v1::ReplicaInputHeader h;
  h.set_job_id(kJob);
  h.set_placement_epoch(cluster.epoch());
  h.set_bucket(0);
  h.set_shard(0);  // primary on d0: d0 holds no replica of it
  h.set_step(-1);
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_total_bytes(cluster.layout().buckets[0].shard_numel * 4);
  h.set_loss_scale(1.0);
  EXPECT_THAT(cluster.daemon(0).CheckReplicaInput(h).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  h.set_shard(1);  // d0 holds its replica
  h.set_total_bytes(8);
  EXPECT_THAT(cluster.daemon(0).CheckReplicaInput(h).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  h.set_total_bytes(cluster.layout().buckets[0].shard_numel * 4);
  h.set_placement_epoch(cluster.epoch() + 1);
  EXPECT_THAT(cluster.daemon(0).CheckReplicaInput(h).status(), StatusIs(absl::StatusCode::kUnavailable));
  h.set_placement_epoch(cluster.epoch());
  std::vector<uint8_t> payload(static_cast<size_t>(h.total_bytes()), 0);
  h.set_crc32c(12345);
  EXPECT_THAT(cluster.daemon(0).StoreReplicaInput(h, payload).status(), StatusIs(absl::StatusCode::kDataLoss));
}

// The trainers' copies of their pushes (ClientOptions::replica_copies): a replica that holds the
// copy is sent the step's header only, and applies the same bits. A copy that does not match
// the primary's input (another payload under its own valid CRC), or none, is not taken: the
// primary sends the payload, and nothing changes either. A push that says no copies were sent
// is forwarded whole without asking.
TEST(ReplicaTest, TrainerCopiesReplaceTheForwardedPayloadAndChangeNoBit) {
  JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 3);
  spec.replication_factor = 2;
  Cluster cluster(spec, 3);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  int64_t shard_bytes = 0;
  for (const Bucket& b : cluster.layout().buckets) shard_bytes += b.shard_numel * 4;
  // step 0: no copies; 1: copies; 2: copies, rank 0's of another payload; 3: copies the pushes
  // do not mention; 4: pushes that mention copies never sent.
  for (int64_t step = 0; step < 5; ++step) {
    if (step >= 1 && step <= 3) cluster.PushCopies(step);
    if (step == 2) {
      // Rank 0's copies carry another gradient (as a stale or foreign payload would).
      for (const Bucket& b : cluster.layout().buckets) {
        std::vector<float> other = cluster.GradShard(b, b.shards[0], step + 7);
        for (int d : cluster.Replicas(0)) ASSERT_THAT(cluster.PushCopy(d, b.index, 0, step, other).status(), IsOk());
      }
    }
    cluster.PushGrads(step, 0.0f, 1.0f, /*copies_sent=*/step != 0 && step != 3);
    std::vector<absl::StatusOr<v1::StepStats>> stats = cluster.Finish(step, 1e-3);
    for (size_t rank = 0; rank < stats.size(); ++rank) {
      ASSERT_THAT(stats[rank].status(), IsOk());
      // Each rank's answer comes from its primary, which forwards that rank's shards only.
      const int64_t expected = step == 1 || (step == 2 && rank != 0) ? 0 : shard_bytes;
      EXPECT_EQ(stats[rank]->forwarded_bytes(), expected) << "step " << step << ", rank " << rank;
    }
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(cluster, ref, step + 1);
    ExpectReplicasEqualPrimaries(cluster);
  }
}

TEST(ReplicaTest, ABadTrainerCopyIsRefusedWithNothingStored) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  const Bucket& b = cluster.layout().buckets[0];
  std::vector<float> grad = cluster.GradShard(b, b.shards[0], 0);
  // Rank 0's primary is d0, its replica d1.
  EXPECT_THAT(cluster.PushCopy(0, 0, 0, 0, grad).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("holds no replica")));
  EXPECT_THAT(cluster.PushCopy(1, 0, 0, 0, grad, 0u).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("crc32c")));
  EXPECT_THAT(cluster.PushCopy(1, 0, 0, 0, std::vector<float>(grad.begin(), grad.end() - 1)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("total_bytes")));
  EXPECT_THAT(cluster.PushCopy(1, 0, 0, 5, grad).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("ahead")));
  // A torn payload: its CRC is the intact one's.
  std::vector<float> torn = grad;
  torn[torn.size() / 2] += 1.0f;
  EXPECT_THAT(cluster.PushCopy(1, 0, 0, 0, torn, Crc32c(grad.data(), grad.size() * 4)).status(),
              StatusIs(absl::StatusCode::kDataLoss));
  // Nothing was kept: d0 forwards rank 0's payload to d1, and the step is exact.
  cluster.PushGrads(0, 0.0f, 1.0f, /*copies_sent=*/true);
  std::vector<absl::StatusOr<v1::StepStats>> stats = cluster.Finish(0, 1e-3);
  ASSERT_THAT(stats[0].status(), IsOk());
  EXPECT_GT(stats[0]->forwarded_bytes(), 0);
  ref.Step(0, 1e-3f);
  ExpectMatchesReference(cluster, ref, 1);
  ExpectReplicasEqualPrimaries(cluster);
}

// A push that reaches a daemon while an attempt of its step runs there without it (begun at the
// placement before a failover made this daemon the shard's primary) is UNAVAILABLE, which the
// trainer retries, not INVALID_ARGUMENT: once that attempt ended, the step completes exactly.
// (The fault matrix found it: a trainer's loop got the INVALID_ARGUMENT after a failover.)
TEST(FailoverTest, APushForAStepRunningWithoutItIsRetriedNotRefused) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 2);  // rank 0: primary d0, replica d1; rank 1: primary d1, replica d0
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  cluster.PushGrads(0);
  for (const auto& stats : cluster.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(0, 1e-3f);
  // Step 1 begins on d0 with rank 0's pushes and stops in its forward to d1.
  cluster.peer_client().HoldForwards(true);
  for (const Bucket& b : cluster.layout().buckets) {
    ASSERT_THAT(cluster.Push(b.index, 0, 1, 0, cluster.GradShard(b, b.shards[0], 1), v1::PUSH_KIND_GRADIENT).status(),
                IsOk());
  }
  absl::StatusOr<v1::StepStats> first = absl::UnknownError("not run");
  std::thread finish([&] {
    v1::FinishStepRequest req;
    req.set_job_id(kJob);
    req.set_job_token(::mainstay::testing::kToken);
    req.set_step(1);
    req.set_rank(0);
    req.set_lr(1e-3);
    req.set_placement_epoch(cluster.epoch());
    first = cluster.daemon(0).FinishStep(req, absl::Now() + absl::Seconds(30));
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (cluster.peer_client().forwards_held() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_GT(cluster.peer_client().forwards_held(), 0);
  // d1 is lost: d0 becomes rank 1's primary at epoch 2, its attempt of step 1 still running.
  ASSERT_THAT(cluster.Failover(1), IsOk());
  const Bucket& b0 = cluster.layout().buckets[0];
  EXPECT_THAT(cluster.Push(b0.index, 1, 1, 1, cluster.GradShard(b0, b0.shards[1], 1), v1::PUSH_KIND_GRADIENT).status(),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("runs here without")));
  cluster.peer_client().HoldForwards(false);
  finish.join();
  EXPECT_THAT(first.status(), StatusIs(absl::StatusCode::kAborted));
  cluster.PushGrads(1);  // both ranks, at epoch 2, as the trainers' retries do
  for (const auto& stats : cluster.Finish(1, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, ref, 2);
}

TEST(FailoverTest, ALostDaemonsReplicasTakeOverAndTheJobGoesOnWithNothingRewound) {
  JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 3);
  spec.replication_factor = 2;
  Cluster cluster(spec, 3);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  for (int64_t step = 0; step < 2; ++step) {
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(step, 1e-3f);
  }
  // Daemon 0 is lost between steps: rank 0's primary moves to its replica on d1.
  ASSERT_THAT(cluster.Failover(0), IsOk());
  EXPECT_EQ(cluster.Owner(0), 1);
  ExpectMatchesReference(cluster, ref, 2);  // version 2 is served by the new primary as it was
  for (int64_t step = 2; step < 5; ++step) {
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, 1e-3)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_EQ(stats->version(), step + 1);
    }
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(cluster, ref, step + 1);
    ExpectReplicasEqualPrimaries(cluster);
  }
}

// A replicated job's checkpoint is written by the primaries (a daemon holding replicas only
// writes none), and restores into a replicated job whose replicas load it too and stay equal.
TEST(ReplicaTest, ACheckpointOfAReplicatedJobRestoresIntoReplicasThatStayEqual) {
  checkpoint::MemFs fs;
  JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 3;
  Cluster a(spec, 3, &fs);  // d2 holds replicas only
  Reference ref(a.resolved());
  a.PushInitial(ref);
  for (int64_t step = 0; step < 2; ++step) {
    a.PushGrads(step);
    for (const auto& stats : a.Finish(step, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(step, 1e-3f);
  }
  absl::StatusOr<v1::CheckpointManifest> manifest = a.Checkpoint(fs, "/ckpt", "c1", 1);
  ASSERT_THAT(manifest.status(), IsOk());
  EXPECT_EQ(manifest->files_size(), static_cast<int>(a.layout().buckets.size()) * 2) << "one copy of each shard";
  Cluster b(spec, 3, &fs);
  ASSERT_THAT(b.Restore("/ckpt", "c1"), IsOk());
  ExpectMatchesReference(b, ref, 2);
  ExpectReplicasEqualPrimaries(b);
  for (int64_t step = 2; step < 4; ++step) {
    b.PushGrads(step);
    for (const auto& stats : b.Finish(step, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(b, ref, step + 1);
    ExpectReplicasEqualPrimaries(b);
  }
}

// After a failover the ranks short of copies get a new replica, copied from their primary at a
// step boundary; it then applies the same steps, and a second loss (its primary's daemon) is
// survived too, with nothing rewound.
TEST(FailoverTest, ANewReplicaCopiedFromItsPrimaryKeepsUpAndSurvivesTheNextLoss) {
  JobSpec spec = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 3);
  spec.replication_factor = 2;
  Cluster cluster(spec, 4);  // d3 holds rank 2's replica at first, and takes rank 0's
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);  // (the reference's delayed scaling counts this cast)
  int64_t step = 0;
  auto run = [&](int64_t steps) {
    for (int64_t end = step + steps; step < end; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      cluster.PushGrads(step);
      const float lr = 1e-3f * static_cast<float>(step + 1);
      for (const auto& stats : cluster.Finish(step, lr)) ASSERT_THAT(stats.status(), IsOk());
      ref.Step(step, lr);
      ExpectMatchesReference(cluster, ref, step + 1);
    }
  };
  run(2);
  ASSERT_THAT(cluster.Failover(0), IsOk());  // rank 0 now only on d1
  ASSERT_EQ(cluster.Replicas(0).size(), 0u);
  run(1);
  ASSERT_THAT(cluster.AddReplica(0, 3), IsOk());
  EXPECT_TRUE(ReplicasEqualPrimaries(cluster)) << "the copy is the primary's committed state";
  run(2);
  ExpectReplicasEqualPrimaries(cluster);
  ASSERT_THAT(cluster.Failover(1), IsOk());  // rank 0's primary again: d3 takes over
  EXPECT_EQ(cluster.Owner(0), 3);
  run(2);  // (delayed scaling: the copy carried the amax histories, or these casts would differ)
}

// Re-replication keeps its source in the new placement, so the source is not fenced. A copy it
// is asked for while a step of the older placement runs there waits for that step, which
// commits without the new replica: a copy taken under it would leave the new replica one step
// behind for good, and every later step would wait for it.
TEST(FailoverTest, ANewReplicaIsCopiedOnlyAfterTheOlderPlacementsStepInFlight) {
  JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  spec.tensors = {{"layers.0.mlp.fc1.weight", {2048, 2048}}};
  spec.bucket_numel = 1 << 23;
  spec.replication_factor = 2;
  Cluster cluster(spec, 4);  // rank 0: d0 (+ d1), rank 1: d1 (+ d2); d3 holds nothing
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  cluster.PushGrads(0);
  for (const auto& stats : cluster.Finish(0, 1e-3f)) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(0, 1e-3f);
  // Step 1 runs at the first placement, past its forwards and the replicas' taking of their
  // inputs, and stops in its MAX (the amaxes) on the three daemons of its group.
  cluster.peers().HoldReductions(true, /*max_only=*/true);
  cluster.PushGrads(1);
  std::vector<absl::StatusOr<v1::StepStats>> finished;
  std::thread trainers([&] { finished = cluster.Finish(1, 1e-3f); });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (cluster.peers().reductions_held() < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_EQ(cluster.peers().reductions_held(), 3);
  // The new placement reaches the daemons meanwhile, and d3 asks d0 for rank 0's state: a copy
  // taken now would be of step 0, while step 1 goes on to commit without d3.
  absl::Status added = absl::UnknownError("not run");
  std::thread add([&] { added = cluster.AddReplica(0, 3); });
  absl::SleepFor(absl::Milliseconds(300));
  cluster.peers().HoldReductions(false);
  trainers.join();
  add.join();
  ASSERT_THAT(added, IsOk());
  // Step 1 was under way everywhere before the new placement came: it commits at the first one.
  for (const auto& stats : finished) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(1, 1e-3f);
  ExpectReplicasEqualPrimaries(cluster);
  int64_t step = 2;
  RunSteps(cluster, ref, &step, 2);
  ExpectReplicasEqualPrimaries(cluster);
}

// A move's source streams views of its shard's own state, not a copy. Should the move be called
// off while the copy streams (the same placement again at a newer epoch: the source serves the
// shard again), the source's next step updates that state only once the stream let go of it:
// the copy stays the state of one committed step, and the step then completes as without it.
TEST(FailoverTest, AStepWaitsToUpdateTheStateACopyIsStreamingFrom) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 2);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  cluster.PushGrads(0);
  for (const auto& stats : cluster.Finish(0, 1e-3f)) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(0, 1e-3f);
  v1::FetchShardStateRequest request;  // a move's target asking: d0 is fenced
  request.set_job_id(kJob);
  request.set_placement_epoch(cluster.epoch() + 1);
  request.mutable_shard()->set_bucket(0);
  request.mutable_shard()->set_shard(0);
  absl::StatusOr<ShardStateCopy> copy = cluster.daemon(0).CopyShardForMove(request, absl::Now() + absl::Seconds(10));
  ASSERT_THAT(copy.status(), IsOk());
  ASSERT_GT(copy->master.size(), 0u);
  const std::vector<float> master(copy->master.begin(), copy->master.end());
  const std::vector<uint8_t> m(copy->m.begin(), copy->m.end());
  ASSERT_THAT(cluster.Resend(), IsOk());  // the move called off
  cluster.PushGrads(1);
  std::atomic<bool> done = false;
  std::vector<absl::StatusOr<v1::StepStats>> finished;
  std::thread trainers([&] {
    finished = cluster.Finish(1, 1e-3f);
    done = true;
  });
  // d1 commits step 1 (d0 is past the decision too); d0 then waits for the copy.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    absl::StatusOr<ShardStateCopy> d1 = cluster.daemon(1).ReadShardState(kJob, 0, 1);
    if (d1.ok() && d1->committed_step == 1) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(done) << "step 1 was acknowledged while the copy still streams its state";
  EXPECT_EQ(std::vector<float>(copy->master.begin(), copy->master.end()), master)
      << "the copy changed under the stream";
  EXPECT_EQ(std::vector<uint8_t>(copy->m.begin(), copy->m.end()), m);
  copy = absl::CancelledError("the stream ended");  // lets go of the state
  trainers.join();
  for (const auto& stats : finished) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, ref, 2);
}

// A replica-only daemon loses step 1's last reduction and learns the decision from a peer, so
// the barrier after it fails and the primaries ask their peers whether they hold it. A new
// replica added meanwhile took no part in step 1 and must not be waited for. (Timing-based:
// the re-replication lands at three points of the step; the review's reproduction of the wait
// for ever came from such a loop.)
TEST(FailoverTest, TheDecisionCheckAsksTheStepsMembersNotANewReplica) {
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
    spec.replication_factor = 2;
    daemon::StepFault lose;
    lose.kind = daemon::StepFault::Kind::kLoseReduction;
    lose.step = 1;
    lose.reduction = 1;
    Cluster cluster(spec, 4, nullptr, {{2, lose}});  // d2 holds only rank 1's replica
    Reference ref(cluster.resolved());
    cluster.PushInitial(ref);
    cluster.PushGrads(0);
    for (const auto& stats : cluster.Finish(0, 1e-3f)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(0, 1e-3f);
    cluster.PushGrads(1);
    std::vector<absl::StatusOr<v1::StepStats>> finished;
    std::thread trainers([&] { finished = cluster.Finish(1, 1e-3f); });
    absl::SleepFor(absl::Milliseconds(5 + 20 * trial));
    const absl::Status added = cluster.AddReplica(0, 3);
    trainers.join();
    ASSERT_THAT(added, IsOk());
    FinishAgainIfFailed(cluster, 1, finished);
    for (const auto& stats : finished) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(1, 1e-3f);
    int64_t step = 2;
    RunSteps(cluster, ref, &step, 1);
    ExpectReplicasEqualPrimaries(cluster);
  }
}

// A rank moved out of d0 whose DropShard never came (the coordinator lost it) is frozen there
// while the rank goes on elsewhere. When a later placement gives it back to d0 with a copy to
// make (re-replication), d0 copies it from the primary instead of serving its stale state.
TEST(FailoverTest, ARankGivenBackWithACopyIsCopiedNotServedFromTheStateKeptSinceItMovedOut) {
  JobSpec spec = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 4);  // rank 0: d0 (+ d1), rank 1: d1 (+ d2); d3 holds nothing
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);  // (the reference's delayed scaling counts this cast)
  int64_t step = 0;
  RunSteps(cluster, ref, &step, 1);
  ASSERT_THAT(cluster.MoveKeepingTheSource(0, 3), IsOk());  // d0 keeps rank 0 at step 0
  RunSteps(cluster, ref, &step, 2);
  ASSERT_THAT(cluster.AddReplica(0, 0), IsOk());  // back to d0, copied from d3
  ExpectReplicasEqualPrimaries(cluster);
  RunSteps(cluster, ref, &step, 1);
  ExpectReplicasEqualPrimaries(cluster);
}

// With R = 1, d1 loses step 1's last reduction and cannot reach d0 to ask about it. Meanwhile d0,
// which decided and committed step 1, is fenced by a move of its rank to d2, copied and dropped,
// and d1 never reaches it again. The decisions d0 made came with the copy: d1 learns step 1 from
// d2 and commits it too, instead of giving it up while d2 holds it committed. `back`: the rank
// then moves back to d0, which d1 reaches only after a while (d0 holds the decisions again, from
// d2's copy).
void DecisionsTravelWithAMove(bool back) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  daemon::StepFault lose;
  lose.kind = daemon::StepFault::Kind::kLoseReduction;
  lose.step = 1;
  lose.reduction = 1;
  Cluster cluster(spec, 3, nullptr, {{1, lose}});  // rank 0 on d0, rank 1 on d1; d2 holds nothing
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  int64_t step = 0;
  RunSteps(cluster, ref, &step, 1);
  cluster.peer_client().SetOutcomesFail("d0", true);
  cluster.PushGrads(1);
  std::vector<absl::StatusOr<v1::StepStats>> finished;
  std::thread trainers([&] { finished = cluster.Finish(1, 1e-3f); });
  const auto committed = [&](int d) {
    for (const v1::JobProgress& p : cluster.daemon(d).Progress()) {
      if (p.job_id() == kJob) return p.committed_step();
    }
    return int64_t{-2};
  };
  while (committed(0) < 1) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_THAT(cluster.Move(0, 2), IsOk());  // d0 is copied and drops the job
  ASSERT_EQ(committed(0), -2) << "d0 still holds the job";
  if (back) {
    ASSERT_THAT(cluster.Move(0, 0), IsOk());
    absl::SleepFor(absl::Milliseconds(1500));  // longer than d1 waits for a member that left
    EXPECT_EQ(committed(1), 0) << "d1 is still in doubt about step 1";
    cluster.peer_client().SetOutcomesFail("d0", false);
  }
  trainers.join();
  for (const auto& stats : finished) EXPECT_THAT(stats.status(), IsOk());
  ref.Step(1, 1e-3f);
  ExpectMatchesReference(cluster, ref, 2);
  step = 2;
  RunSteps(cluster, ref, &step, 2);
}

TEST(FailoverTest, AMovesTargetAnswersForTheDecisionsItsSourceMade) { DecisionsTravelWithAMove(false); }

TEST(FailoverTest, ARankMovedAwayAndBackStillAnswersForTheDecisionsItMade) { DecisionsTravelWithAMove(true); }

// While a daemon copies shards, it tells a member asking about a step it has not decided to ask
// again (RUNNING) only when the copy comes from a daemon that left the placement (a move's
// source: the copy brings its decisions). Not for a re-replication (its source is a member and
// answers for itself), and never to a daemon that left: either wait could close a cycle (the
// copy waits for its source's step in flight).
TEST(FailoverTest, ACopyingDaemonTellsAMemberToAskAgainOnlyForACopyFromADaemonThatLeft) {
  for (const bool move : {true, false}) {
    SCOPED_TRACE(move ? "R = 1: rank 0 moves from d0 to d2" : "R = 2: a new replica of rank 0 on d3");
    JobSpec spec = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2);
    spec.replication_factor = move ? 1 : 2;
    // R = 1: rank 0 on d0, rank 1 on d1, d2 empty. R = 2: rank 0 on d0 (+ d1), rank 1 on d1 (+ d2).
    Cluster cluster(spec, move ? 3 : 4);
    const int target = move ? 2 : 3;
    Reference ref(cluster.resolved());
    cluster.PushInitial(ref);
    ExpectMatchesReference(cluster, ref, 0);  // (the reference's delayed scaling counts this cast)
    int64_t step = 0;
    RunSteps(cluster, ref, &step, 1);
    const auto ask = [&](const std::string& asker) {
      v1::GetStepOutcomeRequest request;
      request.set_job_id(kJob);
      request.set_step(step);  // not decided anywhere yet
      request.set_asker_daemon_id(asker);
      return cluster.daemon(target).GetStepOutcome(request).state();
    };
    const auto copying = [&] {
      for (const v1::JobProgress& p : cluster.daemon(target).Progress()) {
        if (p.job_id() == kJob) return p.loading();
      }
      return false;
    };
    cluster.peer_client().SetCopiesFail("d0", true);
    absl::Status done;
    std::thread placer([&] { done = move ? cluster.Move(0, target) : cluster.AddReplica(0, target); });
    while (!copying()) absl::SleepFor(absl::Milliseconds(5));
    if (move) {
      EXPECT_EQ(ask("d1"), v1::STEP_OUTCOME_STATE_RUNNING) << "a member; the copy's source left";
      EXPECT_EQ(ask("d0"), v1::STEP_OUTCOME_STATE_UNDECIDED) << "the move's source, which left";
    } else {
      EXPECT_EQ(ask("d1"), v1::STEP_OUTCOME_STATE_UNDECIDED) << "the copy's source is a member";
    }
    cluster.peer_client().SetCopiesFail("d0", false);
    placer.join();
    ASSERT_THAT(done, IsOk());
    EXPECT_EQ(ask("d1"), v1::STEP_OUTCOME_STATE_UNDECIDED) << "loaded";
    RunSteps(cluster, ref, &step, 1);
  }
}

// A move's target that cannot copy its shards reports why in its progress (JobProgress.load_error,
// which the coordinator shows in `jobs show`) while it retries, and clears it once loaded.
TEST(FailoverTest, AMoveTargetThatCannotCopyReportsWhyUntilItHasLoaded) {
  const JobSpec spec = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 3);  // rank 0 on d0, rank 1 on d1; d2 holds nothing
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);  // (the reference's delayed scaling counts this cast)
  int64_t step = 0;
  RunSteps(cluster, ref, &step, 1);
  const auto progress = [&](int d) {
    for (const v1::JobProgress& p : cluster.daemon(d).Progress()) {
      if (p.job_id() == kJob) return p;
    }
    return v1::JobProgress();
  };
  cluster.peer_client().SetCopiesFail("d0", true);
  absl::Status moved;
  std::thread mover([&] { moved = cluster.Move(0, 2); });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (progress(2).load_error().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  const v1::JobProgress failing = progress(2);
  EXPECT_TRUE(failing.loading());
  EXPECT_THAT(failing.load_error(), ::testing::HasSubstr("from daemon d0 at placement epoch 2"));
  EXPECT_THAT(failing.load_error(), ::testing::HasSubstr("UNAVAILABLE"));
  EXPECT_EQ(progress(0).load_error(), "") << "the source loads nothing";
  cluster.peer_client().SetCopiesFail("d0", false);
  mover.join();
  ASSERT_THAT(moved, IsOk());
  EXPECT_FALSE(progress(2).loading());
  EXPECT_EQ(progress(2).load_error(), "");
  RunSteps(cluster, ref, &step, 1);
}

// Version 0 is confirmed like a step: a replica-only daemon that loses the MAX of version 0
// learns the decision from a peer, the barrier after it fails (it left the group), and the
// daemons ask each other until every member holds the decision before they publish. Then the
// primary of that rank is lost and its replica takes over with nothing rewound. (This runs
// the confirmation's asking path for version 0; the case it guards against, the deciding
// primary lost before the replica asked, needs a kill between the two and is not staged.)
TEST(FailoverTest, AReplicaThatLosesVersionZerosLastReductionLearnsItAndCanTakeOver) {
  JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  daemon::StepFault lose;
  lose.kind = daemon::StepFault::Kind::kLoseReduction;
  lose.step = -1;
  lose.reduction = 1;
  Cluster cluster(spec, 3, nullptr, {{2, lose}});  // d2 holds only rank 1's replica
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  ExpectReplicasEqualPrimaries(cluster);
  ASSERT_THAT(cluster.Failover(1), IsOk());  // rank 1's primary: d2 takes over
  ASSERT_EQ(cluster.Owner(1), 2);
  int64_t step = 0;
  RunSteps(cluster, ref, &step, 2);
}

// A rank moved before the job's initial values came (a drain right after CreateJob): the target
// takes the source's progress, which is "nothing yet", and waits for the initial push, not for
// step 0 (which it used to: version 0 then never came).
TEST(FailoverTest, ARankMovedBeforeVersionZeroTakesTheInitialValues) {
  JobSpec spec = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2);
  Cluster cluster(spec, 3);  // rank 0 on d0, rank 1 on d1; d2 holds nothing
  Reference ref(cluster.resolved());
  ASSERT_THAT(cluster.Move(0, 2), IsOk());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  int64_t step = 0;
  RunSteps(cluster, ref, &step, 2);
}

// A step that runs while a new replica is still being copied: its forwards to the new replica
// are answered UNAVAILABLE and retried until the copy is in, so the step commits at its first
// attempt (they were refused as "ahead", and every attempt failed until the copy was in).
TEST(FailoverTest, AStepWaitsForANewReplicaStillBeingCopied) {
  JobSpec spec = MakeSpec("bf16_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 4);  // rank 0: d0 (+ d1), rank 1: d1 (+ d2); d3 holds nothing
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  int64_t step = 0;
  RunSteps(cluster, ref, &step, 3);  // (a copy-in-progress knows no step: later ones look "ahead")
  cluster.peer_client().SetCopiesFail("d0", true);  // d3's copy of rank 0 waits
  absl::Status added;
  std::thread rereplicate([&] { added = cluster.AddReplica(0, 3); });
  absl::SleepFor(absl::Milliseconds(200));  // every daemon runs the new placement
  cluster.PushGrads(step);
  std::vector<absl::StatusOr<v1::StepStats>> finished;
  std::thread trainers([&] { finished = cluster.Finish(step, 1e-3f); });
  absl::SleepFor(absl::Milliseconds(500));  // the step's forward to d3 meets the copy in progress
  cluster.peer_client().SetCopiesFail("d0", false);
  trainers.join();
  rereplicate.join();
  ASSERT_THAT(added, IsOk());
  for (const auto& stats : finished) ASSERT_THAT(stats.status(), IsOk());
  ref.Step(step, 1e-3f);
  ExpectMatchesReference(cluster, ref, step + 1);
  ++step;
  RunSteps(cluster, ref, &step, 1);
  ExpectReplicasEqualPrimaries(cluster);
}

// A move whose source dies before its copy got through (docs/architecture.md, "Replicas"): the
// target copies the rank from its surviving replica, and the job goes on bit for bit.
TEST(FailoverTest, AMoveWhoseSourceDiesCopiesFromTheReplicaAndTheJobGoesOnBitForBit) {
  JobSpec spec = MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  Cluster cluster(spec, 3);  // rank 0 on d0 with its replica on d1; d2 holds rank 1's replica
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  for (int64_t step = 0; step < 4; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    if (step == 2) {
      ASSERT_THAT(cluster.MoveAndLoseTheSource(0, 2), IsOk());
      EXPECT_EQ(cluster.Owner(0), 2);
      ExpectReplicasEqualPrimaries(cluster);
    }
    cluster.PushGrads(step);
    for (const auto& stats : cluster.Finish(step, 1e-3f)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(step, 1e-3f);
    ExpectMatchesReference(cluster, ref, step + 1);
  }
  ExpectReplicasEqualPrimaries(cluster);
}

// The mutation check: a replica that does not apply one step's input (the fault) diverges from
// its primary, and once it is promoted the job no longer matches the reference. The
// equality checks above would fail on it.
TEST(FailoverTest, AReplicaThatDropsOneStepsInputIsCaught) {
  JobSpec spec = MakeSpec("bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2);
  spec.replication_factor = 2;
  daemon::StepFault fault;
  fault.kind = daemon::StepFault::Kind::kDropReplicaInput;
  fault.step = 1;
  Cluster cluster(spec, 2, nullptr, {{1, fault}});  // d1 holds rank 0's replica
  Cluster clean(spec, 2);                           // the same run without the fault
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  clean.PushInitial(ref);
  for (int64_t step = 0; step < 3; ++step) {
    for (Cluster* c : {&cluster, &clean}) {
      c->PushGrads(step);
      for (const auto& stats : c->Finish(step, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
    }
  }
  EXPECT_TRUE(ReplicasEqualPrimaries(clean));
  EXPECT_FALSE(ReplicasEqualPrimaries(cluster));
  ASSERT_THAT(cluster.Failover(0), IsOk());
  absl::StatusOr<ShardStateCopy> promoted = StateAt(cluster, 1, 0, 0, 2, 3);
  absl::StatusOr<ShardStateCopy> expected = StateAt(clean, 0, 0, 0, 2, 3);
  ASSERT_THAT(promoted.status(), IsOk());
  ASSERT_THAT(expected.status(), IsOk());
  EXPECT_EQ(promoted->committed_step, expected->committed_step);
  EXPECT_NE(promoted->master, expected->master) << "the dropped step must show in the promoted copy";
}

}  // namespace
}  // namespace mainstay::daemon

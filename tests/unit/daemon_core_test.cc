// The shard daemon's step engine (server/daemon), in process: several ShardDaemons joined by
// the in-process peer group, trainers simulated by the test. The reference runs the same
// kernels on the unsharded model, so masters and moments must be bit-identical (no clipping:
// clipping depends on the norm, whose summation order differs between the sharded and the
// whole model) and the published bytes must equal quantizing the reference masters whole.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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
#include "server/daemon/scaling_state.h"
#include "server/daemon/shard_daemon.h"
#include "server/peer/fake_peer_group.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::GradValue;
using Reference = ::mainstay::testing::ReferenceModel;

constexpr char kJob[] = "job-1";

JobSpec MakeSpec(const std::string& recipe, LayoutPolicy policy, int64_t d) {
  JobSpec spec;
  spec.name = "test";
  spec.recipe = recipe;
  spec.data_parallel_size = d;
  spec.layout_policy = policy;
  spec.bucket_numel = 16384;
  spec.optimizer.max_grad_norm = 0.0f;  // see the file comment
  spec.optimizer.weight_decay = 0.0f;
  spec.tensors = testing::TestTensors();
  return spec;
}

class Cluster {
 public:
  Cluster(const JobSpec& spec, int daemons) : spec_(spec) {
    resolved_ = *ResolveJob(spec);
    for (int i = 0; i < daemons; ++i) {
      ShardDaemonOptions o;
      o.peers = &peers_;
      o.peer_timeout = absl::Seconds(2);
      daemons_.push_back(std::make_unique<ShardDaemon>(o));
      daemons_.back()->set_daemon_id(absl::StrCat("d", i));
    }
    // Rank r's shards on daemon r % daemons: tensors straddle daemons under `flat`.
    v1::AssignShardRequest base;
    base.set_job_id(kJob);
    base.set_placement_epoch(1);
    JobSpecToProto(spec, base.mutable_spec());
    LayoutToProto(resolved_.layout, base.mutable_layout());
    base.mutable_from_trainer();
    for (const Bucket& b : resolved_.layout.buckets) {
      for (const Shard& s : b.shards) {
        v1::ShardPlacement* p = base.mutable_placement()->add_shards();
        p->mutable_shard()->set_bucket(b.index);
        p->mutable_shard()->set_shard(s.rank);
        p->set_daemon_id(absl::StrCat("d", Owner(s.rank)));
      }
    }
    for (int i = 0; i < daemons; ++i) {
      v1::AssignShardRequest req = base;
      for (const Bucket& b : resolved_.layout.buckets) {
        for (const Shard& s : b.shards) {
          if (Owner(s.rank) != i) continue;
          v1::ShardRef* ref = req.add_shards();
          ref->set_bucket(b.index);
          ref->set_shard(s.rank);
        }
      }
      EXPECT_THAT(daemons_[static_cast<size_t>(i)]->AssignShard(req).status(), IsOk());
    }
  }

  int Owner(int32_t rank) const { return rank % static_cast<int>(daemons_.size()); }
  ShardDaemon& daemon_of(int32_t rank) { return *daemons_[static_cast<size_t>(Owner(rank))]; }
  const Layout& layout() const { return resolved_.layout; }
  const ResolvedJob& resolved() const { return resolved_; }
  peer::InProcessPeerGroupFactory& peers() { return peers_; }

  // The shard's slice of bucket b filled by value(tensor, index).
  template <typename Fn>
  std::vector<float> ShardValues(const Bucket& b, const Shard& s, Fn value) const {
    std::vector<float> out(static_cast<size_t>(b.shard_numel), 0.0f);
    for (const TensorFragment& f : s.fragments) {
      for (int64_t i = f.elements.begin; i < f.elements.end; ++i) {
        out[static_cast<size_t>(f.bucket_offset - s.elements.begin + (i - f.elements.begin))] = value(f.tensor, i);
      }
    }
    return out;
  }

  absl::StatusOr<v1::PushGradResponse> Push(int32_t bucket, int32_t shard, int64_t step, int32_t rank,
                                            const std::vector<float>& values, v1::PushKind kind,
                                            int32_t contributors = 1, int64_t chunk_elements = 1000) {
    v1::PushGradHeader h;
    h.set_job_id(kJob);
    h.set_placement_epoch(1);
    h.set_bucket(bucket);
    h.set_shard(shard);
    h.set_step(step);
    h.set_rank(rank);
    h.set_kind(kind);
    h.set_dtype(v1::ELEMENT_TYPE_FP32);
    h.set_total_bytes(static_cast<int64_t>(values.size() * 4));
    h.set_num_contributors(contributors);
    MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> session, daemon_of(shard).BeginPush(h));
    for (int64_t off = 0; off < static_cast<int64_t>(values.size()); off += chunk_elements) {
      const int64_t n = std::min<int64_t>(chunk_elements, static_cast<int64_t>(values.size()) - off);
      MAINSTAY_RETURN_IF_ERROR(session->AddChunk(
          off, std::string(reinterpret_cast<const char*>(values.data() + off), static_cast<size_t>(n) * 4)));
    }
    return session->Finish();
  }

  void PushInitial(const Reference& ref) {
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        auto values = ShardValues(b, s, [&](int32_t t, int64_t i) { return ref.master(static_cast<size_t>(t))[static_cast<size_t>(i)]; });
        ASSERT_THAT(Push(b.index, s.rank, -1, s.rank, values, v1::PUSH_KIND_INITIAL_PARAMS).status(), IsOk());
      }
    }
  }

  void PushGrads(int64_t step, float poison = 0.0f) {
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        auto values = ShardValues(b, s, [&](int32_t t, int64_t i) {
          return GradValue(t, i, step);
        });
        if (poison != 0.0f && b.index == 0 && s.rank == 0) values[0] = poison;
        ASSERT_THAT(Push(b.index, s.rank, step, s.rank, values, v1::PUSH_KIND_GRADIENT).status(), IsOk());
      }
    }
  }

  // Every rank finishes the step on every daemon it pushed to, in parallel (the calls block
  // until the step is decided). Returns one stats per call.
  std::vector<absl::StatusOr<v1::StepStats>> Finish(int64_t step, double lr) {
    std::vector<std::pair<int32_t, int>> calls;
    for (int32_t r = 0; r < layout().data_parallel_size; ++r) calls.push_back({r, Owner(r)});
    std::vector<absl::StatusOr<v1::StepStats>> out(calls.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < calls.size(); ++i) {
      threads.emplace_back([&, i] {
        v1::FinishStepRequest req;
        req.set_job_id(kJob);
        req.set_placement_epoch(1);
        req.set_step(step);
        req.set_rank(calls[i].first);
        req.set_lr(lr);
        out[i] = daemons_[static_cast<size_t>(calls[i].second)]->FinishStep(req, absl::Now() + absl::Seconds(30));
      });
    }
    for (std::thread& t : threads) t.join();
    return out;
  }

  absl::StatusOr<PullResult> Pull(int32_t bucket, int32_t shard, int64_t version, absl::Duration wait = absl::Seconds(10)) {
    v1::PullParamsRequest req;
    req.set_job_id(kJob);
    req.set_placement_epoch(1);
    req.set_bucket(bucket);
    req.set_shard(shard);
    req.set_version(version);
    return daemon_of(shard).PullParams(req, absl::Now() + wait);
  }

 private:
  JobSpec spec_;
  ResolvedJob resolved_;
  peer::InProcessPeerGroupFactory peers_;
  std::vector<std::unique_ptr<ShardDaemon>> daemons_;
};

// Compares every published shard of `version` with the reference quantized whole, and every
// master with the reference's.
void ExpectMatchesReference(Cluster& c, Reference& ref, int64_t version) {
  const size_t num_tensors = c.layout().tensors.size();
  std::vector<std::vector<uint8_t>> data(num_tensors), scales(num_tensors);
  for (size_t t = 0; t < num_tensors; ++t) ref.Quantize(t, data[t], scales[t]);
  for (const Bucket& b : c.layout().buckets) {
    const FormatDescriptor& d = Describe(b.format);
    const int scale_bytes = d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
    for (const Shard& s : b.shards) {
      absl::StatusOr<PullResult> pulled = c.Pull(b.index, s.rank, version);
      ASSERT_THAT(pulled.status(), IsOk());
      ASSERT_FALSE(pulled->unchanged);
      const QuantizedShard& q = *pulled->shard;
      ASSERT_EQ(q.version, version);
      absl::StatusOr<ShardStateCopy> state = c.daemon_of(s.rank).ReadShardState(kJob, b.index, s.rank);
      ASSERT_THAT(state.status(), IsOk());
      int64_t scale_offset = 0;
      for (const TensorFragment& f : s.fragments) {
        const size_t t = static_cast<size_t>(f.tensor);
        const IndexRange bytes = FragmentShardByteRange(b, s, f);
        const int64_t begin = DataBytes(b.format, f.elements.begin);
        ASSERT_EQ(0, std::memcmp(q.data.data() + bytes.begin, data[t].data() + begin, static_cast<size_t>(bytes.size())))
            << "data of " << c.layout().tensors[t].name << " " << f.elements.begin << ".." << f.elements.end;
        const IndexRange blocks = FragmentScaleBlocks(c.layout(), f);
        ASSERT_EQ(0, std::memcmp(q.scales.data() + scale_offset * scale_bytes,
                                 scales[t].data() + blocks.begin * scale_bytes, static_cast<size_t>(blocks.size() * scale_bytes)))
            << "scales of " << c.layout().tensors[t].name;
        scale_offset += blocks.size();
        const int64_t off = f.bucket_offset - s.elements.begin;
        ASSERT_EQ(0, std::memcmp(state->master.data() + off, ref.master(t).data() + f.elements.begin,
                                 static_cast<size_t>(f.elements.size()) * 4))
            << "master of " << c.layout().tensors[t].name;
      }
    }
  }
}

struct Case {
  std::string recipe;
  LayoutPolicy policy;
  int daemons;
};

class StepEngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(StepEngineTest, ShardedStepsEqualTheUnshardedReferenceBitForBit) {
  const Case& p = GetParam();
  const JobSpec spec = MakeSpec(p.recipe, p.policy, 2);
  Cluster cluster(spec, p.daemons);
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  for (int64_t step = 0; step < 4; ++step) {
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

INSTANTIATE_TEST_SUITE_P(
    Recipes, StepEngineTest,
    ::testing::Values(Case{"bf16_mixed", LayoutPolicy::kFlat, 2},
                      Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2},
                      Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, 2},
                      Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kWholeTensor, 2},
                      Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, 2},
                      Case{"bf16_with_fp8_subchannel_scaling_mixed", LayoutPolicy::kFlat, 2},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, 2},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, 1},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, 2}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.recipe, "_", LayoutPolicyName(info.param.policy), "_", info.param.daemons, "d");
    });

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
  req.set_placement_epoch(1);
  req.set_step(0);
  req.set_rank(0);
  req.set_lr(1e-3);
  absl::Status s = cluster_.daemon_of(0).FinishStep(req, absl::Now() + absl::Seconds(30)).status();
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("push step 0 again")));
}

}  // namespace
}  // namespace mainstay::daemon

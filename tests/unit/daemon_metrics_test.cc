// The shard daemon's metrics (server/metrics/daemon_metrics.h) recorded by the core itself, in
// process and without any HTTP server: a ShardDaemon given a registry counts committed,
// skipped and failed steps per job, observes the step phases, sets the held-state gauges
// before each render, and forgets a job's series when the job is dropped.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "server/daemon/shard_daemon.h"
#include "server/metrics/registry.h"
#include "tests/testing/job_token.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::IsOk;
using ::testing::HasSubstr;
using ::testing::Not;

// The value of one series (`name{labels}` exactly as rendered); NaN when absent.
double Value(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nan("");
}

class DaemonMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ShardDaemonOptions o;
    o.metrics = &registry_;
    daemon_ = std::make_unique<ShardDaemon>(o);
    daemon_->set_daemon_id("d0");
  }

  // Assigns job `id` (data parallel size `d`) to this daemon: the shards of rank 0, the other
  // ranks' shards placed on a daemon "d1" that does not exist.
  Layout Assign(const std::string& id, int64_t d) {
    JobSpec spec;
    spec.name = id;
    spec.recipe = "bf16_mixed";
    spec.data_parallel_size = d;
    spec.bucket_numel = 16384;
    spec.optimizer.max_grad_norm = 0.0f;
    spec.tensors = testing::TestTensors();
    const ResolvedJob resolved = *ResolveJob(spec);
    v1::AssignShardRequest request;
    request.set_job_id(id);
    request.set_job_token_sha256(testing::TokenSha256());
    request.set_placement_epoch(1);
    JobSpecToProto(spec, request.mutable_spec());
    LayoutToProto(resolved.layout, request.mutable_layout());
    request.mutable_from_trainer();
    for (const Bucket& b : resolved.layout.buckets) {
      for (const Shard& s : b.shards) {
        v1::ShardPlacement* p = request.mutable_placement()->add_shards();
        p->mutable_shard()->set_bucket(b.index);
        p->mutable_shard()->set_shard(s.rank);
        p->set_daemon_id(s.rank == 0 ? "d0" : "d1");
        if (s.rank != 0) continue;
        v1::ShardRef* ref = request.add_shards();
        ref->set_bucket(b.index);
        ref->set_shard(s.rank);
      }
    }
    EXPECT_THAT(daemon_->AssignShard(request).status(), IsOk());
    return resolved.layout;
  }

  // Pushes rank 0's shard of every bucket for `step` (-1: initial parameters), all `value`.
  void PushAll(const std::string& id, const Layout& layout, int64_t step, float value, float poison = 0.0f) {
    for (const Bucket& b : layout.buckets) {
      std::vector<float> values(static_cast<size_t>(b.shard_numel), value);
      if (poison != 0.0f && b.index == 0) values[0] = poison;
      v1::PushGradHeader h;
      h.set_job_id(id);
      h.set_job_token(testing::kToken);
      h.set_placement_epoch(1);
      h.set_bucket(b.index);
      h.set_shard(0);
      h.set_step(step);
      h.set_rank(0);
      h.set_kind(step < 0 ? v1::PUSH_KIND_INITIAL_PARAMS : v1::PUSH_KIND_GRADIENT);
      h.set_dtype(v1::ELEMENT_TYPE_FP32);
      h.set_total_bytes(static_cast<int64_t>(values.size() * 4));
      absl::StatusOr<std::unique_ptr<PushSession>> session = daemon_->BeginPush(h);
      ASSERT_THAT(session.status(), IsOk());
      ASSERT_THAT((*session)->AddChunk(0, std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4)),
                  IsOk());
      ASSERT_THAT((*session)->Finish().status(), IsOk());
    }
  }

  absl::StatusOr<v1::StepStats> Finish(const std::string& id, int64_t step) {
    v1::FinishStepRequest request;
    request.set_job_id(id);
    request.set_job_token(testing::kToken);
    request.set_placement_epoch(1);
    request.set_step(step);
    request.set_rank(0);
    request.set_lr(1e-3);
    return daemon_->FinishStep(request, absl::Now() + absl::Seconds(60));
  }

  metrics::Registry registry_;
  std::unique_ptr<ShardDaemon> daemon_;
};

TEST_F(DaemonMetricsTest, BeforeAnyJobEveryUnlabelledMetricRendersZero) {
  const std::string text = registry_.Render();
  EXPECT_EQ(Value(text, "mainstay_daemon_jobs"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_shards"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_shard_state_bytes"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_lease_live"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_pushed_bytes_total{transport=\"grpc\"}"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_pulled_bytes_total{transport=\"grpc\"}"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_step_seconds_count"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_step_phase_seconds_count{phase=\"quantize\"}"), 0);
  EXPECT_THAT(text, Not(HasSubstr("mainstay_daemon_steps_committed_total")));  // no job yet
}

TEST_F(DaemonMetricsTest, CommittedAndSkippedStepsAreCountedWithTheirPhasesAndDroppedJobsForgotten) {
  const Layout layout = Assign("job-a", 1);
  PushAll("job-a", layout, -1, 0.5f);
  PushAll("job-a", layout, 0, 0.01f);
  absl::StatusOr<v1::StepStats> stats = Finish("job-a", 0);
  ASSERT_THAT(stats.status(), IsOk());
  ASSERT_FALSE(stats->skipped());

  std::string text = registry_.Render();
  EXPECT_EQ(Value(text, "mainstay_daemon_steps_committed_total{job_id=\"job-a\"}"), 1) << text;
  EXPECT_TRUE(std::isnan(Value(text, "mainstay_daemon_steps_skipped_total{job_id=\"job-a\"}")));
  EXPECT_NEAR(Value(text, "mainstay_daemon_grad_norm{job_id=\"job-a\"}"), stats->grad_norm(), 1e-9);
  EXPECT_GT(stats->grad_norm(), 0.0);
  for (const char* phase : {"wait_inputs", "grad_stats", "reduce_stats", "update", "reduce_amax", "quantize"}) {
    EXPECT_EQ(Value(text, absl::StrCat("mainstay_daemon_step_phase_seconds_count{phase=\"", phase, "\"}")), 1) << phase;
  }
  EXPECT_EQ(Value(text, "mainstay_daemon_step_seconds_count"), 1);
  EXPECT_EQ(Value(text, "mainstay_daemon_jobs"), 1);
  EXPECT_EQ(Value(text, "mainstay_daemon_shards"), static_cast<double>(layout.buckets.size()));
  EXPECT_EQ(Value(text, "mainstay_daemon_shard_state_bytes"), static_cast<double>(daemon_->used_bytes()));
  EXPECT_GT(daemon_->used_bytes(), 0);

  // A non-finite gradient: skipped, observed up to the statistics' reduction only.
  PushAll("job-a", layout, 1, 0.01f, std::numeric_limits<float>::infinity());
  stats = Finish("job-a", 1);
  ASSERT_THAT(stats.status(), IsOk());
  ASSERT_TRUE(stats->skipped());
  text = registry_.Render();
  EXPECT_EQ(Value(text, "mainstay_daemon_steps_committed_total{job_id=\"job-a\"}"), 1);
  EXPECT_EQ(Value(text, "mainstay_daemon_steps_skipped_total{job_id=\"job-a\"}"), 1);
  EXPECT_EQ(Value(text, "mainstay_daemon_step_phase_seconds_count{phase=\"reduce_stats\"}"), 2);
  EXPECT_EQ(Value(text, "mainstay_daemon_step_phase_seconds_count{phase=\"update\"}"), 1);
  EXPECT_EQ(Value(text, "mainstay_daemon_step_seconds_count"), 2);

  v1::DropShardRequest drop;
  drop.set_job_id("job-a");
  drop.set_placement_epoch(2);
  ASSERT_THAT(daemon_->DropShard(drop), IsOk());
  text = registry_.Render();
  EXPECT_THAT(text, Not(HasSubstr("job-a")));
  EXPECT_EQ(Value(text, "mainstay_daemon_jobs"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_shard_state_bytes"), 0);
  EXPECT_EQ(Value(text, "mainstay_daemon_step_seconds_count"), 2);  // histograms are per daemon
}

TEST_F(DaemonMetricsTest, AStepThatFailsIsCountedAsFailed) {
  // Two daemons in the placement and no peer group configured: every attempt fails, changing nothing.
  const Layout layout = Assign("job-b", 2);
  PushAll("job-b", layout, -1, 0.5f);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  double failed = std::nan("");
  while (absl::Now() < deadline) {
    failed = Value(registry_.Render(), "mainstay_daemon_steps_failed_total{job_id=\"job-b\"}");
    if (failed >= 1) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(failed, 1);
  EXPECT_TRUE(std::isnan(Value(registry_.Render(), "mainstay_daemon_steps_committed_total{job_id=\"job-b\"}")));
}

TEST(DaemonMetricsWithoutRegistryTest, ADaemonWithoutARegistryHasNoMetrics) {
  ShardDaemon daemon(ShardDaemonOptions{});
  EXPECT_EQ(daemon.metrics(), nullptr);
}

}  // namespace
}  // namespace mainstay::daemon

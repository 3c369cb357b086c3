// The coordinator's metric set (server/metrics/coordinator_metrics.h) as Prometheus text.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/metrics/coordinator_metrics.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::metrics {
namespace {

using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(CoordinatorMetricsTest, RendersCountersAndStateGauges) {
  Registry registry;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto m, CoordinatorMetrics::Create(&registry));
  m->LeaseExpired();
  m->LeaseExpired();
  m->RpcFinished("mainstay.v1.Coordinator/GetJob", "OK");
  m->RpcFinished("mainstay.v1.Coordinator/GetJob", "OK");
  m->RpcFinished("mainstay.v1.Coordinator/GetJob", "PERMISSION_DENIED");
  m->SetState({{"READY", 2}, {"DOWN", 1}}, {{"READY", 1}}, {{"job-1", 3}, {"job-2", 1}});
  std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# TYPE mainstay_coordinator_lease_expirations_total counter\n"
                              "mainstay_coordinator_lease_expirations_total 2\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_rpcs_total{method=\"mainstay.v1.Coordinator/GetJob\",code=\"OK\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("code=\"PERMISSION_DENIED\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"READY\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"DOWN\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_placement_epoch{job_id=\"job-1\"} 3\n"));

  // A state that empties goes to 0; a job that is gone loses its series.
  m->SetState({{"READY", 3}}, {{"READY", 0}}, {{"job-2", 2}});
  text = registry.Render();
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"DOWN\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"READY\"} 3\n"));
  EXPECT_THAT(text, Not(HasSubstr("job-1")));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_placement_epoch{job_id=\"job-2\"} 2\n"));
}

TEST(CoordinatorMetricsTest, LastCheckpointTimeIsTheNewestCommittedOnePerJob) {
  Registry registry;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto m, CoordinatorMetrics::Create(&registry));
  v1::ListCheckpointsResponse list;
  auto add = [&](const std::string& job, int64_t ms, v1::CheckpointState state) {
    v1::CheckpointInfo* c = list.add_checkpoints();
    c->set_job_id(job);
    c->set_created_unix_ms(ms);
    c->set_state(state);
  };
  add("job-1", 9'000'000, v1::CHECKPOINT_STATE_FAILED);  // newest, but not loadable
  add("job-1", 7'000'000, v1::CHECKPOINT_STATE_COMMITTED);
  add("job-1", 5'000'000, v1::CHECKPOINT_STATE_COMMITTED);
  add("job-2", 6'000'000, v1::CHECKPOINT_STATE_WRITING);
  m->SetCheckpoints(list);
  std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_last_checkpoint_timestamp_seconds{job_id=\"job-1\"} 7000\n"));
  EXPECT_THAT(text, Not(HasSubstr("job-2")));
  m->SetCheckpoints(v1::ListCheckpointsResponse());  // deleted: the series goes
  EXPECT_THAT(registry.Render(), Not(HasSubstr("job-1")));
}

TEST(CoordinatorMetricsTest, StateFromTheCoordinatorsListsRendersEveryStateOfTheEnums) {
  Registry registry;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto m, CoordinatorMetrics::Create(&registry));
  v1::ListDaemonsResponse daemons;
  daemons.add_daemons()->set_state(v1::DAEMON_STATE_READY);
  daemons.add_daemons()->set_state(v1::DAEMON_STATE_READY);
  daemons.add_daemons()->set_state(v1::DAEMON_STATE_CORDONED);
  v1::ListJobsResponse jobs;
  v1::JobInfo* job = jobs.add_jobs();
  job->set_job_id("job-4");
  job->set_state(v1::JOB_STATE_DEGRADED);
  job->set_placement_epoch(5);
  m->SetState(daemons, jobs);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"READY\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"CORDONED\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"DOWN\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_daemons{state=\"DRAINING\"} 0\n"));
  EXPECT_THAT(text, Not(HasSubstr("UNSPECIFIED")));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_jobs{state=\"DEGRADED\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_jobs{state=\"PLACING\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("mainstay_coordinator_placement_epoch{job_id=\"job-4\"} 5\n"));
}

TEST(CoordinatorMetricsTest, NeedsARegistryAndRefusesClashingNames) {
  EXPECT_THAT(CoordinatorMetrics::Create(nullptr).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  Registry registry;
  ASSERT_TRUE(registry.AddGauge("mainstay_coordinator_jobs", "other", {"kind"}).ok());
  EXPECT_THAT(CoordinatorMetrics::Create(&registry).status(), StatusIs(absl::StatusCode::kAlreadyExists));
}

}  // namespace
}  // namespace mainstay::metrics

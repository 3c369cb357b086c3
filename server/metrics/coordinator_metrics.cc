#include "server/metrics/coordinator_metrics.h"

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "common/status.h"

namespace mainstay::metrics {
namespace {

template <typename Metric>
std::shared_ptr<Metric> Series(Family<Metric>* family, const std::vector<std::string>& values) {
  // The label counts are this file's own: a mismatch is a bug here, not a caller's error.
  return *family->WithLabels(values);
}

// Sets every series of `values`, zeroes the ones of `known` that are absent now (or removes
// them with `remove_absent`), and remembers the keys.
void Replace(Family<Gauge>* family, const std::map<std::string, int64_t>& values, std::set<std::string>& known,
             bool remove_absent) {
  for (const std::string& key : known) {
    if (values.count(key)) continue;
    if (remove_absent) {
      family->Remove({key});
    } else {
      Series(family, {key})->Set(0);
    }
  }
  if (remove_absent) known.clear();
  for (const auto& [key, value] : values) {
    Series(family, {key})->Set(static_cast<double>(value));
    known.insert(key);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> CoordinatorMetrics::Create(Registry* registry) {
  if (registry == nullptr) return absl::InvalidArgumentError("CoordinatorMetrics: registry is required");
  std::unique_ptr<CoordinatorMetrics> m(new CoordinatorMetrics(registry));
  Registry& r = *registry;
  MAINSTAY_ASSIGN_OR_RETURN(m->daemons_, r.AddGauge("mainstay_coordinator_daemons",
                                                    "Daemons known to the coordinator, by state.", {"state"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->jobs_, r.AddGauge("mainstay_coordinator_jobs", "Jobs, by state.", {"state"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->epochs_, r.AddGauge("mainstay_coordinator_placement_epoch",
                                                   "Current placement epoch of each job.", {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->last_checkpoint_,
                            r.AddGauge("mainstay_coordinator_last_checkpoint_timestamp_seconds",
                                       "Creation time (Unix seconds) of each job's newest committed checkpoint.",
                                       {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(
      m->rpcs_, r.AddCounter("mainstay_coordinator_rpcs_total",
                             "RPCs the coordinator finished, by full method name and status code.", {"method", "code"}));
  MAINSTAY_ASSIGN_OR_RETURN(Family<Counter>* expirations,
                            r.AddCounter("mainstay_coordinator_lease_expirations_total",
                                         "Daemons marked DOWN because their lease ran out."));
  m->lease_expirations_ = Series(expirations, {});
  return m;
}

void CoordinatorMetrics::LeaseExpired() { lease_expirations_->Increment(); }

void CoordinatorMetrics::RpcFinished(const std::string& method, const std::string& code) {
  Series(rpcs_, {method, code})->Increment();
}

void CoordinatorMetrics::SetState(const std::map<std::string, int64_t>& daemons_by_state,
                                  const std::map<std::string, int64_t>& jobs_by_state,
                                  const std::map<std::string, int64_t>& epochs_by_job) {
  absl::MutexLock lock(&mu_);
  Replace(daemons_, daemons_by_state, daemon_states_, /*remove_absent=*/false);
  Replace(jobs_, jobs_by_state, job_states_, /*remove_absent=*/false);
  Replace(epochs_, epochs_by_job, epoch_jobs_, /*remove_absent=*/true);
}

void CoordinatorMetrics::SetState(const v1::ListDaemonsResponse& listed_daemons, const v1::ListJobsResponse& listed_jobs) {
  auto short_name = [](const std::string& name, absl::string_view prefix) {
    return absl::StartsWith(name, prefix) ? name.substr(prefix.size()) : name;
  };
  std::map<std::string, int64_t> daemons, jobs, epochs;
  for (int i = 0; i < v1::DaemonState_descriptor()->value_count(); ++i) {
    const auto* value = v1::DaemonState_descriptor()->value(i);
    if (value->number() != 0) daemons[short_name(value->name(), "DAEMON_STATE_")] = 0;
  }
  for (int i = 0; i < v1::JobState_descriptor()->value_count(); ++i) {
    const auto* value = v1::JobState_descriptor()->value(i);
    if (value->number() != 0) jobs[short_name(value->name(), "JOB_STATE_")] = 0;
  }
  for (const v1::DaemonInfo& d : listed_daemons.daemons()) {
    ++daemons[short_name(v1::DaemonState_Name(d.state()), "DAEMON_STATE_")];
  }
  for (const v1::JobInfo& j : listed_jobs.jobs()) {
    ++jobs[short_name(v1::JobState_Name(j.state()), "JOB_STATE_")];
    epochs[j.job_id()] = j.placement_epoch();
  }
  SetState(daemons, jobs, epochs);
}

void CoordinatorMetrics::SetCheckpoints(const v1::ListCheckpointsResponse& checkpoints) {
  std::map<std::string, int64_t> newest;  // job -> seconds
  for (const v1::CheckpointInfo& c : checkpoints.checkpoints()) {
    if (c.state() != v1::CHECKPOINT_STATE_COMMITTED || c.job_id().empty()) continue;
    int64_t& t = newest[c.job_id()];
    t = std::max(t, c.created_unix_ms() / 1000);
  }
  absl::MutexLock lock(&mu_);
  Replace(last_checkpoint_, newest, checkpoint_jobs_, /*remove_absent=*/true);
}

}  // namespace mainstay::metrics

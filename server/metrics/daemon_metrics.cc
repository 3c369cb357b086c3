#include "server/metrics/daemon_metrics.h"

#include <cmath>
#include <utility>
#include <vector>

#include "common/status.h"

namespace mainstay::metrics {
namespace {

// Seconds, from a millisecond to two minutes (the default peer timeout): a step phase on a
// small model takes milliseconds, waiting for inputs can take as long as the trainers' step.
const std::vector<double>& StepBuckets() {
  static const std::vector<double> kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                               0.5,   1,      2.5,   5,    10,    30,   60,  120};
  return kBuckets;
}

template <typename Metric>
std::shared_ptr<Metric> Series(Family<Metric>* family, const std::vector<std::string>& values) {
  // The label counts are this file's own: a mismatch is a bug here, not a caller's error.
  return *family->WithLabels(values);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonMetrics>> DaemonMetrics::Create(Registry* registry) {
  if (registry == nullptr) return absl::InvalidArgumentError("DaemonMetrics: registry is required");
  std::unique_ptr<DaemonMetrics> m(new DaemonMetrics(registry));
  Registry& r = *registry;
  Family<Histogram>* phases = nullptr;
  Family<Histogram>* step = nullptr;
  Family<Gauge>* state = nullptr;
  Family<Gauge>* jobs = nullptr;
  Family<Gauge>* shards = nullptr;
  Family<Gauge>* lease = nullptr;
  MAINSTAY_ASSIGN_OR_RETURN(m->committed_,
                            r.AddCounter("mainstay_daemon_steps_committed_total",
                                         "Training steps this daemon committed (a new version).", {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->skipped_,
                            r.AddCounter("mainstay_daemon_steps_skipped_total",
                                         "Training steps skipped for a non-finite gradient (no update).", {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->failed_, r.AddCounter("mainstay_daemon_steps_failed_total",
                                                     "Step attempts that failed and changed nothing (trainers "
                                                     "push the step again).",
                                                     {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(phases, r.AddHistogram("mainstay_daemon_step_phase_seconds",
                                                   "Time of each phase of a decided training step (StepStats.phases).",
                                                   {"phase"}, StepBuckets()));
  for (size_t i = 0; i < kPhases.size(); ++i) m->phase_[i] = Series(phases, {kPhases[i]});
  MAINSTAY_ASSIGN_OR_RETURN(
      step, r.AddHistogram("mainstay_daemon_step_seconds",
                           "Time from a training step's first push to its commit or skip.", {}, StepBuckets()));
  m->step_ = Series(step, {});
  MAINSTAY_ASSIGN_OR_RETURN(
      m->grad_norm_,
      r.AddGauge("mainstay_daemon_grad_norm", "Global gradient norm of the job's last decided step.", {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->pushed_, r.AddCounter("mainstay_daemon_pushed_bytes_total",
                                                     "Gradient and initial-parameter payload bytes received "
                                                     "(PushGrad).",
                                                     {"transport"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->pulled_,
                            r.AddCounter("mainstay_daemon_pulled_bytes_total",
                                         "Parameter data and scale bytes sent (PullParams).", {"transport"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->reader_bytes_,
                            r.AddCounter("mainstay_daemon_reader_bytes_total",
                                         "Parameter data and scale bytes sent to readers (pulls with the job's "
                                         "reader token; included in mainstay_daemon_pulled_bytes_total).",
                                         {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(m->reader_throttled_,
                            r.AddCounter("mainstay_daemon_reader_pulls_throttled_total",
                                         "Reader pulls refused (UNAVAILABLE, retried) by --reader-bytes-per-sec.",
                                         {"job_id"}));
  MAINSTAY_ASSIGN_OR_RETURN(state, r.AddGauge("mainstay_daemon_shard_state_bytes",
                                              "Bytes of shard state held: masters, moments and retained versions."));
  m->state_bytes_ = Series(state, {});
  MAINSTAY_ASSIGN_OR_RETURN(jobs, r.AddGauge("mainstay_daemon_jobs", "Jobs with shards on this daemon."));
  m->jobs_ = Series(jobs, {});
  MAINSTAY_ASSIGN_OR_RETURN(shards,
                            r.AddGauge("mainstay_daemon_shards", "Shards (bucket, shard) held, over all jobs."));
  m->shards_ = Series(shards, {});
  MAINSTAY_ASSIGN_OR_RETURN(lease, r.AddGauge("mainstay_daemon_lease_live",
                                              "1 while the daemon holds a live lease with the coordinator, else 0."));
  m->lease_ = Series(lease, {});
  // Create the transports' series now, so a scrape shows 0 before the first call.
  m->PushedBytes("grpc");
  m->PulledBytes("grpc");
  return m;
}

void DaemonMetrics::StepDecided(const std::string& job, const v1::StepStats& stats) {
  Series(stats.skipped() ? skipped_ : committed_, {job})->Increment();
  Series(grad_norm_, {job})->Set(stats.grad_norm());
  const v1::StepPhaseTimes& p = stats.phases();
  const double ms[kPhases.size()] = {p.wait_inputs_ms(), p.grad_stats_ms(),  p.reduce_stats_ms(),
                                     p.update_ms(),      p.reduce_amax_ms(), p.quantize_ms()};
  // A skipped step stops after the statistics' reduction: the phases it never ran are not
  // observed (they would count as instant ones).
  const size_t ran = stats.skipped() ? 3 : kPhases.size();
  for (size_t i = 0; i < ran; ++i) phase_[i]->Observe(ms[i] / 1000.0);
  step_->Observe(static_cast<double>(stats.step_time_ms()) / 1000.0);
}

void DaemonMetrics::StepFailed(const std::string& job) { Series(failed_, {job})->Increment(); }

void DaemonMetrics::ReaderPulled(const std::string& job, int64_t bytes) {
  Series(reader_bytes_, {job})->Increment(static_cast<double>(bytes));
}

void DaemonMetrics::ReaderThrottled(const std::string& job) { Series(reader_throttled_, {job})->Increment(); }

void DaemonMetrics::ForgetJob(const std::string& job) {
  for (Family<Counter>* f : {committed_, skipped_, failed_, reader_bytes_, reader_throttled_}) f->Remove({job});
  grad_norm_->Remove({job});
}

std::shared_ptr<Counter> DaemonMetrics::PushedBytes(const std::string& transport) {
  return Series(pushed_, {transport});
}

std::shared_ptr<Counter> DaemonMetrics::PulledBytes(const std::string& transport) {
  return Series(pulled_, {transport});
}

void DaemonMetrics::SetHeld(int64_t jobs, int64_t shards, int64_t state_bytes) {
  jobs_->Set(static_cast<double>(jobs));
  shards_->Set(static_cast<double>(shards));
  state_bytes_->Set(static_cast<double>(state_bytes));
}

void DaemonMetrics::SetLeaseLive(bool live) { lease_->Set(live ? 1.0 : 0.0); }

}  // namespace mainstay::metrics

// The metrics mainstayd exports (docs/daemon.md, "Metrics"): their names, types, labels and
// buckets in one place, and what the daemon records into them. The core (server/daemon) calls
// these methods and never sees HTTP; server/grpc counts the bytes it moves; main.cc serves the
// registry with a MetricsServer.
//
// Per-job series carry the label `job_id`, not `job`: Prometheus attaches `job` (the scrape
// job's name) to every series it scrapes and would rename ours to `exported_job`.
//
// Ownership: the registry is not owned and must outlive this object. Thread safety: every
// method is thread-safe. Errors: Create fails (ALREADY_EXISTS) only when the registry already
// holds one of these names with another type or labels; a second DaemonMetrics on the same
// registry shares the families (the gauges then hold whichever daemon set them last).
#ifndef MAINSTAY_SERVER_METRICS_DAEMON_METRICS_H_
#define MAINSTAY_SERVER_METRICS_DAEMON_METRICS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "mainstay/v1/common.pb.h"
#include "server/metrics/registry.h"

namespace mainstay::metrics {

class DaemonMetrics {
 public:
  // The step phases of v1::StepPhaseTimes, as the `phase` label says them.
  static constexpr std::array<const char*, 6> kPhases = {"wait_inputs", "grad_stats",  "reduce_stats",
                                                         "update",      "reduce_amax", "quantize"};

  static absl::StatusOr<std::unique_ptr<DaemonMetrics>> Create(Registry* registry);

  Registry* registry() const { return registry_; }

  // A training step (step >= 0) decided: committed, or skipped (stats.skipped()). Counts it,
  // observes its phase times and total time, and sets the job's last gradient norm.
  void StepDecided(const std::string& job, const v1::StepStats& stats);
  // An attempt at a step (the initial publication too) that failed and changed nothing.
  void StepFailed(const std::string& job);
  // A reader-token pull of `bytes` (data and scales) sent; one refused by the reader cap.
  void ReaderPulled(const std::string& job, int64_t bytes);
  void ReaderThrottled(const std::string& job);
  // Removes the job's series (the job left this daemon).
  void ForgetJob(const std::string& job);

  // Payload bytes moved by the Shard service, by transport ("grpc"). Never null.
  std::shared_ptr<Counter> PushedBytes(const std::string& transport);
  std::shared_ptr<Counter> PulledBytes(const std::string& transport);

  // What the daemon holds now (set by a collector before each scrape).
  void SetHeld(int64_t jobs, int64_t shards, int64_t state_bytes);
  // 1 while the coordinator link holds a live lease.
  void SetLeaseLive(bool live);

 private:
  explicit DaemonMetrics(Registry* registry) : registry_(registry) {}

  Registry* const registry_;
  Family<Counter>* committed_ = nullptr;
  Family<Counter>* skipped_ = nullptr;
  Family<Counter>* failed_ = nullptr;
  Family<Gauge>* grad_norm_ = nullptr;
  Family<Counter>* pushed_ = nullptr;
  Family<Counter>* pulled_ = nullptr;
  Family<Counter>* reader_bytes_ = nullptr;
  Family<Counter>* reader_throttled_ = nullptr;
  std::array<std::shared_ptr<Histogram>, kPhases.size()> phase_;
  std::shared_ptr<Histogram> step_;
  std::shared_ptr<Gauge> jobs_, shards_, state_bytes_, lease_;
};

}  // namespace mainstay::metrics

#endif  // MAINSTAY_SERVER_METRICS_DAEMON_METRICS_H_

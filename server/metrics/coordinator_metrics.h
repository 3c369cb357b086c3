// The metric set of mainstay-coordinator (docs/operations.md "Metrics"), recorded into a
// metrics::Registry and served by the same /metrics endpoint as the daemon's
// (metrics_server.h). The server (server/grpc/coordinator_service.cc) counts RPCs and lease
// expirations as they happen and refreshes the state gauges from the core before each scrape.
//
//   mainstay_coordinator_daemons{state}             gauge    daemons known, by state (READY, ...)
//   mainstay_coordinator_jobs{state}                gauge    jobs, by state
//   mainstay_coordinator_placement_epoch{job_id}    gauge    each job's current placement epoch
//   mainstay_coordinator_lease_expirations_total    counter  daemons marked DOWN for a missed lease
//   mainstay_coordinator_rpcs_total{method,code}    counter  finished RPCs by full method and status
//   mainstay_coordinator_last_checkpoint_timestamp_seconds{job_id}
//                                                   gauge    creation time of the job's newest
//                                                            committed checkpoint (age = time() - it);
//                                                            no series for a job without one
//
// Ownership: the registry is not owned and must outlive this object. Thread safety: every
// method is thread-safe.
#ifndef MAINSTAY_SERVER_METRICS_COORDINATOR_METRICS_H_
#define MAINSTAY_SERVER_METRICS_COORDINATOR_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "mainstay/v1/admin.pb.h"
#include "mainstay/v1/coordinator.pb.h"
#include "server/metrics/registry.h"

namespace mainstay::metrics {

class CoordinatorMetrics {
 public:
  // INVALID_ARGUMENT without a registry; ALREADY_EXISTS when the registry has other metrics
  // under these names.
  static absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> Create(Registry* registry);

  Registry* registry() const { return registry_; }

  // A daemon missed its lease and was marked DOWN.
  void LeaseExpired();
  // An RPC finished. `method` is gRPC's full name without the leading '/'
  // ("mainstay.v1.Coordinator/GetJob"); `code` the status code's name ("OK", "NOT_FOUND").
  void RpcFinished(const std::string& method, const std::string& code);

  // The state gauges, replaced as a whole: every state in `daemons_by_state` / `jobs_by_state`
  // is set (a state that had a series and is absent now goes to 0); a job absent from
  // `epochs_by_job` loses its series.
  void SetState(const std::map<std::string, int64_t>& daemons_by_state,
                const std::map<std::string, int64_t>& jobs_by_state,
                const std::map<std::string, int64_t>& epochs_by_job);
  // The same from the coordinator's lists (every daemon, DOWN ones included, and every job);
  // every state of the DaemonState and JobState enums gets a series, 0 when none is in it.
  void SetState(const v1::ListDaemonsResponse& daemons, const v1::ListJobsResponse& jobs);
  // The newest committed checkpoint of each job (from ListCheckpoints, newest first); a job
  // without one loses its series.
  void SetCheckpoints(const v1::ListCheckpointsResponse& checkpoints);

 private:
  explicit CoordinatorMetrics(Registry* registry) : registry_(registry) {}

  Registry* const registry_;
  Family<Gauge>* daemons_ = nullptr;
  Family<Gauge>* jobs_ = nullptr;
  Family<Gauge>* epochs_ = nullptr;
  Family<Gauge>* last_checkpoint_ = nullptr;
  Family<Counter>* rpcs_ = nullptr;
  std::shared_ptr<Counter> lease_expirations_;
  absl::Mutex mu_;  // serializes SetState
  std::set<std::string> daemon_states_ ABSL_GUARDED_BY(mu_), job_states_ ABSL_GUARDED_BY(mu_),
      epoch_jobs_ ABSL_GUARDED_BY(mu_), checkpoint_jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mainstay::metrics

#endif  // MAINSTAY_SERVER_METRICS_COORDINATOR_METRICS_H_

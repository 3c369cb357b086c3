// The step part of mainstayd's graceful stop (SIGTERM; docs/daemon.md "Dropping a job,
// stopping"): from Begin on, only pushes of the steps already in flight are admitted, and
// AwaitInFlight waits until those steps are decided, so the trainers' current step commits
// and its version can be pulled before the daemon goes.
//
// A step is "in flight" for a job when a push of it was admitted and the job had not decided
// it when the drain began; a job with no such step has nothing to finish. Pushes of later
// steps, or for jobs with nothing in flight, are UNAVAILABLE ("draining"): the trainer retries
// and, once the daemon has deregistered, re-reads the placement.
//
// Transport-free: the Shard service calls AdmitPush after the core accepted a push's header
// (before any data is stored); the daemon's main calls Begin and AwaitInFlight with the
// core's Progress().
// Thread safety: every method is thread-safe.
#ifndef MAINSTAY_SERVER_DAEMON_STEP_DRAIN_H_
#define MAINSTAY_SERVER_DAEMON_STEP_DRAIN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mainstay/v1/coordinator.pb.h"

namespace mainstay::daemon {

class StepDrain {
 public:
  // OK (and remembered) before the drain; while draining OK only for a step <= the job's step
  // in flight, else UNAVAILABLE naming the step. `step` -1 is the initial parameters.
  absl::Status AdmitPush(const std::string& job_id, int64_t step);

  // Starts draining. `progress` is the daemon's progress now (ShardDaemon::Progress). Returns
  // the step in flight of each job that has one. Idempotent: a second call returns the same.
  std::map<std::string, int64_t> Begin(const std::vector<v1::JobProgress>& progress);
  bool draining() const;

  // Polls `progress` every `poll` until every step in flight is decided (a job missing from
  // the progress, i.e. dropped, counts as done) or `deadline` passes: then DEADLINE_EXCEEDED
  // naming the jobs and steps still open.
  absl::Status AwaitInFlight(const std::function<std::vector<v1::JobProgress>()>& progress, absl::Time deadline,
                             absl::Duration poll = absl::Milliseconds(20)) const;

 private:
  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, int64_t> admitted_ ABSL_GUARDED_BY(mu_);   // highest step admitted per job
  std::map<std::string, int64_t> in_flight_ ABSL_GUARDED_BY(mu_);  // frozen by Begin
};

// Whether `progress` shows `step` decided: the initial parameters (-1) once version 0 is
// published, a training step once committed or skipped.
bool StepDecided(const v1::JobProgress& progress, int64_t step);

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_STEP_DRAIN_H_

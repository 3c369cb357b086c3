#include "server/daemon/step_drain.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace mainstay::daemon {

bool StepDecided(const v1::JobProgress& progress, int64_t step) {
  return step < 0 ? progress.version() >= 0 : progress.committed_step() >= step;
}

absl::Status StepDrain::AdmitPush(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (!draining_) {
    auto [it, inserted] = admitted_.emplace(job_id, step);
    if (!inserted) it->second = std::max(it->second, step);
    return absl::OkStatus();
  }
  auto it = in_flight_.find(job_id);
  if (it != in_flight_.end() && step <= it->second) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "daemon is draining (shutting down): job ", job_id, " step ", step,
      it == in_flight_.end() ? " is not accepted; no step of the job is in flight here"
                             : absl::StrCat(" is not accepted; only step ", it->second, " is finished here"),
      " (retry: the coordinator moves the shards or the daemon comes back)"));
}

std::map<std::string, int64_t> StepDrain::Begin(const std::vector<v1::JobProgress>& progress) {
  absl::MutexLock lock(&mu_);
  if (draining_) return in_flight_;
  draining_ = true;
  for (const v1::JobProgress& p : progress) {
    auto it = admitted_.find(p.job_id());
    if (it != admitted_.end() && !StepDecided(p, it->second)) in_flight_[p.job_id()] = it->second;
  }
  return in_flight_;
}

bool StepDrain::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

absl::Status StepDrain::AwaitInFlight(const std::function<std::vector<v1::JobProgress>()>& progress,
                                      absl::Time deadline, absl::Duration poll) const {
  std::map<std::string, int64_t> waiting;
  {
    absl::MutexLock lock(&mu_);
    waiting = in_flight_;
  }
  while (true) {
    std::map<std::string, int64_t> open;
    std::map<std::string, v1::JobProgress> now;
    for (v1::JobProgress& p : progress()) now[p.job_id()] = std::move(p);
    for (const auto& [job, step] : waiting) {
      auto it = now.find(job);
      if (it != now.end() && !StepDecided(it->second, step)) open[job] = step;
    }
    if (open.empty()) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "steps still in flight at the drain deadline: ",
          absl::StrJoin(open, ", ", [](std::string* out, const auto& e) { absl::StrAppend(out, e.first, " step ", e.second); })));
    }
    absl::SleepFor(std::min(poll, deadline - absl::Now()));
  }
}

}  // namespace mainstay::daemon

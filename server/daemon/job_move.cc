// Moves of shards between live daemons (docs/daemon.md, "Moves"): the source's fence and copy,
// the target's load. A move happens at a step boundary: the coordinator names the target at a
// new placement epoch; the target asks the source for each shard with that epoch; the source
// stops taking steps at older epochs, lets the step in flight be decided, and streams its
// committed state with the job's scaling state, the newest version and the pushes it stored of
// later steps; the target installs it and serves from the step after (the trainers send their
// FinishStep to the new owner: the step goes on). The source keeps its copy until the
// coordinator drops it, once the target reports the job loaded.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/daemon/job.h"

namespace mainstay::daemon {

namespace {
constexpr absl::Duration kCopyTimeout = absl::Minutes(5);
constexpr absl::Duration kRetryInterval = absl::Milliseconds(500);

}  // namespace

absl::Status Job::FencedError(const char* call) const {
  v1::ErrorDetail detail;
  detail.set_placement_epoch(fence_epoch_);
  detail.set_committed_step(committed_step_);
  detail.set_version(version_);
  return AttachErrorDetail(
      absl::FailedPreconditionError(absl::StrCat(call, ": job ", job_id_, " is moving to placement epoch ",
                                                 fence_epoch_, " (its shards are being copied to a new daemon); "
                                                 "re-read the placement")),
      detail);
}

absl::StatusOr<ShardStateCopy> Job::CopyForMove(const v1::FetchShardStateRequest& request, absl::Time deadline) {
  const Key key{request.shard().bucket(), request.shard().shard()};
  absl::MutexLock lock(&mu_);
  CrashIfInjectedLocked(StepFault::Phase::kCopy, committed_step_,
                        [&] { return absl::StrCat("when asked for a copy of ", ShardName(key.first, key.second)); });
  const bool fence = request.placement_epoch() > epoch_;
  if (fence && request.placement_epoch() > fence_epoch_) {
    fence_epoch_ = request.placement_epoch();
    Changed();
    Log(LogLevel::kInfo, "daemon",
        absl::StrCat("job ", job_id_, ": fenced at placement epoch ", fence_epoch_, " for the copy of ",
                     ShardName(key.first, key.second), " (no more steps at epoch ", epoch_, ")"));
  }
  if (fence || moving_out_.count(key)) {
    // The copy must be final: the step in flight (which may still commit) is decided first.
    auto settled = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stopping_ || (executing_step_ == -2 && restore_ == nullptr && !restoring_);
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("FetchShardState: job ", job_id_,
                                                      ": the step in flight was not decided before the deadline"));
    }
  }
  // A copy that keeps its source (re-replication: the source is in the new placement, so no
  // fence) must not be taken under a step of an older placement: that step commits without the
  // target, which would start one step behind and never catch up. Its steps at the new epoch
  // include the target (their inputs are forwarded to it), so they need no wait.
  const int64_t copy_epoch = request.placement_epoch();
  auto older_step_settled = [this, copy_epoch]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || executing_step_ == -2 || executing_epoch_ >= copy_epoch;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&older_step_settled), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("FetchShardState: job ", job_id_, ": the step in flight at epoch ",
                                                    executing_epoch_, " was not decided before the deadline"));
  }
  auto not_applying = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !applying_; };
  mu_.Await(absl::Condition(&not_applying));  // the state, as of a committed step
  if (stopping_) return absl::UnavailableError(absl::StrCat("job ", job_id_, " stopped on this daemon"));
  if (!restore_error_.ok()) return absl::FailedPreconditionError(restore_error_.message());
  std::shared_ptr<ShardState> state;
  if (auto it = shards_.find(key); it != shards_.end()) state = it->second;
  if (auto it = moving_out_.find(key); it != moving_out_.end()) state = it->second;
  if (state == nullptr || state->incoming) {
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        "FetchShardState: job ", job_id_, ": this daemon holds no state of ", ShardName(key.first, key.second))));
  }
  // Fenced (or moving out), the copy is the shard's state from now on, wherever it goes.
  const bool leaving = Fenced() || moving_out_.count(key) > 0;
  if (leaving) released_.insert(key);
  ShardStateCopy copy;
  copy.version = state->initialized ? version_ : -1;
  copy.committed_step = committed_step_;
  copy.moment_type = job_.spec.optimizer.moment_dtype;
  if (leaving) {
    // A move's source runs no more steps on this state: the stream reads the shard's own
    // buffers (views), no copy. Should the move be called off while it streams (the shard
    // served here again), ApplyStep waits for copies_out_; the copy keeps the state and the
    // job alive.
    copy.master = StateBuffer<float>::View(state->master.data(), state->master.size());
    copy.m = StateBuffer<uint8_t>::View(state->m.data(), state->m.size());
    copy.v = StateBuffer<uint8_t>::View(state->v.data(), state->v.size());
    ++copies_out_;
    copy.hold = std::shared_ptr<void>(nullptr, [job = shared_from_this(), state](void*) {
      absl::MutexLock lock(&job->mu_);
      --job->copies_out_;
    });
  } else {
    // A re-replication's source keeps training: its steps must not wait for the stream (a slow
    // target would hold them up), so it streams a copy, taken here.
    MAINSTAY_RETURN_IF_ERROR(copy.master.Assign(HostCopyMemory(), state->master.span()));
    MAINSTAY_RETURN_IF_ERROR(copy.m.Assign(HostCopyMemory(), state->m.span()));
    MAINSTAY_RETURN_IF_ERROR(copy.v.Assign(HostCopyMemory(), state->v.span()));
  }
  copy.scaling = committed_scaling_;
  if (!state->versions.empty()) copy.newest = state->versions.rbegin()->second;
  if (auto it = stats_.find(committed_step_); it != stats_.end()) copy.committed_stats = it->second;
  for (const auto& [step, decision] : decisions_) copy.decisions.push_back(decision);
  // The pushes of later steps stored here go along: the trainers' next step continues on the
  // target instead of being pushed again (pushes that come after the fence are refused and
  // re-routed by the trainers, so each push lands exactly once on either side).
  for (const auto& [step, inputs] : pending_) {
    if (step >= 0 ? step <= committed_step_ : version_ >= 0) continue;
    auto in = inputs.shards.find(key);
    if (in == inputs.shards.end()) continue;
    for (const auto& [rank, payload] : in->second.by_rank) {
      copy.pending.push_back(PendingPushCopy{step, rank, in->second.num_contributors, in->second.dtype,
                                             in->second.loss_scale, payload});
    }
  }
  return copy;
}

void Job::RunMovesIn() {
  MoveIn& queued = moves_in_.front();
  // Shards an earlier move of a re-sent placement filled meanwhile are not copied again.
  queued.keys.erase(std::remove_if(queued.keys.begin(), queued.keys.end(),
                                   [this](const Key& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                     auto it = shards_.find(key);
                                     return it == shards_.end() || !it->second->incoming;
                                   }),
                    queued.keys.end());
  if (queued.keys.empty()) {
    moves_in_.erase(moves_in_.begin());
    return;
  }
  const MoveIn move = queued;
  mu_.Unlock();
  std::vector<std::pair<Key, absl::StatusOr<ShardStateCopy>>> copies;
  absl::Status failed;
  for (const Key& key : move.keys) {
    v1::FetchShardStateRequest request;
    request.set_job_id(job_id_);
    request.set_placement_epoch(move.epoch);
    request.mutable_shard()->set_bucket(key.first);
    request.mutable_shard()->set_shard(key.second);
    absl::StatusOr<ShardStateCopy> copy =
        options_.peer_client == nullptr
            ? absl::FailedPreconditionError("this daemon has no peer client to copy shards with")
            : options_.peer_client->FetchShardState(move.source, request, absl::Now() + kCopyTimeout, *options_.memory,
                                                    job_.layout.buckets[static_cast<size_t>(key.first)].shard_numel);
    if (!copy.ok()) {
      failed = Annotate(copy.status(), absl::StrCat("copying ", ShardName(key.first, key.second), " from daemon ",
                                                    move.source.daemon_id()));
      break;
    }
    copies.emplace_back(key, std::move(copy));
  }
  // The copies' masters and moments landed in this daemon's state memory as they streamed in
  // (all of them, or the move waits and retries), outside the lock. A RESOURCE_EXHAUSTED (the
  // coordinator places the move elsewhere) is only that memory being full (PeerClient).
  mu_.Lock();
  if (stopping_) return;
  if (failed.ok() && !copies.empty()) {
    CrashIfInjectedLocked(StepFault::Phase::kInstall, copies.front().second->committed_step,
                          [&] {
                            return absl::StrCat("with the copy from daemon ", move.source.daemon_id(), " not installed");
                          });
  }
  // All shards of one move come from one source at one step, or none is installed.
  // A daemon that holds no other shard of the job with state takes the source's progress (the
  // job is new here, or came with no shards); otherwise the copy must be at its step.
  const bool fresh = std::all_of(shards_.begin(), shards_.end(), [](const auto& e) { return e.second->incoming; });
  const size_t mb = static_cast<size_t>(BitsOf(job_.spec.optimizer.moment_dtype) / 8);
  const bool adamw = job_.spec.optimizer.type == OptimizerType::kAdamW;
  for (size_t k = 0; k < copies.size() && failed.ok(); ++k) {
    const auto& [key, copy] = copies[k];
    auto it = shards_.find(key);
    const int64_t numel = job_.layout.buckets[static_cast<size_t>(key.first)].shard_numel;
    if (copy->committed_step != (fresh ? copies.front().second->committed_step : committed_step_) ||
        (!fresh && copy->version >= 0 && copy->version != version_)) {
      failed = absl::AbortedError(absl::StrCat("the copy of ", ShardName(key.first, key.second), " is at step ",
                                               copy->committed_step, " version ", copy->version,
                                               ", this daemon's shards at step ", committed_step_, " version ",
                                               version_, "; copying again"));
    } else if (copy->version >= 0 && (static_cast<int64_t>(copy->master.size()) != numel ||
                                      copy->m.size() != static_cast<size_t>(numel) * mb ||
                                      copy->v.size() != (adamw ? static_cast<size_t>(numel) * mb : 0))) {
      failed = absl::DataLossError(absl::StrCat("the copy of ", ShardName(key.first, key.second),
                                                " has buffers of the wrong size"));
    } else if (std::any_of(copy->pending.begin(), copy->pending.end(), [&](const PendingPushCopy& p) {
                 return p.payload.size() != static_cast<size_t>(numel) * static_cast<size_t>(BitsOf(p.dtype) / 8) ||
                        p.rank < 0 || p.rank >= job_.layout.data_parallel_size;
               })) {
      failed = absl::DataLossError(absl::StrCat("the copy of ", ShardName(key.first, key.second),
                                                " carries a pending push of the wrong size or rank"));
    } else if (it == shards_.end() || !it->second->incoming) {
      failed = absl::AbortedError("the placement changed during the copy");
    }
  }
  if (!failed.ok()) {
    const absl::Status error(
        failed.code(), absl::StrCat("loading ", move.keys.size(), " shard(s) from daemon ", move.source.daemon_id(),
                                    " at placement epoch ", move.epoch, ": ", failed.ToString()));
    Log(LogLevel::kWarning, "daemon", absl::StrCat("job ", job_id_, ": ", error.message(), "; retrying"));
    if (epoch_ > move.epoch || stopping_) {
      // A newer placement supersedes this move (the coordinator re-sends what is still wanted),
      // and its failure says nothing of the loads that follow.
      moves_in_.erase(moves_in_.begin());
      return;
    }
    load_error_ = error;
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), kRetryInterval);
    return;
  }
  for (auto& [key, copy] : copies) {
    ShardState& s = *shards_.at(key);
    s.initialized = copy->version >= 0;
    s.master = std::move(copy->master);
    s.m = std::move(copy->m);
    s.v = std::move(copy->v);
    s.versions.clear();
    if (copy->newest != nullptr) s.versions[copy->newest->version] = copy->newest;
    s.incoming = false;
    released_.erase(key);
  }
  if (fresh && !copies.empty()) {
    const ShardStateCopy& first = *copies.front().second;
    committed_step_ = first.committed_step;
    // Before version 0 (a move of a job not started yet) the engine waits for the initial push.
    next_step_ = first.version >= 0 ? first.committed_step + 1 : -1;
    version_ = first.version;
    ApplyScaling(first.scaling);  // the step thread's own state: it is this thread
    committed_scaling_ = ScalingProto();
    loss_scale_now_ = loss_scale_.scale;
    restoring_ = false;
    // A peer in doubt about a step the source decided may ask only after the source dropped
    // the job: this daemon, now a member, answers for it (Job::LearnDecision asks the current
    // members too).
    for (const v1::StepDecision& d : first.decisions) {
      if (d.step() <= committed_step_) decisions_[d.step()] = d;
    }
    if (first.committed_stats.has_value() && first.committed_step >= 0) {
      stats_[first.committed_step] = *first.committed_stats;
    }
  }
  size_t carried = 0;
  for (auto& [key, copy] : copies) {
    // A replica's inputs come from its primary's forwards, never from trainers' pushes: the
    // pushes the copy carries are for a new primary (a move), not for a new replica.
    if (shards_.at(key)->replica) continue;
    for (PendingPushCopy& p : copy->pending) {
      if (p.step >= 0 ? p.step <= committed_step_ : version_ >= 0) continue;
      StepInputs& step = pending_[p.step];
      if (step.first_push_ms == 0) step.first_push_ms = options_.clock->NowUnixMs();
      carried += step.shards[key].Add(p.rank, p.num_contributors, p.dtype, p.loss_scale, std::move(p.payload)) ? 1 : 0;
    }
  }
  // Pushes of the open step that reached a source which died before its copy (the copy then came
  // from a replica, which holds no trainers' pushes) are gone: a rank that called FinishStep
  // has pushed everything it will, so a copied primary shard missing its push would keep the
  // step waiting for ever. The step fails; its waiters push it again.
  if (auto open = pending_.find(next_step_); open != pending_.end() && !open->second.finished.empty()) {
    bool unreduced = false;
    for (const auto& [key, in] : open->second.shards) unreduced |= in.num_contributors > 1;
    std::string lost;
    std::set<std::pair<Key, int32_t>> lost_pushes;
    for (const auto& [key, copy] : copies) {
      if (shards_.at(key)->replica) continue;
      auto in = open->second.shards.find(key);
      for (const auto& [rank, hyper] : open->second.finished) {
        if ((unreduced || rank == key.second) && (in == open->second.shards.end() || !in->second.by_rank.count(rank))) {
          lost = absl::StrCat(ShardName(key.first, key.second), "'s push of rank ", rank);
          lost_pushes.insert({key, rank});
        }
      }
    }
    if (!lost.empty()) {
      const int64_t step = next_step_;
      // Lost, and dropped with the step here: each rank must push them again.
      for (const auto& [key, in] : open->second.shards) {
        for (const auto& [rank, data] : in.by_rank) lost_pushes.insert({key, rank});
      }
      dropped_pushes_[step].insert(lost_pushes.begin(), lost_pushes.end());
      RecordFailureLocked(step, ErrorWithDetail(absl::AbortedError(
          absl::StrCat("step ", step, " of job ", job_id_, " lost ", lost, " with the daemon it went to (",
                       move.source.daemon_id(), " or an earlier source); push step ", step, " again"))));
      pending_.erase(open);
      Log(LogLevel::kWarning, "daemon", absl::StrCat("job ", job_id_, ": ", failures_[step].message()));
    }
  }
  moves_in_.erase(moves_in_.begin());
  load_error_ = absl::OkStatus();
  Log(LogLevel::kInfo, "daemon",
      absl::StrCat("job ", job_id_, ": copied ", copies.size(), " shard(s) from daemon ", move.source.daemon_id(),
                   " at step ", committed_step_, ", version ", version_, " (placement epoch ", move.epoch, ")",
                   carried > 0 ? absl::StrCat(", with ", carried, " push(es) of later steps") : ""));
}

}  // namespace mainstay::daemon

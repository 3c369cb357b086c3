// Checkpoints of a job (DESIGN.md section 8, docs/checkpoints.md): writing the committed state
// of the owned shards in model space, and restoring a new job from a checkpoint written with
// any layout.
#include <algorithm>
#include <array>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/layout_proto.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/daemon/job.h"

namespace mainstay::daemon {
namespace {

constexpr absl::Duration kRestoreRetryInterval = absl::Milliseconds(500);
constexpr absl::Duration kRestoreRetryFor = absl::Minutes(15);

int ElementBytes(ElementType type) { return BitsOf(type) / 8; }

}  // namespace

v1::CheckpointScalingState Job::ScalingProto() const {
  v1::CheckpointScalingState out;
  for (size_t t = 0; t < job_.layout.tensors.size(); ++t) {
    v1::TensorScalingState& s = *out.add_tensors();
    s.set_tensor_name(job_.layout.tensors[t].name);
    if (Describe(job_.layout.tensors[t].format).scaling == ScalingMode::kDelayed) {
      for (float a : delayed_[t].history) s.add_amax_history(a);
      s.set_scale(delayed_[t].scale);
      s.set_published_scale(cast_scale_[t]);
    }
  }
  out.set_loss_scale(loss_scale_.scale);
  out.set_loss_scale_good_steps(loss_scale_.good_steps);
  out.set_loss_scale_hysteresis_left(loss_scale_.hysteresis_left);
  return out;
}

std::pair<std::string, int64_t> Job::restored_from() const {
  absl::MutexLock lock(&mu_);
  return {restored_from_, restored_epoch_};
}

absl::Status Job::RewoundError(const char* call, int64_t step) const {
  return ErrorWithDetail(absl::AbortedError(absl::StrCat(
      call, ": job ", job_id_, " was restored from checkpoint ", restored_from_, " at step ", committed_step_,
      " (version ", version_, "); step ", step, " is not the resume step: pull the latest version and resume at step ",
      committed_step_ + 1)));
}

absl::StatusOr<JobSnapshot> Job::SnapshotAt(int64_t committed_step, absl::Time deadline) {
  // The copies' memory is allocated and touched before the lock is taken, so that the copy
  // under the lock (which holds back the step's commit and every pull) is a plain memcpy
  // without page faults: on the machine of docs/benchmarks.md faulting in fresh pages costs
  // as much as copying into them. (On a GPU daemon the source pages still migrate from the
  // device under the lock: managed memory, docs/daemon.md.)
  std::map<Key, std::array<size_t, 3>> sizes;  // master, m, v elements
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, state] : shards_) {
      if (!state->replica) sizes[key] = {state->master.size(), state->m.size(), state->v.size()};
    }
  }
  std::map<Key, JobSnapshot::ShardCopy> buffers;
  for (const auto& [key, n] : sizes) {
    JobSnapshot::ShardCopy& copy = buffers[key];
    copy.master.resize(n[0]);
    copy.m.resize(n[1]);
    copy.v.resize(n[2]);
  }
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || !restore_error_.ok() ||
           (version_ >= 0 && !restoring_ && !applying_ && committed_step_ >= committed_step);
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("WriteCheckpoint: job ", job_id_, " did not decide step ",
                                                    committed_step, " before the deadline (committed step ",
                                                    committed_step_, ")"));
  }
  if (stopping_) return absl::UnavailableError("WriteCheckpoint: the job stopped on this daemon");
  if (!restore_error_.ok()) return absl::FailedPreconditionError(restore_error_.message());
  if (committed_step_ > committed_step) {
    return ErrorWithDetail(absl::FailedPreconditionError(
        absl::StrCat("WriteCheckpoint: job ", job_id_, " has already decided step ", committed_step_,
                     " (asked for the state after step ", committed_step, ")")));
  }
  JobSnapshot snap;
  snap.version = version_;
  snap.committed_step = committed_step_;
  snap.scaling = committed_scaling_;
  for (const auto& [key, state] : shards_) {
    if (state->replica) continue;  // its primary writes it
    if (!state->initialized) {
      return absl::FailedPreconditionError(absl::StrCat("WriteCheckpoint: shard (bucket ", key.first, ", shard ",
                                                        key.second, ") of job ", job_id_, " has no state yet"));
    }
    JobSnapshot::ShardCopy& copy = buffers[key];  // assign() reuses the memory when the size is unchanged
    copy.bucket = key.first;
    copy.shard = key.second;
    copy.master.assign(state->master.begin(), state->master.end());
    copy.m.assign(state->m.begin(), state->m.end());
    copy.v.assign(state->v.begin(), state->v.end());
    snap.shards.push_back(std::move(copy));
  }
  return snap;
}

absl::StatusOr<v1::WriteCheckpointResponse> Job::WriteCheckpoint(const v1::WriteCheckpointRequest& request,
                                                                 absl::Time deadline) {
  if (request.directory_uri().empty()) return absl::InvalidArgumentError("WriteCheckpoint: directory_uri is empty");
  {
    absl::MutexLock lock(&mu_);
    if (request.placement_epoch() != epoch_) {
      return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
          "WriteCheckpoint: job ", job_id_, " is at placement epoch ", epoch_, ", the request names ",
          request.placement_epoch())));
    }
  }
  MAINSTAY_ASSIGN_OR_RETURN(JobSnapshot snap, SnapshotAt(request.committed_step(), deadline));
  checkpoint::CheckpointFs& fs = options_.fs != nullptr ? *options_.fs : *checkpoint::PosixFs();
  MAINSTAY_RETURN_IF_ERROR(fs.CreateDirs(request.directory_uri()));
  const Layout& layout = job_.layout;
  const OptimizerSpec& opt = job_.spec.optimizer;
  const size_t mb = static_cast<size_t>(ElementBytes(opt.moment_dtype));
  v1::WriteCheckpointResponse response;
  response.set_version(snap.version);
  response.set_committed_step(snap.committed_step);
  response.set_moment_type(ElementTypeToProto(opt.moment_dtype));
  response.set_has_second_moment(opt.type == OptimizerType::kAdamW);
  *response.mutable_scaling() = snap.scaling;
  for (const JobSnapshot::ShardCopy& copy : snap.shards) {
    const Bucket& bucket = layout.buckets[static_cast<size_t>(copy.bucket)];
    const Shard& shard = bucket.shards[static_cast<size_t>(copy.shard)];
    std::vector<checkpoint::SectionData> sections;
    for (const TensorFragment& f : shard.fragments) {
      const size_t off = static_cast<size_t>(f.bucket_offset - shard.elements.begin);
      const size_t n = static_cast<size_t>(f.elements.size());
      checkpoint::SectionData s;
      s.tensor_name = layout.tensors[static_cast<size_t>(f.tensor)].name;
      s.begin = f.elements.begin;
      s.end = f.elements.end;
      s.master = std::span<const float>(copy.master.data() + off, n);
      s.m = std::span<const uint8_t>(copy.m.data() + off * mb, n * mb);
      if (!copy.v.empty()) s.v = std::span<const uint8_t>(copy.v.data() + off * mb, n * mb);
      sections.push_back(std::move(s));
    }
    MAINSTAY_ASSIGN_OR_RETURN(
        v1::CheckpointFile file,
        checkpoint::WriteDataFile(fs, request.directory_uri(), copy.bucket, copy.shard, sections));
    *response.add_files() = std::move(file);
  }
  return response;
}

absl::Status Job::LoadRestore(const Restore& restore, const std::vector<std::shared_ptr<ShardState>>& shards,
                              StepInputs& inputs) {
  checkpoint::CheckpointFs& fs = options_.fs != nullptr ? *options_.fs : *checkpoint::PosixFs();
  checkpoint::CheckpointReader reader(fs, restore.dir, restore.manifest);
  const Layout& layout = job_.layout;
  const OptimizerSpec& opt = job_.spec.optimizer;
  const size_t mb = static_cast<size_t>(ElementBytes(opt.moment_dtype));
  const bool adamw = opt.type == OptimizerType::kAdamW;
  for (const auto& state : shards) {
    const Shard& shard = layout.buckets[static_cast<size_t>(state->bucket)].shards[static_cast<size_t>(state->shard)];
    const size_t n = static_cast<size_t>(state->numel);
    // Straight into the scratch buffers the restore's step publishes from (no copy; on a
    // failure they are overwritten by the next step as always). Every element is read.
    ShardState& s = *state;
    kernels::StateMemory& memory = *options_.memory;
    if (s.scratch_master.size() != n) MAINSTAY_RETURN_IF_ERROR(s.scratch_master.Reset(memory, static_cast<int64_t>(n)));
    if (s.scratch_m.size() != n * mb) MAINSTAY_RETURN_IF_ERROR(s.scratch_m.Reset(memory, static_cast<int64_t>(n * mb)));
    if (s.scratch_v.size() != (adamw ? n * mb : 0)) {
      MAINSTAY_RETURN_IF_ERROR(s.scratch_v.Reset(memory, static_cast<int64_t>(adamw ? n * mb : 0)));
    }
    for (const TensorFragment& f : shard.fragments) {
      const size_t off = static_cast<size_t>(f.bucket_offset - shard.elements.begin);
      MAINSTAY_RETURN_IF_ERROR(reader.ReadRange(layout.tensors[static_cast<size_t>(f.tensor)].name, f.elements.begin,
                                                f.elements.end, s.scratch_master.data() + off,
                                                s.scratch_m.data() + off * mb,
                                                adamw ? s.scratch_v.data() + off * mb : nullptr));
    }
  }
  inputs.restored = true;
  ApplyScaling(restore.manifest.scaling());
  inputs.publish_version = restore.manifest.version();
  return absl::OkStatus();
}

void Job::ApplyScaling(const v1::CheckpointScalingState& scaling) {
  const Layout& layout = job_.layout;
  // The scaling state: matched by tensor name (the new job may order or format tensors
  // differently; a tensor that was not delayed-scaled starts fresh, as in a new job).
  std::map<std::string, const v1::TensorScalingState*> by_name;
  for (const v1::TensorScalingState& t : scaling.tensors()) by_name[t.tensor_name()] = &t;
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    auto it = by_name.find(layout.tensors[t].name);
    if (it == by_name.end() || it->second->amax_history().empty()) continue;
    if (Describe(layout.tensors[t].format).scaling != ScalingMode::kDelayed) continue;
    DelayedScaling& d = delayed_[t];
    std::fill(d.history.begin(), d.history.end(), 0.0f);
    for (size_t i = 0; i < d.history.size() && i < static_cast<size_t>(it->second->amax_history_size()); ++i) {
      d.history[i] = it->second->amax_history(static_cast<int>(i));
    }
    d.scale = it->second->scale();
    cast_scale_[t] = it->second->published_scale();
  }
  if (loss_scale_.config.dynamic && scaling.loss_scale() > 0.0) {
    loss_scale_.scale = scaling.loss_scale();
    loss_scale_.good_steps = scaling.loss_scale_good_steps();
    loss_scale_.hysteresis_left = scaling.loss_scale_hysteresis_left();
  }
}

void Job::RunRestore() {
  std::unique_ptr<Restore> restore = std::move(restore_);
  std::vector<std::shared_ptr<ShardState>> shards;
  for (const auto& [key, state] : shards_) shards.push_back(state);
  const std::vector<char> is_replica = RolesLocked(shards);
  const std::vector<std::string> members = members_;
  const int64_t epoch = epoch_;
  executing_step_ = -1;  // the republication's reductions answer RUNNING to peers in doubt
  executing_epoch_ = epoch;
  mu_.Unlock();

  const absl::Time start = absl::Now();
  StepInputs inputs;
  absl::Status loaded = LoadRestore(*restore, shards, inputs);
  absl::StatusOr<StepResult> result = loaded.ok() ? ExecuteStep(-1, inputs, shards, is_replica, members, epoch, {})
                                                  : absl::StatusOr<StepResult>(loaded);

  if (!result.ok()) {
    BreakGroup();                          // a failed collective leaves the group unusable
    (void)options_.memory->Synchronize();  // no kernel of the failed attempt still runs
  }
  mu_.Lock();
  executing_step_ = -2;
  if (!result.ok()) {
    decisions_.erase(-1);
    if (++restore_attempts_ == 1 || epoch != restore_failing_epoch_) {  // (a new placement starts anew)
      restore_failing_since_ = absl::Now();
      restore_failing_epoch_ = epoch;
    }
    // A failed rendezvous or reduction with the peers (they load at their own pace; one may
    // have timed out first) is tried again for kRestoreRetryFor: long enough for any peer still
    // loading, rather than a count of this daemon's own attempts that a slow peer outlasts. A
    // peer whose load failed for good never comes, so the retries end. A checkpoint that does
    // not load here, or any other error, is final.
    const absl::StatusCode code = result.status().code();
    const bool transient = code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
                           code == absl::StatusCode::kAborted;
    const bool retry =
        loaded.ok() && transient && !stopping_ && absl::Now() - restore_failing_since_ < kRestoreRetryFor;
    load_error_ = absl::Status(result.status().code(),
                               absl::StrCat("restoring from checkpoint ", restore->checkpoint_id, " failed (attempt ",
                                            restore_attempts_, "): ", result.status().ToString()));
    Log(LogLevel::kWarning, "daemon",
        absl::StrCat("job ", job_id_, ": ", load_error_.message(), retry ? "; retrying" : ""));
    if (retry) {
      restore_ = std::move(restore);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), kRestoreRetryInterval);
    } else {
      restoring_ = false;
      restore_error_ = absl::Status(result.status().code(),
                                    absl::StrCat("job ", job_id_, ": restoring from checkpoint ",
                                                 restore->checkpoint_id, " failed: ", result.status().message()));
    }
    return;
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    shards[i]->Commit(result->published[i], options_.retained_versions, /*in_place=*/false, PinnedVersionsLocked());
  }
  version_ = inputs.publish_version;
  restoring_ = false;
  restore_attempts_ = 0;
  load_error_ = absl::OkStatus();
  loss_scale_now_ = loss_scale_.scale;
  committed_scaling_ = ScalingProto();
  Log(LogLevel::kInfo, "daemon",
      absl::StrCat("job ", job_id_, ": restored ", shards.size(), " shard(s) from checkpoint ", restore->checkpoint_id,
                   " at step ", committed_step_, ", version ", version_, " in ",
                   absl::FormatDuration(absl::Now() - start)));
}

}  // namespace mainstay::daemon

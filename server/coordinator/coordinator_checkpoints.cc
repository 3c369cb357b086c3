// Checkpoints on the coordinator's side (DESIGN.md section 8, docs/checkpoints.md): choosing
// the step, fanning WriteCheckpoint out to the job's daemons, committing the manifest,
// listing, deleting, restoring, and restoring jobs that lost a daemon.
#include <algorithm>
#include <future>
#include <tuple>

#include "common/error_detail.h"
#include "common/job_spec_proto.h"
#include "server/coordinator/coordinator_impl.h"

namespace mainstay::coordinator {
namespace {

constexpr int kCheckpointAttempts = 5;
constexpr absl::Duration kBackgroundDeadline = absl::Minutes(30);

absl::Status ValidCheckpointId(const std::string& id) {
  if (id.empty()) return absl::InvalidArgumentError("checkpoint_id: must not be empty");
  const bool ok = id != "." && id != ".." && id.size() <= 200 && std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
  if (!ok) return absl::InvalidArgumentError(absl::StrCat("checkpoint_id: '", id, "' is not a checkpoint id"));
  return absl::OkStatus();
}

absl::Status NeedDirectory(const CoordinatorOptions& options) {
  if (options.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints are off: start mainstay-coordinator with --checkpoint-dir (a directory every daemon reaches "
        "under the same path)");
  }
  return absl::OkStatus();
}

v1::CheckpointInfo InfoFromManifest(const v1::CheckpointManifest& m, const std::string& dir) {
  v1::CheckpointInfo info;
  info.set_checkpoint_id(m.checkpoint_id());
  info.set_job_id(m.job_id());
  info.set_job_name(m.job_name());
  info.set_version(m.version());
  info.set_state(v1::CHECKPOINT_STATE_COMMITTED);
  info.set_created_unix_ms(m.created_unix_ms());
  int64_t size = 0;
  for (const v1::CheckpointFile& f : m.files()) size += f.size_bytes();
  info.set_size_bytes(size);
  info.set_file_count(m.files_size());
  info.set_manifest_uri(checkpoint::JoinPath(dir, checkpoint::kManifestName));
  info.set_periodic(m.periodic());
  return info;
}

}  // namespace

checkpoint::CheckpointFs& Coordinator::Impl::Fs() const {
  return options.fs != nullptr ? *options.fs : *checkpoint::PosixFs();
}

v1::CheckpointInfo Coordinator::Impl::RunCheckpoint(v1::CheckpointInfo info, int64_t step, absl::Time deadline) {
  const std::string dir = checkpoint::JoinPath(options.checkpoint_dir, info.checkpoint_id());
  checkpoint::CheckpointFs& fs = Fs();
  absl::Status failure;
  v1::CheckpointManifest manifest;
  for (int attempt = 0; attempt < kCheckpointAttempts; ++attempt) {
    v1::StoredJob job;
    {
      StateLock lock(*this);
      const v1::StoredJob* found = FindJob(info.job_id());
      if (found == nullptr) {
        failure = absl::NotFoundError(absl::StrCat("job ", info.job_id(), " was deleted"));
        break;
      }
      job = *found;
    }
    failure = fs.RemoveAll(dir);
    if (failure.ok()) failure = fs.CreateDirs(dir);
    if (!failure.ok()) break;
    std::vector<std::future<absl::StatusOr<v1::WriteCheckpointResponse>>> answers;
    for (const v1::DaemonEndpoint& daemon : job.placement().daemons()) {
      v1::WriteCheckpointRequest request;
      request.set_job_id(info.job_id());
      request.set_placement_epoch(job.placement().epoch());
      request.set_checkpoint_id(info.checkpoint_id());
      request.set_directory_uri(dir);
      request.set_committed_step(step);
      answers.push_back(std::async(std::launch::async, [this, address = daemon.address(), request, deadline] {
        return options.assigner->WriteCheckpoint(address, request, deadline);
      }));
    }
    std::vector<v1::WriteCheckpointResponse> written;
    int64_t newer_step = -2;
    failure = absl::OkStatus();
    for (auto& answer : answers) {
      absl::StatusOr<v1::WriteCheckpointResponse> r = answer.get();
      if (r.ok()) {
        written.push_back(*std::move(r));
        continue;
      }
      std::optional<v1::ErrorDetail> detail = GetErrorDetail(r.status());
      if (absl::IsFailedPrecondition(r.status()) && detail.has_value() && detail->committed_step() > step) {
        newer_step = std::max(newer_step, detail->committed_step());
      } else if (failure.ok()) {
        failure = r.status();
      }
    }
    if (!failure.ok()) break;
    if (newer_step > step) {  // training moved on while we asked: ask again at the newer step
      step = newer_step;
      failure = absl::AbortedError(absl::StrCat("the job kept deciding steps faster than ", kCheckpointAttempts,
                                                " attempts could catch (last asked for step ", step, ")"));
      continue;
    }
    manifest.set_checkpoint_id(info.checkpoint_id());
    manifest.set_job_id(info.job_id());
    manifest.set_job_name(info.job_name());
    *manifest.mutable_spec() = job.info().spec();
    manifest.set_created_unix_ms(info.created_unix_ms());
    manifest.set_periodic(info.periodic());
    const v1::WriteCheckpointResponse& first = written.front();
    manifest.set_version(first.version());
    manifest.set_committed_step(first.committed_step());
    manifest.set_moment_type(first.moment_type());
    manifest.set_has_second_moment(first.has_second_moment());
    *manifest.mutable_scaling() = first.scaling();
    std::vector<v1::CheckpointFile> files;
    for (const v1::WriteCheckpointResponse& r : written) {
      if (r.version() != first.version() || r.committed_step() != first.committed_step()) {
        failure = absl::InternalError(absl::StrCat("daemons wrote different versions (", r.version(), " and ",
                                                   first.version(), ") for one step"));
      }
      files.insert(files.end(), r.files().begin(), r.files().end());
    }
    std::sort(files.begin(), files.end(), [](const v1::CheckpointFile& a, const v1::CheckpointFile& b) {
      return std::make_pair(a.shard().bucket(), a.shard().shard()) < std::make_pair(b.shard().bucket(), b.shard().shard());
    });
    const int64_t expected = static_cast<int64_t>(job.layout().buckets_size()) * job.info().spec().data_parallel_size();
    if (failure.ok() && static_cast<int64_t>(files.size()) != expected) {
      failure = absl::InternalError(absl::StrCat("the daemons wrote ", files.size(), " shard files, the job has ", expected,
                                                 " shards"));
    }
    for (v1::CheckpointFile& f : files) *manifest.add_files() = std::move(f);
    if (failure.ok() && options.fault_point) options.fault_point("checkpoint-shards-written");
    if (failure.ok()) failure = checkpoint::WriteManifest(fs, dir, manifest);
    break;
  }
  if (failure.ok()) {
    v1::CheckpointInfo done = InfoFromManifest(manifest, dir);
    Log(LogLevel::kInfo, "coordinator",
        absl::StrCat("checkpoint ", done.checkpoint_id(), " of job ", done.job_id(), " committed: version ",
                     done.version(), ", step ", manifest.committed_step(), ", ", done.size_bytes(), " bytes in ",
                     done.file_count(), " files"));
    return done;
  }
  (void)fs.RemoveAll(dir);  // a failed checkpoint leaves nothing behind
  info.set_state(v1::CHECKPOINT_STATE_FAILED);
  info.set_error(std::string(failure.message()));
  Log(LogLevel::kWarning, "coordinator",
      absl::StrCat("checkpoint ", info.checkpoint_id(), " of job ", info.job_id(), " failed: ", failure.ToString()));
  return info;
}

absl::StatusOr<std::pair<v1::CheckpointInfo, int64_t>> Coordinator::Impl::BeginCheckpointLocked(
    const std::string& job_id, bool periodic) {
  if (stopping) return absl::UnavailableError("the coordinator is shutting down");
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, JobOrNotFound(job_id));
  for (const v1::DaemonEndpoint& e : job->placement().daemons()) {
    auto d = state.daemons.find(e.daemon_id());
    if (d == state.daemons.end() || d->second.state() == v1::DAEMON_STATE_DOWN) {
      return absl::UnavailableError(
          absl::StrCat("job ", job_id, ": daemon ", e.daemon_id(), " is down; a checkpoint needs every shard"));
    }
  }
  // The newest step any daemon reported: the others decide it within a step.
  int64_t step = -1;
  if (auto p = progress.find(job_id); p != progress.end()) {
    for (const auto& [daemon, progress] : p->second) step = std::max(step, progress.committed_step());
  }
  v1::CheckpointInfo info;
  info.set_job_id(job_id);
  info.set_job_name(job->info().spec().name());
  info.set_created_unix_ms(Now());
  info.set_checkpoint_id(absl::StrCat(job->info().spec().name(), "-", info.created_unix_ms(), "-", RandomHex(3)));
  info.set_state(v1::CHECKPOINT_STATE_WRITING);
  info.set_periodic(periodic);
  info.set_manifest_uri(checkpoint::JoinPath(checkpoint::JoinPath(options.checkpoint_dir, info.checkpoint_id()),
                                             checkpoint::kManifestName));
  checkpoints_in_flight[info.checkpoint_id()] = info;
  return std::make_pair(info, step);
}

void Coordinator::Impl::EndCheckpoint(const v1::CheckpointInfo& done) {
  {
    StateLock lock(*this);
    if (done.state() == v1::CHECKPOINT_STATE_COMMITTED) {
      checkpoints_in_flight.erase(done.checkpoint_id());
    } else {
      checkpoints_in_flight[done.checkpoint_id()] = done;
    }
  }
  if (done.state() != v1::CHECKPOINT_STATE_COMMITTED || !done.periodic() || options.checkpoint_keep <= 0) return;
  // Retention: the newest `checkpoint_keep` periodic checkpoints of the job stay.
  int kept = 0;
  for (const v1::CheckpointInfo& c : ScanCheckpoints(done.job_id())) {
    if (!c.periodic() || c.state() != v1::CHECKPOINT_STATE_COMMITTED) continue;
    if (++kept <= options.checkpoint_keep) continue;
    absl::Status deleted = DeleteFiles(c.checkpoint_id());
    Log(deleted.ok() ? LogLevel::kInfo : LogLevel::kWarning, "coordinator",
        absl::StrCat("checkpoint retention (keep ", options.checkpoint_keep, "): delete ", c.checkpoint_id(), ": ",
                     deleted.ok() ? "done" : deleted.ToString()));
  }
}

absl::StatusOr<v1::CreateCheckpointResponse> Coordinator::CreateCheckpoint(const v1::CreateCheckpointRequest& request,
                                                                           absl::Time deadline) {
  Impl& s = *impl_;
  MAINSTAY_RETURN_IF_ERROR(NeedDirectory(s.options));
  if (s.options.assigner == nullptr) return absl::FailedPreconditionError("this coordinator cannot reach daemons");
  v1::CheckpointInfo info;
  int64_t step = -1;
  {
    Impl::StateLock lock(s);
    s.TickLocked();
    MAINSTAY_ASSIGN_OR_RETURN(std::tie(info, step), s.BeginCheckpointLocked(request.job_id(), /*periodic=*/false));
    if (!request.wait()) {
      s.StartBackgroundLocked([&s, info, step] {
        s.EndCheckpoint(s.RunCheckpoint(info, step, absl::Now() + kBackgroundDeadline));
      });
      v1::CreateCheckpointResponse response;
      *response.mutable_checkpoint() = info;
      return response;
    }
  }
  v1::CheckpointInfo done = s.RunCheckpoint(info, step, deadline);
  s.EndCheckpoint(done);
  if (done.state() != v1::CHECKPOINT_STATE_COMMITTED) {
    return absl::AbortedError(absl::StrCat("checkpoint ", done.checkpoint_id(), " failed: ", done.error()));
  }
  v1::CreateCheckpointResponse response;
  *response.mutable_checkpoint() = done;
  return response;
}

void Coordinator::Impl::RunCheckpointPolicy() {
  if (options.checkpoint_dir.empty() || options.assigner == nullptr ||
      (options.checkpoint_every_steps <= 0 && options.checkpoint_every_ms <= 0)) {
    return;
  }
  StateLock lock(*this);
  if (stopping) return;
  const int64_t now = Now();
  for (const auto& [job_id, job] : state.jobs) {
    int64_t step = -1;
    if (auto p = progress.find(job_id); p != progress.end()) {
      for (const auto& [daemon, progress] : p->second) step = std::max(step, progress.committed_step());
    }
    auto [last, inserted] = policy_last.try_emplace(job_id, std::make_pair(step, now));
    if (inserted) continue;  // the policy counts from when this coordinator first saw the job
    const bool by_steps = options.checkpoint_every_steps > 0 && step >= last->second.first + options.checkpoint_every_steps;
    const bool by_time = options.checkpoint_every_ms > 0 && now >= last->second.second + options.checkpoint_every_ms &&
                         step > last->second.first;  // an idle job is not checkpointed again
    if (!by_steps && !by_time) continue;
    bool writing = false;
    for (const auto& [id, c] : checkpoints_in_flight) {
      writing |= c.job_id() == job_id && c.state() == v1::CHECKPOINT_STATE_WRITING;
    }
    if (writing) continue;
    absl::StatusOr<std::pair<v1::CheckpointInfo, int64_t>> begun = BeginCheckpointLocked(job_id, /*periodic=*/true);
    if (!begun.ok()) continue;  // a daemon is down: recovery, not a checkpoint, comes next
    last->second = {step, now};
    Log(LogLevel::kInfo, "coordinator",
        absl::StrCat("checkpoint policy: job ", job_id, " at step ", step, " -> ", begun->first.checkpoint_id()));
    StartBackgroundLocked([this, info = begun->first, at = begun->second] {
      EndCheckpoint(RunCheckpoint(info, at, absl::Now() + kBackgroundDeadline));
    });
  }
  for (auto it = policy_last.begin(); it != policy_last.end();) {  // forget deleted jobs
    it = state.jobs.count(it->first) ? std::next(it) : policy_last.erase(it);
  }
}

std::vector<v1::CheckpointInfo> Coordinator::Impl::ScanCheckpoints(const std::string& job_id) {
  checkpoint::CheckpointFs& fs = Fs();
  std::map<std::string, v1::CheckpointInfo> in_flight;
  {
    StateLock lock(*this);
    in_flight = checkpoints_in_flight;
  }
  std::vector<v1::CheckpointInfo> out;
  absl::StatusOr<std::vector<std::string>> names = fs.ListDir(options.checkpoint_dir);
  if (names.ok()) {
    for (const std::string& name : *names) {
      if (in_flight.count(name) || !ValidCheckpointId(name).ok()) continue;
      const std::string dir = checkpoint::JoinPath(options.checkpoint_dir, name);
      absl::StatusOr<v1::CheckpointManifest> manifest = checkpoint::ReadManifest(fs, dir);
      v1::CheckpointInfo info;
      if (manifest.ok()) {
        info = InfoFromManifest(*manifest, dir);
      } else {
        info.set_checkpoint_id(name);
        info.set_manifest_uri(checkpoint::JoinPath(dir, checkpoint::kManifestName));
        info.set_state(absl::IsNotFound(manifest.status()) ? v1::CHECKPOINT_STATE_FAILED : v1::CHECKPOINT_STATE_CORRUPT);
        info.set_error(absl::IsNotFound(manifest.status())
                           ? "no manifest: a write that never finished (delete it)"
                           : std::string(manifest.status().message()));
      }
      if (!job_id.empty() && info.job_id() != job_id) continue;
      out.push_back(std::move(info));
    }
  }
  for (const auto& [id, info] : in_flight) {
    if (job_id.empty() || info.job_id() == job_id) out.push_back(info);
  }
  std::sort(out.begin(), out.end(), [](const v1::CheckpointInfo& a, const v1::CheckpointInfo& b) {
    return std::make_pair(a.created_unix_ms(), a.checkpoint_id()) > std::make_pair(b.created_unix_ms(), b.checkpoint_id());
  });
  return out;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(const v1::ListCheckpointsRequest& request) {
  MAINSTAY_RETURN_IF_ERROR(NeedDirectory(impl_->options));
  v1::ListCheckpointsResponse response;
  for (v1::CheckpointInfo& info : impl_->ScanCheckpoints(request.job_id())) *response.add_checkpoints() = std::move(info);
  return response;
}

absl::Status Coordinator::DeleteCheckpoint(const v1::DeleteCheckpointRequest& request) {
  Impl& s = *impl_;
  MAINSTAY_RETURN_IF_ERROR(NeedDirectory(s.options));
  MAINSTAY_RETURN_IF_ERROR(ValidCheckpointId(request.checkpoint_id()));
  const std::string dir = checkpoint::JoinPath(s.options.checkpoint_dir, request.checkpoint_id());
  {
    Impl::StateLock lock(s);
    auto it = s.checkpoints_in_flight.find(request.checkpoint_id());
    if (it != s.checkpoints_in_flight.end() && it->second.state() == v1::CHECKPOINT_STATE_WRITING) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", request.checkpoint_id(),
                                                        " is being written; delete it once it is done"));
    }
    const bool known = it != s.checkpoints_in_flight.end();
    if (known) s.checkpoints_in_flight.erase(it);
    if (!s.Fs().ListDir(dir).ok()) {
      if (known) return absl::OkStatus();
      return absl::NotFoundError(absl::StrCat("no checkpoint '", request.checkpoint_id(), "'"));
    }
  }
  return s.DeleteFiles(request.checkpoint_id());
}

absl::Status Coordinator::Impl::DeleteFiles(const std::string& checkpoint_id) {
  const std::string dir = checkpoint::JoinPath(options.checkpoint_dir, checkpoint_id);
  // The manifest goes first: a delete cut short leaves an uncommitted (FAILED) directory, never
  // a manifest over missing files.
  MAINSTAY_RETURN_IF_ERROR(Fs().RemoveAll(checkpoint::JoinPath(dir, checkpoint::kManifestName)));
  return Fs().RemoveAll(dir);
}

absl::StatusOr<v1::RestoreCheckpointResponse> Coordinator::Impl::RestoreLocked(v1::StoredJob job,
                                                                               const v1::CheckpointManifest& manifest,
                                                                               const std::string& dir) {
  const std::string job_id = job.info().job_id();
  const int64_t dp = job.info().spec().data_parallel_size();
  std::vector<std::string> owners(static_cast<size_t>(dp));
  for (const v1::ShardPlacement& p : job.placement().shards()) owners[static_cast<size_t>(p.shard().shard())] = p.daemon_id();
  std::vector<DaemonCandidate> candidates = Candidates("");
  std::set<std::string> ready;
  for (const DaemonCandidate& c : candidates) ready.insert(c.id);
  for (int64_t r = 0; r < dp; ++r) {
    std::string& owner = owners[static_cast<size_t>(r)];
    auto d = state.daemons.find(owner);
    if (d != state.daemons.end() && d->second.state() != v1::DAEMON_STATE_DOWN) continue;
    std::vector<std::string> node;
    if (job.info().spec().trainer_nodes_size() == dp) node.push_back(job.info().spec().trainer_nodes(static_cast<int>(r)));
    absl::StatusOr<std::vector<std::string>> target = PlaceRanks(1, node, candidates, job.bytes_per_rank());
    if (!target.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("restoring job ", job_id, ": no ready daemon can take rank ", r,
                                                       ": ", target.status().message()));
    }
    for (DaemonCandidate& c : candidates) {
      if (c.id == (*target)[0]) c.free_bytes -= job.bytes_per_rank();
    }
    owner = (*target)[0];
  }
  // Replicas are placed afresh: every copy loads the checkpoint.
  absl::StatusOr<std::vector<std::vector<std::string>>> replicas =
      PlaceReplicas(owners, std::max(1, job.info().spec().replication_factor()), Candidates(""), job.bytes_per_rank());
  if (!replicas.ok()) return Annotate(replicas.status(), absl::StrCat("restoring job ", job_id));
  v1::StoredJob updated = job;
  *updated.mutable_placement() =
      MakePlacement(job_id, job.placement().epoch() + 1, job.layout().buckets_size(), owners, *replicas);
  updated.mutable_info()->set_placement_epoch(updated.placement().epoch());
  v1::SourceCheckpoint source;
  source.set_checkpoint_id(manifest.checkpoint_id());
  source.set_manifest_uri(checkpoint::JoinPath(dir, checkpoint::kManifestName));
  updated.set_started(true);
  updated.clear_moves();  // every daemon of the new placement loads the checkpoint instead
  *updated.mutable_restored_from() = source;
  updated.set_restored_epoch(updated.placement().epoch());
  auto lost = lost_state.find(job_id);
  std::set<std::string> lost_before;
  if (lost != lost_state.end()) lost_before.swap(lost->second);
  lost_state.erase(job_id);  // every daemon of the new placement loads the checkpoint
  updated.mutable_info()->set_state(HealthOf(updated));
  Batch batch;
  batch.PutJob(updated);
  if (absl::Status saved = Commit(batch); !saved.ok()) {
    if (!lost_before.empty()) lost_state[job_id] = std::move(lost_before);
    return saved;
  }
  progress.erase(job_id);
  for (auto it = resends.begin(); it != resends.end();) it = it->first.first == job_id ? resends.erase(it) : std::next(it);
  SendAssignments(updated, {}, "", &source);
  if (options.assigner != nullptr) {
    std::set<std::string> kept;
    for (const v1::DaemonEndpoint& e : updated.placement().daemons()) kept.insert(e.daemon_id());
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      if (kept.count(e.daemon_id())) continue;
      auto d = state.daemons.find(e.daemon_id());
      if (d == state.daemons.end() || d->second.state() == v1::DAEMON_STATE_DOWN) continue;
      v1::DropShardRequest drop;
      drop.set_job_id(job_id);
      drop.set_placement_epoch(updated.placement().epoch());
      options.assigner->Drop(e.address(), drop);
    }
  }
  Log(LogLevel::kInfo, "coordinator",
      absl::StrCat("job ", job_id, ": restoring from checkpoint ", manifest.checkpoint_id(), " (version ",
                   manifest.version(), ", step ", manifest.committed_step(), ") at placement epoch ",
                   updated.placement().epoch()));
  v1::RestoreCheckpointResponse response;
  response.set_version(manifest.version());
  response.set_placement_epoch(updated.placement().epoch());
  return response;
}

absl::StatusOr<v1::RestoreCheckpointResponse> Coordinator::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& request) {
  Impl& s = *impl_;
  MAINSTAY_RETURN_IF_ERROR(NeedDirectory(s.options));
  MAINSTAY_RETURN_IF_ERROR(ValidCheckpointId(request.checkpoint_id()));
  const std::string dir = checkpoint::JoinPath(s.options.checkpoint_dir, request.checkpoint_id());
  absl::StatusOr<v1::CheckpointManifest> manifest = checkpoint::ReadManifest(s.Fs(), dir);
  if (absl::IsNotFound(manifest.status())) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint '", request.checkpoint_id(), "'"));
  }
  MAINSTAY_RETURN_IF_ERROR(manifest.status());
  // Every byte is checked before anything changes: a damaged checkpoint is refused whole.
  MAINSTAY_RETURN_IF_ERROR(checkpoint::VerifyDataFiles(s.Fs(), dir, *manifest).status());
  const std::string job_id = request.job_id().empty() ? manifest->job_id() : request.job_id();
  Impl::StateLock lock(s);
  s.TickLocked();
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, s.JobOrNotFound(job_id));
  MAINSTAY_ASSIGN_OR_RETURN(JobSpec spec, JobSpecFromProto(job->info().spec()));
  MAINSTAY_ASSIGN_OR_RETURN(ResolvedJob resolved, ResolveJob(spec));
  MAINSTAY_RETURN_IF_ERROR(checkpoint::CheckFitsJob(resolved, *manifest));
  return s.RestoreLocked(*job, *manifest, dir);
}

void Coordinator::Impl::RecoverJobs() {
  std::set<std::string> jobs;
  {
    StateLock lock(*this);
    jobs.swap(jobs_to_recover);
    if (stopping) return;
    // Jobs with replicas go on from their surviving copies; the rest are restored. Jobs short
    // of copies get new replicas (coordinator_replicas.cc).
    for (auto it = jobs.begin(); it != jobs.end();) it = FailoverLocked(*it) ? jobs.erase(it) : std::next(it);
    ReReplicateLocked();
    if (!options.restore_on_daemon_loss || options.checkpoint_dir.empty()) return;
  }
  for (const std::string& job_id : jobs) {
    // Newest first; a checkpoint whose manifest or data files do not verify (a torn copy, a
    // damaged disk) is passed over for the next older one rather than restored, or trusted.
    absl::Status status = absl::NotFoundError("no committed checkpoint");
    for (const v1::CheckpointInfo& c : ScanCheckpoints(job_id)) {
      if (c.state() != v1::CHECKPOINT_STATE_COMMITTED) continue;
      const std::string dir = checkpoint::JoinPath(options.checkpoint_dir, c.checkpoint_id());
      absl::StatusOr<v1::CheckpointManifest> manifest = checkpoint::ReadManifest(Fs(), dir);
      status = manifest.status();
      if (status.ok()) status = checkpoint::VerifyDataFiles(Fs(), dir, *manifest).status();
      if (!status.ok()) {
        Log(LogLevel::kError, "coordinator",
            absl::StrCat("job ", job_id, " lost a daemon; its checkpoint ", c.checkpoint_id(),
                         " does not verify (", status.ToString(), "): trying the next older one"));
        continue;
      }
      StateLock lock(*this);
      const v1::StoredJob* job = FindJob(job_id);
      if (job == nullptr) break;
      status = RestoreLocked(*job, *manifest, dir).status();
      if (!status.ok()) {
        Log(LogLevel::kError, "coordinator",
            absl::StrCat("job ", job_id, " lost a daemon; restoring it from checkpoint ", c.checkpoint_id(),
                         " failed: ", status.ToString()));
      }
      break;
    }
    if (absl::IsNotFound(status)) {
      Log(LogLevel::kWarning, "coordinator",
          absl::StrCat("job ", job_id, " lost a daemon and has no committed checkpoint that verifies: it stays DEGRADED"));
    }
  }
}

}  // namespace mainstay::coordinator

#include "server/daemon/shard_daemon.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/checkpoint/checkpoint_files.h"

namespace mainstay::daemon {

ShardDaemon::ShardDaemon(ShardDaemonOptions options)
    : options_(std::move(options)),
      own_memory_(options_.memory == nullptr ? kernels::HostStateMemory(nullptr) : nullptr),
      memory_(options_.memory != nullptr ? options_.memory : own_memory_.get()) {
  if (options_.reader_bytes_per_sec > 0) reader_limiter_ = std::make_unique<ReaderLimiter>(options_.reader_bytes_per_sec);
  if (options_.metrics == nullptr) return;
  absl::StatusOr<std::unique_ptr<metrics::DaemonMetrics>> m = metrics::DaemonMetrics::Create(options_.metrics);
  if (!m.ok()) {
    Log(LogLevel::kWarning, "daemon", absl::StrCat("running without metrics: ", m.status().ToString()));
    return;
  }
  metrics_ = *std::move(m);
  collector_ = options_.metrics->AddCollector([this] {
    std::vector<std::shared_ptr<Job>> jobs;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, job] : jobs_) jobs.push_back(job);
    }
    int64_t shards = 0, bytes = 0;
    for (const auto& job : jobs) {
      for (const v1::ShardStatus& s : job->ShardStatuses()) {
        ++shards;
        bytes += s.state_bytes();
      }
    }
    metrics_->SetHeld(static_cast<int64_t>(jobs.size()), shards, bytes);
  });
}

ShardDaemon::~ShardDaemon() {
  if (collector_ != 0) options_.metrics->RemoveCollector(collector_);
  Shutdown();
}

void ShardDaemon::set_daemon_id(const std::string& id) {
  absl::MutexLock lock(&mu_);
  daemon_id_ = id;
}

void ShardDaemon::set_checkpoint_root(const std::string& root) {
  absl::MutexLock lock(&mu_);
  checkpoint_root_ = root;
}

absl::Status ShardDaemon::CheckCheckpointPath(const std::string& path, absl::string_view what) const {
  absl::MutexLock lock(&mu_);
  if (!checkpoint_root_.has_value()) return absl::OkStatus();
  return checkpoint::CheckPathUnder(*checkpoint_root_, path, what);
}

std::string ShardDaemon::daemon_id() const {
  absl::MutexLock lock(&mu_);
  return daemon_id_;
}

absl::StatusOr<std::shared_ptr<Job>> ShardDaemon::FindJob(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the daemon is shutting down");
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    // The coordinator assigns shards asynchronously after CreateJob: a trainer may get here
    // first. Retryable; a job that never arrives ends in the caller's deadline.
    return absl::UnavailableError(absl::StrCat("job '", job_id, "' has no shards on this daemon (yet); retry"));
  }
  return it->second;
}

absl::StatusOr<v1::AssignShardResponse> ShardDaemon::AssignShard(const v1::AssignShardRequest& request) {
  if (request.has_from_checkpoint()) {
    MAINSTAY_RETURN_IF_ERROR(
        CheckCheckpointPath(request.from_checkpoint().manifest_uri(), "AssignShard: from_checkpoint.manifest_uri"));
  }
  absl::MutexLock assign_lock(&assign_mu_);
  std::shared_ptr<Job> job;
  int64_t planned = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the daemon is shutting down");
    if (daemon_id_.empty()) return absl::UnavailableError("the daemon has not finished registering; retry");
    auto it = jobs_.find(request.job_id());
    if (it != jobs_.end()) job = it->second;
    MAINSTAY_ASSIGN_OR_RETURN(planned, AdmitLocked(request));
  }
  // A restore replaces the whole job (its state rewinds to the checkpoint), once per
  // (checkpoint, epoch): a retried AssignShard of the same restore is an ordinary Assign.
  const bool replace = job != nullptr && request.has_from_checkpoint() &&
                       job->restored_from() != std::make_pair(request.from_checkpoint().checkpoint_id(),
                                                              request.placement_epoch());
  if (replace) {
    // A stale message (the coordinator restores at a new epoch): it must not rewind the job.
    const int64_t epoch = job->Progress().placement_epoch();
    if (request.placement_epoch() < epoch) {
      return absl::FailedPreconditionError(absl::StrCat("AssignShard for job ", request.job_id(), ": a restore at epoch ",
                                                        request.placement_epoch(), " is older than the job's epoch ",
                                                        epoch));
    }
  }
  if (job != nullptr && !replace) {
    MAINSTAY_RETURN_IF_ERROR(job->Assign(request));
  } else {
    JobOptions options;
    options.memory = memory_;
    options.peers = options_.peers;
    options.daemon_id = daemon_id();
    options.retained_versions = options_.retained_versions;
    options.peer_timeout = options_.peer_timeout;
    options.clock = options_.clock;
    options.metrics = metrics_.get();
    options.fs = options_.fs;
    options.peer_client = options_.peer_client;
    options.faults = options_.faults;
    options.reader_limiter = reader_limiter_.get();
    options.on_change = [this](const std::string& job_id) {
      absl::MutexLock lock(&listener_mu_);
      if (listener_) listener_(job_id);
    };
    MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> created, Job::Create(request, std::move(options)));
    absl::MutexLock lock(&mu_);
    if (replace) {
      auto old = jobs_.find(request.job_id());
      if (old != jobs_.end()) {
        ReapLocked(old->second);
        jobs_.erase(old);
      }
      Log(LogLevel::kInfo, "daemon",
          absl::StrCat("job ", request.job_id(), ": replaced by a restore from checkpoint ",
                       request.from_checkpoint().checkpoint_id(), " at epoch ", request.placement_epoch()));
    }
    auto [it, inserted] = jobs_.emplace(request.job_id(), created);
    if (!inserted) {  // a concurrent AssignShard created it first
      created->Shutdown();
      MAINSTAY_RETURN_IF_ERROR(it->second->Assign(request));
    } else {
      Log(LogLevel::kInfo, "daemon",
          absl::StrCat("job ", request.job_id(), ": assigned ", request.shards_size(), " shard(s) at epoch ",
                       request.placement_epoch()));
    }
    job = it->second;
  }
  {
    absl::MutexLock lock(&mu_);
    // (Unless a DropShard took the job away meanwhile: it would reserve for a job gone.)
    if (auto it = jobs_.find(request.job_id()); it != jobs_.end() && it->second == job) planned_[request.job_id()] = planned;
  }
  v1::AssignShardResponse response;
  for (v1::ShardStatus& s : job->ShardStatuses()) *response.add_shards() = std::move(s);
  return response;
}

absl::StatusOr<int64_t> ShardDaemon::AdmitLocked(const v1::AssignShardRequest& request) const {
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(request.spec());
  if (!spec.ok()) return Annotate(spec.status(), "AssignShard: spec");
  absl::StatusOr<Layout> layout = LayoutFromProto(request.layout());
  if (!layout.ok()) return Annotate(layout.status(), "AssignShard: layout");
  const MemoryPlan plan = PlanMemory(*spec, options_.retained_versions);
  int64_t need = 0;
  int shards = 0;
  for (const v1::ShardPlacement& p : request.placement().shards()) {
    const bool here = p.daemon_id() == daemon_id_ || std::count(p.replica_daemon_ids().begin(),
                                                                p.replica_daemon_ids().end(), daemon_id_) > 0;
    const int32_t b = p.shard().bucket();
    if (!here || b < 0 || b >= static_cast<int32_t>(layout->buckets.size())) continue;
    need += ShardMemoryBytes(layout->buckets[static_cast<size_t>(b)], plan);
    ++shards;
  }
  if (options_.memory_bytes <= 0) return need;
  int64_t others = 0;
  for (const auto& [job_id, bytes] : planned_) {
    if (job_id != request.job_id()) others += bytes;
  }
  if (others + need > options_.memory_bytes) {
    v1::ErrorDetail detail;
    detail.set_memory_needed_bytes(need);
    return AttachErrorDetail(absl::ResourceExhaustedError(absl::StrCat(
        "AssignShard: job ", request.job_id(), " needs ", need, " bytes on daemon ", daemon_id_, " for its ", shards,
        " shard(s) at epoch ", request.placement_epoch(), " (masters, moments, gradients and ", plan.retained_versions,
        " retained versions; docs/daemon.md, Memory), but ", others, " of its --memory-bytes ", options_.memory_bytes,
        " are planned for other jobs; nothing was assigned")), detail);
  }
  return need;
}

int64_t ShardDaemon::planned_bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [job_id, bytes] : planned_) total += bytes;
  return total;
}

absl::Status ShardDaemon::DropShard(const v1::DropShardRequest& request) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it == jobs_.end()) return absl::OkStatus();  // idempotent
    job = it->second;
  }
  MAINSTAY_ASSIGN_OR_RETURN(bool empty, job->Drop(request));
  if (empty) {
    {
      absl::MutexLock lock(&mu_);
      auto it = jobs_.find(request.job_id());
      if (it != jobs_.end() && it->second == job) {
        jobs_.erase(it);
        planned_.erase(request.job_id());
      }
      ReapLocked(job);
    }
    if (metrics_ != nullptr) metrics_->ForgetJob(request.job_id());
    Log(LogLevel::kInfo, "daemon", absl::StrCat("job ", request.job_id(), ": dropped"));
  }
  return absl::OkStatus();
}

void ShardDaemon::ReapLocked(std::shared_ptr<Job> job) {
  job->RequestStop();  // waits end now; the step thread is joined by a reaper
  for (auto r = reapers_.begin(); r != reapers_.end();) {  // join the reapers that are done
    if (r->done->load()) {
      r->thread.join();
      r = reapers_.erase(r);
    } else {
      ++r;
    }
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  reapers_.push_back({std::thread([job, done] {
                        job->Shutdown();
                        done->store(true);
                      }),
                      done});
}

absl::StatusOr<v1::WriteCheckpointResponse> ShardDaemon::WriteCheckpoint(const v1::WriteCheckpointRequest& request,
                                                                         absl::Time deadline) {
  MAINSTAY_RETURN_IF_ERROR(CheckCheckpointPath(request.directory_uri(), "WriteCheckpoint: directory_uri"));
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return job->WriteCheckpoint(request, deadline);
}

absl::StatusOr<std::unique_ptr<PushSession>> ShardDaemon::BeginPush(const v1::PushGradHeader& header) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(header.job_id()));
  return job->BeginPush(header);
}

absl::Status ShardDaemon::CheckJobToken(const std::string& job_id, const std::string& job_token, bool writer) const {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return writer ? job->CheckToken(job_token) : job->CheckReadToken(job_token);
}

absl::StatusOr<v1::PinVersionResponse> ShardDaemon::PinVersion(const v1::PinVersionRequest& request) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return job->PinVersion(request);
}

absl::StatusOr<PullResult> ShardDaemon::PullParams(const v1::PullParamsRequest& request, absl::Time deadline) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return job->PullParams(request, deadline);
}

std::shared_ptr<const QuantizedShard> ShardDaemon::KeptVersion(const v1::PullParamsRequest& request, int64_t version) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(request.job_id());
  return job.ok() ? (*job)->KeptVersion(request, version) : nullptr;
}

absl::Status ShardDaemon::AdmitReaderBytes(const std::string& job_id, int64_t bytes) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->AdmitReaderBytes(bytes);
}

absl::StatusOr<v1::StepStats> ShardDaemon::FinishStep(const v1::FinishStepRequest& request, absl::Time deadline) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return job->FinishStep(request, deadline);
}

absl::StatusOr<v1::StepStats> ShardDaemon::GetStepStats(const v1::GetStepStatsRequest& request) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return job->GetStepStats(request);
}

absl::StatusOr<ShardStateCopy> ShardDaemon::CopyShardForMove(const v1::FetchShardStateRequest& request,
                                                             absl::Time deadline) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  return job->CopyForMove(request, deadline);
}

absl::StatusOr<bool> ShardDaemon::CheckReplicaInput(const v1::ReplicaInputHeader& header) const {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(header.job_id()));
  return job->CheckReplicaInput(header);
}

absl::StatusOr<bool> ShardDaemon::StoreReplicaInput(const v1::ReplicaInputHeader& header,
                                                    std::vector<uint8_t> payload) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(header.job_id()));
  return job->StoreReplicaInput(header, std::move(payload));
}

absl::StatusOr<bool> ShardDaemon::AdoptTrainerCopy(const v1::ReplicaInputHeader& header) {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(header.job_id()));
  return job->AdoptTrainerCopy(header);
}

std::vector<uint8_t> ShardDaemon::SpareBuffer(const std::string& job_id, int64_t bytes) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(job_id);
  if (!job.ok()) return {};
  std::vector<uint8_t> buffer = (*job)->TakeSpareBuffer(bytes);
  buffer.clear();  // keeps the memory: the input is appended chunk by chunk
  return buffer;
}

v1::GetStepOutcomeResponse ShardDaemon::GetStepOutcome(const v1::GetStepOutcomeRequest& request) const {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(request.job_id());
    if (it != jobs_.end()) job = it->second;
  }
  if (job != nullptr) return job->GetStepOutcome(request);
  // Without the job this daemon cannot decide any of its steps.
  v1::GetStepOutcomeResponse response;
  response.set_state(v1::STEP_OUTCOME_STATE_UNDECIDED);
  response.set_committed_step(-1);
  return response;
}

absl::StatusOr<ShardStateCopy> ShardDaemon::ReadShardState(const std::string& job_id, int32_t bucket,
                                                           int32_t shard) const {
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->ReadShardState(bucket, shard);
}

int64_t ShardDaemon::used_bytes() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  int64_t total = 0;
  for (const auto& job : jobs) total += job->state_bytes();
  return total;
}

std::vector<v1::JobProgress> ShardDaemon::Progress() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  std::vector<v1::JobProgress> out;
  for (const auto& job : jobs) out.push_back(job->Progress());
  return out;
}

int ShardDaemon::active_jobs() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

void ShardDaemon::SetChangeListener(std::function<void(const std::string&)> listener) {
  absl::MutexLock lock(&listener_mu_);
  listener_ = std::move(listener);
}

void ShardDaemon::Shutdown() {
  std::map<std::string, std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    jobs.swap(jobs_);
  }
  for (auto& [id, job] : jobs) job->RequestStop();
  for (auto& [id, job] : jobs) job->Shutdown();
  JoinDroppedJobs();
}

void ShardDaemon::JoinDroppedJobs() {
  std::vector<Reaper> reapers;
  {
    absl::MutexLock lock(&mu_);
    reapers.swap(reapers_);
  }
  for (Reaper& r : reapers) r.thread.join();
}

v1::PullParamsHeader PullHeaderOf(const PullResult& result) {
  const QuantizedShard& s = *result.shard;
  v1::PullParamsHeader h;
  h.set_version(s.version);
  h.set_unchanged(result.unchanged);
  h.set_format(FormatToProto(s.format));
  h.mutable_elements()->set_begin(s.elements.begin);
  h.mutable_elements()->set_end(s.elements.end);
  h.set_total_data_bytes(static_cast<int64_t>(s.data.size()));
  if (s.has_scales) h.set_scale_type(ElementTypeToProto(s.scale_type));
  h.set_total_scales(s.num_scales);
  h.set_total_scale_bytes(static_cast<int64_t>(s.scales.size()));
  for (const FragmentMeta& f : s.fragments) {
    v1::FragmentQuantization* q = h.add_fragments();
    q->set_tensor(f.tensor);
    q->mutable_elements()->set_begin(f.elements.begin);
    q->mutable_elements()->set_end(f.elements.end);
    q->set_format(FormatToProto(f.format));
    q->set_scale(f.scale);
    q->set_scale_inv(f.scale_inv);
    q->set_amax(f.amax);
  }
  return h;
}

}  // namespace mainstay::daemon

// Coordinator: jobs, layout and placement.
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "server/coordinator/coordinator_impl.h"

#include "absl/strings/ascii.h"

namespace mainstay::coordinator {

namespace {

constexpr int64_t kFormats = 9;  // Format's values: one buffer (and so one partial bucket) each

// The job's size against the coordinator's bounds, from the spec alone (before its layout, the
// expensive part, is computed). Under the flat and whole-tensor policies a bucket holds at least
// one whole tensor and closes once it reaches bucket_numel, so buckets <= min(tensors,
// elements / bucket_numel + formats).
absl::Status CheckJobSize(const JobSpec& spec, const CoordinatorOptions& o) {
  const int64_t tensors = static_cast<int64_t>(spec.tensors.size());
  if (tensors > o.max_job_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("spec.tensors: ", tensors, " tensors; this coordinator takes at most ",
                                                   o.max_job_tensors, " per job"));
  }
  if (spec.data_parallel_size > o.max_data_parallel_size) {
    return absl::InvalidArgumentError(absl::StrCat("spec.data_parallel_size: ", spec.data_parallel_size,
                                                   "; this coordinator takes at most ", o.max_data_parallel_size));
  }
  int64_t elements = 0;
  for (const TensorSpec& t : spec.tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) {
      if (d <= 0) break;  // ResolveJob names the bad dimension
      n = n > (int64_t{1} << 50) / d ? int64_t{1} << 50 : n * d;
    }
    elements = std::min<int64_t>(elements + n, int64_t{1} << 52);
  }
  const int64_t bucket_numel = spec.bucket_numel > 0 ? spec.bucket_numel : DefaultBucketNumel(spec.data_parallel_size);
  const int64_t buckets = std::min(tensors, elements / std::max<int64_t>(bucket_numel, 1) + 1 + kFormats);
  const int64_t d = std::max<int64_t>(spec.data_parallel_size, 1);
  if (buckets > o.max_job_shards / d) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec: the layout could have up to ", buckets, " buckets x ", d, " shards; this coordinator takes at most ",
        o.max_job_shards, " (bucket, shard) pairs per job: raise bucket_numel or lower data_parallel_size"));
  }
  return absl::OkStatus();
}

// A caller's own job_token (CreateJobRequest.job_token): long and plain enough to be a secret
// that survives being passed around in files and environment variables.
absl::Status CheckCallerToken(const std::string& token) {
  if (token.empty()) return absl::OkStatus();
  if (token.size() < 32 || token.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("job_token: 32 to 256 characters, got ", token.size()));
  }
  for (const char c : token) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') {
      return absl::InvalidArgumentError("job_token: only [0-9A-Za-z_-]");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::CreateJobResponse> Coordinator::CreateJob(const v1::CreateJobRequest& request) {
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(request.spec());
  if (!spec.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.", spec.status().message()));
  MAINSTAY_RETURN_IF_ERROR(CheckJobSize(*spec, impl_->options));
  absl::StatusOr<ResolvedJob> resolved = ResolveJob(*spec);
  if (!resolved.ok()) return absl::Status(resolved.status().code(), absl::StrCat("spec.", resolved.status().message()));

  MAINSTAY_RETURN_IF_ERROR(CheckCallerToken(request.job_token()));

  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  for (const auto& [id, job] : s.state.jobs) {
    if (!request.request_id().empty() && job.request_id() == request.request_id()) {
      // The retry of a CreateJob that was committed: the same job, and the same token, which
      // is the one this coordinator made (kept in memory only) or the caller's own.
      const std::string& chosen = request.job_token();
      auto made = s.tokens.find(id);
      if (!chosen.empty() && Sha256(chosen) != job.job_token_sha256()) {
        return absl::FailedPreconditionError(absl::StrCat("request ", request.request_id(), " created job ", id,
                                                          " with another job_token"));
      }
      if (chosen.empty() && made == s.tokens.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "request ", request.request_id(), " already created job ", id,
            "; its token is not kept here (only its hash: the first call chose it, or this coordinator restarted or "
            "took over since). Retry with that job_token, or delete and recreate (a CreateJob that sets job_token "
            "as well as request_id can be retried across a restart)"));
      }
      v1::CreateJobResponse response;
      response.set_job_id(id);
      response.set_job_token(chosen.empty() ? made->second : chosen);
      *response.mutable_job() = job.info();
      return response;
    }
    if (job.info().spec().name() == spec->name) {
      return absl::AlreadyExistsError(absl::StrCat("spec.name: a job named '", spec->name, "' exists (", id, ")"));
    }
  }
  // What each copy of a rank holds on a daemon (common/job_spec.h, MemoryPlan; the daemon's own
  // --retained-versions may make it refuse the assignment, and the rank is then placed elsewhere).
  const int64_t bytes_per_rank = RankMemoryBytes(resolved->layout, PlanMemory(*spec));
  MAINSTAY_ASSIGN_OR_RETURN(std::vector<std::string> owners,
                            PlaceRanks(spec->data_parallel_size, spec->trainer_nodes, s.Candidates(""), bytes_per_rank));
  MAINSTAY_ASSIGN_OR_RETURN(std::vector<std::vector<std::string>> replicas,
                            PlaceReplicas(owners, spec->replication_factor, s.Candidates(""), bytes_per_rank));

  v1::StateCounters counters = s.state.counters;
  counters.set_next_job(counters.next_job() + 1);
  const std::string job_id = absl::StrCat("job-", counters.next_job());
  const std::string token = request.job_token().empty() ? RandomHex(32) : request.job_token();
  v1::StoredJob job;
  job.set_request_id(request.request_id());
  job.set_job_token_sha256(Sha256(token));
  job.set_bytes_per_rank(bytes_per_rank);
  LayoutToProto(resolved->layout, job.mutable_layout());
  *job.mutable_placement() =
      s.MakePlacement(job_id, 1, static_cast<int>(resolved->layout.buckets.size()), owners, replicas);
  if (const int64_t bytes = static_cast<int64_t>(job.placement().ByteSizeLong()); bytes > s.options.max_placement_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec: the job's placement would take ", bytes,
                                                   " bytes; this coordinator sends at most ", s.options.max_placement_bytes,
                                                   ": raise bucket_numel or lower data_parallel_size"));
  }
  v1::JobInfo* info = job.mutable_info();
  info->set_job_id(job_id);
  JobSpecToProto(*spec, info->mutable_spec());
  info->set_state(v1::JOB_STATE_READY);
  info->set_created_unix_ms(s.Now());
  info->set_placement_epoch(1);
  info->set_committed_step(-1);
  info->set_version(0);
  info->set_num_buckets(static_cast<int32_t>(resolved->layout.buckets.size()));
  info->set_total_numel(TotalNumel(resolved->layout));
  info->set_data_numel(TotalDataNumel(resolved->layout));
  Batch batch;
  batch.PutJob(job);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch, counters));
  // Only a token this coordinator made is kept in memory, to answer a retry until a restart;
  // one the caller chose must be presented again.
  if (request.job_token().empty()) s.tokens[job_id] = token;
  s.SendAssignments(job, {}, "");
  Log(LogLevel::kInfo, "coordinator", absl::StrCat("job ", job_id, " '", spec->name, "' created: D=",
                                                   spec->data_parallel_size, ", ", info->num_buckets(), " bucket(s)"));
  v1::CreateJobResponse response;
  response.set_job_id(job_id);
  response.set_job_token(token);
  *response.mutable_job() = job.info();
  return response;
}

absl::StatusOr<v1::GetJobResponse> Coordinator::GetJob(const v1::GetJobRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, s.JobForCaller(request.job_id(), request.job_token()));
  v1::GetJobResponse response;
  v1::StepStats last;
  *response.mutable_job() = s.InfoWithProgress(*job, &last);
  if (last.step() != 0 || last.version() != 0) *response.mutable_last_step_stats() = last;
  return response;
}

v1::ListJobsResponse Coordinator::ListJobs(const v1::ListJobsRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  std::vector<v1::JobInfo> jobs;
  for (const auto& [id, job] : s.state.jobs) jobs.push_back(s.InfoWithProgress(job));
  std::sort(jobs.begin(), jobs.end(), [](const v1::JobInfo& a, const v1::JobInfo& b) {
    return a.created_unix_ms() != b.created_unix_ms() ? a.created_unix_ms() < b.created_unix_ms()
                                                      : a.job_id() < b.job_id();
  });
  v1::ListJobsResponse response;
  for (v1::JobInfo& info : jobs) *response.add_jobs() = std::move(info);
  return response;
}

absl::Status Coordinator::DeleteJob(const v1::DeleteJobRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* found, s.JobOrNotFound(request.job_id()));
  const v1::StoredJob job = *found;
  Batch batch;
  batch.DeleteJob(job.info().job_id());
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch));
  s.tokens.erase(job.info().job_id());
  s.progress.erase(job.info().job_id());
  s.refused_at.erase(job.info().job_id());
  if (s.options.assigner != nullptr) {
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      v1::DropShardRequest drop;
      drop.set_job_id(job.info().job_id());
      drop.set_placement_epoch(job.placement().epoch() + 1);
      s.options.assigner->Drop(e.address(), drop);  // no shards listed: all of the job's
    }
  }
  Log(LogLevel::kInfo, "coordinator", absl::StrCat("job ", job.info().job_id(), " deleted"));
  return absl::OkStatus();
}

absl::StatusOr<v1::GetReaderTokenResponse> Coordinator::GetReaderToken(const v1::GetReaderTokenRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* found,
                            s.JobForCaller(request.job_id(), request.job_token(), Impl::Access::kTrainer));
  v1::GetReaderTokenResponse response;
  if (!found->reader_token().empty() && !request.rotate()) {
    response.set_reader_token(found->reader_token());
    return response;
  }
  if (found->moves_size() > 0) {
    // (A move's target is sent its assignment from the move's source: not one to re-send now.)
    return absl::UnavailableError(absl::StrCat("job ", request.job_id(),
                                               ": a shard move is in progress; ask for the reader token once it is done"));
  }
  v1::StoredJob job = *found;
  job.set_reader_token(RandomHex(32));
  Batch batch;
  batch.PutJob(job);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch));
  // Every holder gets its shards again at the same epoch, now with the reader token's hash (an
  // ordinary re-send for the daemon: it holds them already).
  for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
    const bool restore = job.has_restored_from() && job.restored_epoch() == job.placement().epoch();
    s.SendAssignmentTo(job, e.daemon_id(), restore ? &job.restored_from() : nullptr);
  }
  Log(LogLevel::kInfo, "coordinator",
      absl::StrCat("job ", job.info().job_id(), ": reader token ", request.rotate() ? "rotated" : "created"));
  response.set_reader_token(job.reader_token());
  return response;
}

absl::StatusOr<v1::GetLayoutResponse> Coordinator::GetLayout(const v1::GetLayoutRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, s.JobForCaller(request.job_id(), request.job_token()));
  v1::GetLayoutResponse response;
  *response.mutable_layout() = job->layout();
  // The version the daemons last reported (the stored one is the version at creation or at the
  // last restore): a re-attaching trainer starts from it.
  response.set_version(s.InfoWithProgress(*job).version());
  return response;
}

absl::StatusOr<v1::GetPlacementResponse> Coordinator::GetPlacement(const v1::GetPlacementRequest& request) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, s.JobForCaller(request.job_id(), request.job_token()));
  v1::GetPlacementResponse response;
  *response.mutable_placement() = job->placement();
  return response;
}

absl::StatusOr<v1::Placement> Coordinator::WaitPlacement(const std::string& job_id, const std::string& job_token,
                                                          int64_t known_epoch, absl::Time deadline) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  while (true) {
    MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, s.JobForCaller(job_id, job_token));
    if (job->placement().epoch() > known_epoch) return job->placement();
    if (s.changed.WaitWithDeadline(&s.mu, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("placement of ", job_id, " still at epoch ", known_epoch, " at the deadline"));
    }
  }
}

}  // namespace mainstay::coordinator

// The protocol side of a job: assignment, pulls, FinishStep, state copies and progress.
// Pushes are staged in job_push.cc, the step thread's arithmetic and commit are in
// job_step.cc, the agreed outcome of a step in job_outcome.cc, checkpoints in
// job_checkpoint.cc.
#include "server/daemon/job.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/logging.h"
#include "common/status.h"
#include "mainstay/v1/common.pb.h"
#include "common/error_detail.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {
namespace {

std::string Sha256(const std::string& text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}


}  // namespace

absl::StatusOr<std::shared_ptr<Job>> Job::Create(const v1::AssignShardRequest& assign, JobOptions options) {
  if (assign.job_id().empty()) return absl::InvalidArgumentError("AssignShard: job_id is empty");
  absl::StatusOr<JobSpec> spec = JobSpecFromProto(assign.spec());
  if (!spec.ok()) return Annotate(spec.status(), "AssignShard: spec");
  absl::StatusOr<ResolvedJob> resolved = ResolveJob(*spec);
  if (!resolved.ok()) return Annotate(resolved.status(), "AssignShard: spec");
  if (assign.job_token_sha256().size() != SHA256_DIGEST_LENGTH) {
    // Every job has a token; a job without one would let any client push, pull or finish steps.
    return absl::InvalidArgumentError(absl::StrCat("AssignShard: job_token_sha256 of job ", assign.job_id(), " has ",
                                                   assign.job_token_sha256().size(), " bytes, not the ",
                                                   SHA256_DIGEST_LENGTH, " of a SHA-256"));
  }
  absl::StatusOr<Layout> layout = LayoutFromProto(assign.layout());
  if (!layout.ok()) return Annotate(layout.status(), "AssignShard: layout");
  if (!(*layout == resolved->layout)) {
    return absl::InvalidArgumentError(
        "AssignShard: the layout does not match the one computed from the spec (coordinator and daemon versions "
        "differ?)");
  }
  std::unique_ptr<Restore> restore;
  if (assign.has_from_checkpoint()) {
    const v1::SourceCheckpoint& source = assign.from_checkpoint();
    // The id is how the job knows it was restored (no initial parameters, replaced once).
    if (source.checkpoint_id().empty()) {
      return absl::InvalidArgumentError("AssignShard: from_checkpoint.checkpoint_id is empty");
    }
    restore = std::make_unique<Restore>();
    restore->checkpoint_id = source.checkpoint_id();
    const size_t slash = source.manifest_uri().rfind('/');
    restore->dir = slash == std::string::npos ? "." : source.manifest_uri().substr(0, slash);
    checkpoint::CheckpointFs& fs = options.fs != nullptr ? *options.fs : *checkpoint::PosixFs();
    absl::StatusOr<v1::CheckpointManifest> manifest = checkpoint::ReadManifest(fs, restore->dir);
    if (!manifest.ok()) return Annotate(manifest.status(), absl::StrCat("AssignShard: checkpoint ", source.checkpoint_id()));
    MAINSTAY_RETURN_IF_ERROR(checkpoint::CheckFitsJob(*resolved, *manifest));
    restore->manifest = *std::move(manifest);
  }
  std::shared_ptr<Job> job(new Job(assign.job_id(), *std::move(resolved), assign.job_token_sha256(), std::move(options)));
  {
    absl::MutexLock lock(&job->mu_);
    job->committed_scaling_ = job->ScalingProto();
    if (restore != nullptr) {
      job->restored_from_ = restore->checkpoint_id;
      job->restored_epoch_ = assign.placement_epoch();
      job->restored_version_ = restore->manifest.version();
      job->committed_step_ = restore->manifest.committed_step();
      job->next_step_ = restore->manifest.committed_step() + 1;
      job->rewound_ = true;
      job->restoring_ = true;
      job->restore_ = std::move(restore);
    }
    // A job that arrives by a move has no state until its shards are copied (job_move.cc).
    // One that gains no shard has no copy to wait for (nothing would ever end the wait).
    if (assign.has_from_peer() && assign.shards_size() > 0) job->restoring_ = true;
  }
  MAINSTAY_RETURN_IF_ERROR(job->Assign(assign));
  job->step_thread_ = std::thread([raw = job.get()] { raw->RunSteps(); });
  return job;
}

Job::Job(std::string job_id, ResolvedJob resolved, std::string token_sha256, JobOptions options)
    : job_id_(std::move(job_id)),
      job_(std::move(resolved)),
      token_sha256_(std::move(token_sha256)),
      options_(std::move(options)),
      plan_(job_.layout),
      num_groups_(NumParamGroups(job_.layout)),
      loss_scale_(job_.recipe.model_dtype == Format::kFP16 ? job_.recipe.loss_scaling : LossScaling{}) {
  delayed_.assign(job_.layout.tensors.size(), DelayedScaling(job_.recipe.fp8_amax_history_len));
  cast_scale_.assign(job_.layout.tensors.size(), 1.0f);
  loss_scale_now_ = loss_scale_.scale;
}

Job::~Job() { Shutdown(); }

void Job::RequestStop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  Changed();
}

void Job::Shutdown() {
  RequestStop();
  if (step_thread_.joinable() && step_thread_.get_id() != std::this_thread::get_id()) step_thread_.join();
}

namespace {

// Constant time: how much of a guess matched must not show in the answer's timing.
bool DigestMatches(const std::string& digest, const std::string& expected) {
  return expected.size() == SHA256_DIGEST_LENGTH &&
         CRYPTO_memcmp(digest.data(), expected.data(), SHA256_DIGEST_LENGTH) == 0;
}

}  // namespace

absl::Status Job::CheckToken(const std::string& token) const {
  if (token.empty()) return absl::UnauthenticatedError(absl::StrCat("job ", job_id_, ": job_token is required"));
  const std::string digest = Sha256(token);
  if (DigestMatches(digest, token_sha256_)) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    if (DigestMatches(digest, reader_sha256_)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "job ", job_id_, ": a reader token can only pull published versions; this call needs the job_token"));
    }
  }
  return absl::PermissionDeniedError(absl::StrCat("job ", job_id_, ": the job_token is not this job's"));
}

absl::Status Job::CheckReadToken(const std::string& token, bool* reader) const {
  if (reader != nullptr) *reader = false;
  if (token.empty()) {
    return absl::UnauthenticatedError(absl::StrCat("job ", job_id_, ": a job_token or reader token is required"));
  }
  const std::string digest = Sha256(token);
  if (DigestMatches(digest, token_sha256_)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (DigestMatches(digest, reader_sha256_)) {
    if (reader != nullptr) *reader = true;
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("job ", job_id_, ": the token is neither this job's job_token nor its current reader token"));
}

absl::Status Job::ErrorWithDetail(absl::Status status) const {
  v1::ErrorDetail detail;
  detail.set_placement_epoch(epoch_);
  detail.set_committed_step(committed_step_);
  detail.set_version(version_);
  return AttachErrorDetail(std::move(status), detail);
}

absl::Status Job::CheckRoute(int64_t epoch, int32_t bucket, int32_t shard) const {
  if (!restore_error_.ok()) return absl::FailedPreconditionError(restore_error_.message());
  if (epoch > epoch_) {
    return absl::UnavailableError(absl::StrCat("job ", job_id_, ": this daemon has not received placement epoch ",
                                               epoch, " yet (it has ", epoch_, "); retry"));
  }
  if (bucket < 0 || bucket >= static_cast<int32_t>(job_.layout.buckets.size())) {
    return absl::NotFoundError(absl::StrCat("job ", job_id_, ": no bucket ", bucket, " (the layout has ",
                                            job_.layout.buckets.size(), ")"));
  }
  if (shard < 0 || shard >= job_.layout.data_parallel_size) {
    return absl::InvalidArgumentError(absl::StrCat("shard ", shard, " is outside [0, ", job_.layout.data_parallel_size, ")"));
  }
  if (Fenced() && epoch < fence_epoch_) return FencedError("this call");
  auto it = shards_.find({bucket, shard});
  if (it == shards_.end()) {
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id_, ": this daemon does not own ", ShardName(bucket, shard), " at placement epoch ", epoch_,
        "; re-read the placement")));
  }
  if (it->second->replica) {
    auto owner = owners_.find(it->first);
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id_, ": this daemon holds a replica of ", ShardName(bucket, shard), " at placement epoch ", epoch_,
        "; its primary is daemon ", owner == owners_.end() ? std::string("?") : owner->second,
        ": re-read the placement")));
  }
  if (it->second->incoming) {
    return absl::UnavailableError(absl::StrCat("job ", job_id_, ": ", ShardName(bucket, shard),
                                               " is being copied here from its previous daemon; retry"));
  }
  return absl::OkStatus();
}

absl::Status Job::ApplyPlacement(const v1::AssignShardRequest& request) {
  if (request.placement_epoch() < epoch_) {
    return absl::FailedPreconditionError(absl::StrCat("AssignShard for job ", job_id_, ": epoch ",
                                                      request.placement_epoch(), " is older than ", epoch_));
  }
  std::map<Key, std::string> owners;
  std::map<Key, std::vector<std::string>> replicas;
  std::set<std::string> members;
  for (const v1::ShardPlacement& p : request.placement().shards()) {
    const Key key{p.shard().bucket(), p.shard().shard()};
    owners[key] = p.daemon_id();
    members.insert(p.daemon_id());
    for (const std::string& r : p.replica_daemon_ids()) {
      if (r == p.daemon_id()) {
        return absl::InvalidArgumentError(absl::StrCat("AssignShard: daemon ", r, " is both the primary and a replica of ",
                                                       ShardName(key.first, key.second)));
      }
      replicas[key].push_back(r);
      members.insert(r);
    }
  }
  // What the placement makes of this daemon for a shard: its primary, a replica, or neither.
  auto holds = [&](const Key& key) {
    auto owner = owners.find(key);
    if (owner == owners.end()) return true;  // (a placement always lists every shard)
    if (owner->second == options_.daemon_id) return true;
    auto r = replicas.find(key);
    return r != replicas.end() && std::count(r->second.begin(), r->second.end(), options_.daemon_id) > 0;
  };
  auto is_replica = [&](const Key& key) {
    auto owner = owners.find(key);
    return owner != owners.end() && owner->second != options_.daemon_id;
  };
  for (const v1::ShardRef& ref : request.shards()) {
    const Key key{ref.bucket(), ref.shard()};
    if (key.first < 0 || key.first >= static_cast<int32_t>(job_.layout.buckets.size()) || key.second < 0 ||
        key.second >= job_.layout.data_parallel_size) {
      return absl::InvalidArgumentError(absl::StrCat("AssignShard: ", ShardName(key.first, key.second),
                                                     " is not in the layout"));
    }
    if (request.has_from_peer() && request.from_peer().daemon().daemon_id().empty()) {
      return absl::InvalidArgumentError("AssignShard: from_peer names no daemon");
    }
    if (request.has_from_checkpoint() && request.from_checkpoint().checkpoint_id() != restored_from_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "AssignShard: job ", job_id_, " already runs here; a restore from checkpoint ",
          request.from_checkpoint().checkpoint_id(), " replaces the whole job (ShardDaemon does that)"));
    }
  }
  epoch_ = request.placement_epoch();
  reader_sha256_ = request.reader_token_sha256();  // the newest assignment's: a rotation re-sends them
  Changed();
  // Shards this placement gives to another daemon stop being served here; their state stays
  // for the new owner's copy until DropShard (a move). One given back is served again.
  for (auto it = shards_.begin(); it != shards_.end();) {
    if (!holds(it->first)) {
      released_.insert(it->first);
      moving_out_[it->first] = it->second;
      it = shards_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = moving_out_.begin(); it != moving_out_.end();) {
    if (holds(it->first)) {
      shards_[it->first] = it->second;
      it = moving_out_.erase(it);
    } else {
      ++it;
    }
  }
  // A replica promoted to primary (its primary was lost: failover) serves the trainers from now
  // on; its forwarded inputs not applied are dropped (the trainers push the step to it again).
  // A primary turned replica drops the trainers' pushes it held.
  for (auto& [key, state] : shards_) {
    const bool replica = is_replica(key);
    if (state->replica == replica) continue;
    Log(LogLevel::kInfo, "daemon",
        absl::StrCat("job ", job_id_, ": ", ShardName(key.first, key.second), " is ", replica ? "a replica" : "the primary",
                     " here from placement epoch ", request.placement_epoch()));
    state->replica = replica;
    for (auto& [step, in] : replica_inputs_) in.erase(key);
    for (auto& [step, in] : pending_) in.shards.erase(key);
  }
  // Trainers' copies are kept only for replicas this daemon still holds.
  for (auto& [step, copies] : trainer_copies_) {
    for (auto it = copies.begin(); it != copies.end();) {
      auto held = shards_.find(it->first);
      it = held == shards_.end() || !held->second->replica ? copies.erase(it) : std::next(it);
    }
  }
  std::erase_if(trainer_copies_, [](const auto& entry) { return entry.second.empty(); });

  members_.assign(members.begin(), members.end());
  // Daemons that left keep their endpoints: a step's members are asked about its outcome after
  // a newer placement dropped some of them (a move's fenced source may hold the decision).
  for (const v1::DaemonEndpoint& e : request.placement().daemons()) endpoints_[e.daemon_id()] = e;
  MoveIn move_in{request.from_peer().daemon(), {}, request.placement_epoch()};
  for (const v1::ShardRef& ref : request.shards()) {
    const Key key{ref.bucket(), ref.shard()};
    if (auto held = shards_.find(key); held != shards_.end()) {
      // Still waiting for its copy: a re-sent move (its earlier copy failed, or is superseded by
      // this newer epoch) copies it from this request's source, or it would wait for ever.
      if (request.has_from_peer() && held->second->incoming) move_in.keys.push_back(key);
      // A shard this daemon let go (given to another daemon, or copied away under a fence) and
      // now given back with a copy to make: what it kept may be steps behind (the rank went on
      // elsewhere, e.g. on a promoted replica, after the move was abandoned), so it is dropped
      // and copied like a new shard. Without `from_peer` (a move called off before the rank
      // went on) it is served again as it is; a re-sent move to a shard already copied here is
      // not copied again.
      if (!request.has_from_peer() || held->second->incoming || !released_.count(key)) continue;
      Log(LogLevel::kInfo, "daemon",
          absl::StrCat("job ", job_id_, ": ", ShardName(key.first, key.second), " comes back at placement epoch ",
                       request.placement_epoch(), " with a copy from daemon ", request.from_peer().daemon().daemon_id(),
                       "; the state kept here since it left is dropped"));
      shards_.erase(held);
    }
    auto state = std::make_shared<ShardState>();
    state->bucket = key.first;
    state->shard = key.second;
    state->numel = job_.layout.buckets[static_cast<size_t>(key.first)].shard_numel;
    state->replica = is_replica(key);
    if (request.has_from_peer()) {
      state->incoming = true;
      move_in.keys.push_back(key);
    } else if (!request.has_from_checkpoint()) {
      shards_to_touch_.push_back(state);
    }
    shards_[key] = std::move(state);
  }
  if (!move_in.keys.empty()) {
    moves_in_.push_back(std::move(move_in));
    load_error_ = absl::OkStatus();  // a new load: an older one's failure says nothing of it
  }
  owners_ = std::move(owners);  // (last: the lambdas above read them)
  replicas_ = std::move(replicas);
  return absl::OkStatus();
}

absl::Status Job::Assign(const v1::AssignShardRequest& request) {
  absl::MutexLock lock(&mu_);
  return ApplyPlacement(request);
}

absl::StatusOr<bool> Job::Drop(const v1::DropShardRequest& request) {
  absl::MutexLock lock(&mu_);
  if (request.placement_epoch() < epoch_) {
    return absl::FailedPreconditionError(absl::StrCat("DropShard for job ", job_id_, ": epoch ",
                                                      request.placement_epoch(), " is older than ", epoch_));
  }
  epoch_ = request.placement_epoch();
  Changed();
  if (request.shards().empty()) {
    shards_.clear();
    moving_out_.clear();
    released_.clear();
  } else {
    for (const v1::ShardRef& ref : request.shards()) {
      shards_.erase({ref.bucket(), ref.shard()});
      moving_out_.erase({ref.bucket(), ref.shard()});
      released_.erase({ref.bucket(), ref.shard()});
    }
  }
  return shards_.empty() && moving_out_.empty();
}

bool Job::Decided(int64_t step) const {
  if (step < 0) return version_ >= 0;
  return committed_step_ >= step && version_ >= 0;
}

bool Job::Ready(int64_t step) const {
  if (shards_.empty()) return false;
  auto it = pending_.find(step);
  if (it == pending_.end()) return false;
  const StepInputs& in = it->second;
  std::set<int32_t> ranks;
  for (const auto& [key, state] : shards_) {
    if (state->replica) continue;  // its input comes from the primary, taken mid-step
    auto sit = in.shards.find(key);
    if (sit == in.shards.end()) return false;
    if (static_cast<int32_t>(sit->second.by_rank.size()) < sit->second.num_contributors) return false;
    for (const auto& [rank, bytes] : sit->second.by_rank) ranks.insert(rank);
  }
  if (step < 0) return true;
  for (int32_t r : ranks) {
    if (!in.finished.count(r)) return false;
  }
  return true;
}

bool Job::ShouldWake() const {
  return stopping_ || restore_ != nullptr || !moves_in_.empty() || !shards_to_touch_.empty() ||
         (!Fenced() && Ready(next_step_));
}

absl::StatusOr<PullResult> Job::PullParams(const v1::PullParamsRequest& request, absl::Time deadline) {
  bool reader = false;
  MAINSTAY_RETURN_IF_ERROR(CheckReadToken(request.job_token(), &reader));
  absl::StatusOr<PullResult> result = PullAfterTokenCheck(request, deadline);
  if (!reader || !result.ok() || result->shard == nullptr) return result;
  result->reader = true;
  if (request.delta_chunk_bytes() != 0) return result;  // charged for what the delta sends
  // A reader's pull: counted, and within the daemon's reader cap (mainstayd --reader-bytes-per-sec).
  MAINSTAY_RETURN_IF_ERROR(AdmitReaderBytes(
      result->unchanged ? 0 : static_cast<int64_t>(result->shard->data.size() + result->shard->scales.size())));
  return result;
}

absl::Status Job::AdmitReaderBytes(int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();  // nothing to send: not held back by the cap's debt
  if (options_.reader_limiter != nullptr) {
    if (const int64_t wait_ms = options_.reader_limiter->Admit(bytes, options_.clock->NowUnixMs()); wait_ms > 0) {
      if (options_.metrics != nullptr) options_.metrics->ReaderThrottled(job_id_);
      return absl::UnavailableError(absl::StrCat(
          "PullParams: readers of this daemon are capped at ", options_.reader_limiter->bytes_per_sec(),
          " bytes/s (mainstayd --reader-bytes-per-sec); retry in ", wait_ms, " ms"));
    }
  }
  if (options_.metrics != nullptr) options_.metrics->ReaderPulled(job_id_, bytes);
  return absl::OkStatus();
}

std::shared_ptr<const QuantizedShard> Job::KeptVersion(const v1::PullParamsRequest& request, int64_t version) {
  if (!CheckReadToken(request.job_token(), nullptr).ok()) return nullptr;
  v1::PullParamsRequest at = request;
  at.set_version(version);
  at.set_latest(false);
  at.set_no_wait(true);
  absl::StatusOr<PullResult> result = PullAfterTokenCheck(at, absl::InfinitePast());
  if (!result.ok() || result->unchanged || result->shard == nullptr || result->shard->version != version) return nullptr;
  return result->shard;
}

absl::StatusOr<PullResult> Job::PullAfterTokenCheck(const v1::PullParamsRequest& request, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  MAINSTAY_RETURN_IF_ERROR(CheckRoute(request.placement_epoch(), request.bucket(), request.shard()));
  const Key key{request.bucket(), request.shard()};
  int64_t wanted = request.version();
  if (request.latest()) {
    // A job being restored has its version once the restore is done.
    auto known = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stopping_ || !restoring_ || !restore_error_.ok();
    };
    if (!known()) {
      if (request.no_wait()) return absl::UnavailableError("PullParams: the job is being restored; retry");
      if (!mu_.AwaitWithDeadline(absl::Condition(&known), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("PullParams: job ", job_id_, " is still being restored"));
      }
      MAINSTAY_RETURN_IF_ERROR(CheckRoute(request.placement_epoch(), request.bucket(), request.shard()));
    }
    wanted = std::max<int64_t>(version_, 0);
  } else if (wanted < 0) {
    return absl::InvalidArgumentError(absl::StrCat("PullParams: version ", wanted, " < 0"));
  }

  // Checked even while the restore is loading: a trainer that was ahead must rewind, not wait.
  if (rewound_ && wanted > restored_version_ + 1) {
    return ErrorWithDetail(absl::AbortedError(absl::StrCat(
        "PullParams: job ", job_id_, " was restored from checkpoint ", restored_from_, " at version ",
        restored_version_, "; version ", wanted, " does not exist: pull the latest version and resume at step ",
        committed_step_ + 1)));
  }
  if (request.version() >= 1 && Decided(wanted - 1)) {
    CrashIfInjectedLocked(StepFault::Phase::kPull, wanted - 1,
                          [&] { return absl::StrCat("with a pull of version ", wanted, " arrived"); });
  }
  if (wanted > std::max<int64_t>(next_step_, 0) + 2) {
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        "PullParams: version ", wanted, " is more than one step ahead of job ", job_id_, " (current version ", version_,
        ")")));
  }
  auto decided = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || !shards_.count(key) || !restore_error_.ok() || (!restoring_ && Decided(wanted - 1)) ||
           (Fenced() && request.placement_epoch() < fence_epoch_);
  };
  if (!decided()) {
    if (request.no_wait()) {
      return absl::UnavailableError(absl::StrCat("PullParams: version ", wanted, " is not decided yet"));
    }
    if (!mu_.AwaitWithDeadline(absl::Condition(&decided), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("PullParams: version ", wanted, " of ",
                                                      ShardName(key.first, key.second), " of job ", job_id_,
                                                      " was not published before the deadline (current version ",
                                                      version_, ")"));
    }
  }
  if (stopping_) return absl::UnavailableError("PullParams: the job stopped on this daemon (dropped, or the daemon is shutting down)");
  MAINSTAY_RETURN_IF_ERROR(CheckRoute(request.placement_epoch(), request.bucket(), request.shard()));
  const ShardState& state = *shards_.at(key);
  PullResult result;
  auto it = state.versions.find(wanted);
  if (it == state.versions.end()) {
    // Not published: either its step was skipped (answer with the version before it, which the
    // trainer already holds) or it is older than what the daemon keeps (even when an older,
    // pinned version is still here).
    auto after = state.versions.upper_bound(wanted);
    auto decided = stats_.find(wanted - 1);
    if (after != state.versions.begin() && !state.versions.empty() && decided != stats_.end() &&
        decided->second.skipped()) {
      result.shard = std::prev(after)->second;
      result.unchanged = true;
      return result;
    }
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        "PullParams: version ", wanted, " of job ", job_id_, " is no longer kept (the daemon keeps the newest ",
        options_.retained_versions, "; newest is ", version_, "); pull with latest")));
  }
  result.shard = it->second;
  return result;
}

namespace {
constexpr int64_t kMaxPinTtlMs = 600000;
constexpr size_t kMaxPinnedVersions = 4;
}  // namespace

std::set<int64_t> Job::PinnedVersionsLocked() {
  const int64_t now = options_.clock->NowUnixMs();
  std::set<int64_t> pinned;
  for (auto it = pins_.begin(); it != pins_.end();) {
    if (it->second.expires_unix_ms <= now) {
      it = pins_.erase(it);
    } else {
      pinned.insert(it->second.version);
      ++it;
    }
  }
  return pinned;
}

absl::StatusOr<v1::PinVersionResponse> Job::PinVersion(const v1::PinVersionRequest& request) {
  MAINSTAY_RETURN_IF_ERROR(CheckReadToken(request.job_token()));
  if (request.ttl_ms() < 0 || request.ttl_ms() > kMaxPinTtlMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("PinVersion: ttl_ms must be in [0, ", kMaxPinTtlMs, "] (0 releases the pin), got ", request.ttl_ms()));
  }
  absl::MutexLock lock(&mu_);
  v1::PinVersionResponse response;
  if (request.ttl_ms() == 0) {  // a release; an unknown or expired pin is released already
    pins_.erase(request.pin_id());
    response.set_pin_id(request.pin_id());
    return response;
  }
  std::set<int64_t> pinned = PinnedVersionsLocked();
  auto existing = pins_.find(request.pin_id());
  if (request.pin_id() != 0 && existing == pins_.end()) {
    return ErrorWithDetail(absl::NotFoundError(absl::StrCat(
        "PinVersion: pin ", request.pin_id(), " of job ", job_id_, " expired or was released; pin version ",
        request.version(), " again with pin_id 0")));
  }
  if (existing != pins_.end() && existing->second.version != request.version()) {
    return absl::InvalidArgumentError(absl::StrCat("PinVersion: pin ", request.pin_id(), " holds version ",
                                                   existing->second.version, ", not ", request.version()));
  }
  if (existing == pins_.end()) {
    for (const auto& [key, state] : shards_) {
      if (state->versions.count(request.version())) continue;
      return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
          "PinVersion: version ", request.version(), " of ", ShardName(key.first, key.second), " of job ", job_id_,
          " is not kept here (", request.version() > version_ ? "not published yet" : "evicted already",
          "; newest is ", version_, ")")));
    }
    if (!pinned.count(request.version()) && pinned.size() >= kMaxPinnedVersions) {
      return absl::ResourceExhaustedError(absl::StrCat("PinVersion: job ", job_id_, " has ", pinned.size(),
                                                       " versions pinned, the most a daemon keeps; release one"));
    }
  }
  uint64_t id = request.pin_id();
  while (id == 0 || (existing == pins_.end() && pins_.count(id))) {
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&id), sizeof(id)) != 1) {
      return absl::InternalError("PinVersion: no random pin id");
    }
  }
  Pin& pin = pins_[id];
  pin.version = request.version();
  pin.expires_unix_ms = options_.clock->NowUnixMs() + request.ttl_ms();
  response.set_pin_id(id);
  response.set_expires_unix_ms(pin.expires_unix_ms);
  return response;
}

absl::StatusOr<StepHyper> Job::RequestHyper(const v1::FinishStepRequest& request) const {
  StepHyper hyper;
  if (request.groups_size() == 0) {
    hyper.assign(static_cast<size_t>(num_groups_), GroupHyper{request.lr(), request.weight_decay()});
  } else {
    if (request.lr() != 0.0 || request.weight_decay() != 0.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FinishStep: give either lr and weight_decay (every param group) or groups (one entry per group), not "
          "both; got lr ", request.lr(), " weight_decay ", request.weight_decay(), " and ", request.groups_size(),
          " groups"));
    }
    if (request.groups_size() != num_groups_) {
      return absl::InvalidArgumentError(absl::StrCat("FinishStep: job ", job_id_, " has ", num_groups_,
                                                     " param groups (its tensors' param_group), the request has ",
                                                     request.groups_size(), " entries in groups"));
    }
    hyper = StepHyperFromProto(request.groups());
  }
  MAINSTAY_RETURN_IF_ERROR(CheckStepHyper(hyper, "FinishStep"));
  return hyper;
}

absl::StatusOr<v1::StepStats> Job::FinishStep(const v1::FinishStepRequest& request, absl::Time deadline) {
  MAINSTAY_RETURN_IF_ERROR(CheckToken(request.job_token()));
  const int64_t step = request.step();
  if (step < -1) return absl::InvalidArgumentError(absl::StrCat("FinishStep: step ", step, " < -1"));
  MAINSTAY_ASSIGN_OR_RETURN(const StepHyper hyper, RequestHyper(request));
  absl::MutexLock lock(&mu_);
  if (request.placement_epoch() > epoch_) {
    return absl::UnavailableError(absl::StrCat("job ", job_id_, ": this daemon has not received placement epoch ",
                                               request.placement_epoch(), " yet; retry"));
  }
  const int64_t d = job_.layout.data_parallel_size;
  if (request.rank() < 0 || request.rank() >= d) {
    return absl::InvalidArgumentError(absl::StrCat("FinishStep: rank ", request.rank(), " is outside [0, ", d, ")"));
  }
  if (step >= 0 && executing_step_ == step && executing_hyper_.has_value() && hyper != *executing_hyper_) {
    return absl::InvalidArgumentError(absl::StrCat("FinishStep: rank ", request.rank(), " sends ",
                                                   StepHyperString(hyper), " for step ", step, " but it runs with ",
                                                   StepHyperString(*executing_hyper_)));
  }
  if (step >= 0 && rewound_ && step > next_step_) return RewoundError("FinishStep", step);
  CrashIfInjectedLocked(StepFault::Phase::kFinish, step,
                        [&] {
                          return absl::StrCat("with rank ", request.rank(), "'s FinishStep of step ", step, " arrived");
                        });
  const bool open = step >= 0 && !Decided(step) && executing_step_ != step && !failures_.count(step);
  // A FinishStep must find the rank's pushes of the step here: the client sends it only once
  // they were acknowledged. Where one is missing it was lost, and the step would wait for it
  // until the deadline: it cannot run without it. The rank pushed its own shard (bucket, rank)
  // of every bucket, and in a step of unreduced pushes every shard. Pushes are lost
  //  - with a move's source that died before its copy, which then came from a replica (replicas
  //    hold no trainers' pushes): a `redirected` FinishStep;
  //  - with a restore or failover that re-placed the job at a newer epoch since the pushes
  //    (`placement_epoch` older than this daemon's);
  //  - with a failed attempt of the step here, whose failure another rank's new push cleared
  //    before this call arrived (same epoch): the attempt recorded which pushes it dropped
  //    (dropped_pushes_), and one of this rank's that is not here again will not come; without
  //    that record a missing push may still come.
  // A shard still being copied here brings its pushes along: the call is retried after it.
  if (open) {
    const bool moved = request.redirected() || (request.placement_epoch() < epoch_ && !Fenced());
    bool incoming = false, pushed = false, unreduced = false, lacking_any = false, lacking_own = false;
    auto in = pending_.find(step);
    for (const auto& [key, state] : shards_) {
      incoming |= state->incoming;
      const ShardInputs* sin = nullptr;
      if (in != pending_.end()) {
        auto sit = in->second.shards.find(key);
        if (sit != in->second.shards.end()) sin = &sit->second;
      }
      const bool has = sin != nullptr && sin->by_rank.count(request.rank()) > 0;
      pushed |= has;
      unreduced |= sin != nullptr && sin->num_contributors > 1;
      if (state->replica || state->incoming || has) continue;
      lacking_any = true;
      lacking_own |= key.second == request.rank();  // the shard a reduced push of this rank fills
    }
    if (moved && incoming) {
      return absl::UnavailableError(absl::StrCat("FinishStep: job ", job_id_,
                                                 ": shards are being copied to this daemon; retry"));
    }
    bool dropped = false;
    if (auto d = dropped_pushes_.find(step); !moved && d != dropped_pushes_.end()) {
      for (const auto& [key, rank] : d->second) {
        if (rank != request.rank()) continue;
        const ShardInputs* sin = nullptr;
        if (in != pending_.end()) {
          auto sit = in->second.shards.find(key);
          if (sit != in->second.shards.end()) sin = &sit->second;
        }
        dropped |= sin == nullptr || sin->by_rank.count(rank) == 0;
      }
    }
    if ((moved && (!pushed || lacking_own || (unreduced && lacking_any))) || dropped) {
      return ErrorWithDetail(absl::AbortedError(absl::StrCat(
          "FinishStep: this daemon lacks pushes of rank ", request.rank(), " for step ", step, " of job ", job_id_,
          request.redirected()                       ? " (they were lost with the daemon they went to)"
          : request.placement_epoch() < epoch_ ? absl::StrCat(" (pushed at placement epoch ", request.placement_epoch(),
                                                              "; the job was re-placed at epoch ", epoch_, " without them)")
                                               : " (a failed attempt of the step dropped them)",
          ": push step ", step, " again")));
    }
  }
  if (step >= 0 && !Decided(step) && executing_step_ != step) {
    const int64_t first_open = std::max<int64_t>(next_step_, 0);
    if (step > first_open + 1) {
      return ErrorWithDetail(absl::FailedPreconditionError(
          absl::StrCat("FinishStep: step ", step, " is ahead of job ", job_id_, " (open steps: ", first_open, ", ",
                       first_open + 1, ")")));
    }
    StepInputs& in = pending_[step];
    for (const auto& [rank, other] : in.finished) {
      if (rank != request.rank() && other != hyper) {
        return absl::InvalidArgumentError(absl::StrCat("FinishStep: rank ", request.rank(), " sends ",
                                                       StepHyperString(hyper), " for step ", step, " but rank ", rank,
                                                       " sent ", StepHyperString(other)));
      }
    }
    in.finished[request.rank()] = hyper;
  }
  auto fenced = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    // (A step still running here may yet commit: its waiters learn how it ends first.)
    return Fenced() && request.placement_epoch() < fence_epoch_ && !Decided(step) && executing_step_ != step;
  };
  // An attempt that fails while this call waits ends it, even if another rank's push of the next
  // attempt cleared failures_ before this thread ran again.
  auto attempts_failed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) -> int64_t {
    auto f = failed_attempts_.find(step);
    return f == failed_attempts_.end() ? 0 : f->second.first;
  };
  const int64_t failed_before = attempts_failed();
  auto done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stopping_ || !restore_error_.ok() || (!restoring_ && Decided(step)) || failures_.count(step) ||
           attempts_failed() != failed_before || fenced();
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("FinishStep: step ", step, " of job ", job_id_,
                                                    " was not decided before the deadline; waiting for the pushes or "
                                                    "FinishStep calls of other ranks?"));
  }
  if (!restore_error_.ok()) return absl::FailedPreconditionError(restore_error_.message());
  if (fenced()) return FencedError("FinishStep");
  if (auto f = failures_.find(step); f != failures_.end() && !Decided(step)) return f->second;
  if (attempts_failed() != failed_before && !Decided(step)) return failed_attempts_.at(step).second;
  if (stopping_ && !Decided(step)) return absl::UnavailableError("FinishStep: the job stopped on this daemon (dropped, or the daemon is shutting down)");
  auto it = stats_.find(step);
  if (it == stats_.end()) {
    return absl::NotFoundError(absl::StrCat("FinishStep: stats of step ", step, " are no longer kept"));
  }
  return it->second;
}

absl::StatusOr<v1::StepStats> Job::GetStepStats(const v1::GetStepStatsRequest& request) {
  MAINSTAY_RETURN_IF_ERROR(CheckToken(request.job_token()));
  absl::MutexLock lock(&mu_);
  if (stats_.empty()) return absl::UnavailableError(absl::StrCat("job ", job_id_, ": no step decided yet"));
  if (request.latest()) return stats_.rbegin()->second;
  auto it = stats_.find(request.step());
  if (it != stats_.end()) return it->second;
  if (request.step() > committed_step_) {
    return absl::UnavailableError(absl::StrCat("step ", request.step(), " is not decided yet"));
  }
  return absl::NotFoundError(absl::StrCat("stats of step ", request.step(), " are no longer kept (oldest ",
                                          stats_.begin()->first, ")"));
}

absl::StatusOr<ShardStateCopy> Job::ReadShardState(int32_t bucket, int32_t shard) const {
  absl::MutexLock lock(&mu_);
  auto not_applying = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !applying_; };
  mu_.Await(absl::Condition(&not_applying));  // the state, as of a committed step
  auto it = shards_.find({bucket, shard});
  if (it == shards_.end()) {
    return ErrorWithDetail(absl::FailedPreconditionError(
        absl::StrCat("job ", job_id_, ": this daemon holds no primary or replica of ", ShardName(bucket, shard))));
  }
  ShardStateCopy copy;
  copy.version = it->second->initialized ? version_ : -1;
  copy.committed_step = committed_step_;
  copy.moment_type = job_.spec.optimizer.moment_dtype;
  const ShardState& state = *it->second;
  MAINSTAY_RETURN_IF_ERROR(copy.master.Assign(HostCopyMemory(), state.master.span()));
  MAINSTAY_RETURN_IF_ERROR(copy.m.Assign(HostCopyMemory(), state.m.span()));
  MAINSTAY_RETURN_IF_ERROR(copy.v.Assign(HostCopyMemory(), state.v.span()));
  return copy;
}

std::vector<v1::ShardStatus> Job::ShardStatuses() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::ShardStatus> out;
  for (const auto& [key, state] : shards_) {
    v1::ShardStatus s;
    s.mutable_shard()->set_bucket(key.first);
    s.mutable_shard()->set_shard(key.second);
    s.set_role(state->replica ? v1::SHARD_ROLE_REPLICA : v1::SHARD_ROLE_PRIMARY);
    s.set_version(state->initialized ? version_ : -1);
    s.set_committed_step(committed_step_);
    int64_t bytes = static_cast<int64_t>(state->master.size() * 4 + state->m.size() + state->v.size());
    for (const auto& [v, snap] : state->versions) bytes += static_cast<int64_t>(snap->data.size() + snap->scales.size());
    s.set_state_bytes(bytes);
    out.push_back(std::move(s));
  }
  return out;
}

v1::JobProgress Job::Progress() const {
  absl::MutexLock lock(&mu_);
  v1::JobProgress p;
  p.set_job_id(job_id_);
  p.set_committed_step(committed_step_);
  p.set_version(version_);
  p.set_placement_epoch(epoch_);
  p.set_loading(!moves_in_.empty() || restoring_);
  // A restore that failed for good, else the last failed attempt of the load in progress.
  const absl::Status& error = !restore_error_.ok() ? restore_error_ : p.loading() ? load_error_ : absl::OkStatus();
  p.set_load_error(std::string(error.message()));
  p.set_load_error_code(static_cast<int32_t>(error.code()));
  if (auto it = stats_.find(committed_step_); committed_step_ >= 0 && it != stats_.end()) {
    *p.mutable_last_step_stats() = it->second;
  }
  return p;
}

int64_t Job::state_bytes() const {
  int64_t total = 0;
  for (const v1::ShardStatus& s : ShardStatuses()) total += s.state_bytes();
  return total;
}

}  // namespace mainstay::daemon

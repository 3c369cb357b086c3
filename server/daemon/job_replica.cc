// Replicas (docs/architecture.md, "Replicas"): the primary forwards each replicated shard's input
// of a step to its replicas before the step's first peer reduction; the replica stores it and its
// step thread takes it after that reduction, so that it applies the step with the same input and
// the same reduced scalars as the primary, before the step is decided.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/crc32c.h"
#include "common/logging.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "server/daemon/job.h"

namespace mainstay::daemon {
namespace {

constexpr absl::Duration kForwardRetry = absl::Milliseconds(100);
constexpr int kStreamsPerReplica = 4;

absl::StatusOr<ElementType> InputType(v1::ElementType type) {
  switch (type) {
    case v1::ELEMENT_TYPE_FP32: return ElementType::kFloat32;
    case v1::ELEMENT_TYPE_BF16: return ElementType::kBFloat16;
    case v1::ELEMENT_TYPE_FP16: return ElementType::kFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardStepInput: dtype ", v1::ElementType_Name(type), " is not FP32, BF16 or FP16"));
  }
}

v1::ElementType ProtoType(ElementType type) {
  switch (type) {
    case ElementType::kBFloat16: return v1::ELEMENT_TYPE_BF16;
    case ElementType::kFloat16: return v1::ELEMENT_TYPE_FP16;
    default: return v1::ELEMENT_TYPE_FP32;
  }
}

}  // namespace

absl::StatusOr<bool> Job::CheckReplicaInput(const v1::ReplicaInputHeader& h) const {
  absl::MutexLock lock(&mu_);
  return CheckReplicaInputLocked(h);
}

absl::StatusOr<bool> Job::CheckReplicaStepLocked(const char* call, int64_t epoch, const Key& key,
                                                 int64_t step) const {
  if (stopping_) return absl::UnavailableError(absl::StrCat("job ", job_id_, " stopped on this daemon"));
  if (epoch > epoch_) {
    return absl::UnavailableError(absl::StrCat(call, ": job ", job_id_, ": this daemon has not received placement epoch ",
                                               epoch, " yet (it has ", epoch_, "); retry"));
  }
  auto it = shards_.find(key);
  if (epoch < epoch_ || it == shards_.end() || !it->second->replica) {
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        call, ": job ", job_id_, ": this daemon holds no replica of ", ShardName(key.first, key.second),
        " at placement epoch ", epoch, " (it is at epoch ", epoch_, ")")));
  }
  if (step < -1) return absl::InvalidArgumentError(absl::StrCat(call, ": step ", step, " < -1"));
  if (it->second->incoming) {  // a new replica still being copied: its steps are not known yet
    return absl::UnavailableError(absl::StrCat(call, ": job ", job_id_, ": the replica of ",
                                               ShardName(key.first, key.second), " is still being copied here; retry"));
  }
  // Applied already (a retried call). While the step runs here its input is still wanted: the
  // step thread takes it after the stats reduction.
  if (Decided(step)) return true;
  const int64_t first_open = std::max<int64_t>(next_step_, 0);
  if (step > first_open + 1) {
    return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
        call, ": step ", step, " is ahead of job ", job_id_, " (open steps: ", first_open, ", ", first_open + 1, ")")));
  }
  return false;
}

absl::StatusOr<bool> Job::CheckReplicaInputLocked(const v1::ReplicaInputHeader& h) const {
  const Key key{h.bucket(), h.shard()};
  MAINSTAY_ASSIGN_OR_RETURN(bool decided, CheckReplicaStepLocked("ForwardStepInput", h.placement_epoch(), key, h.step()));
  MAINSTAY_ASSIGN_OR_RETURN(ElementType type, InputType(h.dtype()));
  if (h.step() == -1 && type != ElementType::kFloat32) {
    return absl::InvalidArgumentError("ForwardStepInput: initial parameters (step -1) must be FP32");
  }
  const int64_t numel = shards_.at(key)->numel;
  if (h.total_bytes() != numel * (BitsOf(type) / 8)) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardStepInput: total_bytes ", h.total_bytes(), " but ",
                                                   ShardName(key.first, key.second), " holds ", numel, " elements of ",
                                                   ElementTypeName(type)));
  }
  if (!(h.loss_scale() > 0.0)) return absl::InvalidArgumentError("ForwardStepInput: loss_scale must be > 0");
  if (h.groups_size() != (h.step() >= 0 ? num_groups_ : 0)) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardStepInput: ", h.groups_size(), " param groups' "
                                                   "hyperparameters for step ", h.step(), " of job ", job_id_,
                                                   ", which has ", num_groups_, " groups"));
  }
  MAINSTAY_RETURN_IF_ERROR(CheckStepHyper(StepHyperFromProto(h.groups()), "ForwardStepInput"));
  if (h.payload_from_trainer() && h.crc32c() == 0) {
    return absl::InvalidArgumentError("ForwardStepInput: payload_from_trainer needs the payload's crc32c");
  }
  return decided;
}

absl::StatusOr<bool> Job::StoreReplicaInput(const v1::ReplicaInputHeader& h, std::vector<uint8_t> payload) {
  if (static_cast<int64_t>(payload.size()) != h.total_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardStepInput: the payload has ", payload.size(),
                                                   " bytes, the header says ", h.total_bytes(), "; nothing stored"));
  }
  if (h.crc32c() != 0) {
    const uint32_t crc = Crc32c(payload.data(), payload.size());
    if (crc != h.crc32c()) {
      return absl::DataLossError(absl::StrCat("ForwardStepInput: CRC-32C of the payload is ", crc, ", the primary sent ",
                                              h.crc32c(), "; nothing stored"));
    }
  }
  absl::MutexLock lock(&mu_);
  MAINSTAY_ASSIGN_OR_RETURN(bool duplicate, CheckReplicaInputLocked(h));
  if (duplicate) return true;
  ReplicaInput& in = replica_inputs_[h.step()][{h.bucket(), h.shard()}];
  in.dtype = *InputType(h.dtype());
  in.loss_scale = h.loss_scale();
  in.hyper = StepHyperFromProto(h.groups());
  in.data = std::move(payload);
  // A daemon that holds only replicas has no pushes to make its step ready: the input does.
  StepInputs& step = pending_[h.step()];
  if (step.first_push_ms == 0) step.first_push_ms = options_.clock->NowUnixMs();
  CrashIfInjectedLocked(StepFault::Phase::kInput, h.step(),
                        [&] { return absl::StrCat("with the forward of step ", h.step(), " stored, not answered"); });
  return false;
}

absl::StatusOr<bool> Job::AdoptTrainerCopy(const v1::ReplicaInputHeader& h) {
  const Key key{h.bucket(), h.shard()};
  absl::MutexLock lock(&mu_);
  MAINSTAY_ASSIGN_OR_RETURN(bool duplicate, CheckReplicaInputLocked(h));
  if (duplicate) return true;
  const ElementType type = *InputType(h.dtype());
  auto step_it = trainer_copies_.find(h.step());
  if (step_it == trainer_copies_.end() || !step_it->second.count(key)) {
    return absl::NotFoundError(absl::StrCat("ForwardStepInput: no trainer copy of step ", h.step(), " of ",
                                            ShardName(key.first, key.second), " here; send the payload"));
  }
  auto it = step_it->second.find(key);
  if (it->second.crc32c != h.crc32c() || it->second.dtype != type || it->second.loss_scale != h.loss_scale()) {
    return absl::NotFoundError(absl::StrCat(
        "ForwardStepInput: the trainer copy of step ", h.step(), " of ", ShardName(key.first, key.second),
        " here differs (CRC-32C ", it->second.crc32c, ", ", ElementTypeName(it->second.dtype), ", loss scale ",
        it->second.loss_scale, "; the primary's input: ", h.crc32c(), ", ", ElementTypeName(type), ", ", h.loss_scale(),
        "); send the payload"));
  }
  ReplicaInput& in = replica_inputs_[h.step()][key];
  in.dtype = type;
  in.loss_scale = h.loss_scale();
  in.hyper = StepHyperFromProto(h.groups());
  in.data = std::move(it->second.data);
  step_it->second.erase(it);
  if (step_it->second.empty()) trainer_copies_.erase(step_it);
  StepInputs& step = pending_[h.step()];
  if (step.first_push_ms == 0) step.first_push_ms = options_.clock->NowUnixMs();
  CrashIfInjectedLocked(StepFault::Phase::kInput, h.step(), [&] {
    return absl::StrCat("with the forward of step ", h.step(), " stored (the trainer's copy), not answered");
  });
  return false;
}

absl::Status Job::BeginTrainerCopyLocked(const v1::PushGradHeader& h, PushSession& session) {
  const Key key{h.bucket(), h.shard()};
  if (h.kind() != v1::PUSH_KIND_GRADIENT || h.num_contributors() > 1) {
    return absl::InvalidArgumentError("PushGrad: replica_copy is for reduced gradient pushes only "
                                      "(kind PUSH_KIND_GRADIENT, num_contributors 1)");
  }
  if (h.crc32c() == 0) return absl::InvalidArgumentError("PushGrad: replica_copy needs the payload's crc32c");
  if (h.step() < 0) return absl::InvalidArgumentError(absl::StrCat("PushGrad: step ", h.step(), " < 0"));
  MAINSTAY_ASSIGN_OR_RETURN(bool decided, CheckReplicaStepLocked("PushGrad (replica copy)", h.placement_epoch(), key, h.step()));
  MAINSTAY_ASSIGN_OR_RETURN(ElementType type, InputType(h.dtype()));
  const int64_t numel = shards_.at(key)->numel;
  if (h.total_bytes() != numel * (BitsOf(type) / 8)) {
    return absl::InvalidArgumentError(absl::StrCat("PushGrad: total_bytes ", h.total_bytes(), " but ",
                                                   ShardName(key.first, key.second), " holds ", numel, " elements of ",
                                                   ElementTypeName(type)));
  }
  bool duplicate = decided;
  if (auto s = trainer_copies_.find(h.step()); s != trainer_copies_.end()) {
    auto c = s->second.find(key);
    duplicate = duplicate || (c != s->second.end() && c->second.crc32c == h.crc32c());
  }
  session.replica_copy_ = true;
  session.numel_ = numel;
  session.elem_bytes_ = BitsOf(type) / 8;
  session.duplicate_ = duplicate;
  session.track_crc_ = !duplicate;
  session.expected_crc_ = h.crc32c();
  return absl::OkStatus();
}

absl::StatusOr<v1::PushGradResponse> Job::StoreTrainerCopyLocked(PushSession& session) {
  const v1::PushGradHeader& h = session.header_;
  const Key key{h.bucket(), h.shard()};
  v1::PushGradResponse response;
  response.set_received_elements(session.received_);
  // Re-checked: the step may have been decided, or the role changed, while the data streamed in.
  MAINSTAY_ASSIGN_OR_RETURN(bool decided, CheckReplicaStepLocked("PushGrad (replica copy)", h.placement_epoch(), key, h.step()));
  if (session.duplicate_ || decided) {
    response.set_duplicate(true);
    return response;
  }
  // Kept under the CRC computed here as it landed, which must be the header's: a copy is only
  // ever matched by it (a copy cannot announce a trailer: BeginPush refuses crc32c_follows).
  if (!session.track_crc_ || session.crc_ != h.crc32c()) {
    return absl::DataLossError(absl::StrCat("PushGrad (replica copy): CRC-32C of the payload is ", session.crc_,
                                            ", the header says ", h.crc32c(), "; nothing was stored"));
  }
  TrainerCopy& copy = trainer_copies_[h.step()][key];
  copy.dtype = *InputType(h.dtype());
  copy.loss_scale = h.loss_scale() > 0.0 ? h.loss_scale() : 1.0;
  copy.crc32c = session.crc_;
  copy.data = std::move(session.buffer_);
  return response;
}

absl::Status Job::ForwardInputs(int64_t step, int64_t epoch, const std::vector<Forward>& forwards,
                                const std::vector<std::shared_ptr<ShardState>>& shards, const StepHyper& hyper,
                                const std::map<Key, std::vector<v1::DaemonEndpoint>>& replicas_of,
                                absl::Time deadline, int64_t* payload_bytes) {
  if (options_.peer_client == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id_, " has replicas but this daemon has no peer client to reach them"));
  }
  // Up to kStreamsPerReplica streams at once to each replica daemon (one gRPC stream alone is
  // far from the link's speed), each a thread sending its shards in order.
  std::map<std::pair<std::string, int>, std::vector<std::pair<const Forward*, v1::DaemonEndpoint>>> by_peer;
  std::map<std::string, int> sent_to;
  for (const Forward& f : forwards) {
    const ShardState& s = *shards[f.index];
    auto r = replicas_of.find({s.bucket, s.shard});
    if (r == replicas_of.end()) continue;
    for (const v1::DaemonEndpoint& peer : r->second) {
      const int lane = sent_to[peer.daemon_id()]++ % kStreamsPerReplica;
      by_peer[{peer.daemon_id(), lane}].push_back({&f, peer});
    }
  }
  std::vector<absl::Status> results(by_peer.size());
  std::atomic<int64_t> sent_bytes{0};
  std::vector<std::thread> threads;
  size_t n = 0;
  for (auto& [id, list] : by_peer) {
    threads.emplace_back([&, i = n++, &list = list] {
      for (const auto& [f, peer] : list) {
        const ShardState& s = *shards[f->index];
        v1::ReplicaInputHeader h;
        h.set_job_id(job_id_);
        h.set_placement_epoch(epoch);
        h.set_bucket(s.bucket);
        h.set_shard(s.shard);
        h.set_step(step);
        h.set_dtype(ProtoType(f->dtype));
        h.set_total_bytes(s.numel * (BitsOf(f->dtype) / 8));
        h.set_loss_scale(f->loss_scale);
        StepHyperToProto(hyper, h.mutable_groups());
        h.set_from_daemon_id(options_.daemon_id);
        h.set_crc32c(f->crc32c != 0 ? f->crc32c : Crc32c(f->data, static_cast<size_t>(h.total_bytes())));
        // The header alone first where the trainer may have sent the replica a copy of its push
        // (the fast path: it travelled next to the push to this daemon). Any answer but OK
        // (NOT_FOUND: no copy; or an error, retried below) sends the payload.
        if (f->trainer_copy) {
          h.set_payload_from_trainer(true);
          const absl::Status adopted = options_.peer_client->ForwardStepInput(peer, h, {}, deadline);
          if (adopted.ok()) continue;
          h.set_payload_from_trainer(false);
          if (!copy_miss_logged_.exchange(true)) {  // once per job: StepStats.forwarded_bytes counts them
            Log(LogLevel::kInfo, "daemon",
                absl::StrCat("job ", job_id_, ": the replica on daemon ", peer.daemon_id(), " did not take the trainer's "
                             "copy of step ", step, " of ", ShardName(s.bucket, s.shard), " (", adopted.ToString(),
                             "); its payload is forwarded (logged once)"));
          }
        }
        // An unreachable replica may be dead: retried until the deadline, or until the
        // coordinator's failover takes it out of the placement (a new epoch: the attempt is
        // then given up, and the trainers push the step again once, at the new epoch, instead
        // of failing attempt after attempt against a dead daemon until its lease runs out).
        absl::Status sent;
        while (true) {
          sent = options_.peer_client->ForwardStepInput(
              peer, h, std::span<const uint8_t>(f->data, static_cast<size_t>(h.total_bytes())), deadline);
          if (sent.code() != absl::StatusCode::kUnavailable || absl::Now() + kForwardRetry >= deadline) break;
          absl::MutexLock lock(&mu_);
          auto moved = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || epoch_ != epoch; };
          if (mu_.AwaitWithTimeout(absl::Condition(&moved), kForwardRetry)) {
            sent = absl::AbortedError(absl::StrCat("the placement changed to epoch ", epoch_, " (", sent.message(), ")"));
            break;
          }
        }
        if (sent.ok()) sent_bytes += h.total_bytes();
        if (!sent.ok()) {
          results[i] = Annotate(sent, absl::StrCat("forwarding step ", step, " of ", ShardName(s.bucket, s.shard),
                                                   " to its replica on daemon ", peer.daemon_id()));
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (payload_bytes != nullptr) *payload_bytes += sent_bytes.load();
  for (const absl::Status& s : results) MAINSTAY_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::StatusOr<std::map<Job::Key, Job::ReplicaInput>> Job::TakeReplicaInputs(int64_t step, int64_t epoch,
                                                                             const std::vector<Key>& wanted,
                                                                             absl::Time deadline) {
  std::map<Key, ReplicaInput> out;
  if (wanted.empty()) return out;
  absl::MutexLock lock(&mu_);
  auto complete = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (stopping_ || epoch_ != epoch) return true;
    auto it = replica_inputs_.find(step);
    if (it == replica_inputs_.end()) return false;
    return std::all_of(wanted.begin(), wanted.end(), [&](const Key& k) { return it->second.count(k) > 0; });
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&complete), deadline)) {
    std::vector<std::string> missing;
    auto it = replica_inputs_.find(step);
    for (const Key& k : wanted) {
      if (it == replica_inputs_.end() || !it->second.count(k)) missing.push_back(ShardName(k.first, k.second));
    }
    return absl::DeadlineExceededError(absl::StrCat("step ", step, ": no input from the primary of the replica(s) ",
                                                    absl::StrJoin(missing, ", "), " before the peer deadline"));
  }
  if (stopping_) return absl::UnavailableError(absl::StrCat("job ", job_id_, " stopped on this daemon"));
  if (epoch_ != epoch) {
    // (A failover promoted this daemon, or a primary moved: the step runs again at the new epoch.)
    return absl::AbortedError(absl::StrCat("step ", step, ": the placement changed to epoch ", epoch_,
                                           " while this daemon waited for its replicas' inputs"));
  }
  auto it = replica_inputs_.find(step);
  for (const Key& k : wanted) {
    auto in = it->second.find(k);
    out[k] = std::move(in->second);
    it->second.erase(in);
  }
  if (it->second.empty()) replica_inputs_.erase(it);
  return out;
}

}  // namespace mainstay::daemon

// An in-process shard-daemon cluster for tests: several ShardDaemons joined by the in-process
// peer group, one job whose rank r's shards live on daemon r % daemons (so tensors straddle
// daemons under the flat policy), and helpers that play the trainers (pushes, FinishStep,
// pulls) and the coordinator (checkpoints, restores). Compared against ReferenceModel.
#ifndef MAINSTAY_TESTS_TESTING_DAEMON_CLUSTER_H_
#define MAINSTAY_TESTS_TESTING_DAEMON_CLUSTER_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/shard_transfer.h"
#include "server/peer/fake_peer_group.h"
#include "tests/testing/job_token.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::testing {

using daemon::PullResult;
using daemon::PushSession;
using daemon::QuantizedShard;
using daemon::ShardDaemon;
using daemon::ShardDaemonOptions;
using daemon::ShardStateCopy;
using Reference = ReferenceModel;

inline constexpr char kJob[] = "job-1";

inline JobSpec MakeSpec(const std::string& recipe, LayoutPolicy policy, int64_t d) {
  JobSpec spec;
  spec.name = "test";
  spec.recipe = recipe;
  spec.data_parallel_size = d;
  spec.layout_policy = policy;
  spec.bucket_numel = 16384;
  spec.optimizer.max_grad_norm = 0.0f;  // see the file comment
  spec.optimizer.weight_decay = 0.0f;
  spec.tensors = TestTensors();
  // The test model has two layers: without this, the fp8 recipes would keep both in bf16.
  spec.recipe_options.first_last_layers_bf16 = false;
  spec.unreduced_pushes = true;  // tests push reduced shards and unreduced contributions alike
  return spec;
}

// Three optimizer param groups over TestTensors(), as a configure_optimizers() would make them:
// 0 the 2-D weights, 1 the 1-D norms and biases (no decay), 2 the attention weights (own lr).
inline void AssignParamGroups(JobSpec& spec) {
  for (TensorSpec& t : spec.tensors) {
    t.param_group = t.shape.size() == 1 ? 1 : absl::StrContains(t.name, ".attn.") ? 2 : 0;
  }
}
// Their hyperparameters at `step`: a schedule per group.
inline StepHyper ParamGroupSchedule(int64_t step) {
  const double s = static_cast<double>(step + 1);
  return {{1e-3 * s, 0.1}, {1e-3 * s, 0.0}, {3e-3 / s, 0.05}};
}

// The daemons' GetStepOutcome calls to each other, in memory (daemon "dI" is daemons[I]).
class InProcessPeers : public daemon::PeerClient {
 public:
  explicit InProcessPeers(const std::vector<std::unique_ptr<ShardDaemon>>* daemons) : daemons_(daemons) {}
  absl::StatusOr<v1::GetStepOutcomeResponse> GetStepOutcome(const v1::DaemonEndpoint& peer,
                                                            const v1::GetStepOutcomeRequest& request,
                                                            absl::Time) override {
    {
      absl::MutexLock lock(&mu_);
      if (unreachable_outcomes_.count(peer.daemon_id())) {
        return absl::UnavailableError(absl::StrCat("daemon ", peer.daemon_id(), " is cut off"));
      }
    }
    for (const auto& d : *daemons_) {
      if (d->daemon_id() == peer.daemon_id()) return d->GetStepOutcome(request);
    }
    return absl::UnavailableError(absl::StrCat("no daemon ", peer.daemon_id()));
  }
  // Through the wire codec, as over gRPC (server/daemon/shard_transfer.h).
  absl::StatusOr<ShardStateCopy> FetchShardState(const v1::DaemonEndpoint& peer,
                                                 const v1::FetchShardStateRequest& request, absl::Time deadline,
                                                 kernels::StateMemory& land, int64_t shard_numel) override {
    for (const auto& d : *daemons_) {
      if (d->daemon_id() != peer.daemon_id()) continue;
      {
        absl::MutexLock lock(&mu_);
        if (unreachable_copies_.count(peer.daemon_id())) break;
      }
      absl::StatusOr<ShardStateCopy> copy = d->CopyShardForMove(request, deadline);
      // As the gRPC peer client reports them: RESOURCE_EXHAUSTED means `land` is full, only.
      if (copy.status().code() == absl::StatusCode::kResourceExhausted) {
        return absl::UnavailableError(copy.status().message());
      }
      MAINSTAY_RETURN_IF_ERROR(copy.status());
      daemon::ShardStateReader reader(land, shard_numel);
      absl::Status added;
      MAINSTAY_RETURN_IF_ERROR(daemon::WriteShardState(*copy, 4096, [&](const v1::FetchShardStateResponse& m) {
        if (added.ok()) added = reader.Add(m);
        return added.ok();
      }));
      MAINSTAY_RETURN_IF_ERROR(added);
      return reader.Finish(request.shard().bucket(), request.shard().shard());
    }
    return absl::UnavailableError(absl::StrCat("no daemon ", peer.daemon_id()));
  }
  absl::Status ForwardStepInput(const v1::DaemonEndpoint& peer, const v1::ReplicaInputHeader& header,
                                std::span<const uint8_t> payload, absl::Time) override {
    {
      absl::MutexLock lock(&mu_);
      if (hold_forwards_) {
        ++forwards_held_;
        mu_.Await(absl::Condition(this, &InProcessPeers::ForwardsReleased));
        --forwards_held_;
      }
      if (down_.count(peer.daemon_id())) return absl::UnavailableError(absl::StrCat("daemon ", peer.daemon_id(), " is down"));
    }
    for (const auto& d : *daemons_) {
      if (d->daemon_id() != peer.daemon_id()) continue;
      if (header.payload_from_trainer()) return d->AdoptTrainerCopy(header).status();
      MAINSTAY_ASSIGN_OR_RETURN(bool duplicate, d->CheckReplicaInput(header));
      if (duplicate) return absl::OkStatus();
      return d->StoreReplicaInput(header, std::vector<uint8_t>(payload.begin(), payload.end())).status();
    }
    return absl::UnavailableError(absl::StrCat("no daemon ", peer.daemon_id()));
  }
  // Calls to a daemon marked down fail UNAVAILABLE (a lost daemon).
  void SetDown(const std::string& id) {
    absl::MutexLock lock(&mu_);
    down_.insert(id);
  }
  // While held, forwards wait (forwards_held() of them) until released: a step thread stopped
  // inside an attempt.
  void HoldForwards(bool hold) {
    absl::MutexLock lock(&mu_);
    hold_forwards_ = hold;
  }
  int forwards_held() {
    absl::MutexLock lock(&mu_);
    return forwards_held_;
  }
  // State copies from `id` fail UNAVAILABLE while set (a source cut off for a while).
  void SetCopiesFail(const std::string& id, bool fail) { SetCut(unreachable_copies_, id, fail); }
  // Questions to `id` about a step's outcome fail UNAVAILABLE while set.
  void SetOutcomesFail(const std::string& id, bool fail) { SetCut(unreachable_outcomes_, id, fail); }

 private:
  const std::vector<std::unique_ptr<ShardDaemon>>* daemons_;
  bool ForwardsReleased() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !hold_forwards_; }
  absl::Mutex mu_;
  std::set<std::string> down_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> unreachable_copies_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> unreachable_outcomes_ ABSL_GUARDED_BY(mu_);
  void SetCut(std::set<std::string>& cut, const std::string& id, bool on) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (on) {
      cut.insert(id);
    } else {
      cut.erase(id);
    }
  }
  bool hold_forwards_ ABSL_GUARDED_BY(mu_) = false;
  int forwards_held_ ABSL_GUARDED_BY(mu_) = 0;
};

class Cluster {
 public:
  // `fs`: where checkpoints are written and read (null: the real file system). `faults`: a
  // test fault per daemon index (daemon::StepFault). `ask_peers`: daemons in doubt about a
  // step ask the others (false: they give it up alone, the behaviour before agreed outcomes).
  // With spec.replication_factor R > 1, rank r's shards have replicas on the R-1 daemons after
  // its primary, (r + k) % daemons.
  // `memory`: every daemon's state memory (null: host memory; kernels::HostStateMemory with
  // staged = true runs the GPU's staging on the CPU).
  Cluster(const JobSpec& spec, int daemons, checkpoint::CheckpointFs* fs = nullptr,
          const std::map<int, daemon::StepFault>& faults = {}, bool ask_peers = true,
          kernels::StateMemory* memory = nullptr)
      : spec_(spec) {
    resolved_ = *ResolveJob(spec);
    for (int32_t r = 0; r < spec.data_parallel_size; ++r) {
      for (int k = 1; k < spec.replication_factor; ++k) replicas_[r].push_back((r + k) % daemons);
    }
    for (int i = 0; i < daemons; ++i) {
      ShardDaemonOptions o;
      o.peers = &peers_;
      o.peer_timeout = absl::Seconds(2);
      o.fs = fs;
      o.memory = memory;
      if (ask_peers) o.peer_client = &peer_client_;
      if (auto f = faults.find(i); f != faults.end()) o.faults.list = {f->second};
      daemons_.push_back(std::make_unique<ShardDaemon>(o));
      daemons_.back()->set_daemon_id(absl::StrCat("d", i));
    }
    // Rank r's shards on daemon r % daemons: tensors straddle daemons under `flat`.
    v1::AssignShardRequest base;
    base.set_job_id(kJob);
    base.set_job_token_sha256(TokenSha256());
    base.set_placement_epoch(epoch_);
    JobSpecToProto(spec, base.mutable_spec());
    LayoutToProto(resolved_.layout, base.mutable_layout());
    base.mutable_from_trainer();
    for (const Bucket& b : resolved_.layout.buckets) {
      for (const Shard& s : b.shards) {
        v1::ShardPlacement* p = base.mutable_placement()->add_shards();
        p->mutable_shard()->set_bucket(b.index);
        p->mutable_shard()->set_shard(s.rank);
        p->set_daemon_id(absl::StrCat("d", Owner(s.rank)));
        for (int k : replicas_[s.rank]) p->add_replica_daemon_ids(absl::StrCat("d", k));
      }
    }
    base_ = base;
    AssignAll();
  }

  // Every daemon gets its shards (again) at the current epoch, as the coordinator sends them:
  // at creation, and to hand out a reader token's hash ("" = none), as a rotation does.
  void AssignAll(const std::string& reader_token = "") {
    for (int i = 0; i < static_cast<int>(daemons_.size()); ++i) {
      v1::AssignShardRequest req = base_;
      req.set_placement_epoch(epoch_);
      if (!reader_token.empty()) req.set_reader_token_sha256(Sha256Of(reader_token));
      for (const Bucket& b : resolved_.layout.buckets) {
        for (const Shard& s : b.shards) {
          if (!Holds(i, s.rank)) continue;
          v1::ShardRef* ref = req.add_shards();
          ref->set_bucket(b.index);
          ref->set_shard(s.rank);
        }
      }
      EXPECT_THAT(daemons_[static_cast<size_t>(i)]->AssignShard(req).status(), IsOk());
    }
  }

  int Owner(int32_t rank) const {
    return rank < static_cast<int32_t>(owners_.size()) ? owners_[static_cast<size_t>(rank)]
                                                       : rank % static_cast<int>(daemons_.size());
  }
  std::vector<int> Replicas(int32_t rank) const {
    auto it = replicas_.find(rank);
    return it == replicas_.end() ? std::vector<int>{} : it->second;
  }
  // Whether daemon i holds rank's shards (as primary or replica).
  bool Holds(int i, int32_t rank) const {
    const std::vector<int> r = Replicas(rank);
    return Owner(rank) == i || std::count(r.begin(), r.end(), i) > 0;
  }

  // What the coordinator does when daemon `dead` is lost with replicas: at the next epoch each
  // of its primaries goes to its first replica, and it leaves every replica list. The others
  // get the new placement (they hold every shard they are given already), except that
  // `copies` (per daemon, a rank and the daemon it copies it from) continue moves whose source
  // died. Calls to the dead daemon fail from now on.
  absl::Status Failover(int dead, const std::map<int, std::pair<int32_t, int>>& copies = {}) {
    peer_client_.SetDown(absl::StrCat("d", dead));
    if (owners_.empty()) {
      for (int32_t r = 0; r < layout().data_parallel_size; ++r) owners_.push_back(Owner(r));
    }
    for (int32_t r = 0; r < layout().data_parallel_size; ++r) {
      std::vector<int>& reps = replicas_[r];
      reps.erase(std::remove(reps.begin(), reps.end(), dead), reps.end());
      if (owners_[static_cast<size_t>(r)] == dead) {
        if (reps.empty()) return absl::FailedPreconditionError(absl::StrCat("rank ", r, " has no replica left"));
        owners_[static_cast<size_t>(r)] = reps.front();
        reps.erase(reps.begin());
      }
    }
    ++epoch_;
    MAINSTAY_RETURN_IF_ERROR(SendPlacement(copies));
    daemons_[static_cast<size_t>(dead)]->Shutdown();
    return absl::OkStatus();
  }

  // A move of rank `rank` to daemon `to` whose source (its primary) dies before any copy got
  // through: the failover has `to` copy the rank from its surviving replica instead. Returns
  // once `to` has loaded it.
  absl::Status MoveAndLoseTheSource(int32_t rank, int to) {
    const int from = Owner(rank);
    const std::vector<int> replicas = Replicas(rank);
    if (replicas.empty()) return absl::FailedPreconditionError("the rank has no replica to copy from");
    if (owners_.empty()) {
      for (int32_t r = 0; r < layout().data_parallel_size; ++r) owners_.push_back(Owner(r));
    }
    owners_[static_cast<size_t>(rank)] = to;
    peer_client_.SetCopiesFail(absl::StrCat("d", from), true);
    ++epoch_;
    MAINSTAY_RETURN_IF_ERROR(SendPlacement({{to, {rank, from}}}));
    absl::SleepFor(absl::Milliseconds(200));  // the copy from the source fails meanwhile
    MAINSTAY_RETURN_IF_ERROR(Failover(from, {{to, {rank, replicas.front()}}}));
    return WaitLoaded(to);
  }

  // What the coordinator does for a move (MoveShard): rank `rank`'s shards go to daemon `to` at
  // the next epoch; `to` copies them from their owner, the others learn the new placement; once
  // `to` has loaded them, the old owner drops them. Returns the first failed call.
  absl::Status Move(int32_t rank, int to) { return MoveAndResend(rank, to, /*resend=*/false); }

  // A move whose first copy fails (its source cannot be reached for a while): the coordinator
  // re-sends it at the next epoch (reconciliation), after which the copy succeeds.
  absl::Status MoveWithResend(int32_t rank, int to) { return MoveAndResend(rank, to, /*resend=*/true); }
  // A move whose source never gets its DropShard (one the coordinator lost): the source keeps
  // its copy of the rank, frozen at the move's step.
  absl::Status MoveKeepingTheSource(int32_t rank, int to) {
    return MoveAndResend(rank, to, /*resend=*/false, /*drop=*/false);
  }

  // The same placement again at a new epoch (as the coordinator sends when it calls a move off).
  absl::Status Resend() {
    ++epoch_;
    return SendPlacement({});
  }

  // What the coordinator does to re-replicate: daemon `to` becomes one more replica of rank
  // `rank` at the next epoch and copies it from the rank's primary, which keeps its copy.
  // Returns once `to` has loaded it.
  absl::Status AddReplica(int32_t rank, int to) {
    replicas_[rank].push_back(to);
    ++epoch_;
    MAINSTAY_RETURN_IF_ERROR(SendPlacement({{to, {rank, Owner(rank)}}}));
    return WaitLoaded(to);
  }

  ShardDaemon& daemon_of(int32_t rank) { return *daemons_[static_cast<size_t>(Owner(rank))]; }
  const Layout& layout() const { return resolved_.layout; }
  const ResolvedJob& resolved() const { return resolved_; }
  peer::InProcessPeerGroupFactory& peers() { return peers_; }
  int num_daemons() const { return static_cast<int>(daemons_.size()); }
  ShardDaemon& daemon(int i) { return *daemons_[static_cast<size_t>(i)]; }
  InProcessPeers& peer_client() { return peer_client_; }
  int64_t epoch() const { return epoch_; }

  // What the coordinator does for a checkpoint: every daemon writes its shards at
  // `committed_step` into `dir`, then the manifest is committed. Returns the manifest.
  absl::StatusOr<v1::CheckpointManifest> Checkpoint(checkpoint::CheckpointFs& fs, const std::string& dir,
                                                    const std::string& id, int64_t committed_step) {
    v1::CheckpointManifest manifest;
    manifest.set_checkpoint_id(id);
    manifest.set_job_id(kJob);
    JobSpecToProto(spec_, manifest.mutable_spec());
    for (auto& d : daemons_) {
      v1::WriteCheckpointRequest req;
      req.set_job_id(kJob);
      req.set_placement_epoch(epoch_);
      req.set_checkpoint_id(id);
      req.set_directory_uri(dir);
      req.set_committed_step(committed_step);
      MAINSTAY_ASSIGN_OR_RETURN(v1::WriteCheckpointResponse r, d->WriteCheckpoint(req, absl::Now() + absl::Seconds(10)));
      manifest.set_version(r.version());
      manifest.set_committed_step(r.committed_step());
      manifest.set_moment_type(r.moment_type());
      manifest.set_has_second_moment(r.has_second_moment());
      *manifest.mutable_scaling() = r.scaling();
      for (const v1::CheckpointFile& f : r.files()) *manifest.add_files() = f;
    }
    MAINSTAY_RETURN_IF_ERROR(checkpoint::WriteManifest(fs, dir, manifest));
    return manifest;
  }

  // What the coordinator does for a restore: every shard is assigned again, at the next
  // epoch, from the checkpoint in `dir`. Returns the first failed AssignShard.
  absl::Status Restore(const std::string& dir, const std::string& id) {
    ++epoch_;
    for (int i = 0; i < num_daemons(); ++i) {
      v1::AssignShardRequest req = base_;
      req.set_placement_epoch(epoch_);
      req.mutable_placement()->set_epoch(epoch_);
      req.mutable_from_checkpoint()->set_checkpoint_id(id);
      req.mutable_from_checkpoint()->set_manifest_uri(checkpoint::JoinPath(dir, checkpoint::kManifestName));
      for (const Bucket& b : resolved_.layout.buckets) {
        for (const Shard& s : b.shards) {
          if (!Holds(i, s.rank)) continue;  // replicas load the checkpoint too
          v1::ShardRef* ref = req.add_shards();
          ref->set_bucket(b.index);
          ref->set_shard(s.rank);
        }
      }
      MAINSTAY_RETURN_IF_ERROR(daemons_[static_cast<size_t>(i)]->AssignShard(req).status());
    }
    return absl::OkStatus();
  }

  // The shard's slice of bucket b filled by value(tensor, index).
  template <typename Fn>
  std::vector<float> ShardValues(const Bucket& b, const Shard& s, Fn value) const {
    std::vector<float> out(static_cast<size_t>(b.shard_numel), 0.0f);
    for (const TensorFragment& f : s.fragments) {
      for (int64_t i = f.elements.begin; i < f.elements.end; ++i) {
        out[static_cast<size_t>(f.bucket_offset - s.elements.begin + (i - f.elements.begin))] = value(f.tensor, i);
      }
    }
    return out;
  }

  // The header of `rank`'s push of `values` (FP32) at the cluster's epoch.
  v1::PushGradHeader PushHeader(int32_t bucket, int32_t shard, int64_t step, int32_t rank, v1::PushKind kind,
                                const std::vector<float>& values) const {
    v1::PushGradHeader h;
    h.set_job_id(kJob);
    h.set_job_token(kToken);
    h.set_placement_epoch(epoch_);
    h.set_bucket(bucket);
    h.set_shard(shard);
    h.set_step(step);
    h.set_rank(rank);
    h.set_kind(kind);
    h.set_dtype(v1::ELEMENT_TYPE_FP32);
    h.set_total_bytes(static_cast<int64_t>(values.size() * 4));
    return h;
  }

  absl::StatusOr<v1::PushGradResponse> Push(int32_t bucket, int32_t shard, int64_t step, int32_t rank,
                                            const std::vector<float>& values, v1::PushKind kind,
                                            int32_t contributors = 1, int64_t chunk_elements = 1000,
                                            bool copies_sent = false) {
    v1::PushGradHeader h = PushHeader(bucket, shard, step, rank, kind, values);
    h.set_num_contributors(contributors);
    h.set_copies_sent(copies_sent);
    MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> session, daemon_of(shard).BeginPush(h));
    for (int64_t off = 0; off < static_cast<int64_t>(values.size()); off += chunk_elements) {
      const int64_t n = std::min<int64_t>(chunk_elements, static_cast<int64_t>(values.size()) - off);
      MAINSTAY_RETURN_IF_ERROR(session->AddChunk(
          off, std::string(reinterpret_cast<const char*>(values.data() + off), static_cast<size_t>(n) * 4)));
    }
    return session->Finish();
  }

  // A trainer's copy of rank `shard`'s reduced push of `step` for the replica on daemon `d`
  // (PushGradHeader.replica_copy), in one chunk, with the CRC-32C of `values` unless `crc`.
  absl::StatusOr<v1::PushGradResponse> PushCopy(int d, int32_t bucket, int32_t shard, int64_t step,
                                                const std::vector<float>& values,
                                                std::optional<uint32_t> crc = std::nullopt) {
    v1::PushGradHeader h = PushHeader(bucket, shard, step, shard, v1::PUSH_KIND_GRADIENT, values);
    h.set_num_contributors(1);
    h.set_crc32c(crc.has_value() ? *crc : Crc32c(values.data(), values.size() * 4));
    h.set_replica_copy(true);
    MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> session, daemon(d).BeginPush(h));
    MAINSTAY_RETURN_IF_ERROR(
        session->AddChunk(0, std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4)));
    return session->Finish();
  }
  // The values PushGrads pushes for (bucket b, rank s) at `step`.
  std::vector<float> GradShard(const Bucket& b, const Shard& s, int64_t step) const {
    return ShardValues(b, s, [&](int32_t t, int64_t i) { return GradValue(t, i, step); });
  }
  // Every rank's copy of its push of `step` to each replica of its shard, as the client sends
  // them next to its pushes (ClientOptions::replica_copies).
  void PushCopies(int64_t step) {
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        for (int d : Replicas(s.rank)) ASSERT_THAT(PushCopy(d, b.index, s.rank, step, GradShard(b, s, step)).status(), IsOk());
      }
    }
  }

  void PushInitial(const Reference& ref) {
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        auto values = ShardValues(b, s, [&](int32_t t, int64_t i) { return ref.master(static_cast<size_t>(t))[static_cast<size_t>(i)]; });
        ASSERT_THAT(Push(b.index, s.rank, -1, s.rank, values, v1::PUSH_KIND_INITIAL_PARAMS).status(), IsOk());
      }
    }
  }

  // Every rank pushes its reduced shard of step `step`: GradValue(.., -1) * scale (FP32), saying
  // with `copies_sent` that it sent the replicas copies of it (PushCopies).
  void PushGrads(int64_t step, float poison = 0.0f, float scale = 1.0f, bool copies_sent = false) {
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        auto values = ShardValues(b, s, [&](int32_t t, int64_t i) {
          return GradValue(t, i, step) * scale;
        });
        if (poison != 0.0f && b.index == 0 && s.rank == 0) values[0] = poison;
        ASSERT_THAT(Push(b.index, s.rank, step, s.rank, values, v1::PUSH_KIND_GRADIENT, 1, 1000, copies_sent).status(),
                    IsOk());
      }
    }
  }

  // Every rank finishes the step on every daemon it pushed to, in parallel (the calls block
  // until the step is decided). Returns one stats per call. `redirected`: as a trainer calls
  // the new owner of shards that moved after its pushes (FinishStepRequest.redirected).
  std::vector<absl::StatusOr<v1::StepStats>> Finish(int64_t step, double lr, bool redirected = false) {
    return Finish(step, [&](v1::FinishStepRequest& req) {
      req.set_lr(lr);
      req.set_redirected(redirected);
    });
  }
  // The same with one (lr, weight_decay) per param group (FinishStepRequest.groups).
  std::vector<absl::StatusOr<v1::StepStats>> FinishGroups(int64_t step, const StepHyper& groups) {
    return Finish(step, [&](v1::FinishStepRequest& req) { StepHyperToProto(groups, req.mutable_groups()); });
  }
  // `fill` sets the hyperparameters (and flags) of each rank's request.
  std::vector<absl::StatusOr<v1::StepStats>> Finish(int64_t step,
                                                    const std::function<void(v1::FinishStepRequest&)>& fill) {
    std::vector<std::pair<int32_t, int>> calls;
    for (int32_t r = 0; r < layout().data_parallel_size; ++r) calls.push_back({r, Owner(r)});
    std::vector<absl::StatusOr<v1::StepStats>> out(calls.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < calls.size(); ++i) {
      threads.emplace_back([&, i] {
        v1::FinishStepRequest req;
        req.set_job_id(kJob);
        req.set_job_token(kToken);
        req.set_placement_epoch(epoch_);
        req.set_step(step);
        req.set_rank(calls[i].first);
        fill(req);
        out[i] = daemons_[static_cast<size_t>(calls[i].second)]->FinishStep(req, absl::Now() + absl::Seconds(30));
      });
    }
    for (std::thread& t : threads) t.join();
    return out;
  }

  absl::StatusOr<PullResult> Pull(int32_t bucket, int32_t shard, int64_t version, absl::Duration wait = absl::Seconds(10)) {
    v1::PullParamsRequest req;
    req.set_job_id(kJob);
    req.set_job_token(kToken);
    req.set_placement_epoch(epoch_);
    req.set_bucket(bucket);
    req.set_shard(shard);
    req.set_version(version);
    return daemon_of(shard).PullParams(req, absl::Now() + wait);
  }

 private:
  JobSpec spec_;
  ResolvedJob resolved_;
  static v1::ShardRef ShardRef(int32_t bucket, int32_t shard) {
    v1::ShardRef ref;
    ref.set_bucket(bucket);
    ref.set_shard(shard);
    return ref;
  }

  // Sends every daemon holding a shard the current placement (Owner, Replicas) at epoch_.
  // `copies`: per daemon, the (rank, source daemon) it copies from a peer instead.
  absl::Status SendPlacement(const std::map<int, std::pair<int32_t, int>>& copies) {
    v1::AssignShardRequest base = base_;
    base.set_placement_epoch(epoch_);
    base.mutable_placement()->set_epoch(epoch_);
    for (v1::ShardPlacement& p : *base.mutable_placement()->mutable_shards()) {
      p.set_daemon_id(absl::StrCat("d", Owner(p.shard().shard())));
      p.clear_replica_daemon_ids();
      for (int k : Replicas(p.shard().shard())) p.add_replica_daemon_ids(absl::StrCat("d", k));
    }
    for (int i = 0; i < num_daemons(); ++i) {
      auto copy = copies.find(i);
      v1::AssignShardRequest req = base;
      for (const Bucket& b : resolved_.layout.buckets) {
        for (const Shard& s : b.shards) {
          if (!Holds(i, s.rank) || (copy != copies.end() && copy->second.first == s.rank)) continue;
          *req.add_shards() = ShardRef(b.index, s.rank);
        }
      }
      if (copy != copies.end()) {
        v1::AssignShardRequest from_peer = base;
        from_peer.clear_from_trainer();
        from_peer.mutable_from_peer()->mutable_daemon()->set_daemon_id(absl::StrCat("d", copy->second.second));
        for (const Bucket& b : resolved_.layout.buckets) *from_peer.add_shards() = ShardRef(b.index, copy->second.first);
        MAINSTAY_RETURN_IF_ERROR(daemons_[static_cast<size_t>(i)]->AssignShard(from_peer).status());
      }
      if (req.shards_size() > 0) MAINSTAY_RETURN_IF_ERROR(daemons_[static_cast<size_t>(i)]->AssignShard(req).status());
    }
    return absl::OkStatus();
  }

  absl::Status MoveAndResend(int32_t rank, int to, bool resend, bool drop = true) {
    const int from = Owner(rank);
    if (owners_.empty()) {
      for (int32_t r = 0; r < layout().data_parallel_size; ++r) owners_.push_back(Owner(r));
    }
    owners_[static_cast<size_t>(rank)] = to;
    if (resend) peer_client_.SetCopiesFail(absl::StrCat("d", from), true);
    ++epoch_;
    MAINSTAY_RETURN_IF_ERROR(SendPlacement({{to, {rank, from}}}));
    if (resend) {
      absl::SleepFor(absl::Milliseconds(200));  // the first copy fails meanwhile
      ++epoch_;
      MAINSTAY_RETURN_IF_ERROR(SendPlacement({{to, {rank, from}}}));
      absl::SleepFor(absl::Milliseconds(800));  // the first move's retry fails too, superseded
      peer_client_.SetCopiesFail(absl::StrCat("d", from), false);
    }
    MAINSTAY_RETURN_IF_ERROR(WaitLoaded(to));
    if (!drop) return absl::OkStatus();
    v1::DropShardRequest request;
    request.set_job_id(kJob);
    request.set_placement_epoch(epoch_);
    for (const Bucket& b : resolved_.layout.buckets) *request.add_shards() = ShardRef(b.index, rank);
    return daemons_[static_cast<size_t>(from)]->DropShard(request);
  }

  // What the coordinator waits for after a copy: the target's progress says it loaded epoch_.
  absl::Status WaitLoaded(int to) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (true) {
      for (const v1::JobProgress& p : daemons_[static_cast<size_t>(to)]->Progress()) {
        if (p.job_id() == kJob && p.placement_epoch() == epoch_ && !p.loading()) return absl::OkStatus();
      }
      if (absl::Now() > deadline) return absl::DeadlineExceededError("the copy's target did not load it");
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  int64_t epoch_ = 1;
  std::vector<int> owners_;      // rank -> daemon, once a move changed it (else rank % daemons)
  std::map<int32_t, std::vector<int>> replicas_;  // rank -> replica daemons
  v1::AssignShardRequest base_;  // the assignment without shards
  peer::InProcessPeerGroupFactory peers_;
  InProcessPeers peer_client_{&daemons_};  // outlives the daemons (declared first)
  std::vector<std::unique_ptr<ShardDaemon>> daemons_;
};

// Compares every published shard of `version` with the reference quantized whole, and every
// master with the reference's.
inline void ExpectMatchesReference(Cluster& c, Reference& ref, int64_t version) {
  const size_t num_tensors = c.layout().tensors.size();
  std::vector<std::vector<uint8_t>> data(num_tensors), scales(num_tensors);
  for (size_t t = 0; t < num_tensors; ++t) ref.Quantize(t, data[t], scales[t]);
  for (const Bucket& b : c.layout().buckets) {
    const FormatDescriptor& d = Describe(b.format);
    const int scale_bytes = d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
    for (const Shard& s : b.shards) {
      absl::StatusOr<PullResult> pulled = c.Pull(b.index, s.rank, version);
      ASSERT_THAT(pulled.status(), IsOk());
      ASSERT_FALSE(pulled->unchanged);
      const QuantizedShard& q = *pulled->shard;
      ASSERT_EQ(q.version, version);
      absl::StatusOr<ShardStateCopy> state = c.daemon_of(s.rank).ReadShardState(kJob, b.index, s.rank);
      ASSERT_THAT(state.status(), IsOk());
      int64_t scale_offset = 0;
      std::vector<bool> covered(q.data.size(), false);
      for (const TensorFragment& f : s.fragments) {
        const size_t t = static_cast<size_t>(f.tensor);
        const IndexRange bytes = FragmentShardByteRange(b, s, f);
        for (int64_t i = bytes.begin; i < bytes.end && i < static_cast<int64_t>(covered.size()); ++i) covered[i] = true;
        const int64_t begin = DataBytes(b.format, f.elements.begin);
        ASSERT_EQ(0, std::memcmp(q.data.data() + bytes.begin, data[t].data() + begin, static_cast<size_t>(bytes.size())))
            << "data of " << c.layout().tensors[t].name << " " << f.elements.begin << ".." << f.elements.end;
        const IndexRange blocks = FragmentScaleBlocks(c.layout(), f);
        if (blocks.size() * scale_bytes > 0) {  // (memcmp of null pointers is undefined, even for 0 bytes)
          ASSERT_EQ(0, std::memcmp(q.scales.data() + scale_offset * scale_bytes, scales[t].data() + blocks.begin * scale_bytes,
                                   static_cast<size_t>(blocks.size() * scale_bytes)))
              << "scales of " << c.layout().tensors[t].name;
        }
        scale_offset += blocks.size();
        const int64_t off = f.bucket_offset - s.elements.begin;
        ASSERT_EQ(0, std::memcmp(state->master.data() + off, ref.master(t).data() + f.elements.begin,
                                 static_cast<size_t>(f.elements.size()) * 4))
            << "master of " << c.layout().tensors[t].name;
      }
      // The bytes no fragment covers (padding) are zeros in every version: a version cast into
      // an evicted version's buffer is not zeroed first, as nothing writes there.
      for (size_t i = 0; i < covered.size(); ++i) {
        if (!covered[i]) {
          ASSERT_EQ(q.data[i], 0) << "padding byte " << i << " of bucket " << b.index << " shard " << s.rank;
        }
      }
    }
  }
}

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_TESTING_DAEMON_CLUSTER_H_

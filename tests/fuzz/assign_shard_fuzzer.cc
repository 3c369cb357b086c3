// libFuzzer target: placement messages (AssignShard, DropShard) against a real in-process
// ShardDaemon "d0" (fresh per input; no peer group, no peer client, checkpoints in an in-memory
// file system under the checkpoint root /ckpt). The input is a sequence of up to 24 operations.
// Each starts as the message a correct coordinator would send next (AssignShard of every shard
// of job "job-a" or "job-b" to d0 at the next epoch, from_trainer; or DropShard at the current
// epoch) and the input changes any of: job id, epoch, token digest, spec and layout, every
// shard's owner and replicas (d0, d1, d2, empty), the shards gained (some, none, out of range,
// twice), the source (trainer, one of two real checkpoints, a missing or outside one, another
// daemon), and then merges a length-prefixed run of serialized AssignShardRequest or
// DropShardRequest bytes into the message (so any field can take any value).
//
// The fuzzer keeps a model of what the daemon must hold (placement_model.h), from the messages
// it accepted: which jobs, at which epoch, which shards (a shard the placement gives to another
// daemon moves out and is served again when given back; DropShard forgets it), their roles and
// whether they wait for a copy (from_peer).
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, leak, UB or hang (built with -fsanitize=fuzzer,address,undefined);
//  - every refusal is INVALID_ARGUMENT, FAILED_PRECONDITION, UNAVAILABLE, NOT_FOUND,
//    PERMISSION_DENIED, UNAUTHENTICATED or RESOURCE_EXHAUSTED, and changes no job's epoch and
//    no set of jobs;
//  - an accepted message was valid: a 32-byte token digest and a spec whose layout is the one
//    sent (new job), shards inside the layout, no daemon both primary and replica of a shard,
//    an epoch no older than the job's (a job's epoch never goes back), a named source daemon;
//  - AssignShard's answer lists exactly the shards the model says the daemon holds, with the
//    roles the placement gives them; Progress() lists exactly the model's jobs at their epochs;
//  - at the end, for every job: a correct initial-parameters push for each shard is accepted
//    exactly when the daemon holds that shard as primary, not waiting for a copy, in a job not
//    restored from a checkpoint; a wrong or missing token is refused; and a job that then has
//    every shard's parameters on this daemon alone, with no copy pending, publishes version 0
//    (FinishStep(-1) OK).
// MAINSTAY_FUZZ_VERBOSE=1 prints every message and its answer; MAINSTAY_FUZZ_STATS=1 counts the
// outcomes reached.
#include <fuzzer/FuzzedDataProvider.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "mainstay/v1/shard.pb.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/checkpoint/checkpoint_fs.h"
#include "server/daemon/shard_daemon.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/placement_model.h"

namespace mainstay {
namespace {

using fuzz::Check;
using fuzz::Fail;
using fuzz::JobModel;
using fuzz::Key;
using fuzz::Model;

constexpr char kSelf[] = "d0";
constexpr char kToken[] = "fuzz-token";
constexpr char kOtherToken[] = "other-token";
constexpr char kCheckpointRoot[] = "/ckpt";
constexpr int kMaxOps = 24;

std::string Sha256(const std::string& text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

std::string Name(const Key& k) { return absl::StrCat("(bucket ", k.first, ", shard ", k.second, ")"); }

void CheckFamily(const absl::Status& s, const std::string& where) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kResourceExhausted: return;
    default: Fail(where + " failed with an unexpected code: " + s.ToString());
  }
}

ResolvedJob Resolve(const JobSpec& spec) {
  absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec);
  if (!resolved.ok()) Fail("the fuzzer's job does not resolve: " + resolved.status().ToString());
  return *std::move(resolved);
}

// The two jobs of the inputs: "job-a" (D = 2, two buckets; the checkpoints are of it) and
// "job-b" (D = 3, one bucket, two copies of each shard).
const ResolvedJob& JobOf(int which) {
  static const ResolvedJob* a = [] {
    JobSpec spec;
    spec.name = "fuzz-a";
    spec.recipe = "bf16_with_fp8_current_scaling_mixed";
    spec.data_parallel_size = 2;
    spec.bucket_numel = 64;
    spec.tensors = {{"layers.0.mlp.fc1.weight", {16, 4}}, {"layers.0.norm.weight", {6}}, {"layers.1.w", {4, 4}}};
    return new ResolvedJob(Resolve(spec));
  }();
  static const ResolvedJob* b = [] {
    JobSpec spec;
    spec.name = "fuzz-b";
    spec.data_parallel_size = 3;
    spec.tensors = {{"w", {6, 4}}, {"b", {6}}};
    spec.replication_factor = 2;
    return new ResolvedJob(Resolve(spec));
  }();
  return which == 0 ? *a : *b;
}

const char* JobIdOf(int which) { return which == 0 ? "job-a" : "job-b"; }

void AddRef(google::protobuf::RepeatedPtrField<v1::ShardRef>* refs, const Key& k) {
  v1::ShardRef* ref = refs->Add();
  ref->set_bucket(k.first);
  ref->set_shard(k.second);
}

std::vector<Key> KeysOf(const Layout& layout) {
  std::vector<Key> keys;
  for (const Bucket& b : layout.buckets) {
    for (const Shard& s : b.shards) keys.push_back({b.index, s.rank});
  }
  return keys;
}

// ---- Two real checkpoints of job-a at version 0, written once into an in-memory file system
// by a daemon that trained it (the daemons of every input read them).

struct Checkpoint {
  std::string id;
  std::string manifest_uri;
};

checkpoint::MemFs& Fs() {
  static checkpoint::MemFs* fs = new checkpoint::MemFs;
  return *fs;
}

v1::AssignShardRequest WholeJobOnSelf(int which, int64_t epoch) {
  const ResolvedJob& job = JobOf(which);
  v1::AssignShardRequest req;
  req.set_job_id(JobIdOf(which));
  req.set_placement_epoch(epoch);
  req.set_job_token_sha256(Sha256(kToken));
  JobSpecToProto(job.spec, req.mutable_spec());
  LayoutToProto(job.layout, req.mutable_layout());
  req.mutable_placement()->set_job_id(JobIdOf(which));
  req.mutable_placement()->set_epoch(epoch);
  req.mutable_placement()->add_daemons()->set_daemon_id(kSelf);
  req.mutable_from_trainer();
  for (const Key& k : KeysOf(job.layout)) {
    v1::ShardPlacement* p = req.mutable_placement()->add_shards();
    p->mutable_shard()->set_bucket(k.first);
    p->mutable_shard()->set_shard(k.second);
    p->set_daemon_id(kSelf);
    AddRef(req.mutable_shards(), k);
  }
  return req;
}

// A correct initial-parameters push of `k`; returns Finish's answer (or the first refusal).
absl::StatusOr<v1::PushGradResponse> PushInitial(daemon::ShardDaemon& d, const std::string& job_id,
                                                 const std::string& token, int64_t epoch, const Layout& layout,
                                                 const Key& k) {
  v1::PushGradHeader h;
  h.set_job_id(job_id);
  h.set_job_token(token);
  h.set_placement_epoch(epoch);
  h.set_bucket(k.first);
  h.set_shard(k.second);
  h.set_rank(k.second);
  h.set_kind(v1::PUSH_KIND_INITIAL_PARAMS);
  h.set_step(-1);
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_num_contributors(1);
  const int64_t numel = k.first >= 0 && k.first < static_cast<int32_t>(layout.buckets.size())
                            ? layout.buckets[static_cast<size_t>(k.first)].shard_numel
                            : 0;
  std::vector<float> params(static_cast<size_t>(numel));
  for (size_t i = 0; i < params.size(); ++i) params[i] = 0.01f * static_cast<float>(i % 97) - 0.3f;
  const std::string data(reinterpret_cast<const char*>(params.data()), params.size() * sizeof(float));
  h.set_total_bytes(static_cast<int64_t>(data.size()));
  h.set_crc32c(Crc32c(data.data(), data.size()));
  absl::StatusOr<std::unique_ptr<daemon::PushSession>> session = d.BeginPush(h);
  if (!session.ok()) return session.status();
  if (absl::Status s = (*session)->AddChunk(0, data); !s.ok()) return s;
  return (*session)->Finish();
}

v1::FinishStepRequest FinishInitial(const std::string& job_id, const std::string& token, int64_t epoch) {
  v1::FinishStepRequest req;
  req.set_job_id(job_id);
  req.set_job_token(token);
  req.set_placement_epoch(epoch);
  req.set_step(-1);
  req.set_rank(0);
  return req;
}

const std::vector<Checkpoint>& Checkpoints() {
  static const std::vector<Checkpoint>* checkpoints = [] {
    auto* out = new std::vector<Checkpoint>;
    daemon::ShardDaemonOptions options;
    options.fs = &Fs();
    daemon::ShardDaemon d(options);
    d.set_daemon_id(kSelf);
    const ResolvedJob& job = JobOf(0);
    if (absl::StatusOr<v1::AssignShardResponse> r = d.AssignShard(WholeJobOnSelf(0, 1)); !r.ok()) {
      Fail("checkpoint setup: AssignShard: " + r.status().ToString());
    }
    for (const Key& k : KeysOf(job.layout)) {
      absl::StatusOr<v1::PushGradResponse> r = PushInitial(d, "job-a", kToken, 1, job.layout, k);
      if (!r.ok()) Fail("checkpoint setup: push: " + r.status().ToString());
    }
    absl::StatusOr<v1::StepStats> v0 = d.FinishStep(FinishInitial("job-a", kToken, 1), absl::Now() + absl::Seconds(20));
    if (!v0.ok()) Fail("checkpoint setup: version 0: " + v0.status().ToString());
    for (const char* id : {"ck-1", "ck-2"}) {
      const std::string dir = checkpoint::JoinPath(kCheckpointRoot, id);
      v1::WriteCheckpointRequest req;
      req.set_job_id("job-a");
      req.set_placement_epoch(1);
      req.set_checkpoint_id(id);
      req.set_directory_uri(dir);
      req.set_committed_step(-1);
      absl::StatusOr<v1::WriteCheckpointResponse> w = d.WriteCheckpoint(req, absl::Now() + absl::Seconds(20));
      if (!w.ok()) Fail("checkpoint setup: WriteCheckpoint: " + w.status().ToString());
      // What the coordinator commits last (coordinator_checkpoints.cc).
      v1::CheckpointManifest manifest;
      manifest.set_checkpoint_id(id);
      manifest.set_job_id("job-a");
      JobSpecToProto(job.spec, manifest.mutable_spec());
      manifest.set_version(w->version());
      manifest.set_committed_step(w->committed_step());
      manifest.set_moment_type(w->moment_type());
      manifest.set_has_second_moment(w->has_second_moment());
      *manifest.mutable_scaling() = w->scaling();
      for (const v1::CheckpointFile& f : w->files()) *manifest.add_files() = f;
      if (absl::Status s = checkpoint::WriteManifest(Fs(), dir, manifest); !s.ok()) {
        Fail("checkpoint setup: WriteManifest: " + s.ToString());
      }
      out->push_back({id, checkpoint::JoinPath(dir, checkpoint::kManifestName)});
    }
    d.Shutdown();
    return out;
  }();
  return *checkpoints;
}

// How often each outcome was reached, printed at exit with MAINSTAY_FUZZ_STATS=1 (to see that
// the inputs get past the validation into placements, moves, restores and drops).
struct Outcomes {
  std::map<std::string, int64_t> counts;
  ~Outcomes() {
    if (std::getenv("MAINSTAY_FUZZ_STATS") == nullptr) return;
    for (const auto& [what, n] : counts) std::fprintf(stderr, "%s: %lld\n", what.c_str(), static_cast<long long>(n));
  }
  void Add(const std::string& what, int64_t n = 1) { counts[what] += n; }
};
Outcomes outcomes;

void Count(const fuzz::PlacementChange& change) {
  outcomes.Add("shards moved out", change.moved_out);
  outcomes.Add("shards given back", change.given_back);
  outcomes.Add("shards waiting for a copy", change.waiting_for_copy);
}

std::string TokenOf(const std::string& digest) {
  if (digest == Sha256(kToken)) return kToken;
  if (digest == Sha256(kOtherToken)) return kOtherToken;
  return "";
}

std::map<std::string, int64_t> Epochs(const daemon::ShardDaemon& d) {
  std::map<std::string, int64_t> out;
  for (const v1::JobProgress& p : d.Progress()) {
    Check(out.emplace(p.job_id(), p.placement_epoch()).second, "Progress lists job " + p.job_id() + " twice");
  }
  return out;
}

void CheckMatchesModel(const daemon::ShardDaemon& d, const Model& model, const std::string& after) {
  const std::map<std::string, int64_t> epochs = Epochs(d);
  for (const auto& [id, epoch] : epochs) {
    auto m = model.find(id);
    Check(m != model.end(), "after " + after + " the daemon holds job '" + id + "', which it should not");
    Check(m->second.epoch == epoch,
          absl::StrCat("after ", after, " job '", id, "' is at epoch ", epoch, ", not ", m->second.epoch));
  }
  for (const auto& [id, m] : model) {
    Check(epochs.count(id) > 0, "after " + after + " the daemon lost job '" + id + "'");
  }
}

// ---- Drawing the messages.

template <typename T>
T Pick(FuzzedDataProvider& in, std::initializer_list<T> choices) {
  return *(choices.begin() + in.ConsumeIntegralInRange<size_t>(0, choices.size() - 1));
}

// True for the "right" choice `right` times in `of` (an exhausted input reads as 0: right).
bool Right(FuzzedDataProvider& in, int right, int of) { return in.ConsumeIntegralInRange(0, of - 1) < right; }

// `current` is a held job's epoch (>= 0) or 0.
int64_t DrawEpoch(FuzzedDataProvider& in, int64_t current, int64_t next) {
  if (Right(in, 13, 16)) return next;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  return Pick<int64_t>(in, {current, current - 1, 0, -1, current < kMax - 7 ? current + 7 : kMax, kMax,
                            std::numeric_limits<int64_t>::min()});
}

void MergeRaw(FuzzedDataProvider& in, google::protobuf::Message& msg) {
  if (Right(in, 7, 8)) return;
  const std::string bytes = in.ConsumeBytesAsString(in.ConsumeIntegralInRange<size_t>(0, 96));
  msg.MergeFromString(bytes);  // a failed parse leaves some fields merged: fine either way
}

v1::AssignShardRequest DrawAssign(FuzzedDataProvider& in, int which, const Model& model) {
  const std::string job_id = JobIdOf(which);
  auto m = model.find(job_id);
  const int64_t current = m == model.end() ? 0 : m->second.epoch;
  v1::AssignShardRequest req =
      WholeJobOnSelf(which, current == std::numeric_limits<int64_t>::max() ? current : current + 1);
  const Layout& layout = JobOf(which).layout;
  const std::vector<Key> keys = KeysOf(layout);
  if (!Right(in, 31, 32)) req.set_job_id(Pick<const char*>(in, {"", "job-a ", JobIdOf(1 - which)}));
  const int64_t epoch = DrawEpoch(in, current, req.placement_epoch());
  req.set_placement_epoch(epoch);
  req.mutable_placement()->set_epoch(epoch);
  switch (in.ConsumeIntegralInRange(0, 31)) {
    case 1: req.set_job_token_sha256(Sha256(kOtherToken)); break;
    case 2: req.clear_job_token_sha256(); break;
    case 3: req.set_job_token_sha256(Sha256(kToken).substr(1)); break;
    default: break;
  }
  switch (in.ConsumeIntegralInRange(0, 31)) {
    case 1:  // the other job's spec and layout: consistent, but not this job's
      JobSpecToProto(JobOf(1 - which).spec, req.mutable_spec());
      LayoutToProto(JobOf(1 - which).layout, req.mutable_layout());
      break;
    case 2: LayoutToProto(JobOf(1 - which).layout, req.mutable_layout()); break;  // a layout that does not match
    case 3: req.mutable_spec()->set_data_parallel_size(0); break;
    default: break;
  }
  // The placement: each shard's owner and replicas.
  if (!Right(in, 3, 4)) {
    req.mutable_placement()->clear_shards();
    for (const Key& k : keys) {
      if (!Right(in, 15, 16)) continue;  // a shard the placement does not list
      v1::ShardPlacement* p = req.mutable_placement()->add_shards();
      p->mutable_shard()->set_bucket(k.first);
      p->mutable_shard()->set_shard(k.second);
      p->set_daemon_id(Right(in, 2, 3) ? kSelf : Pick<const char*>(in, {"d1", "d2", ""}));
      switch (in.ConsumeIntegralInRange(0, 7)) {
        case 1: p->add_replica_daemon_ids("d1"); break;
        case 2: p->add_replica_daemon_ids(kSelf); break;
        case 3:
          p->add_replica_daemon_ids("d1");
          p->add_replica_daemon_ids("d2");
          break;
        default: break;
      }
    }
    if (!Right(in, 7, 8)) {  // an entry outside the layout, or one listed twice
      v1::ShardPlacement* p = req.mutable_placement()->add_shards();
      p->mutable_shard()->set_bucket(Pick<int32_t>(in, {0, 1, 99, -1}));
      p->mutable_shard()->set_shard(Pick<int32_t>(in, {0, 1, 2, 3}));
      p->set_daemon_id(Pick<const char*>(in, {kSelf, "d1"}));
    }
    for (const char* other : {"d1", "d2"}) {
      v1::DaemonEndpoint* e = req.mutable_placement()->add_daemons();
      e->set_daemon_id(other);
      e->set_address("127.0.0.1:1");  // never dialled: no peer client, no peer group
    }
  }
  // The shards gained.
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 1:
    case 2: {
      req.clear_shards();
      for (const Key& k : keys) {
        if (!in.ConsumeBool()) AddRef(req.mutable_shards(), k);
      }
      break;
    }
    case 3: req.clear_shards(); break;
    case 4:
      AddRef(req.mutable_shards(), {Pick<int32_t>(in, {-1, 0, static_cast<int32_t>(layout.buckets.size())}),
                                    Pick<int32_t>(in, {-1, 0, static_cast<int32_t>(layout.data_parallel_size)})});
      break;
    case 5: {  // a shard listed twice
      const v1::ShardRef again = req.shards(0);
      *req.add_shards() = again;
      break;
    }
    default: break;
  }
  // The source of the gained shards.
  switch (in.ConsumeIntegralInRange(0, 15)) {
    case 1:
    case 2:
    case 3: {
      const Checkpoint& c = Checkpoints()[in.ConsumeIntegralInRange<size_t>(0, Checkpoints().size() - 1)];
      v1::SourceCheckpoint* s = req.mutable_from_checkpoint();
      s->set_checkpoint_id(c.id);
      s->set_manifest_uri(c.manifest_uri);
      switch (in.ConsumeIntegralInRange(0, 7)) {
        case 1: s->set_manifest_uri("/ckpt/missing/MANIFEST"); break;
        case 2: s->set_manifest_uri("/etc/MANIFEST"); break;
        case 3: s->set_manifest_uri("/ckpt/../ckpt/ck-1/MANIFEST"); break;
        case 4: s->set_checkpoint_id(""); break;
        case 5: s->set_checkpoint_id(c.id == "ck-1" ? "ck-2" : "ck-1"); break;
        default: break;
      }
      break;
    }
    case 4:
    case 5: {
      v1::DaemonEndpoint* source = req.mutable_from_peer()->mutable_daemon();
      source->set_daemon_id(Right(in, 3, 4) ? "d1" : "");
      source->set_address("127.0.0.1:1");
      break;
    }
    case 6: req.clear_source(); break;
    default: break;
  }
  MergeRaw(in, req);
  return req;
}

v1::DropShardRequest DrawDrop(FuzzedDataProvider& in, int which, const Model& model) {
  v1::DropShardRequest req;
  req.set_job_id(JobIdOf(which));
  auto m = model.find(req.job_id());
  const int64_t current = m == model.end() ? 0 : m->second.epoch;
  req.set_placement_epoch(DrawEpoch(in, current, current));
  const Layout& layout = JobOf(which).layout;
  if (!Right(in, 1, 3)) {  // some shards (else: every shard of the job)
    for (const Key& k : KeysOf(layout)) {
      if (!in.ConsumeBool()) AddRef(req.mutable_shards(), k);
    }
    if (!Right(in, 7, 8)) AddRef(req.mutable_shards(), {Pick<int32_t>(in, {-1, 99}), Pick<int32_t>(in, {-1, 7})});
  }
  MergeRaw(in, req);
  return req;
}

// ---- Running them.

// MAINSTAY_FUZZ_VERBOSE=1: print every message (without its long spec and layout) and its
// answer, to read a saved input.
bool Verbose() {
  static const bool verbose = std::getenv("MAINSTAY_FUZZ_VERBOSE") != nullptr;
  return verbose;
}

void Trace(const std::string& what, const google::protobuf::Message& msg, const absl::Status& answer) {
  if (!Verbose()) return;
  std::string text;
  if (const auto* assign = dynamic_cast<const v1::AssignShardRequest*>(&msg)) {
    v1::AssignShardRequest brief = *assign;
    brief.clear_spec();
    brief.clear_layout();
    text = brief.ShortDebugString() + " spec of " + assign->spec().name();
  } else {
    text = msg.ShortDebugString();
  }
  std::fprintf(stderr, "%s: %s\n  -> %s\n", what.c_str(), text.c_str(), answer.ToString().c_str());
}

void RunAssign(daemon::ShardDaemon& d, const v1::AssignShardRequest& req, Model& model, int op) {
  const std::string what =
      absl::StrCat("AssignShard #", op, " (job '", req.job_id(), "', epoch ", req.placement_epoch(), ")");
  const std::map<std::string, int64_t> before = Epochs(d);
  absl::StatusOr<v1::AssignShardResponse> r = d.AssignShard(req);
  Trace(what, req, r.status());
  if (!r.ok()) {
    CheckFamily(r.status(), what);
    Check(Epochs(d) == before, what + " was refused (" + r.status().ToString() + ") but changed the daemon's jobs");
    outcomes.Add("refused messages");
    return;
  }
  auto it = model.find(req.job_id());
  const bool replace =
      it != model.end() && req.has_from_checkpoint() &&
      it->second.restored_from != std::make_pair(req.from_checkpoint().checkpoint_id(), req.placement_epoch());
  JobModel* existing = it != model.end() && !replace ? &it->second : nullptr;
  if (existing == nullptr) {
    // A new job (or a restore that replaces one): the spec and layout were checked.
    Check(!req.job_id().empty(), what + " created a job without an id");
    Check(req.job_token_sha256().size() == SHA256_DIGEST_LENGTH,
          what + " created a job without a 32-byte token digest");
    absl::StatusOr<JobSpec> spec = JobSpecFromProto(req.spec());
    Check(spec.ok(), what + " created a job whose spec does not parse: " + spec.status().ToString());
    absl::StatusOr<ResolvedJob> resolved = ResolveJob(*spec);
    Check(resolved.ok(), what + " created a job whose spec does not resolve: " + resolved.status().ToString());
    absl::StatusOr<Layout> layout = LayoutFromProto(req.layout());
    Check(layout.ok() && *layout == resolved->layout, what + " created a job whose layout is not its spec's");
    if (replace) {
      Check(req.placement_epoch() >= it->second.epoch,
            absl::StrCat(what, ": a restore at an older epoch replaced the job (at epoch ", it->second.epoch,
                         "): its epoch went back"));
    }
    JobModel fresh;
    fresh.job = *std::move(resolved);
    fresh.token = TokenOf(req.job_token_sha256());
    if (req.has_from_checkpoint()) {
      fresh.restored = true;
      fresh.restored_from = {req.from_checkpoint().checkpoint_id(), req.placement_epoch()};
    }
    const std::string refuse = fuzz::MustRefuse(req, nullptr, fresh.job.layout);
    Check(refuse.empty(), what + " accepted " + refuse);
    Count(fuzz::ApplyAssign(fresh, req, kSelf));
    model[req.job_id()] = std::move(fresh);
    outcomes.Add(replace ? "jobs replaced by a restore" : req.has_from_checkpoint() ? "jobs restored" : "jobs created");
  } else {
    const std::string refuse = fuzz::MustRefuse(req, existing, existing->job.layout);
    Check(refuse.empty(), what + " accepted " + refuse);
    Count(fuzz::ApplyAssign(*existing, req, kSelf));
    outcomes.Add("placements of held jobs");
  }
  // The answer: every shard held now, each with the role the placement gives it.
  const JobModel& m = model[req.job_id()];
  std::set<Key> answered;
  for (const v1::ShardStatus& s : r->shards()) {
    const Key k{s.shard().bucket(), s.shard().shard()};
    Check(answered.insert(k).second, what + " answered " + Name(k) + " twice");
    Check(m.held.count(k) > 0, what + " answered " + Name(k) + ", which the daemon should not hold");
    const v1::ShardRole role = m.placement.IsReplica(k) ? v1::SHARD_ROLE_REPLICA : v1::SHARD_ROLE_PRIMARY;
    Check(s.role() == role, what + " answered " + Name(k) + " as " + v1::ShardRole_Name(s.role()) +
                                ", the placement makes it " + v1::ShardRole_Name(role));
  }
  Check(answered.size() == m.held.size(),
        absl::StrCat(what, " answered ", answered.size(), " shards; the daemon should hold ", m.held.size()));
  CheckMatchesModel(d, model, what);
}

void RunDrop(daemon::ShardDaemon& d, const v1::DropShardRequest& req, Model& model, int op) {
  const std::string what =
      absl::StrCat("DropShard #", op, " (job '", req.job_id(), "', epoch ", req.placement_epoch(), ")");
  const std::map<std::string, int64_t> before = Epochs(d);
  const absl::Status s = d.DropShard(req);
  Trace(what, req, s);
  if (!s.ok()) {
    CheckFamily(s, what);
    Check(Epochs(d) == before, what + " was refused but changed the daemon's jobs");
    outcomes.Add("refused messages");
    return;
  }
  auto it = model.find(req.job_id());
  if (it == model.end()) {
    Check(Epochs(d) == before, what + " of a job the daemon does not hold changed its jobs");
    return;
  }
  JobModel& m = it->second;
  Check(req.placement_epoch() >= m.epoch,
        absl::StrCat(what, " accepted an epoch older than the job's (", m.epoch, ")"));
  outcomes.Add("drops");
  if (fuzz::ApplyDrop(m, req)) {
    model.erase(it);  // the job is gone from the daemon
    outcomes.Add("jobs dropped");
  }
  CheckMatchesModel(d, model, what);
}

// The end: trainers' calls against whatever the messages left.
void CheckServes(daemon::ShardDaemon& d, const Model& model) {
  for (const auto& [id, m] : model) {
    const std::vector<Key> keys = KeysOf(m.job.layout);
    const Key first = keys.front();
    if (m.token.empty()) {
      absl::StatusOr<v1::PushGradResponse> r = PushInitial(d, id, kToken, m.epoch, m.job.layout, first);
      Check(r.status().code() == absl::StatusCode::kPermissionDenied,
            "job '" + id + "' was created with another token's digest, yet a push with ours answered " +
                r.status().ToString());
      continue;
    }
    const std::string wrong = m.token == kToken ? kOtherToken : kToken;
    absl::StatusOr<v1::PushGradResponse> bad = PushInitial(d, id, wrong, m.epoch, m.job.layout, first);
    Check(bad.status().code() == absl::StatusCode::kPermissionDenied,
          "a push with a wrong token answered " + bad.status().ToString());
    bad = PushInitial(d, id, "", m.epoch, m.job.layout, first);
    Check(bad.status().code() == absl::StatusCode::kUnauthenticated,
          "a push without a token answered " + bad.status().ToString());

    bool all_pushed = true;
    for (const Key& k : keys) {
      auto held = m.held.find(k);
      const bool primary = held != m.held.end() && !m.placement.IsReplica(k);
      const bool takes = primary && !held->second.incoming && !m.restored;
      absl::StatusOr<v1::PushGradResponse> r = PushInitial(d, id, m.token, m.epoch, m.job.layout, k);
      const std::string what = "job '" + id + "': a correct initial push of " + Name(k) + " ";
      if (takes) {
        Check(r.ok(), what + "(a primary shard here) was refused: " + r.status().ToString());
        Check(!r->duplicate(), what + "was called a duplicate");
        outcomes.Add("pushes taken");
        continue;
      }
      all_pushed = false;
      Check(!r.ok(), what +
                         (held == m.held.end()    ? "(not held here)"
                          : !primary              ? "(a replica here)"
                          : held->second.incoming ? "(waiting for its copy)"
                                                  : "(into a job restored from a checkpoint)") +
                         " was accepted");
      CheckFamily(r.status(), what);
      outcomes.Add("pushes refused");
      if (held == m.held.end() || !primary) {
        Check(r.status().code() == absl::StatusCode::kFailedPrecondition,
              what + "of a shard not served here answered " + r.status().ToString());
      }
    }
    // Every shard's parameters on this daemon alone, no copy in the way: version 0 is published.
    if (all_pushed && m.placement.Alone() && !m.queued_move) {
      absl::StatusOr<v1::StepStats> v0 =
          d.FinishStep(FinishInitial(id, m.token, m.epoch), absl::Now() + absl::Seconds(20));
      Check(v0.ok(), "job '" + id + "' has every initial parameter on this daemon alone, but version 0 failed: " +
                         v0.status().ToString());
      outcomes.Add("versions 0 published");
    }
  }
}

}  // namespace
}  // namespace mainstay

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)mainstay::Checkpoints();  // before the first input: its time is not the input's
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mainstay;
  FuzzedDataProvider in(data, size);
  daemon::ShardDaemonOptions options;
  options.fs = &Fs();
  options.peer_timeout = absl::Seconds(5);
  daemon::ShardDaemon d(options);
  d.set_daemon_id(kSelf);
  d.set_checkpoint_root(kCheckpointRoot);
  Model model;
  for (int op = 0; op < kMaxOps && in.remaining_bytes() > 0; ++op) {
    const int which = Right(in, 3, 4) ? 0 : 1;
    if (Right(in, 3, 4)) {
      RunAssign(d, DrawAssign(in, which, model), model, op);
    } else {
      RunDrop(d, DrawDrop(in, which, model), model, op);
    }
  }
  CheckServes(d, model);
  d.Shutdown();
  return 0;
}

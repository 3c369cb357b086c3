// The coordinator core with an injected clock, a memory or file state store and a recording
// shard assigner: membership and leases, placement, jobs, KV, durability.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/placement.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/checkpoint/checkpoint_fs.h"
#include "tests/testing/job_token.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::coordinator {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kGiB = int64_t{1} << 30;

v1::JobSpec SmallSpec(const std::string& name, int64_t dp, std::vector<std::string> nodes = {}) {
  JobSpec spec;
  spec.name = name;
  spec.recipe = "bf16_with_fp8_current_scaling_mixed";
  spec.data_parallel_size = dp;
  spec.tensors = {{"layers.0.fc1.weight", {256, 128}}, {"layers.0.fc1.bias", {256}}, {"layers.1.fc2.weight", {128, 256}}};
  spec.trainer_nodes = std::move(nodes);
  v1::JobSpec proto;
  JobSpecToProto(spec, &proto);
  return proto;
}

class CoordinatorCoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Restart(NewMemoryStateStore()); }

  void Restart(std::unique_ptr<StateStore> store) {
    coordinator_.reset();
    store_ = std::move(store);
    CoordinatorOptions options;
    options.clock = &clock_;
    options.store = store_.get();
    options.assigner = &assigner_;
    options.fs = &fs_;
    options.checkpoint_dir = checkpoint_dir_;
    options.default_lease_ttl_ms = 1000;
    options.snapshot_every_batches = 4;  // exercise compaction
    auto c = Coordinator::Create(options);
    ASSERT_THAT(c, IsOk());
    coordinator_ = *std::move(c);
  }

  // A registration as mainstayd makes it: a known id presents the key its first one returned.
  v1::RegisterDaemonResponse Register(const std::string& node, int64_t memory, const std::string& id = "") {
    v1::RegisterDaemonRequest req;
    req.set_daemon_id(id);
    if (auto k = keys_.find(id); k != keys_.end()) req.set_daemon_key(k->second);
    req.set_address(node + ":7000");
    req.set_node_name(node);
    req.mutable_resources()->set_host_memory_bytes(memory);
    auto r = coordinator_->RegisterDaemon(req);
    EXPECT_THAT(r, IsOk());
    if (r.ok()) keys_[r->daemon_id()] = r->daemon_key();
    return r.ok() ? *r : v1::RegisterDaemonResponse();
  }
  std::map<std::string, std::string> keys_;  // daemon id -> its key

  // A heartbeat of daemon `d` reporting `job` at `epoch` (version 3, step 2); must succeed.
  // `load_error`, `code`: a failed load's report (JobProgress.load_error, load_error_code).
  void Beat(const v1::RegisterDaemonResponse& d, const std::string& job, int64_t epoch, bool loading = false,
            const std::string& load_error = "", absl::StatusCode code = absl::StatusCode::kOk) {
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(d.daemon_id());
    hb.set_lease_id(d.lease_id());
    v1::JobProgress* p = hb.add_jobs();
    p->set_job_id(job);
    p->set_placement_epoch(epoch);
    p->set_version(3);
    p->set_committed_step(2);
    p->set_loading(loading);
    p->set_load_error(load_error);
    p->set_load_error_code(static_cast<int32_t>(code));
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  }
  absl::StatusOr<v1::CreateJobResponse> Create(const v1::JobSpec& spec) {
    v1::CreateJobRequest req;
    *req.mutable_spec() = spec;
    return coordinator_->CreateJob(req);
  }
  // Creates job "j" of two ranks (on n1 and n2) with replication_factor 2; returns its id.
  std::string CreateReplicated() {
    v1::JobSpec spec = SmallSpec("j", 2, {"n1", "n2"});
    spec.set_replication_factor(2);
    auto created = Create(spec);
    EXPECT_THAT(created, IsOk());
    return created.ok() ? created->job_id() : "";
  }
  // `job`'s placement once its epoch reached `epoch` (waiting a second at most).
  v1::Placement PlacementAt(const std::string& job, int64_t epoch) {
    auto p = coordinator_->WaitPlacement(job, "", epoch - 1, absl::Now() + absl::Seconds(1));
    EXPECT_THAT(p, IsOk());
    return p.ok() ? *p : v1::Placement();
  }

  std::map<std::string, v1::DaemonInfo> Daemons(bool include_down = true) {
    v1::ListDaemonsRequest req;
    req.set_include_down(include_down);
    std::map<std::string, v1::DaemonInfo> out;
    const v1::ListDaemonsResponse response = coordinator_->ListDaemons(req);
    for (const v1::DaemonInfo& d : response.daemons()) out[d.endpoint().daemon_id()] = d;
    return out;
  }

  // daemon id owning each rank, from the placement.
  std::vector<std::string> Owners(const v1::Placement& p, int64_t dp) {
    std::vector<std::string> owners(dp);
    for (const v1::ShardPlacement& s : p.shards()) owners[s.shard().shard()] = s.daemon_id();
    return owners;
  }

  FakeClock clock_;
  checkpoint::MemFs fs_;
  std::string checkpoint_dir_;  // "" : checkpoints off (set before Restart)
  RecordingShardAssigner assigner_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<Coordinator> coordinator_;
};

TEST(PlacementTest, LocalityFirstThenMostFreeMemory) {
  std::vector<DaemonCandidate> daemons = {{"a", "n1", 10 * kGiB}, {"b", "n2", 10 * kGiB}, {"c", "n3", 30 * kGiB}};
  std::vector<std::string> nodes = {"n2", "n1", "", "n9"};
  auto owners = PlaceRanks(4, nodes, daemons, 5 * kGiB);
  ASSERT_THAT(owners, IsOk());
  // rank 0 -> n2's daemon b, rank 1 -> a; rank 2 (no node) and rank 3 (unknown node) -> most free: c, c.
  EXPECT_THAT(*owners, ElementsAre("b", "a", "c", "c"));
}

TEST(PlacementTest, BalancesByFreeMemoryWithoutNodes) {
  std::vector<DaemonCandidate> daemons = {{"a", "n1", 8 * kGiB}, {"b", "n2", 8 * kGiB}};
  auto owners = PlaceRanks(4, {}, daemons, 2 * kGiB);
  ASSERT_THAT(owners, IsOk());
  EXPECT_THAT(*owners, ElementsAre("a", "b", "a", "b"));
}

TEST(PlacementTest, ExhaustionIsResourceExhaustedWithTheNumbers) {
  std::vector<DaemonCandidate> daemons = {{"a", "n1", 3 * kGiB}, {"b", "n2", 1 * kGiB}};
  EXPECT_THAT(PlaceRanks(2, {}, daemons, 2 * kGiB),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("needs 2147483648 bytes per rank x 2 ranks = 4294967296 bytes")));
  EXPECT_THAT(PlaceRanks(1, {}, {}, 1), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no ready daemon")));
  // A full local daemon falls back to another one.
  std::vector<DaemonCandidate> two = {{"a", "n1", 1 * kGiB}, {"b", "n2", 4 * kGiB}};
  std::vector<std::string> nodes = {"n1"};
  auto owners = PlaceRanks(1, nodes, two, 2 * kGiB);
  ASSERT_THAT(owners, IsOk());
  EXPECT_THAT(*owners, ElementsAre("b"));
}

TEST_F(CoordinatorCoreTest, RegisterAssignsStableIdsAndRestartKeepsIdentity) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  EXPECT_EQ(a.daemon_id(), "daemon-1");
  EXPECT_EQ(b.daemon_id(), "daemon-2");
  EXPECT_EQ(a.lease_ttl_ms(), 1000);
  EXPECT_GT(a.heartbeat_interval_ms(), 0);
  auto again = Register("n1", kGiB, a.daemon_id());
  EXPECT_EQ(again.daemon_id(), a.daemon_id());
  EXPECT_NE(again.lease_id(), a.lease_id()) << "a new lease per registration";
  EXPECT_EQ(Daemons().size(), 2u);
}

TEST_F(CoordinatorCoreTest, ADaemonIdIsBoundToItsKeyAndAnAddressToOneLiveDaemon) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  ASSERT_EQ(a.daemon_key().size(), 64u);
  EXPECT_NE(a.daemon_key(), b.daemon_key());
  ASSERT_THAT(Create(SmallSpec("j", 2)), IsOk());
  // Another process (any holder of the cluster secret) claiming daemon-1, without or with a wrong
  // key, from its own address: refused, and daemon-1's record is untouched.
  for (const std::string& key : {std::string(), b.daemon_key(), a.daemon_key().substr(1)}) {
    v1::RegisterDaemonRequest claim;
    claim.set_daemon_id(a.daemon_id());
    claim.set_daemon_key(key);
    claim.set_address("intruder:7000");
    claim.mutable_resources()->set_host_memory_bytes(kGiB);
    EXPECT_THAT(coordinator_->RegisterDaemon(claim),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("belongs to the daemon process")));
  }
  v1::ListDaemonsRequest list;
  list.set_include_down(true);
  const v1::ListDaemonsResponse listed = coordinator_->ListDaemons(list);
  for (const v1::DaemonInfo& d : listed.daemons()) {
    EXPECT_NE(d.endpoint().address(), "intruder:7000");
    EXPECT_TRUE(d.key_sha256().empty()) << "the key's digest left the coordinator";
  }
  // A new daemon at daemon-1's address (to be sent its DropShards and AssignShards): refused
  // while daemon-1's lease is live.
  v1::RegisterDaemonRequest squat;
  squat.set_address("n1:7000");
  squat.mutable_resources()->set_host_memory_bytes(kGiB);
  EXPECT_THAT(coordinator_->RegisterDaemon(squat),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("is daemon daemon-1's, whose lease is live")));
  EXPECT_EQ(Daemons().size(), 2u);
  // Hence a heartbeat claiming a job it is not placed on makes the coordinator send DropShard to
  // the sender's own address only.
  auto c = Register("n3", kGiB);
  v1::HeartbeatRequest hb;
  hb.set_daemon_id(c.daemon_id());
  hb.set_lease_id(c.lease_id());
  v1::JobProgress* p = hb.add_jobs();
  p->set_job_id("job-1");
  p->set_placement_epoch(0);
  const size_t before = assigner_.calls().size();
  ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  const std::vector<RecordingShardAssigner::Call> calls = assigner_.calls();
  ASSERT_GT(calls.size(), before);
  for (size_t i = before; i < calls.size(); ++i) EXPECT_EQ(calls[i].address, "n3:7000");
  // daemon-1 itself, with its key, registers again (a lost lease) and keeps its id.
  EXPECT_EQ(Register("n1", kGiB, a.daemon_id()).daemon_id(), a.daemon_id());
  // Once daemon-1's lease ran out (DOWN), its address may be taken by a new process.
  clock_.Advance(5000);
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->RegisterDaemon(squat), IsOk());
}

TEST_F(CoordinatorCoreTest, LeaseExpiryMarksDaemonDownAndJobDegraded) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  ASSERT_THAT(Create(SmallSpec("j", 2)), IsOk());
  v1::HeartbeatRequest hb;
  hb.set_daemon_id(a.daemon_id());
  hb.set_lease_id(a.lease_id());
  clock_.Advance(900);
  ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());  // a renews, b does not
  clock_.Advance(200);
  coordinator_->Tick();
  auto daemons = Daemons();
  EXPECT_EQ(daemons[a.daemon_id()].state(), v1::DAEMON_STATE_READY);
  EXPECT_EQ(daemons[b.daemon_id()].state(), v1::DAEMON_STATE_DOWN);
  EXPECT_EQ(Daemons(/*include_down=*/false).size(), 1u);
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).state(), v1::JOB_STATE_DEGRADED);
  // b's old lease is gone: its heartbeat says register again.
  v1::HeartbeatRequest stale;
  stale.set_daemon_id(b.daemon_id());
  stale.set_lease_id(b.lease_id());
  EXPECT_THAT(coordinator_->Heartbeat(stale), StatusIs(absl::StatusCode::kNotFound, HasSubstr("register again")));
  Register("n2", kGiB, b.daemon_id());
  EXPECT_EQ(Daemons()[b.daemon_id()].state(), v1::DAEMON_STATE_READY);
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).state(), v1::JOB_STATE_READY);
}

// A store whose Sync can be held (an fdatasync on a stalled disk) until released.
class StallingStore : public StateStore {
 public:
  explicit StallingStore(std::unique_ptr<StateStore> inner) : inner_(std::move(inner)) {}
  absl::StatusOr<v1::CoordinatorState> Load() override { return inner_->Load(); }
  absl::Status Write(const v1::StateBatch& batch) override { return inner_->Write(batch); }
  absl::Status StartSnapshot(const v1::CoordinatorState& state) override { return inner_->StartSnapshot(state); }
  absl::Status Sync() override {
    {
      absl::MutexLock lock(&mu_);
      if (held_) {
        ++stalled_;
        mu_.Await(absl::Condition(+[](bool* held) { return !*held; }, &held_));
      }
    }
    return inner_->Sync();
  }
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  // Waits until a Sync is held.
  void AwaitStalled() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* n) { return *n > 0; }, &stalled_));
  }

 private:
  std::unique_ptr<StateStore> inner_;
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  int stalled_ ABSL_GUARDED_BY(mu_) = 0;
};

// Group commit (state_store.h): the sync runs without the coordinator's lock, so daemons renew
// their leases through a stalled disk, and nothing that depends on an unsynced batch (the
// CreateJob's answer, its AssignShard calls) leaves the coordinator until the sync completes.
TEST_F(CoordinatorCoreTest, AStalledSyncHoldsNoLockAndMarksNoLiveDaemonDown) {
  auto stalling = std::make_unique<StallingStore>(NewMemoryStateStore());
  StallingStore* store = stalling.get();
  Restart(std::move(stalling));
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  const size_t calls_before = assigner_.calls().size();
  store->Hold();
  absl::StatusOr<v1::CreateJobResponse> created;
  std::thread create([&] { created = Create(SmallSpec("j", 2)); });
  store->AwaitStalled();
  EXPECT_TRUE(coordinator_->StateLockFreeForTesting()) << "the sync holds the coordinator's lock";
  // Ten seconds of a stalled disk (leases are 1 s): the daemons' heartbeats are answered at once.
  for (int i = 0; i < 11; ++i) {
    clock_.Advance(900);
    for (const auto* d : {&a, &b}) {
      v1::HeartbeatRequest hb;
      hb.set_daemon_id(d->daemon_id());
      hb.set_lease_id(d->lease_id());
      EXPECT_THAT(coordinator_->Heartbeat(hb), IsOk()) << d->daemon_id();
    }
  }
  std::thread tick([&] { coordinator_->Tick(); });  // (its own return waits for the sync)
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(assigner_.calls().size(), calls_before) << "a daemon got shards of a job that is not durable yet";
  store->Release();
  create.join();
  tick.join();
  ASSERT_THAT(created, IsOk());
  EXPECT_GE(assigner_.calls().size(), calls_before + 2);  // (and re-sends: these daemons report no job)
  for (const auto& [id, d] : Daemons()) EXPECT_EQ(d.state(), v1::DAEMON_STATE_READY) << id;
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).state(), v1::JOB_STATE_READY);
  // Real silence still expires a lease.
  clock_.Advance(1100);
  coordinator_->Tick();
  EXPECT_EQ(Daemons()[a.daemon_id()].state(), v1::DAEMON_STATE_DOWN);
}

TEST_F(CoordinatorCoreTest, AWallClockJumpDoesNotExpireLeases) {
  auto a = Register("n1", kGiB);
  clock_.JumpWall(3'600'000);  // NTP steps the clock an hour ahead
  coordinator_->Tick();
  EXPECT_EQ(Daemons()[a.daemon_id()].state(), v1::DAEMON_STATE_READY);
  clock_.JumpWall(-7'200'000);  // and back
  clock_.Advance(1100);  // while a real 1.1 s of silence does
  coordinator_->Tick();
  EXPECT_EQ(Daemons()[a.daemon_id()].state(), v1::DAEMON_STATE_DOWN);
}

TEST_F(CoordinatorCoreTest, CreateJobPlacesRanksAndAssignsShards) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n2", "n1"}));
  ASSERT_THAT(created, IsOk());
  EXPECT_EQ(created->job_id(), "job-1");
  EXPECT_EQ(created->job_token().size(), 64u);
  v1::GetPlacementRequest req;
  req.set_job_id(created->job_id());
  auto placement = coordinator_->GetPlacement(req);
  ASSERT_THAT(placement, IsOk());
  EXPECT_EQ(placement->placement().epoch(), 1);
  EXPECT_THAT(Owners(placement->placement(), 2), ElementsAre(b.daemon_id(), a.daemon_id())) << "locality";
  const auto calls = assigner_.calls();
  ASSERT_EQ(calls.size(), 2u);
  for (const auto& call : calls) {
    EXPECT_TRUE(call.assign);
    EXPECT_TRUE(call.assign_request.has_from_trainer());
    EXPECT_EQ(call.assign_request.job_token_sha256().size(), 32u);
    EXPECT_EQ(call.assign_request.shards_size(), created->job().num_buckets()) << "one rank per daemon";
  }
  EXPECT_EQ(Daemons()[a.daemon_id()].shard_count(), created->job().num_buckets());
  v1::GetLayoutRequest lreq;
  lreq.set_job_id(created->job_id());
  auto layout = coordinator_->GetLayout(lreq);
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->layout().data_parallel_size(), 2);
}

TEST_F(CoordinatorCoreTest, BadJobsAreRejectedAndChangeNothing) {
  Register("n1", kGiB);
  ASSERT_THAT(Create(SmallSpec("j", 2)), IsOk());
  const size_t calls_before = assigner_.calls().size();
  v1::JobSpec bad = SmallSpec("k", 2);
  bad.mutable_tensors(0)->set_shape(0, 0);
  EXPECT_THAT(Create(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.tensors[0].shape[0]")));
  v1::JobSpec unknown_recipe = SmallSpec("k", 2);
  unknown_recipe.set_recipe("fp7_mixed");
  EXPECT_THAT(Create(unknown_recipe), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.recipe")));
  EXPECT_THAT(Create(SmallSpec("j", 2)), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("'j'")));
  v1::JobSpec huge = SmallSpec("big", 2);
  huge.mutable_tensors(0)->set_shape(0, 1 << 30);
  EXPECT_THAT(Create(huge), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("bytes per rank")));
  v1::GetJobRequest get;
  get.set_job_id("job-99");
  EXPECT_THAT(coordinator_->GetJob(get), StatusIs(absl::StatusCode::kNotFound));
  v1::DeleteJobRequest del;
  del.set_job_id("job-99");
  EXPECT_THAT(coordinator_->DeleteJob(del), StatusIs(absl::StatusCode::kNotFound));
  v1::CordonDaemonRequest cordon;
  cordon.set_daemon_id("daemon-42");
  EXPECT_THAT(coordinator_->CordonDaemon(cordon), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(coordinator_->ListJobs({}).jobs_size(), 1);
  EXPECT_EQ(assigner_.calls().size(), calls_before);
}

TEST_F(CoordinatorCoreTest, OversizedJobsAreRefusedBeforeTheirLayoutIsBuilt) {
  Register("n1", 1000 * kGiB);
  // A few hundred bytes of spec asking for 200 tensors x D = 1,000,000 shards: refused by name,
  // at once, without building the billions of fragments.
  v1::JobSpec big = SmallSpec("big", 2);
  big.set_data_parallel_size(1'000'000);
  big.set_bucket_numel(1);
  for (int i = 0; i < 200; ++i) {
    v1::TensorSpec* t = big.add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->add_shape(64);
  }
  const absl::Time start = absl::Now();
  EXPECT_THAT(Create(big), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data_parallel_size")));
  big.set_data_parallel_size(8192);  // up to 203 buckets x 8192 = 1.7M pairs
  EXPECT_THAT(Create(big), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(bucket, shard) pairs per job")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(coordinator_->ListJobs({}).jobs_size(), 0);
  // Within the bounds it is created.
  EXPECT_THAT(Create(SmallSpec("small", 2)), IsOk());
}

TEST_F(CoordinatorCoreTest, AJobTokenReadsOnlyItsOwnJob) {
  Register("n1", kGiB);
  auto a = Create(SmallSpec("a", 1));
  auto b = Create(SmallSpec("b", 1));
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  v1::GetLayoutRequest layout;
  layout.set_job_id(b->job_id());
  layout.set_job_token(a->job_token());
  EXPECT_THAT(coordinator_->GetLayout(layout), StatusIs(absl::StatusCode::kPermissionDenied));
  v1::GetPlacementRequest placement;
  placement.set_job_id(b->job_id());
  placement.set_job_token(a->job_token());
  EXPECT_THAT(coordinator_->GetPlacement(placement), StatusIs(absl::StatusCode::kPermissionDenied));
  v1::GetJobRequest job;
  job.set_job_id(b->job_id());
  job.set_job_token(a->job_token());
  EXPECT_THAT(coordinator_->GetJob(job), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(coordinator_->WaitPlacement(b->job_id(), a->job_token(), 0, absl::Now() + absl::Seconds(1)),
              StatusIs(absl::StatusCode::kPermissionDenied));
  // Its own token reads it; the error never echoes a token.
  layout.set_job_token(b->job_token());
  EXPECT_THAT(coordinator_->GetLayout(layout), IsOk());
  placement.set_job_token("wrong");
  absl::Status denied = coordinator_->GetPlacement(placement).status();
  EXPECT_THAT(std::string(denied.message()), ::testing::Not(::testing::HasSubstr("wrong")));
}

// The reader token (docs/weight_serving.md): minted on first ask by the job's trainers (or an
// admin), reads the job's layout and placement and nothing of another job, cannot mint or
// rotate itself, reaches every daemon of the job as a hash, survives a restart, and a
// rotation replaces it everywhere.
TEST_F(CoordinatorCoreTest, AReaderTokenReadsItsJobOnlyAndARotationReplacesItOnEveryDaemon) {
  Register("n1", kGiB);
  Register("n2", kGiB);
  auto a = Create(SmallSpec("a", 2));
  auto b = Create(SmallSpec("b", 1));
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  auto reader_token = [&](const std::string& job, const std::string& token, bool rotate) {
    v1::GetReaderTokenRequest req;
    req.set_job_id(job);
    req.set_job_token(token);
    req.set_rotate(rotate);
    return coordinator_->GetReaderToken(req);
  };
  // Another job's token, and no token at the core (the gRPC layer asks an admin token then).
  EXPECT_THAT(reader_token(a->job_id(), b->job_token(), false), StatusIs(absl::StatusCode::kPermissionDenied));
  const size_t before = assigner_.calls().size();
  auto first = reader_token(a->job_id(), a->job_token(), false);
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->reader_token().size(), 64u);
  // Every daemon of the job was sent its shards again, with the token's hash.
  std::set<std::string> told;
  const auto calls = assigner_.calls();  // (a copy)
  for (size_t i = before; i < calls.size(); ++i) {
    const auto& call = calls[i];
    ASSERT_TRUE(call.assign);
    EXPECT_EQ(call.assign_request.job_id(), a->job_id());
    EXPECT_EQ(call.assign_request.reader_token_sha256(), testing::Sha256Of(first->reader_token()));
    EXPECT_GT(call.assign_request.shards_size(), 0);
    told.insert(call.address);
  }
  EXPECT_EQ(told.size(), 2u);
  // Asked again: the same token, nothing sent.
  const size_t after_first = assigner_.calls().size();
  auto again = reader_token(a->job_id(), a->job_token(), false);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->reader_token(), first->reader_token());
  EXPECT_EQ(assigner_.calls().size(), after_first);
  // It reads its job's layout, placement and info; not another job's; it cannot rotate itself.
  v1::GetLayoutRequest layout;
  layout.set_job_id(a->job_id());
  layout.set_job_token(first->reader_token());
  EXPECT_THAT(coordinator_->GetLayout(layout), IsOk());
  v1::GetPlacementRequest placement;
  placement.set_job_id(a->job_id());
  placement.set_job_token(first->reader_token());
  EXPECT_THAT(coordinator_->GetPlacement(placement), IsOk());
  EXPECT_THAT(coordinator_->WaitPlacement(a->job_id(), first->reader_token(), 0, absl::Now() + absl::Seconds(1)),
              IsOk());
  layout.set_job_id(b->job_id());
  EXPECT_THAT(coordinator_->GetLayout(layout), StatusIs(absl::StatusCode::kPermissionDenied));
  auto by_reader = reader_token(a->job_id(), first->reader_token(), true);
  EXPECT_THAT(by_reader, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(std::string(by_reader.status().message()), ::testing::HasSubstr("reader token"));
  // A restart keeps it.
  Restart(std::move(store_));
  auto kept = reader_token(a->job_id(), a->job_token(), false);
  ASSERT_THAT(kept, IsOk());
  EXPECT_EQ(kept->reader_token(), first->reader_token());
  // A rotation: a new token, sent to every daemon; the old one reads nothing more.
  const size_t before_rotation = assigner_.calls().size();
  auto rotated = reader_token(a->job_id(), a->job_token(), true);
  ASSERT_THAT(rotated, IsOk());
  EXPECT_NE(rotated->reader_token(), first->reader_token());
  told.clear();
  const auto rotation_calls = assigner_.calls();
  for (size_t i = before_rotation; i < rotation_calls.size(); ++i) {
    EXPECT_EQ(rotation_calls[i].assign_request.reader_token_sha256(), testing::Sha256Of(rotated->reader_token()));
    told.insert(rotation_calls[i].address);
  }
  EXPECT_EQ(told.size(), 2u);
  layout.set_job_id(a->job_id());
  EXPECT_THAT(coordinator_->GetLayout(layout), StatusIs(absl::StatusCode::kPermissionDenied));
  layout.set_job_token(rotated->reader_token());
  EXPECT_THAT(coordinator_->GetLayout(layout), IsOk());
}

TEST_F(CoordinatorCoreTest, IdempotentCreateReturnsTheSameJob) {
  Register("n1", kGiB);
  v1::CreateJobRequest req;
  *req.mutable_spec() = SmallSpec("j", 1);
  req.set_request_id("launch-7");
  auto first = coordinator_->CreateJob(req);
  auto second = coordinator_->CreateJob(req);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(first->job_id(), second->job_id());
  EXPECT_EQ(first->job_token(), second->job_token());
  EXPECT_EQ(coordinator_->ListJobs({}).jobs_size(), 1);
}

TEST_F(CoordinatorCoreTest, ARetryWithTheCallersOwnTokenReturnsTheJobAfterARestart) {
  // The CreateJob was committed and the coordinator died before answering: a coordinator on the
  // same state (a restart, or a standby taking over) keeps only the token's hash.
  Register("n1", kGiB);
  v1::CreateJobRequest req;
  *req.mutable_spec() = SmallSpec("j", 1);
  req.set_request_id("launch-8");
  req.set_job_token(std::string(40, 'a') + "-token_1");
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse first, coordinator_->CreateJob(req));
  EXPECT_EQ(first.job_token(), req.job_token());
  // Knowing the request id is not enough to learn a token the caller chose, before a restart too.
  v1::CreateJobRequest without = req;
  without.clear_job_token();
  EXPECT_THAT(coordinator_->CreateJob(without), StatusIs(absl::StatusCode::kFailedPrecondition));
  Restart(std::move(store_));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse retried, coordinator_->CreateJob(req));
  EXPECT_EQ(retried.job_id(), first.job_id());
  EXPECT_EQ(retried.job_token(), req.job_token());
  EXPECT_EQ(coordinator_->ListJobs({}).jobs_size(), 1);
  // Whoever knows the request id but not the token gets nothing.
  v1::CreateJobRequest other = req;
  other.set_job_token(std::string(48, 'b'));
  EXPECT_THAT(coordinator_->CreateJob(other), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another")));
  other.clear_job_token();
  EXPECT_THAT(coordinator_->CreateJob(other),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("Retry with that job_token")));
  // A token the caller chooses must look like one.
  v1::CreateJobRequest bad;
  *bad.mutable_spec() = SmallSpec("k", 1);
  bad.set_job_token("short");
  EXPECT_THAT(coordinator_->CreateJob(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_token: 32")));
  bad.set_job_token(std::string(40, 'x') + " space");
  EXPECT_THAT(coordinator_->CreateJob(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_token: only")));
  EXPECT_EQ(coordinator_->ListJobs({}).jobs_size(), 1);
}

TEST_F(CoordinatorCoreTest, DeleteDropsShardsOnEveryDaemon) {
  Register("n1", kGiB);
  Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2));
  ASSERT_THAT(created, IsOk());
  v1::DeleteJobRequest del;
  del.set_job_id(created->job_id());
  ASSERT_THAT(coordinator_->DeleteJob(del), IsOk());
  int drops = 0;
  for (const auto& call : assigner_.calls()) drops += !call.assign && call.drop_request.job_id() == created->job_id();
  EXPECT_EQ(drops, 2);
  EXPECT_EQ(coordinator_->ListJobs({}).jobs_size(), 0);
}

TEST_F(CoordinatorCoreTest, ADaemonHoldingAJobItIsNotPlacedOnIsToldToDropItAndItsProgressIgnored) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2));
  ASSERT_THAT(created, IsOk());
  v1::DrainDaemonRequest drain;  // the job moves off a (epoch 2)
  drain.set_daemon_id(a.daemon_id());
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  {  // b has copied a's rank: the move is done (a is told to drop it)
    v1::HeartbeatRequest loaded;
    loaded.set_daemon_id(b.daemon_id());
    loaded.set_lease_id(b.lease_id());
    loaded.add_jobs()->set_job_id(created->job_id());
    loaded.mutable_jobs(0)->set_placement_epoch(2);
    ASSERT_THAT(coordinator_->Heartbeat(loaded), IsOk());
  }
  const size_t before = assigner_.calls().size();
  // a still reports the job at epoch 1, far ahead of the real progress.
  v1::HeartbeatRequest hb;
  hb.set_daemon_id(a.daemon_id());
  hb.set_lease_id(a.lease_id());
  v1::JobProgress* stale = hb.add_jobs();
  stale->set_job_id(created->job_id());
  stale->set_placement_epoch(1);
  stale->set_committed_step(99);
  ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  const auto calls = assigner_.calls();
  ASSERT_EQ(calls.size(), before + 1);
  EXPECT_FALSE(calls.back().assign);
  EXPECT_EQ(calls.back().address, "n1:7000");
  EXPECT_EQ(calls.back().drop_request.job_id(), created->job_id());
  EXPECT_EQ(calls.back().drop_request.placement_epoch(), 2);
  EXPECT_EQ(calls.back().drop_request.shards_size(), 0) << "every shard of the job";
  v1::GetJobRequest get;
  get.set_job_id(created->job_id());
  auto job = coordinator_->GetJob(get);
  ASSERT_THAT(job, IsOk());
  EXPECT_NE(job->job().committed_step(), 99) << "a stale daemon's progress must not show";
  // b, which the placement names, reports normally and is not told anything.
  v1::HeartbeatRequest hb_b;
  hb_b.set_daemon_id(b.daemon_id());
  hb_b.set_lease_id(b.lease_id());
  hb_b.add_jobs()->set_job_id(created->job_id());
  hb_b.mutable_jobs(0)->set_placement_epoch(2);
  ASSERT_THAT(coordinator_->Heartbeat(hb_b), IsOk());
  EXPECT_EQ(assigner_.calls().size(), before + 1);
}

// Memory admission (issue 18, item 9): a daemon that refuses an assignment for lack of memory
// (RESOURCE_EXHAUSTED, reported by the assigner) gets the ranks it was to gain placed elsewhere.
class RefusalTest : public CoordinatorCoreTest {
 protected:
  // The newest AssignShard sent to `address` (only those copying from a peer: a move's).
  v1::AssignShardRequest LastAssignmentTo(const std::string& address, bool from_peer = false) {
    v1::AssignShardRequest last;
    for (const auto& call : assigner_.calls()) {
      if (call.assign && call.address == address && (!from_peer || call.assign_request.has_from_peer())) {
        last = call.assign_request;
      }
    }
    return last;
  }
  v1::Placement PlacementOf(const std::string& job_id) {
    v1::GetPlacementRequest req;
    req.set_job_id(job_id);
    auto placement = coordinator_->GetPlacement(req);
    EXPECT_THAT(placement, IsOk());
    return placement.ok() ? placement->placement() : v1::Placement();
  }
  const absl::Status kNoRoom = absl::ResourceExhaustedError("AssignShard: job needs more than --memory-bytes");
};

TEST_F(RefusalTest, ANewJobsRanksThatADaemonRefusesGoToAnotherDaemon) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  auto c = Register("n3", kGiB);
  const v1::AssignShardRequest refused = LastAssignmentTo("n1:7000");
  ASSERT_EQ(refused.placement_epoch(), 1);
  assigner_.Refuse("n1:7000", refused, kNoRoom);
  const v1::Placement placement = PlacementOf(created->job_id());
  EXPECT_EQ(placement.epoch(), 2);
  EXPECT_THAT(Owners(placement, 2), ElementsAre(c.daemon_id(), b.daemon_id()));
  const v1::AssignShardRequest sent = LastAssignmentTo("n3:7000");
  EXPECT_EQ(sent.placement_epoch(), 2);
  EXPECT_TRUE(sent.has_from_trainer()) << "nothing of the rank exists yet: it starts from the trainers";
  EXPECT_EQ(LastAssignmentTo("n2:7000").placement_epoch(), 2);
  // The refusal of a request the job has moved past changes nothing.
  assigner_.Refuse("n1:7000", refused, kNoRoom);
  EXPECT_EQ(PlacementOf(created->job_id()).epoch(), 2);
  // c refuses too: the rank goes to b, which has room; the refusers are not chosen again.
  assigner_.Refuse("n3:7000", sent, kNoRoom);
  EXPECT_EQ(PlacementOf(created->job_id()).epoch(), 3);
  EXPECT_THAT(Owners(PlacementOf(created->job_id()), 2), ElementsAre(b.daemon_id(), b.daemon_id()));
  // And when b refuses, no daemon is left: the ranks wait where they are (reconciliation asks b
  // again; another daemon may come).
  assigner_.Refuse("n2:7000", LastAssignmentTo("n2:7000"), kNoRoom);
  EXPECT_EQ(PlacementOf(created->job_id()).epoch(), 3);
  (void)a;
}

TEST_F(RefusalTest, AMoveTargetThatRefusesIsReplacedOrTheRankStaysWithItsSource) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  for (const auto* d : {&a, &b}) {  // version 0 published: the job's state lives in its daemons
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(d->daemon_id());
    hb.set_lease_id(d->lease_id());
    v1::JobProgress* p = hb.add_jobs();
    p->set_job_id(created->job_id());
    p->set_placement_epoch(1);
    p->set_version(0);
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  }
  v1::DrainDaemonRequest drain;  // a's rank 0 moves to c (the emptiest), epoch 2
  drain.set_daemon_id(a.daemon_id());
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  ASSERT_THAT(Owners(PlacementOf(created->job_id()), 2), ElementsAre(c.daemon_id(), b.daemon_id()));
  // c has no room after all: the move goes to b, still from a's copy.
  assigner_.Refuse("n3:7000", LastAssignmentTo("n3:7000"), kNoRoom);
  EXPECT_EQ(PlacementOf(created->job_id()).epoch(), 3);
  EXPECT_THAT(Owners(PlacementOf(created->job_id()), 2), ElementsAre(b.daemon_id(), b.daemon_id()));
  v1::AssignShardRequest moved = LastAssignmentTo("n2:7000", /*from_peer=*/true);
  EXPECT_EQ(moved.placement_epoch(), 3);
  ASSERT_TRUE(moved.has_from_peer());
  EXPECT_EQ(moved.from_peer().daemon().daemon_id(), a.daemon_id());
  // b refuses too: no daemon is left with room, so rank 0 stays with its source, a.
  assigner_.Refuse("n2:7000", moved, kNoRoom);
  EXPECT_EQ(PlacementOf(created->job_id()).epoch(), 4);
  EXPECT_THAT(Owners(PlacementOf(created->job_id()), 2), ElementsAre(a.daemon_id(), b.daemon_id()));
  EXPECT_EQ(LastAssignmentTo("n1:7000").placement_epoch(), 4);
  // Five minutes later the refusals are forgotten (memory may have been freed): a's rank is
  // drained to c again, c refuses again, and the rank goes to b, which refused five minutes ago.
  for (int i = 0; i < 601; ++i) {  // (the leases are renewed meanwhile)
    clock_.Advance(500);
    for (auto* d : {&a, &b, &c}) Beat(*d, created->job_id(), 4);
  }
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  ASSERT_THAT(Owners(PlacementOf(created->job_id()), 2), ElementsAre(c.daemon_id(), b.daemon_id()));
  assigner_.Refuse("n3:7000", LastAssignmentTo("n3:7000"), kNoRoom);
  EXPECT_EQ(PlacementOf(created->job_id()).epoch(), 6);
  EXPECT_THAT(Owners(PlacementOf(created->job_id()), 2), ElementsAre(b.daemon_id(), b.daemon_id()));
}

// A move's target that accepted the assignment but then cannot allocate the copy (its heartbeat
// reports RESOURCE_EXHAUSTED while loading) is treated like one that refused: the move goes to
// another daemon with room, or the rank stays with its source.
TEST_F(RefusalTest, AMoveTargetThatCannotAllocateTheCopyIsReplacedOrTheRankStaysWithItsSource) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  const std::string job = created->job_id();
  const std::string no_memory = "loading 1 shard(s): RESOURCE_EXHAUSTED: cannot allocate 4096 bytes of state memory";
  Beat(a, job, 1);  // (the job has published a version: its state lives in its daemons)
  Beat(b, job, 1);
  v1::DrainDaemonRequest drain;  // a's rank 0 moves to c (the emptiest), epoch 2
  drain.set_daemon_id(a.daemon_id());
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  ASSERT_THAT(Owners(PlacementOf(job), 2), ElementsAre(c.daemon_id(), b.daemon_id()));
  // Another error while loading (the source unreachable for a moment) changes nothing.
  Beat(c, job, 2, /*loading=*/true, "loading 1 shard(s): UNAVAILABLE: connection refused",
       absl::StatusCode::kUnavailable);
  EXPECT_EQ(PlacementOf(job).epoch(), 2);
  // c cannot allocate the copy: the move goes to b, still from a's copy.
  Beat(c, job, 2, /*loading=*/true, no_memory, absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(PlacementOf(job).epoch(), 3);
  EXPECT_THAT(Owners(PlacementOf(job), 2), ElementsAre(b.daemon_id(), b.daemon_id()));
  v1::AssignShardRequest moved = LastAssignmentTo("n2:7000", /*from_peer=*/true);
  EXPECT_EQ(moved.placement_epoch(), 3);
  EXPECT_EQ(moved.from_peer().daemon().daemon_id(), a.daemon_id());
  // A late report of c at the old epoch changes nothing; then b cannot allocate either: no daemon
  // is left with room, so rank 0 stays with its source, a.
  Beat(c, job, 2, /*loading=*/true, no_memory, absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(PlacementOf(job).epoch(), 3);
  Beat(b, job, 3, /*loading=*/true, no_memory, absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(PlacementOf(job).epoch(), 4);
  EXPECT_THAT(Owners(PlacementOf(job), 2), ElementsAre(a.daemon_id(), b.daemon_id()));
  EXPECT_EQ(LastAssignmentTo("n1:7000").placement_epoch(), 4);
}

// Reconciliation: the coordinator re-sends what a live daemon lacks, for as long as it lives.
TEST_F(CoordinatorCoreTest, AnAssignmentADaemonNeverGotIsSentAgainUntilItHoldsTheJob) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  const size_t sent = assigner_.calls().size();  // the original assignments (a's was "lost")
  auto beat = [&](const v1::RegisterDaemonResponse& d, int64_t epoch) {
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(d.daemon_id());
    hb.set_lease_id(d.lease_id());
    if (epoch >= 0) {
      v1::JobProgress* p = hb.add_jobs();
      p->set_job_id(created->job_id());
      p->set_placement_epoch(epoch);
      p->set_version(-1);
      p->set_committed_step(-1);
    }
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  };
  auto resent_to_a = [&] {
    int n = 0;
    const auto calls = assigner_.calls();
    for (size_t i = sent; i < calls.size(); ++i) {
      if (!calls[i].assign || calls[i].address != "n1:7000") continue;
      EXPECT_EQ(calls[i].assign_request.job_id(), created->job_id());
      EXPECT_EQ(calls[i].assign_request.placement_epoch(), 1);
      EXPECT_TRUE(calls[i].assign_request.has_from_trainer()) << "the job has not started: a new assignment";
      EXPECT_EQ(calls[i].assign_request.shards_size(), created->job().num_buckets());
      ++n;
    }
    return n;
  };
  beat(a, -1);
  EXPECT_EQ(resent_to_a(), 0) << "an assignment may still be on its way";
  // Well past the old one-minute give-up: re-sent every 3 s while a lacks the job.
  for (int i = 0; i < 200; ++i) {  // 100 s in 500 ms heartbeats
    clock_.Advance(500);
    beat(a, -1);
    beat(b, 1);
  }
  EXPECT_GE(resent_to_a(), 30);
  EXPECT_LE(resent_to_a(), 34);
  EXPECT_EQ(assigner_.calls().size(), sent + static_cast<size_t>(resent_to_a())) << "b, which holds it, gets nothing";
  // Once a reports the job at the current epoch, nothing more is sent.
  const int total = resent_to_a();
  for (int i = 0; i < 20; ++i) {
    clock_.Advance(500);
    beat(a, 1);
    beat(b, 1);
  }
  EXPECT_EQ(resent_to_a(), total);
}

TEST_F(CoordinatorCoreTest, ADaemonBehindThePlacementEpochIsSentTheCurrentAssignment) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  v1::DrainDaemonRequest drain;  // rank 1 moves from b to c: epoch 2, and a must learn of it
  drain.set_daemon_id(b.daemon_id());
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  const size_t sent = assigner_.calls().size();
  for (int i = 0; i < 8; ++i) {  // 4 s of heartbeats; a still reports epoch 1
    clock_.Advance(500);
    for (const auto* d : {&a, &b, &c}) {
      v1::HeartbeatRequest hb;
      hb.set_daemon_id(d->daemon_id());
      hb.set_lease_id(d->lease_id());
      if (d != &b) {
        v1::JobProgress* p = hb.add_jobs();
        p->set_job_id(created->job_id());
        p->set_placement_epoch(d == &a ? 1 : 2);
      }
      ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
    }
  }
  std::vector<RecordingShardAssigner::Call> to_a;
  for (size_t i = sent; i < assigner_.calls().size(); ++i) {
    if (assigner_.calls()[i].address == "n1:7000") to_a.push_back(assigner_.calls()[i]);
  }
  ASSERT_EQ(to_a.size(), 1u);
  EXPECT_TRUE(to_a[0].assign);
  EXPECT_EQ(to_a[0].assign_request.placement_epoch(), 2);
  EXPECT_EQ(to_a[0].assign_request.placement().epoch(), 2);
  EXPECT_EQ(to_a[0].assign_request.shards_size(), created->job().num_buckets()) << "a's own shards";
}

TEST_F(CoordinatorCoreTest, ALiveDaemonThatLostAStartedJobMakesItDegradedNotReassignedEmpty) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  auto beat = [&](const v1::RegisterDaemonResponse& d, bool holds) {
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(d.daemon_id());
    hb.set_lease_id(d.lease_id());
    if (holds) {
      v1::JobProgress* p = hb.add_jobs();
      p->set_job_id(created->job_id());
      p->set_placement_epoch(1);
      p->set_version(5);
      p->set_committed_step(4);
    }
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  };
  beat(a, true);  // version 0 was published: the job has started
  beat(b, true);
  const size_t sent = assigner_.calls().size();
  for (int i = 0; i < 10; ++i) {  // a no longer holds it
    clock_.Advance(500);
    beat(a, false);
    beat(b, true);
  }
  EXPECT_EQ(assigner_.calls().size(), sent) << "an empty from_trainer assignment would wedge the job";
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).state(), v1::JOB_STATE_DEGRADED);
  // Survives a coordinator restart: the job is still known to have started.
  Restart(std::move(store_));
  a = Register("n1", kGiB, a.daemon_id());
  b = Register("n2", kGiB, b.daemon_id());
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(500);
    beat(a, false);
    beat(b, true);
  }
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).state(), v1::JOB_STATE_DEGRADED);
}

TEST_F(CoordinatorCoreTest, DrainMovesRanksAndBumpsTheEpoch) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2));
  ASSERT_THAT(created, IsOk());
  v1::DrainDaemonRequest drain;
  drain.set_daemon_id(a.daemon_id());
  auto moves = coordinator_->DrainDaemon(drain);
  ASSERT_THAT(moves, IsOk());
  EXPECT_EQ(moves->moves_size(), created->job().num_buckets());
  auto placement = coordinator_->WaitPlacement(created->job_id(), "", 1, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(placement, IsOk());
  EXPECT_EQ(placement->epoch(), 2);
  EXPECT_THAT(Owners(*placement, 2), ElementsAre(b.daemon_id(), b.daemon_id()));
  EXPECT_EQ(Daemons()[a.daemon_id()].state(), v1::DAEMON_STATE_DRAINING);
  // b copies rank 0 from a (from_peer) and learns the epoch for the rank it had; a keeps its
  // copy (no DropShard) until b reports the job loaded at epoch 2.
  auto calls = assigner_.calls();
  ASSERT_GE(calls.size(), 2u);
  EXPECT_TRUE(calls[calls.size() - 2].assign);
  EXPECT_EQ(calls[calls.size() - 2].address, "n2:7000");
  EXPECT_TRUE(calls[calls.size() - 2].assign_request.has_from_peer());
  EXPECT_EQ(calls[calls.size() - 2].assign_request.from_peer().daemon().daemon_id(), a.daemon_id());
  EXPECT_EQ(calls[calls.size() - 2].assign_request.shards(0).shard(), 0);
  EXPECT_TRUE(calls.back().assign);
  EXPECT_EQ(calls.back().assign_request.shards(0).shard(), 1);
  EXPECT_FALSE(calls.back().assign_request.has_from_peer());
  auto report = [&](bool loading) {
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(b.daemon_id());
    hb.set_lease_id(b.lease_id());
    v1::JobProgress* p = hb.add_jobs();
    p->set_job_id(created->job_id());
    p->set_placement_epoch(2);
    p->set_loading(loading);
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  };
  const size_t after_drain = assigner_.calls().size();
  report(/*loading=*/true);
  EXPECT_EQ(assigner_.calls().size(), after_drain) << "nothing is dropped while the copy runs";
  report(/*loading=*/false);
  calls = assigner_.calls();
  ASSERT_EQ(calls.size(), after_drain + 1);
  EXPECT_FALSE(calls.back().assign);
  EXPECT_EQ(calls.back().address, "n1:7000");
  EXPECT_EQ(calls.back().drop_request.shards_size(), 0) << "a holds nothing of the job any more";
  report(/*loading=*/false);
  EXPECT_EQ(assigner_.calls().size(), after_drain + 1) << "the move is over";
  EXPECT_THAT(coordinator_->WaitPlacement(created->job_id(), "", 2, absl::Now() + absl::Milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  // With no other daemon, draining b is refused and nothing changes.
  drain.set_daemon_id(b.daemon_id());
  const size_t before_refusal = assigner_.calls().size();
  EXPECT_THAT(coordinator_->DrainDaemon(drain),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("nothing was moved")));
  EXPECT_EQ(assigner_.calls().size(), before_refusal) << "nothing sent, nothing dropped";
  EXPECT_EQ(Daemons()[b.daemon_id()].state(), v1::DAEMON_STATE_READY);
}

// A drained daemon holding two ranks is the source of two moves that finish one at a time: the
// first one to finish drops only its rank there (the daemon is out of the placement already,
// and dropping the whole job would take the rank still being copied from it).
TEST_F(CoordinatorCoreTest, ADrainedDaemonKeepsTheRankStillBeingCopiedWhenTheOtherMoveFinishes) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n1"}));
  ASSERT_THAT(created, IsOk());
  v1::DrainDaemonRequest drain;
  drain.set_daemon_id(a.daemon_id());
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  auto placement = coordinator_->WaitPlacement(created->job_id(), "", 1, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(placement, IsOk());
  const std::vector<std::string> owners = Owners(*placement, 2);
  ASSERT_NE(owners[0], owners[1]) << "the two ranks go to the two other daemons";
  auto report = [&](const v1::RegisterDaemonResponse& d) {
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(d.daemon_id());
    hb.set_lease_id(d.lease_id());
    v1::JobProgress* p = hb.add_jobs();
    p->set_job_id(created->job_id());
    p->set_placement_epoch(placement->epoch());
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  };
  const auto& first = owners[0] == b.daemon_id() ? b : c;
  const auto& second = owners[0] == b.daemon_id() ? c : b;
  size_t before = assigner_.calls().size();
  report(first);  // rank 0's copy is loaded; rank 1 is still being copied from a
  auto calls = assigner_.calls();
  ASSERT_EQ(calls.size(), before + 1);
  EXPECT_FALSE(calls.back().assign);
  EXPECT_EQ(calls.back().address, "n1:7000");
  ASSERT_EQ(calls.back().drop_request.shards_size(), created->job().num_buckets()) << "only rank 0's shards";
  for (const auto& shard : calls.back().drop_request.shards()) EXPECT_EQ(shard.shard(), 0);
  before = calls.size();
  report(second);  // the last move from a: a holds nothing of the job any more
  calls = assigner_.calls();
  ASSERT_EQ(calls.size(), before + 1);
  EXPECT_EQ(calls.back().address, "n1:7000");
  EXPECT_EQ(calls.back().drop_request.shards_size(), 0);
}

TEST_F(CoordinatorCoreTest, MoveShardMovesOneRankStateAndAllAndRefusesBadMoves) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  v1::MoveShardRequest move;
  move.set_job_id(created->job_id());
  move.mutable_shard()->set_shard(1);
  move.set_to_daemon_id(c.daemon_id());
  auto moved = coordinator_->MoveShard(move);
  ASSERT_THAT(moved, IsOk());
  EXPECT_EQ(moved->moves_size(), created->job().num_buckets());
  EXPECT_EQ(moved->move().from_daemon_id(), b.daemon_id());
  EXPECT_EQ(moved->move().placement_epoch(), 2);
  auto placement = coordinator_->WaitPlacement(created->job_id(), "", 1, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(placement, IsOk());
  EXPECT_THAT(Owners(*placement, 2), ElementsAre(a.daemon_id(), c.daemon_id()));
  const auto calls = assigner_.calls();
  bool copied = false;
  for (const auto& call : calls) {
    copied |= call.assign && call.address == "n3:7000" && call.assign_request.has_from_peer() &&
              call.assign_request.from_peer().daemon().daemon_id() == b.daemon_id();
    EXPECT_FALSE(!call.assign && call.address == "n2:7000") << "b keeps its copy until c has loaded it";
  }
  EXPECT_TRUE(copied);
  // The same rank again while it moves, to its owner, a bad rank, an unknown daemon: refused.
  EXPECT_THAT(coordinator_->MoveShard(move), StatusIs(absl::StatusCode::kFailedPrecondition));
  move.set_to_daemon_id(a.daemon_id());
  move.mutable_shard()->set_shard(0);
  EXPECT_THAT(coordinator_->MoveShard(move), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already on")));
  move.mutable_shard()->set_shard(2);
  EXPECT_THAT(coordinator_->MoveShard(move), StatusIs(absl::StatusCode::kInvalidArgument));
  move.mutable_shard()->set_shard(0);
  move.set_to_daemon_id("daemon-99");
  EXPECT_THAT(coordinator_->MoveShard(move), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("READY")));
}

// A move in progress and its target's load error are in GetJob's and ListJobs' answers (what
// `mainstayctl jobs show` prints) until the target reports the copy loaded.
TEST_F(CoordinatorCoreTest, AJobListsItsMovesInProgressAndTheLoadErrorsItsDaemonsReport) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  const std::string job = created->job_id();
  v1::MoveShardRequest move;
  move.set_job_id(job);
  move.mutable_shard()->set_shard(1);
  move.set_to_daemon_id(c.daemon_id());
  ASSERT_THAT(coordinator_->MoveShard(move), IsOk());
  const std::string error =
      "loading 1 shard(s) from daemon " + b.daemon_id() + " at placement epoch 2: UNAVAILABLE: connection refused";
  Beat(a, job, 2);
  Beat(b, job, 1);
  Beat(c, job, 2, /*loading=*/true, error);
  v1::GetJobRequest get;
  get.set_job_id(job);
  auto info = coordinator_->GetJob(get);
  ASSERT_THAT(info, IsOk());
  ASSERT_EQ(info->job().moves_size(), 1);
  EXPECT_EQ(info->job().moves(0).rank(), 1);
  EXPECT_EQ(info->job().moves(0).source_daemon_id(), b.daemon_id());
  EXPECT_EQ(info->job().moves(0).target_daemon_id(), c.daemon_id());
  EXPECT_EQ(info->job().moves(0).epoch(), 2);
  ASSERT_EQ(info->job().load_errors_size(), 1);
  EXPECT_EQ(info->job().load_errors(0).daemon_id(), c.daemon_id());
  EXPECT_EQ(info->job().load_errors(0).error(), error);
  const v1::ListJobsResponse listed = coordinator_->ListJobs({});
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).moves_size(), 1);
  EXPECT_EQ(listed.jobs(0).load_errors_size(), 1);
  Beat(c, job, 2);  // loaded: the move is done
  info = coordinator_->GetJob(get);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->job().moves_size(), 0);
  EXPECT_EQ(info->job().load_errors_size(), 0);
}

// The holders of rank `rank` (primary first) in a placement.
std::vector<std::string> HoldersOf(const v1::Placement& p, int rank) {
  for (const v1::ShardPlacement& s : p.shards()) {
    if (s.shard().shard() != rank) continue;
    std::vector<std::string> out = {s.daemon_id()};
    out.insert(out.end(), s.replica_daemon_ids().begin(), s.replica_daemon_ids().end());
    return out;
  }
  return {};
}

TEST_F(CoordinatorCoreTest, ReplicasArePlacedOnOtherNodesAndTooFewDaemonsAreRefused) {
  Register("n1", kGiB);
  v1::JobSpec spec = SmallSpec("j", 2);
  spec.set_replication_factor(2);
  EXPECT_THAT(Create(spec), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("replication_factor 2")));
  Register("n2", kGiB);
  Register("n3", kGiB);
  auto created = Create(spec);
  ASSERT_THAT(created, IsOk());
  auto placement = coordinator_->WaitPlacement(created->job_id(), "", 0, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(placement, IsOk());
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<std::string> holders = HoldersOf(*placement, rank);
    ASSERT_EQ(holders.size(), 2u);
    EXPECT_NE(holders[0], holders[1]);
  }
  EXPECT_EQ(placement->daemons_size(), 3) << "the replicas spread over the third daemon";
  // Every holder got an assignment naming its shards.
  std::set<std::string> assigned;
  for (const auto& call : assigner_.calls()) {
    if (call.assign) assigned.insert(call.address);
  }
  EXPECT_EQ(assigned.size(), 3u);
}

// A replicated job loses a daemon: the survivors' copies take over at the next epoch (no
// restore: there is no checkpoint at all), then the job is re-replicated back to R copies from
// its primaries, which keep their copies.
// A move's source dies while its target copies: the failover keeps the move, at the new epoch,
// with the rank's surviving replica as its source.
TEST_F(CoordinatorCoreTest, AMoveWhoseSourceIsLostCopiesFromAnotherCopyOfTheRank) {
  std::map<std::string, v1::RegisterDaemonResponse> daemons;
  for (const char* node : {"n1", "n2", "n3", "n4"}) daemons[node] = Register(node, kGiB);
  v1::JobSpec spec = SmallSpec("j", 2, {"n1", "n2"});
  spec.set_replication_factor(2);
  auto created = Create(spec);
  ASSERT_THAT(created, IsOk());
  const std::string job = created->job_id();
  auto placement = [&] {
    v1::GetPlacementRequest req;
    req.set_job_id(job);
    auto p = coordinator_->GetPlacement(req);
    EXPECT_THAT(p, IsOk());
    return p.ok() ? p->placement() : v1::Placement();
  };
  const std::vector<std::string> first = HoldersOf(placement(), 0);
  ASSERT_EQ(first.size(), 2u);
  const std::string source = first[0], replica = first[1];
  const std::vector<std::string> holders1 = HoldersOf(placement(), 1);
  const std::set<std::string> rank1(holders1.begin(), holders1.end());
  std::string target;
  for (const auto& [node, d] : daemons) {
    if (d.daemon_id() != source && d.daemon_id() != replica && !rank1.count(d.daemon_id())) target = d.daemon_id();
  }
  if (target.empty()) {  // every spare daemon holds rank 1: any that holds no copy of rank 0
    for (const auto& [node, d] : daemons) {
      if (d.daemon_id() != source && d.daemon_id() != replica) target = d.daemon_id();
    }
  }
  v1::MoveShardRequest move;
  move.set_job_id(job);
  move.mutable_shard()->set_shard(0);
  move.set_to_daemon_id(target);
  ASSERT_THAT(coordinator_->MoveShard(move), IsOk());
  ASSERT_EQ(HoldersOf(placement(), 0).front(), target);
  // The job has started (version 0 is out) and runs epoch 2, the target still loading. Then the
  // source dies before its copy reached the target: every other daemon renews its lease.
  auto beat = [&](const v1::RegisterDaemonResponse& d) {
    v1::HeartbeatRequest hb;
    hb.set_daemon_id(d.daemon_id());
    hb.set_lease_id(d.lease_id());
    v1::JobProgress* p = hb.add_jobs();
    p->set_job_id(job);
    p->set_placement_epoch(2);
    p->set_version(d.daemon_id() == target ? -1 : 3);
    p->set_committed_step(d.daemon_id() == target ? -1 : 2);
    p->set_loading(d.daemon_id() == target);
    ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  };
  for (const auto& [node, d] : daemons) beat(d);
  clock_.Advance(900);
  for (const auto& [node, d] : daemons) {
    if (d.daemon_id() != source) beat(d);
  }
  clock_.Advance(200);
  const size_t before = assigner_.calls().size();
  coordinator_->Tick();
  const v1::Placement after = placement();
  EXPECT_EQ(after.epoch(), 3);
  EXPECT_EQ(HoldersOf(after, 0), (std::vector<std::string>{target, replica}));
  bool copied_from_replica = false;
  const auto calls = assigner_.calls();
  for (size_t i = before; i < calls.size(); ++i) {
    if (!calls[i].assign) continue;
    EXPECT_FALSE(calls[i].assign_request.has_from_checkpoint()) << "a restore, although a replica lives";
    if (!calls[i].assign_request.has_from_peer()) continue;
    EXPECT_EQ(calls[i].address, Daemons()[target].endpoint().address());
    EXPECT_EQ(calls[i].assign_request.placement_epoch(), 3);
    EXPECT_EQ(calls[i].assign_request.from_peer().daemon().daemon_id(), replica);
    copied_from_replica = true;
  }
  EXPECT_TRUE(copied_from_replica) << "the target was never told to copy from the surviving replica";
}

TEST_F(CoordinatorCoreTest, ALostDaemonFailsOverToReplicasThenTheJobIsReReplicated) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  const std::string job = CreateReplicated();
  auto at = [&](int64_t epoch) { return PlacementAt(job, epoch); };
  auto beat = [&](const v1::RegisterDaemonResponse& d, int64_t epoch) { Beat(d, job, epoch); };
  const v1::Placement first = at(1);
  ASSERT_EQ(HoldersOf(first, 0).front(), a.daemon_id());
  const std::string replica_of_0 = HoldersOf(first, 0)[1];
  for (auto* d : {&a, &b, &c}) beat(*d, 1);
  // a dies: its lease runs out while b and c renew theirs.
  clock_.Advance(900);
  beat(b, 1);
  beat(c, 1);
  clock_.Advance(200);
  coordinator_->Tick();
  const v1::Placement failed_over = at(2);
  EXPECT_EQ(HoldersOf(failed_over, 0), std::vector<std::string>{replica_of_0}) << "promoted, nothing restored";
  for (int rank = 0; rank < 2; ++rank) {
    for (const std::string& id : HoldersOf(failed_over, rank)) EXPECT_NE(id, a.daemon_id());
  }
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).state(), v1::JOB_STATE_READY);
  // Re-replication waits until both survivors run epoch 2, then copies each short rank from
  // its primary to the other survivor.
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->WaitPlacement(job, "", 2, absl::Now() + absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  beat(b, 2);
  beat(c, 2);
  const size_t before = assigner_.calls().size();
  coordinator_->Tick();
  const v1::Placement rereplicated = at(3);
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(HoldersOf(rereplicated, rank).size(), 2u) << "rank " << rank;
  EXPECT_EQ(HoldersOf(rereplicated, 0).front(), replica_of_0) << "the primary stays";
  const std::string new_replica = HoldersOf(rereplicated, 0)[1];
  bool copied = false;
  const auto calls = assigner_.calls();
  for (size_t i = before; i < calls.size(); ++i) {
    if (!calls[i].assign || !calls[i].assign_request.has_from_peer()) continue;
    if (calls[i].assign_request.shards(0).shard() != 0) continue;  // (rank 1 may be short too)
    EXPECT_EQ(calls[i].address, Daemons()[new_replica].endpoint().address());
    EXPECT_EQ(calls[i].assign_request.from_peer().daemon().daemon_id(), replica_of_0);
    copied = true;
  }
  EXPECT_TRUE(copied);
  // The new replica reports it loaded: the move is over, and the source drops nothing.
  beat(b, 3);
  beat(c, 3);
  for (size_t i = before; i < assigner_.calls().size(); ++i) EXPECT_TRUE(assigner_.calls()[i].assign);
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->WaitPlacement(job, "", 3, absl::Now() + absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded))
      << "two copies of every rank: nothing more to do";
}

// A new replica that cannot allocate its copy gives the copy up (the rank stays with one copy
// for now), and re-replication does not pick that daemon for the job again for five minutes:
// each try costs a placement epoch.
TEST_F(CoordinatorCoreTest, ANewReplicaThatCannotAllocateItsCopyIsNotChosenAgain) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  const std::string job = CreateReplicated();
  auto at = [&](int64_t epoch) { return PlacementAt(job, epoch); };
  const std::string replica_of_0 = HoldersOf(at(1), 0)[1];
  for (auto* d : {&a, &b, &c}) Beat(*d, job, 1);
  clock_.Advance(900);  // a dies
  Beat(b, job, 1);
  Beat(c, job, 1);
  clock_.Advance(200);
  coordinator_->Tick();
  ASSERT_EQ(at(2).epoch(), 2);
  Beat(b, job, 2);
  Beat(c, job, 2);
  coordinator_->Tick();
  const std::vector<std::string> holders = HoldersOf(at(3), 0);
  ASSERT_EQ(holders.size(), 2u);
  ASSERT_EQ(holders[0], replica_of_0);
  const v1::RegisterDaemonResponse& full = holders[1] == b.daemon_id() ? b : c;
  const v1::RegisterDaemonResponse& other = holders[1] == b.daemon_id() ? c : b;
  Beat(other, job, 3);
  Beat(full, job, 3, /*loading=*/true, "loading 1 shard(s): RESOURCE_EXHAUSTED: no memory",
       absl::StatusCode::kResourceExhausted);
  const v1::Placement given_up = at(4);
  EXPECT_EQ(HoldersOf(given_up, 0), std::vector<std::string>{replica_of_0}) << "no other daemon has room";
  EXPECT_EQ(coordinator_->ListJobs({}).jobs(0).moves_size(), 0);
  Beat(other, job, 4);
  Beat(full, job, 4);
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->WaitPlacement(job, "", 4, absl::Now() + absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded))
      << "re-replicated to " << full.daemon_id() << " again at once";
  // Five minutes later it is tried again (its memory may have been freed).
  for (int i = 0; i < 601; ++i) {  // (the leases are renewed meanwhile)
    clock_.Advance(500);
    Beat(other, job, 4);
    Beat(full, job, 4);
  }
  coordinator_->Tick();
  EXPECT_EQ(HoldersOf(PlacementAt(job, 5), 0), (std::vector<std::string>{replica_of_0, full.daemon_id()}));
}

// A daemon saved DOWN by a heartbeat's lease check, then the coordinator restarted before its
// next tick made the failover: the new process makes it (the queue of jobs to recover lives
// only in memory).
TEST_F(CoordinatorCoreTest, AFailoverNotMadeBeforeARestartIsMadeAfterIt) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  const std::string job = CreateReplicated();
  auto beat = [&](const v1::RegisterDaemonResponse& d) { Beat(d, job, 1); };
  const v1::Placement first = PlacementAt(job, 1);
  ASSERT_EQ(HoldersOf(first, 0).front(), a.daemon_id());
  const std::string replica_of_0 = HoldersOf(first, 0)[1];
  for (auto* d : {&a, &b, &c}) beat(*d);
  clock_.Advance(900);
  beat(b);
  beat(c);
  clock_.Advance(200);
  beat(b);  // its lease check saves a DOWN; the failover waits for the next Tick
  ASSERT_EQ(Daemons()[a.daemon_id()].state(), v1::DAEMON_STATE_DOWN);
  EXPECT_THAT(coordinator_->WaitPlacement(job, "", 1, absl::Now() + absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  Restart(std::move(store_));
  coordinator_->Tick();
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::Placement failed_over,
                                coordinator_->WaitPlacement(job, "", 1, absl::Now() + absl::Seconds(1)));
  EXPECT_EQ(failed_over.epoch(), 2);
  EXPECT_EQ(HoldersOf(failed_over, 0), std::vector<std::string>{replica_of_0}) << "promoted after the restart";
}

TEST_F(CoordinatorCoreTest, DrainingAReplicaMovesItsRoleAndAPrimaryMovesOnlyToADaemonWithoutACopy) {
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto c = Register("n3", kGiB);
  v1::JobSpec spec = SmallSpec("j", 1, {"n1"});
  spec.set_replication_factor(2);
  auto created = Create(spec);
  ASSERT_THAT(created, IsOk());
  const std::string job = created->job_id();
  auto first = coordinator_->WaitPlacement(job, "", 0, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(first, IsOk());
  const std::vector<std::string> holders = HoldersOf(*first, 0);
  ASSERT_EQ(holders.size(), 2u);
  ASSERT_EQ(holders[0], a.daemon_id());
  const std::string spare = holders[1] == b.daemon_id() ? c.daemon_id() : b.daemon_id();
  v1::MoveShardRequest move;
  move.set_job_id(job);
  move.mutable_shard()->set_shard(0);
  move.set_to_daemon_id(holders[1]);
  EXPECT_THAT(coordinator_->MoveShard(move),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already holds a replica")));
  v1::DrainDaemonRequest drain;
  drain.set_daemon_id(holders[1]);
  ASSERT_THAT(coordinator_->DrainDaemon(drain), IsOk());
  auto second = coordinator_->WaitPlacement(job, "", 1, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(HoldersOf(*second, 0), (std::vector<std::string>{a.daemon_id(), spare}));
  // The spare is copying the rank: draining it (or the primary) now is refused until the move is
  // over, with nothing changed; a second move on top of the first would never finish.
  for (const std::string& id : {spare, a.daemon_id()}) {
    drain.set_daemon_id(id);
    EXPECT_THAT(coordinator_->DrainDaemon(drain),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is still moving")));
    EXPECT_EQ(Daemons()[id].state(), v1::DAEMON_STATE_READY);
  }
  // The spare reports the rank loaded: the move is over.
  Beat(spare == b.daemon_id() ? b : c, job, second->epoch());
  // With every other daemon holding a copy, the primary's daemon cannot be drained.
  drain.set_daemon_id(a.daemon_id());
  EXPECT_THAT(coordinator_->DrainDaemon(drain),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("nothing was moved")));
}

// Recovery from a lost daemon: the newest checkpoint that verifies, not merely the newest.
TEST_F(CoordinatorCoreTest, RecoverySkipsACheckpointWhoseFilesDoNotVerify) {
  checkpoint_dir_ = "/ckpt";
  Restart(NewMemoryStateStore());
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  const std::vector<float> master(8, 1.0f);
  const std::vector<uint8_t> moments(32, 0);
  for (int i = 1; i <= 2; ++i) {  // ckpt-1 (older), ckpt-2 (newer)
    const std::string dir = absl::StrCat("/ckpt/ckpt-", i);
    ASSERT_THAT(fs_.CreateDirs(dir), IsOk());
    absl::StatusOr<v1::CheckpointFile> file =
        checkpoint::WriteDataFile(fs_, dir, 0, 0, {{"layers.0.fc1.bias", 0, 8, master, moments, moments}});
    ASSERT_THAT(file.status(), IsOk());
    v1::CheckpointManifest m;
    m.set_checkpoint_id(absl::StrCat("ckpt-", i));
    m.set_job_id(created->job_id());
    m.set_version(10 * i);
    m.set_committed_step(10 * i - 1);
    m.set_created_unix_ms(clock_.NowUnixMs() + i);
    *m.add_files() = *file;
    ASSERT_THAT(checkpoint::WriteManifest(fs_, dir, m), IsOk());
  }
  fs_.Corrupt(checkpoint::JoinPath("/ckpt/ckpt-2", fs_.ListDir("/ckpt/ckpt-2")->front()), 40);
  // b goes silent: DOWN, and the job is restored from ckpt-1 (ckpt-2's data does not verify).
  v1::HeartbeatRequest hb;
  hb.set_daemon_id(a.daemon_id());
  hb.set_lease_id(a.lease_id());
  clock_.Advance(900);
  ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
  clock_.Advance(200);
  const size_t before = assigner_.calls().size();
  coordinator_->Tick();
  std::set<std::string> restored_from;
  const auto calls = assigner_.calls();
  for (size_t i = before; i < calls.size(); ++i) {
    if (calls[i].assign && calls[i].assign_request.has_from_checkpoint()) {
      restored_from.insert(calls[i].assign_request.from_checkpoint().checkpoint_id());
    }
  }
  EXPECT_THAT(restored_from, ElementsAre("ckpt-1"));
}

// A daemon that refuses a restore's assignment for lack of memory: its ranks go to another
// daemon, and every daemon of the job loads the checkpoint at the new epoch.
TEST_F(RefusalTest, ARestoresRanksThatADaemonRefusesAreRestoredOnAnotherDaemon) {
  checkpoint_dir_ = "/ckpt";
  Restart(NewMemoryStateStore());
  auto a = Register("n1", kGiB);
  auto b = Register("n2", kGiB);
  auto created = Create(SmallSpec("j", 2, {"n1", "n2"}));
  ASSERT_THAT(created, IsOk());
  ASSERT_THAT(fs_.CreateDirs("/ckpt/ckpt-1"), IsOk());
  absl::StatusOr<v1::CheckpointFile> file = checkpoint::WriteDataFile(
      fs_, "/ckpt/ckpt-1", 0, 0, {{"layers.0.fc1.bias", 0, 8, std::vector<float>(8, 1.0f), std::vector<uint8_t>(32, 0),
                                   std::vector<uint8_t>(32, 0)}});
  ASSERT_THAT(file.status(), IsOk());
  v1::CheckpointManifest m;
  m.set_checkpoint_id("ckpt-1");
  m.set_job_id(created->job_id());
  m.set_version(10);
  m.set_committed_step(9);
  m.set_created_unix_ms(clock_.NowUnixMs());
  *m.add_files() = *file;
  ASSERT_THAT(checkpoint::WriteManifest(fs_, "/ckpt/ckpt-1", m), IsOk());
  auto c = Register("n3", kGiB);
  // b goes silent: DOWN, and the job is restored from ckpt-1 on a and c.
  for (int round = 0; round < 2; ++round) {
    clock_.Advance(600);
    for (const auto* d : {&a, &c}) {
      v1::HeartbeatRequest hb;
      hb.set_daemon_id(d->daemon_id());
      hb.set_lease_id(d->lease_id());
      ASSERT_THAT(coordinator_->Heartbeat(hb), IsOk());
    }
  }
  coordinator_->Tick();
  const v1::Placement restored = PlacementOf(created->job_id());
  const std::string lost_rank_holder = Owners(restored, 2)[1];
  ASSERT_NE(lost_rank_holder, b.daemon_id());
  const std::string address = lost_rank_holder == a.daemon_id() ? "n1:7000" : "n3:7000";
  const v1::AssignShardRequest refused = LastAssignmentTo(address);
  ASSERT_TRUE(refused.has_from_checkpoint());
  ASSERT_EQ(refused.placement_epoch(), restored.epoch());
  assigner_.Refuse(address, refused, kNoRoom);
  const v1::Placement moved = PlacementOf(created->job_id());
  EXPECT_EQ(moved.epoch(), restored.epoch() + 1);
  for (const std::string& owner : Owners(moved, 2)) EXPECT_NE(owner, lost_rank_holder);
  for (const std::string& to : {std::string("n1:7000"), std::string("n3:7000")}) {
    if (to == address) continue;
    const v1::AssignShardRequest sent = LastAssignmentTo(to);
    EXPECT_EQ(sent.placement_epoch(), moved.epoch()) << to;
    EXPECT_TRUE(sent.has_from_checkpoint()) << to << " loads the checkpoint at the new epoch";
    EXPECT_EQ(sent.from_checkpoint().checkpoint_id(), "ckpt-1");
  }
}

TEST_F(CoordinatorCoreTest, FinishedBackgroundCheckpointThreadsAreReaped) {
  checkpoint_dir_ = "/ckpt";
  Restart(NewMemoryStateStore());
  Register("n1", kGiB);
  auto created = Create(SmallSpec("j", 1));
  ASSERT_THAT(created, IsOk());
  v1::CreateCheckpointRequest request;
  request.set_job_id(created->job_id());
  request.set_wait(false);
  for (int i = 0; i < 200; ++i) {
    // Each fails at once (the recording assigner writes nothing) and its thread ends.
    ASSERT_THAT(coordinator_->CreateCheckpoint(request, absl::Now() + absl::Seconds(5)), IsOk());
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_LE(coordinator_->background_threads_for_testing(), 10u) << "the 200 finished threads were all kept";
}

TEST_F(CoordinatorCoreTest, KvCompareAndSetAndTtl) {
  v1::KvPutRequest put;
  put.set_key("jobs/j/nccl");
  put.set_value("id-1");
  put.set_expected_version(0);  // create only
  auto first = coordinator_->KvPut(put);
  ASSERT_THAT(first, IsOk());
  EXPECT_TRUE(first->applied());
  EXPECT_EQ(first->current().version(), 1);
  put.set_value("id-2");
  auto lost = coordinator_->KvPut(put);
  ASSERT_THAT(lost, IsOk());
  EXPECT_FALSE(lost->applied()) << "the key exists";
  EXPECT_EQ(lost->current().value(), "id-1");
  put.set_expected_version(1);
  auto swapped = coordinator_->KvPut(put);
  ASSERT_THAT(swapped, IsOk());
  EXPECT_TRUE(swapped->applied());
  EXPECT_EQ(swapped->current().version(), 2);

  v1::KvPutRequest ttl;
  ttl.set_key("jobs/j/lease");
  ttl.set_value("x");
  ttl.set_ttl_ms(500);
  ASSERT_THAT(coordinator_->KvPut(ttl), IsOk());
  v1::KvGetRequest get;
  get.set_key("jobs/j/");
  get.set_prefix(true);
  EXPECT_EQ(coordinator_->KvGet(get, absl::InfiniteFuture())->entries_size(), 2);
  clock_.Advance(501);
  EXPECT_EQ(coordinator_->KvGet(get, absl::InfiniteFuture())->entries_size(), 1) << "expired";
  get.set_key("jobs/j/missing");
  get.set_prefix(false);
  get.set_wait_ms(30);
  EXPECT_THAT(coordinator_->KvGet(get, absl::InfiniteFuture()), StatusIs(absl::StatusCode::kNotFound));

  v1::KvDeleteRequest del;
  del.set_key("jobs/j/nccl");
  del.set_expected_version(1);
  EXPECT_EQ(coordinator_->KvDelete(del)->deleted(), 0) << "version moved on";
  del.set_expected_version(2);
  EXPECT_EQ(coordinator_->KvDelete(del)->deleted(), 1);

  v1::KvPutRequest bad;
  EXPECT_THAT(coordinator_->KvPut(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  bad.set_key("k");
  bad.set_value(std::string((1 << 20) + 1, 'x'));
  EXPECT_THAT(coordinator_->KvPut(bad), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("value")));
}

TEST_F(CoordinatorCoreTest, KvWatchSeesPutsDeletesAndExpiriesInOrderAndSaysWhenHistoryIsGone) {
  auto put = [&](const std::string& key, const std::string& value, int64_t ttl_ms = 0) {
    v1::KvPutRequest r;
    r.set_key(key);
    r.set_value(value);
    r.set_ttl_ms(ttl_ms);
    ASSERT_THAT(coordinator_->KvPut(r), IsOk());
  };
  v1::KvWatchRequest watch;
  watch.set_key("peer/");
  watch.set_prefix(true);
  const int64_t start = coordinator_->KvRevision();
  EXPECT_THAT(coordinator_->KvChangesAfter(watch, start, 100), StatusIs(absl::StatusCode::kDeadlineExceeded));
  put("peer/a", "1");
  put("other/x", "not watched");
  put("peer/b", "2", /*ttl_ms=*/100);
  put("peer/a", "3");
  v1::KvDeleteRequest del;
  del.set_key("peer/a");
  ASSERT_THAT(coordinator_->KvDelete(del), IsOk());
  clock_.Advance(101);  // peer/b expires
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Coordinator::KvChanges all, coordinator_->KvChangesAfter(watch, start, 100));
  std::vector<std::string> seen;
  int64_t last = start;
  for (const v1::KvWatchResponse& c : all.changes) {
    EXPECT_GT(c.revision(), last);  // oldest first, one revision each here
    last = c.revision();
    seen.push_back(absl::StrCat(v1::KvEventType_Name(c.type()), " ", c.entry().key(), " v", c.entry().version(),
                                c.type() == v1::KV_EVENT_TYPE_PUT ? " " + c.entry().value() : ""));
  }
  EXPECT_THAT(seen, ::testing::ElementsAre("KV_EVENT_TYPE_PUT peer/a v1 1", "KV_EVENT_TYPE_PUT peer/b v1 2",
                                           "KV_EVENT_TYPE_PUT peer/a v2 3", "KV_EVENT_TYPE_DELETE peer/a v2",
                                           "KV_EVENT_TYPE_EXPIRE peer/b v1"));
  EXPECT_EQ(all.revision, coordinator_->KvRevision());
  // One key, and a limit: the next call goes on from the revision returned.
  watch.set_key("peer/a");
  watch.set_prefix(false);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Coordinator::KvChanges first, coordinator_->KvChangesAfter(watch, start, 1));
  ASSERT_EQ(first.changes.size(), 1u);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Coordinator::KvChanges rest, coordinator_->KvChangesAfter(watch, first.revision, 100));
  EXPECT_EQ(rest.changes.size(), 2u);
  EXPECT_THAT(coordinator_->KvChangesAfter(watch, coordinator_->KvRevision() + 1, 100),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ahead")));
  // A restarted coordinator keeps the KV but not its history.
  const int64_t before_restart = coordinator_->KvRevision();
  Restart(std::move(store_));
  EXPECT_THAT(coordinator_->KvChangesAfter(watch, start, 100),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("re-read with KvGet")));
  EXPECT_THAT(coordinator_->KvChangesAfter(watch, before_restart, 100), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

class FileStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("mainstay-store-" + std::to_string(::getpid()) + "-" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

v1::StateBatch KvBatch(int64_t seq, const std::string& key) {
  v1::StateBatch b;
  b.set_sequence(seq);
  v1::KvEntry* e = b.add_records()->mutable_put_kv();
  e->set_key(key);
  e->set_value("v" + key);
  b.mutable_counters()->set_kv_revision(seq);
  return b;
}

// Only a final append cut short is a torn tail; a complete record that is corrupt is refused
// with DATA_LOSS naming the file and offset, wherever it is, rather than silently cut off.
TEST_F(FileStoreTest, OnlyAShortFinalRecordIsATornTail) {
  const auto wal = dir_ / "wal";
  auto write_three = [&] {
    std::filesystem::remove(wal);
    std::filesystem::remove(dir_ / "snapshot");
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT((*store)->Load(), IsOk());
    for (int i = 1; i <= 3; ++i) ASSERT_THAT((*store)->Append(KvBatch(i, std::to_string(i))), IsOk());
  };
  auto corrupt = [&](std::streamoff at, char byte) {
    std::fstream f(wal, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(at);
    f.put(byte);
  };
  auto load = [&] { return (*OpenFileStateStore(dir_))->Load(); };
  write_three();
  const auto size = static_cast<std::streamoff>(std::filesystem::file_size(wal));
  const std::streamoff record = size / 3;  // the three batches have the same size
  // A bad magic in the second record (the old reader took it for a torn tail and dropped 2 and 3).
  corrupt(record, 'X');
  EXPECT_THAT(load(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(absl::StrCat("byte ", record, " of"))));
  EXPECT_THAT(load(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad magic")));
  // An absurd length in the second record's header.
  write_three();
  corrupt(record + 7, '\x7f');
  EXPECT_THAT(load(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad length")));
  // A complete final record with a bad checksum was acknowledged: refused too.
  write_three();
  corrupt(size - 1, '\x55');
  EXPECT_THAT(load(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(absl::StrCat("byte ", 2 * record))));
  // The file extended with zeros that were never written (a crash after the size grew): cut.
  write_three();
  {
    std::ofstream f(wal, std::ios::app | std::ios::binary);
    f << std::string(64, '\0');
  }
  auto state = load();
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->sequence(), 3);
}

TEST_F(FileStoreTest, ReplaysLogOntoSnapshot) {
  {
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT(store, IsOk());
    ASSERT_THAT((*store)->Load(), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(1, "a")), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(2, "b")), IsOk());
    v1::CoordinatorState snap;
    snap.set_sequence(2);
    *snap.add_kv() = KvBatch(1, "a").records(0).put_kv();
    *snap.add_kv() = KvBatch(2, "b").records(0).put_kv();
    ASSERT_THAT((*store)->WriteSnapshot(snap), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(3, "c")), IsOk());
  }
  auto store = OpenFileStateStore(dir_);
  auto state = (*store)->Load();
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->sequence(), 3);
  EXPECT_EQ(state->kv_size(), 3);
}

// A snapshot is written by the Sync after StartSnapshot, while Writes go on into the next log
// (wal.next): a crash at any point in between loses nothing that was written in order, and a
// torn end of the old log also drops the next one (nothing in it can have been synced).
TEST_F(FileStoreTest, ACrashWhileASnapshotIsWrittenLosesNothingWrittenBeforeIt) {
  v1::CoordinatorState at2;
  at2.set_sequence(2);
  *at2.add_kv() = KvBatch(1, "a").records(0).put_kv();
  *at2.add_kv() = KvBatch(2, "b").records(0).put_kv();
  {  // the crash comes after the next log got batch 3, before any Sync
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT((*store)->Load(), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(1, "a")), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(2, "b")), IsOk());
    ASSERT_THAT((*store)->StartSnapshot(at2), IsOk());
    EXPECT_THAT((*store)->StartSnapshot(at2), StatusIs(absl::StatusCode::kFailedPrecondition)) << "one at a time";
    ASSERT_THAT((*store)->Write(KvBatch(3, "c")), IsOk());
    EXPECT_TRUE(std::filesystem::exists(dir_ / "wal.next"));
  }
  {
    auto store = OpenFileStateStore(dir_);
    auto state = (*store)->Load();
    ASSERT_THAT(state, IsOk());
    EXPECT_EQ(state->sequence(), 3);
    EXPECT_EQ(state->kv_size(), 3);
    EXPECT_FALSE(std::filesystem::exists(dir_ / "wal.next")) << "Load starts over from one snapshot and one log";
    // Later, a snapshot completes while writes continue: both land.
    ASSERT_THAT((*store)->Append(KvBatch(4, "d")), IsOk());
    v1::CoordinatorState at4 = *state;
    at4.set_sequence(4);
    *at4.add_kv() = KvBatch(4, "d").records(0).put_kv();
    ASSERT_THAT((*store)->StartSnapshot(at4), IsOk());
    ASSERT_THAT((*store)->Write(KvBatch(5, "e")), IsOk());
    ASSERT_THAT((*store)->Sync(), IsOk());
    EXPECT_FALSE(std::filesystem::exists(dir_ / "wal.next"));
    ASSERT_THAT((*store)->Append(KvBatch(6, "f")), IsOk());
  }
  {
    auto store = OpenFileStateStore(dir_);
    auto state = (*store)->Load();
    ASSERT_THAT(state, IsOk());
    EXPECT_EQ(state->sequence(), 6);
    EXPECT_EQ(state->kv_size(), 6);
  }
  // The old log cut short while a next log exists: the next log's records were never synced.
  std::filesystem::remove_all(dir_);
  {
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT((*store)->Load(), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(1, "a")), IsOk());
    ASSERT_THAT((*store)->Write(KvBatch(2, "b")), IsOk());
    ASSERT_THAT((*store)->StartSnapshot(at2), IsOk());
    ASSERT_THAT((*store)->Write(KvBatch(3, "c")), IsOk());
  }
  std::filesystem::resize_file(dir_ / "wal", std::filesystem::file_size(dir_ / "wal") - 3);
  auto store = OpenFileStateStore(dir_);
  auto state = (*store)->Load();
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->sequence(), 1) << "batch 3 follows a torn batch 2: never acknowledged";
}

// A snapshot the store cannot write (here: snapshot.tmp is a directory) is dropped: Sync still
// succeeds, the log stays whole (the next log's records go back into it), and a later snapshot
// works once the obstacle is gone.
TEST_F(FileStoreTest, ASnapshotThatCannotBeWrittenIsDroppedAndTheLogStaysWhole) {
  v1::CoordinatorState at1;
  at1.set_sequence(1);
  *at1.add_kv() = KvBatch(1, "a").records(0).put_kv();
  {
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT((*store)->Load(), IsOk());
    ASSERT_THAT((*store)->Append(KvBatch(1, "a")), IsOk());
    std::filesystem::create_directory(dir_ / "snapshot.tmp");
    ASSERT_THAT((*store)->StartSnapshot(at1), IsOk());
    ASSERT_THAT((*store)->Write(KvBatch(2, "b")), IsOk());
    EXPECT_THAT((*store)->Sync(), IsOk()) << "the log is durable: a failed snapshot is no reason to stop";
    EXPECT_FALSE(std::filesystem::exists(dir_ / "wal.next"));
    EXPECT_FALSE(std::filesystem::exists(dir_ / "snapshot"));
    ASSERT_THAT((*store)->Append(KvBatch(3, "c")), IsOk());
    std::filesystem::remove(dir_ / "snapshot.tmp");
    v1::CoordinatorState at3 = at1;
    at3.set_sequence(3);
    *at3.add_kv() = KvBatch(2, "b").records(0).put_kv();
    *at3.add_kv() = KvBatch(3, "c").records(0).put_kv();
    ASSERT_THAT((*store)->WriteSnapshot(at3), IsOk());
    EXPECT_TRUE(std::filesystem::exists(dir_ / "snapshot"));
  }
  auto store = OpenFileStateStore(dir_);
  auto state = (*store)->Load();
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->sequence(), 3);
  EXPECT_EQ(state->kv_size(), 3);
}

TEST_F(FileStoreTest, TornTailIsCutAndCorruptMiddleIsRefused) {
  {
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT((*store)->Load(), IsOk());
    for (int i = 1; i <= 3; ++i) ASSERT_THAT((*store)->Append(KvBatch(i, std::to_string(i))), IsOk());
  }
  const auto wal = dir_ / "wal";
  const auto size = std::filesystem::file_size(wal);
  std::filesystem::resize_file(wal, size - 5);  // a crash mid-append of batch 3
  {
    auto store = OpenFileStateStore(dir_);
    auto state = (*store)->Load();
    ASSERT_THAT(state, IsOk());
    EXPECT_EQ(state->sequence(), 2);
    ASSERT_THAT((*store)->Append(KvBatch(3, "3")), IsOk()) << "appends continue after the cut";
  }
  {
    auto store = OpenFileStateStore(dir_);
    EXPECT_EQ((*store)->Load()->sequence(), 3);
  }
  // Flip a byte inside the first record: committed data is corrupt, refuse to start.
  {
    std::fstream f(wal, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(14);
    f.put('\x7f');
  }
  auto store = OpenFileStateStore(dir_);
  EXPECT_THAT((*store)->Load(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("corrupt record at byte 0")));
}

TEST_F(FileStoreTest, CoordinatorRestartRecoversDaemonsJobsPlacementAndKv) {
  FakeClock clock;
  RecordingShardAssigner assigner;
  std::string job_id;
  int64_t epoch = 0;
  {
    auto store = OpenFileStateStore(dir_);
    ASSERT_THAT(store, IsOk());
    CoordinatorOptions options;
    options.clock = &clock;
    options.store = store->get();
    options.assigner = &assigner;
    options.snapshot_every_batches = 3;
    auto c = Coordinator::Create(options);
    ASSERT_THAT(c, IsOk());
    for (const char* node : {"n1", "n2"}) {
      v1::RegisterDaemonRequest req;
      req.set_address(std::string(node) + ":1");
      req.mutable_resources()->set_host_memory_bytes(kGiB);
      ASSERT_THAT((*c)->RegisterDaemon(req), IsOk());
    }
    v1::CreateJobRequest create;
    *create.mutable_spec() = SmallSpec("j", 2);
    auto job = (*c)->CreateJob(create);
    ASSERT_THAT(job, IsOk());
    job_id = job->job_id();
    v1::DrainDaemonRequest drain;
    drain.set_daemon_id("daemon-1");
    ASSERT_THAT((*c)->DrainDaemon(drain), IsOk());
    v1::KvPutRequest put;
    put.set_key("k");
    put.set_value("v");
    ASSERT_THAT((*c)->KvPut(put), IsOk());
    v1::GetPlacementRequest p;
    p.set_job_id(job_id);
    epoch = (*c)->GetPlacement(p)->placement().epoch();
  }
  auto store = OpenFileStateStore(dir_);
  CoordinatorOptions options;
  options.clock = &clock;
  options.store = store->get();
  auto c = Coordinator::Create(options);
  ASSERT_THAT(c, IsOk());
  v1::ListDaemonsRequest list;
  list.set_include_down(true);
  auto daemons = (*c)->ListDaemons(list);
  ASSERT_EQ(daemons.daemons_size(), 2);
  EXPECT_EQ(daemons.daemons(0).state(), v1::DAEMON_STATE_DRAINING);
  v1::GetPlacementRequest p;
  p.set_job_id(job_id);
  EXPECT_EQ((*c)->GetPlacement(p)->placement().epoch(), epoch);
  EXPECT_EQ(epoch, 2);
  v1::KvGetRequest get;
  get.set_key("k");
  EXPECT_EQ((*c)->KvGet(get, absl::InfiniteFuture())->entries(0).value(), "v");
  // A new registration continues the id sequence.
  v1::RegisterDaemonRequest req;
  req.set_address("n3:1");
  EXPECT_EQ((*c)->RegisterDaemon(req)->daemon_id(), "daemon-3");
}

}  // namespace
}  // namespace mainstay::coordinator

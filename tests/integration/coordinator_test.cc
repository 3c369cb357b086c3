// mainstay-coordinator end to end: the real binary on 127.0.0.1:0 with a temporary state
// directory, driven over gRPC by clients acting as daemons (each serves an in-process Shard
// service on 127.0.0.1:0 that records the AssignShard / DropShard calls it gets), trainers and
// an admin. Waits are waits for a condition with generous timeouts (a loaded 2-core machine),
// never fixed sleeps.
#include <gmock/gmock.h>
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <openssl/sha.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::mainstay::testing::DescribeWaitStatus;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr absl::Duration kRpcTimeout = absl::Seconds(30);
constexpr absl::Duration kWaitTimeout = absl::Seconds(60);
constexpr int64_t kLongLeaseMs = 600'000;  // daemons that are not about leases never expire
constexpr int64_t kDaemonMemory = int64_t{1} << 30;

// One unary call with a deadline, as a StatusOr.
template <typename Stub, typename Request, typename Response>
absl::StatusOr<Response> Rpc(Stub& stub, ::grpc::Status (Stub::*method)(::grpc::ClientContext*, const Request&, Response*),
                             const std::type_identity_t<Request>& request, absl::Duration timeout = kRpcTimeout) {
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  Response response;
  ::grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

using CoordinatorStub = v1::Coordinator::Stub;
using AdminStub = v1::Admin::Stub;

// The binary under test, restartable on the same state directory.
class CoordinatorProcess {
 public:
  explicit CoordinatorProcess(const TempDir& dir) : dir_(dir) {}

  absl::Status Start(std::vector<std::string> flags = {}) {
    std::remove(dir_.File("port").c_str());  // a previous run's port must not be read
    std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                     dir_.File("state"), "--port-file", dir_.File("port")};
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start({argv, dir_.File("coordinator.log")});
    if (!process.ok()) return process.status();
    process_ = *std::move(process);
    absl::StatusOr<int> port = testing::WaitForPortFile(dir_.File("port"), *process_, kWaitTimeout);
    if (!port.ok()) return port.status();
    address_ = absl::StrCat("127.0.0.1:", *port);
    channel_ = ::grpc::CreateChannel(address_, ::grpc::InsecureChannelCredentials());
    coordinator_ = v1::Coordinator::NewStub(channel_);
    admin_ = v1::Admin::NewStub(channel_);
    return absl::OkStatus();
  }

  // Sends `signal_number` and returns how the process ended.
  absl::StatusOr<int> Stop(int signal_number) {
    absl::Status s = process_->Signal(signal_number);
    if (!s.ok()) return s;
    return process_->Wait(kWaitTimeout);
  }

  const std::string& address() const { return address_; }
  std::shared_ptr<::grpc::Channel> channel() const { return channel_; }
  CoordinatorStub& coordinator() { return *coordinator_; }
  AdminStub& admin() { return *admin_; }
  std::string log() const { return ReadFileOrEmpty(dir_.File("coordinator.log")); }

 private:
  const TempDir& dir_;
  std::unique_ptr<Subprocess> process_;
  std::string address_;
  std::shared_ptr<::grpc::Channel> channel_;
  std::unique_ptr<CoordinatorStub> coordinator_;
  std::unique_ptr<AdminStub> admin_;
};

// A test daemon: registers with the coordinator and records the shard calls it receives.
class FakeDaemon final : public v1::Shard::CallbackService {
 public:
  struct Received {
    std::vector<v1::AssignShardRequest> assigns;
    std::vector<v1::DropShardRequest> drops;
  };

  FakeDaemon(std::string node_name, int64_t memory_bytes) : node_name_(std::move(node_name)), memory_(memory_bytes) {}
  ~FakeDaemon() override {
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  // On `port`, or a free one.
  absl::Status Serve(int port = 0) {
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), ::grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) return absl::UnavailableError("fake daemon: cannot listen");
    address_ = absl::StrCat("127.0.0.1:", port);
    return absl::OkStatus();
  }

  absl::StatusOr<v1::RegisterDaemonResponse> Register(CoordinatorStub& coordinator, int64_t lease_ms = kLongLeaseMs) {
    v1::RegisterDaemonRequest request;
    request.set_daemon_id(id_);
    request.set_daemon_key(key_);
    request.set_address(address_);
    request.set_node_name(node_name_);
    request.add_transports(v1::TRANSPORT_GRPC);
    request.mutable_resources()->set_host_memory_bytes(memory_);
    request.mutable_resources()->set_memory_kind(v1::MEMORY_KIND_HOST);
    request.set_version("test");
    request.set_requested_lease_ttl_ms(lease_ms);
    absl::StatusOr<v1::RegisterDaemonResponse> response = Rpc(coordinator, &CoordinatorStub::RegisterDaemon, request);
    if (response.ok()) {
      id_ = response->daemon_id();
      key_ = response->daemon_key();
      lease_ = response->lease_id();
    }
    return response;
  }

  // `jobs`: the progress the heartbeat reports (the jobs this daemon holds).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(CoordinatorStub& coordinator,
                                                  const std::vector<v1::JobProgress>& jobs = {}) {
    v1::HeartbeatRequest request;
    for (const v1::JobProgress& p : jobs) *request.add_jobs() = p;
    request.set_daemon_id(id_);
    request.set_lease_id(lease_);
    return Rpc(coordinator, &CoordinatorStub::Heartbeat, request);
  }

  // True once `predicate` holds for the calls received, false after `timeout`.
  bool WaitFor(std::function<bool(const Received&)> predicate, absl::Duration timeout = kWaitTimeout) {
    struct Check {
      FakeDaemon* self;
      std::function<bool(const Received&)>* predicate;
      static bool Eval(Check* c) ABSL_NO_THREAD_SAFETY_ANALYSIS { return (*c->predicate)(c->self->received_); }
    } check{this, &predicate};
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&Check::Eval, &check), timeout);
  }

  Received received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }
  const std::string& id() const { return id_; }
  const std::string& address() const { return address_; }
  void set_address(std::string address) { address_ = std::move(address); }  // before Serve
  const std::string& node_name() const { return node_name_; }

  ::grpc::ServerUnaryReactor* AssignShard(::grpc::CallbackServerContext* context, const v1::AssignShardRequest* request,
                                          v1::AssignShardResponse*) override {
    {
      absl::MutexLock lock(&mu_);
      received_.assigns.push_back(*request);
    }
    auto* reactor = context->DefaultReactor();
    reactor->Finish(::grpc::Status::OK);
    return reactor;
  }
  ::grpc::ServerUnaryReactor* DropShard(::grpc::CallbackServerContext* context, const v1::DropShardRequest* request,
                                        v1::DropShardResponse*) override {
    {
      absl::MutexLock lock(&mu_);
      received_.drops.push_back(*request);
    }
    auto* reactor = context->DefaultReactor();
    reactor->Finish(::grpc::Status::OK);
    return reactor;
  }

 private:
  const std::string node_name_;
  const int64_t memory_;
  std::unique_ptr<::grpc::Server> server_;
  std::string address_;
  std::string id_;
  std::string key_;  // the daemon key of id_, from its first registration
  std::string lease_;
  absl::Mutex mu_;
  Received received_ ABSL_GUARDED_BY(mu_);
};

// A WatchPlacement stream read on its own thread.
class PlacementWatch {
 public:
  PlacementWatch(CoordinatorStub& coordinator, const std::string& job_id, int64_t known_epoch) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
    v1::WatchPlacementRequest request;
    request.set_job_id(job_id);
    request.set_known_epoch(known_epoch);
    reader_ = coordinator.WatchPlacement(&context_, request);
    thread_ = std::thread([this] {
      v1::WatchPlacementResponse response;
      while (reader_->Read(&response)) {
        absl::MutexLock lock(&mu_);
        placements_.push_back(response.placement());
      }
      absl::Status end = FromGrpcStatus(reader_->Finish());
      absl::MutexLock lock(&mu_);
      end_ = end;
    });
  }
  ~PlacementWatch() {
    context_.TryCancel();
    thread_.join();
  }

  // The first placement received with an epoch >= `epoch`.
  std::optional<v1::Placement> WaitForEpoch(int64_t epoch) {
    auto seen = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return end_.has_value() || (!placements_.empty() && placements_.back().epoch() >= epoch);
    };
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&seen), kWaitTimeout);
    for (const v1::Placement& p : placements_) {
      if (p.epoch() >= epoch) return p;
    }
    return std::nullopt;
  }
  // How the stream ended; nullopt while it still runs after `timeout`.
  std::optional<absl::Status> WaitForEnd(absl::Duration timeout = kWaitTimeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](std::optional<absl::Status>* end) { return end->has_value(); }, &end_),
                         timeout);
    return end_;
  }
  std::vector<int64_t> epochs() {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t> out;
    for (const v1::Placement& p : placements_) out.push_back(p.epoch());
    return out;
  }
  void Cancel() { context_.TryCancel(); }

 private:
  ::grpc::ClientContext context_;
  std::unique_ptr<::grpc::ClientReader<v1::WatchPlacementResponse>> reader_;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<v1::Placement> placements_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> end_ ABSL_GUARDED_BY(mu_);
};

// A port that was free a moment ago (for a server that must start after its address is known).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

v1::JobSpec SmallSpec(const std::string& name, int64_t data_parallel_size, std::vector<std::string> trainer_nodes = {}) {
  v1::JobSpec spec;
  spec.set_name(name);
  spec.set_data_parallel_size(data_parallel_size);
  for (const char* tensor : {"layers.0.weight", "layers.1.weight"}) {
    v1::TensorSpec* t = spec.add_tensors();
    t->set_name(tensor);
    t->add_shape(256);
    t->add_shape(128);
  }
  for (const std::string& node : trainer_nodes) spec.add_trainer_nodes(node);
  return spec;
}

v1::CreateJobRequest CreateRequest(v1::JobSpec spec) {
  v1::CreateJobRequest request;
  *request.mutable_spec() = std::move(spec);
  return request;
}

template <typename Request>
Request WithJobId(const std::string& job_id) {
  Request request;
  request.set_job_id(job_id);
  return request;
}

std::map<std::string, int> RanksPerDaemon(const v1::Placement& placement) {
  std::map<std::string, std::set<int>> ranks;
  for (const v1::ShardPlacement& p : placement.shards()) ranks[p.daemon_id()].insert(p.shard().shard());
  std::map<std::string, int> out;
  for (const auto& [id, r] : ranks) out[id] = static_cast<int>(r.size());
  return out;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(dir_, TempDir::Create("coordinator-test"));
    coordinator_ = std::make_unique<CoordinatorProcess>(*dir_);
  }
  void TearDown() override {
    // The coordinator's log on failure (or always with MAINSTAY_TEST_SHOW_LOGS=1).
    const bool show = HasFailure() || std::getenv("MAINSTAY_TEST_SHOW_LOGS") != nullptr;
    if (show && coordinator_ != nullptr) std::fprintf(stderr, "---- coordinator log ----\n%s", coordinator_->log().c_str());
    daemons_.clear();
    coordinator_.reset();
  }

  CoordinatorStub& stub() { return coordinator_->coordinator(); }
  AdminStub& admin() { return coordinator_->admin(); }

  // A daemon serving and registered (long lease unless told).
  absl::StatusOr<FakeDaemon*> AddDaemon(const std::string& node, int64_t memory = kDaemonMemory,
                                        int64_t lease_ms = kLongLeaseMs) {
    auto daemon = std::make_unique<FakeDaemon>(node, memory);
    if (absl::Status s = daemon->Serve(); !s.ok()) return s;
    if (absl::Status s = daemon->Register(stub(), lease_ms).status(); !s.ok()) return s;
    daemons_.push_back(std::move(daemon));
    return daemons_.back().get();
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::vector<std::unique_ptr<FakeDaemon>> daemons_;
};

TEST_F(CoordinatorTest, DaemonsRegisterHeartbeatAndAreListedSortedById) {
  ASSERT_THAT(coordinator_->Start({"--coordinator-id", "test-coordinator"}), IsOk());
  std::vector<FakeDaemon*> daemons;
  for (const char* node : {"node-a", "node-b", "node-c"}) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d, AddDaemon(node));
    daemons.push_back(d);
  }
  EXPECT_EQ(daemons[0]->id(), "daemon-1");
  EXPECT_EQ(daemons[2]->id(), "daemon-3");

  for (FakeDaemon* d : daemons) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse beat, d->Heartbeat(stub()));
    EXPECT_EQ(beat.lease_ttl_ms(), kLongLeaseMs);
    EXPECT_EQ(beat.state(), v1::DAEMON_STATE_READY);
  }
  // A restarted daemon re-registers with its id and gets a new lease.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::RegisterDaemonResponse again, daemons[1]->Register(stub()));
  EXPECT_EQ(again.daemon_id(), "daemon-2");
  EXPECT_EQ(again.coordinator_id(), "test-coordinator");
  EXPECT_GT(again.heartbeat_interval_ms(), 0);

  v1::HeartbeatRequest stale;
  stale.set_daemon_id("daemon-1");
  stale.set_lease_id("not-the-lease");
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::Heartbeat, stale), StatusIs(absl::StatusCode::kNotFound));

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListDaemonsResponse list, Rpc(stub(), &CoordinatorStub::ListDaemons, {}));
  ASSERT_THAT(list.daemons(), SizeIs(3));
  for (int i = 0; i < 3; ++i) {
    const v1::DaemonInfo& info = list.daemons(i);
    EXPECT_EQ(info.endpoint().daemon_id(), daemons[i]->id());
    EXPECT_EQ(info.endpoint().address(), daemons[i]->address());
    EXPECT_EQ(info.endpoint().node_name(), daemons[i]->node_name());
    EXPECT_EQ(info.state(), v1::DAEMON_STATE_READY);
    EXPECT_GT(info.lease_expires_unix_ms(), 0);
  }
}

TEST_F(CoordinatorTest, JobCreateGetListDeleteDeliversAssignAndDropShard) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d1, AddDaemon("node-a"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d2, AddDaemon("node-b"));

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse created,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("llm", 2))));
  const std::string job_id = created.job_id();
  EXPECT_EQ(created.job().state(), v1::JOB_STATE_READY);
  EXPECT_EQ(created.job().placement_epoch(), 1);
  ASSERT_FALSE(created.job_token().empty());
  std::string token_sha(SHA256_DIGEST_LENGTH, '\0');
  SHA256(reinterpret_cast<const unsigned char*>(created.job_token().data()), created.job_token().size(),
         reinterpret_cast<unsigned char*>(token_sha.data()));

  // Each daemon is told its rank of every bucket, with the layout, placement and token hash.
  for (FakeDaemon* d : {d1, d2}) {
    ASSERT_TRUE(d->WaitFor([&](const FakeDaemon::Received& r) { return !r.assigns.empty(); })) << d->id();
    const v1::AssignShardRequest assign = d->received().assigns.front();
    EXPECT_EQ(assign.job_id(), job_id);
    EXPECT_EQ(assign.placement_epoch(), 1);
    EXPECT_TRUE(assign.has_from_trainer());
    EXPECT_EQ(assign.job_token_sha256(), token_sha);
    EXPECT_EQ(assign.layout().data_parallel_size(), 2);
    EXPECT_EQ(assign.shards_size(), assign.layout().buckets_size());
    for (const v1::ShardPlacement& p : assign.placement().shards()) {
      if (p.daemon_id() == d->id()) {
        EXPECT_EQ(p.shard().shard(), assign.shards(0).shard());
      }
    }
  }
  EXPECT_NE(d1->received().assigns[0].shards(0).shard(), d2->received().assigns[0].shards(0).shard());

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetJobResponse got, Rpc(stub(), &CoordinatorStub::GetJob, WithJobId<v1::GetJobRequest>(job_id)));
  EXPECT_TRUE(MessageDifferencer::Equals(got.job(), created.job())) << got.job().DebugString();
  EXPECT_EQ(got.job().spec().optimizer().type(), "adamw");  // defaults filled in
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetLayoutResponse layout,
                                Rpc(stub(), &CoordinatorStub::GetLayout, WithJobId<v1::GetLayoutRequest>(job_id)));
  EXPECT_TRUE(MessageDifferencer::Equals(layout.layout(), d1->received().assigns[0].layout()));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetPlacementResponse placement,
                                Rpc(stub(), &CoordinatorStub::GetPlacement, WithJobId<v1::GetPlacementRequest>(job_id)));
  EXPECT_EQ(placement.placement().epoch(), 1);
  EXPECT_THAT(placement.placement().daemons(), SizeIs(2));

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse second,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("llm-2", 1))));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListJobsResponse jobs, Rpc(stub(), &CoordinatorStub::ListJobs, {}));
  ASSERT_THAT(jobs.jobs(), SizeIs(2));
  EXPECT_EQ(jobs.jobs(0).job_id(), job_id);
  EXPECT_EQ(jobs.jobs(1).job_id(), second.job_id());

  ASSERT_THAT(Rpc(stub(), &CoordinatorStub::DeleteJob, WithJobId<v1::DeleteJobRequest>(job_id)), IsOk());
  for (FakeDaemon* d : {d1, d2}) {
    EXPECT_TRUE(d->WaitFor([&](const FakeDaemon::Received& r) {
      for (const v1::DropShardRequest& drop : r.drops) {
        if (drop.job_id() == job_id && drop.shards().empty()) return true;  // all of the job's shards
      }
      return false;
    })) << d->id() << " got no DropShard";
  }
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::GetJob, WithJobId<v1::GetJobRequest>(job_id)),
              StatusIs(absl::StatusCode::kNotFound));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(jobs, Rpc(stub(), &CoordinatorStub::ListJobs, {}));
  ASSERT_THAT(jobs.jobs(), SizeIs(1));
  EXPECT_EQ(jobs.jobs(0).job_id(), second.job_id());
}

TEST_F(CoordinatorTest, AssignShardIsRetriedUntilTheDaemonServes) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  const int port = FreePort();
  ASSERT_GT(port, 0);
  FakeDaemon late("n0", kDaemonMemory);
  late.set_address(absl::StrCat("127.0.0.1:", port));
  ASSERT_THAT(late.Register(stub()), IsOk());  // registered, but not serving yet
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse job,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("early", 1))));
  const absl::Time deadline = absl::Now() + kWaitTimeout;
  while (coordinator_->log().find("retrying AssignShard") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_THAT(coordinator_->log(), HasSubstr("retrying AssignShard"));
  ASSERT_THAT(late.Serve(port), IsOk());
  EXPECT_TRUE(late.WaitFor([&](const FakeDaemon::Received& r) {
    return !r.assigns.empty() && r.assigns[0].job_id() == job.job_id();
  })) << "AssignShard never arrived";
}

TEST_F(CoordinatorTest, PlacementPutsRankROnTrainerRsNodeAndBalancesTheRest) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  std::map<std::string, std::string> node_of;  // daemon id -> node
  for (const char* node : {"n0", "n1", "n2", "n3"}) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d, AddDaemon(node));
    node_of[d->id()] = node;
  }
  const std::vector<std::string> trainer_nodes = {"n2", "n0", "n3", "n1"};
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse local,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("local", 4, trainer_nodes))));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetPlacementResponse placement,
                                Rpc(stub(), &CoordinatorStub::GetPlacement, WithJobId<v1::GetPlacementRequest>(local.job_id())));
  for (const v1::ShardPlacement& p : placement.placement().shards()) {
    EXPECT_EQ(node_of[p.daemon_id()], trainer_nodes[p.shard().shard()]) << "rank " << p.shard().shard();
  }

  // Without trainer nodes: spread evenly over equal daemons, on top of what they hold.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse spread,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("spread", 8))));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(placement,
                                Rpc(stub(), &CoordinatorStub::GetPlacement, WithJobId<v1::GetPlacementRequest>(spread.job_id())));
  std::map<std::string, int> ranks = RanksPerDaemon(placement.placement());
  ASSERT_THAT(ranks, SizeIs(4));
  for (const auto& [id, count] : ranks) EXPECT_EQ(count, 2) << id;

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListDaemonsResponse list, Rpc(stub(), &CoordinatorStub::ListDaemons, {}));
  std::set<int> shard_counts;
  for (const v1::DaemonInfo& d : list.daemons()) shard_counts.insert(d.shard_count());
  EXPECT_THAT(shard_counts, SizeIs(1)) << "every daemon holds the same number of shards";
}

TEST_F(CoordinatorTest, JobLargerThanDaemonMemoryIsResourceExhaustedWithTheNumbers) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d1, AddDaemon("n0", 1 << 20));
  ASSERT_THAT(AddDaemon("n1", 1 << 20), IsOk());
  v1::JobSpec spec = SmallSpec("huge", 2);
  spec.mutable_tensors(0)->set_shape(0, 8192);
  spec.mutable_tensors(0)->set_shape(1, 8192);
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(spec)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       ::testing::AllOf(HasSubstr("bytes per rank"), HasSubstr(absl::StrCat(d1->id(), " 1048576")))));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListJobsResponse jobs, Rpc(stub(), &CoordinatorStub::ListJobs, {}));
  EXPECT_THAT(jobs.jobs(), SizeIs(0));
}

TEST_F(CoordinatorTest, DaemonThatStopsHeartbeatingIsDownAfterItsLeaseTtl) {
  ASSERT_THAT(coordinator_->Start({"--tick-ms", "50"}), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * alive, AddDaemon("n0", kDaemonMemory, 3000));
  const absl::Time silent_registered = absl::Now();  // no later than the coordinator granted the lease
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * silent, AddDaemon("n1", kDaemonMemory, 1000));

  std::atomic<bool> stop{false};
  std::atomic<int> beats{0};
  std::thread heartbeats([&] {
    while (!stop) {
      if (alive->Heartbeat(stub()).ok()) ++beats;
      absl::SleepFor(absl::Milliseconds(250));
    }
  });
  auto state_of = [&](const std::string& id) {
    v1::ListDaemonsRequest request;
    request.set_include_down(true);
    absl::StatusOr<v1::ListDaemonsResponse> list = Rpc(stub(), &CoordinatorStub::ListDaemons, request);
    if (list.ok()) {
      for (const v1::DaemonInfo& d : list->daemons()) {
        if (d.endpoint().daemon_id() == id) return d.state();
      }
    }
    return v1::DAEMON_STATE_UNSPECIFIED;
  };
  const absl::Time deadline = absl::Now() + kWaitTimeout;
  while (state_of(silent->id()) != v1::DAEMON_STATE_DOWN && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  const absl::Duration took = absl::Now() - silent_registered;
  // Keep the survivor beating past its own 3 s TTL: renewals, not the first grant, keep it up.
  while (absl::Now() - silent_registered < absl::Seconds(4)) absl::SleepFor(absl::Milliseconds(50));
  const v1::DaemonState alive_state = state_of(alive->id());
  stop = true;
  heartbeats.join();

  EXPECT_EQ(state_of(silent->id()), v1::DAEMON_STATE_DOWN);
  EXPECT_GE(took, absl::Milliseconds(1000)) << "DOWN before the lease ended";
  EXPECT_EQ(alive_state, v1::DAEMON_STATE_READY) << beats << " heartbeat(s)";
  EXPECT_THAT(silent->Heartbeat(stub()), StatusIs(absl::StatusCode::kNotFound));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListDaemonsResponse up, Rpc(stub(), &CoordinatorStub::ListDaemons, {}));
  ASSERT_THAT(up.daemons(), SizeIs(1)) << "DOWN daemons are listed only with include_down";
  // Registering again with its id brings it back.
  ASSERT_THAT(silent->Register(stub()), IsOk());
  EXPECT_EQ(state_of(silent->id()), v1::DAEMON_STATE_READY);
}

TEST_F(CoordinatorTest, KvCompareAndSetTtlWaitAndDelete) {
  ASSERT_THAT(coordinator_->Start({"--tick-ms", "50"}), IsOk());
  auto put = [&](const std::string& key, const std::string& value, std::optional<int64_t> expected = std::nullopt,
                 int64_t ttl_ms = 0) {
    v1::KvPutRequest request;
    request.set_key(key);
    request.set_value(value);
    if (expected) request.set_expected_version(*expected);
    request.set_ttl_ms(ttl_ms);
    return Rpc(stub(), &CoordinatorStub::KvPut, request);
  };
  auto get = [&](const std::string& key, bool prefix = false, int64_t wait_ms = 0) {
    v1::KvGetRequest request;
    request.set_key(key);
    request.set_prefix(prefix);
    request.set_wait_ms(wait_ms);
    return Rpc(stub(), &CoordinatorStub::KvGet, request);
  };

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse first, put("jobs/j/rank0", "addr-0", 0));
  EXPECT_TRUE(first.applied());
  EXPECT_EQ(first.current().version(), 1);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse lost, put("jobs/j/rank0", "other", 0));
  EXPECT_FALSE(lost.applied());
  EXPECT_EQ(lost.current().value(), "addr-0");
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse second, put("jobs/j/rank0", "addr-0b", 1));
  EXPECT_TRUE(second.applied());
  EXPECT_EQ(second.current().version(), 2);
  EXPECT_GT(second.revision(), first.revision());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse stale, put("jobs/j/rank0", "x", 1));
  EXPECT_FALSE(stale.applied());
  ASSERT_THAT(put("jobs/j/rank1", "addr-1"), IsOk());
  ASSERT_THAT(put("jobs/k/rank0", "elsewhere"), IsOk());

  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvGetResponse prefix, get("jobs/j/", true));
  ASSERT_THAT(prefix.entries(), SizeIs(2));
  EXPECT_EQ(prefix.entries(0).key(), "jobs/j/rank0");
  EXPECT_EQ(prefix.entries(0).value(), "addr-0b");
  EXPECT_EQ(prefix.entries(1).key(), "jobs/j/rank1");

  // TTL: the entry is there, then expires on its own.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse leased, put("ttl/key", "v", std::nullopt, 500));
  EXPECT_GT(leased.current().expires_unix_ms(), 0);
  const absl::Time deadline = absl::Now() + kWaitTimeout;
  absl::StatusOr<v1::KvGetResponse> ttl_get = get("ttl/key");
  while (ttl_get.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    ttl_get = get("ttl/key");
  }
  EXPECT_THAT(ttl_get, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_GE(absl::ToUnixMillis(absl::Now()), leased.current().expires_unix_ms());

  // A waiting get returns as soon as the key appears; a missing key is NOT_FOUND after the wait.
  absl::StatusOr<v1::KvGetResponse> waited;
  std::thread waiter([&] { waited = get("late/key", false, 60'000); });
  ASSERT_THAT(put("late/key", "here"), IsOk());
  waiter.join();
  ASSERT_THAT(waited, IsOk());
  EXPECT_EQ(waited->entries(0).value(), "here");
  const absl::Time start = absl::Now();
  EXPECT_THAT(get("never/key", false, 300), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));

  v1::KvDeleteRequest del;
  del.set_key("jobs/j/rank0");
  del.set_expected_version(1);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvDeleteResponse not_deleted, Rpc(stub(), &CoordinatorStub::KvDelete, del));
  EXPECT_EQ(not_deleted.deleted(), 0);
  del.set_key("jobs/");
  del.set_prefix(true);
  del.clear_expected_version();
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvDeleteResponse deleted, Rpc(stub(), &CoordinatorStub::KvDelete, del));
  EXPECT_EQ(deleted.deleted(), 3);

  // KvWatch: the changes under a prefix after a revision, streamed as they happen.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse base, put("w/0", "before"));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
  v1::KvWatchRequest watch_request;
  watch_request.set_key("w/");
  watch_request.set_prefix(true);
  watch_request.set_start_revision(base.current().mod_revision());
  auto watch = stub().KvWatch(&context, watch_request);
  ASSERT_THAT(put("w/1", "one"), IsOk());
  ASSERT_THAT(put("elsewhere", "x"), IsOk());
  ASSERT_THAT(put("w/1", "uno"), IsOk());
  del.set_key("w/1");
  del.set_prefix(false);
  ASSERT_THAT(Rpc(stub(), &CoordinatorStub::KvDelete, del).status(), IsOk());
  std::vector<std::string> seen;
  v1::KvWatchResponse change;
  while (seen.size() < 3 && watch->Read(&change)) {
    seen.push_back(absl::StrCat(v1::KvEventType_Name(change.type()), " ", change.entry().key(), " ",
                                change.entry().value()));
  }
  EXPECT_THAT(seen, ::testing::ElementsAre("KV_EVENT_TYPE_PUT w/1 one", "KV_EVENT_TYPE_PUT w/1 uno",
                                           "KV_EVENT_TYPE_DELETE w/1 "));
  context.TryCancel();
  watch->Finish().ok();
  ::grpc::ClientContext ahead;
  ahead.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
  watch_request.set_start_revision(1'000'000);
  auto refused = stub().KvWatch(&ahead, watch_request);
  EXPECT_FALSE(refused->Read(&change));
  EXPECT_THAT(FromGrpcStatus(refused->Finish()), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ahead")));
}

TEST_F(CoordinatorTest, WatchPlacementStreamsTheNewEpochAfterDrainDaemon) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  std::map<std::string, FakeDaemon*> by_id;
  for (const char* node : {"n0", "n1", "n2"}) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d, AddDaemon(node));
    by_id[d->id()] = d;
  }
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse job,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("watched", 2))));
  PlacementWatch watch(stub(), job.job_id(), 0);
  std::optional<v1::Placement> initial = watch.WaitForEpoch(1);
  ASSERT_TRUE(initial.has_value()) << "no initial placement";
  const std::string drained = initial->shards(0).daemon_id();

  // A watcher that already has the epoch gets nothing until it cancels.
  auto idle = std::make_unique<PlacementWatch>(stub(), job.job_id(), 1);
  idle->Cancel();
  std::optional<absl::Status> idle_end = idle->WaitForEnd();
  ASSERT_TRUE(idle_end.has_value());
  EXPECT_THAT(*idle_end, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(idle->epochs(), SizeIs(0));
  idle.reset();

  v1::DrainDaemonRequest drain;
  drain.set_daemon_id(drained);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::DrainDaemonResponse moves, Rpc(admin(), &AdminStub::DrainDaemon, drain));
  ASSERT_GT(moves.moves_size(), 0);
  const std::string target = moves.moves(0).to_daemon_id();
  EXPECT_NE(target, drained);
  EXPECT_EQ(moves.moves(0).placement_epoch(), 2);

  std::optional<v1::Placement> moved = watch.WaitForEpoch(2);
  ASSERT_TRUE(moved.has_value()) << "no epoch 2 on the stream";
  EXPECT_EQ(moved->epoch(), 2);
  for (const v1::ShardPlacement& p : moved->shards()) EXPECT_NE(p.daemon_id(), drained);
  EXPECT_THAT(watch.epochs(), ElementsAre(1, 2));

  // The target copies the state from the drained daemon, which drops its shards once the
  // target reports the job loaded at epoch 2.
  EXPECT_TRUE(by_id[target]->WaitFor([&](const FakeDaemon::Received& r) {
    for (const v1::AssignShardRequest& a : r.assigns) {
      if (a.placement_epoch() == 2 && a.has_from_peer() && a.from_peer().daemon().daemon_id() == drained) return true;
    }
    return false;
  }));
  v1::JobProgress loaded;
  loaded.set_job_id(job.job_id());
  loaded.set_placement_epoch(2);
  loaded.set_loading(true);
  ASSERT_THAT(by_id[target]->Heartbeat(stub(), {loaded}).status(), IsOk());
  EXPECT_FALSE(by_id[drained]->WaitFor(
      [&](const FakeDaemon::Received& r) { return !r.drops.empty(); }, absl::Milliseconds(300)))
      << "the drained daemon keeps its copy while the target loads it";
  loaded.set_loading(false);
  ASSERT_THAT(by_id[target]->Heartbeat(stub(), {loaded}).status(), IsOk());
  EXPECT_TRUE(by_id[drained]->WaitFor([&](const FakeDaemon::Received& r) {
    return !r.drops.empty() && r.drops.back().placement_epoch() == 2;
  }));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListDaemonsResponse list, Rpc(stub(), &CoordinatorStub::ListDaemons, {}));
  for (const v1::DaemonInfo& d : list.daemons()) {
    if (d.endpoint().daemon_id() == drained) {
      EXPECT_EQ(d.state(), v1::DAEMON_STATE_DRAINING);
    }
  }

  ASSERT_THAT(Rpc(stub(), &CoordinatorStub::DeleteJob, WithJobId<v1::DeleteJobRequest>(job.job_id())), IsOk());
  std::optional<absl::Status> end = watch.WaitForEnd();
  ASSERT_TRUE(end.has_value()) << "stream still open after DeleteJob";
  EXPECT_THAT(*end, StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CoordinatorTest, EveryAcknowledgedWriteSurvivesKill9AndRestart) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d1, AddDaemon("n0"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * d2, AddDaemon("n1"));

  struct AckedJob {
    v1::CreateJobResponse created;
    std::optional<v1::Layout> layout;
  };
  absl::Mutex mu;
  std::map<std::string, v1::KvEntry> acked_kv;  // guarded by mu
  std::vector<AckedJob> acked_jobs;             // guarded by mu
  absl::Status writer_end;
  std::thread writer([&] {
    for (int i = 0;; ++i) {
      v1::KvPutRequest put;
      put.set_key(absl::StrCat("crash/key-", i));
      put.set_value(absl::StrCat("value-", i));
      absl::StatusOr<v1::KvPutResponse> r = Rpc(stub(), &CoordinatorStub::KvPut, put, absl::Seconds(10));
      if (!r.ok()) {
        writer_end = r.status();
        return;
      }
      {
        absl::MutexLock lock(&mu);
        acked_kv[put.key()] = r->current();
      }
      if (i % 4 != 0) continue;
      absl::StatusOr<v1::CreateJobResponse> job =
          Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec(absl::StrCat("crash-job-", i), 2)), absl::Seconds(10));
      if (!job.ok()) {
        writer_end = job.status();
        return;
      }
      AckedJob acked{*job, std::nullopt};
      absl::StatusOr<v1::GetLayoutResponse> layout =
          Rpc(stub(), &CoordinatorStub::GetLayout, WithJobId<v1::GetLayoutRequest>(job->job_id()), absl::Seconds(10));
      if (layout.ok()) acked.layout = layout->layout();
      absl::MutexLock lock(&mu);
      acked_jobs.push_back(acked);
    }
  });
  {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return acked_kv.size() >= 40 && acked_jobs.size() >= 4; };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&enough), absl::Minutes(2)));
  }
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int killed, coordinator_->Stop(SIGKILL));  // in the middle of the writes
  EXPECT_TRUE(WIFSIGNALED(killed)) << DescribeWaitStatus(killed);
  writer.join();
  EXPECT_FALSE(writer_end.ok());

  ASSERT_THAT(coordinator_->Start(), IsOk());
  absl::MutexLock lock(&mu);
  for (const auto& [key, entry] : acked_kv) {
    v1::KvGetRequest get;
    get.set_key(key);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvGetResponse found, Rpc(stub(), &CoordinatorStub::KvGet, get));
    ASSERT_THAT(found.entries(), SizeIs(1));
    EXPECT_TRUE(MessageDifferencer::Equals(found.entries(0), entry)) << found.entries(0).DebugString();
  }
  for (const AckedJob& acked : acked_jobs) {
    const std::string& job_id = acked.created.job_id();
    MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetJobResponse job, Rpc(stub(), &CoordinatorStub::GetJob, WithJobId<v1::GetJobRequest>(job_id)));
    EXPECT_TRUE(MessageDifferencer::Equals(job.job(), acked.created.job())) << job.job().DebugString();
    MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetPlacementResponse placement,
                                  Rpc(stub(), &CoordinatorStub::GetPlacement, WithJobId<v1::GetPlacementRequest>(job_id)));
    EXPECT_EQ(placement.placement().epoch(), acked.created.job().placement_epoch());
    EXPECT_THAT(placement.placement().shards(), SizeIs(2 * acked.created.job().num_buckets()));
    if (acked.layout) {
      MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::GetLayoutResponse layout,
                                    Rpc(stub(), &CoordinatorStub::GetLayout, WithJobId<v1::GetLayoutRequest>(job_id)));
      EXPECT_TRUE(MessageDifferencer::Equals(layout.layout(), *acked.layout));
    }
  }
  v1::ListDaemonsRequest all;
  all.set_include_down(true);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListDaemonsResponse daemons, Rpc(stub(), &CoordinatorStub::ListDaemons, all));
  ASSERT_THAT(daemons.daemons(), SizeIs(2));
  EXPECT_EQ(daemons.daemons(0).endpoint().daemon_id(), d1->id());
  EXPECT_EQ(daemons.daemons(0).endpoint().address(), d1->address());
  EXPECT_EQ(daemons.daemons(1).endpoint().daemon_id(), d2->id());
}

TEST_F(CoordinatorTest, HealthServiceAnswersServing) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  auto health = ::grpc::health::v1::Health::NewStub(coordinator_->channel());
  for (const char* service : {"", "mainstay.v1.Coordinator", "mainstay.v1.Admin"}) {
    ::grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(::grpc::health::v1::HealthCheckResponse response,
                                  Rpc(*health, &::grpc::health::v1::Health::Stub::Check, request));
    EXPECT_EQ(response.status(), ::grpc::health::v1::HealthCheckResponse::SERVING) << "'" << service << "'";
  }
  ::grpc::health::v1::HealthCheckRequest unknown;
  unknown.set_service("no.such.Service");
  EXPECT_THAT(Rpc(*health, &::grpc::health::v1::Health::Stub::Check, unknown), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CoordinatorTest, BadInputGetsTheRightCodeAndChangesNothing) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(FakeDaemon * daemon, AddDaemon("n0"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse good,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("good", 1))));
  ASSERT_THAT(Rpc(stub(), &CoordinatorStub::KvPut, [] {
                v1::KvPutRequest r;
                r.set_key("kept");
                return r;
              }()),
              IsOk());

  v1::JobSpec zero_dim = SmallSpec("bad-shape", 1);
  zero_dim.mutable_tensors(0)->set_shape(0, 0);
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(zero_dim)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.tensors[0].shape[0]")));
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("bad-dp", 0))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data_parallel_size")));
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("good", 1))),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr(good.job_id())));

  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::GetJob, WithJobId<v1::GetJobRequest>("job-999")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-999")));
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::DeleteJob, WithJobId<v1::DeleteJobRequest>("job-999")),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::GetLayout, WithJobId<v1::GetLayoutRequest>("job-999")),
              StatusIs(absl::StatusCode::kNotFound));
  {
    PlacementWatch watch(stub(), "job-999", 0);
    std::optional<absl::Status> end = watch.WaitForEnd();
    ASSERT_TRUE(end.has_value());
    EXPECT_THAT(*end, StatusIs(absl::StatusCode::kNotFound));
  }
  v1::CordonDaemonRequest cordon;
  cordon.set_daemon_id("daemon-999");
  EXPECT_THAT(Rpc(admin(), &AdminStub::CordonDaemon, cordon), StatusIs(absl::StatusCode::kNotFound, HasSubstr("daemon-999")));
  v1::DrainDaemonRequest drain;
  drain.set_daemon_id("daemon-999");
  EXPECT_THAT(Rpc(admin(), &AdminStub::DrainDaemon, drain), StatusIs(absl::StatusCode::kNotFound));
  v1::RegisterDaemonRequest no_port;
  no_port.set_address("localhost");
  EXPECT_THAT(Rpc(stub(), &CoordinatorStub::RegisterDaemon, no_port),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("address")));

  auto put = [&](std::string key, std::string value) {
    v1::KvPutRequest request;
    request.set_key(std::move(key));
    request.set_value(std::move(value));
    return Rpc(stub(), &CoordinatorStub::KvPut, request);
  };
  EXPECT_THAT(put("", "v"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  EXPECT_THAT(put(std::string(2000, 'k'), "v"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  EXPECT_THAT(put("big", std::string((1 << 20) + 1, 'v')), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("value")));
  // Beyond the 64 MiB message limit gRPC itself refuses the request.
  EXPECT_THAT(put("huge", std::string((64 << 20) + 1024, 'v')), StatusIs(absl::StatusCode::kResourceExhausted));

  v1::CreateCheckpointRequest checkpoint;
  checkpoint.set_job_id(good.job_id());
  // This coordinator runs without --checkpoint-dir.
  EXPECT_THAT(Rpc(admin(), &AdminStub::CreateCheckpoint, checkpoint),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--checkpoint-dir")));
  v1::RestoreCheckpointRequest restore;
  restore.set_checkpoint_id("../etc");
  EXPECT_THAT(Rpc(admin(), &AdminStub::RestoreCheckpoint, restore), StatusIs(absl::StatusCode::kFailedPrecondition));

  // Nothing changed.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListJobsResponse jobs, Rpc(stub(), &CoordinatorStub::ListJobs, {}));
  ASSERT_THAT(jobs.jobs(), SizeIs(1));
  EXPECT_EQ(jobs.jobs(0).job_id(), good.job_id());
  v1::KvGetRequest everything;
  everything.set_prefix(true);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvGetResponse kv, Rpc(stub(), &CoordinatorStub::KvGet, everything));
  ASSERT_THAT(kv.entries(), SizeIs(1));
  EXPECT_EQ(kv.entries(0).key(), "kept");
  v1::ListDaemonsRequest all;
  all.set_include_down(true);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::ListDaemonsResponse daemons, Rpc(stub(), &CoordinatorStub::ListDaemons, all));
  ASSERT_THAT(daemons.daemons(), SizeIs(1));
  EXPECT_EQ(daemons.daemons(0).endpoint().daemon_id(), daemon->id());
  EXPECT_EQ(daemons.daemons(0).state(), v1::DAEMON_STATE_READY);
}

TEST_F(CoordinatorTest, SigtermEndsWaitingCallsAndExitsZero) {
  ASSERT_THAT(coordinator_->Start(), IsOk());
  ASSERT_THAT(AddDaemon("n0"), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CreateJobResponse job,
                                Rpc(stub(), &CoordinatorStub::CreateJob, CreateRequest(SmallSpec("job", 1))));
  PlacementWatch watch(stub(), job.job_id(), 0);
  ASSERT_TRUE(watch.WaitForEpoch(1).has_value());  // the stream is up and now waits for epoch 2
  absl::StatusOr<v1::KvGetResponse> waited;
  std::thread waiter([&] {
    v1::KvGetRequest get;
    get.set_key("never");
    get.set_wait_ms(600'000);
    waited = Rpc(stub(), &CoordinatorStub::KvGet, get, absl::Minutes(10));
  });
  // A waiting call is answered UNAVAILABLE. (One that reaches the server in the last moments of
  // its gRPC shutdown is cancelled by gRPC itself: CANCELLED, which the client library retries
  // as it does UNAVAILABLE. So the KvGet must be waiting before the signal.)
  absl::SleepFor(absl::Seconds(1));
  const absl::Time start = absl::Now();
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int ended, coordinator_->Stop(SIGTERM));
  EXPECT_TRUE(WIFEXITED(ended) && WEXITSTATUS(ended) == 0) << DescribeWaitStatus(ended);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  waiter.join();
  EXPECT_THAT(waited, StatusIs(absl::StatusCode::kUnavailable));
  std::optional<absl::Status> end = watch.WaitForEnd();
  ASSERT_TRUE(end.has_value());
  EXPECT_THAT(*end, StatusIs(absl::StatusCode::kUnavailable));
}

// ---- Flags and config (no server needed for most).

class CoordinatorFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override { MAINSTAY_ASSERT_OK_AND_ASSIGN(dir_, TempDir::Create("coordinator-flags")); }
  // Runs the binary to its end; returns the wait status.
  absl::StatusOr<int> Run(std::vector<std::string> args) {
    args.insert(args.begin(), MAINSTAY_COORDINATOR_BIN);
    absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start({args, dir_->File("out.log")});
    if (!process.ok()) return process.status();
    return (*process)->Wait(kWaitTimeout);
  }
  std::string WriteConfig(const std::string& json) {
    const std::string path = dir_->File("config.json");
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(json.c_str(), f);
    std::fclose(f);
    return path;
  }
  std::unique_ptr<TempDir> dir_;
};

TEST_F(CoordinatorFlagsTest, BadFlagsAndConfigExitWithCode2) {
  const std::string state = dir_->File("state");
  const std::vector<std::vector<std::string>> bad = {
      {"--no-such-flag"},
      {"--listen", "127.0.0.1:0"},  // no state dir
      {"--state-dir", state, "--lease-ttl-ms", "soon"},
      {"--state-dir", state, "--lease-ttl-ms", "10"},  // below the 500 ms minimum
      {"--state-dir", state, "--listen", "no-port"},
      {"--config", dir_->File("missing.json")},
      {"--config", WriteConfig(R"({"state_dir": "x", "lease_tll_ms": 5})")},
  };
  for (const std::vector<std::string>& args : bad) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(int status, Run(args));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << args[0] << " " << DescribeWaitStatus(status);
  }
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("out.log")), HasSubstr("lease_tll_ms: unknown key"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int help, Run({"--help"}));
  EXPECT_TRUE(WIFEXITED(help) && WEXITSTATUS(help) == 0);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("out.log")), HasSubstr("--port-file"));
}

TEST_F(CoordinatorFlagsTest, ConfigFileSuppliesSettingsAndFlagsOverrideIt) {
  const std::string config = WriteConfig(absl::StrCat(R"({"listen": "127.0.0.1:1", "state_dir": ")", dir_->File("state"),
                                                      R"(", "lease_ttl_ms": 700, "tick_ms": 100, "coordinator_id": "from-config"})"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(
      auto process, Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--config", config, "--listen", "127.0.0.1:0",
                                        "--lease-ttl-ms", "900", "--port-file", dir_->File("port")},
                                       dir_->File("out.log")}));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int port, testing::WaitForPortFile(dir_->File("port"), *process, kWaitTimeout));
  auto stub = v1::Coordinator::NewStub(
      ::grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), ::grpc::InsecureChannelCredentials()));
  v1::RegisterDaemonRequest request;
  request.set_address("127.0.0.1:1");
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::RegisterDaemonResponse registered, Rpc(*stub, &CoordinatorStub::RegisterDaemon, request));
  EXPECT_EQ(registered.lease_ttl_ms(), 900);  // the flag beat the file
  EXPECT_EQ(registered.coordinator_id(), "from-config");
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("out.log")),
              HasSubstr(absl::StrCat("mainstay-coordinator listening on 127.0.0.1:", port)));
  ASSERT_THAT(process->Signal(SIGINT), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int ended, process->Wait(kWaitTimeout));
  EXPECT_TRUE(WIFEXITED(ended) && WEXITSTATUS(ended) == 0) << DescribeWaitStatus(ended);
}

}  // namespace
}  // namespace mainstay

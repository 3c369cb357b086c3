// A hostile client against the real binaries in their default, certificate-free setup
// (issue "closed by default"; docs/operations.md, "Threat model"): a mainstay-coordinator and a
// mainstayd on loopback sharing a cluster secret file that the coordinator made on its first
// start. A client holding no secret, or a wrong one, calls every internal-only RPC with raw
// gRPC stubs: each is PERMISSION_DENIED naming --cluster-secret-file, nothing of the victim
// job is read, stored or dropped, and the victim still trains. Also the start-up rule: with
// neither a secret nor --tls-internal-name, a non-loopback listener is refused (exit 2) unless
// --insecure, which starts with a warning; a missing or short secret file is exit 2. And an
// insider holding the secret cannot register as the victim's daemon id or at its address.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/grpc_tls.h"
#include "common/job_spec.h"
#include "mainstay/client.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;

constexpr absl::Duration kStartTimeout = absl::Seconds(120);
constexpr absl::Duration kCallTimeout = absl::Seconds(20);

// A context for a call presenting `secret` as the cluster secret (none when empty).
std::unique_ptr<::grpc::ClientContext> Context(const std::string& secret) {
  auto context = std::make_unique<::grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
  if (!secret.empty()) context->AddMetadata(kClusterSecretMetadata, secret);
  return context;
}

template <typename Stub, typename Request, typename Response>
absl::Status Call(Stub& stub, ::grpc::Status (Stub::*method)(::grpc::ClientContext*, const Request&, Response*),
                  const Request& request, const std::string& secret) {
  Response response;
  return FromGrpcStatus((stub.*method)(Context(secret).get(), request, &response));
}

class HostileClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = TempDir::Create("mainstay-hostile").value().release();
    std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                     dir_->File("state"), "--port-file", dir_->File("cport"), "--metrics-listen",
                                     "off", "--cluster-secret-file", dir_->File("cluster.secret")};
    auto coordinator = Subprocess::Start({argv, dir_->File("coordinator.log")});
    ASSERT_THAT(coordinator.status(), IsOk());
    coordinator_ = coordinator->release();
    absl::StatusOr<int> cport = testing::WaitForPortFile(dir_->File("cport"), *coordinator_, kStartTimeout);
    ASSERT_THAT(cport.status(), IsOk()) << Logs();
    address_ = new std::string(absl::StrCat("127.0.0.1:", *cport));
    argv = {MAINSTAYD_BIN, "--coordinator", *address_, "--listen", "127.0.0.1:0", "--node-name", "node0",
            "--threads", "1", "--memory-bytes", "4000000000", "--port-file", dir_->File("dport"),
            "--metrics-listen", "off", "--cluster-secret-file", dir_->File("cluster.secret")};
    auto daemon = Subprocess::Start({argv, dir_->File("daemon.log")});
    ASSERT_THAT(daemon.status(), IsOk());
    daemon_ = daemon->release();
    absl::StatusOr<int> dport = testing::WaitForPortFile(dir_->File("dport"), *daemon_, kStartTimeout);
    ASSERT_THAT(dport.status(), IsOk()) << Logs();
    daemon_address_ = new std::string(absl::StrCat("127.0.0.1:", *dport));
  }

  static void TearDownTestSuite() {
    delete daemon_;
    delete coordinator_;
    delete address_;
    delete daemon_address_;
    delete dir_;
    daemon_ = coordinator_ = nullptr;
    address_ = daemon_address_ = nullptr;
    dir_ = nullptr;
  }

  void SetUp() override { ASSERT_NE(daemon_address_, nullptr) << "the cluster did not start\n" << Logs(); }

  static std::string Secret() {
    std::string s = ReadFileOrEmpty(dir_->File("cluster.secret"));
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
  }

  // A job (D = 1) through the client library, which holds no secret, with its initial params.
  static std::unique_ptr<Client> CreateJob(const std::string& name) {
    JobSpec spec;
    spec.name = name;
    spec.recipe = "bf16_mixed";
    spec.data_parallel_size = 1;
    spec.bucket_numel = 16384;
    spec.tensors = testing::TestTensors();
    ClientOptions options;
    options.coordinator = *address_;
    options.job_spec_json = JobSpecToJson(spec);
    options.timeout = std::chrono::seconds(60);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    EXPECT_THAT(client.status(), IsOk()) << Logs();
    if (!client.ok()) return nullptr;
    for (const Bucket& b : (*client)->layout().buckets) {
      std::vector<float> params(static_cast<size_t>(b.numel), 0.25f);
      EXPECT_THAT((*client)->PushInitialParams(b.index, params, true).Wait().status(), IsOk()) << Logs();
    }
    return *std::move(client);
  }

  // Pushes `step` and finishes it: the job still trains.
  static void Step(Client& client, int64_t step) {
    std::vector<std::vector<float>> grads;
    for (const Bucket& b : client.layout().buckets) grads.emplace_back(b.shard_numel, 0.5f);
    for (const Bucket& b : client.layout().buckets) {
      client.PushGrad(b.index, step, ElementSpan::Fp32(std::span<float>(grads[static_cast<size_t>(b.index)])));
    }
    absl::StatusOr<StepStats> stats = client.FinishStep(step, 1e-3, 0.0);
    ASSERT_THAT(stats.status(), IsOk()) << Logs();
    EXPECT_EQ(stats->version, step + 1);
  }

  static std::string Logs() {
    if (dir_ == nullptr) return "";
    return absl::StrCat("--- coordinator\n", ReadFileOrEmpty(dir_->File("coordinator.log")), "--- daemon\n",
                        ReadFileOrEmpty(dir_->File("daemon.log")));
  }

  static TempDir* dir_;
  static Subprocess* coordinator_;
  static Subprocess* daemon_;
  static std::string* address_;
  static std::string* daemon_address_;
};
TempDir* HostileClientTest::dir_ = nullptr;
Subprocess* HostileClientTest::coordinator_ = nullptr;
Subprocess* HostileClientTest::daemon_ = nullptr;
std::string* HostileClientTest::address_ = nullptr;
std::string* HostileClientTest::daemon_address_ = nullptr;

TEST_F(HostileClientTest, TheCoordinatorMadeAPrivateSecretAndTheDaemonUsesIt) {
  struct stat st;
  ASSERT_EQ(::stat(dir_->File("cluster.secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(Secret().size(), 64u);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("coordinator.log")), HasSubstr("internal calls need the cluster secret"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), HasSubstr("internal calls need the cluster secret"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), HasSubstr("registered with coordinator"));
}

TEST_F(HostileClientTest, InternalCallsWithoutTheSecretAreRefusedAndTheVictimTrains) {
  std::unique_ptr<Client> victim = CreateJob("victim");
  ASSERT_NE(victim, nullptr);
  Step(*victim, 0);
  const std::string job = victim->job_id();
  const int64_t epoch = victim->placement().epoch;
  auto coordinator = v1::Coordinator::NewStub(::grpc::CreateChannel(*address_, ::grpc::InsecureChannelCredentials()));
  auto shard = v1::Shard::NewStub(::grpc::CreateChannel(*daemon_address_, ::grpc::InsecureChannelCredentials()));
  using CoordinatorStub = v1::Coordinator::Stub;
  using ShardStub = v1::Shard::Stub;
  const std::string wrong(64, 'a');

  for (const std::string& secret : {std::string(), wrong, Secret().substr(0, 63)}) {
    SCOPED_TRACE(secret.empty() ? "no secret" : "a wrong secret");
    const auto denied = StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("--cluster-secret-file"));
    // The coordinator's daemon-only calls.
    v1::RegisterDaemonRequest reg;
    reg.set_address("127.0.0.1:1");
    reg.set_node_name("intruder");
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::RegisterDaemon, reg, secret), denied);
    v1::HeartbeatRequest beat;
    beat.set_daemon_id("daemon-1");
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::Heartbeat, beat, secret), denied);
    v1::DeregisterDaemonRequest dereg;
    dereg.set_daemon_id("daemon-1");
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::DeregisterDaemon, dereg, secret), denied);
    v1::KvPutRequest put;
    put.set_key("mainstay/peer/x");
    put.set_value("forged");
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::KvPut, put, secret), denied);
    v1::KvGetRequest get;
    get.set_key("mainstay/");
    get.set_prefix(true);
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::KvGet, get, secret), denied);
    v1::KvDeleteRequest del;
    del.set_key("mainstay/");
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::KvDelete, del, secret), denied);
    // The daemon's internal-only calls.
    v1::AssignShardRequest assign;
    assign.set_job_id(job);
    EXPECT_THAT(Call(*shard, &ShardStub::AssignShard, assign, secret), denied);
    v1::DropShardRequest drop;
    drop.set_job_id(job);
    drop.set_placement_epoch(epoch + 1);
    EXPECT_THAT(Call(*shard, &ShardStub::DropShard, drop, secret), denied);
    v1::GetStepOutcomeRequest outcome;
    outcome.set_job_id(job);
    outcome.set_step(0);
    EXPECT_THAT(Call(*shard, &ShardStub::GetStepOutcome, outcome, secret), denied);
    v1::WriteCheckpointRequest checkpoint;
    checkpoint.set_job_id(job);
    checkpoint.set_placement_epoch(epoch);
    checkpoint.set_checkpoint_id("stolen");
    checkpoint.set_directory_uri(dir_->File("stolen"));
    EXPECT_THAT(Call(*shard, &ShardStub::WriteCheckpoint, checkpoint, secret), denied);
    {
      auto context = Context(secret);
      v1::FetchShardStateRequest fetch;
      fetch.set_job_id(job);
      auto reader = shard->FetchShardState(context.get(), fetch);
      v1::FetchShardStateResponse message;
      EXPECT_FALSE(reader->Read(&message)) << "a byte of the victim's optimizer state streamed";
      EXPECT_THAT(FromGrpcStatus(reader->Finish()), denied);
    }
    {
      auto context = Context(secret);
      v1::ForwardStepInputResponse response;
      auto writer = shard->ForwardStepInput(context.get(), &response);
      v1::ForwardStepInputRequest request;
      v1::ReplicaInputHeader& h = *request.mutable_header();
      h.set_job_id(job);
      h.set_placement_epoch(epoch);
      h.set_step(1);
      writer->Write(request);
      writer->WritesDone();
      EXPECT_THAT(FromGrpcStatus(writer->Finish()), denied);
    }
  }
  struct stat st;
  EXPECT_NE(::stat(dir_->File("stolen").c_str(), &st), 0) << "a checkpoint was written for the intruder";

  // An insider (any holder of the secret: every daemon) still cannot take the victim's daemon
  // over: its id is bound to the key its own registration got, and its address to it.
  {
    v1::RegisterDaemonRequest claim;
    claim.set_daemon_id("daemon-1");
    claim.set_address("127.0.0.1:1");
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::RegisterDaemon, claim, Secret()),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("presents no daemon key")));
    v1::RegisterDaemonRequest squat;
    squat.set_address(*daemon_address_);
    EXPECT_THAT(Call(*coordinator, &CoordinatorStub::RegisterDaemon, squat, Secret()),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("whose lease is live")));
  }

  // The same calls with the secret reach their handlers: the state copy streams.
  {
    auto context = Context(Secret());
    v1::FetchShardStateRequest fetch;
    fetch.set_job_id(job);
    auto reader = shard->FetchShardState(context.get(), fetch);
    v1::FetchShardStateResponse message;
    EXPECT_TRUE(reader->Read(&message));
    while (reader->Read(&message)) {
    }
    EXPECT_THAT(FromGrpcStatus(reader->Finish()), IsOk());
  }
  // mainstayctl's `kv get` (the KV is the daemons'): refused without the secret (exit 6),
  // served with it.
  v1::KvPutRequest put;
  put.set_key("hostile-test/key");
  put.set_value("written-with-the-secret");
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::KvPut, put, Secret()), IsOk());
  const std::string ctl = absl::StrCat(MAINSTAY_CTL_BIN, " kv get hostile-test/key --coordinator ", *address_);
  int status = std::system(absl::StrCat(ctl, " > ", dir_->File("kv-denied.out"), " 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 6) << ReadFileOrEmpty(dir_->File("kv-denied.out"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("kv-denied.out")), HasSubstr("PERMISSION_DENIED"));
  status = std::system(absl::StrCat(ctl, " --cluster-secret-file ", dir_->File("cluster.secret"), " > ",
                                    dir_->File("kv.out"), " 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ReadFileOrEmpty(dir_->File("kv.out"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("kv.out")), HasSubstr("written-with-the-secret"));
  // The victim lost nothing: the daemon still holds it (no drop), and it trains on.
  Step(*victim, 1);
  // The secret never appears in either server's log.
  EXPECT_FALSE(absl::StrContains(Logs(), Secret()));
}

// One PullParams read on gRPC's callback API (no thread of the test's per call).
class WaitingPull final : public ::grpc::ClientReadReactor<v1::PullParamsResponse> {
 public:
  WaitingPull(v1::Shard::Stub* stub, const v1::PullParamsRequest& request) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    stub->async()->PullParams(&context_, &request, this);
    StartRead(&message_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (message_.has_data()) bytes_ += static_cast<int64_t>(message_.data().data().size());
    StartRead(&message_);
  }
  void OnDone(const ::grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = FromGrpcStatus(status);
    done_ = true;
  }
  // Waits for the call's end.
  absl::Status Wait(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithDeadline(absl::Condition(&done_), deadline)) return absl::DeadlineExceededError("still waiting");
    return status_;
  }
  bool done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  int64_t bytes() const { return bytes_; }
  void Cancel() { context_.TryCancel(); }

 private:
  ::grpc::ClientContext context_;
  v1::PullParamsResponse message_;
  int64_t bytes_ = 0;  // data bytes received (read after done)
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// The daemon's thread count, from /proc.
int Threads(pid_t pid) {
  const std::string status = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/status"));
  const size_t at = status.find("Threads:");
  return at == std::string::npos ? -1 : std::atoi(status.c_str() + at + 8);
}

// Waiting calls hold no thread (docs/operations.md, "Threat model"): 5,000 PullParams of a
// version not yet published, with the job's valid token, wait at once; the daemon's thread count
// stays within the documented bound (its threads before them plus 16), another job steps
// meanwhile, and once the first job steps every one of them gets the new version.
TEST_F(HostileClientTest, FiveThousandWaitingPullsHoldNoThreadsAndAnotherJobTrains) {
  constexpr int kPulls = 5000;
  constexpr int kChannels = 10;
  std::unique_ptr<Client> waited = CreateJob("waited-on");
  std::unique_ptr<Client> other = CreateJob("trains-meanwhile");
  ASSERT_NE(waited, nullptr);
  ASSERT_NE(other, nullptr);
  Step(*waited, 0);
  Step(*other, 0);
  const int before = Threads(daemon_->pid());
  ASSERT_GT(before, 0);
  std::vector<std::unique_ptr<v1::Shard::Stub>> stubs;
  for (int i = 0; i < kChannels; ++i) {
    ::grpc::ChannelArguments args;
    args.SetInt("mainstay.test.channel", i);  // a connection of its own
    stubs.push_back(v1::Shard::NewStub(
        ::grpc::CreateCustomChannel(*daemon_address_, ::grpc::InsecureChannelCredentials(), args)));
  }
  v1::PullParamsRequest request;
  request.set_job_id(waited->job_id());
  request.set_job_token(waited->job_token());
  request.set_placement_epoch(waited->placement().epoch);
  request.set_bucket(0);
  request.set_shard(0);
  request.set_version(2);  // step 1's: not run yet
  std::vector<std::unique_ptr<WaitingPull>> pulls;
  for (int i = 0; i < kPulls; ++i) pulls.push_back(std::make_unique<WaitingPull>(stubs[i % kChannels].get(), request));
  // All of them reach the daemon and wait (none is answered: the version does not exist yet).
  absl::SleepFor(absl::Seconds(3));
  int answered = 0;
  for (auto& p : pulls) answered += p->done();
  EXPECT_EQ(answered, 0) << "pulls were answered before their version existed";
  const int waiting_threads = Threads(daemon_->pid());
  EXPECT_LE(waiting_threads, before + 16) << "threads before the pulls: " << before;
  RecordProperty("threads_before", before);
  RecordProperty("threads_waiting", waiting_threads);
  // Another job trains meanwhile, and so does the daemon's own heartbeat.
  Step(*other, 1);
  Step(*other, 2);
  EXPECT_TRUE(daemon_->Running());
  // The version comes: every waiting pull gets it, whole.
  Step(*waited, 1);
  const int64_t expected = waited->layout().buckets[0].shard_numel * 2;  // bf16
  int ok = 0;
  for (auto& p : pulls) {
    absl::Status s = p->Wait(absl::Now() + absl::Seconds(60));
    if (s.ok() && p->bytes() == expected) ++ok;
  }
  EXPECT_EQ(ok, kPulls);
  EXPECT_LE(Threads(daemon_->pid()), before + 16);
}

// The start-up rule, for each binary: exit 2 naming the fix, or the warning with --insecure.
class ListenerRuleTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = TempDir::Create("mainstay-listener").value(); }

  // Runs the binary until it exits or `up_file` appears; returns its exit code (-1: it is
  // serving, and was stopped).
  int Run(std::vector<std::string> argv, const std::string& log, const std::string& up_file) {
    auto child = Subprocess::Start({argv, dir_->File(log)});
    EXPECT_THAT(child.status(), IsOk());
    if (!child.ok()) return -2;
    const absl::Time end = absl::Now() + kStartTimeout;
    while (absl::Now() < end) {
      if (!(*child)->Running()) {
        absl::StatusOr<int> status = (*child)->Wait(absl::Seconds(1));
        return status.ok() && WIFEXITED(*status) ? WEXITSTATUS(*status) : -3;
      }
      struct stat st;
      if (!up_file.empty() && ::stat(up_file.c_str(), &st) == 0) return -1;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -4;
  }

  std::unique_ptr<TempDir> dir_;
};

TEST_F(ListenerRuleTest, ACoordinatorWithoutSecretRefusesAPublicListenerUnlessInsecure) {
  std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "0.0.0.0:0", "--state-dir",
                                   dir_->File("state"), "--port-file", dir_->File("port"), "--metrics-listen", "off"};
  EXPECT_EQ(Run(argv, "refused.log", dir_->File("port")), 2);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("refused.log")),
              HasSubstr("refusing to listen on 0.0.0.0:0 with its internal calls"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("refused.log")), HasSubstr("--cluster-secret-file"));
  argv.push_back("--insecure");
  EXPECT_EQ(Run(argv, "insecure.log", dir_->File("port")), -1);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("insecure.log")), HasSubstr("INSECURE: mainstay-coordinator on 0.0.0.0:0"));
}

TEST_F(ListenerRuleTest, ADaemonWithoutSecretRefusesAPublicListenerUnlessInsecure) {
  // Its coordinator: loopback, no secret (allowed, with the warning).
  auto coordinator = Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                         dir_->File("state"), "--port-file", dir_->File("cport"),
                                         "--metrics-listen", "off"},
                                        dir_->File("coordinator.log")});
  ASSERT_THAT(coordinator.status(), IsOk());
  absl::StatusOr<int> cport = testing::WaitForPortFile(dir_->File("cport"), **coordinator, kStartTimeout);
  ASSERT_THAT(cport.status(), IsOk());
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("coordinator.log")), HasSubstr("(loopback only)"));
  std::vector<std::string> argv = {MAINSTAYD_BIN, "--coordinator", absl::StrCat("127.0.0.1:", *cport), "--listen",
                                   "0.0.0.0:0", "--advertise", "127.0.0.1", "--threads", "1", "--metrics-listen",
                                   "off", "--port-file", dir_->File("dport")};
  EXPECT_EQ(Run(argv, "refused.log", dir_->File("dport")), 2);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("refused.log")), HasSubstr("refusing to listen on 0.0.0.0:0"));
  argv.push_back("--insecure");
  EXPECT_EQ(Run(argv, "insecure.log", dir_->File("dport")), -1);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("insecure.log")), HasSubstr("INSECURE: mainstayd on 0.0.0.0:0"));
}

TEST_F(ListenerRuleTest, AMissingOrShortSecretFileIsExit2NamingItAndNeverShowingIt) {
  // A daemon does not make the secret (only the coordinator and a standalone daemon do).
  std::vector<std::string> argv = {MAINSTAYD_BIN, "--coordinator", "127.0.0.1:1", "--listen", "127.0.0.1:0",
                                   "--metrics-listen", "off", "--cluster-secret-file", dir_->File("missing.secret")};
  EXPECT_EQ(Run(argv, "missing.log", ""), 2);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("missing.log")),
              HasSubstr(absl::StrCat("cluster secret file ", dir_->File("missing.secret"), ": cannot read")));
  std::FILE* f = std::fopen(dir_->File("short.secret").c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("tooshortsecret\n", f);
  std::fclose(f);
  argv.back() = dir_->File("short.secret");
  EXPECT_EQ(Run(argv, "short.log", ""), 2);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("short.log")), HasSubstr("at least 32 are needed"));
  EXPECT_FALSE(absl::StrContains(ReadFileOrEmpty(dir_->File("short.log")), "tooshortsecret"));
  argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir", dir_->File("state"),
          "--metrics-listen", "off", "--cluster-secret-file", dir_->File("short.secret")};
  EXPECT_EQ(Run(argv, "coordinator-short.log", ""), 2);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("coordinator-short.log")), HasSubstr("at least 32 are needed"));
}

}  // namespace
}  // namespace mainstay

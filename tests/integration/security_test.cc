// Security end to end (DESIGN.md section 8) with the real binaries on loopback: a
// mainstay-coordinator and a mainstayd serving mutual TLS with an admin token, certificates
// made by `openssl` at test time (a CA, a certificate for localhost / 127.0.0.1 that the
// servers present and use as their client certificate, which also names the cluster's internal
// peer name, a trainer's client certificate, and a second CA with a client certificate of its
// own). Trainers go through the client library,
// operators through the mainstayctl binary, and raw gRPC stubs probe what must be refused.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/grpc_tls.h"
#include "common/job_spec.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mainstay/client.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "tests/testing/etcd_server.h"
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
using ::testing::Not;

constexpr absl::Duration kStartTimeout = absl::Seconds(120);
constexpr absl::Duration kCallTimeout = absl::Seconds(20);

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) absl::StrAppend(&out, absl::Hex(rd() & 0xff, absl::kZeroPad2));
  return out;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

// Runs a shell command; the failure message has its output.
void Shell(const std::string& command, const std::string& log) {
  const int status = std::system(absl::StrCat("(", command, ") >>", log, " 2>&1").c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << "\n" << ReadFileOrEmpty(log);
}

// A CA (NAME-ca.pem / .key) with P-256 keys, valid for a day.
void MakeCa(const TempDir& dir, const std::string& name) {
  Shell(absl::StrCat("cd ", dir.path(), " && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes",
                     " -keyout ", name, "-ca.key -out ", name, "-ca.pem -days 1 -subj '/CN=", name, " test CA'",
                     " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign"),
        dir.File("openssl.log"));
}

constexpr char kInternalName[] = "mainstay-internal";  // --tls-internal-name
constexpr char kServerSans[] = "DNS:localhost,IP:127.0.0.1,DNS:mainstay-internal";

// NAME.pem / NAME.key signed by CA-ca, for servers and clients, with these SANs.
void MakeCert(const TempDir& dir, const std::string& ca, const std::string& name, const std::string& sans = kServerSans) {
  WriteFile(dir.File(name + ".ext"),
            absl::StrCat("subjectAltName=", sans, "\nextendedKeyUsage=serverAuth,clientAuth\n"));
  Shell(absl::StrCat("cd ", dir.path(), " && openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes",
                     " -keyout ", name, ".key -out ", name, ".csr -subj '/CN=", name, "'",
                     " && openssl x509 -req -in ", name, ".csr -CA ", ca, "-ca.pem -CAkey ", ca, "-ca.key",
                     " -set_serial 0x", RandomHex(8), " -days 1 -out ", name, ".pem -extfile ", name, ".ext"),
        dir.File("openssl.log"));
}

// A port that was free a moment ago (for --health-listen, whose port is not written to a file).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

template <typename Stub, typename Request, typename Response>
absl::Status Call(Stub& stub, ::grpc::Status (Stub::*method)(::grpc::ClientContext*, const Request&, Response*),
                  const Request& request, Response* response, const std::string& admin_token = "") {
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
  if (!admin_token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", admin_token));
  return FromGrpcStatus((stub.*method)(&context, request, response));
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = TempDir::Create("mainstay-security").value().release();
    MakeCa(*dir_, "cluster");
    MakeCert(*dir_, "cluster", "server");
    MakeCert(*dir_, "cluster", "trainer", "DNS:trainer-7");
    MakeCa(*dir_, "rogue");
    MakeCert(*dir_, "rogue", "intruder");
    if (HasFatalFailure()) return;
    admin_token_ = new std::string(RandomHex(32));
    WriteFile(dir_->File("admin-token"), *admin_token_ + "\n");
    tokens_ = new std::vector<std::string>{*admin_token_};

    const std::vector<std::string> tls = {"--tls-cert-file", dir_->File("server.pem"), "--tls-key-file",
                                          dir_->File("server.key"), "--tls-ca-file", dir_->File("cluster-ca.pem"),
                                          "--tls-client-auth", "require", "--tls-internal-name", kInternalName};
    health_addresses_ = new std::vector<std::string>{absl::StrCat("127.0.0.1:", FreePort()),
                                                     absl::StrCat("127.0.0.1:", FreePort())};
    std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                     dir_->File("state"), "--port-file", dir_->File("cport"), "--metrics-listen",
                                     "off", "--admin-token-file", dir_->File("admin-token"), "--health-listen",
                                     (*health_addresses_)[0]};
    argv.insert(argv.end(), tls.begin(), tls.end());
    auto coordinator = Subprocess::Start({argv, dir_->File("coordinator.log")});
    ASSERT_THAT(coordinator.status(), IsOk());
    coordinator_ = coordinator->release();
    absl::StatusOr<int> cport = testing::WaitForPortFile(dir_->File("cport"), *coordinator_, kStartTimeout);
    ASSERT_THAT(cport.status(), IsOk()) << Logs();
    address_ = new std::string(absl::StrCat("127.0.0.1:", *cport));

    argv = {MAINSTAYD_BIN, "--coordinator", *address_, "--listen", "127.0.0.1:0", "--node-name", "node0",
            "--threads", "1", "--memory-bytes", "4000000000", "--port-file", dir_->File("dport"),
            "--metrics-listen", "off", "--health-listen", (*health_addresses_)[1]};
    argv.insert(argv.end(), tls.begin(), tls.end());
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
    delete admin_token_;
    delete tokens_;
    delete health_addresses_;
    health_addresses_ = nullptr;
    delete dir_;
    daemon_ = coordinator_ = nullptr;
    address_ = daemon_address_ = admin_token_ = nullptr;
    tokens_ = nullptr;
    dir_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(daemon_address_, nullptr) << "the cluster did not start\n" << Logs();
  }

  // The trainer's TLS options: the cluster CA and its own client certificate.
  static TlsOptions TrainerTls() {
    TlsOptions tls;
    tls.ca_file = dir_->File("cluster-ca.pem");
    tls.cert_file = dir_->File("trainer.pem");
    tls.key_file = dir_->File("trainer.key");
    return tls;
  }
  // The servers' own certificate, as the coordinator and the daemons present it as clients.
  static TlsOptions ServerTls() {
    TlsOptions tls;
    tls.ca_file = dir_->File("cluster-ca.pem");
    tls.cert_file = dir_->File("server.pem");
    tls.key_file = dir_->File("server.key");
    return tls;
  }
  static std::shared_ptr<::grpc::Channel> Channel(const std::string& address, const TlsOptions& tls) {
    absl::StatusOr<ChannelSecurity> security = ChannelSecurity::Create(tls);
    EXPECT_THAT(security.status(), IsOk());
    return security.ok() ? security->CreateChannel(address, {}) : nullptr;
  }

  // Creates a job (D = 1) through the client library over mutual TLS, pushes its initial
  // parameters and returns the client; remembers its token for the log check.
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
    options.admin_token = *admin_token_;
    options.tls = TrainerTls();
    options.timeout = std::chrono::seconds(60);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    EXPECT_THAT(client.status(), IsOk()) << Logs();
    if (!client.ok()) return nullptr;
    tokens_->push_back((*client)->job_token());
    std::vector<PushHandle> pushes;
    std::vector<std::vector<float>> params;
    for (const Bucket& b : (*client)->layout().buckets) params.emplace_back(b.numel, 0.25f);
    for (const Bucket& b : (*client)->layout().buckets) {
      pushes.push_back((*client)->PushInitialParams(b.index, params[static_cast<size_t>(b.index)], true));
    }
    for (PushHandle& p : pushes) EXPECT_THAT(p.Wait().status(), IsOk()) << Logs();
    return *std::move(client);
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
  static std::string* admin_token_;
  static std::vector<std::string>* tokens_;  // every secret the tests used
  static std::vector<std::string>* health_addresses_;  // --health-listen of coordinator, daemon
};
TempDir* SecurityTest::dir_ = nullptr;
Subprocess* SecurityTest::coordinator_ = nullptr;
Subprocess* SecurityTest::daemon_ = nullptr;
std::string* SecurityTest::address_ = nullptr;
std::string* SecurityTest::daemon_address_ = nullptr;
std::string* SecurityTest::admin_token_ = nullptr;
std::vector<std::string>* SecurityTest::tokens_ = nullptr;
std::vector<std::string>* SecurityTest::health_addresses_ = nullptr;

TEST_F(SecurityTest, TrainerStepsEndToEndOverMutualTls) {
  std::unique_ptr<Client> client = CreateJob("tls-steps");
  ASSERT_NE(client, nullptr);
  const Layout& layout = client->layout();
  std::vector<std::vector<float>> grads;
  for (const Bucket& b : layout.buckets) grads.emplace_back(b.shard_numel, 0.01f);
  for (int64_t step = 0; step < 2; ++step) {
    for (const Bucket& b : layout.buckets) {
      EXPECT_THAT(
          client->PushGrad(b.index, step, ElementSpan::Fp32(std::span<float>(grads[static_cast<size_t>(b.index)])))
              .Wait()
              .status(),
          IsOk());
    }
    absl::StatusOr<StepStats> stats = client->FinishStep(step, 1e-3, 0.0);
    ASSERT_THAT(stats.status(), IsOk()) << Logs();
    EXPECT_EQ(stats->version, step + 1);
  }
  absl::StatusOr<PulledBucket> pulled = client->PullBucket(0, 2).Wait();
  ASSERT_THAT(pulled.status(), IsOk()) << Logs();
  EXPECT_EQ(pulled->version(), 2);
}

TEST_F(SecurityTest, MainstayctlNeedsCertificatesAndTheAdminToken) {
  const std::string ctl = MAINSTAY_CTL_BIN;
  const std::string tls = absl::StrCat(" --coordinator ", *address_, " --tls-ca-file ", dir_->File("cluster-ca.pem"),
                                       " --tls-cert-file ", dir_->File("trainer.pem"), " --tls-key-file ",
                                       dir_->File("trainer.key"));
  auto run = [&](const std::string& command, const std::string& log) {
    const int status = std::system(absl::StrCat(command, " >", dir_->File(log), " 2>&1").c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  // With certificates and the token (flag, then the environment variable): the daemon is listed.
  EXPECT_EQ(run(absl::StrCat(ctl, " daemons list", tls, " --admin-token-file ", dir_->File("admin-token")), "ctl1.log"),
            0)
      << ReadFileOrEmpty(dir_->File("ctl1.log"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("ctl1.log")), HasSubstr("READY"));
  EXPECT_EQ(run(absl::StrCat("MAINSTAY_ADMIN_TOKEN_FILE=", dir_->File("admin-token"), " ", ctl, " jobs list", tls),
                "ctl2.log"),
            0)
      << ReadFileOrEmpty(dir_->File("ctl2.log"));
  // Without the token: PERMISSION_DENIED (exit 6) saying what is missing.
  EXPECT_EQ(run(absl::StrCat(ctl, " daemons list", tls), "ctl3.log"), 6) << ReadFileOrEmpty(dir_->File("ctl3.log"));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("ctl3.log")), HasSubstr("admin token"));
  // Without certificates: the TLS port does not answer plaintext (UNAVAILABLE, exit 5).
  EXPECT_EQ(run(absl::StrCat(ctl, " daemons list --timeout-ms 3000 --coordinator ", *address_, " --admin-token-file ",
                             dir_->File("admin-token")),
                "ctl4.log"),
            5)
      << ReadFileOrEmpty(dir_->File("ctl4.log"));
  // A certificate file that does not exist: a usage error naming it (exit 2).
  EXPECT_EQ(run(absl::StrCat(ctl, " daemons list --coordinator ", *address_, " --tls-ca-file ",
                             dir_->File("missing.pem")),
                "ctl5.log"),
            2);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("ctl5.log")), HasSubstr(dir_->File("missing.pem")));
}

TEST_F(SecurityTest, PlaintextClientsAreRefusedByTheTlsPorts) {
  for (const std::string* address : {address_, daemon_address_}) {
    auto health = ::grpc::health::v1::Health::NewStub(Channel(*address, {}));
    ::grpc::health::v1::HealthCheckResponse response;
    EXPECT_THAT(Call(*health, &::grpc::health::v1::Health::Stub::Check, {}, &response),
                StatusIs(absl::StatusCode::kUnavailable))
        << *address;
  }
  ClientOptions options;
  options.coordinator = *address_;
  options.job_id = "job-1";
  options.job_token = "whatever";
  options.timeout = std::chrono::seconds(3);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
  EXPECT_THAT(client.status(), Not(IsOk()));
  EXPECT_TRUE(client.status().code() == absl::StatusCode::kUnavailable ||
              client.status().code() == absl::StatusCode::kDeadlineExceeded)
      << client.status();
}

TEST_F(SecurityTest, MutualTlsRefusesClientsWithoutACertificateOrWithOneFromAnotherCa) {
  TlsOptions no_cert;
  no_cert.ca_file = dir_->File("cluster-ca.pem");
  TlsOptions other_ca = no_cert;
  other_ca.cert_file = dir_->File("intruder.pem");
  other_ca.key_file = dir_->File("intruder.key");
  for (const std::string* address : {address_, daemon_address_}) {
    for (const TlsOptions& tls : {no_cert, other_ca}) {
      auto health = ::grpc::health::v1::Health::NewStub(Channel(*address, tls));
      ::grpc::health::v1::HealthCheckResponse response;
      EXPECT_THAT(Call(*health, &::grpc::health::v1::Health::Stub::Check, {}, &response),
                  StatusIs(absl::StatusCode::kUnavailable))
          << *address << " with " << (tls.cert_file.empty() ? "no certificate" : tls.cert_file);
    }
    // The cluster's own client certificate is accepted.
    auto health = ::grpc::health::v1::Health::NewStub(Channel(*address, TrainerTls()));
    ::grpc::health::v1::HealthCheckResponse response;
    EXPECT_THAT(Call(*health, &::grpc::health::v1::Health::Stub::Check, {}, &response), IsOk()) << *address;
    EXPECT_EQ(response.status(), ::grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // A client that trusts another CA does not accept the servers' certificate either.
  TlsOptions wrong_roots;
  wrong_roots.ca_file = dir_->File("rogue-ca.pem");
  wrong_roots.cert_file = dir_->File("trainer.pem");
  wrong_roots.key_file = dir_->File("trainer.key");
  auto health = ::grpc::health::v1::Health::NewStub(Channel(*address_, wrong_roots));
  ::grpc::health::v1::HealthCheckResponse response;
  EXPECT_THAT(Call(*health, &::grpc::health::v1::Health::Stub::Check, {}, &response),
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(SecurityTest, PlaintextHealthPortMirrorsTheTlsServersAndServesNothingElse) {
  const std::vector<std::pair<std::string, std::string>> checks = {
      {(*health_addresses_)[0], "mainstay.v1.Coordinator"}, {(*health_addresses_)[1], "mainstay.v1.Shard"}};
  for (const auto& [address, service] : checks) {
    auto channel = Channel(address, {});
    auto health = ::grpc::health::v1::Health::NewStub(channel);
    ::grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    ::grpc::health::v1::HealthCheckResponse response;
    EXPECT_THAT(Call(*health, &::grpc::health::v1::Health::Stub::Check, request, &response), IsOk()) << address;
    EXPECT_EQ(response.status(), ::grpc::health::v1::HealthCheckResponse::SERVING) << address << " " << service;
  }
  // Only health: the services themselves are not on the plaintext port.
  auto coordinator = v1::Coordinator::NewStub(Channel((*health_addresses_)[0], {}));
  v1::ListDaemonsResponse daemons;
  EXPECT_THAT(Call(*coordinator, &v1::Coordinator::Stub::ListDaemons, {}, &daemons, *admin_token_),
              StatusIs(absl::StatusCode::kUnimplemented));
  auto shard = v1::Shard::NewStub(Channel((*health_addresses_)[1], {}));
  v1::GetStepStatsResponse stats;
  EXPECT_THAT(Call(*shard, &v1::Shard::Stub::GetStepStats, {}, &stats), StatusIs(absl::StatusCode::kUnimplemented));
}

TEST_F(SecurityTest, AdminCallsWithoutOrWithAWrongAdminTokenArePermissionDenied) {
  std::unique_ptr<Client> client = CreateJob("admin-checks");
  ASSERT_NE(client, nullptr);
  const std::string wrong = RandomHex(32);
  tokens_->push_back(wrong);
  auto channel = Channel(*address_, TrainerTls());
  auto coordinator = v1::Coordinator::NewStub(channel);
  auto admin = v1::Admin::NewStub(channel);
  using CoordinatorStub = v1::Coordinator::Stub;
  using AdminStub = v1::Admin::Stub;
  const auto denied = StatusIs(absl::StatusCode::kPermissionDenied);

  v1::ListDaemonsResponse daemons;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::ListDaemons, {}, &daemons), denied);
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::ListDaemons, {}, &daemons, wrong), denied);
  ASSERT_THAT(Call(*coordinator, &CoordinatorStub::ListDaemons, {}, &daemons, *admin_token_), IsOk());
  ASSERT_EQ(daemons.daemons_size(), 1);

  v1::ListJobsRequest list;
  v1::ListJobsResponse jobs;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::ListJobs, list, &jobs), denied);
  list.set_admin_token(wrong);
  absl::Status wrong_status = Call(*coordinator, &CoordinatorStub::ListJobs, list, &jobs);
  EXPECT_THAT(wrong_status, StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("not the coordinator's")));
  EXPECT_THAT(std::string(wrong_status.message()), Not(HasSubstr(wrong)));
  list.set_admin_token(*admin_token_);
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::ListJobs, list, &jobs), IsOk());

  v1::CreateJobRequest create;
  create.mutable_spec()->set_name("no-token");
  v1::CreateJobResponse created;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::CreateJob, create, &created),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("CreateJob needs the coordinator's admin token")));
  v1::DeleteJobRequest del;
  del.set_job_id(client->job_id());
  del.set_admin_token(wrong);
  v1::DeleteJobResponse deleted;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::DeleteJob, del, &deleted), denied);
  // Job reads without a job token are an admin's.
  v1::GetJobRequest get;
  get.set_job_id(client->job_id());
  v1::GetJobResponse job;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetJob, get, &job), denied);
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetJob, get, &job, *admin_token_), IsOk());
  v1::GetLayoutRequest layout;
  layout.set_job_id(client->job_id());
  v1::GetLayoutResponse layout_response;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetLayout, layout, &layout_response), denied);
  v1::GetPlacementRequest placement;
  placement.set_job_id(client->job_id());
  v1::GetPlacementResponse placement_response;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetPlacement, placement, &placement_response, wrong), denied);
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetPlacement, placement, &placement_response, *admin_token_), IsOk());
  {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
    v1::WatchPlacementRequest watch;
    watch.set_job_id(client->job_id());
    auto reader = coordinator->WatchPlacement(&context, watch);
    v1::WatchPlacementResponse message;
    EXPECT_FALSE(reader->Read(&message));
    EXPECT_THAT(FromGrpcStatus(reader->Finish()), denied);
  }

  // Every Admin RPC, read-only ones included, and before it says whether it is implemented.
  v1::CordonDaemonRequest cordon;
  cordon.set_daemon_id(daemons.daemons(0).endpoint().daemon_id());
  v1::CordonDaemonResponse cordoned;
  EXPECT_THAT(Call(*admin, &AdminStub::CordonDaemon, cordon, &cordoned), denied);
  v1::DrainDaemonRequest drain;
  drain.set_daemon_id(cordon.daemon_id());
  drain.set_admin_token(wrong);
  v1::DrainDaemonResponse drained;
  EXPECT_THAT(Call(*admin, &AdminStub::DrainDaemon, drain, &drained), denied);
  v1::MoveShardResponse moved;
  EXPECT_THAT(Call(*admin, &AdminStub::MoveShard, {}, &moved), denied);
  v1::GetShardStatsResponse stats;
  EXPECT_THAT(Call(*admin, &AdminStub::GetShardStats, {}, &stats), denied);
  v1::CreateCheckpointResponse checkpoint;
  EXPECT_THAT(Call(*admin, &AdminStub::CreateCheckpoint, {}, &checkpoint), denied);
  v1::ListCheckpointsResponse checkpoints;
  EXPECT_THAT(Call(*admin, &AdminStub::ListCheckpoints, {}, &checkpoints), denied);
  v1::RestoreCheckpointResponse restored;
  EXPECT_THAT(Call(*admin, &AdminStub::RestoreCheckpoint, {}, &restored), denied);
  v1::DeleteCheckpointResponse deleted_checkpoint;
  EXPECT_THAT(Call(*admin, &AdminStub::DeleteCheckpoint, {}, &deleted_checkpoint), denied);
  {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
    auto reader = admin->DumpTensor(&context, {});
    v1::DumpTensorResponse message;
    EXPECT_FALSE(reader->Read(&message));
    EXPECT_THAT(FromGrpcStatus(reader->Finish()), denied);
  }
  // With the token the call reaches the handler: cordon works, uncordon restores.
  EXPECT_THAT(Call(*admin, &AdminStub::CordonDaemon, cordon, &cordoned, *admin_token_), IsOk());
  EXPECT_EQ(cordoned.daemon().state(), v1::DAEMON_STATE_CORDONED);
  cordon.set_uncordon(true);
  cordon.set_admin_token(*admin_token_);
  EXPECT_THAT(Call(*admin, &AdminStub::CordonDaemon, cordon, &cordoned), IsOk());
  EXPECT_EQ(cordoned.daemon().state(), v1::DAEMON_STATE_READY);

  // Daemons' calls never need the admin token: they authenticate by mutual TLS, with a
  // certificate that names the internal peer name (a trainer's does not).
  v1::KvPutRequest put;
  put.set_key("security-test");
  put.set_value("v");
  v1::KvPutResponse put_response;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::KvPut, put, &put_response),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(kInternalName)));
  auto as_server = v1::Coordinator::NewStub(Channel(*address_, ServerTls()));
  EXPECT_THAT(Call(*as_server, &CoordinatorStub::KvPut, put, &put_response), IsOk());
  v1::RegisterDaemonRequest fake;
  fake.set_address("127.0.0.1:1");
  v1::RegisterDaemonResponse registered;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::RegisterDaemon, fake, &registered), denied);
}

// Standby coordinators (etcd) pass calls to the leader under their own certificate, which names
// the internal peer name: the caller's rights must not grow on the way.
TEST_F(SecurityTest, AStandbyPassesCallsOnWithoutLendingTrainersItsCertificate) {
  using CoordinatorStub = v1::Coordinator::Stub;
  using AdminStub = v1::Admin::Stub;
  if (!testing::EtcdServer::Available()) GTEST_SKIP() << "no etcd-server";
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::unique_ptr<testing::EtcdServer> etcd, testing::EtcdServer::Start());
  std::vector<std::unique_ptr<Subprocess>> coordinators;
  std::string standby;
  for (const std::string id : {"ha-lead", "ha-standby"}) {
    std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--etcd-endpoints",
                                     etcd->endpoint(), "--etcd-prefix", "/security/", "--coordinator-id", id,
                                     "--port-file", dir_->File(id + ".port"), "--metrics-listen", "off",
                                     "--admin-token-file", dir_->File("admin-token"), "--tls-cert-file",
                                     dir_->File("server.pem"), "--tls-key-file", dir_->File("server.key"),
                                     "--tls-ca-file", dir_->File("cluster-ca.pem"), "--tls-client-auth", "require",
                                     "--tls-internal-name", kInternalName};
    auto started = Subprocess::Start({argv, dir_->File(id + ".log")});
    ASSERT_THAT(started.status(), IsOk());
    coordinators.push_back(*std::move(started));
    absl::StatusOr<int> port = testing::WaitForPortFile(dir_->File(id + ".port"), *coordinators.back(), kStartTimeout);
    ASSERT_THAT(port.status(), IsOk()) << ReadFileOrEmpty(dir_->File(id + ".log"));
    standby = absl::StrCat("127.0.0.1:", *port);
    const absl::Time deadline = absl::Now() + kStartTimeout;
    const std::string line = id == "ha-lead" ? "I coordinator: leading (" : "I coordinator: standby: ha-lead at ";
    while (!absl::StrContains(ReadFileOrEmpty(dir_->File(id + ".log")), line) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_THAT(ReadFileOrEmpty(dir_->File(id + ".log")), HasSubstr(line));
  }
  v1::KvPutRequest put;
  put.set_key("through-a-standby");
  put.set_value("v");
  v1::KvPutResponse put_response;
  auto as_trainer = v1::Coordinator::NewStub(Channel(standby, TrainerTls()));
  EXPECT_THAT(Call(*as_trainer, &CoordinatorStub::KvPut, put, &put_response),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(kInternalName)));
  v1::RegisterDaemonRequest fake;
  fake.set_address("127.0.0.1:1");
  v1::RegisterDaemonResponse registered;
  EXPECT_THAT(Call(*as_trainer, &CoordinatorStub::RegisterDaemon, fake, &registered),
              StatusIs(absl::StatusCode::kPermissionDenied));
  auto as_server = v1::Coordinator::NewStub(Channel(standby, ServerTls()));
  EXPECT_THAT(Call(*as_server, &CoordinatorStub::KvPut, put, &put_response), IsOk());
  // The admin token goes along: an admin call from a trainer's certificate works with it.
  auto admin = v1::Admin::NewStub(Channel(standby, TrainerTls()));
  v1::ListCheckpointsResponse checkpoints;
  EXPECT_THAT(Call(*admin, &AdminStub::ListCheckpoints, {}, &checkpoints),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(Call(*admin, &AdminStub::ListCheckpoints, {}, &checkpoints, *admin_token_),
              Not(StatusIs(absl::StatusCode::kPermissionDenied)));
}

TEST_F(SecurityTest, AClientOfJobANeverReadsOrWritesJobB) {
  std::unique_ptr<Client> a = CreateJob("job-a");
  std::unique_ptr<Client> b = CreateJob("job-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::string& token_a = a->job_token();
  const std::string& job_b = b->job_id();
  const auto denied = StatusIs(absl::StatusCode::kPermissionDenied);
  auto channel = Channel(*address_, TrainerTls());
  auto coordinator = v1::Coordinator::NewStub(channel);
  using CoordinatorStub = v1::Coordinator::Stub;

  // The coordinator: every job read with A's token names B: refused.
  v1::GetJobRequest get;
  get.set_job_id(job_b);
  get.set_job_token(token_a);
  v1::GetJobResponse job;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetJob, get, &job), denied);
  v1::GetLayoutRequest layout;
  layout.set_job_id(job_b);
  layout.set_job_token(token_a);
  v1::GetLayoutResponse layout_response;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetLayout, layout, &layout_response), denied);
  v1::GetPlacementRequest placement;
  placement.set_job_id(job_b);
  placement.set_job_token(token_a);
  v1::GetPlacementResponse placement_response;
  EXPECT_THAT(Call(*coordinator, &CoordinatorStub::GetPlacement, placement, &placement_response), denied);
  // Attaching the client library to B with A's token.
  ClientOptions attach;
  attach.coordinator = *address_;
  attach.job_id = job_b;
  attach.job_token = token_a;
  attach.tls = TrainerTls();
  attach.timeout = std::chrono::seconds(20);
  EXPECT_THAT(Client::Connect(attach).status(), denied);

  // The daemon: pushes, pulls, FinishStep and stats of B with A's token, routed correctly.
  const int64_t epoch = b->placement().epoch;
  auto shard = v1::Shard::NewStub(Channel(*daemon_address_, TrainerTls()));
  {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
    v1::PushGradResponse response;
    auto writer = shard->PushGrad(&context, &response);
    v1::PushGradRequest request;
    v1::PushGradHeader& h = *request.mutable_header();
    h.set_job_id(job_b);
    h.set_job_token(token_a);
    h.set_placement_epoch(epoch);
    h.set_step(0);
    h.set_kind(v1::PUSH_KIND_GRADIENT);
    h.set_dtype(v1::ELEMENT_TYPE_FP32);
    h.set_total_bytes(b->layout().buckets[0].shard_numel * 4);
    h.set_num_contributors(1);
    writer->Write(request);
    v1::PushGradRequest chunk;
    chunk.mutable_chunk()->set_data(std::string(static_cast<size_t>(h.total_bytes()), '\0'));
    writer->Write(chunk);
    writer->WritesDone();
    EXPECT_THAT(FromGrpcStatus(writer->Finish()), denied);
  }
  {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
    v1::PullParamsRequest pull;
    pull.set_job_id(job_b);
    pull.set_job_token(token_a);
    pull.set_placement_epoch(epoch);
    pull.set_latest(true);
    auto reader = shard->PullParams(&context, pull);
    v1::PullParamsResponse message;
    EXPECT_FALSE(reader->Read(&message));
    EXPECT_THAT(FromGrpcStatus(reader->Finish()), denied);
  }
  v1::FinishStepRequest finish;
  finish.set_job_id(job_b);
  finish.set_job_token(token_a);
  finish.set_step(0);
  v1::FinishStepResponse finished;
  EXPECT_THAT(Call(*shard, &v1::Shard::Stub::FinishStep, finish, &finished), denied);
  v1::GetStepStatsRequest stats;
  stats.set_job_id(job_b);
  stats.set_job_token(token_a);
  v1::GetStepStatsResponse stats_response;
  EXPECT_THAT(Call(*shard, &v1::Shard::Stub::GetStepStats, stats, &stats_response), denied);
  // The daemon-only calls, which carry no job token, are refused to a trainer's certificate.
  {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
    v1::FetchShardStateRequest fetch;
    fetch.set_job_id(job_b);
    auto reader = shard->FetchShardState(&context, fetch);
    v1::FetchShardStateResponse message;
    EXPECT_FALSE(reader->Read(&message));
    EXPECT_THAT(FromGrpcStatus(reader->Finish()), StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(kInternalName)));
  }
  v1::DropShardRequest drop;
  drop.set_job_id(job_b);
  drop.set_placement_epoch(epoch + 1);
  v1::DropShardResponse dropped;
  EXPECT_THAT(Call(*shard, &v1::Shard::Stub::DropShard, drop, &dropped), denied);
  v1::AssignShardRequest assign;
  assign.set_job_id(job_b);
  v1::AssignShardResponse assigned;
  EXPECT_THAT(Call(*shard, &v1::Shard::Stub::AssignShard, assign, &assigned), denied);
  // The servers' certificate may: the copy of B's committed state streams.
  {
    auto as_server = v1::Shard::NewStub(Channel(*daemon_address_, ServerTls()));
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
    v1::FetchShardStateRequest fetch;
    fetch.set_job_id(job_b);
    auto reader = as_server->FetchShardState(&context, fetch);
    v1::FetchShardStateResponse message;
    EXPECT_TRUE(reader->Read(&message));
    while (reader->Read(&message)) {
    }
    EXPECT_THAT(FromGrpcStatus(reader->Finish()), IsOk());
  }

  // B is untouched: its own trainer still pushes step 0 and gets version 1.
  const Layout& b_layout = b->layout();
  std::vector<std::vector<float>> grads;
  for (const Bucket& bucket : b_layout.buckets) grads.emplace_back(bucket.shard_numel, 0.5f);
  for (const Bucket& bucket : b_layout.buckets) {
    b->PushGrad(bucket.index, 0, ElementSpan::Fp32(std::span<float>(grads[static_cast<size_t>(bucket.index)])));
  }
  absl::StatusOr<StepStats> step = b->FinishStep(0, 1e-3, 0.0);
  ASSERT_THAT(step.status(), IsOk()) << Logs();
  EXPECT_EQ(step->version, 1);
}

TEST_F(SecurityTest, TokensNeverAppearInTheServersLogs) {
  std::unique_ptr<Client> client = CreateJob("log-check");
  ASSERT_NE(client, nullptr);
  // Refused calls carrying secrets, so the servers had every chance to log them.
  auto coordinator = v1::Coordinator::NewStub(Channel(*address_, TrainerTls()));
  const std::string wrong = RandomHex(32);
  tokens_->push_back(wrong);
  v1::ListJobsRequest list;
  list.set_admin_token(wrong);
  v1::ListJobsResponse jobs;
  EXPECT_THAT(Call(*coordinator, &v1::Coordinator::Stub::ListJobs, list, &jobs),
              StatusIs(absl::StatusCode::kPermissionDenied));
  list.set_admin_token(*admin_token_);
  EXPECT_THAT(Call(*coordinator, &v1::Coordinator::Stub::ListJobs, list, &jobs), IsOk());
  v1::GetJobRequest get;
  get.set_job_id("job-999");
  get.set_job_token(client->job_token());
  v1::GetJobResponse job;
  EXPECT_THAT(Call(*coordinator, &v1::Coordinator::Stub::GetJob, get, &job), Not(IsOk()));
  ASSERT_GE(tokens_->size(), 3u);  // the admin token, a job token, a wrong admin token
  const std::string logs = Logs();
  ASSERT_THAT(logs, HasSubstr("admin token required"));  // the logs were read
  for (const std::string& secret : *tokens_) {
    ASSERT_FALSE(secret.empty());
    EXPECT_THAT(logs, Not(HasSubstr(secret)));
  }
}

// ---- Bad TLS and token files stop the binaries at once: exit 2 with the path and the reason.

class SecurityFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(dir_, TempDir::Create("mainstay-security-flags"));
    MakeCa(*dir_, "cluster");
    MakeCert(*dir_, "cluster", "server");
    MakeCert(*dir_, "cluster", "other");
  }
  // Runs `argv` to its end; returns its exit code (-1 when it did not exit) and its output.
  int Run(std::vector<std::string> argv, std::string* output) {
    const std::string log = dir_->File(absl::StrCat("run", runs_++, ".log"));
    absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start({argv, log});
    EXPECT_THAT(process.status(), IsOk());
    if (!process.ok()) return -1;
    absl::StatusOr<int> status = (*process)->Wait(absl::Seconds(60));
    EXPECT_THAT(status.status(), IsOk());
    *output = ReadFileOrEmpty(log);
    return status.ok() && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  }
  std::vector<std::string> Coordinator(std::vector<std::string> extra) {
    std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                     dir_->File("state"), "--metrics-listen", "off"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }
  std::unique_ptr<TempDir> dir_;
  int runs_ = 0;
};

TEST_F(SecurityFlagsTest, MissingMismatchedOrInconsistentFilesExitWithCode2NamingThem) {
  std::string out;
  const std::string missing = dir_->File("no-such-cert.pem");
  EXPECT_EQ(Run(Coordinator({"--tls-cert-file", missing, "--tls-key-file", dir_->File("server.key")}), &out), 2)
      << out;
  EXPECT_THAT(out, HasSubstr(missing));
  EXPECT_THAT(out, HasSubstr("No such file or directory"));

  EXPECT_EQ(Run(Coordinator({"--tls-cert-file", dir_->File("server.pem"), "--tls-key-file", dir_->File("other.key")}),
                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("does not match the certificate"));

  EXPECT_EQ(Run(Coordinator({"--tls-cert-file", dir_->File("server.pem"), "--tls-key-file", dir_->File("server.key"),
                             "--tls-client-auth", "require"}),
                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("no CA file"));

  EXPECT_EQ(Run(Coordinator({"--tls-ca-file", dir_->File("server.key")}), &out), 2) << out;
  EXPECT_THAT(out, HasSubstr("no PEM certificate"));

  // The same from the --config file's keys.
  WriteFile(dir_->File("config.json"), absl::StrCat("{\"tls_cert_file\": \"", missing, "\", \"tls_key_file\": \"",
                                                    dir_->File("server.key"), "\"}"));
  EXPECT_EQ(Run(Coordinator({"--config", dir_->File("config.json")}), &out), 2) << out;
  EXPECT_THAT(out, HasSubstr(missing));

  WriteFile(dir_->File("short-token"), "short\n");
  EXPECT_EQ(Run(Coordinator({"--admin-token-file", dir_->File("short-token")}), &out), 2) << out;
  EXPECT_THAT(out, HasSubstr("shorter than"));
  EXPECT_THAT(out, Not(HasSubstr("short\n")));
  EXPECT_EQ(Run(Coordinator({"--admin-token-file", dir_->File("no-token")}), &out), 2) << out;
  EXPECT_THAT(out, HasSubstr(dir_->File("no-token")));

  EXPECT_EQ(Run({MAINSTAYD_BIN, "--coordinator", "127.0.0.1:1", "--metrics-listen", "off", "--tls-key-file",
                 dir_->File("server.key")},
                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("without a certificate file"));
  EXPECT_EQ(Run({MAINSTAYD_BIN, "--coordinator", "127.0.0.1:1", "--metrics-listen", "off", "--tls-cert-file",
                 dir_->File("server.pem"), "--tls-key-file", dir_->File("server.key"), "--tls-client-auth", "maybe"},
                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("--tls-client-auth"));
  EXPECT_EQ(Run(Coordinator({"--tls-cert-file", dir_->File("server.pem"), "--tls-key-file", dir_->File("server.key"),
                             "--tls-internal-name", "mainstay-internal"}),
                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("--tls-internal-name needs mutual TLS"));
  EXPECT_EQ(Run({MAINSTAYD_BIN, "--coordinator", "127.0.0.1:1", "--metrics-listen", "off", "--tls-internal-name",
                 "mainstay-internal"},
                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("--tls-internal-name needs mutual TLS"));
}

}  // namespace
}  // namespace mainstay

// mainstayd's health and graceful stop with the real binaries on loopback (DESIGN.md section
// 9): the Shard service's health (grpc.health.v1, service "mainstay.v1.Shard") is NOT_SERVING
// until the daemon has registered with the coordinator; on SIGTERM it goes NOT_SERVING at once,
// pushes of a new step are UNAVAILABLE, the step in flight still commits and its version is
// pulled, then the daemon deregisters and exits 0.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mainstay/client.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::grpc::health::v1::HealthCheckResponse;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;

constexpr absl::Duration kStartTimeout = absl::Seconds(120);
constexpr char kShardService[] = "mainstay.v1.Shard";

// A port that was free a moment ago (the daemon must know the coordinator's before it starts).
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

// The health status of `service` at `address`; an error when the call fails.
absl::StatusOr<HealthCheckResponse::ServingStatus> Health(const std::string& address, const std::string& service) {
  auto stub = ::grpc::health::v1::Health::NewStub(::grpc::CreateChannel(address, ::grpc::InsecureChannelCredentials()));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  ::grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  MAINSTAY_RETURN_IF_ERROR(FromGrpcStatus(stub->Check(&context, request, &response)));
  return response.status();
}

// Polls until `service` reports `want`; false at the deadline.
bool WaitForHealth(const std::string& address, const std::string& service, HealthCheckResponse::ServingStatus want,
                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    absl::StatusOr<HealthCheckResponse::ServingStatus> status = Health(address, service);
    if (status.ok() && *status == want) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

class DaemonLifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override { MAINSTAY_ASSERT_OK_AND_ASSIGN(dir_, TempDir::Create("mainstay-lifecycle")); }

  absl::Status StartCoordinator(const std::string& listen) {
    MAINSTAY_ASSIGN_OR_RETURN(coordinator_,
                              Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--listen", listen, "--state-dir",
                                                  dir_->File("state"), "--port-file", dir_->File("cport"),
                                                  "--metrics-listen", "off"},
                                                 dir_->File("coordinator.log")}));
    MAINSTAY_ASSIGN_OR_RETURN(int port, testing::WaitForPortFile(dir_->File("cport"), *coordinator_, kStartTimeout));
    coordinator_address_ = absl::StrCat("127.0.0.1:", port);
    return absl::OkStatus();
  }
  absl::Status StartDaemon(const std::string& coordinator, const std::string& listen) {
    MAINSTAY_ASSIGN_OR_RETURN(
        daemon_, Subprocess::Start({{MAINSTAYD_BIN, "--coordinator", coordinator, "--listen", listen, "--node-name",
                                     "node0", "--threads", "1", "--memory-bytes", "4000000000", "--port-file",
                                     dir_->File("dport"), "--metrics-listen", "off", "--drain-timeout-ms", "60000"},
                                    dir_->File("daemon.log")}));
    return absl::OkStatus();
  }

  std::string Logs() const {
    return absl::StrCat("--- coordinator\n", ReadFileOrEmpty(dir_->File("coordinator.log")), "--- daemon\n",
                        ReadFileOrEmpty(dir_->File("daemon.log")));
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<Subprocess> daemon_;
  std::string coordinator_address_;
};

TEST_F(DaemonLifecycleTest, ADeviceThatIsNotThereOrBadlyNamedExitsWithCode2AndSaysWhich) {
  // cuda:0 too, where this machine has no GPU (CI): the daemon must not fall back to the CPU.
  std::vector<std::pair<std::string, std::string>> cases = {
      {"cuda:4096", "--device cuda:4096"}, {"gpu0", "expected cpu or cuda:N"}, {"cuda:-1", "expected cpu or cuda:N"}};
  if (access("/dev/nvidia0", F_OK) != 0) cases.push_back({"cuda:0", "--device cuda:0"});
  for (const auto& [device, says] : cases) {
    const std::string log = dir_->File(absl::StrCat("device-", device, ".log"));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Subprocess> daemon,
                                  Subprocess::Start({{MAINSTAYD_BIN, "--coordinator", "127.0.0.1:1", "--listen",
                                                      "127.0.0.1:0", "--device", device, "--metrics-listen", "off"},
                                                     log}));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(int status, daemon->Wait(kStartTimeout));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << device << ": " << testing::DescribeWaitStatus(status);
    EXPECT_THAT(ReadFileOrEmpty(log), HasSubstr(says)) << device;
  }
}

TEST_F(DaemonLifecycleTest, CudaIpcWithoutAGpuDeviceExitsWithCode2) {
  for (const std::string device : {"cpu", "cpu-staged"}) {
    const std::string log = dir_->File(absl::StrCat("ipc-", device, ".log"));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<Subprocess> daemon,
        Subprocess::Start({{MAINSTAYD_BIN, "--coordinator", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--device",
                            device, "--transports", "grpc,cuda_ipc", "--metrics-listen", "off"},
                           log}));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(int status, daemon->Wait(kStartTimeout));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << device << ": " << testing::DescribeWaitStatus(status);
    EXPECT_THAT(ReadFileOrEmpty(log), HasSubstr("--transports cuda_ipc needs the shard state on a GPU")) << device;
  }
}

TEST_F(DaemonLifecycleTest, ShardHealthIsNotServingUntilTheDaemonHasRegistered) {
  const int coordinator_port = FreePort();
  const int daemon_port = FreePort();
  ASSERT_GT(coordinator_port, 0);
  ASSERT_GT(daemon_port, 0);
  const std::string daemon_address = absl::StrCat("127.0.0.1:", daemon_port);
  // The daemon first: it serves while it keeps trying to register.
  ASSERT_THAT(StartDaemon(absl::StrCat("127.0.0.1:", coordinator_port), daemon_address), IsOk());
  ASSERT_TRUE(WaitForHealth(daemon_address, "", HealthCheckResponse::SERVING, kStartTimeout)) << Logs();
  ASSERT_TRUE(WaitForHealth(daemon_address, kShardService, HealthCheckResponse::NOT_SERVING, absl::Seconds(10)))
      << Logs();
  absl::SleepFor(absl::Seconds(1));  // still not registered: still not ready
  EXPECT_EQ(Health(daemon_address, kShardService).value_or(HealthCheckResponse::UNKNOWN), HealthCheckResponse::NOT_SERVING);

  ASSERT_THAT(StartCoordinator(absl::StrCat("127.0.0.1:", coordinator_port)), IsOk()) << Logs();
  EXPECT_TRUE(WaitForHealth(daemon_address, kShardService, HealthCheckResponse::SERVING, kStartTimeout)) << Logs();
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), HasSubstr("registered with coordinator"));
}

TEST_F(DaemonLifecycleTest, SigtermLetsTheStepInFlightCommitThenDeregistersAndExitsZero) {
  ASSERT_THAT(StartCoordinator("127.0.0.1:0"), IsOk()) << Logs();
  ASSERT_THAT(StartDaemon(coordinator_address_, "127.0.0.1:0"), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int daemon_port, testing::WaitForPortFile(dir_->File("dport"), *daemon_, kStartTimeout));
  const std::string daemon_address = absl::StrCat("127.0.0.1:", daemon_port);
  ASSERT_TRUE(WaitForHealth(daemon_address, kShardService, HealthCheckResponse::SERVING, kStartTimeout)) << Logs();

  // The cuda_ipc calls of a daemon on the CPU say what it would take.
  {
    auto shard = v1::Shard::NewStub(::grpc::CreateChannel(daemon_address, ::grpc::InsecureChannelCredentials()));
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::AttachCudaIpcRequest request;
    request.set_job_id("any");
    v1::AttachCudaIpcResponse response;
    EXPECT_THAT(FromGrpcStatus(shard->AttachCudaIpc(&context, request, &response)),
                StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("--device cuda:N")));
    ::grpc::ClientContext pull_context;
    pull_context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::CudaIpcPullRequest pull;
    pull.mutable_request()->set_job_id("any");
    v1::CudaIpcPullResponse pulled;
    EXPECT_THAT(FromGrpcStatus(shard->CudaIpcPull(&pull_context, pull, &pulled)),
                StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("--device cuda:N")));
  }

  // Two ranks on the one daemon: a step is in flight while only rank 0 has pushed it.
  JobSpec spec;
  spec.name = "drain";
  spec.recipe = "bf16_mixed";
  spec.data_parallel_size = 2;
  spec.bucket_numel = 16384;
  spec.tensors = testing::TestTensors();
  ClientOptions options;
  options.coordinator = coordinator_address_;
  options.job_spec_json = JobSpecToJson(spec);
  options.timeout = std::chrono::seconds(60);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> rank0, Client::Connect(options));
  options.job_spec_json.clear();
  options.job_id = rank0->job_id();
  options.job_token = rank0->job_token();
  options.rank = 1;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Client> rank1, Client::Connect(options));
  const Layout& layout = rank0->layout();
  std::vector<std::vector<float>> params, grads;
  for (const Bucket& b : layout.buckets) {
    params.emplace_back(b.numel, 0.25f);
    grads.emplace_back(b.shard_numel, 0.01f);
  }
  for (const Bucket& b : layout.buckets) {
    ASSERT_THAT(rank0->PushInitialParams(b.index, params[static_cast<size_t>(b.index)], /*all_shards=*/true)
                    .Wait()
                    .status(),
                IsOk())
        << Logs();
  }
  auto push = [&](Client& client, int64_t step) {
    absl::Status status;
    for (const Bucket& b : layout.buckets) {
      absl::Status s =
          client.PushGrad(b.index, step, ElementSpan::Fp32(std::span<float>(grads[static_cast<size_t>(b.index)])))
              .Wait()
              .status();
      if (status.ok()) status = s;
    }
    return status;
  };
  ASSERT_THAT(push(*rank0, 0), IsOk()) << Logs();

  ASSERT_THAT(daemon_->Signal(SIGTERM), IsOk());
  EXPECT_TRUE(WaitForHealth(daemon_address, kShardService, HealthCheckResponse::NOT_SERVING, absl::Seconds(20)))
      << Logs();
  EXPECT_EQ(Health(daemon_address, "").value_or(HealthCheckResponse::UNKNOWN), HealthCheckResponse::NOT_SERVING);

  // A push of the next step is refused before any data is stored.
  {
    auto shard = v1::Shard::NewStub(::grpc::CreateChannel(daemon_address, ::grpc::InsecureChannelCredentials()));
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::PushGradResponse response;
    auto writer = shard->PushGrad(&context, &response);
    v1::PushGradRequest request;
    v1::PushGradHeader& h = *request.mutable_header();
    h.set_job_id(rank0->job_id());
    h.set_job_token(rank0->job_token());
    h.set_placement_epoch(rank0->placement().epoch);
    h.set_step(1);
    h.set_kind(v1::PUSH_KIND_GRADIENT);
    h.set_dtype(v1::ELEMENT_TYPE_FP32);
    h.set_total_bytes(layout.buckets[0].shard_numel * 4);
    h.set_num_contributors(1);
    writer->Write(request);
    writer->WritesDone();
    EXPECT_THAT(FromGrpcStatus(writer->Finish()), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("draining")));
  }
  EXPECT_TRUE(daemon_->Running()) << "the daemon left with a step in flight\n" << Logs();

  // The step in flight completes: rank 1 pushes, both finish, version 1 is pulled.
  PullHandle pull = rank0->PullBucket(0, 1);
  ASSERT_THAT(push(*rank1, 0), IsOk()) << Logs();
  std::future<absl::StatusOr<StepStats>> finish1 =
      std::async(std::launch::async, [&] { return rank1->FinishStep(0, 1e-3, 0.0); });
  absl::StatusOr<StepStats> stats0 = rank0->FinishStep(0, 1e-3, 0.0);
  absl::StatusOr<StepStats> stats1 = finish1.get();
  ASSERT_THAT(stats0.status(), IsOk()) << Logs();
  ASSERT_THAT(stats1.status(), IsOk()) << Logs();
  EXPECT_EQ(stats0->version, 1);
  absl::StatusOr<PulledBucket> pulled = pull.Wait();
  ASSERT_THAT(pulled.status(), IsOk()) << Logs();
  EXPECT_EQ(pulled->version(), 1);

  MAINSTAY_ASSERT_OK_AND_ASSIGN(int ended, daemon_->Wait(absl::Seconds(60)));
  EXPECT_TRUE(WIFEXITED(ended) && WEXITSTATUS(ended) == 0) << testing::DescribeWaitStatus(ended) << "\n" << Logs();
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), HasSubstr("steps in flight decided"));

  // Deregistered: gone from the list of live daemons, DOWN among all.
  auto coordinator =
      v1::Coordinator::NewStub(::grpc::CreateChannel(coordinator_address_, ::grpc::InsecureChannelCredentials()));
  for (bool include_down : {false, true}) {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::ListDaemonsRequest request;
    request.set_include_down(include_down);
    v1::ListDaemonsResponse response;
    ASSERT_THAT(FromGrpcStatus(coordinator->ListDaemons(&context, request, &response)), IsOk());
    if (!include_down) {
      EXPECT_EQ(response.daemons_size(), 0) << response.DebugString();
    } else {
      ASSERT_EQ(response.daemons_size(), 1);
      EXPECT_EQ(response.daemons(0).state(), v1::DAEMON_STATE_DOWN);
      // Where its shard state lived (mainstayd --device, cpu by default), as registered.
      const auto device = response.daemons(0).labels().find("device");
      ASSERT_NE(device, response.daemons(0).labels().end()) << response.DebugString();
      EXPECT_EQ(device->second, "cpu");
      EXPECT_EQ(response.daemons(0).resources().memory_kind(), v1::MEMORY_KIND_HOST);
      // A daemon on the CPU does not offer cuda_ipc (it copies trainers' memory with its GPU).
      for (int t : response.daemons(0).endpoint().transports()) EXPECT_NE(t, v1::TRANSPORT_CUDA_IPC);
    }
  }
}

}  // namespace
}  // namespace mainstay

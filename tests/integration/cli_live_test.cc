// mainstayctl against a live mainstay-coordinator (the real binary on 127.0.0.1:0): every
// remote command, its table and --json output, mutating commands' --yes, error codes.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "cli/command.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay::cli {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;

class CliLiveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("mainstay-cli");
    ASSERT_THAT(dir, IsOk());
    dir_ = *std::move(dir);
    auto child = Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                     dir_->File("state"), "--port-file", dir_->File("port"), "--lease-ttl-ms", "60000"},
                                    dir_->File("coordinator.log")});
    ASSERT_THAT(child, IsOk());
    coordinator_ = *std::move(child);
    auto port = testing::WaitForPortFile(dir_->File("port"), *coordinator_, absl::Seconds(60));
    ASSERT_THAT(port, IsOk()) << testing::ReadFileOrEmpty(dir_->File("coordinator.log"));
    address_ = absl::StrCat("127.0.0.1:", *port);
    stub_ = v1::Coordinator::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  // Registers a daemon the way mainstayd does (its Shard address need not answer here).
  std::string RegisterDaemon(const std::string& node, int64_t memory) {
    v1::RegisterDaemonRequest req;
    req.set_address(node + ":1");
    req.set_node_name(node);
    req.mutable_resources()->set_host_memory_bytes(memory);
    v1::RegisterDaemonResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    EXPECT_TRUE(stub_->RegisterDaemon(&ctx, req, &resp).ok());
    leases_[resp.daemon_id()] = resp.lease_id();
    return resp.daemon_id();
  }

  // A heartbeat of daemon `id` reporting `progress`.
  void Beat(const std::string& id, const v1::JobProgress& progress) {
    v1::HeartbeatRequest req;
    req.set_daemon_id(id);
    req.set_lease_id(leases_[id]);
    *req.add_jobs() = progress;
    v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::Status status = stub_->Heartbeat(&ctx, req, &resp);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  std::map<std::string, std::string> leases_;  // daemon id -> lease id

  absl::Status Ctl(std::vector<std::string> args, std::string* out, bool interactive = false) {
    args.push_back("--coordinator=" + address_);
    args.push_back("--timeout-ms=30000");
    std::ostringstream stream;
    Output output{stream, interactive};
    absl::Status status = RunCommand(args, output);
    *out = stream.str();
    return status;
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::string address_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

const std::string kGpt2 = std::string(MAINSTAY_SOURCE_DIR) + "/docs/examples/gpt2_small.json";

TEST_F(CliLiveTest, DaemonsJobsPlacementLayoutAndKvThroughTheCli) {
  const std::string a = RegisterDaemon("node-a", int64_t{8} << 30);
  const std::string b = RegisterDaemon("node-b", int64_t{8} << 30);
  std::string out;
  ASSERT_THAT(Ctl({"health"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("SERVING"));

  ASSERT_THAT(Ctl({"daemons", "list"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("DAEMON    STATE  NODE    ADDRESS"));
  EXPECT_THAT(out, HasSubstr(a));
  EXPECT_THAT(out, HasSubstr("node-b"));
  ASSERT_THAT(Ctl({"daemons", "show", b, "--json"}, &out), IsOk());
  EXPECT_EQ(nlohmann::json::parse(out)["endpoint"]["node_name"], "node-b");

  // Mutating without --yes from a non-interactive caller is refused, and nothing is created.
  EXPECT_THAT(Ctl({"jobs", "create", "--spec", kGpt2}, &out), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                                       HasSubstr("--yes")));
  ASSERT_THAT(Ctl({"jobs", "list", "--json"}, &out), IsOk());
  EXPECT_TRUE(nlohmann::json::parse(out)["jobs"].empty());

  ASSERT_THAT(Ctl({"jobs", "create", "--spec", kGpt2, "--yes"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("created job-1 'gpt2-small'"));
  EXPECT_THAT(out, HasSubstr("job token"));
  EXPECT_THAT(Ctl({"jobs", "create", "--spec", kGpt2, "--yes"}, &out),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("gpt2-small")));

  ASSERT_THAT(Ctl({"jobs", "list"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("job-1  gpt2-small  READY  2"));
  ASSERT_THAT(Ctl({"jobs", "show", "job-1"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("placement epoch     1"));

  ASSERT_THAT(Ctl({"placement", "--job", "job-1"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("job job-1  placement epoch 1"));
  ASSERT_THAT(Ctl({"placement", "--job", "job-1", "--json"}, &out), IsOk());
  const nlohmann::json placement = nlohmann::json::parse(out);
  EXPECT_EQ(placement["placement"]["daemons"].size(), 2u) << "balanced over both daemons";

  ASSERT_THAT(Ctl({"layout", "--job", "job-1", "--summary"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("job gpt2-small  recipe bf16_with_fp8_current_scaling_mixed  policy flat  D=2"));
  EXPECT_THAT(out, HasSubstr("148 tensors, 124.44M elements"));

  ASSERT_THAT(Ctl({"daemons", "drain", a, "--yes"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("is DRAINING"));
  ASSERT_THAT(Ctl({"placement", "--job", "job-1"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("placement epoch 2"));
  // The move stays pending (these daemons never copy): jobs show lists it, and the target's
  // load error once its heartbeat reports one.
  v1::JobProgress loading;
  loading.set_job_id("job-1");
  loading.set_placement_epoch(2);
  loading.set_loading(true);
  loading.set_load_error("loading 1 shard(s) from daemon " + a +
                         " at placement epoch 2: RESOURCE_EXHAUSTED: no memory");
  Beat(b, loading);
  ASSERT_THAT(Ctl({"jobs", "show", "job-1"}, &out), IsOk());
  EXPECT_THAT(out, ::testing::ContainsRegex("moving +rank [01] from " + a + " to " + b + " \\(placement epoch 2\\)"));
  EXPECT_THAT(out, HasSubstr("load error          " + b + ": loading 1 shard(s) from daemon " + a));
  ASSERT_THAT(Ctl({"daemons", "cordon", b, "--yes"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("CORDONED"));
  ASSERT_THAT(Ctl({"daemons", "cordon", b, "--undo"}, &out, /*interactive=*/true), IsOk());
  EXPECT_THAT(out, HasSubstr("READY"));

  // kv get of a key a daemon wrote.
  v1::KvPutRequest put;
  put.set_key("jobs/job-1/gloo/rank0");
  put.set_value("127.0.0.1:5000");
  v1::KvPutResponse put_resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->KvPut(&ctx, put, &put_resp).ok());
  ASSERT_THAT(Ctl({"kv", "get", "jobs/job-1/", "--prefix"}, &out), IsOk());
  EXPECT_THAT(out, HasSubstr("jobs/job-1/gloo/rank0  1"));
  EXPECT_THAT(out, HasSubstr("127.0.0.1:5000"));

  ASSERT_THAT(Ctl({"jobs", "delete", "job-1", "--yes"}, &out), IsOk());
  EXPECT_THAT(Ctl({"jobs", "show", "job-1"}, &out), StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-1")));
}

TEST_F(CliLiveTest, ErrorsCarryCodesAndExitCodes) {
  std::string out;
  EXPECT_THAT(Ctl({"daemons", "show", "daemon-404"}, &out), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(Ctl({"kv", "get", "missing"}, &out), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(Ctl({"jobs", "create", "--spec", kGpt2, "--yes"}, &out),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no ready daemon")));
  EXPECT_THAT(Ctl({"jobs", "show"}, &out), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job id")));

  // Through the binary: exit codes a script can branch on.
  auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), MAINSTAY_CTL_BIN);
    args.push_back("--coordinator=" + address_);
    auto child = Subprocess::Start({args, dir_->File("ctl.log")});
    EXPECT_THAT(child, IsOk());
    auto status = (*child)->Wait(absl::Seconds(60));
    EXPECT_THAT(status, IsOk());
    return WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  };
  EXPECT_EQ(run({"health"}), 0);
  EXPECT_EQ(run({"jobs", "show", "job-9"}), 3);
  EXPECT_EQ(run({"jobs", "delete", "job-9"}), 4) << "mutating without --yes, stdin not a terminal";
  ASSERT_THAT(coordinator_->Kill(), IsOk());
  EXPECT_EQ(run({"health", "--timeout-ms=2000"}), 5) << "coordinator gone: UNAVAILABLE";
}

}  // namespace
}  // namespace mainstay::cli

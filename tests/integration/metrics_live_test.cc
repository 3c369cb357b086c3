// The Prometheus endpoints end to end: the real mainstay-coordinator and one real
// mainstayd (both --metrics-listen 127.0.0.1:0) on loopback, a trainer through the public client
// library running two steps and a pull. Then GET /metrics shows the steps, the bytes and the
// lease (and passes `promtool check metrics` where installed), the coordinator's shows its
// daemons, jobs, epochs, RPCs and a lease expiration, and a real Prometheus server,
// scraping the daemon every second, answers its query API with the committed steps. The
// Prometheus part is skipped (GTEST_SKIP) without the prometheus binary (Debian package
// `prometheus`). Every wait is a poll with a generous deadline (loaded CI machines).
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "mainstay/client.h"
#include "nlohmann/json.hpp"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;

constexpr absl::Duration kStartTimeout = absl::Seconds(120);
constexpr absl::Duration kPrometheusTimeout = absl::Seconds(180);
constexpr int kSteps = 2;

// The value of one series (`name{labels}` exactly as rendered); NaN when absent.
double SeriesValue(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " "))
      return std::strtod(std::string(line.substr(series.size() + 1)).c_str(), nullptr);
  }
  return std::nan("");
}

std::string HttpGet(int port, const std::string& path, int* status = nullptr) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(10);
  client.set_read_timeout(60);
  httplib::Result result = client.Get(path.c_str());
  if (status != nullptr) *status = result ? result->status : -1;
  return result ? result->body : "";
}

// A port that was free a moment ago (Prometheus cannot listen on port 0 and report it).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

std::string FindProgram(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':')) {
    const std::string candidate = absl::StrCat(dir, "/", name);
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

class MetricsLiveTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = TempDir::Create("mainstay-metrics").value().release();
    auto coordinator = Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                           dir_->File("state"), "--port-file", dir_->File("cport"), "--metrics-listen",
                                           "127.0.0.1:0", "--metrics-port-file", dir_->File("cmport")},
                                          dir_->File("coordinator.log")});
    ASSERT_THAT(coordinator.status(), IsOk());
    coordinator_ = coordinator->release();
    absl::StatusOr<int> cport = testing::WaitForPortFile(dir_->File("cport"), *coordinator_, kStartTimeout);
    ASSERT_THAT(cport.status(), IsOk()) << Logs();
    absl::StatusOr<int> cmport = testing::WaitForPortFile(dir_->File("cmport"), *coordinator_, kStartTimeout);
    ASSERT_THAT(cmport.status(), IsOk()) << Logs();
    coordinator_metrics_port_ = *cmport;
    address_ = new std::string(absl::StrCat("127.0.0.1:", *cport));
    auto daemon = Subprocess::Start(
        {{MAINSTAYD_BIN, "--coordinator", *address_, "--listen", "127.0.0.1:0", "--node-name", "node0", "--threads",
          "1", "--memory-bytes", "4000000000", "--port-file", dir_->File("dport"), "--metrics-listen", "127.0.0.1:0",
          "--metrics-port-file", dir_->File("mport")},
         dir_->File("daemon.log")});
    ASSERT_THAT(daemon.status(), IsOk());
    daemon_ = daemon->release();
    ASSERT_THAT(testing::WaitForPortFile(dir_->File("dport"), *daemon_, kStartTimeout).status(), IsOk()) << Logs();
    absl::StatusOr<int> mport = testing::WaitForPortFile(dir_->File("mport"), *daemon_, kStartTimeout);
    ASSERT_THAT(mport.status(), IsOk()) << Logs();
    metrics_port_ = *mport;
    RunSteps();
  }

  static void TearDownTestSuite() {
    delete daemon_;
    delete coordinator_;
    delete address_;
    delete dir_;
    daemon_ = coordinator_ = nullptr;
    address_ = nullptr;
    dir_ = nullptr;
  }

  // One trainer (D = 1): the initial parameters, kSteps steps, a pull of the newest version.
  static void RunSteps() {
    JobSpec spec;
    spec.name = "metrics";
    spec.recipe = "bf16_mixed";
    spec.data_parallel_size = 1;
    spec.bucket_numel = 16384;
    spec.tensors = testing::TestTensors();
    ClientOptions options;
    options.coordinator = *address_;
    options.job_spec_json = JobSpecToJson(spec);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(options);
    ASSERT_THAT(client.status(), IsOk()) << Logs();
    Client& c = **client;
    job_id_ = new std::string(c.job_id());
    const Layout& layout = c.layout();
    std::vector<std::vector<float>> buffers;
    for (const Bucket& b : layout.buckets) buffers.push_back(*MakeBucketBuffer(layout, b.index));
    std::vector<PushHandle> pushes;
    for (const Bucket& b : layout.buckets) {
      std::fill(buffers[static_cast<size_t>(b.index)].begin(), buffers[static_cast<size_t>(b.index)].end(), 0.5f);
      pushes.push_back(c.PushInitialParams(b.index, buffers[static_cast<size_t>(b.index)], /*all_shards=*/true));
    }
    for (PushHandle& p : pushes) ASSERT_THAT(p.Wait().status(), IsOk()) << Logs();
    for (int64_t step = 0; step < kSteps; ++step) {
      for (const Bucket& b : layout.buckets) {
        std::vector<float>& g = buffers[static_cast<size_t>(b.index)];
        std::fill(g.begin(), g.end(), 0.01f * static_cast<float>(step + 1));
        c.PushGrad(b.index, step, ElementSpan::Fp32(std::span<float>(g)));
      }
      ASSERT_THAT(c.FinishStep(step, 1e-3, 0.0).status(), IsOk()) << Logs();
    }
    ASSERT_THAT(c.PullBucket(0, kSteps).Wait().status(), IsOk()) << Logs();
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
  static std::string* job_id_;
  static int metrics_port_;
  static int coordinator_metrics_port_;
};
TempDir* MetricsLiveTest::dir_ = nullptr;
Subprocess* MetricsLiveTest::coordinator_ = nullptr;
Subprocess* MetricsLiveTest::daemon_ = nullptr;
std::string* MetricsLiveTest::address_ = nullptr;
std::string* MetricsLiveTest::job_id_ = nullptr;
int MetricsLiveTest::metrics_port_ = 0;
int MetricsLiveTest::coordinator_metrics_port_ = 0;

TEST_F(MetricsLiveTest, EndpointShowsCommittedStepsBytesHeldStateAndLiveLease) {
  ASSERT_NE(job_id_, nullptr);
  int status = 0;
  const std::string text = HttpGet(metrics_port_, "/metrics", &status);
  ASSERT_EQ(status, 200) << Logs();
  const std::string job = absl::StrCat("{job_id=\"", *job_id_, "\"}");
  EXPECT_EQ(SeriesValue(text, "mainstay_daemon_steps_committed_total" + job), kSteps) << text;
  EXPECT_GT(SeriesValue(text, "mainstay_daemon_grad_norm" + job), 0.0) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_daemon_step_phase_seconds_count{phase=\"update\"}"), kSteps) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_daemon_step_seconds_count"), kSteps) << text;
  // By whichever transport the trainer chose (auto: ucx where both ends have it).
  EXPECT_GT(SeriesValue(text, "mainstay_daemon_pushed_bytes_total{transport=\"grpc\"}") +
                SeriesValue(text, "mainstay_daemon_pushed_bytes_total{transport=\"ucx\"}"),
            0.0) << text;
  EXPECT_GT(SeriesValue(text, "mainstay_daemon_pulled_bytes_total{transport=\"grpc\"}") +
                SeriesValue(text, "mainstay_daemon_pulled_bytes_total{transport=\"ucx\"}"),
            0.0) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_daemon_jobs"), 1) << text;
  EXPECT_GE(SeriesValue(text, "mainstay_daemon_shards"), 1) << text;
  EXPECT_GT(SeriesValue(text, "mainstay_daemon_shard_state_bytes"), 0.0) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_daemon_lease_live"), 1) << text;

  HttpGet(metrics_port_, "/", &status);
  EXPECT_EQ(status, 404);

  if (const std::string promtool = FindProgram("promtool"); !promtool.empty()) {
    const std::string file = dir_->File("scrape.txt");
    std::ofstream(file) << text;
    const std::string command = absl::StrCat(promtool, " check metrics < ", file, " > ", file, ".out 2>&1");
    EXPECT_EQ(std::system(command.c_str()), 0) << ReadFileOrEmpty(file + ".out");
  }
}

TEST_F(MetricsLiveTest, CoordinatorEndpointShowsDaemonsJobsEpochsRpcsAndALeaseExpiration) {
  ASSERT_NE(job_id_, nullptr);
  // A second daemon with a short lease, killed without deregistering: its lease runs out.
  auto extra = Subprocess::Start({{MAINSTAYD_BIN, "--coordinator", *address_, "--listen", "127.0.0.1:0", "--node-name",
                                   "node1", "--threads", "1", "--memory-bytes", "1000000", "--lease-ttl-ms", "1000",
                                   "--metrics-listen", "off", "--port-file", dir_->File("dport2")},
                                  dir_->File("daemon2.log")});
  ASSERT_THAT(extra.status(), IsOk());
  ASSERT_THAT(testing::WaitForPortFile(dir_->File("dport2"), **extra, kStartTimeout).status(), IsOk()) << Logs();
  std::string text = HttpGet(coordinator_metrics_port_, "/metrics");
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_daemons{state=\"READY\"}"), 2) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_lease_expirations_total"), 0) << text;
  ASSERT_THAT((*extra)->Kill().status(), IsOk());

  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  int status = 0;
  while (absl::Now() < deadline) {
    text = HttpGet(coordinator_metrics_port_, "/metrics", &status);
    if (SeriesValue(text, "mainstay_coordinator_lease_expirations_total") >= 1) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(status, 200) << Logs();
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_lease_expirations_total"), 1) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_daemons{state=\"READY\"}"), 1) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_daemons{state=\"DOWN\"}"), 1) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_daemons{state=\"DRAINING\"}"), 0) << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_jobs{state=\"READY\"}"), 1) << text;
  EXPECT_GE(SeriesValue(text, absl::StrCat("mainstay_coordinator_placement_epoch{job_id=\"", *job_id_, "\"}")), 1)
      << text;
  EXPECT_EQ(SeriesValue(text, "mainstay_coordinator_rpcs_total{method=\"mainstay.v1.Coordinator/CreateJob\","
                              "code=\"OK\"}"),
            1)
      << text;
  EXPECT_GE(SeriesValue(text, "mainstay_coordinator_rpcs_total{method=\"mainstay.v1.Coordinator/RegisterDaemon\","
                              "code=\"OK\"}"),
            2)
      << text;
  EXPECT_GE(SeriesValue(text, "mainstay_coordinator_rpcs_total{method=\"mainstay.v1.Coordinator/GetLayout\","
                              "code=\"OK\"}"),
            1)
      << text;
  if (const std::string promtool = FindProgram("promtool"); !promtool.empty()) {
    const std::string file = dir_->File("coordinator_scrape.txt");
    std::ofstream(file) << text;
    const std::string command = absl::StrCat(promtool, " check metrics < ", file, " > ", file, ".out 2>&1");
    EXPECT_EQ(std::system(command.c_str()), 0) << ReadFileOrEmpty(file + ".out");
  }
}

// Polls Prometheus' query API until `query` has a sample > `above`; returns the last answer.
bool WaitForSample(int port, const std::string& query, double above, std::string* last) {
  const absl::Time deadline = absl::Now() + kPrometheusTimeout;
  while (absl::Now() < deadline) {
    httplib::Params params{{"query", query}};
    httplib::Client client("127.0.0.1", port);
    client.set_connection_timeout(5);
    client.set_read_timeout(30);
    httplib::Result result = client.Get("/api/v1/query", params, httplib::Headers{});
    *last = result ? result->body : absl::StrCat("no answer: ", httplib::to_string(result.error()));
    if (result && result->status == 200) {
      const nlohmann::json answer = nlohmann::json::parse(result->body, nullptr, /*allow_exceptions=*/false);
      if (!answer.is_discarded() && answer.value("status", "") == "success") {
        for (const nlohmann::json& sample : answer["data"]["result"]) {
          if (std::stod(sample["value"][1].get<std::string>()) > above) return true;
        }
      }
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
  return false;
}

TEST_F(MetricsLiveTest, PrometheusScrapesTheDaemonAndAnswersWithTheCommittedSteps) {
  const std::string prometheus = FindProgram("prometheus");
  if (prometheus.empty()) GTEST_SKIP() << "the prometheus binary is not installed (Debian package `prometheus`)";
  ASSERT_NE(job_id_, nullptr);
  const std::string config = dir_->File("prometheus.yml");
  std::ofstream(config) << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                        << "scrape_configs:\n  - job_name: mainstayd\n    static_configs:\n"
                        << "      - targets: ['127.0.0.1:" << metrics_port_ << "']\n";
  // The port is picked before Prometheus binds it: another process may take it meanwhile, so a
  // Prometheus that exits at start is tried again on another port.
  std::unique_ptr<Subprocess> server;
  std::string failures;
  int port = -1;
  for (int attempt = 0; attempt < 3 && server == nullptr; ++attempt) {
    port = FreePort();
    ASSERT_GT(port, 0);
    const std::string log = dir_->File(absl::StrCat("prometheus", attempt, ".log"));
    absl::StatusOr<std::unique_ptr<Subprocess>> started =
        Subprocess::Start({{prometheus, absl::StrCat("--config.file=", config),
                            absl::StrCat("--storage.tsdb.path=", dir_->File(absl::StrCat("tsdb", attempt))),
                            absl::StrCat("--web.listen-address=127.0.0.1:", port), "--log.level=warn"},
                           log});
    ASSERT_THAT(started.status(), IsOk());
    const absl::Time deadline = absl::Now() + kStartTimeout;
    int status = 0;
    while (absl::Now() < deadline && (*started)->Running()) {
      HttpGet(port, "/-/ready", &status);
      if (status == 200) break;
      absl::SleepFor(absl::Milliseconds(250));
    }
    if (status == 200) {
      server = *std::move(started);
    } else {
      failures += absl::StrCat("--- attempt ", attempt, " on port ", port, ": not ready\n", ReadFileOrEmpty(log));
    }
  }
  ASSERT_NE(server, nullptr) << "Prometheus did not start:\n" << failures;

  std::string last;
  const std::string steps = absl::StrCat("mainstay_daemon_steps_committed_total{job_id=\"", *job_id_, "\"}");
  EXPECT_TRUE(WaitForSample(port, steps, 0.0, &last))
      << "last answer: " << last << "\ntargets: " << HttpGet(port, "/api/v1/targets");
  // The histogram parsed too: the +Inf bucket of the update phase holds every committed step.
  EXPECT_TRUE(WaitForSample(port, "mainstay_daemon_step_phase_seconds_bucket{phase=\"update\",le=\"+Inf\"}",
                            kSteps - 0.5, &last))
      << "last answer: " << last;
  EXPECT_TRUE(WaitForSample(port, "mainstay_daemon_lease_live", 0.5, &last)) << "last answer: " << last;
}

}  // namespace
}  // namespace mainstay

// Data-plane throughput per transport (docs/benchmarks.md, "Transports"): the real coordinator
// and one mainstayd on loopback, one trainer (this process) through the client library, one
// job per shard size: a single bucket, D = 1, recipe bf16_mixed. Each measured step pushes the
// shard's FP32 gradient (S bytes), finishes the step (not timed: the optimizer runs), then pulls
// the published BF16 parameters (S/2 bytes).
//
// Baseline, measured in the same run: `ucx_perftest -t tag_bw` between two processes on the
// same host with the same UCX_TLS and the same message size (for grpc: UCX_TLS=tcp, the
// transport gRPC rides on). ratio = bench bandwidth / tag_bw bandwidth.
//
// For ucx over tcp a second line ("tcp-e") repeats the bench's figures against tag_bw with
// `-e`: endpoints with peer-failure handling, as Mainstay's are wherever UCX supports it (a dead
// peer must fail its transfers). UCX 1.13 then leaves out the zero-copy RMA lanes over tcp (and
// the second interface they stripe across), so plain tag_bw is not what those endpoints can do.
// Shared memory has no peer-failure handling: its endpoints are plain, like tag_bw's.
//
//   transport_bench --coordinator-bin PATH --daemon-bin PATH [--sizes-mib 16,64,256,1024]
//                   [--steps 3 (at least; more for sizes under 256 MiB)] [--configs grpc,ucx:tcp,ucx:sm] [--perftest ucx_perftest]
//                   [--chunk-bytes 4194304] [--daemon-threads 2] [--crc on|off]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "mainstay/client.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "transport_bench: %s\n", message.c_str());
  std::exit(1);
}

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Flags {
  std::string coordinator_bin, daemon_bin, perftest = "ucx_perftest";
  std::vector<int64_t> sizes_mib = {16, 64, 256, 1024};
  std::vector<std::string> configs = {"grpc", "ucx:tcp", "ucx:sm"};
  int steps = 3;
  int64_t chunk_bytes = 4 << 20;
  int daemon_threads = 2;
  bool crc = true;  // the end-to-end CRC-32C of each push (ClientOptions.push_crc32c)
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i], value = argv[i + 1];
    if (name == "--coordinator-bin") {
      f.coordinator_bin = value;
    } else if (name == "--daemon-bin") {
      f.daemon_bin = value;
    } else if (name == "--perftest") {
      f.perftest = value;
    } else if (name == "--sizes-mib") {
      f.sizes_mib.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int64_t v = 0;
        if (!absl::SimpleAtoi(s, &v) || v < 1) Die("bad --sizes-mib");
        f.sizes_mib.push_back(v);
      }
    } else if (name == "--configs") {
      f.configs = absl::StrSplit(value, ',');
    } else if (name == "--steps") {
      f.steps = std::atoi(value.c_str());
    } else if (name == "--chunk-bytes") {
      f.chunk_bytes = std::atoll(value.c_str());
    } else if (name == "--crc") {
      f.crc = value != "off";
    } else if (name == "--daemon-threads") {
      f.daemon_threads = std::atoi(value.c_str());
    } else {
      Die("unknown flag " + name);
    }
  }
  if (f.coordinator_bin.empty() || f.daemon_bin.empty()) Die("--coordinator-bin and --daemon-bin are required");
  if (f.steps < 1) Die("--steps must be >= 1");
  return f;
}

// ucx_perftest tag_bw between two processes here: the "Final:" line's average bandwidth, MB/s
// (UCX's MB = 2^20 bytes).
double PerftestMBps(const std::string& perftest, const std::string& tls, int64_t bytes, int port,
                    bool error_handling = false) {
  const int iters = static_cast<int>(std::clamp<int64_t>((int64_t{4} << 30) / bytes, 5, 200));
  const std::string env = absl::StrCat("UCX_TLS=", tls, " ");
  // The server may not listen yet when the client starts (a loaded 2-core machine): try again
  // on a fresh port, a few times.
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string common =
        absl::StrCat(" -t tag_bw -s ", bytes, " -n ", iters, error_handling ? " -e" : "", " -p ", port + attempt);
    const std::string server = absl::StrCat(env, "timeout 300 ", perftest, common, " > /dev/null 2>&1 &");
    if (std::system(server.c_str()) != 0) Die("cannot start the ucx_perftest server");
    std::this_thread::sleep_for(std::chrono::milliseconds(500 * (attempt + 1)));
    const std::string client = absl::StrCat(env, "timeout 300 ", perftest, " 127.0.0.1", common, " 2>&1");
    FILE* out = popen(client.c_str(), "r");
    if (out == nullptr) Die("cannot run ucx_perftest");
    char line[1024];
    double mbps = -1;
    while (std::fgets(line, sizeof(line), out) != nullptr) {
      const std::string l = line;
      if (l.rfind("Final:", 0) != 0) continue;
      std::vector<std::string> cols = absl::StrSplit(l, ' ', absl::SkipEmpty());
      // Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall
      if (cols.size() >= 7) mbps = std::atof(cols[5].c_str());
    }
    pclose(out);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    if (mbps > 0) return mbps;
    const std::string stop = absl::StrCat("pkill -f 'ucx_perftest.* -p ", port + attempt, "$' > /dev/null 2>&1");
    (void)std::system(stop.c_str());  // a server left waiting for its client
  }
  Die(absl::StrCat("no tag_bw result from ", perftest, " with UCX_TLS=", tls, " after 3 attempts"));
  return -1;
}

struct Result {
  double push_s = 0, pull_s = 0;
  std::string transport;
};

// One job of one bucket of `bytes` bytes of FP32; returns the median push and pull times.
Result Measure(const std::string& address, const std::string& transport, int64_t bytes, const Flags& f) {
  const int64_t numel = bytes / 4;
  const int64_t cols = 4096;
  JobSpec spec;
  spec.name = absl::StrCat("transport-bench-", bytes >> 20, "mib");
  spec.recipe = "bf16_mixed";
  spec.data_parallel_size = 1;
  spec.bucket_numel = numel;
  spec.tensors.push_back({"w", {numel / cols, cols}});
  ClientOptions o;
  o.coordinator = address;
  o.job_spec_json = JobSpecToJson(spec);
  o.transport = transport;
  o.chunk_bytes = f.chunk_bytes;
  o.push_crc32c = f.crc;
  o.timeout = std::chrono::minutes(10);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  if (!c.ok()) Die(c.status().ToString());
  Client& client = **c;
  if (client.layout().buckets.size() != 1) Die("expected one bucket");
  Result r;
  r.transport = client.connections().at(0).transport;
  std::vector<float> params(static_cast<size_t>(numel), 0.01f);
  if (!client.PushInitialParams(0, params).Wait().ok()) Die("initial push failed");
  std::vector<float> grad(static_cast<size_t>(numel), 0.001f);
  std::vector<double> push, pull;
  // Small transfers take a few milliseconds each, where one descheduling on a loaded machine
  // moves a sample by half: they get more steps (each size moves at least 256 MiB measured).
  const int64_t steps = std::max<int64_t>(f.steps, ((int64_t{256} << 20) + bytes - 1) / bytes);
  for (int64_t step = 0; step <= steps; ++step) {  // step 0 warms up
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<PushResult> pushed = client.PushGrad(0, step, ElementSpan::Fp32(grad)).Wait();
    const Clock::time_point t1 = Clock::now();
    if (!pushed.ok()) Die(pushed.status().ToString());
    absl::StatusOr<StepStats> stats = client.FinishStep(step, 1e-4, 0.0);
    if (!stats.ok()) Die(stats.status().ToString());
    const Clock::time_point t2 = Clock::now();
    absl::StatusOr<PulledBucket> pulled = client.PullBucket(0, step + 1).Wait();
    const Clock::time_point t3 = Clock::now();
    if (!pulled.ok()) Die(pulled.status().ToString());
    if (step == 0) continue;
    push.push_back(Seconds(t0, t1));
    pull.push_back(Seconds(t2, t3));
  }
  std::sort(push.begin(), push.end());
  std::sort(pull.begin(), pull.end());
  r.push_s = push[push.size() / 2];
  r.pull_s = pull[pull.size() / 2];
  return r;
}

int Main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  std::printf("%-8s %-5s %8s | %10s %10s %6s | %10s %10s %6s\n", "config", "tls", "size", "push_MB/s", "tag_bw",
              "ratio", "pull_MB/s", "tag_bw", "ratio");
  int port = 20000 + static_cast<int>(getpid() % 20000);
  for (const std::string& config : f.configs) {
    std::vector<std::string> parts = absl::StrSplit(config, ':');
    const std::string transport = parts[0];
    const std::string tls = parts.size() > 1 ? parts[1] : "tcp";
    if (transport != "grpc" && transport != "ucx") Die("config " + config + ": transport must be grpc or ucx");
    setenv("UCX_TLS", tls.c_str(), 1);  // this process's client and the daemon below
    auto dir = testing::TempDir::Create("mainstay-transport-bench");
    if (!dir.ok()) Die(dir.status().ToString());
    auto coordinator = testing::Subprocess::Start({{f.coordinator_bin, "--listen", "127.0.0.1:0", "--state-dir",
                                                    (*dir)->File("state"), "--port-file", (*dir)->File("cport"),
                                                    "--metrics-listen", "off"},
                                                   (*dir)->File("coordinator.log")});
    if (!coordinator.ok()) Die(coordinator.status().ToString());
    absl::StatusOr<int> cport = testing::WaitForPortFile((*dir)->File("cport"), **coordinator, absl::Seconds(60));
    if (!cport.ok()) Die(cport.status().ToString());
    const std::string address = absl::StrCat("127.0.0.1:", *cport);
    auto daemon = testing::Subprocess::Start({{f.daemon_bin, "--coordinator", address, "--listen", "127.0.0.1:0",
                                               "--threads", std::to_string(f.daemon_threads), "--retained-versions", "2",
                                               "--metrics-listen", "off", "--port-file", (*dir)->File("dport")},
                                              (*dir)->File("daemon.log")});
    if (!daemon.ok()) Die(daemon.status().ToString());
    if (!testing::WaitForPortFile((*dir)->File("dport"), **daemon, absl::Seconds(60)).ok()) Die("daemon did not start");
    for (int64_t mib : f.sizes_mib) {
      const int64_t bytes = mib << 20;
      const Result r = Measure(address, transport, bytes, f);
      if (r.transport != transport) Die(absl::StrCat(config, ": the client used ", r.transport));
      const double push_mbps = static_cast<double>(bytes) / (1 << 20) / r.push_s;
      const double pull_mbps = static_cast<double>(bytes / 2) / (1 << 20) / r.pull_s;
      const double base_push = PerftestMBps(f.perftest, tls, bytes, port);
      port += 3;
      const double base_pull = PerftestMBps(f.perftest, tls, bytes / 2, port);
      port += 3;
      std::printf("%-8s %-5s %6lldMi | %10.0f %10.0f %6.2f | %10.0f %10.0f %6.2f\n", transport.c_str(), tls.c_str(),
                  static_cast<long long>(mib), push_mbps, base_push, push_mbps / base_push, pull_mbps, base_pull,
                  pull_mbps / base_pull);
      if (transport == "ucx" && tls == "tcp") {
        const double e_push = PerftestMBps(f.perftest, tls, bytes, port, /*error_handling=*/true);
        port += 3;
        const double e_pull = PerftestMBps(f.perftest, tls, bytes / 2, port, /*error_handling=*/true);
        port += 3;
        std::printf("%-8s %-5s %6lldMi | %10.0f %10.0f %6.2f | %10.0f %10.0f %6.2f\n", transport.c_str(), "tcp-e",
                    static_cast<long long>(mib), push_mbps, e_push, push_mbps / e_push, pull_mbps, e_pull,
                    pull_mbps / e_pull);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace mainstay

int main(int argc, char** argv) { return mainstay::Main(argc, argv); }

// Part 3 of checkpoint_bench: the time from a daemon's SIGKILL and restart to the job serving
// its checkpoint's version again, with real processes (mainstay-coordinator with
// --checkpoint-dir and --lease-ttl-ms, write_dp mainstayd with the same lease) and trainers
// through the client library (rank r placed on node r). After one step, rank 0 takes a
// checkpoint with the Admin RPC (CreateCheckpoint, wait); daemon 1 is killed and a new one
// started on the same node at once. Phases, from the kill:
//   lease detection: until the coordinator's placement shows the next epoch (it restores the
//                    job from its newest checkpoint once the lost daemon's lease expires: one
//                    lease TTL plus up to one tick), polled every 10 ms through the client;
//   restore:         from then until rank 1's shard of every bucket answers a pull of the
//                    checkpoint's version (the daemons read the files and republish);
//   full pull:       then every bucket pulled whole (the model a resuming trainer needs).
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/checkpoint_bench.h"
#include "common/status.h"
#include "mainstay/client.h"
#include "tests/testing/subprocess.h"

namespace mainstay::bench {
namespace {

using testing::Subprocess;

absl::StatusOr<std::unique_ptr<Subprocess>> StartDaemon(const Flags& flags, const std::string& dir,
                                                         const std::string& coordinator, int i, int generation) {
  const std::string port_file = absl::StrCat(dir, "/dport", i, ".", generation);
  MAINSTAY_ASSIGN_OR_RETURN(
      std::unique_ptr<Subprocess> d,
      Subprocess::Start({{flags.daemon_bin, "--coordinator", coordinator, "--listen", "127.0.0.1:0", "--node-name",
                          absl::StrCat("node", i), "--threads", "1", "--retained-versions", "2", "--lease-ttl-ms",
                          std::to_string(flags.lease_ttl_ms), "--metrics-listen", "off", "--port-file", port_file},
                         absl::StrCat(dir, "/daemon", i, ".", generation, ".log")}));
  MAINSTAY_RETURN_IF_ERROR(testing::WaitForPortFile(port_file, *d, absl::Seconds(60)).status());
  return d;
}

// The daemon's own account of its restore ("restored N shard(s) ... in D"), or "".
std::string RestoreLine(const std::string& log) {
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t at = line.find(": restored ");
    if (at != absl::string_view::npos) return std::string(line.substr(line.find("job ")));
  }
  return "";
}

}  // namespace

absl::Status RunRestart(const Flags& flags, const std::string& scratch_dir) {
  const std::string dir = absl::StrCat(scratch_dir, "/restart");
  std::filesystem::create_directories(dir);
  MAINSTAY_ASSIGN_OR_RETURN(
      std::unique_ptr<Subprocess> coordinator,
      Subprocess::Start({{flags.coordinator_bin, "--listen", "127.0.0.1:0", "--state-dir", dir + "/state",
                          "--checkpoint-dir", dir + "/checkpoints", "--lease-ttl-ms", std::to_string(flags.lease_ttl_ms),
                          "--tick-ms", "100", "--metrics-listen", "off", "--port-file", dir + "/cport"},
                         dir + "/coordinator.log"}));
  MAINSTAY_ASSIGN_OR_RETURN(int cport, testing::WaitForPortFile(dir + "/cport", *coordinator, absl::Seconds(60)));
  const std::string address = absl::StrCat("127.0.0.1:", cport);
  std::vector<std::unique_ptr<Subprocess>> daemons;
  for (int i = 0; i < flags.write_dp; ++i) {
    MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> d, StartDaemon(flags, dir, address, i, 0));
    daemons.push_back(std::move(d));
  }
  JobSpec spec = MakeSpec(flags, flags.write_dp, "checkpoint-bench-restart");
  for (int r = 0; r < flags.write_dp; ++r) spec.trainer_nodes.push_back(absl::StrCat("node", r));
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < flags.write_dp; ++r) {
    ClientOptions o;
    o.coordinator = address;
    o.rank = r;
    o.timeout = std::chrono::minutes(10);
    if (r == 0) {
      o.job_spec_json = JobSpecToJson(spec);
    } else {
      o.job_id = clients[0]->job_id();
      o.job_token = clients[0]->job_token();
    }
    MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Connect(o));
    clients.push_back(std::move(c));
  }
  const Layout& layout = clients[0]->layout();
  std::printf("\nrestart: coordinator + %d mainstayd (--threads 1), lease TTL %d ms, tick 100 ms; one step...\n",
              flags.write_dp, flags.lease_ttl_ms);
  std::fflush(stdout);
  // Step 0 by every rank: initial parameters, a gradient, FinishStep.
  std::vector<absl::Status> results(clients.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < clients.size(); ++r) {
    threads.emplace_back([&, r] {
      Client& c = *clients[r];
      results[r] = [&]() -> absl::Status {
        for (const Bucket& b : layout.buckets) {
          std::vector<float> shard(static_cast<size_t>(b.shard_numel), 0.01f);
          MAINSTAY_RETURN_IF_ERROR(c.PushInitialParams(b.index, shard).Wait().status());
        }
        std::vector<std::vector<float>> grads;
        for (const Bucket& b : layout.buckets) grads.emplace_back(static_cast<size_t>(b.shard_numel), 0.001f);
        std::vector<PushHandle> pushes;
        for (const Bucket& b : layout.buckets) {
          pushes.push_back(c.PushGrad(b.index, 0, ElementSpan::Fp32(grads[static_cast<size_t>(b.index)])));
        }
        for (PushHandle& p : pushes) MAINSTAY_RETURN_IF_ERROR(p.Wait().status());
        return c.FinishStep(0, 1e-4, 0.0).status();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) MAINSTAY_RETURN_IF_ERROR(s);

  const Clock::time_point c0 = Clock::now();
  MAINSTAY_ASSIGN_OR_RETURN(CheckpointInfo info, clients[0]->CreateCheckpoint(/*wait=*/true));
  const double checkpoint_s = Seconds(c0, Clock::now());
  if (info.state != "COMMITTED") return absl::InternalError(absl::StrCat("checkpoint state ", info.state, ": ", info.error));
  const int64_t epoch = clients[0]->placement().epoch;

  // Kill daemon 1 (rank 1's) and start a new one on its node at once.
  const int victim = flags.write_dp > 1 ? 1 : 0;
  const Clock::time_point k0 = Clock::now();
  MAINSTAY_RETURN_IF_ERROR(daemons[static_cast<size_t>(victim)]->Kill().status());
  MAINSTAY_ASSIGN_OR_RETURN(daemons[static_cast<size_t>(victim)], StartDaemon(flags, dir, address, victim, 1));
  const double started_s = Seconds(k0, Clock::now());
  Client& trainer = *clients[0];
  for (;;) {
    MAINSTAY_RETURN_IF_ERROR(trainer.RefreshPlacement());
    if (trainer.placement().epoch > epoch) break;
    if (Seconds(k0, Clock::now()) > 120) return absl::DeadlineExceededError("the coordinator did not re-place the job");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double detected_s = Seconds(k0, Clock::now());
  for (const Bucket& b : layout.buckets) {
    MAINSTAY_RETURN_IF_ERROR(trainer.PullShard(b.index, victim, info.version, std::chrono::minutes(5)).Wait().status());
  }
  const double restored_s = Seconds(k0, Clock::now());
  for (const Bucket& b : layout.buckets) {
    MAINSTAY_RETURN_IF_ERROR(trainer.PullBucket(b.index, info.version, std::chrono::minutes(5)).Wait().status());
  }
  const double pulled_s = Seconds(k0, Clock::now());
  std::string owner;
  for (const ShardOwner& s : trainer.placement().shards) {
    if (s.shard == victim && s.bucket == 0) owner = s.daemon_id;
  }

  std::printf("checkpoint through the Admin RPC (CreateCheckpoint, wait): %.3f s for %.3f GB (%d files)\n\n", checkpoint_s,
              info.size_bytes / 1e9, info.file_count);
  std::printf("| phase (SIGKILL of daemon %d at t = 0) | at s | phase s |\n|---|---:|---:|\n", victim);
  std::printf("| new mainstayd serving its port | %.3f | %.3f |\n", started_s, started_s);
  std::printf("| lease detection: placement epoch %lld -> %lld seen | %.3f | %.3f |\n", static_cast<long long>(epoch),
              static_cast<long long>(trainer.placement().epoch), detected_s, detected_s);
  std::printf("| restore: rank %d's shard of every bucket pullable at version %lld | %.3f | %.3f |\n", victim,
              static_cast<long long>(info.version), restored_s, restored_s - detected_s);
  std::printf("| every bucket pulled whole | %.3f | %.3f |\n", pulled_s, pulled_s - restored_s);
  std::printf("\nrank %d now on daemon %s; the daemons' own accounts:\n", victim, owner.c_str());
  for (int i = 0; i < flags.write_dp; ++i) {
    const int generation = i == victim ? 1 : 0;
    const std::string line = RestoreLine(testing::ReadFileOrEmpty(absl::StrCat(dir, "/daemon", i, ".", generation, ".log")));
    std::printf("  daemon %d%s: %s\n", i, i == victim ? " (restarted)" : "", line.empty() ? "(no restore line)" : line.c_str());
  }
  std::fflush(stdout);
  clients.clear();
  return absl::OkStatus();
}

}  // namespace mainstay::bench

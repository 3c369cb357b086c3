// Shared pieces of checkpoint_bench (checkpoint_bench.cc: writes and restores with in-process
// ShardDaemons; checkpoint_bench_restart.cc: a daemon restart with real processes).
#ifndef MAINSTAY_BENCH_CHECKPOINT_BENCH_H_
#define MAINSTAY_BENCH_CHECKPOINT_BENCH_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/job_spec.h"

namespace mainstay::bench {

using Clock = std::chrono::steady_clock;
inline double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Flags {
  double params = 64.0 * (1 << 20);  // model parameters (rounded to whole rows of 4096)
  std::string dir;                   // where checkpoints go; empty: a fresh directory under /tmp
  int reps = 3;                      // repetitions of each write / restore measurement
  int write_dp = 2;                  // D of the job that writes (one daemon per rank)
  int restore_dp = 4;                // D of the job restored into (on write_dp daemons)
  std::string recipe = "bf16_mixed";
  bool drop_cache = true;            // posix_fadvise(DONTNEED) the files before each read
  std::string coordinator_bin, daemon_bin;  // both set: part 3 runs with real processes
  int lease_ttl_ms = 1000;
};

// The benchmark's model: ceil(params / 2^24) weights of [rows x 4096], rows a multiple of 128.
JobSpec MakeSpec(const Flags& flags, int64_t dp, const std::string& name);

// Part 3: coordinator + write_dp daemons as processes, a job of the same size created and
// stepped through the client library, a checkpoint via the Admin RPC, SIGKILL of one daemon, a
// new one started; prints its table. Errors end the benchmark.
absl::Status RunRestart(const Flags& flags, const std::string& scratch_dir);

}  // namespace mainstay::bench

#endif  // MAINSTAY_BENCH_CHECKPOINT_BENCH_H_

// End-to-end step time of the vertical slice: a coordinator and D daemons (real processes on
// loopback), D trainer threads of this process with their own Client, one model of --params
// parameters in square weights. Each measured step: every trainer pushes its shard of every
// bucket (reduce-scattered FP32 gradients), finishes the step, and pulls every bucket of the new
// version (the all-gather through the daemons). Reported per phase, with the daemons' own phase
// times from StepStats, and the minor page faults taken during the step by the daemons (dflt_k)
// and by this process, the trainers (tflt_k), in thousands: first touches of memory in the step.
//
// Baseline, measured in the same run: the same update done in-process without the service (the
// fused AdamW + amax + quantize of the kernels over the whole model, on --baseline-threads
// threads). ratio = slice step time / in-process step time.
//
// With --move-at-step S, a spare daemon starts too, and just before step S the last rank's
// shards are moved to it (Admin.MoveShard, the live move of docs/daemon.md) while the trainers
// go on. Reported: the time from MoveShard until the spare had installed the copy (its log's
// "copied" line), the bytes of optimizer state moved, an in-process memcpy of as many bytes in
// the same run, and the step times before, during and after the move.
//
//   step_bench --coordinator-bin PATH --daemon-bin PATH [--params 256e6] [--dp 2] [--steps 3]
//              [--recipe bf16_with_fp8_current_scaling_mixed] [--daemon-threads 1]
//              [--daemon-device cpu|cuda:N]  (mainstayd --device: the daemons' shard state and step
//                                             on that GPU; the baselines stay on the CPU)
//              [--transport auto|grpc|ucx|nccl|cuda_ipc]  (UCX_TLS in the environment reaches the daemons too)
//              [--grads-on cpu|cuda:N]  (where the trainers' gradients are: on a GPU, each trainer's
//                                        shards are parts of one cudaMalloc block, pushed from there;
//                                        then also reported: the median push phase against a
//                                        cudaMemcpy device to device of as many bytes, same run;
//                                        with --transport cuda_ipc also each trainer's pull of its
//                                        shards into device memory, PullShardInto, against a
//                                        cudaMemcpy from pageable host memory)
//              [--move-at-step S] [--replication R [--kill-at-step S] [--lease-ttl-ms N]]
//              [--grad-norm 0.5]   (every step's global gradient norm; the job clips above 1)
//              [--readers N]       (then --steps more steps with N readers polling for new versions)
//              [--reader-bytes-per-sec B]  (the daemons' cap on readers' traffic, mainstayd's flag)
//              [--replica-copies on|off]   (ClientOptions::replica_copies; fwd_MB: the payload the
//                                           answering daemon still forwarded to its replicas)
//
// With --readers N, N reader threads (each its own Client with the job's reader token: the
// weight-serving path of docs/weight_serving.md) start after the measured steps, each read the
// newest version once (their first read, which faults their pull buffers in, timed apart), then
// poll while --steps more steps run: whenever a newer version is out, each pins the newest and
// reads it in full (every bucket, every tensor's published form), skipping versions when it is
// slower than the steps; reported: both medians and their ratio, and the versions read. Then
// one reader's full read of the last version against a trainer's pull of the same buckets and a
// memcpy of as many bytes, in the same run.
//
// Two baselines, measured in the same run: the whole model's update on --baseline-threads
// threads (the ratio the tables before 2026-12-06 report), and the in-process distributed
// optimizer the daemons replace: D ranks at once, each updating 1/D of the tensors on
// --daemon-threads threads (the same threads as the slice's daemons).
//
// With --replication R (2 or 3), max(D, R) daemons start and the measured job runs twice in the
// same run: with replication_factor 1, then R (docs/architecture.md, "Replicas"; the first job is
// deleted before the second starts). Reported: both medians and their ratio. With
// --kill-at-step S as well, the replicated run SIGKILLs the daemon of rank 0's primary just
// before its step S (its replicas take over after the lease, --lease-ttl-ms); reported: the time
// from the kill until every trainer's FinishStep(S) returned (the trainers push S again when it
// is ABORTED, as mainstay.torch does). That step is left out of the median.
// STEP_BENCH_PRINT_LOGS=1 prints the daemons' and the coordinator's logs at the end.
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#if MAINSTAY_STEP_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "kernels/cpu/executor.h"
#include "kernels/kernels.h"
#include "mainstay/client.h"
#include "mainstay/published.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Flags {
  std::string coordinator_bin, daemon_bin;
  double params = 256e6;
  int dp = 2;
  int steps = 3;
  int daemon_threads = 1;
  std::string daemon_device = "cpu";  // mainstayd --device
  int baseline_threads = 1;
  std::string recipe = "bf16_with_fp8_current_scaling_mixed";
  std::string transport = "auto";
  int grads_device = -1;  // --grads-on cuda:N: N; -1: host memory
  int move_at_step = -1;  // -1: no move
  int replication = 1;    // > 1: the job runs twice, at R = 1 then at R, on the same daemons
  int kill_at_step = -1;  // with replication: SIGKILL rank 0's daemon just before this step
  int lease_ttl_ms = 0;   // the daemons' --lease-ttl-ms; 0: the coordinator's default
  double grad_norm = 0.5; // of every step's gradients (max_grad_norm is 1: 0.5 does not clip)
  int readers = 0;        // > 0: --steps more steps with this many readers polling every version
  std::string reader_bytes_per_sec;  // non-empty: mainstayd --reader-bytes-per-sec (the readers' cap)
  bool replica_copies = true;  // ClientOptions::replica_copies of the trainers
};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "step_bench: %s\n", message.c_str());
  std::exit(1);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string name = argv[i], value = argv[i + 1];
    if (name == "--coordinator-bin") f.coordinator_bin = value;
    else if (name == "--daemon-bin") f.daemon_bin = value;
    else if (name == "--params") f.params = std::atof(value.c_str());
    else if (name == "--dp") f.dp = std::atoi(value.c_str());
    else if (name == "--steps") f.steps = std::atoi(value.c_str());
    else if (name == "--daemon-threads") f.daemon_threads = std::atoi(value.c_str());
    else if (name == "--daemon-device") f.daemon_device = value;
    else if (name == "--baseline-threads") f.baseline_threads = std::atoi(value.c_str());
    else if (name == "--recipe") f.recipe = value;
    else if (name == "--transport") f.transport = value;
    else if (name == "--grads-on") {
      if (value == "cpu") {
        f.grads_device = -1;
      } else if (!absl::StartsWith(value, "cuda:") || !absl::SimpleAtoi(value.substr(5), &f.grads_device) ||
                 f.grads_device < 0) {
        Die("--grads-on takes cpu or cuda:N, not " + value);
      }
    }
    else if (name == "--move-at-step") f.move_at_step = std::atoi(value.c_str());
    else if (name == "--replication") f.replication = std::atoi(value.c_str());
    else if (name == "--kill-at-step") f.kill_at_step = std::atoi(value.c_str());
    else if (name == "--lease-ttl-ms") f.lease_ttl_ms = std::atoi(value.c_str());
    else if (name == "--grad-norm") f.grad_norm = std::atof(value.c_str());
    else if (name == "--readers") f.readers = std::atoi(value.c_str());
    else if (name == "--reader-bytes-per-sec") f.reader_bytes_per_sec = value;
    else if (name == "--replica-copies") {
      if (value != "on" && value != "off") Die("--replica-copies takes on or off, not " + value);
      f.replica_copies = value == "on";
    }
    else Die("unknown flag " + name);
  }
  if (f.coordinator_bin.empty() || f.daemon_bin.empty()) Die("--coordinator-bin and --daemon-bin are required");
  if (f.dp < 1 || f.steps < 1 || f.params < 1e6) Die("bad --dp, --steps or --params");
  if (!(f.grad_norm > 0.0)) Die("--grad-norm must be > 0");
  if (f.readers < 0 || (f.readers > 0 && (f.replication > 1 || f.move_at_step > 0))) {
    Die("--readers must be >= 0 and does not combine with --replication or --move-at-step");
  }
  if (f.move_at_step == 0 || f.move_at_step > f.steps) Die("--move-at-step must be in [1, --steps] (step 0 warms up)");
  if (f.replication < 1 || f.replication > kMaxReplicationFactor) Die("--replication must be in [1, 3]");
  if (f.replication > 1 && f.move_at_step > 0) Die("--replication and --move-at-step do not combine");
  if (f.kill_at_step >= 0 && (f.replication < 2 || f.kill_at_step == 0 || f.kill_at_step > f.steps || f.steps < 2)) {
    Die("--kill-at-step needs --replication >= 2, --steps >= 2 and a step in [1, --steps]");
  }
  return f;
}

JobSpec MakeSpec(const Flags& f) {
  JobSpec spec;
  spec.name = "step-bench";
  spec.recipe = f.recipe;
  spec.data_parallel_size = f.dp;
  const int64_t side = 4096;
  const int64_t layers = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(f.params / (side * side))));
  for (int64_t l = 0; l < layers; ++l) {
    spec.tensors.push_back({absl::StrCat("layers.", l, ".mlp.fc.weight"), {side, side}});
  }
  return spec;
}

struct TrainerTimes {
  double push = 0, finish = 0, pull = 0, total = 0;
  StepStats stats;
};

// Device memory for --grads-on cuda:N: a trainer's shards as parts of one block (as a caching
// allocator hands them out), filled from `host` once.
#if MAINSTAY_STEP_BENCH_CUDA
std::vector<ElementSpan> OnDevice(int device, const std::vector<std::vector<float>>& host) {
  size_t floats = 0;
  for (const auto& h : host) floats += h.size() + 64;
  float* block = nullptr;
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&block), floats * sizeof(float)) != cudaSuccess) {
    Die(absl::StrCat("cudaMalloc of ", floats * sizeof(float), " bytes on cuda:", device, ": ",
                     cudaGetErrorString(cudaGetLastError())));
  }
  std::vector<ElementSpan> out;
  size_t offset = 0;
  for (const auto& h : host) {
    if (cudaMemcpy(block + offset, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
      Die(absl::StrCat("cudaMemcpy: ", cudaGetErrorString(cudaGetLastError())));
    }
    out.push_back(ElementSpan::Fp32(std::span<const float>(block + offset, h.size())));
    offset += h.size() + 64;
  }
  if (cudaDeviceSynchronize() != cudaSuccess) Die(cudaGetErrorString(cudaGetLastError()));
  return out;  // freed at exit
}
// Seconds of a cudaMemcpy device to device of `bytes` (median of 5, after a warm-up).
double DeviceCopySeconds(int device, int64_t bytes) {
  void *a = nullptr, *b = nullptr;
  if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
    Die(cudaGetErrorString(cudaGetLastError()));
  }
  std::vector<double> t;
  for (int i = 0; i < 6; ++i) {
    const Clock::time_point t0 = Clock::now();
    cudaMemcpy(b, a, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    if (i > 0) t.push_back(Seconds(t0, Clock::now()));
  }
  cudaFree(a);
  cudaFree(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
// `bytes` of device memory on `device` (freed at exit).
uint8_t* DeviceBytes(int device, int64_t bytes) {
  void* p = nullptr;
  if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
    Die(absl::StrCat("cudaMalloc of ", bytes, " bytes on cuda:", device, ": ", cudaGetErrorString(cudaGetLastError())));
  }
  return static_cast<uint8_t*>(p);
}
// Seconds of a cudaMemcpy of `bytes` from pageable host memory to the device (median of 5, after
// a warm-up): what a daemon whose versions are in host memory does for a pull into device memory.
double HostToDeviceSeconds(int device, int64_t bytes) {
  std::vector<uint8_t> host(static_cast<size_t>(bytes), 1);
  uint8_t* d = DeviceBytes(device, bytes);
  std::vector<double> t;
  for (int i = 0; i < 6; ++i) {
    const Clock::time_point t0 = Clock::now();
    cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
    if (i > 0) t.push_back(Seconds(t0, Clock::now()));
  }
  cudaFree(d);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
#else
std::vector<ElementSpan> OnDevice(int, const std::vector<std::vector<float>>&) {
  Die("--grads-on cuda:N: this step_bench was built without CUDA");
}
double DeviceCopySeconds(int, int64_t) { return 0; }
uint8_t* DeviceBytes(int, int64_t) { Die("--grads-on cuda:N: this step_bench was built without CUDA"); }
double HostToDeviceSeconds(int, int64_t) { return 0; }
#endif

// One measured step of one trainer: push every bucket's shard, finish, pull every bucket.
TrainerTimes Step(Client& c, int64_t step, const std::vector<ElementSpan>& grads) {
  TrainerTimes t;
  const Layout& layout = c.layout();
  const Clock::time_point t0 = Clock::now();
  Clock::time_point t1;
  // A step the daemons gave up (ABORTED: a daemon was lost mid-step) is pushed again.
  for (int attempt = 1;; ++attempt) {
    std::vector<PushHandle> pushes;
    for (const Bucket& b : layout.buckets) {
      pushes.push_back(c.PushGrad(b.index, step, grads[static_cast<size_t>(b.index)]));
    }
    absl::Status pushed;
    for (PushHandle& p : pushes) {
      if (absl::Status s = p.Wait().status(); !s.ok() && pushed.ok()) pushed = s;
    }
    t1 = Clock::now();
    absl::StatusOr<StepStats> stats = pushed.ok() ? c.FinishStep(step, 1e-4, 0.0) : absl::StatusOr<StepStats>(pushed);
    if (stats.ok()) {
      t.stats = *stats;
      break;
    }
    if (stats.status().code() != absl::StatusCode::kAborted || attempt == 8) Die(stats.status().ToString());
  }
  const Clock::time_point t2 = Clock::now();
  std::vector<PullHandle> pulls;
  for (const Bucket& b : layout.buckets) pulls.push_back(c.PullBucket(b.index, step + 1));
  for (PullHandle& p : pulls) {
    if (!p.Wait().ok()) Die(p.Wait().status().ToString());
  }
  const Clock::time_point t3 = Clock::now();
  t.push = Seconds(t0, t1);
  t.finish = Seconds(t1, t2);
  t.pull = Seconds(t2, t3);
  t.total = Seconds(t0, t3);
  return t;
}

// Moves the last rank to the spare daemon (node "spare") with Admin.MoveShard, and returns once
// the spare's log says it installed the copy.
absl::Status MoveLastRank(const std::string& coordinator, const Client& client, const std::string& spare_log) {
  auto channel = ::grpc::CreateChannel(coordinator, ::grpc::InsecureChannelCredentials());
  auto coord = v1::Coordinator::NewStub(channel);
  v1::ListDaemonsRequest list;
  v1::ListDaemonsResponse daemons;
  {
    ::grpc::ClientContext context;
    if (::grpc::Status s = coord->ListDaemons(&context, list, &daemons); !s.ok()) {
      return absl::UnavailableError("ListDaemons: " + s.error_message());
    }
  }
  std::string spare;
  for (const v1::DaemonInfo& d : daemons.daemons()) {
    if (d.endpoint().node_name() == "spare") spare = d.endpoint().daemon_id();
  }
  if (spare.empty()) return absl::NotFoundError("no spare daemon registered");
  v1::MoveShardRequest request;
  request.set_job_id(client.job_id());
  request.mutable_shard()->set_shard(client.layout().data_parallel_size - 1);
  request.set_to_daemon_id(spare);
  v1::MoveShardResponse response;
  {
    ::grpc::ClientContext context;
    auto admin = v1::Admin::NewStub(channel);
    if (::grpc::Status s = admin->MoveShard(&context, request, &response); !s.ok()) {
      return absl::FailedPreconditionError("MoveShard: " + s.error_message());
    }
  }
  const absl::Time give_up = absl::Now() + absl::Minutes(10);
  while (absl::Now() < give_up) {
    std::ifstream in(spare_log);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.find(": copied ") != std::string::npos) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::DeadlineExceededError("the spare did not install the copy within 10 minutes");
}

// The fastest of three in-process copies of `bytes` (first touch excluded).
// The fields of /proc/PID/stat after the command name (field 3, the state, is [0]); empty for
// a pid that is gone.
std::vector<std::string> ProcStat(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 > line.size()) return {};
  return absl::StrSplit(line.substr(paren + 2), ' ');
}

// CPU seconds (user + system) this process and `pids` have used so far: where the cores of a
// machine shared by every process of the bench went (a pid that is gone counts 0).
double CpuSeconds(const std::vector<pid_t>& pids) {
  rusage self;
  getrusage(RUSAGE_SELF, &self);
  double total = self.ru_utime.tv_sec + self.ru_utime.tv_usec / 1e6 + self.ru_stime.tv_sec + self.ru_stime.tv_usec / 1e6;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  for (pid_t pid : pids) {
    const std::vector<std::string> fields = ProcStat(pid);
    if (fields.size() > 12) total += (std::atof(fields[11].c_str()) + std::atof(fields[12].c_str())) / tick;
  }
  return total;
}

// Minor page faults so far: of `pids` together (the daemons) and of this process (the trainers).
// Faults inside a step are first touches of memory (a buffer allocated in the step).
std::pair<int64_t, int64_t> MinorFaults(const std::vector<pid_t>& pids) {
  int64_t others = 0;
  for (pid_t pid : pids) {
    const std::vector<std::string> fields = ProcStat(pid);
    if (fields.size() > 7) others += std::atoll(fields[7].c_str());
  }
  rusage self;
  getrusage(RUSAGE_SELF, &self);
  return {others, self.ru_minflt};
}

double MemcpySeconds(int64_t bytes) {
  std::vector<uint8_t> from(static_cast<size_t>(bytes), 1), to(static_cast<size_t>(bytes), 0);
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const Clock::time_point t0 = Clock::now();
    std::memcpy(to.data(), from.data(), from.size());
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  return best;
}

// The in-process update of the tensors t with t % stride == first: fused AdamW with amax, then
// quantize (no gradient-norm pass: the baseline is spared it).
double Baseline(const ResolvedJob& job, int threads, int reps, float grad_value, size_t first = 0, size_t stride = 1) {
  kernels::CpuExecutor executor(threads);
  const kernels::Device device{kernels::Device::Kind::kCpu, &executor, nullptr};
  double best = 1e30;
  std::vector<std::vector<float>> master, m, v, grad;
  std::vector<std::vector<uint8_t>> out;
  std::vector<size_t> mine;
  for (size_t i = first; i < job.layout.tensors.size(); i += stride) mine.push_back(i);
  for (size_t i : mine) {
    const LayoutTensor& t = job.layout.tensors[i];
    master.emplace_back(t.numel, 0.01f);
    m.emplace_back(t.numel, 0.0f);
    v.emplace_back(t.numel, 0.0f);
    grad.emplace_back(t.numel, grad_value);
    out.emplace_back(DataBytes(t.format, t.numel));
  }
  for (int r = 0; r < reps; ++r) {
    const Clock::time_point t0 = Clock::now();
    for (size_t k = 0; k < mine.size(); ++k) {
      const LayoutTensor& t = job.layout.tensors[mine[k]];
      const kernels::Fragment frag{View2D(t.shape), {0, t.numel}};
      float amax = 0.0f;
      kernels::StepOutputs so;
      so.amax.tensor_amax = &amax;
      kernels::AdamWHyper h{1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, r + 1, 1.0f};
      if (!kernels::FusedAdamW(device, t.format, job.recipe.model_dtype, frag, {grad[k].data(), ElementType::kFloat32},
                               {master[k].data(), m[k].data(), v[k].data(), ElementType::kFloat32}, h, so)
               .ok()) {
        Die("baseline FusedAdamW failed");
      }
      kernels::ScaleInputs in;
      in.tensor_amax = amax;
      if (!kernels::Quantize(device, t.format, job.recipe.model_dtype, frag, master[k], in, {out[k], {}, nullptr}).ok()) {
        Die("baseline Quantize failed (use a recipe with per-tensor scales)");
      }
    }
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  return best;
}

// The in-process distributed optimizer on the same threads as the slice's daemons: D ranks at
// once (threads of this process), each updating 1/D of the tensors on `threads` threads.
// Returns the slowest rank's best time.
double PerRankBaseline(const ResolvedJob& job, int ranks, int threads, int reps, float grad_value) {
  std::vector<double> times(static_cast<size_t>(ranks));
  std::vector<std::thread> workers;
  for (int r = 0; r < ranks; ++r) {
    workers.emplace_back([&, r] {
      times[static_cast<size_t>(r)] =
          Baseline(job, threads, reps, grad_value, static_cast<size_t>(r), static_cast<size_t>(ranks));
    });
  }
  for (std::thread& w : workers) w.join();
  return *std::max_element(times.begin(), times.end());
}

// A reader: reads every version published after `from` in full (every bucket, every tensor's
// published form) until `stop`; a version gone before it was read is skipped for the newest.
struct ReaderTally {
  std::atomic<int64_t> versions{0}, bytes{0};
};

int64_t ReadVersion(Client& reader, int64_t version, int64_t* bytes,
                    std::chrono::milliseconds wait = std::chrono::milliseconds(0)) {
  const Layout& layout = reader.layout();
  std::vector<PullHandle> pulls;
  for (const Bucket& b : layout.buckets) pulls.push_back(reader.PullBucket(b.index, version, wait));
  std::vector<PulledBucket> pulled;
  for (PullHandle& p : pulls) {
    absl::StatusOr<PulledBucket> got = p.Wait();
    if (!got.ok()) return -1;
    pulled.push_back(*std::move(got));
  }
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    absl::StatusOr<std::vector<NamedTensor>> named =
        PublishedTensors(pulled[static_cast<size_t>(layout.tensors[t].bucket)], static_cast<int32_t>(t));
    if (!named.ok()) Die("PublishedTensors: " + named.status().ToString());
    for (const NamedTensor& n : *named) *bytes += static_cast<int64_t>(n.bytes().size());
  }
  return version;
}

// Polls as an inference engine's refit does: whenever a version newer than the last one it read
// is out, pins the newest (so that training cannot evict it mid-read), reads it whole, releases
// the pin. A reader slower than the steps skips versions rather than falling behind.
void ReaderLoop(Client& reader, int64_t from, const std::atomic<bool>& stop, ReaderTally& tally) {
  int64_t version = from;
  while (!stop.load()) {
    absl::StatusOr<VersionPin> pin = reader.PinNewestVersion(std::chrono::minutes(1));
    if (!pin.ok() || pin->version <= version) {
      if (pin.ok()) reader.ReleasePin(*pin).IgnoreError();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a step takes ~1 s here
      continue;
    }
    int64_t bytes = 0;
    if (ReadVersion(reader, pin->version, &bytes) >= 0) {
      version = pin->version;
      tally.versions += 1;
      tally.bytes += bytes;
    }
    reader.ReleasePin(*pin).IgnoreError();
  }
}

int Main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  const JobSpec spec = MakeSpec(f);
  absl::StatusOr<ResolvedJob> job = ResolveJob(spec);
  if (!job.ok()) Die(job.status().ToString());
  int64_t params = 0;
  for (const LayoutTensor& t : job->layout.tensors) params += t.numel;
  std::printf("model: %zu tensors [4096 x 4096], %.1fM parameters, recipe %s, D=%d, %zu buckets; daemons on %s\n",
              job->layout.tensors.size(), params / 1e6, f.recipe.c_str(), f.dp, job->layout.buckets.size(),
              f.daemon_device.c_str());

  std::printf("baseline: in-process fused AdamW + amax + quantize of the whole model on %d thread(s)...\n",
              f.baseline_threads);
  std::fflush(stdout);
  // Every element of every step's gradient: the global norm is --grad-norm.
  const float grad_value = static_cast<float>(f.grad_norm / std::sqrt(static_cast<double>(params)));
  const double baseline = Baseline(*job, f.baseline_threads, 3, grad_value);
  std::printf("baseline: the in-process distributed optimizer, %d ranks at once on %d thread(s) each...\n", f.dp,
              f.daemon_threads);
  std::fflush(stdout);
  const double per_rank = PerRankBaseline(*job, f.dp, f.daemon_threads, 3, grad_value);

  auto dir = testing::TempDir::Create("mainstay-step-bench");
  if (!dir.ok()) Die(dir.status().ToString());
  auto coordinator = testing::Subprocess::Start({{f.coordinator_bin, "--listen", "127.0.0.1:0", "--state-dir",
                                                  (*dir)->File("state"), "--port-file", (*dir)->File("cport")},
                                                 (*dir)->File("coordinator.log")});
  if (!coordinator.ok()) Die(coordinator.status().ToString());
  absl::StatusOr<int> cport = testing::WaitForPortFile((*dir)->File("cport"), **coordinator, absl::Seconds(60));
  if (!cport.ok()) Die(cport.status().ToString());
  const std::string address = absl::StrCat("127.0.0.1:", *cport);
  std::vector<std::unique_ptr<testing::Subprocess>> daemons;
  const bool move = f.move_at_step > 0;
  const int num_daemons = std::max(f.dp + (move ? 1 : 0), f.replication);
  for (int i = 0; i < num_daemons; ++i) {  // with a move, the last one is its spare
    const std::string port_file = (*dir)->File(absl::StrCat("dport", i));
    std::vector<std::string> argv = {f.daemon_bin, "--coordinator", address, "--listen", "127.0.0.1:0",
                                     "--node-name", i == f.dp ? std::string("spare") : absl::StrCat("node", i), "--threads",
                                     std::to_string(f.daemon_threads), "--retained-versions", "2", "--metrics-listen", "off",
                                     "--port-file", port_file};
    if (f.lease_ttl_ms > 0) argv.insert(argv.end(), {"--lease-ttl-ms", std::to_string(f.lease_ttl_ms)});
    if (f.daemon_device != "cpu") argv.insert(argv.end(), {"--device", f.daemon_device});
    if (!f.reader_bytes_per_sec.empty()) argv.insert(argv.end(), {"--reader-bytes-per-sec", f.reader_bytes_per_sec});
    auto d = testing::Subprocess::Start({argv, (*dir)->File(absl::StrCat("daemon", i, ".log"))});
    if (!d.ok()) Die(d.status().ToString());
    if (!testing::WaitForPortFile(port_file, **d, absl::Seconds(60)).ok()) Die("daemon did not start");
    daemons.push_back(*std::move(d));
  }
  // Trainer r on node r: its shards are placed on daemon r (locality).
  std::map<int, double> cpu_of;  // replication factor -> CPU seconds of every process per step
  auto run_job = [&](int replication) -> double {
    JobSpec placed = spec;
    placed.name = absl::StrCat(spec.name, "-r", replication);
    placed.replication_factor = replication;
    for (int r = 0; r < f.dp; ++r) placed.trainer_nodes.push_back(absl::StrCat("node", r));
    std::printf("\njob with replication_factor %d\n", replication);
    std::vector<std::unique_ptr<Client>> clients;
    for (int r = 0; r < f.dp; ++r) {
      ClientOptions o;
      o.coordinator = address;
      o.rank = r;
      o.transport = f.transport;
      o.replica_copies = f.replica_copies;
      o.timeout = std::chrono::minutes(10);
      if (r == 0) {
        o.job_spec_json = JobSpecToJson(placed);
      } else {
        o.job_id = clients[0]->job_id();
        o.job_token = clients[0]->job_token();
      }
      absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
      if (!c.ok()) Die(c.status().ToString());
      clients.push_back(*std::move(c));
    }
    for (const DataConnection& c : clients[0]->connections()) {
      std::printf("rank 0 -> %s: %s%s\n", c.daemon_id.c_str(), c.transport.c_str(),
                  c.note.empty() ? "" : (" (" + c.note + ")").c_str());
    }
    const Layout& layout = clients[0]->layout();
    std::printf("setup: initial parameters (version 0)...\n");
    std::fflush(stdout);
    {
      std::vector<std::thread> threads;
      for (int r = 0; r < f.dp; ++r) {
        threads.emplace_back([&, r] {
          for (const Bucket& b : layout.buckets) {
            std::vector<float> shard(static_cast<size_t>(b.shard_numel), 0.01f);
            if (!clients[static_cast<size_t>(r)]->PushInitialParams(b.index, shard).Wait().ok()) Die("initial push failed");
          }
        });
      }
      for (std::thread& t : threads) t.join();
    }
    std::vector<std::vector<std::vector<float>>> host_grads(static_cast<size_t>(f.dp));
    std::vector<std::vector<ElementSpan>> grads(static_cast<size_t>(f.dp));
    for (size_t r = 0; r < host_grads.size(); ++r) {
      for (const Bucket& b : layout.buckets) host_grads[r].emplace_back(static_cast<size_t>(b.shard_numel), grad_value);
      if (f.grads_device >= 0) {
        grads[r] = OnDevice(f.grads_device, host_grads[r]);
      } else {
        for (const auto& h : host_grads[r]) grads[r].push_back(ElementSpan::Fp32(h));
      }
    }
    std::vector<double> push_times;  // the slowest trainer's push phase, measured steps
    std::printf("%6s %9s %9s %9s %9s | daemon: %8s %8s %8s %8s %8s %8s %6s %7s | %7s %7s\n", "step", "total_s", "push_s",
                "finish_s", "pull_s", "wait_ms", "stats_ms", "rstat_ms", "probe_ms", "ramax_ms", "apply_ms", "clip",
                "fwd_MB", "dflt_k", "tflt_k");
    std::vector<double> totals;
    // Every process's CPU over the measured steps (steps 1..--steps).
    auto pids = [&] {
      std::vector<pid_t> out = {(*coordinator)->pid()};
      for (const auto& d : daemons) out.push_back(d->pid());
      return out;
    };
    double cpu_start = 0, cpu_per_step = 0, wall_per_step = 0;
    Clock::time_point wall_start;
    std::thread mover;
    double move_s = -1;
    double failover_s = -1;  // --kill-at-step: from the kill until every trainer's FinishStep returned
    int64_t move_done_step = -1;
    std::atomic<int64_t> current_step{0};
    std::vector<double> read_totals;  // the steps with readers polling
    std::vector<std::unique_ptr<Client>> readers;
    std::vector<std::thread> reader_threads;
    std::vector<ReaderTally> tallies(static_cast<size_t>(f.readers));
    std::atomic<bool> stop_readers{false};
    const int64_t last_step = f.readers > 0 ? 2 * f.steps : f.steps;
    for (int64_t step = 0; step < last_step + 1; ++step) {  // step 0 is a warm-up
      if (f.readers > 0 && step == f.steps + 1) {
        absl::StatusOr<std::string> token = clients[0]->GetReaderToken();
        if (!token.ok()) Die(token.status().ToString());
        for (int r = 0; r < f.readers; ++r) {
          ClientOptions o;
          o.coordinator = address;
          o.job_id = clients[0]->job_id();
          o.reader_token = *token;
          o.transport = f.transport;
          o.timeout = std::chrono::minutes(10);
          absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
          if (!c.ok()) Die(c.status().ToString());
          readers.push_back(*std::move(c));
        }
        // Each reader first reads the newest version once, before the measured steps: its pull
        // buffers are new memory, page-faulted in on that first read (a one-time cost, like a
        // trainer's, whose client fills its pool at Connect), reported apart.
        const Clock::time_point warm = Clock::now();
        std::vector<std::thread> first_reads;
        for (int r = 0; r < f.readers; ++r) {
          first_reads.emplace_back([&, r] {
            int64_t bytes = 0;
            if (ReadVersion(*readers[static_cast<size_t>(r)], step, &bytes) < 0) Die("a reader's first read failed");
          });
        }
        for (std::thread& t : first_reads) t.join();
        std::printf("readers' first read of version %lld (their buffers faulted in; not in the steps below): %.2f s\n",
                    static_cast<long long>(step), Seconds(warm, Clock::now()));
        for (int r = 0; r < f.readers; ++r) {
          reader_threads.emplace_back([&, r] { ReaderLoop(*readers[static_cast<size_t>(r)], step, stop_readers, tallies[static_cast<size_t>(r)]); });
        }
        std::printf("%d reader(s) polling from here\n", f.readers);
      }
      current_step = step;
      if (step == 1) {
        cpu_start = CpuSeconds(pids());
        wall_start = Clock::now();
      }
      if (step == f.move_at_step) {
        mover = std::thread([&] {
          const Clock::time_point t0 = Clock::now();
          absl::Status s = MoveLastRank(address, *clients[0], (*dir)->File(absl::StrCat("daemon", f.dp, ".log")));
          if (!s.ok()) Die(s.ToString());
          move_s = Seconds(t0, Clock::now());
          move_done_step = current_step.load();
        });
      }
      const bool kill_now = replication > 1 && step == f.kill_at_step;
      Clock::time_point killed_at;
      if (kill_now) {
        killed_at = Clock::now();
        if (!daemons[0]->Kill().ok()) Die("could not kill daemon 0");
        std::printf("SIGKILL of daemon 0 (rank 0's primary) before step %lld\n", static_cast<long long>(step));
      }
      std::vector<TrainerTimes> times(static_cast<size_t>(f.dp));
      std::vector<pid_t> daemon_pids;
      for (const auto& d : daemons) daemon_pids.push_back(d->pid());
      const std::pair<int64_t, int64_t> faults_before = MinorFaults(daemon_pids);
      const Clock::time_point t_steps = Clock::now();
      std::vector<std::thread> threads;
      for (int r = 0; r < f.dp; ++r) {
        threads.emplace_back([&, r] {
          times[static_cast<size_t>(r)] = Step(*clients[static_cast<size_t>(r)], step, grads[static_cast<size_t>(r)]);
        });
      }
      for (std::thread& t : threads) t.join();
      TrainerTimes slowest = *std::max_element(times.begin(), times.end(),
                                               [](const TrainerTimes& a, const TrainerTimes& b) { return a.total < b.total; });
      const StepStats::Phases& ph = slowest.stats.phases;
      const std::pair<int64_t, int64_t> faults_after = MinorFaults(daemon_pids);
      std::printf("%6lld %9.2f %9.2f %9.2f %9.2f |         %8.0f %8.0f %8.0f %8.0f %8.0f %8.0f %6.3f %7.0f | %7.1f %7.1f%s\n",
                  static_cast<long long>(step), slowest.total, slowest.push, slowest.finish, slowest.pull,
                  ph.wait_inputs_ms, ph.grad_stats_ms, ph.reduce_stats_ms, ph.update_ms, ph.reduce_amax_ms,
                  ph.quantize_ms, slowest.stats.clip_factor, slowest.stats.forwarded_bytes / 1e6,
                  (faults_after.first - faults_before.first) / 1e3, (faults_after.second - faults_before.second) / 1e3,
                  step == 0 ? "  (warm-up)" : step == f.move_at_step ? "  (move starts)" : "");
      if (kill_now) {
        double finished = 0;  // the last trainer's FinishStep(step) return, after the kill
        for (const TrainerTimes& t : times) finished = std::max(finished, t.push + t.finish);
        failover_s = Seconds(killed_at, t_steps) + finished;
        continue;
      }
      if (step > f.steps) {
        read_totals.push_back(slowest.total);
      } else if (step > 0) {
        totals.push_back(slowest.total);
        push_times.push_back(slowest.push);
      }
      if (step == f.steps) {
        cpu_per_step = (CpuSeconds(pids()) - cpu_start) / f.steps;
        wall_per_step = Seconds(wall_start, Clock::now()) / f.steps;
      }
    }
    if (mover.joinable()) mover.join();
    if (f.grads_device >= 0 && !push_times.empty()) {
      int64_t pushed = 0;  // one trainer's gradient bytes per step
      for (const Bucket& b : layout.buckets) pushed += b.shard_numel * 4;
      std::sort(push_times.begin(), push_times.end());
      const double push_s = push_times[push_times.size() / 2];
      const double copy_s = DeviceCopySeconds(f.grads_device, pushed);
      std::printf("\npushes from cuda:%d over %s: %.3f GB per trainer in %.3f s (median push phase, %d trainers at "
                  "once); cudaMemcpy device to device of as many bytes in-process: %.4f s; ratio copy/push %.2f\n",
                  f.grads_device, f.transport.c_str(), pushed / 1e9, push_s, f.dp, copy_s, copy_s / push_s);
    }
    if (f.grads_device >= 0 && f.transport == "cuda_ipc" && !push_times.empty()) {
      // Pulls into device memory (Client::PullShardInto): each trainer its own shard of every
      // bucket of the last version, all trainers at once; the first of four rounds warms up.
      int64_t pulled = 0;  // one trainer's packed bytes
      for (const Bucket& b : layout.buckets) pulled += DataBytes(b.format, b.shard_numel);
      std::vector<uint8_t*> dest;
      for (int r = 0; r < f.dp; ++r) dest.push_back(DeviceBytes(f.grads_device, pulled));
      std::vector<double> rounds;
      for (int round = 0; round < 4; ++round) {
        const Clock::time_point t0 = Clock::now();
        std::vector<std::thread> pullers;
        for (int r = 0; r < f.dp; ++r) {
          pullers.emplace_back([&, r] {
            std::vector<ShardPullHandle> handles;
            int64_t offset = 0;
            for (const Bucket& b : layout.buckets) {
              const int64_t bytes = DataBytes(b.format, b.shard_numel);
              handles.push_back(clients[static_cast<size_t>(r)]->PullShardInto(
                  b.index, r, last_step + 1, dest[static_cast<size_t>(r)] + offset, bytes));
              offset += bytes;
            }
            for (ShardPullHandle& h : handles) {
              if (!h.Wait().ok()) Die("PullShardInto: " + h.Wait().status().ToString());
            }
          });
        }
        for (std::thread& t : pullers) t.join();
        if (round > 0) rounds.push_back(Seconds(t0, Clock::now()));
      }
      std::sort(rounds.begin(), rounds.end());
      const double pull_s = rounds[rounds.size() / 2];
      const double copy_s = HostToDeviceSeconds(f.grads_device, pulled);
      std::printf("pulls into cuda:%d over cuda_ipc: %.3f GB per trainer (its shard of every bucket) in %.3f s "
                  "(median of 3, %d trainers at once); cudaMemcpy pageable host to device of as many bytes "
                  "in-process: %.4f s; ratio copy/pull %.2f\n",
                  f.grads_device, pulled / 1e9, pull_s, f.dp, copy_s, copy_s / pull_s);
    }
    if (failover_s >= 0) {
      std::printf("failover: step %d committed on every trainer %.2f s after the SIGKILL of rank 0's daemon "
                  "(lease TTL %s; target: TTL + 1 s)\n",
                  f.kill_at_step, failover_s,
                  f.lease_ttl_ms > 0 ? absl::StrCat(f.lease_ttl_ms, " ms").c_str() : "the coordinator's default, 10000 ms");
    }
    if (move) {
      int64_t state_bytes = 0;
      const int64_t moment_bytes = BitsOf(job->spec.optimizer.moment_dtype) / 8;
      for (const Bucket& b : layout.buckets) state_bytes += b.shard_numel * (4 + 2 * moment_bytes);
      const double copy_s = MemcpySeconds(state_bytes);
      std::printf("\nmove of rank %d before step %d: %.2f GB of optimizer state (masters and moments) in %.2f s "
                  "(installed during step %lld); memcpy of as many bytes in-process: %.3f s; ratio %.1f\n",
                  f.dp - 1, f.move_at_step, state_bytes / 1e9, move_s, static_cast<long long>(move_done_step), copy_s,
                  move_s / copy_s);
    }
    stop_readers = true;
    for (std::thread& t : reader_threads) t.join();
    std::sort(totals.begin(), totals.end());
    const double median = totals[totals.size() / 2];
    if (f.readers > 0) {
      std::sort(read_totals.begin(), read_totals.end());
      const double with_readers = read_totals[read_totals.size() / 2];
      int64_t versions = 0, bytes = 0;
      for (const ReaderTally& t : tallies) {
        versions += t.versions;
        bytes += t.bytes;
      }
      std::printf("\nstep with %d reader(s) polling: %.2f s against %.2f s without, same run: ratio %.2f "
                  "(the readers read %lld versions, %.2f GB)\n",
                  f.readers, with_readers, median, with_readers / median, static_cast<long long>(versions),
                  static_cast<double>(bytes) / 1e9);
      // One reader's full read of the last version against a trainer's pull of it and a memcpy.
      const int64_t last = last_step + 1;
      double read_s = 1e30, pull_s = 1e30;
      int64_t read_bytes = 0;
      for (int rep = 0; rep < 3; ++rep) {
        Clock::time_point t0 = Clock::now();
        read_bytes = 0;
        if (ReadVersion(*readers[0], last, &read_bytes) < 0) Die("the reader could not read the last version");
        read_s = std::min(read_s, Seconds(t0, Clock::now()));
        t0 = Clock::now();
        std::vector<PullHandle> pulls;
        for (const Bucket& b : layout.buckets) pulls.push_back(clients[0]->PullBucket(b.index, last));
        for (PullHandle& p : pulls) {
          if (!p.Wait().ok()) Die(p.Wait().status().ToString());
        }
        pull_s = std::min(pull_s, Seconds(t0, Clock::now()));
      }
      const double copy_s = MemcpySeconds(read_bytes);
      std::printf("full read of version %lld by a reader: %.2f GB in %.3f s (%.2f GB/s); a trainer's pull of it: "
                  "%.3f s (%.2f GB/s): ratio %.2f; memcpy of as many bytes %.3f s\n",
                  static_cast<long long>(last), read_bytes / 1e9, read_s, read_bytes / 1e9 / read_s, pull_s,
                  read_bytes / 1e9 / pull_s, pull_s / read_s, copy_s);
      readers.clear();
    }
    std::printf("slice step at R=%d (median of %zu): %.2f s\n", replication, totals.size(), median);
    if (f.kill_at_step < 0 && wall_per_step > 0) {
      std::printf("CPU of every process (coordinator, daemons, trainers) per measured step: %.2f s, in %.2f s of wall: "
                  "%.2f of the %u cores busy\n",
                  cpu_per_step, wall_per_step, cpu_per_step / wall_per_step, std::thread::hardware_concurrency());
      cpu_of[replication] = cpu_per_step;
    }
    const std::string job_id = clients[0]->job_id();
    clients.clear();
    {
      auto channel = ::grpc::CreateChannel(address, ::grpc::InsecureChannelCredentials());
      v1::DeleteJobRequest request;
      request.set_job_id(job_id);
      v1::DeleteJobResponse response;
      ::grpc::ClientContext context;
      if (::grpc::Status st = v1::Coordinator::NewStub(channel)->DeleteJob(&context, request, &response); !st.ok()) {
        Die("DeleteJob: " + st.error_message());
      }
    }
    return median;
  };
  const double median = run_job(1);
  if (f.replication > 1) {
    const double replicated = run_job(f.replication);
    if (f.kill_at_step > 0) {
      // (After the kill the job runs on fewer copies: its median is not the price of R.)
      std::printf("\n(no replication ratio with --kill-at-step: the steps after the kill run with fewer copies)\n");
    } else {
      std::printf("\nreplication_factor %d: step %.2f s against %.2f s at R=1 in the same run: ratio %.2f\n",
                  f.replication, replicated, median, replicated / median);
      if (cpu_of.count(1) && cpu_of.count(f.replication)) {
        // Where every core is busy, the step time cannot grow by less than the work does.
        std::printf("CPU per step, every process: %.2f s against %.2f s at R=1: ratio %.2f\n", cpu_of[f.replication],
                    cpu_of[1], cpu_of[f.replication] / cpu_of[1]);
      }
    }
  }
  std::printf("\nslice step (median of %d): %.2f s; in-process baseline (whole model, %d thread(s)): %.2f s; "
              "ratio %.2f\n",
              f.steps, median, f.baseline_threads, baseline, median / baseline);
  std::printf("in-process distributed optimizer (%d ranks at once, %d thread(s) each, as the daemons): %.2f s; "
              "ratio %.2f\n",
              f.dp, f.daemon_threads, per_rank, median / per_rank);
  int64_t published = 0;
  for (const LayoutTensor& t : job->layout.tensors) published += DataBytes(t.format, t.numel);
  std::printf("per step and trainer: pushed %.2f GB (its FP32 gradient shards), pulled %.2f GB (every bucket, "
              "quantized)\n",
              static_cast<double>(params) * 4 / f.dp / 1e9, static_cast<double>(published) / 1e9);
  if (std::getenv("STEP_BENCH_PRINT_LOGS") != nullptr) {  // for looking into a slow step
    for (int i = 0; i < num_daemons; ++i) {
      std::fprintf(stderr, "--- daemon %d\n%s", i, testing::ReadFileOrEmpty((*dir)->File(absl::StrCat("daemon", i, ".log"))).c_str());
    }
    std::fprintf(stderr, "--- coordinator\n%s", testing::ReadFileOrEmpty((*dir)->File("coordinator.log")).c_str());
  }
  return 0;
}

}  // namespace
}  // namespace mainstay

int main(int argc, char** argv) { return mainstay::Main(argc, argv); }

#include "kernels/cpu/executor.h"

#include <sched.h>

#include <algorithm>
#include <fstream>
#include <cstdlib>
#include <string>

namespace mainstay::kernels {

namespace {

// The cgroup v2 CPU quota of this process in cores (rounded up), or 0 for none: the
// process's cgroup from /proc/self/cgroup ("0::/path"), then its cpu.max.
int CgroupQuotaCores() {
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(cgroup, line)) {
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  }
  if (path.empty()) return 0;
  // Inside a container the cgroup namespace makes the path "/"; its limit is at the root.
  for (const std::string& dir : {"/sys/fs/cgroup" + path, std::string("/sys/fs/cgroup")}) {
    std::ifstream max(dir + "/cpu.max");
    std::string quota;
    long long period = 0;
    if (!(max >> quota >> period)) continue;
    if (quota == "max" || period <= 0) return 0;
    const long long q = std::atoll(quota.c_str());
    if (q <= 0) return 0;
    return static_cast<int>((q + period - 1) / period);
  }
  return 0;
}

}  // namespace

int AvailableCores() {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (const int quota = CgroupQuotaCores(); quota > 0) cores = std::min(cores, quota);
  return std::max(cores, 1);
}

CpuExecutor::CpuExecutor(int threads) {
  if (threads <= 0) threads = AvailableCores();
  workers_.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

CpuExecutor::~CpuExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void CpuExecutor::RunTasks() {
  // Called with mu_ unlocked; claims task indices one at a time.
  while (true) {
    int64_t i;
    const std::function<void(int64_t)>* fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fn_ == nullptr || next_ >= total_) return;
      i = next_++;
      fn = fn_;
    }
    (*fn)(i);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++finished_ == total_) done_.notify_all();
    }
  }
}

void CpuExecutor::WorkerLoop() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunTasks();
  }
}

void CpuExecutor::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    next_ = 0;
    total_ = n;
    finished_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  RunTasks();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return finished_ == total_; });
  fn_ = nullptr;
}

}  // namespace mainstay::kernels

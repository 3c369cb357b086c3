// A fixed pool of worker threads for the CPU kernels.
//
// ParallelFor(n, fn) runs fn(0) .. fn(n-1), each exactly once, spread over the workers and
// the calling thread, and returns when all are done. Kernels split work into fixed-size
// chunks that do not depend on the thread count, and combine per-chunk partial results in
// chunk order, so results are identical for any number of threads.
//
// Thread safety: ParallelFor may be called from several threads; calls are serialized.
// Ownership: the executor owns its threads; destroying it joins them.
#ifndef MAINSTAY_KERNELS_CPU_EXECUTOR_H_
#define MAINSTAY_KERNELS_CPU_EXECUTOR_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mainstay::kernels {

// The cores this process may use: the CPUs of its affinity mask (sched_getaffinity, e.g.
// taskset or a cpuset cgroup), capped by a cgroup v2 CPU quota (cpu.max "quota period",
// rounded up; Kubernetes' CPU limit). At least 1.
int AvailableCores();

class CpuExecutor {
 public:
  // `threads` = total threads used by ParallelFor, the caller included; 0 = AvailableCores().
  explicit CpuExecutor(int threads = 0);
  ~CpuExecutor();
  CpuExecutor(const CpuExecutor&) = delete;
  CpuExecutor& operator=(const CpuExecutor&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunTasks();

  std::mutex call_mu_;  // serializes ParallelFor calls
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t)>* fn_ = nullptr;  // guarded by mu_
  int64_t next_ = 0;                                   // guarded by mu_
  int64_t total_ = 0;                                  // guarded by mu_
  int64_t finished_ = 0;                               // guarded by mu_
  uint64_t generation_ = 0;                            // guarded by mu_
  bool stop_ = false;                                  // guarded by mu_
  std::vector<std::thread> workers_;
};

// Runs fn(0..n-1) on `executor`, or inline when it is nullptr.
inline void ParallelFor(CpuExecutor* executor, int64_t n, const std::function<void(int64_t)>& fn) {
  if (executor == nullptr || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
  } else {
    executor->ParallelFor(n, fn);
  }
}

}  // namespace mainstay::kernels

#endif  // MAINSTAY_KERNELS_CPU_EXECUTOR_H_

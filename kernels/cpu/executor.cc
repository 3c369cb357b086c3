#include "kernels/cpu/executor.h"

namespace mainstay::kernels {

CpuExecutor::CpuExecutor(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  if (threads <= 0) threads = 1;
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

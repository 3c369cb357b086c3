#include "client/src/thread_pool.h"

#include <algorithm>
#include <utility>

namespace mainstay::client_internal {

ThreadPool::ThreadPool(int max_threads) : max_threads_(std::max(1, max_threads)) {}

ThreadPool::~ThreadPool() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

void ThreadPool::Schedule(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
  // Start a thread when none is idle to take the task (idle ones wake up on the queue change).
  if (idle_ < static_cast<int>(queue_.size()) && static_cast<int>(threads_.size()) < max_threads_) {
    threads_.emplace_back([this] { WorkerLoop(); });
  }
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      ++idle_;
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&has_work));
      --idle_;
      // Drain the queue before stopping: every queued task completes its promise.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace mainstay::client_internal

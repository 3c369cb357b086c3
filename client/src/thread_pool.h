// A small thread pool for the client's blocking gRPC calls: threads start on demand up to
// `max_threads` and run queued tasks in FIFO order. Tasks must not block on other tasks of the
// same pool (the client completes multi-shard operations with a countdown instead).
//
// Thread safety: Schedule may be called from any thread, tasks included. The destructor runs
// every task already queued, then joins.
#ifndef MAINSTAY_CLIENT_SRC_THREAD_POOL_H_
#define MAINSTAY_CLIENT_SRC_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace mainstay::client_internal {

class ThreadPool {
 public:
  explicit ThreadPool(int max_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> task);

 private:
  void WorkerLoop();

  const int max_threads_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mainstay::client_internal

#endif  // MAINSTAY_CLIENT_SRC_THREAD_POOL_H_

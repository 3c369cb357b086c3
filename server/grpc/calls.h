// Shared plumbing of the gRPC services (coordinator and shard daemon): call tracking for a
// graceful shutdown, helper threads for calls that wait, and unary answers from absl results.
//
// Thread safety: Calls is thread-safe; see each member.
#ifndef MAINSTAY_SERVER_GRPC_CALLS_H_
#define MAINSTAY_SERVER_GRPC_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/error_detail.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "server/grpc/waiters.h"

namespace mainstay::grpc_server {

// The gRPC status for `status`; an ErrorDetail payload (common/error_detail.h) goes into the
// call's trailing metadata under kErrorDetailMetadataKey.
inline ::grpc::Status ToGrpcWithDetail(::grpc::ServerContextBase* context, const absl::Status& status) {
  if (std::optional<v1::ErrorDetail> detail = GetErrorDetail(status); detail.has_value()) {
    context->AddTrailingMetadata(kErrorDetailMetadataKey, detail->SerializeAsString());
  }
  return ToGrpcStatus(status);
}

inline absl::Time CallDeadline(const ::grpc::CallbackServerContext* context) {
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// Calls in progress. Every handler Enters before it touches the core and Exits once it has
// finished its call. Calls that wait for the core's state (PullParams, FinishStep, KvGet with
// wait_ms, WatchPlacement) hold no thread while they wait: they are parked in a Waiters
// (AnswerWhenReady below). Calls that work for long (a checkpoint write, a state copy, an NCCL
// transfer) run on a thread of their own (Spawn), so gRPC's callback threads never block for
// long; those are internal or bounded by the transfers a trainer can have in flight.
//
// Shutdown drains here first: grpc::Server::Shutdown waits not only for calls but also for
// every client connection to close, and idle ones (every daemon keeps one) stay open until
// its deadline, so the server is shut down with a short deadline once no call runs.
class Calls {
 public:
  // False once draining: answer UNAVAILABLE without touching the core.
  bool Enter() {
    absl::MutexLock lock(&mu_);
    if (draining_) return false;
    ++active_;
    return true;
  }
  void Exit() {
    absl::MutexLock lock(&mu_);
    --active_;
  }
  // Runs `fn` (which finishes an entered call and Exits) on a new thread; false (nothing
  // runs) after JoinThreads.
  bool Spawn(std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    if (joined_) return false;
    for (uint64_t id : finished_) {  // reap threads that have ended
      auto it = threads_.find(id);
      it->second.join();
      threads_.erase(it);
    }
    finished_.clear();
    const uint64_t id = next_id_++;
    threads_[id] = std::thread([this, id, fn = std::move(fn)] {
      fn();
      absl::MutexLock lock(&mu_);
      finished_.push_back(id);
    });
    return true;
  }
  // Waiting calls poll this and end with UNAVAILABLE.
  bool draining() const { return draining_flag_.load(); }
  // Stops admitting calls; waits until none runs or `deadline` passes. True when none runs.
  bool Drain(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    draining_flag_ = true;
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  // After the server has shut down: joins every thread.
  void JoinThreads() {
    std::map<uint64_t, std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      joined_ = true;
      threads.swap(threads_);
    }
    for (auto& [id, thread] : threads) thread.join();
  }

 private:
  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  int64_t active_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> draining_flag_{false};
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);
};

// Answers a unary call at once with what `fn` returns: absl::Status, absl::StatusOr<Response>
// or Response.
template <typename Response, typename Fn>
::grpc::ServerUnaryReactor* Serve(Calls* calls, ::grpc::CallbackServerContext* context, Response* response,
                                  const ::grpc::Status& shutting_down, Fn fn) {
  ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!calls->Enter()) {
    reactor->Finish(shutting_down);
    return reactor;
  }
  auto result = fn();
  absl::Status status;
  if constexpr (std::is_same_v<decltype(result), absl::Status>) {
    status = result;
  } else if constexpr (std::is_same_v<decltype(result), Response>) {
    *response = std::move(result);
  } else {
    status = result.status();
    if (result.ok()) *response = *std::move(result);
  }
  reactor->Finish(ToGrpcWithDetail(context, status));
  calls->Exit();
  return reactor;
}

// Answers an entered call once `probe()` (the core, asked without waiting) has an answer for
// which `not_yet` is false, parking the call in `waiters` under `key` meanwhile. `answer(result)`
// answers the call and Exits it; it runs exactly once, on this thread or the waiter thread.
// When `deadline` passes the call gets the last probe's answer; at the server's wait limit,
// UNAVAILABLE (the client calls again); when the call is cancelled, CANCELLED; when the server
// drains, `stopping`. A call the waiters refuse (over a limit) gets their RESOURCE_EXHAUSTED.
template <typename T>
void AnswerWhenReady(Calls* calls, Waiters* waiters, ::grpc::CallbackServerContext* context, const std::string& key,
                     absl::Time deadline, std::function<absl::StatusOr<T>()> probe,
                     std::function<bool(const absl::StatusOr<T>&)> not_yet,
                     std::function<void(absl::StatusOr<T>)> answer, absl::Status stopping) {
  absl::StatusOr<T> first = probe();
  if (!not_yet(first) || absl::Now() >= deadline) {
    answer(std::move(first));
    return;
  }
  const absl::Duration limit = waiters->options().max_wait;
  const std::string limit_flag = waiters->options().max_wait_flag;
  auto attempt = [calls, context, probe, not_yet, answer, stopping, limit, limit_flag](Waiters::Why why) {
    if (why == Waiters::Why::kStopping || calls->draining()) {
      answer(stopping);
      return true;
    }
    if (context->IsCancelled()) {
      answer(absl::CancelledError("the call was cancelled"));
      return true;
    }
    absl::StatusOr<T> result = probe();
    if (!not_yet(result) || why == Waiters::Why::kDeadline) {
      answer(std::move(result));
      return true;
    }
    if (why == Waiters::Why::kChanged) return false;
    answer(absl::UnavailableError(absl::StrCat("the call waited ", absl::FormatDuration(limit),
                                               ", this server's limit (", limit_flag, "): call again")));
    return true;
  };
  if (absl::Status parked = waiters->Park(key, context->peer(), deadline, std::move(attempt)); !parked.ok()) {
    answer(parked);
  }
}

// `probe` says "not yet" with DEADLINE_EXCEEDED (the core's waits, asked with a past deadline).
template <typename T>
bool DeadlinePassed(const absl::StatusOr<T>& result) {
  return result.status().code() == absl::StatusCode::kDeadlineExceeded;
}

// The common shutdown of a server: health NOT_SERVING, stop admitting calls, answer the parked
// ones (`waiters`, may be null) and wait up to `grace` for running ones, then shut the server
// down with `close_grace` for its last answers, and join the helper threads. `component` names
// the server in the log.
inline void ShutdownServer(::grpc::Server* server, Calls& calls, Waiters* waiters, absl::Duration grace,
                           absl::Duration close_grace, absl::string_view component) {
  if (server != nullptr && server->GetHealthCheckService() != nullptr) server->GetHealthCheckService()->Shutdown();
  calls.Drain(absl::Now());  // admits no more calls
  if (waiters != nullptr) waiters->Shutdown();
  if (!calls.Drain(absl::Now() + grace)) {
    Log(LogLevel::kWarning, component, "calls still running at the end of the grace period: cancelling them");
  }
  if (server != nullptr) {
    server->Shutdown(absl::ToChronoTime(absl::Now() + close_grace));
    server->Wait();
  }
  calls.JoinThreads();
}

// A server stream that ends at once with `status` (RPCs not implemented yet).
template <typename T>
class FinishedWriter final : public ::grpc::ServerWriteReactor<T> {
 public:
  explicit FinishedWriter(::grpc::Status status) { this->Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_CALLS_H_

// The daemon's open PushGrad streams (issue 18, item 7): one per (job, bucket, shard, step,
// rank), the newest winning, and none idle for long. A trainer that opens a stream and sends
// nothing more (or only a header) holds a gRPC stream, a reactor and its push session; a
// sweeper thread cancels every stream that has received no message for `idle_timeout`, and a
// second stream of the same key cancels the first (a retry after a broken connection replaces
// the stream the server has not noticed dying yet). A cancelled stream stores nothing.
//
// Ownership: contexts are not owned; a stream must be Closed before its context goes (the
// reactor's OnDone), and the registry must outlive every reactor that uses it.
// Thread safety: every method is thread-safe; TryCancel runs under the registry's lock, which
// Close also takes, so a context is never cancelled after it was closed.
#ifndef MAINSTAY_SERVER_GRPC_PUSH_STREAMS_H_
#define MAINSTAY_SERVER_GRPC_PUSH_STREAMS_H_

#include <grpcpp/grpcpp.h>

#include <map>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mainstay::daemon {

class PushStreams {
 public:
  // `idle_timeout` > 0; the sweeper checks every min(idle_timeout / 4, 1 s).
  explicit PushStreams(absl::Duration idle_timeout);
  ~PushStreams();  // stops the sweeper; every stream must be closed by then
  PushStreams(const PushStreams&) = delete;
  PushStreams& operator=(const PushStreams&) = delete;

  // A new stream, before its header: it counts as active now.
  void Open(::grpc::CallbackServerContext* context);
  // The stream's header named `key`: an older open stream of that key is cancelled.
  void Keyed(::grpc::CallbackServerContext* context, const std::string& key);
  // A message arrived on the stream.
  void Touch(::grpc::CallbackServerContext* context);
  void Close(::grpc::CallbackServerContext* context);
  // Streams cancelled so far for being idle, and for being replaced (tests, logs).
  int64_t idle_cancelled() const;
  int64_t replaced() const;
  size_t open() const;

 private:
  struct Stream {
    std::string key;  // empty before the header
    absl::Time last;
  };
  void Sweep();

  const absl::Duration idle_timeout_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<::grpc::CallbackServerContext*, Stream> streams_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, ::grpc::CallbackServerContext*> by_key_ ABSL_GUARDED_BY(mu_);
  int64_t idle_cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t replaced_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread sweeper_;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_GRPC_PUSH_STREAMS_H_

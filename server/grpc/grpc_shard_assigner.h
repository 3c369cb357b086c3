// ShardAssigner over gRPC: delivers the coordinator's AssignShard / DropShard calls to the
// daemons' Shard services in the background.
//
// Each daemon address gets one cached channel and one worker thread that sends that daemon's
// calls in the order they were made (an AssignShard at epoch e must not overtake the DropShard
// of epoch e-1). An AssignShard refused with RESOURCE_EXHAUSTED (no room for the job's memory
// plan) goes to the refused handler, not retried. A call that fails with a retryable code
// (UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, RESOURCE_EXHAUSTED, UNKNOWN, INTERNAL) is retried with exponential backoff until
// `give_up_after` has passed since it was made; then, or on any other code (for example
// FAILED_PRECONDITION for an epoch the daemon has already passed), it is logged and dropped.
// Delivery is best effort by design: a daemon that restarts asks for its placement anyway.
// A worker with nothing to send for `idle_timeout` ends and gives up its channel (daemons come
// and go at new addresses); the next call to that address starts a new one.
//
// Thread safety: Assign and Drop may be called from any thread and return at once.
// Shutdown (also run by the destructor) cancels the call in flight, drops queued ones with a
// log line, and joins the workers; calls made after it are dropped.
#ifndef MAINSTAY_SERVER_GRPC_GRPC_SHARD_ASSIGNER_H_
#define MAINSTAY_SERVER_GRPC_GRPC_SHARD_ASSIGNER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_tls.h"
#include "server/coordinator/shard_assigner.h"

namespace mainstay::coordinator {

struct GrpcShardAssignerOptions {
  absl::Duration attempt_timeout = absl::Seconds(5);  // deadline of one attempt
  absl::Duration give_up_after = absl::Minutes(1);    // per call, from when it was made
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  absl::Duration idle_timeout = absl::Minutes(5);     // a daemon's worker with no call ends
  // How the daemons are dialled: plaintext, TLS or mutual TLS (common/grpc_tls.h).
  ChannelSecurity security;
};

class GrpcShardAssigner : public ShardAssigner {
 public:
  explicit GrpcShardAssigner(GrpcShardAssignerOptions options = {});
  ~GrpcShardAssigner() override;

  void Assign(const std::string& daemon_address, const v1::AssignShardRequest& request) override;
  void Drop(const std::string& daemon_address, const v1::DropShardRequest& request) override;
  void SetRefusedHandler(RefusedHandler handler) override;
  // Synchronous, on the daemon's cached channel; the ErrorDetail of a failure is kept.
  absl::StatusOr<v1::WriteCheckpointResponse> WriteCheckpoint(const std::string& daemon_address,
                                                              const v1::WriteCheckpointRequest& request,
                                                              absl::Time deadline) override;

  void Shutdown();
  // Daemon addresses with a worker now (tests; each is one thread and one channel).
  size_t live_workers() const;

 private:
  struct Call;
  struct Peer;
  void Enqueue(const std::string& address, Call call);
  Peer* PeerLocked(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunWorker(Peer* peer);
  void Deliver(Peer* peer, const Call& call);
  // Joins the workers that ended idle (their threads have returned or are returning).
  void JoinEnded() ABSL_LOCKS_EXCLUDED(mu_);

  const GrpcShardAssignerOptions options_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  RefusedHandler refused_ ABSL_GUARDED_BY(mu_);
  int refused_calls_ ABSL_GUARDED_BY(mu_) = 0;  // refused_ calls running (SetRefusedHandler waits)
  std::map<std::string, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Peer>> ended_ ABSL_GUARDED_BY(mu_);  // idle workers, to join
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_GRPC_GRPC_SHARD_ASSIGNER_H_

// The daemon's end of the cuda_ipc transport (docs/transports.md, CUDA IPC). A trainer on this
// daemon's node opens a session (AttachCudaIpc), then pushes device memory by handing over the
// CUDA IPC handle of its allocation with the payload's offset (CudaIpcPush). The daemon maps the
// allocation for that push only (IpcMemory::Open, then Close once the bytes are copied: CUDA
// leaves a mapping of freed memory undefined, and the trainer may free the buffer once the step
// finished), copies the payload into the core's PushSession, and stores it as PushGrad would:
// nothing is stored unless every byte was copied. A pull (CudaIpcPull) goes the other way: the
// daemon waits for the version as PullParams does, maps the trainer's destination for that pull
// only, writes the shard's packed data into it, and answers the header and the block scales.
// Delta pulls and everything else go over gRPC. server/grpc/shard_service.cc adapts it; no
// gRPC and no CUDA in here (the IpcMemory does the CUDA), so tests run it with a fake.
//
// A session binds (job, rank) to this node (the trainer's boot id). It ends when the trainer
// detaches, when a new session of the same (job, rank) replaces it, when the daemon stops, or
// when the trainer's process is found gone (checked at each attach, for trainers in this
// daemon's pid namespace).
//
// Ownership: the options' daemon, drain and memory are not owned and must outlive the server.
// Thread safety: every method is thread-safe; pushes and pulls of one session may run
// concurrently.
#ifndef MAINSTAY_SERVER_CUDAIPC_CUDA_IPC_SERVER_H_
#define MAINSTAY_SERVER_CUDAIPC_CUDA_IPC_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mainstay/v1/shard.pb.h"
#include "server/cudaipc/ipc_memory.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/step_drain.h"

namespace mainstay::daemon {

// How CudaIpcPush's UNAVAILABLE for an unknown session begins (the trainer then attaches again).
inline constexpr char kUnknownCudaIpcSession[] = "unknown cuda_ipc session";

class CudaIpcServer {
 public:
  struct Options {
    ShardDaemon* daemon = nullptr;  // required, not owned
    StepDrain* drain = nullptr;     // not owned; null: no graceful drain
    IpcMemory* memory = nullptr;    // required, not owned
    std::string device_name;        // for AttachCudaIpcResponse, e.g. "cuda:0 (NVIDIA H200, ...)"
    // This host's boot id and this process's pid namespace; empty: read from /proc.
    std::string boot_id;
    std::string pid_namespace;
    int max_sessions = 1024;  // open sessions at most (RESOURCE_EXHAUSTED beyond)
    // Whether process `pid` of this pid namespace is alive; null: kill(pid, 0).
    std::function<bool(int64_t pid)> alive;
  };
  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<CudaIpcServer>> Start(Options options);
  ~CudaIpcServer();

  // The calls of shard.proto. Errors as documented there.
  absl::StatusOr<v1::AttachCudaIpcResponse> Attach(const v1::AttachCudaIpcRequest& request);
  absl::StatusOr<v1::PushGradResponse> Push(const v1::CudaIpcPushRequest& request);
  // Waits for the version until `deadline` (DEADLINE_EXCEEDED after it), in slices that end
  // early, CANCELLED, once `cancelled` (may be null) answers true; neither, checked once more,
  // may hold when the write starts. A write that started runs to its end, past both.
  // Detach(session) returns only once the session's writes ended.
  absl::StatusOr<v1::CudaIpcPullResponse> Pull(const v1::CudaIpcPullRequest& request, absl::Time deadline,
                                               const std::function<bool()>& cancelled);
  // Ends the session, then waits until none of its pulls writes any more (also for a session
  // that ended already): DEADLINE_EXCEEDED when one still writes at `deadline`.
  absl::Status Detach(const v1::DetachCudaIpcRequest& request, absl::Time deadline = absl::InfiniteFuture());

  // "CUDA IPC on cuda:0 (...)", for the start-up log.
  std::string Describe() const;
  int sessions() const;
  int mappings() const;  // allocations mapped now (by the pushes and pulls in flight)
  // Refuses new calls (UNAVAILABLE), waits for the pushes and pulls in flight (a pull waiting for
  // its version ends within half a second), closes every session.
  // Idempotent.
  void Shutdown();

 private:
  struct State;
  explicit CudaIpcServer(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_CUDAIPC_CUDA_IPC_SERVER_H_

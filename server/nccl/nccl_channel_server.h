// The daemon's end of the nccl transport (docs/transports.md, NCCL): one two-rank NCCL
// communicator ("channel") per trainer rank, opened by the trainer over the Shard service
// (OpenNcclChannel: the ncclUniqueId comes from the coordinator's KV), then pushes and pulls whose
// control messages are Shard service calls (NcclPush, NcclPull) and whose payloads move by NCCL
// between device staging buffers (common/nccl_link.h) and the daemon's host buffers: a push lands
// in the core's PushSession (nothing is stored unless every byte arrived), a pull is sent from the
// immutable published snapshot. server/grpc/shard_service.cc adapts it; no gRPC in here.
//
// The daemon's end uses one CUDA device (Options.device; choose it with CUDA_VISIBLE_DEVICES).
// NCCL refuses two ranks of one communicator on the same CUDA device ("Duplicate GPU detected"),
// so a trainer on the daemon's own GPU cannot open a channel (FAILED_PRECONDITION); see
// docs/transports.md for what newer NCCL releases offer.
//
// A trainer that dies leaves its channel until it opens a new one (a channel of the same job and
// rank replaces the older), the channel's next operation fails, or the daemon stops.
//
// Built without CUDA and NCCL, Start answers UNIMPLEMENTED (nccl_channel_server_stub.cc).
// Ownership: the options' daemon, drain and kv are not owned and must outlive the server.
// Thread safety: every method is thread-safe; operations on one channel run one at a time.
#ifndef MAINSTAY_SERVER_NCCL_NCCL_CHANNEL_SERVER_H_
#define MAINSTAY_SERVER_NCCL_NCCL_CHANNEL_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mainstay/v1/shard.pb.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/step_drain.h"
#include "server/peer/kv_client.h"

namespace mainstay::daemon {

class NcclChannelServer {
 public:
  struct Options {
    ShardDaemon* daemon = nullptr;  // required, not owned
    StepDrain* drain = nullptr;     // not owned; null: no graceful drain
    peer::KvClient* kv = nullptr;   // required, not owned: the coordinator's KV
    int device = 0;                 // CUDA device ordinal of the daemon's ends
    int max_channels = 1024;        // open channels at most (RESOURCE_EXHAUSTED beyond)
  };
  // UNIMPLEMENTED without CUDA and NCCL; UNAVAILABLE without a usable CUDA device;
  // INVALID_ARGUMENT for bad options. Creates no CUDA context yet (the first channel does).
  static absl::StatusOr<std::unique_ptr<NcclChannelServer>> Start(Options options);
  virtual ~NcclChannelServer() = default;

  // Writes one reply of the call; false when the trainer went away.
  using Write = std::function<bool(const v1::NcclReply&)>;
  // True once the call is over for the daemon: cancelled by the trainer, or the server stops.
  using Cancelled = std::function<bool()>;

  // The calls of shard.proto, each bounded by `deadline`. Push and Pull return the call's status:
  // OK when the operation ended as its replies say (its own errors are in the replies), an error
  // when the channel failed (then dropped).
  virtual absl::StatusOr<v1::OpenNcclChannelResponse> Open(const v1::OpenNcclChannelRequest& request,
                                                          absl::Time deadline, const Cancelled& cancelled) = 0;
  virtual absl::Status Push(const v1::NcclPushRequest& request, absl::Time deadline, const Write& write,
                            const Cancelled& cancelled) = 0;
  virtual absl::Status Pull(const v1::NcclPullRequest& request, absl::Time deadline, const Write& write,
                            const Cancelled& cancelled) = 0;
  virtual absl::Status Close(const v1::CloseNcclChannelRequest& request) = 0;

  // "NCCL 2.28.9, CUDA device 0 (NVIDIA H200)", for the start-up log.
  virtual std::string Describe() const = 0;
  // Ends operations in flight (UNAVAILABLE, nothing stored), refuses new ones, closes every
  // channel. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_NCCL_NCCL_CHANNEL_SERVER_H_

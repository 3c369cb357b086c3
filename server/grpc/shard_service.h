// The shard daemon as a gRPC server: the mainstay.v1.Shard service over the ShardDaemon core
// (server/daemon/shard_daemon.h), plus the standard health service and server reflection.
//
// Health: "" is SERVING while the process serves (liveness); "mainstay.v1.Shard" (readiness)
// is NOT_SERVING until SetReady(true) (the daemon's main calls it once registered with the
// coordinator) and from BeginDrain on, when both go NOT_SERVING. options.tls makes the port
// TLS or mutual TLS (common/grpc_tls.h). With options.drain, pushes pass StepDrain::AdmitPush
// after their header is accepted (UNAVAILABLE for new steps while draining, nothing stored).
//
// PushGrad is a callback read reactor that validates the header before any data arrives and
// stages chunks in the core's PushSession (nothing is stored until the stream ends well); an
// idle stream, or one a newer stream of the same push replaces, is cancelled.
// PullParams and FinishStep wait for a step without holding a thread: they are parked
// (server/grpc/waiters.h) and re-tried when the job changes, within the limits of options.waits;
// PullParams then streams the immutable snapshot in chunks of at most max_chunk_bytes (default
// 1 MiB, capped at 4 MiB), each written when the previous one is done. PushGrad and PullParams
// are raw methods whose chunks bypass protobuf (server/grpc/data_streams.h).
// OpenNcclChannel, NcclPush, NcclPull and CloseNcclChannel go to options.nccl (the daemon's end
// of the nccl transport) on helper threads; UNIMPLEMENTED without one.
// FetchShardState streams a consistent copy of a shard's committed state (master, moments);
// WriteCheckpoint waits for the asked step and writes files on a spawned thread.
//
// Ownership: `daemon` is not owned and must outlive the server. Thread safety: port() from
// any thread; Shutdown is idempotent (the destructor calls it).
#ifndef MAINSTAY_SERVER_GRPC_SHARD_SERVICE_H_
#define MAINSTAY_SERVER_GRPC_SHARD_SERVICE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/cluster_secret.h"
#include "common/tls.h"
#include "server/cudaipc/cuda_ipc_server.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/step_drain.h"
#include "server/grpc/waiters.h"
#include "server/nccl/nccl_channel_server.h"

namespace mainstay::daemon {

class ShardServer {
 public:
  struct Options {
    std::string listen_address = "127.0.0.1:0";  // port 0 picks a free port (see port())
    int max_message_bytes = 64 << 20;
    daemon::ShardDaemon* daemon = nullptr;        // required, not owned
    TlsOptions tls;                               // plaintext when tls.cert_file is empty
    // With mutual TLS: the name (certificate CN or SAN) that only the cluster's servers'
    // certificates carry; AssignShard, DropShard, FetchShardState and WriteCheckpoint from any
    // other certificate (a trainer's) are PERMISSION_DENIED (server/grpc/peer_identity.h).
    // Empty: no such check. Needs tls.require_client_cert.
    std::string internal_peer_name;
    // The internal calls (AssignShard, DropShard, FetchShardState, WriteCheckpoint,
    // ForwardStepInput, GetStepOutcome) need it presented (common/cluster_secret.h); disabled:
    // no such check.
    ClusterSecret cluster_secret;
    // With neither internal_peer_name nor cluster_secret, Start refuses a listen_address that is
    // not loopback (INVALID_ARGUMENT) unless this is set (mainstayd --insecure).
    bool insecure = false;
    StepDrain* drain = nullptr;                   // not owned, must outlive the server; null: none
    // "host:port" of a plaintext port serving only grpc.health.v1 with the same statuses
    // (server/grpc/health_port.h), for probes that cannot speak TLS; empty: none.
    std::string health_listen_address;
    // The nccl transport's calls go here; not owned, must outlive the server. Null: they answer
    // UNIMPLEMENTED (mainstayd started without --transports nccl).
    NcclChannelServer* nccl = nullptr;
    // The cuda_ipc transport's calls go here; not owned, must outlive the server. Null: they
    // answer UNIMPLEMENTED (a daemon on the CPU, or --transports without cuda_ipc).
    CudaIpcServer* cuda_ipc = nullptr;
    // A PushGrad stream that receives no message for this long is cancelled (nothing of it is
    // stored), and a second stream of the same (job, bucket, shard, step, rank) cancels the
    // first (server/grpc/push_streams.h). mainstayd --push-idle-timeout-ms.
    absl::Duration push_idle_timeout = absl::Seconds(60);
    // Limits of the waiting PullParams and FinishStep calls (total, per job, per client host,
    // and the longest wait): mainstayd --max-waiting-calls, --max-waiting-calls-per-job,
    // --max-waiting-calls-per-peer, --max-wait-ms.
    grpc_server::Waiters::Options waits;
  };

  // INVALID_ARGUMENT for bad options (unreadable or mismatched TLS files included);
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Start(Options options);
  ~ShardServer();
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;

  int port() const;
  // The bound health-only port; 0 without options.health_listen_address.
  int health_port() const;
  // The readiness of "mainstay.v1.Shard" (ignored after BeginDrain or Shutdown).
  void SetReady(bool ready);
  // Health NOT_SERVING for every service, for good; calls are still served (the steps in
  // flight finish; options.drain refuses new ones).
  void BeginDrain();
  // Stops accepting calls, ends waiting ones with UNAVAILABLE, bounded to a few seconds.
  void Shutdown();

 private:
  struct Impl;
  explicit ShardServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_GRPC_SHARD_SERVICE_H_

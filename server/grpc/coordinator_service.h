// The coordinator as a gRPC server: the mainstay.v1 Coordinator and Admin services over the
// Coordinator core (server/coordinator/coordinator.h), plus the standard health service
// (grpc.health.v1, "" and "mainstay.v1.Coordinator" report SERVING while it runs) and server
// reflection, so grpcurl / grpc_health_probe work out of the box.
//
// Start opens the file state store in options.state_dir (locked against a second
// coordinator), or uses options.store (etcd), loads the durable state, starts a tick thread
// (lease expiry, KV TTLs) and serves with gRPC's callback API. Calls that wait (KvGet with
// wait_ms, WatchPlacement, KvWatch) wait on helper threads, never on gRPC's callback threads.
// AssignShard / DropShard reach the daemons through a GrpcShardAssigner.
//
// Not implemented yet (answered UNIMPLEMENTED with the reason): Admin GetShardStats and
// DumpTensor.
//
// Security (DESIGN.md section 8): options.tls makes every port TLS or mutual TLS and is also
// how AssignShard / DropShard reach the daemons. A per-job token that is not the job's is
// PERMISSION_DENIED on GetJob, GetLayout, GetPlacement and WatchPlacement. With
// options.admin_token set, every Admin RPC, ListDaemons, ListJobs, CreateJob, DeleteJob, and
// GetJob / GetLayout / GetPlacement / WatchPlacement without a job token need the admin token
// (server/coordinator/admin_auth.h: the request's admin_token field or `authorization: Bearer`
// metadata), else PERMISSION_DENIED. Daemons' calls (RegisterDaemon, Heartbeat,
// DeregisterDaemon, the KV) never need it: they need the cluster secret (options.cluster_secret)
// and/or, with options.internal_peer_name, a server's certificate; with neither the server
// listens on loopback only unless options.insecure (docs/operations.md, "Threat model").
//
// Health: "", "mainstay.v1.Coordinator" and "mainstay.v1.Admin" are SERVING from Start and
// NOT_SERVING from the first moment of Shutdown. With options.metrics the server records the
// metrics of server/metrics/coordinator_metrics.h into that registry.
//
// Thread safety: port() may be called from any thread; Shutdown is idempotent and may be
// called from any thread but one at a time (the destructor calls it). Shutdown stops
// accepting calls, ends waiting calls with UNAVAILABLE and gives running calls a few seconds
// to finish before they are cancelled.
#ifndef MAINSTAY_SERVER_GRPC_COORDINATOR_SERVICE_H_
#define MAINSTAY_SERVER_GRPC_COORDINATOR_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/cluster_secret.h"
#include "common/tls.h"
#include "server/coordinator/state_store.h"
#include "server/grpc/caller_identity.h"

namespace mainstay::metrics {
class Registry;
}  // namespace mainstay::metrics

namespace mainstay::coordinator {

class CoordinatorServer {
 public:
  // "<hostname>-<pid>": the id of a coordinator not given one.
  static std::string DefaultCoordinatorId();

  struct Options {
    // "host:port"; port 0 picks a free port (see port()).
    std::string listen_address = "127.0.0.1:0";
    // Directory of the durable state (created if missing, locked against a second
    // coordinator). Required unless `store` is given.
    std::string state_dir;
    // The durable state elsewhere (the etcd store of a leader: etcd_state_store.h), not owned;
    // it must outlive the server. `state_description` names it in the log.
    StateStore* store = nullptr;
    std::string state_description;
    int64_t lease_ttl_ms = 10'000;     // default daemon lease
    int64_t tick_interval_ms = 200;    // how often leases and KV TTLs are checked
    std::string coordinator_id;        // empty: "<hostname>-<pid>"
    // Largest request gRPC accepts; larger ones get RESOURCE_EXHAUSTED from gRPC itself.
    int max_message_bytes = 64 << 20;
    // Checkpoints (docs/checkpoints.md): a directory every daemon reaches under the same path.
    // Empty: the checkpoint RPCs answer FAILED_PRECONDITION.
    std::string checkpoint_dir;
    // Restore a job from its newest checkpoint when it loses a daemon.
    bool restore_on_daemon_loss = true;
    // Checkpoint policy (CoordinatorOptions): every N steps / T ms, keeping the newest K.
    int64_t checkpoint_every_steps = 0;
    int64_t checkpoint_every_ms = 0;
    int checkpoint_keep = 3;
    // TLS of the port and of the calls to daemons; plaintext when tls.cert_file is empty.
    TlsOptions tls;
    // With mutual TLS: the name (certificate CN or SAN) that only the cluster's servers'
    // certificates carry; daemons' calls (RegisterDaemon, Heartbeat, DeregisterDaemon, the KV)
    // from any other certificate are PERMISSION_DENIED (server/grpc/peer_identity.h). Empty: no
    // such check. Needs tls.require_client_cert.
    std::string internal_peer_name;
    // Daemons' calls need it presented (common/cluster_secret.h), and the calls to daemons
    // present it; disabled: no such check.
    ClusterSecret cluster_secret;
    // With neither internal_peer_name nor cluster_secret, Start refuses a listen_address that is
    // not loopback (INVALID_ARGUMENT) unless this is set (--insecure).
    bool insecure = false;
    // The admin token itself (read from --admin-token-file); empty: admin calls are open. Never
    // logged.
    std::string admin_token;
    // Not owned, must outlive the server; null: no metrics.
    metrics::Registry* metrics = nullptr;
    // "host:port" of a plaintext port serving only grpc.health.v1 with the same statuses
    // (server/grpc/health_port.h), for probes that cannot speak TLS; empty: none.
    std::string health_listen_address;
    // Tests only: CoordinatorOptions::fault_point, plus "create-job-committed" (a CreateJob is
    // durable and about to be answered).
    std::function<void(const std::string& point)> fault_point;
  };

  // The checks of Start that need no state: INVALID_ARGUMENT naming the bad option (the TLS
  // files are read later, by Start). A standby runs them before it listens (main.cc).
  static absl::Status CheckOptions(const Options& options);
  // The rule for the internal calls that these options make (caller_identity.h).
  static grpc_server::InternalPeers InternalPeersOf(const Options& options);

  // INVALID_ARGUMENT for bad options (unreadable or mismatched TLS files included),
  // FAILED_PRECONDITION when another coordinator holds the state directory, DATA_LOSS for a corrupt state, UNAVAILABLE when the address cannot be
  // bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(Options options);

  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // The bound port (the chosen one when the address asked for port 0).
  int port() const;
  // The bound health-only port; 0 without options.health_listen_address.
  int health_port() const;

  // Graceful and bounded (about 5 seconds at most); idempotent.
  void Shutdown();

 private:
  struct Impl;
  explicit CoordinatorServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_GRPC_COORDINATOR_SERVICE_H_

// The daemon's UCX data server (docs/transports.md): serves the Shard service's push and pull
// over UCP tagged messages, next to the gRPC server, on the same ShardDaemon core. Trainers
// find its worker address in the placement (DaemonEndpoint.ucx_worker_address, registered by
// mainstayd) and open one connection each with a hello; each connection is then served by a
// worker of its own or one of a shared pool (Options.dedicated_workers).
//
// A push is accepted (or refused) before any payload moves; the payload chunks land straight in
// the core's PushSession buffer, and nothing is stored unless every byte arrived (a trainer that
// dies mid-transfer, or a request past its timeout, leaves nothing). A pull waits for its version
// on a thread of its own, then sends the header, the data chunks and the scales from the
// immutable published snapshot.
//
// Built without UCX, Start answers UNIMPLEMENTED (server/ucx/ucx_data_server_stub.cc).
// Ownership: the options' daemon and drain are not owned and must outlive the server.
// Thread safety: every method is thread-safe; Shutdown is idempotent (the destructor calls it).
#ifndef MAINSTAY_SERVER_UCX_UCX_DATA_SERVER_H_
#define MAINSTAY_SERVER_UCX_UCX_DATA_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/step_drain.h"

namespace mainstay::daemon {

class UcxDataServer {
 public:
  // Which trainer connections get a UCP worker, with its progress thread, of their own; the
  // others share a pool of at most `shared_workers`. Over shared memory, a trainer killed in
  // the middle of writing into a worker's receive queue stalls that worker for good (UCX 1.13),
  // and with it every connection it serves. Trainers on this host (same boot id), which may use
  // shared memory, get their own by default; remote trainers share, so the daemon's threads do
  // not grow with the number of ranks.
  enum class DedicatedWorkers { kLocal, kAll, kNone };
  struct Options {
    ShardDaemon* daemon = nullptr;  // required, not owned
    StepDrain* drain = nullptr;     // not owned; null: no graceful drain
    DedicatedWorkers dedicated_workers = DedicatedWorkers::kLocal;
    int shared_workers = 4;  // >= 1
  };
  // UNIMPLEMENTED without UCX; UNAVAILABLE when UCX cannot start here (no usable transport).
  static absl::StatusOr<std::unique_ptr<UcxDataServer>> Start(Options options);
  virtual ~UcxDataServer() = default;

  // The worker address trainers connect to (opaque bytes).
  virtual const std::string& worker_address() const = 0;
  // "UCX 1.13.1, UCX_TLS=tcp", for the start-up log.
  virtual std::string Describe() const = 0;
  // Ends requests in flight (UNAVAILABLE, nothing stored), refuses new ones, closes connections.
  virtual void Shutdown() = 0;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_UCX_UCX_DATA_SERVER_H_

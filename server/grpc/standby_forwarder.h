// A standby coordinator's port (docs/coordinator.md, "Standbys pass every call to the leader").
//
// Coordinators sharing one etcd elect one leader; the others wait as standbys. A standby
// listens on its own address and passes every call it receives, as raw bytes, to the leader:
// unary and streaming calls, metadata (admin and job tokens, the cluster secret), the deadline,
// and the leader's answer (status, message, details and trailing metadata). So a client given
// several coordinators' addresses is answered by whichever one it reaches, reads are never
// stale (the leader answers them), and nothing in the protocol knows about standbys.
//
// Identity across the hop: with mutual TLS the leader sees the standby's certificate, which
// names the cluster's internal peer name. A caller that is not an internal peer here (the same
// rule as the leader's: server/grpc/caller_identity.h) is therefore marked
// (kNotInternalMetadata), and the leader refuses it the internal calls, as it would directly.
// A call already forwarded once is refused (UNAVAILABLE) rather than forwarded again, so a
// leader key naming a standby's own address cannot loop.
//
// Errors: with no leader known, every call is UNAVAILABLE ("no coordinator leads now"), which
// clients retry; a leader that cannot be reached gives gRPC's own UNAVAILABLE.
//
// Thread safety: SetLeader and Shutdown may be called from any thread; calls are served on
// gRPC's callback threads.
#ifndef MAINSTAY_SERVER_GRPC_STANDBY_FORWARDER_H_
#define MAINSTAY_SERVER_GRPC_STANDBY_FORWARDER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/tls.h"
#include "server/grpc/caller_identity.h"

namespace mainstay::grpc_server {

class StandbyForwarder {
 public:
  struct Options {
    std::string listen_address;  // "host:port"; port 0 picks one (port())
    TlsOptions tls;              // served with these; the leader is called with them too
    int max_message_bytes = 64 << 20;
    InternalPeers internal;      // the leader's rule for internal callers (same flags)
    std::string id;              // this coordinator's id, in messages and the hop marker
  };

  // Listens on options.listen_address, with no leader known yet. INVALID_ARGUMENT for bad TLS
  // files; UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<StandbyForwarder>> Start(Options options);
  ~StandbyForwarder();  // Shutdown()

  int port() const;
  // Where calls go from now on ("host:port"); "" = nowhere (calls get UNAVAILABLE). Calls
  // already forwarded stay with the leader they went to.
  void SetLeader(const std::string& address);
  // Stops listening and ends every forwarded call (CANCELLED to its client); the port is free
  // when this returns. Idempotent.
  void Shutdown();

 private:
  struct Impl;
  explicit StandbyForwarder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_STANDBY_FORWARDER_H_

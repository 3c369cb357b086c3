// daemon::PeerClient over gRPC: a peer daemon's Shard service GetStepOutcome,
// FetchShardState and ForwardStepInput.
//
// One cached channel per peer address, made with the daemon's own client credentials
// (plaintext, TLS or mutual TLS: the call is internal, so with --tls-internal-name the peer
// requires the daemon's certificate).
// Thread safety: thread-safe.
#ifndef MAINSTAY_SERVER_GRPC_GRPC_PEER_CLIENT_H_
#define MAINSTAY_SERVER_GRPC_GRPC_PEER_CLIENT_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_tls.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "server/daemon/peer_client.h"

namespace mainstay::daemon {

class GrpcPeerClient : public PeerClient {
 public:
  explicit GrpcPeerClient(ChannelSecurity security) : security_(std::move(security)) {}

  // FAILED_PRECONDITION when `peer` has no address; else the call's status.
  absl::StatusOr<v1::GetStepOutcomeResponse> GetStepOutcome(const v1::DaemonEndpoint& peer,
                                                            const v1::GetStepOutcomeRequest& request,
                                                            absl::Time deadline) override;
  // Reads the FetchShardState stream into a copy (server/daemon/shard_transfer.h).
  absl::StatusOr<ShardStateCopy> FetchShardState(const v1::DaemonEndpoint& peer,
                                                 const v1::FetchShardStateRequest& request, absl::Time deadline,
                                                 kernels::StateMemory& land, int64_t shard_numel) override;
  // A ForwardStepInput stream: the header, then the payload in chunks of 4 MiB.
  absl::Status ForwardStepInput(const v1::DaemonEndpoint& peer, const v1::ReplicaInputHeader& header,
                                std::span<const uint8_t> payload, absl::Time deadline) override;

 private:
  absl::StatusOr<v1::Shard::Stub*> StubFor(const v1::DaemonEndpoint& peer);

  const ChannelSecurity security_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<v1::Shard::Stub>> stubs_ ABSL_GUARDED_BY(mu_);  // by address
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_GRPC_GRPC_PEER_CLIENT_H_

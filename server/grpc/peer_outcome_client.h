// daemon::PeerOutcomeClient over gRPC: asks a peer daemon's Shard service GetStepOutcome.
//
// One cached channel per peer address, made with the daemon's own client credentials
// (plaintext, TLS or mutual TLS: the call is internal, so with --tls-internal-name the peer
// requires the daemon's certificate).
// Thread safety: thread-safe.
#ifndef MAINSTAY_SERVER_GRPC_PEER_OUTCOME_CLIENT_H_
#define MAINSTAY_SERVER_GRPC_PEER_OUTCOME_CLIENT_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_tls.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "server/daemon/step_outcome.h"

namespace mainstay::daemon {

class GrpcPeerOutcomeClient : public PeerOutcomeClient {
 public:
  explicit GrpcPeerOutcomeClient(ChannelSecurity security) : security_(std::move(security)) {}

  // FAILED_PRECONDITION when `peer` has no address; else the call's status.
  absl::StatusOr<v1::GetStepOutcomeResponse> GetStepOutcome(const v1::DaemonEndpoint& peer,
                                                            const v1::GetStepOutcomeRequest& request,
                                                            absl::Time deadline) override;

 private:
  const ChannelSecurity security_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<v1::Shard::Stub>> stubs_ ABSL_GUARDED_BY(mu_);  // by address
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_GRPC_PEER_OUTCOME_CLIENT_H_

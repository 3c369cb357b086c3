#include "server/grpc/peer_outcome_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status.h"

namespace mainstay::daemon {

absl::StatusOr<v1::GetStepOutcomeResponse> GrpcPeerOutcomeClient::GetStepOutcome(
    const v1::DaemonEndpoint& peer, const v1::GetStepOutcomeRequest& request, absl::Time deadline) {
  if (peer.address().empty()) {
    return absl::FailedPreconditionError(absl::StrCat("daemon ", peer.daemon_id(), " has no address in the placement"));
  }
  v1::Shard::Stub* stub;
  {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<v1::Shard::Stub>& cached = stubs_[peer.address()];
    if (cached == nullptr) {
      ::grpc::ChannelArguments args;
      // A peer that restarts must be found again within a poll or two.
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      cached = v1::Shard::NewStub(security_.CreateChannel(peer.address(), args));
    }
    stub = cached.get();  // stubs are never removed: the pointer stays valid
  }
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::GetStepOutcomeResponse response;
  const absl::Status status = FromGrpcStatus(stub->GetStepOutcome(&context, request, &response));
  if (!status.ok()) return Annotate(status, absl::StrCat("GetStepOutcome from daemon ", peer.daemon_id()));
  return response;
}

}  // namespace mainstay::daemon

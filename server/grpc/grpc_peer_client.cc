#include "server/grpc/grpc_peer_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/chunk_limits.h"
#include "common/grpc_status.h"
#include "common/status.h"
#include "server/daemon/shard_transfer.h"

namespace mainstay::daemon {

absl::StatusOr<v1::Shard::Stub*> GrpcPeerClient::StubFor(const v1::DaemonEndpoint& peer) {
  if (peer.address().empty()) {
    return absl::FailedPreconditionError(absl::StrCat("daemon ", peer.daemon_id(), " has no address in the placement"));
  }
  absl::MutexLock lock(&mu_);
  std::unique_ptr<v1::Shard::Stub>& cached = stubs_[peer.address()];
  if (cached == nullptr) {
    ::grpc::ChannelArguments args;
    // A peer that restarts must be found again within a poll or two.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetMaxReceiveMessageSize(64 << 20);
    cached = v1::Shard::NewStub(security_.CreateChannel(peer.address(), args));
  }
  return cached.get();  // stubs are never removed: the pointer stays valid
}

absl::StatusOr<v1::GetStepOutcomeResponse> GrpcPeerClient::GetStepOutcome(const v1::DaemonEndpoint& peer,
                                                                          const v1::GetStepOutcomeRequest& request,
                                                                          absl::Time deadline) {
  MAINSTAY_ASSIGN_OR_RETURN(v1::Shard::Stub * stub, StubFor(peer));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::GetStepOutcomeResponse response;
  const absl::Status status = FromGrpcStatus(stub->GetStepOutcome(&context, request, &response));
  if (!status.ok()) return Annotate(status, absl::StrCat("GetStepOutcome from daemon ", peer.daemon_id()));
  return response;
}

absl::StatusOr<ShardStateCopy> GrpcPeerClient::FetchShardState(const v1::DaemonEndpoint& peer,
                                                               const v1::FetchShardStateRequest& request,
                                                               absl::Time deadline, kernels::StateMemory& land,
                                                               int64_t shard_numel) {
  MAINSTAY_ASSIGN_OR_RETURN(v1::Shard::Stub * stub, StubFor(peer));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  std::unique_ptr<::grpc::ClientReader<v1::FetchShardStateResponse>> reader = stub->FetchShardState(&context, request);
  ShardStateReader assembled(land, shard_numel);
  v1::FetchShardStateResponse message;
  absl::Status bad;
  while (reader->Read(&message)) {
    if (bad.ok()) bad = assembled.Add(message);
    if (!bad.ok()) context.TryCancel();
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  // RESOURCE_EXHAUSTED means that `land` is full (the coordinator places the move elsewhere),
  // never the transport's limits or the source's.
  if (status.code() == absl::StatusCode::kResourceExhausted) status = absl::UnavailableError(status.message());
  const std::string where = absl::StrCat("FetchShardState from daemon ", peer.daemon_id());
  if (!bad.ok()) return Annotate(bad, where);
  if (!status.ok()) return Annotate(status, where);
  absl::StatusOr<ShardStateCopy> copy = assembled.Finish(request.shard().bucket(), request.shard().shard());
  if (!copy.ok()) return Annotate(copy.status(), where);
  return copy;
}

absl::Status GrpcPeerClient::ForwardStepInput(const v1::DaemonEndpoint& peer, const v1::ReplicaInputHeader& header,
                                              std::span<const uint8_t> payload, absl::Time deadline) {
  MAINSTAY_ASSIGN_OR_RETURN(v1::Shard::Stub * stub, StubFor(peer));
  constexpr size_t kChunkBytes = kMaxChunkBytes;
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::ForwardStepInputResponse response;
  std::unique_ptr<::grpc::ClientWriter<v1::ForwardStepInputRequest>> writer =
      stub->ForwardStepInput(&context, &response);
  v1::ForwardStepInputRequest message;
  *message.mutable_header() = header;
  bool open = writer->Write(message);
  const size_t element = header.dtype() == v1::ELEMENT_TYPE_FP32 ? 4 : 2;  // BF16, FP16
  for (size_t off = 0; open && off < payload.size(); off += kChunkBytes) {
    const size_t n = std::min(kChunkBytes, payload.size() - off);
    v1::ForwardStepInputRequest chunk;
    chunk.mutable_chunk()->set_element_offset(static_cast<int64_t>(off / element));
    chunk.mutable_chunk()->set_data(reinterpret_cast<const char*>(payload.data() + off), n);
    open = writer->Write(chunk);
  }
  if (open) writer->WritesDone();
  const absl::Status status = FromGrpcStatus(writer->Finish());
  if (!status.ok()) return Annotate(status, absl::StrCat("ForwardStepInput to daemon ", peer.daemon_id()));
  return absl::OkStatus();
}

}  // namespace mainstay::daemon

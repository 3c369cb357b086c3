// The trainer's data-plane transports (DESIGN.md section 7, docs/transports.md): how one push
// or pull attempt reaches a daemon. The retry loop, routing and request building stay in
// data_plane.cc; a transport moves one request's bytes and reports the daemon's answer.
//
//   grpc  PushGrad / PullParams streams of the Shard service (always available)
//   ucx   UCP tagged messages straight between the trainer's and the daemon's buffers
//   nccl  NCCL send/recv between device buffers (needs CUDA and NCCL at build time); control
//         messages over the Shard service (OpenNcclChannel, NcclPush, NcclPull)
//   cuda_ipc  pushes of device memory to a daemon on this node, which copies them out of the
//         trainer's allocation by its CUDA IPC handle (CudaIpcPush), and pulls into device
//         memory, which the daemon writes the same way (CudaIpcPull); host memory by gRPC
//
// A backend compiled out is built from its *_stub.cc: Make* answers UNIMPLEMENTED.
//
// Errors: the Shard service's codes (shard.proto) with the daemon's ErrorDetail attached; a peer
// that fails mid-transfer is UNAVAILABLE and the retry loop re-routes. Thread safety: every
// method may be called from any thread, concurrently.
#ifndef MAINSTAY_CLIENT_SRC_TRANSPORT_H_
#define MAINSTAY_CLIENT_SRC_TRANSPORT_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/src/cuda_driver.h"
#include "client/src/pull_assembly.h"
#include "mainstay/buffers.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay::client_internal {
// See DataTransport::Attach.
inline constexpr char kAttachNotYetPayload[] = "mainstay.client/attach-not-yet";
}  // namespace mainstay::client_internal
#include "mainstay/v1/shard.grpc.pb.h"

namespace mainstay::client_internal {

using Deadline = std::chrono::system_clock::time_point;

// Where one attempt goes: the daemon (and the placement epoch it was chosen under).
struct Route {
  int64_t epoch = 0;
  std::string daemon_id;
  std::string address;
  v1::DaemonEndpoint endpoint;            // as the placement lists it
  std::shared_ptr<v1::Shard::Stub> stub;  // gRPC (the control calls)
  std::shared_ptr<grpc::Channel> channel;  // the stub's (the grpc transport's raw streams)
};

// What a transport needs of its client.
struct TransportContext {
  std::string job_id;
  std::string job_token;
  int32_t rank = 0;
  int64_t chunk_bytes = 1 << 20;
  // Puts `value` under `key` in the coordinator's KV with a time to live (the nccl transport's
  // rendezvous). Unset for transports that do not need it.
  std::function<absl::Status(const std::string& key, const std::string& value, std::chrono::milliseconds ttl,
                             Deadline deadline)>
      kv_put;
  // The Shard service stub of a daemon's address (shared with the client's other calls).
  std::function<std::shared_ptr<v1::Shard::Stub>(const std::string& address)> stub_for;
};

class DataTransport {
 public:
  virtual ~DataTransport() = default;
  virtual v1::Transport kind() const = 0;
  // Whether the client may read a push's payload at `data` on the CPU (its CRC-32C): false for
  // device memory, which only the nccl and cuda_ipc transports take.
  virtual bool HostReadable(const void* data) const { return true; }
  // Whether the transport computes the CRC-32C of a host-readable push payload itself, as it
  // copies or sends it (Push's `payload_crc32c`; the header's crc32c_follows). Otherwise the
  // client computes it before the push and the header carries it.
  virtual bool ComputesPushCrc32c() const { return false; }
  // Pays this daemon's connection costs now (Client::Connect calls it for every daemon of the
  // placement, so the first push does not). Idempotent; the grpc transport has none. A daemon
  // that has not received the job (yet) is asked again until `deadline`; then its UNAVAILABLE
  // carries the payload kAttachNotYetPayload (the caller may re-read the placement: the job may
  // have gone elsewhere).
  virtual absl::Status Attach(const v1::DaemonEndpoint& daemon, Deadline deadline) = 0;
  // One push attempt: `header` (placement epoch set), then `data` in chunks, then, when
  // header.crc32c_follows(), the payload's CRC-32C in a PushGradTrailer (transports that
  // ComputesPushCrc32c only; the header's crc32c is then 0). With `payload_crc32c` not null, a
  // transport that ComputesPushCrc32c computes the CRC-32C of the payload as it goes even when
  // the header does not ask for a trailer, and sets it there on success, unless the daemon took
  // the push as a duplicate without its payload (then it is left as it was). Others ignore it.
  virtual absl::StatusOr<v1::PushGradResponse> Push(const Route& route, const v1::PushGradHeader& header,
                                                    ElementSpan data, Deadline deadline, grpc::ClientContext* context,
                                                    std::optional<uint32_t>* payload_crc32c) = 0;
  // One pull attempt: the daemon's answer fed to `assembler` (a fresh one per attempt).
  virtual absl::Status Pull(const Route& route, const v1::PullParamsRequest& request, ShardPullAssembler& assembler,
                            Deadline deadline, grpc::ClientContext* context) = 0;
  // Ends every operation in flight (CANCELLED) and refuses new ones. Idempotent.
  virtual void Shutdown() = 0;
};

std::unique_ptr<DataTransport> MakeGrpcTransport(const TransportContext& context);
// UNIMPLEMENTED when built without UCX; UNAVAILABLE when UCX cannot start here.
absl::StatusOr<std::unique_ptr<DataTransport>> MakeUcxTransport(const TransportContext& context);
// UNIMPLEMENTED when built without CUDA and NCCL; UNAVAILABLE without a CUDA device. Uses the
// CUDA device current on the calling thread (Client::Connect's).
absl::StatusOr<std::unique_ptr<DataTransport>> MakeNcclTransport(const TransportContext& context);
// FAILED_PRECONDITION when `cuda` cannot export device memory here (no CUDA driver). `cuda` must
// outlive the transport.
absl::StatusOr<std::unique_ptr<DataTransport>> MakeCudaIpcTransport(const TransportContext& context,
                                                                    const CudaDriver& cuda);

// The transport to use with a daemon offering `offered`: `requested` ("auto", "grpc", "ucx",
// "nccl") when the daemon offers it (FAILED_PRECONDITION naming both sides otherwise), or for
// "auto" the best both sides have: ucx, else grpc (nccl and cuda_ipc only when asked for: they
// are for device buffers). `available` is what this client could start.
absl::StatusOr<v1::Transport> ChooseTransport(absl::string_view requested, const std::vector<v1::Transport>& available,
                                              const v1::DaemonEndpoint& daemon);
// "grpc" for TRANSPORT_GRPC, ...
std::string TransportName(v1::Transport t);
absl::StatusOr<v1::Transport> ParseTransport(absl::string_view name);

}  // namespace mainstay::client_internal

#endif  // MAINSTAY_CLIENT_SRC_TRANSPORT_H_

// The cuda_ipc transport (docs/transports.md, CUDA IPC): pushes of device memory to a daemon on
// this trainer's node. The trainer exports the allocation that holds the pushed buffer
// (CudaDriver::ExportIpc: its CUDA IPC handle and the buffer's offset in it) and the daemon
// copies the payload out of it while the CudaIpcPush call runs; a pull into device memory
// (Client::PullShardInto) is the other way round (CudaIpcPull: the daemon writes the shard's
// packed data into the exported destination, the header and block scales come in the answer).
// Nothing moves through this process's host memory, and no NCCL communicator is needed, so a
// trainer and a daemon may share one GPU. Each daemon gets one session (AttachCudaIpc), opened
// at Attach and again after a daemon restart. Pushes from host memory and pulls into host memory
// go over gRPC (the grpc transport).
//
// The push's CUDA work (PushOptions::cuda_stream / cuda_event) is waited for before Push is
// called (data_plane.cc), so the daemon reads finished bytes.
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/src/cuda_driver.h"
#include "client/src/rpc_errors.h"
#include "client/src/transport.h"
#include "common/process_identity.h"
#include "common/status.h"

namespace mainstay::client_internal {
namespace {

constexpr absl::Duration kDetachTimeout = absl::Milliseconds(500);
// How long a pull that ended without the daemon's answer waits for its write to end (Detach).
constexpr absl::Duration kFenceTimeout = absl::Seconds(10);

class CudaIpcTransport final : public DataTransport {
 public:
  CudaIpcTransport(const TransportContext& context, const CudaDriver& cuda, std::unique_ptr<DataTransport> grpc)
      : context_(context), cuda_(cuda), grpc_(std::move(grpc)) {}

  ~CudaIpcTransport() override {
    Shutdown();
    std::map<std::string, Session> sessions;
    {
      absl::MutexLock lock(&mu_);
      sessions.swap(sessions_);
    }
    // The daemons end the sessions now rather than when this process is found gone.
    std::vector<std::thread> detachers;
    for (auto& [daemon, s] : sessions) {
      detachers.emplace_back([this, s = s] { Detach(s, kDetachTimeout).IgnoreError(); });  // best effort
    }
    for (std::thread& t : detachers) t.join();
  }

  v1::Transport kind() const override { return v1::TRANSPORT_CUDA_IPC; }

  bool HostReadable(const void* data) const override { return !cuda_.DeviceOf(data).has_value(); }

  // Opens the session now, retrying while the daemon answers UNAVAILABLE (it may not have
  // received the job yet); at the deadline that UNAVAILABLE carries kAttachNotYetPayload, so the
  // caller re-reads the placement (the job may have gone to another daemon).
  absl::Status Attach(const v1::DaemonEndpoint& daemon, Deadline deadline) override {
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      absl::StatusOr<Session> s = SessionTo(daemon, deadline);
      if (s.ok() || s.status().code() != absl::StatusCode::kUnavailable) return s.status();
      if (absl::Now() + backoff >= absl::FromChrono(deadline) || shutdown_.load()) {
        absl::Status not_yet = s.status();
        not_yet.SetPayload(kAttachNotYetPayload, absl::Cord("1"));
        return not_yet;
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }

  // Host memory goes by gRPC, which computes the CRC-32C as it copies (the client asks only for
  // a host-readable payload).
  bool ComputesPushCrc32c() const override { return grpc_->ComputesPushCrc32c(); }

  absl::StatusOr<v1::PushGradResponse> Push(const Route& route, const v1::PushGradHeader& header, ElementSpan data,
                                            Deadline deadline, grpc::ClientContext* context,
                                            std::optional<uint32_t>* payload_crc32c) override {
    if (data.bytes() == 0 || HostReadable(data.data)) {
      return grpc_->Push(route, header, data, deadline, context, payload_crc32c);
    }
    absl::StatusOr<CudaDriver::IpcRegion> region = cuda_.ExportIpc(data.data);
    if (!region.ok()) return Annotate(region.status(), "cuda_ipc: exporting the pushed buffer");
    MAINSTAY_ASSIGN_OR_RETURN(Session s, SessionTo(route.endpoint, deadline));
    v1::CudaIpcPushRequest request;
    request.set_session_id(s.id);
    *request.mutable_header() = header;
    *request.mutable_memory() = ToProto(*region);
    v1::PushGradResponse response;
    absl::Status status = StatusFromCall(route.stub->CudaIpcPush(context, request, &response), context);
    ForgetIfLost(route, s, status);
    if (!status.ok()) return status;
    return response;
  }

  // A pull into device memory (Client::PullShardInto) is written there by the daemon; every other
  // pull goes over gRPC.
  absl::Status Pull(const Route& route, const v1::PullParamsRequest& request, ShardPullAssembler& assembler,
                    Deadline deadline, grpc::ClientContext* context) override {
    const std::span<uint8_t> dest = assembler.data_destination();
    if (dest.empty() || HostReadable(dest.data())) return grpc_->Pull(route, request, assembler, deadline, context);
    if (request.delta_chunk_bytes() != 0) return absl::InternalError("cuda_ipc: a delta pull into device memory");
    absl::StatusOr<CudaDriver::IpcRegion> region = cuda_.ExportIpc(dest.data());
    if (!region.ok()) return Annotate(region.status(), "cuda_ipc: exporting the pull's destination");
    MAINSTAY_ASSIGN_OR_RETURN(Session s, SessionTo(route.endpoint, deadline));
    v1::CudaIpcPullRequest call;
    call.set_session_id(s.id);
    *call.mutable_request() = request;
    *call.mutable_memory() = ToProto(*region);
    call.set_bytes(dest.size());
    v1::CudaIpcPullResponse response;
    absl::Status status = StatusFromCall(route.stub->CudaIpcPull(context, call, &response), context);
    const bool session_lost = ForgetIfLost(route, s, status);
    if (absl::IsDeadlineExceeded(status) || absl::IsCancelled(status) ||
        (absl::IsUnavailable(status) && !session_lost)) {
      // The call may have ended without the daemon's answer (its deadline, a cancel, a broken
      // connection) while the daemon still writes into the destination, which the caller may
      // reuse once the handle is ready: detaching waits for the session's writes (the next call
      // attaches again).
      if (absl::Status fenced = Detach(s, kFenceTimeout); !fenced.ok()) {
        status = Annotate(status, absl::StrCat("the destination may still be written by daemon ", route.daemon_id,
                                               " (detaching to wait for its write failed: ", fenced.ToString(), ")"));
      }
      Forget(route.endpoint.daemon_id(), s.id);
    }
    MAINSTAY_RETURN_IF_ERROR(status);
    v1::PullParamsResponse header;
    *header.mutable_header() = response.header();
    MAINSTAY_RETURN_IF_ERROR(assembler.OnMessage(header));
    if (assembler.unchanged()) return absl::OkStatus();
    const std::span<uint8_t> scales = assembler.scale_destination();
    if (response.scales().size() != scales.size()) {
      return absl::InternalError(absl::StrCat("cuda_ipc: the daemon sent ", response.scales().size(),
                                              " bytes of block scales; its header announced ", scales.size()));
    }
    std::memcpy(scales.data(), response.scales().data(), scales.size());
    return assembler.Placed();
  }

  void Shutdown() override {
    shutdown_.store(true);
    grpc_->Shutdown();
    absl::MutexLock lock(&mu_);
    if (attaching_ != nullptr) attaching_->TryCancel();  // ends at once, not at its deadline
  }

 private:
  struct Session {
    uint64_t id = 0;
    std::shared_ptr<v1::Shard::Stub> stub;
  };

  static v1::CudaIpcRegion ToProto(const CudaDriver::IpcRegion& region) {
    v1::CudaIpcRegion r;
    r.set_handle(region.handle);
    r.set_offset(region.offset);
    r.set_allocation_bytes(region.allocation_bytes);
    return r;
  }

  // The daemon lost the session (it restarted; shard.proto's CudaIpcPush): the retry attaches
  // again. Other UNAVAILABLE answers (a drain, a step in flight) keep it. True when it was lost.
  bool ForgetIfLost(const Route& route, const Session& s, const absl::Status& status) {
    if (!absl::IsUnavailable(status) || !absl::StrContains(status.message(), "unknown cuda_ipc session")) return false;
    Forget(route.endpoint.daemon_id(), s.id);
    return true;
  }
  void Forget(const std::string& daemon_id, uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(daemon_id);
    if (it != sessions_.end() && it->second.id == id) sessions_.erase(it);
  }

  // DetachCudaIpc: the daemon ends the session once none of its pulls writes any more.
  absl::Status Detach(const Session& s, absl::Duration timeout) {
    v1::DetachCudaIpcRequest request;
    request.set_session_id(s.id);
    request.set_job_id(context_.job_id);
    request.set_job_token(context_.job_token);
    v1::DetachCudaIpcResponse response;
    grpc::ClientContext call;
    call.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    return StatusFromCall(s.stub->DetachCudaIpc(&call, request, &response), &call);
  }

  absl::StatusOr<Session> SessionTo(const v1::DaemonEndpoint& daemon, Deadline deadline) {
    if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
    auto known = [&]() -> std::optional<Session> {
      absl::MutexLock lock(&mu_);
      auto it = sessions_.find(daemon.daemon_id());
      if (it == sessions_.end()) return std::nullopt;
      return it->second;
    };
    if (std::optional<Session> s = known(); s.has_value()) return *s;
    absl::MutexLock attach_lock(&attach_mu_);  // one attach at a time: no duplicate sessions
    if (std::optional<Session> s = known(); s.has_value()) return *s;
    Session s;
    s.stub = context_.stub_for(daemon.address());
    v1::AttachCudaIpcRequest request;
    request.set_job_id(context_.job_id);
    request.set_job_token(context_.job_token);
    request.set_rank(context_.rank);
    const ProcessIdentity& self = ProcessIdentity::Self();
    request.set_boot_id(self.boot_id);
    request.set_pid_namespace(self.pid_namespace);
    request.set_pid(self.pid);
    request.set_node_name(node_);
    v1::AttachCudaIpcResponse response;
    grpc::ClientContext call;
    call.set_deadline(deadline);
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
      attaching_ = &call;
    }
    absl::Status status = StatusFromCall(s.stub->AttachCudaIpc(&call, request, &response), &call);
    {
      absl::MutexLock lock(&mu_);
      attaching_ = nullptr;
    }
    if (status.ok() && response.session_id() == 0) status = absl::InternalError("session id 0");
    if (!status.ok()) {
      return Annotate(status,
                      absl::StrCat("attaching cuda_ipc to daemon ", daemon.daemon_id(), " (", daemon.address(), ")"));
    }
    s.id = response.session_id();
    absl::MutexLock lock(&mu_);
    sessions_[daemon.daemon_id()] = s;
    return s;
  }

  const TransportContext context_;
  const CudaDriver& cuda_;
  const std::unique_ptr<DataTransport> grpc_;  // pushes and pulls of host memory
  const std::string node_ = HostName();
  std::atomic<bool> shutdown_{false};
  absl::Mutex attach_mu_;
  absl::Mutex mu_;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);  // by daemon id
  grpc::ClientContext* attaching_ ABSL_GUARDED_BY(mu_) = nullptr;  // the attach in flight (attach_mu_)
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataTransport>> MakeCudaIpcTransport(const TransportContext& context,
                                                                    const CudaDriver& cuda) {
  if (!context.stub_for) return absl::InternalError("the cuda_ipc transport needs stub_for");
  if (absl::Status s = cuda.CanExportIpc(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("CUDA: ", s.message()));
  }
  return std::unique_ptr<DataTransport>(new CudaIpcTransport(context, cuda, MakeGrpcTransport(context)));
}

}  // namespace mainstay::client_internal

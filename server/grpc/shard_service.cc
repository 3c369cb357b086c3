#include "server/grpc/shard_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_tls.h"
#include "common/logging.h"
#include "common/status.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "server/daemon/shard_transfer.h"
#include "server/grpc/caller_identity.h"
#include "server/grpc/calls.h"
#include "server/grpc/data_streams.h"
#include "server/grpc/health_port.h"
#include "server/grpc/push_streams.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {
namespace {

using grpc_server::CallDeadline;
using grpc_server::Calls;
using grpc_server::ToGrpcWithDetail;

constexpr char kComponent[] = "shard-server";
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);
constexpr absl::Duration kShutdownGrace = absl::Seconds(5);
constexpr absl::Duration kCloseGrace = absl::Milliseconds(500);

constexpr char kTransport[] = "grpc";                  // the `transport` label of the byte counters
constexpr char kShardService[] = "mainstay.v1.Shard";  // its health status is the readiness

// Calls `wait(slice_deadline)` in slices until it answers something other than
// DEADLINE_EXCEEDED, the call's deadline passes, the call is cancelled or the server drains.
template <typename T, typename Fn>
absl::StatusOr<T> WaitInSlices(::grpc::CallbackServerContext* context, Calls* calls, Fn wait) {
  const absl::Time end = CallDeadline(context);
  while (true) {
    const absl::Time slice = std::min(end, absl::Now() + kWaitSlice);
    absl::StatusOr<T> result = wait(slice);
    if (result.ok() || result.status().code() != absl::StatusCode::kDeadlineExceeded || absl::Now() >= end) {
      return result;
    }
    if (context->IsCancelled()) return absl::CancelledError("the call was cancelled");
    if (calls->draining()) return FromGrpcStatus(ShuttingDown());
  }
}

// ForwardStepInput: a primary's input of one step for a replica here (internal only). The
// header is checked before any payload is kept; the payload is stored only once all of it came.
class ForwardInputReactor final : public ::grpc::ServerReadReactor<v1::ForwardStepInputRequest> {
 public:
  ForwardInputReactor(ShardDaemon* core, Calls* calls, const grpc_server::InternalPeers& internal,
                      ::grpc::CallbackServerContext* context, v1::ForwardStepInputResponse* response)
      : core_(core), calls_(calls), context_(context), response_(response) {
    if (absl::Status s = grpc_server::CheckInternalPeer(context, internal, "ForwardStepInput"); !s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    if (!calls_->Enter()) {
      Finish(ShuttingDown());
      return;
    }
    entered_ = true;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) return End(absl::CancelledError("ForwardStepInput: cancelled; nothing stored"));
    if (!ok) {
      if (!have_header_) return End(absl::InvalidArgumentError("ForwardStepInput: the stream had no header"));
      if (duplicate_) {
        response_->set_duplicate(true);
        return End(absl::OkStatus());
      }
      absl::StatusOr<bool> stored = core_->StoreReplicaInput(header_, std::move(payload_));
      if (stored.ok()) response_->set_duplicate(*stored);
      return End(stored.status());
    }
    if (!have_header_) {
      if (!request_.has_header()) return End(absl::InvalidArgumentError("ForwardStepInput: the first message must be the header"));
      header_ = request_.header();
      if (header_.payload_from_trainer()) {  // the header alone: nothing follows
        absl::StatusOr<bool> adopted = core_->AdoptTrainerCopy(header_);
        if (adopted.ok()) response_->set_duplicate(*adopted);
        return End(adopted.status());
      }
      absl::StatusOr<bool> duplicate = core_->CheckReplicaInput(header_);
      if (!duplicate.ok()) return End(duplicate.status());
      duplicate_ = *duplicate;
      have_header_ = true;
      if (!duplicate_) {
        payload_ = core_->SpareBuffer(header_.job_id(), header_.total_bytes());
        payload_.reserve(static_cast<size_t>(header_.total_bytes()));
      }
    } else {
      if (!request_.has_chunk()) return End(absl::InvalidArgumentError("ForwardStepInput: a second header in one stream"));
      const v1::GradChunk& chunk = request_.chunk();
      const int64_t element = header_.dtype() == v1::ELEMENT_TYPE_FP32 ? 4 : 2;
      if (chunk.element_offset() * element != received_ || chunk.data().size() > static_cast<size_t>(kMaxChunkBytes) ||
          received_ + static_cast<int64_t>(chunk.data().size()) > header_.total_bytes()) {
        return End(absl::InvalidArgumentError(absl::StrCat(
            "ForwardStepInput: chunk of ", chunk.data().size(), " bytes at element ", chunk.element_offset(),
            " does not continue the ", received_, " bytes received (of ", header_.total_bytes(), ")")));
      }
      received_ += static_cast<int64_t>(chunk.data().size());
      if (!duplicate_) payload_.insert(payload_.end(), chunk.data().begin(), chunk.data().end());
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void End(const absl::Status& status) {
    Finish(ToGrpcWithDetail(context_, status));
    if (entered_) calls_->Exit();
    entered_ = false;
  }

  ShardDaemon* const core_;
  Calls* const calls_;
  ::grpc::CallbackServerContext* const context_;
  v1::ForwardStepInputResponse* const response_;
  v1::ForwardStepInputRequest request_;
  v1::ReplicaInputHeader header_;
  bool have_header_ = false;
  bool duplicate_ = false;
  int64_t received_ = 0;
  std::vector<uint8_t> payload_;
  bool entered_ = false;
};

// A server stream produced by a blocking function on a helper thread: `produce(write)` calls
// write(message) for each message (each write waits for the previous one's OnWriteDone; false
// when the client went away) and returns the final status. The reactor is deleted by whichever
// of OnDone and the helper thread ends last.
template <typename Message>
class BlockingWriter final : public ::grpc::ServerWriteReactor<Message> {
 public:
  using Write = std::function<bool(const Message&)>;
  using Produce = std::function<absl::Status(const Write&)>;

  BlockingWriter(Calls* calls, ::grpc::CallbackServerContext* context, Produce produce)
      : calls_(calls), context_(context), produce_(std::move(produce)) {
    if (!calls_->Enter()) {
      refs_ = 1;
      this->Finish(ShuttingDown());
    } else if (!calls_->Spawn([this] { Run(); })) {
      refs_ = 1;
      this->Finish(ShuttingDown());
      calls_->Exit();
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    write_pending_ = false;
    write_ok_ = ok;
  }
  void OnDone() override { Unref(); }

 private:
  void Run() {
    Calls* const calls = calls_;
    const absl::Status status = produce_([this](const Message& m) { return WriteOne(m); });
    this->Finish(ToGrpcWithDetail(context_, status));
    calls->Exit();
    Unref();
  }

  bool WriteOne(const Message& message) {
    {
      absl::MutexLock lock(&mu_);
      write_pending_ = true;
    }
    this->StartWrite(&message);
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !write_pending_; };
    mu_.Await(absl::Condition(&done));
    return write_ok_;
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  Calls* const calls_;
  ::grpc::CallbackServerContext* const context_;
  const Produce produce_;
  std::atomic<int> refs_{2};  // OnDone + the helper thread
  absl::Mutex mu_;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = true;
};

// Sends `bytes` as chunks of at most `chunk` bytes; make(offset_bytes, data, size) fills one.
template <typename Message, typename Make>
absl::Status WriteChunks(const std::function<bool(const Message&)>& write, const uint8_t* bytes, int64_t size,
                         int64_t chunk, Make make) {
  Message message;
  for (int64_t off = 0; off < size; off += chunk) {
    const int64_t n = std::min<int64_t>(chunk, size - off);
    message.Clear();
    make(message, off, bytes + off, n);
    if (!write(message)) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

// FetchShardState: the move's copy (fenced when the request's epoch is newer), then its buffers
// in chunks (server/daemon/shard_transfer.h).
absl::Status StreamState(ShardDaemon* core, const v1::FetchShardStateRequest& request, absl::Time deadline,
                         const std::function<bool(const v1::FetchShardStateResponse&)>& write) {
  MAINSTAY_ASSIGN_OR_RETURN(ShardStateCopy state, core->CopyShardForMove(request, deadline));
  return WriteShardState(state, ChunkBytes(0), write);
}

::grpc::Status NoNccl() {
  return ::grpc::Status(::grpc::StatusCode::UNIMPLEMENTED,
                        "this daemon does not serve the nccl transport (mainstayd --transports nccl)");
}

::grpc::Status NoCudaIpc() {
  return ::grpc::Status(::grpc::StatusCode::UNIMPLEMENTED,
                        "this daemon does not serve the cuda_ipc transport (it needs mainstayd --device cuda:N, "
                        "and --transports auto or cuda_ipc)");
}

// PushGrad and PullParams are raw (ByteBuffer) methods: their bulk chunks bypass protobuf.
using ShardServiceBase =
    v1::Shard::WithRawCallbackMethod_PushGrad<v1::Shard::WithRawCallbackMethod_PullParams<v1::Shard::CallbackService>>;

class ShardService final : public ShardServiceBase {
 public:
  ShardService(ShardDaemon* core, Calls* calls, grpc_server::Waiters* waiters, StepDrain* drain,
               grpc_server::InternalPeers internal, NcclChannelServer* nccl, CudaIpcServer* cuda_ipc,
               PushStreams* streams)
      : core_(core),
        calls_(calls),
        waiters_(waiters),
        drain_(drain),
        internal_(std::move(internal)),
        nccl_(nccl),
        cuda_ipc_(cuda_ipc),
        streams_(streams) {
    if (metrics::DaemonMetrics* m = core->metrics(); m != nullptr) {
      pushed_bytes_ = m->PushedBytes(kTransport);
      pulled_bytes_ = m->PulledBytes(kTransport);
    }
  }

  ::grpc::ServerUnaryReactor* AssignShard(::grpc::CallbackServerContext* context, const v1::AssignShardRequest* request,
                                          v1::AssignShardResponse* response) override {
    return grpc_server::Serve(calls_, context, response, ShuttingDown(),
                              [&]() -> absl::StatusOr<v1::AssignShardResponse> {
                                MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "AssignShard"));
                                return core_->AssignShard(*request);
                              });
  }
  ::grpc::ServerUnaryReactor* DropShard(::grpc::CallbackServerContext* context, const v1::DropShardRequest* request,
                                        v1::DropShardResponse* response) override {
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&]() -> absl::Status {
      MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "DropShard"));
      return core_->DropShard(*request);
    });
  }
  ::grpc::ServerReadReactor<::grpc::ByteBuffer>* PushGrad(::grpc::CallbackServerContext* context,
                                                          ::grpc::ByteBuffer* response) override {
    return NewPushGradReactor(core_, calls_, pushed_bytes_.get(), drain_, streams_, context, response);
  }
  ::grpc::ServerReadReactor<v1::ForwardStepInputRequest>* ForwardStepInput(
      ::grpc::CallbackServerContext* context, v1::ForwardStepInputResponse* response) override {
    return new ForwardInputReactor(core_, calls_, internal_, context, response);
  }
  ::grpc::ServerWriteReactor<::grpc::ByteBuffer>* PullParams(::grpc::CallbackServerContext* context,
                                                             const ::grpc::ByteBuffer* request) override {
    return NewPullWriter(core_, calls_, waiters_, pulled_bytes_.get(), context, *request);
  }
  ::grpc::ServerUnaryReactor* FinishStep(::grpc::CallbackServerContext* context, const v1::FinishStepRequest* request,
                                         v1::FinishStepResponse* response) override {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    grpc_server::AnswerWhenReady<v1::StepStats>(
        calls_, waiters_, context, request->job_id(), CallDeadline(context),
        [this, request] { return core_->FinishStep(*request, absl::InfinitePast()); },
        grpc_server::DeadlinePassed<v1::StepStats>,
        [this, context, response, reactor](absl::StatusOr<v1::StepStats> stats) {
          if (stats.ok()) *response->mutable_stats() = *std::move(stats);
          reactor->Finish(ToGrpcWithDetail(context, stats.status()));
          calls_->Exit();
        },
        FromGrpcStatus(ShuttingDown()));
    return reactor;
  }
  ::grpc::ServerUnaryReactor* GetStepStats(::grpc::CallbackServerContext* context,
                                           const v1::GetStepStatsRequest* request,
                                           v1::GetStepStatsResponse* response) override {
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&]() -> absl::Status {
      MAINSTAY_ASSIGN_OR_RETURN(*response->mutable_stats(), core_->GetStepStats(*request));
      return absl::OkStatus();
    });
  }
  ::grpc::ServerUnaryReactor* PinVersion(::grpc::CallbackServerContext* context, const v1::PinVersionRequest* request,
                                         v1::PinVersionResponse* response) override {
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&]() -> absl::Status {
      MAINSTAY_ASSIGN_OR_RETURN(*response, core_->PinVersion(*request));
      return absl::OkStatus();
    });
  }
  ::grpc::ServerUnaryReactor* GetStepOutcome(::grpc::CallbackServerContext* context,
                                             const v1::GetStepOutcomeRequest* request,
                                             v1::GetStepOutcomeResponse* response) override {
    if (absl::Status s = grpc_server::CheckInternalPeer(context, internal_, "GetStepOutcome"); !s.ok()) {
      ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&]() -> absl::Status {
      *response = core_->GetStepOutcome(*request);
      return absl::OkStatus();
    });
  }
  ::grpc::ServerWriteReactor<v1::FetchShardStateResponse>* FetchShardState(
      ::grpc::CallbackServerContext* context, const v1::FetchShardStateRequest* request) override {
    if (absl::Status s = grpc_server::CheckInternalPeer(context, internal_, "FetchShardState"); !s.ok()) {
      return new grpc_server::FinishedWriter<v1::FetchShardStateResponse>(ToGrpcStatus(s));
    }
    const v1::FetchShardStateRequest copy = *request;
    return new BlockingWriter<v1::FetchShardStateResponse>(
        calls_, context, [core = core_, copy, context](const auto& write) {
          return StreamState(core, copy, std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Minutes(5)),
                             write);
        });
  }
  ::grpc::ServerUnaryReactor* WriteCheckpoint(::grpc::CallbackServerContext* context,
                                              const v1::WriteCheckpointRequest* request,
                                              v1::WriteCheckpointResponse* response) override {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (absl::Status s = grpc_server::CheckInternalPeer(context, internal_, "WriteCheckpoint"); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    // Waits for the step, then writes files: off the gRPC threads.
    const bool spawned = calls_->Spawn([this, context, request, response, reactor] {
      absl::StatusOr<v1::WriteCheckpointResponse> written = WaitInSlices<v1::WriteCheckpointResponse>(
          context, calls_, [&](absl::Time deadline) { return core_->WriteCheckpoint(*request, deadline); });
      if (written.ok()) *response = *std::move(written);
      reactor->Finish(ToGrpcWithDetail(context, written.status()));
      calls_->Exit();
    });
    if (!spawned) {
      reactor->Finish(ShuttingDown());
      calls_->Exit();
    }
    return reactor;
  }

  // ---- The nccl transport (server/nccl): control messages here, payloads by NCCL.
  ::grpc::ServerUnaryReactor* OpenNcclChannel(::grpc::CallbackServerContext* context,
                                              const v1::OpenNcclChannelRequest* request,
                                              v1::OpenNcclChannelResponse* response) override {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (nccl_ == nullptr) {
      reactor->Finish(NoNccl());
      return reactor;
    }
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    // Joining the communicator waits for the trainer: off the gRPC threads.
    const bool spawned = calls_->Spawn([this, context, request, response, reactor] {
      absl::StatusOr<v1::OpenNcclChannelResponse> opened =
          nccl_->Open(*request, CallDeadline(context), CancelledFn(context));
      if (opened.ok()) *response = *std::move(opened);
      reactor->Finish(ToGrpcWithDetail(context, opened.status()));
      calls_->Exit();
    });
    if (!spawned) {
      reactor->Finish(ShuttingDown());
      calls_->Exit();
    }
    return reactor;
  }
  ::grpc::ServerWriteReactor<v1::NcclReply>* NcclPush(::grpc::CallbackServerContext* context,
                                                      const v1::NcclPushRequest* request) override {
    if (nccl_ == nullptr) return new grpc_server::FinishedWriter<v1::NcclReply>(NoNccl());
    const v1::NcclPushRequest copy = *request;
    return new BlockingWriter<v1::NcclReply>(
        calls_, context, [nccl = nccl_, context, copy, cancelled = CancelledFn(context)](const auto& write) {
          return nccl->Push(copy, CallDeadline(context), write, cancelled);
        });
  }
  ::grpc::ServerWriteReactor<v1::NcclReply>* NcclPull(::grpc::CallbackServerContext* context,
                                                      const v1::NcclPullRequest* request) override {
    if (nccl_ == nullptr) return new grpc_server::FinishedWriter<v1::NcclReply>(NoNccl());
    const v1::NcclPullRequest copy = *request;
    return new BlockingWriter<v1::NcclReply>(
        calls_, context, [nccl = nccl_, context, copy, cancelled = CancelledFn(context)](const auto& write) {
          return nccl->Pull(copy, CallDeadline(context), write, cancelled);
        });
  }
  ::grpc::ServerUnaryReactor* CloseNcclChannel(::grpc::CallbackServerContext* context,
                                               const v1::CloseNcclChannelRequest* request,
                                               v1::CloseNcclChannelResponse* response) override {
    if (nccl_ == nullptr) {
      ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(NoNccl());
      return reactor;
    }
    return grpc_server::Serve(calls_, context, response, ShuttingDown(),
                              [&]() -> absl::Status { return nccl_->Close(*request); });
  }

  // ---- The cuda_ipc transport (server/cudaipc): the push's payload is copied out of the
  // trainer's device memory, and a pull's data into it, while the call runs.
  ::grpc::ServerUnaryReactor* AttachCudaIpc(::grpc::CallbackServerContext* context,
                                            const v1::AttachCudaIpcRequest* request,
                                            v1::AttachCudaIpcResponse* response) override {
    if (cuda_ipc_ == nullptr) {
      ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(NoCudaIpc());
      return reactor;
    }
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&] { return cuda_ipc_->Attach(*request); });
  }
  ::grpc::ServerUnaryReactor* CudaIpcPush(::grpc::CallbackServerContext* context, const v1::CudaIpcPushRequest* request,
                                          v1::PushGradResponse* response) override {
    // The copy and the store take milliseconds.
    return CudaIpcOffThread(context, response, [this, request] { return cuda_ipc_->Push(*request); });
  }
  ::grpc::ServerUnaryReactor* CudaIpcPull(::grpc::CallbackServerContext* context, const v1::CudaIpcPullRequest* request,
                                          v1::CudaIpcPullResponse* response) override {
    // It may wait for its version, then copies.
    return CudaIpcOffThread(context, response, [this, context, request] {
      return cuda_ipc_->Pull(*request, absl::FromChrono(context->deadline()), CancelledFn(context));
    });
  }
  ::grpc::ServerUnaryReactor* DetachCudaIpc(::grpc::CallbackServerContext* context,
                                            const v1::DetachCudaIpcRequest* request,
                                            v1::DetachCudaIpcResponse* response) override {
    // It waits for the session's pulls that are still writing.
    return CudaIpcOffThread(context, response, [this, context, request]() -> absl::StatusOr<v1::DetachCudaIpcResponse> {
      MAINSTAY_RETURN_IF_ERROR(cuda_ipc_->Detach(*request, absl::FromChrono(context->deadline())));
      return v1::DetachCudaIpcResponse();
    });
  }

 private:
  // A cuda_ipc call whose `work` (returning absl::StatusOr<Response>) copies, and may wait, off
  // the gRPC threads.
  template <typename Response, typename Work>
  ::grpc::ServerUnaryReactor* CudaIpcOffThread(::grpc::CallbackServerContext* context, Response* response, Work work) {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (cuda_ipc_ == nullptr) {
      reactor->Finish(NoCudaIpc());
      return reactor;
    }
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    const bool spawned = calls_->Spawn([this, context, response, reactor, work] {
      absl::StatusOr<Response> result = work();
      if (result.ok()) *response = *std::move(result);
      reactor->Finish(ToGrpcWithDetail(context, result.status()));
      calls_->Exit();
    });
    if (!spawned) {
      reactor->Finish(ShuttingDown());
      calls_->Exit();
    }
    return reactor;
  }

  // The nccl calls' view of a call that is over: cancelled by the trainer, or the server drains.
  NcclChannelServer::Cancelled CancelledFn(::grpc::CallbackServerContext* context) const {
    return [context, calls = calls_] { return context->IsCancelled() || calls->draining(); };
  }

  ShardDaemon* const core_;
  Calls* const calls_;
  grpc_server::Waiters* const waiters_;
  StepDrain* const drain_;
  const grpc_server::InternalPeers internal_;
  NcclChannelServer* const nccl_;  // null: no nccl transport
  CudaIpcServer* const cuda_ipc_;  // null: no cuda_ipc transport
  PushStreams* const streams_;     // the open PushGrad streams
  std::shared_ptr<metrics::Counter> pushed_bytes_, pulled_bytes_;  // null: no metrics
};

}  // namespace

struct ShardServer::Impl {
  Options options;
  std::unique_ptr<PushStreams> streams;  // declared first: outlives the server and its reactors
  Calls calls;
  std::unique_ptr<grpc_server::Waiters> waiters;  // the parked PullParams and FinishStep calls
  std::unique_ptr<ShardService> service;
  std::unique_ptr<::grpc::Server> server;
  std::unique_ptr<grpc_server::HealthPort> health_port;  // null: none
  int port = 0;
  std::atomic<bool> shut_down{false};
  absl::Mutex health_mu;  // orders SetReady against BeginDrain
  bool drained ABSL_GUARDED_BY(health_mu) = false;

  ~Impl() { Shutdown(); }

  void Shutdown() {
    if (shut_down.exchange(true)) return;
    if (health_port != nullptr) health_port->SetServingStatus(false);
    if (waiters != nullptr) options.daemon->SetChangeListener(nullptr);
    grpc_server::ShutdownServer(server.get(), calls, waiters.get(), kShutdownGrace, kCloseGrace, kComponent);
    if (health_port != nullptr) health_port->Shutdown();
  }
};

ShardServer::ShardServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardServer::~ShardServer() = default;
int ShardServer::port() const { return impl_->port; }
int ShardServer::health_port() const { return impl_->health_port == nullptr ? 0 : impl_->health_port->port(); }
void ShardServer::Shutdown() { impl_->Shutdown(); }

void ShardServer::SetReady(bool ready) {
  absl::MutexLock lock(&impl_->health_mu);
  if (impl_->drained || impl_->server == nullptr) return;
  if (::grpc::HealthCheckServiceInterface* health = impl_->server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(kShardService, ready);
  }
  if (impl_->health_port != nullptr) impl_->health_port->SetServingStatus(kShardService, ready);
}

void ShardServer::BeginDrain() {
  absl::MutexLock lock(&impl_->health_mu);
  impl_->drained = true;
  if (impl_->server == nullptr) return;
  if (::grpc::HealthCheckServiceInterface* health = impl_->server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(false);
  }
  if (impl_->health_port != nullptr) impl_->health_port->SetServingStatus(false);
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  if (options.listen_address.empty()) return absl::InvalidArgumentError("listen_address: must not be empty");
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<::grpc::ServerCredentials> credentials, MakeServerCredentials(options.tls));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (!options.internal_peer_name.empty() && !options.tls.require_client_cert) {
    return absl::InvalidArgumentError(
        "--tls-internal-name needs mutual TLS (--tls-client-auth require): the name is read from client certificates");
  }
  const grpc_server::InternalPeers internal{options.internal_peer_name, options.cluster_secret};
  MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckListenerIsSafe(internal, options.listen_address, options.insecure, "mainstayd"));
  impl->streams = std::make_unique<PushStreams>(options.push_idle_timeout);
  impl->waiters = std::make_unique<grpc_server::Waiters>(options.waits);
  impl->service = std::make_unique<ShardService>(options.daemon, &impl->calls, impl->waiters.get(), options.drain,
                                                 internal, options.nccl, options.cuda_ipc, impl->streams.get());
  options.daemon->SetChangeListener(
      [waiters = impl->waiters.get()](const std::string& job_id) { waiters->Notify(job_id); });
  ::grpc::EnableDefaultHealthCheckService(true);
  ::grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, credentials, &impl->port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  // Trainers ping every few seconds while a call runs (client keepalive, to notice a
  // partitioned daemon); without these gRPC answers such pings with GOAWAY "too_many_pings".
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.RegisterService(impl->service.get());
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               " (address in use or not local?)"));
  }
  if (::grpc::HealthCheckServiceInterface* health = impl->server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus("", true);
    health->SetServingStatus(kShardService, false);  // ready once registered: SetReady
  }
  if (!options.health_listen_address.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(impl->health_port, grpc_server::HealthPort::Start(options.health_listen_address));
    impl->health_port->SetServingStatus("", true);
  }
  Log(LogLevel::kInfo, kComponent,
      absl::StrCat("serving the Shard service on port ", impl->port,
                   options.tls.ServerEnabled() ? (options.tls.require_client_cert ? " with mutual TLS" : " with TLS") : " in plaintext",
                   " (", grpc_server::DescribeInternalPeers(internal), ")"));
  return std::unique_ptr<ShardServer>(new ShardServer(std::move(impl)));
}

}  // namespace mainstay::daemon

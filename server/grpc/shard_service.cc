#include "server/grpc/shard_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/layout_proto.h"
#include "common/logging.h"
#include "common/status.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "server/grpc/calls.h"

namespace mainstay::daemon {
namespace {

using grpc_server::CallDeadline;
using grpc_server::Calls;
using grpc_server::ToGrpcWithDetail;

constexpr char kComponent[] = "shard-server";
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);
constexpr absl::Duration kShutdownGrace = absl::Seconds(5);
constexpr absl::Duration kCloseGrace = absl::Milliseconds(500);
constexpr int64_t kDefaultChunkBytes = 1 << 20;
constexpr int64_t kMaxChunkBytes = 4 << 20;

::grpc::Status ShuttingDown() { return ::grpc::Status(::grpc::StatusCode::UNAVAILABLE, "daemon is shutting down"); }

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

// PushGrad: header first (validated before any data), then chunks into the session.
class PushGradReactor final : public ::grpc::ServerReadReactor<v1::PushGradRequest> {
 public:
  PushGradReactor(ShardDaemon* core, Calls* calls, ::grpc::CallbackServerContext* context,
                  v1::PushGradResponse* response)
      : core_(core), calls_(calls), context_(context), response_(response) {
    if (!calls_->Enter()) {
      Finish(ShuttingDown());
      return;
    }
    entered_ = true;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed: the stream is complete
      if (session_ == nullptr) return End(absl::InvalidArgumentError("PushGrad: the stream had no header"));
      absl::StatusOr<v1::PushGradResponse> result = session_->Finish();
      if (result.ok()) *response_ = *std::move(result);
      return End(result.status());
    }
    if (session_ == nullptr) {
      if (!request_.has_header()) return End(absl::InvalidArgumentError("PushGrad: the first message must be the header"));
      absl::StatusOr<std::unique_ptr<PushSession>> session = core_->BeginPush(request_.header());
      if (!session.ok()) return End(session.status());
      session_ = *std::move(session);
    } else {
      if (!request_.has_chunk()) return End(absl::InvalidArgumentError("PushGrad: a second header in one stream"));
      if (absl::Status s = session_->AddChunk(request_.chunk().element_offset(), request_.chunk().data()); !s.ok()) {
        return End(s);
      }
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
  v1::PushGradResponse* const response_;
  v1::PushGradRequest request_;
  std::unique_ptr<PushSession> session_;
  bool entered_ = false;
};

// PullParams: a helper thread waits for the version, then writes header, data and scale
// chunks one at a time (each write waits for the previous one's OnWriteDone). The reactor is
// deleted by whichever of OnDone and the helper thread ends last.
class PullParamsReactor final : public ::grpc::ServerWriteReactor<v1::PullParamsResponse> {
 public:
  PullParamsReactor(ShardDaemon* core, Calls* calls, ::grpc::CallbackServerContext* context,
                    const v1::PullParamsRequest& request)
      : core_(core), calls_(calls), context_(context), request_(request) {
    if (!calls_->Enter()) {
      refs_ = 1;
      Finish(ShuttingDown());
    } else if (!calls_->Spawn([this] { Run(); })) {
      refs_ = 1;
      Finish(ShuttingDown());
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
    const absl::Status status = Stream();
    Finish(ToGrpcWithDetail(context_, status));
    calls->Exit();
    Unref();
  }

  bool Write(const v1::PullParamsResponse& message) {
    {
      absl::MutexLock lock(&mu_);
      write_pending_ = true;
    }
    StartWrite(&message);
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !write_pending_; };
    mu_.Await(absl::Condition(&done));
    return write_ok_;
  }

  absl::Status Stream() {
    absl::StatusOr<PullResult> result = WaitInSlices<PullResult>(
        context_, calls_, [&](absl::Time deadline) { return core_->PullParams(request_, deadline); });
    if (!result.ok()) return result.status();
    const QuantizedShard& s = *result->shard;
    v1::PullParamsResponse message;
    v1::PullParamsHeader& h = *message.mutable_header();
    h.set_version(s.version);
    h.set_unchanged(result->unchanged);
    h.set_format(FormatToProto(s.format));
    h.mutable_elements()->set_begin(s.elements.begin);
    h.mutable_elements()->set_end(s.elements.end);
    h.set_total_data_bytes(static_cast<int64_t>(s.data.size()));
    if (s.has_scales) h.set_scale_type(ElementTypeToProto(s.scale_type));
    h.set_total_scales(s.num_scales);
    h.set_total_scale_bytes(static_cast<int64_t>(s.scales.size()));
    for (const FragmentMeta& f : s.fragments) {
      v1::FragmentQuantization* q = h.add_fragments();
      q->set_tensor(f.tensor);
      q->mutable_elements()->set_begin(f.elements.begin);
      q->mutable_elements()->set_end(f.elements.end);
      q->set_format(FormatToProto(f.format));
      q->set_scale(f.scale);
      q->set_scale_inv(f.scale_inv);
      q->set_amax(f.amax);
    }
    if (!Write(message)) return absl::CancelledError("PullParams: the client went away");
    if (result->unchanged) return absl::OkStatus();
    int64_t chunk = request_.max_chunk_bytes() > 0 ? std::min(request_.max_chunk_bytes(), kMaxChunkBytes)
                                                   : kDefaultChunkBytes;
    chunk = std::max<int64_t>(chunk - chunk % 8, 8);  // whole elements of every type
    const int bits = Describe(s.format).bits_per_element;
    for (int64_t off = 0; off < static_cast<int64_t>(s.data.size()); off += chunk) {
      const int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(s.data.size()) - off);
      message.Clear();
      message.mutable_data()->set_element_offset(off * 8 / bits);
      message.mutable_data()->set_data(s.data.data() + off, static_cast<size_t>(n));
      if (!Write(message)) return absl::CancelledError("PullParams: the client went away");
    }
    const int64_t entry = s.num_scales > 0 ? static_cast<int64_t>(s.scales.size()) / s.num_scales : 1;
    for (int64_t off = 0; off < static_cast<int64_t>(s.scales.size()); off += chunk) {
      const int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(s.scales.size()) - off);
      message.Clear();
      message.mutable_scales()->set_scale_offset(off / entry);
      message.mutable_scales()->set_data(s.scales.data() + off, static_cast<size_t>(n));
      if (!Write(message)) return absl::CancelledError("PullParams: the client went away");
    }
    return absl::OkStatus();
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  ShardDaemon* const core_;
  Calls* const calls_;
  ::grpc::CallbackServerContext* const context_;
  const v1::PullParamsRequest request_;
  std::atomic<int> refs_{2};  // OnDone + the helper thread
  absl::Mutex mu_;
  bool write_pending_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = true;
};


class ShardService final : public v1::Shard::CallbackService {
 public:
  ShardService(ShardDaemon* core, Calls* calls) : core_(core), calls_(calls) {}

  ::grpc::ServerUnaryReactor* AssignShard(::grpc::CallbackServerContext* context, const v1::AssignShardRequest* request,
                                          v1::AssignShardResponse* response) override {
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&] { return core_->AssignShard(*request); });
  }
  ::grpc::ServerUnaryReactor* DropShard(::grpc::CallbackServerContext* context, const v1::DropShardRequest* request,
                                        v1::DropShardResponse* response) override {
    return grpc_server::Serve(calls_, context, response, ShuttingDown(), [&] { return core_->DropShard(*request); });
  }
  ::grpc::ServerReadReactor<v1::PushGradRequest>* PushGrad(::grpc::CallbackServerContext* context,
                                                           v1::PushGradResponse* response) override {
    return new PushGradReactor(core_, calls_, context, response);
  }
  ::grpc::ServerWriteReactor<v1::PullParamsResponse>* PullParams(::grpc::CallbackServerContext* context,
                                                                 const v1::PullParamsRequest* request) override {
    return new PullParamsReactor(core_, calls_, context, *request);
  }
  ::grpc::ServerUnaryReactor* FinishStep(::grpc::CallbackServerContext* context, const v1::FinishStepRequest* request,
                                         v1::FinishStepResponse* response) override {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    const bool spawned = calls_->Spawn([this, context, request, response, reactor] {
      absl::StatusOr<v1::StepStats> stats = WaitInSlices<v1::StepStats>(
          context, calls_, [&](absl::Time deadline) { return core_->FinishStep(*request, deadline); });
      if (stats.ok()) *response->mutable_stats() = *std::move(stats);
      reactor->Finish(ToGrpcWithDetail(context, stats.status()));
      calls_->Exit();
    });
    if (!spawned) {
      reactor->Finish(ShuttingDown());
      calls_->Exit();
    }
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
  ::grpc::ServerWriteReactor<v1::FetchShardStateResponse>* FetchShardState(
      ::grpc::CallbackServerContext*, const v1::FetchShardStateRequest*) override {
    return new grpc_server::FinishedWriter<v1::FetchShardStateResponse>(::grpc::Status(
        ::grpc::StatusCode::UNIMPLEMENTED, "FetchShardState: shard moves between daemons are not supported yet"));
  }
  ::grpc::ServerUnaryReactor* WriteCheckpoint(::grpc::CallbackServerContext* context,
                                              const v1::WriteCheckpointRequest*,
                                              v1::WriteCheckpointResponse*) override {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(::grpc::Status(::grpc::StatusCode::UNIMPLEMENTED, "WriteCheckpoint: checkpoints are not supported yet"));
    return reactor;
  }

 private:
  ShardDaemon* const core_;
  Calls* const calls_;
};

}  // namespace

struct ShardServer::Impl {
  Options options;
  Calls calls;
  std::unique_ptr<ShardService> service;
  std::unique_ptr<::grpc::Server> server;
  int port = 0;
  std::atomic<bool> shut_down{false};

  ~Impl() { Shutdown(); }

  void Shutdown() {
    if (shut_down.exchange(true)) return;
    if (server != nullptr && server->GetHealthCheckService() != nullptr) server->GetHealthCheckService()->Shutdown();
    if (!calls.Drain(absl::Now() + kShutdownGrace)) {
      Log(LogLevel::kWarning, kComponent, "calls still running at the end of the grace period: cancelling them");
    }
    if (server != nullptr) {
      server->Shutdown(absl::ToChronoTime(absl::Now() + kCloseGrace));
      server->Wait();
    }
    calls.JoinThreads();
  }
};

ShardServer::ShardServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ShardServer::~ShardServer() = default;
int ShardServer::port() const { return impl_->port; }
void ShardServer::Shutdown() { impl_->Shutdown(); }

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  if (options.listen_address.empty()) return absl::InvalidArgumentError("listen_address: must not be empty");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->service = std::make_unique<ShardService>(options.daemon, &impl->calls);
  ::grpc::EnableDefaultHealthCheckService(true);
  ::grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, ::grpc::InsecureServerCredentials(), &impl->port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.RegisterService(impl->service.get());
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               " (address in use or not local?)"));
  }
  if (::grpc::HealthCheckServiceInterface* health = impl->server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus("", true);
    health->SetServingStatus("mainstay.v1.Shard", true);
  }
  Log(LogLevel::kInfo, kComponent, absl::StrCat("serving the Shard service on port ", impl->port));
  return std::unique_ptr<ShardServer>(new ShardServer(std::move(impl)));
}

}  // namespace mainstay::daemon

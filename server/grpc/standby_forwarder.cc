#include "server/grpc/standby_forwarder.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_tls.h"

namespace mainstay::grpc_server {
namespace {

// Metadata that gRPC sets itself on every call, which must not be copied onto the next hop.
bool IsTransportMetadata(absl::string_view key) {
  return absl::StartsWith(key, ":") || absl::StartsWith(key, "grpc-") || key == "te" || key == "content-type" ||
         key == "user-agent" || key == "host" || key == "accept-encoding";
}

absl::string_view View(const ::grpc::string_ref& s) { return absl::string_view(s.data(), s.size()); }

// A call this standby answers itself.
class Refusal : public ::grpc::ServerGenericBidiReactor {
 public:
  explicit Refusal(const ::grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

class ForwardingService;

// One call passed to the leader: two reactors joined by two buffers. Messages move one at a
// time in each direction (read one side, write the other, then read again), so each buffer has
// one user at a time.
//
// The upstream call's reads and writes are started from the downstream side's callbacks, so it
// keeps a hold (AddHold) until its last read; each such start takes a hold of its own for its
// length, which is how it never starts on a finished call. No gRPC operation is started under
// mu_: gRPC may run a reaction inline in the thread that starts an operation. The downstream
// call is finished once the upstream one is done and no downstream write is in flight, and the
// object is deleted in the downstream OnDone, which gRPC calls last.
class ForwardedCall : public ::grpc::ServerGenericBidiReactor {
 public:
  // Registers with `service` before it starts anything (so its OnDone always finds it there).
  ForwardedCall(ForwardingService* service, ::grpc::GenericCallbackServerContext* context,
                std::shared_ptr<::grpc::Channel> channel, const InternalPeers& internal, const std::string& id);

  // Downstream (the caller).
  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {  // a cut-off stream must not look complete upstream
      client_context_.TryCancel();
      return;
    }
    if (!HoldUpstream()) return;
    if (ok) {
      upstream_.StartWrite(&request_);
    } else {
      upstream_.StartWritesDone();
    }
    upstream_.RemoveHold();
  }
  void OnWriteDone(bool ok) override {
    bool read_next = false, close = false, finish = false;
    {
      absl::MutexLock lock(&mu_);
      downstream_writing_ = false;
      read_next = ok && upstream_open_;
      if (read_next) upstream_.AddHold();
      close = !ok && upstream_open_;
      if (close) upstream_open_ = false;
      finish = ReadyToFinish();
    }
    if (read_next) {
      upstream_.StartRead(&response_);
      upstream_.RemoveHold();
    }
    if (close) {  // the caller went away: end the upstream call too
      client_context_.TryCancel();
      upstream_.RemoveHold();
    }
    if (finish) FinishDownstream();
  }
  void OnCancel() override { client_context_.TryCancel(); }
  void OnDone() override;

  // Ends the call (the standby stops forwarding, or the leader changed): UNAVAILABLE to the
  // caller, who retries.
  void Cancel(const std::string& why) {
    {
      absl::MutexLock lock(&mu_);
      cancelled_because_ = why;
    }
    client_context_.TryCancel();
  }
  // The service's references while it cancels calls; gRPC holds the first one until OnDone.
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  class Upstream : public ::grpc::ClientBidiReactor<::grpc::ByteBuffer, ::grpc::ByteBuffer> {
   public:
    explicit Upstream(ForwardedCall* call) : call_(call) {}
    void OnWriteDone(bool ok) override {
      if (ok) call_->StartRead(&call_->request_);  // the caller's next message
    }
    void OnReadDone(bool ok) override {
      if (ok) {
        {
          absl::MutexLock lock(&call_->mu_);
          call_->downstream_writing_ = true;
        }
        call_->StartWrite(&call_->response_);
        return;
      }
      bool close = false;
      {
        absl::MutexLock lock(&call_->mu_);
        close = call_->upstream_open_;
        call_->upstream_open_ = false;
      }
      if (close) RemoveHold();
    }
    void OnDone(const ::grpc::Status& status) override {
      bool finish = false;
      {
        absl::MutexLock lock(&call_->mu_);
        call_->status_ = status;
        call_->upstream_done_ = true;
        finish = call_->ReadyToFinish();
      }
      if (finish) call_->FinishDownstream();
    }

   private:
    ForwardedCall* const call_;
  };

  // A hold for one upstream operation started from outside the upstream's reactions; false
  // when the upstream call is closing (nothing may be started on it).
  bool HoldUpstream() {
    absl::MutexLock lock(&mu_);
    if (upstream_open_) upstream_.AddHold();
    return upstream_open_;
  }
  bool ReadyToFinish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!upstream_done_ || downstream_writing_ || finished_) return false;
    finished_ = true;
    return true;
  }
  void FinishDownstream();

  ForwardingService* const service_;
  ::grpc::GenericCallbackServerContext* const context_;
  const std::shared_ptr<::grpc::Channel> channel_;
  std::atomic<int> refs_{1};
  ::grpc::ClientContext client_context_;
  Upstream upstream_;
  ::grpc::ByteBuffer request_, response_;
  absl::Mutex mu_;
  bool upstream_open_ ABSL_GUARDED_BY(mu_) = true;  // the hold taken at the start is still held
  bool upstream_done_ ABSL_GUARDED_BY(mu_) = false;
  bool downstream_writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::string cancelled_because_ ABSL_GUARDED_BY(mu_);  // set by Cancel
  ::grpc::Status status_;  // written before finished_ is set, read after
};

class ForwardingService : public ::grpc::CallbackGenericService {
 public:
  ForwardingService(const StandbyForwarder::Options& options, ChannelSecurity security)
      : options_(options), security_(std::move(security)) {}

  // Calls already forwarded to another leader end with UNAVAILABLE (their client retries here,
  // and reaches the new one).
  void SetLeader(const std::string& address) {
    std::shared_ptr<::grpc::Channel> channel;
    if (!address.empty()) {
      ::grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      args.SetMaxSendMessageSize(-1);
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
      // A leader whose host vanished (no RST) must not hold forwarded streams for minutes.
      args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
      args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
      channel = security_.CreateChannel(address, args);
    }
    {
      absl::MutexLock lock(&mu_);
      if (closing_ || address == leader_) return;
      leader_ = address;
      channel_ = std::move(channel);
    }
    CancelCalls(/*closing=*/false, absl::StrCat("the leader changed (now ", address.empty() ? "none" : address, ")"));
  }

  // False when the service is closing (the call must end at once).
  bool Register(ForwardedCall* call) {
    absl::MutexLock lock(&mu_);
    calls_.insert(call);
    return !closing_;
  }

  ::grpc::ServerGenericBidiReactor* CreateReactor(::grpc::GenericCallbackServerContext* context) override {
    if (const auto& metadata = context->client_metadata(); metadata.count(kForwardedByMetadata) != 0) {
      const std::string by(View(metadata.find(kForwardedByMetadata)->second));
      return new Refusal(::grpc::Status(
          ::grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("coordinator ", options_.id, " is a standby too (the call came through standby ", by,
                       "): the leader is changing; retry in a moment")));
    }
    std::shared_ptr<::grpc::Channel> channel;
    bool closing = false;
    {
      absl::MutexLock lock(&mu_);
      channel = channel_;
      closing = closing_;
    }
    if (closing) {
      return new Refusal(::grpc::Status(::grpc::StatusCode::UNAVAILABLE,
                                        absl::StrCat("coordinator ", options_.id, " is taking over or stopping: retry")));
    }
    if (channel == nullptr) {
      return new Refusal(::grpc::Status(::grpc::StatusCode::UNAVAILABLE,
                                        absl::StrCat("no coordinator leads now (", options_.id,
                                                     " is a standby): retry in a moment")));
    }
    return new ForwardedCall(this, context, std::move(channel), options_.internal, options_.id);
  }

  // From now on no call is forwarded, and those in flight end with UNAVAILABLE.
  void CloseAll() { CancelCalls(/*closing=*/true, "it is taking over or stopping"); }
  // Waits up to `timeout` for the calls in flight to end.
  void WaitIdle(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](absl::flat_hash_set<ForwardedCall*>* calls) { return calls->empty(); }, &calls_),
                         timeout);
  }
  void Forget(ForwardedCall* call) {
    absl::MutexLock lock(&mu_);
    calls_.erase(call);
  }
  const std::string& id() const { return options_.id; }

 private:
  const StandbyForwarder::Options options_;
  const ChannelSecurity security_;
  absl::Mutex mu_;
  // Ends the calls in flight with UNAVAILABLE saying `why` (and, `closing`, every later one).
  void CancelCalls(bool closing, const std::string& why) {
    std::vector<ForwardedCall*> calls;
    {
      absl::MutexLock lock(&mu_);
      if (closing) {
        closing_ = true;
        channel_ = nullptr;
      }
      for (ForwardedCall* call : calls_) {
        call->Ref();
        calls.push_back(call);
      }
    }
    for (ForwardedCall* call : calls) {
      call->Cancel(why);
      call->Unref();
    }
  }

  std::string leader_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<::grpc::Channel> channel_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<ForwardedCall*> calls_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

ForwardedCall::ForwardedCall(ForwardingService* service, ::grpc::GenericCallbackServerContext* context,
                             std::shared_ptr<::grpc::Channel> channel, const InternalPeers& internal,
                             const std::string& id)
    : service_(service), context_(context), channel_(std::move(channel)), upstream_(this) {
  const bool open = service_->Register(this);
  client_context_.set_deadline(context->deadline());
  for (const auto& [key, value] : context->client_metadata()) {
    if (IsTransportMetadata(View(key))) continue;
    client_context_.AddMetadata(std::string(View(key)), std::string(View(value)));
  }
  client_context_.AddMetadata(kForwardedByMetadata, id);
  if (!IsInternalPeer(context, internal)) client_context_.AddMetadata(kNotInternalMetadata, "1");
  ::grpc::GenericStub stub(channel_);
  stub.PrepareBidiStreamingCall(&client_context_, context->method(), ::grpc::StubOptions(), &upstream_);
  upstream_.AddHold();  // released at the upstream's last read (upstream_open_); needs the bound call
  StartRead(&request_);
  upstream_.StartRead(&response_);
  upstream_.StartCall();
  if (!open) Cancel("it is taking over or stopping");  // CloseAll ran while this call came in
}

void ForwardedCall::OnDone() {
  service_->Forget(this);
  Unref();
}

void ForwardedCall::FinishDownstream() {
  for (const auto& [key, value] : client_context_.GetServerTrailingMetadata()) {
    if (!IsTransportMetadata(View(key))) context_->AddTrailingMetadata(std::string(View(key)), std::string(View(value)));
  }
  std::string why;
  {
    absl::MutexLock lock(&mu_);
    why = cancelled_because_;
  }
  if (status_.error_code() == ::grpc::StatusCode::CANCELLED && !why.empty()) {
    status_ = ::grpc::Status(::grpc::StatusCode::UNAVAILABLE,
                             absl::StrCat("coordinator ", service_->id(), " stopped passing this call on: ", why,
                                          "; retry"));
  }
  Finish(status_);
}

}  // namespace

struct StandbyForwarder::Impl {
  std::unique_ptr<ForwardingService> service;
  std::unique_ptr<::grpc::Server> server;
  int port = 0;
  absl::Mutex mu;
  bool shut_down ABSL_GUARDED_BY(mu) = false;
};

StandbyForwarder::StandbyForwarder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StandbyForwarder::~StandbyForwarder() { Shutdown(); }

int StandbyForwarder::port() const { return impl_->port; }

void StandbyForwarder::SetLeader(const std::string& address) { impl_->service->SetLeader(address); }

void StandbyForwarder::Shutdown() {
  absl::MutexLock lock(&impl_->mu);
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  // Forwarded calls (long polls among them) end at once with UNAVAILABLE: the caller retries
  // at the leader, which this coordinator is about to become or has lost. What still runs
  // after a second is cancelled.
  impl_->service->CloseAll();
  impl_->service->WaitIdle(absl::Seconds(1));
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  impl_->server->Wait();
}

absl::StatusOr<std::unique_ptr<StandbyForwarder>> StandbyForwarder::Start(Options options) {
  // The calls to the leader present this coordinator's certificate, never the cluster secret:
  // each forwarded call carries its own caller's metadata, secret included or not.
  absl::StatusOr<ChannelSecurity> security = ChannelSecurity::Create(options.tls);
  if (!security.ok()) return security.status();
  absl::StatusOr<std::shared_ptr<::grpc::ServerCredentials>> credentials = MakeServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  auto impl = std::make_unique<Impl>();
  impl->service = std::make_unique<ForwardingService>(options, *std::move(security));
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, *credentials, &impl->port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  // Two coordinators given one host:port must not share it silently.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients ping every 5 s during calls (client_internal::ChannelArgs), long polls included.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.RegisterCallbackGenericService(impl->service.get());
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address, " (address in use or not local?)"));
  }
  return std::unique_ptr<StandbyForwarder>(new StandbyForwarder(std::move(impl)));
}

}  // namespace mainstay::grpc_server

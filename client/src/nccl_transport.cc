// The nccl transport (docs/transports.md, NCCL): one two-rank NCCL communicator ("channel") per
// daemon, this trainer rank 0 and the daemon rank 1, on the CUDA device that was current when the
// client connected. Attach opens it: a fresh ncclUniqueId goes into the coordinator's KV, the
// daemon is asked to join by OpenNcclChannel (naming the key), and both ends join and exchange a
// first message while that call runs. Pushes and pulls are NcclPush / NcclPull calls on the
// Shard service that carry the control messages; payloads move by NCCL (common/nccl_link.h):
// pushes straight from the caller's device buffer (host buffers are staged), pulls through device
// staging buffers into the assembler's host destination.
//
// The daemon's own answers (refusals, stale epochs, duplicates) arrive in band (NcclReply) and
// leave the channel as it is. Anything else that ends an attempt early (the call fails, NCCL
// fails, the deadline passes mid-transfer) drops the channel: its communicator is aborted here
// and the daemon drops its end when it sees the call end; the next attempt opens a new one.
//
// NCCL refuses two ranks of one communicator on the same CUDA device, so a trainer and a daemon
// sharing a GPU cannot use this transport (Connect fails with FAILED_PRECONDITION naming NCCL's
// "Duplicate GPU detected"); see docs/transports.md.
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/src/rpc_errors.h"
#include "client/src/transport.h"
#include "common/error_detail.h"
#include "common/nccl_link.h"
#include "common/process_identity.h"
#include "common/status.h"

namespace mainstay::client_internal {
namespace {

constexpr std::chrono::milliseconds kKvTtl{120000};  // the id is read once, within the open's deadline
constexpr absl::Duration kCloseTimeout = absl::Milliseconds(500);

absl::Time ToAbsl(Deadline d) { return absl::FromChrono(d); }

// The daemon's in-band answer, with its ErrorDetail.
absl::Status StatusOfReply(const v1::NcclReply& reply) {
  if (reply.code() == 0) return absl::OkStatus();
  absl::Status status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  if (!reply.error_detail().empty()) {
    v1::ErrorDetail detail;
    if (detail.ParseFromString(reply.error_detail())) status = AttachErrorDetail(status, detail);
  }
  return status;
}

// Reads the rest of a control call on a thread of its own while NCCL moves the payload: the
// replies that follow and the call's final status. A daemon that fails mid-transfer ends the call
// with an error, and Failure() then ends this end's wait at once instead of at the deadline.
class CallWatch {
 public:
  CallWatch(grpc::ClientReader<v1::NcclReply>* reader, grpc::ClientContext* context)
      : thread_([this, reader, context] {
          std::vector<v1::NcclReply> replies;
          v1::NcclReply reply;
          while (reader->Read(&reply)) replies.push_back(reply);
          absl::Status status = StatusFromCall(reader->Finish(), context);
          absl::MutexLock lock(&mu_);
          replies_ = std::move(replies);
          status_ = std::move(status);
          ended_ = true;
        }) {}
  ~CallWatch() {
    if (thread_.joinable()) thread_.join();
  }

  // The call's error once it ended with one; OK while it runs or after it ended well.
  absl::Status Failure() {
    absl::MutexLock lock(&mu_);
    if (!ended_ || status_.ok()) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("the daemon ended the call: ", status_.ToString()));
  }
  // Waits for the call's end (after a TryCancel if this end gave up).
  std::pair<std::vector<v1::NcclReply>, absl::Status> Join() {
    if (thread_.joinable()) thread_.join();
    absl::MutexLock lock(&mu_);
    return {replies_, status_};
  }

 private:
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<v1::NcclReply> replies_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the members above exist
};

class NcclTransport final : public DataTransport {
 public:
  NcclTransport(const TransportContext& context, int device)
      : context_(context), device_(device), node_(HostName()) {}

  ~NcclTransport() override {
    Shutdown();
    std::map<std::string, std::shared_ptr<Channel>> channels;
    {
      absl::MutexLock lock(&mu_);
      channels.swap(channels_);
    }
    // The daemons drop their ends now rather than when the channel's next operation fails.
    std::vector<std::thread> closers;
    for (auto& [daemon, c] : channels) {
      if (c->link->broken()) continue;
      closers.emplace_back([this, c = c] {
        v1::CloseNcclChannelRequest request;
        request.set_channel_id(c->id);
        request.set_job_id(context_.job_id);
        request.set_job_token(context_.job_token);
        v1::CloseNcclChannelResponse response;
        grpc::ClientContext call;
        call.set_deadline(absl::ToChronoTime(absl::Now() + kCloseTimeout));
        c->stub->CloseNcclChannel(&call, request, &response).ok();  // best effort
      });
    }
    for (std::thread& t : closers) t.join();
  }

  v1::Transport kind() const override { return v1::TRANSPORT_NCCL; }

  bool HostReadable(const void* data) const override {
    absl::StatusOr<int> where = nccl::DeviceOf(data);
    return where.ok() && *where < 0;
  }

  // Opens the channel now, retrying while the daemon answers UNAVAILABLE (it may not have
  // received the job yet).
  absl::Status Attach(const v1::DaemonEndpoint& daemon, Deadline deadline) override {
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      absl::StatusOr<std::shared_ptr<Channel>> c = ChannelTo(daemon, deadline);
      if (c.ok() || c.status().code() != absl::StatusCode::kUnavailable) return c.status();
      if (absl::Now() + backoff >= ToAbsl(deadline) || shutdown_.load()) return c.status();
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }

  absl::StatusOr<v1::PushGradResponse> Push(const Route& route, const v1::PushGradHeader& header, ElementSpan data,
                                            Deadline deadline, grpc::ClientContext* context,
                                            std::optional<uint32_t>*) override {
    if (data.bytes() > 0) {  // checked before the daemon accepts: nothing to undo
      absl::StatusOr<int> where = nccl::DeviceOf(data.data);
      if (!where.ok()) return where.status();
      if (*where >= 0 && *where != device_) {
        return absl::InvalidArgumentError(absl::StrCat("data: the buffer is on CUDA device ", *where,
                                                       " but the nccl transport uses device ", device_,
                                                       " (the current device when the client connected)"));
      }
    }
    MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, ChannelTo(route.endpoint, deadline));
    absl::MutexLock op(&c->op_mu);
    MAINSTAY_RETURN_IF_ERROR(Usable(c));
    v1::NcclPushRequest request;
    request.set_channel_id(c->id);
    *request.mutable_header() = header;
    std::unique_ptr<grpc::ClientReader<v1::NcclReply>> reader = route.stub->NcclPush(context, request);
    v1::NcclReply accept;
    if (!reader->Read(&accept)) return CallFailed(c, reader.get(), context, "push request");
    if (accept.code() != 0) {  // refused: nothing moved, nothing stored
      reader->Finish().ok();
      return StatusOfReply(accept);
    }
    CallWatch watch(reader.get(), context);  // the outcome, or the daemon's failure mid-transfer
    if (!accept.duplicate()) {
      if (absl::Status s = c->link->Send(data.data, data.bytes(), ToAbsl(deadline), Aborter(&watch)); !s.ok()) {
        context->TryCancel();
        watch.Join();
        return Failed(c, s, "push payload");
      }
    }
    auto [replies, status] = watch.Join();
    if (!status.ok() || replies.size() != 1) {
      if (status.ok()) status = absl::InternalError(absl::StrCat(replies.size(), " push outcomes, expected 1"));
      return Failed(c, status, "push outcome");
    }
    MAINSTAY_RETURN_IF_ERROR(StatusOfReply(replies[0]));
    return replies[0].push();
  }

  absl::Status Pull(const Route& route, const v1::PullParamsRequest& pull, ShardPullAssembler& assembler,
                    Deadline deadline, grpc::ClientContext* context) override {
    MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, ChannelTo(route.endpoint, deadline));
    absl::MutexLock op(&c->op_mu);
    MAINSTAY_RETURN_IF_ERROR(Usable(c));
    v1::NcclPullRequest request;
    request.set_channel_id(c->id);
    *request.mutable_request() = pull;
    std::unique_ptr<grpc::ClientReader<v1::NcclReply>> reader = route.stub->NcclPull(context, request);
    v1::NcclReply header;
    if (!reader->Read(&header)) return CallFailed(c, reader.get(), context, "pull request");
    if (header.code() != 0) {  // nothing follows an error
      reader->Finish().ok();
      return StatusOfReply(header);
    }
    v1::PullParamsResponse message;
    *message.mutable_header() = header.pull();
    if (absl::Status s = assembler.OnMessage(message); !s.ok()) {
      // The daemon is about to send what this end will not receive: end the call, so that it
      // drops its end too.
      context->TryCancel();
      reader->Finish().ok();
      return Failed(c, s, "pull header");
    }
    CallWatch watch(reader.get(), context);  // the call's end, or the daemon's failure mid-transfer
    if (!assembler.unchanged()) {
      const std::span<uint8_t> data = assembler.data_destination();
      const std::span<uint8_t> scales = assembler.scale_destination();
      absl::Status s =
          c->link->RecvToHost(data.data(), static_cast<int64_t>(data.size()), ToAbsl(deadline), Aborter(&watch));
      if (s.ok()) {
        s = c->link->RecvToHost(scales.data(), static_cast<int64_t>(scales.size()), ToAbsl(deadline),
                                Aborter(&watch));
      }
      if (!s.ok()) {
        context->TryCancel();
        watch.Join();
        return Failed(c, s, "pull payload");
      }
    }
    auto [replies, status] = watch.Join();
    if (status.ok() && !replies.empty()) status = absl::InternalError("a second reply to a pull");
    if (!status.ok()) return Failed(c, status, "pull");
    return assembler.unchanged() ? absl::OkStatus() : assembler.Placed();
  }

  void Shutdown() override { shutdown_.store(true); }

 private:
  struct Channel {
    uint64_t id = 0;
    std::string daemon_id;
    std::string daemon;  // "id (address)", for messages
    std::shared_ptr<v1::Shard::Stub> stub;
    std::unique_ptr<nccl::Link> link;
    absl::Mutex op_mu;  // one operation at a time: both ends must issue NCCL calls in the same order
  };

  nccl::Link::AbortCheck Aborter(CallWatch* watch) const {
    return [this, watch] {
      if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
      return watch->Failure();
    };
  }

  absl::Status Usable(const std::shared_ptr<Channel>& c) {
    if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
    if (!c->link->broken()) return absl::OkStatus();
    Drop(c);
    return absl::UnavailableError(absl::StrCat("the NCCL channel to daemon ", c->daemon, " broke; retry opens a new one"));
  }

  // Forgets `c` (if it is still the daemon's channel); its communicator goes with the last holder.
  void Drop(const std::shared_ptr<Channel>& c) {
    c->link->Break("dropped");
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(c->daemon_id);
    if (it != channels_.end() && it->second == c) channels_.erase(it);
  }

  // The attempt failed in a way that leaves the channel unusable: drop it, annotate `s`.
  absl::Status Failed(const std::shared_ptr<Channel>& c, const absl::Status& s, const char* what) {
    Drop(c);
    if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
    return absl::Status(s.code(), absl::StrCat("NCCL ", what, " to daemon ", c->daemon, ": ", s.message()));
  }

  // The call ended without the reply this end waited for.
  absl::Status CallFailed(const std::shared_ptr<Channel>& c, grpc::ClientReader<v1::NcclReply>* reader,
                          grpc::ClientContext* context, const char* what) {
    absl::Status s = StatusFromCall(reader->Finish(), context);
    if (s.ok()) s = absl::InternalError("the daemon ended the call without a reply");
    return Failed(c, s, what);
  }

  absl::StatusOr<std::shared_ptr<Channel>> ChannelTo(const v1::DaemonEndpoint& daemon, Deadline deadline) {
    if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
    absl::MutexLock connect_lock(&connect_mu_);  // one open at a time: no duplicate channels
    {
      absl::MutexLock lock(&mu_);
      auto it = channels_.find(daemon.daemon_id());
      if (it != channels_.end() && !it->second->link->broken()) return it->second;
      if (it != channels_.end()) channels_.erase(it);
    }
    MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, Open(daemon, deadline));
    absl::MutexLock lock(&mu_);
    channels_[daemon.daemon_id()] = c;
    return c;
  }

  absl::StatusOr<std::shared_ptr<Channel>> Open(const v1::DaemonEndpoint& daemon, Deadline deadline) {
    auto c = std::make_shared<Channel>();
    c->daemon_id = daemon.daemon_id();
    c->daemon = absl::StrCat(daemon.daemon_id(), " (", daemon.address(), ")");
    c->stub = context_.stub_for(daemon.address());
    const std::string where = absl::StrCat("opening an NCCL channel to daemon ", c->daemon);
    absl::StatusOr<std::string> id = nccl::NewUniqueId();
    if (!id.ok()) return absl::Status(id.status().code(), absl::StrCat(where, ": ", id.status().message()));
    uint64_t nonce;
    {
      absl::MutexLock lock(&mu_);
      nonce = rng_();
    }
    v1::OpenNcclChannelRequest request;
    request.set_job_id(context_.job_id);
    request.set_job_token(context_.job_token);
    request.set_rank(context_.rank);
    request.set_kv_key(absl::StrCat("nccl/", context_.job_id, "/", context_.rank, "/", daemon.daemon_id(), "/",
                                    absl::Hex(nonce, absl::kZeroPad16)));
    request.set_chunk_bytes(context_.chunk_bytes);
    request.set_node_name(node_);
    if (absl::Status s = context_.kv_put(request.kv_key(), *id, kKvTtl, deadline); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(where, ": putting the ncclUniqueId into the coordinator's KV: ",
                                                 s.message()));
    }

    // The daemon joins while this call runs; this end joins meanwhile.
    struct Call {
      grpc::ClientContext context;
      v1::OpenNcclChannelResponse response;
      absl::Mutex mu;
      bool done ABSL_GUARDED_BY(mu) = false;
      absl::Status status ABSL_GUARDED_BY(mu);
    };
    auto call = std::make_shared<Call>();
    call->context.set_deadline(deadline);
    c->stub->async()->OpenNcclChannel(&call->context, &request, &call->response, [call](grpc::Status status) {
      absl::Status s = StatusFromCall(status, &call->context);
      absl::MutexLock lock(&call->mu);
      call->status = s;
      call->done = true;
    });
    auto call_failed = [call]() -> absl::Status {
      absl::MutexLock lock(&call->mu);
      if (call->done && !call->status.ok()) return call->status;
      return absl::OkStatus();
    };
    absl::StatusOr<std::unique_ptr<nccl::Link>> link = nccl::Link::Connect(
        {device_, /*rank=*/0, context_.chunk_bytes}, *id, ToAbsl(deadline), [&]() -> absl::Status {
          if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
          return call_failed();
        });
    if (!link.ok()) call->context.TryCancel();
    absl::Status call_status;
    {
      absl::MutexLock lock(&call->mu);
      call->mu.Await(absl::Condition(&call->done));
      call_status = call->status;
    }
    // The daemon's answer explains more (a wrong token, NCCL's refusal on its side) than this
    // end's view of a peer that never came.
    absl::Status s = !call_status.ok() && call_status.code() != absl::StatusCode::kCancelled ? call_status
                                                                                            : link.status();
    if (s.ok() && call_status.ok() && call->response.channel_id() == 0) s = absl::InternalError("channel id 0");
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
    c->id = call->response.channel_id();
    c->link = *std::move(link);
    return c;
  }

  const TransportContext context_;
  const int device_;
  const std::string node_;
  std::atomic<bool> shutdown_{false};
  absl::Mutex connect_mu_;
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_) = std::mt19937_64(std::random_device{}());
  std::map<std::string, std::shared_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);  // by daemon id
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataTransport>> MakeNcclTransport(const TransportContext& context) {
  if (context.chunk_bytes < nccl::kMinChunkBytes || context.chunk_bytes > nccl::kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", context.chunk_bytes, " is not in [",
                                                   nccl::kMinChunkBytes, ", ", nccl::kMaxChunkBytes, "]"));
  }
  if (!context.kv_put || !context.stub_for) return absl::InternalError("the nccl transport needs kv_put and stub_for");
  absl::StatusOr<int> device = nccl::CurrentDevice();
  if (!device.ok()) return absl::UnavailableError(absl::StrCat("CUDA: ", device.status().message()));
  return std::unique_ptr<DataTransport>(new NcclTransport(context, *device));
}

}  // namespace mainstay::client_internal

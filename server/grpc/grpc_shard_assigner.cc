#include "server/grpc/grpc_shard_assigner.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <deque>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/grpc_status.h"
#include "common/status.h"
#include "common/logging.h"
#include "mainstay/v1/shard.grpc.pb.h"

namespace mainstay::coordinator {
namespace {

constexpr char kComponent[] = "shard-assigner";

bool Retryable(::grpc::StatusCode code) {
  switch (code) {
    case ::grpc::StatusCode::UNAVAILABLE:
    case ::grpc::StatusCode::DEADLINE_EXCEEDED:
    case ::grpc::StatusCode::ABORTED:
    case ::grpc::StatusCode::RESOURCE_EXHAUSTED:
    case ::grpc::StatusCode::UNKNOWN:
    case ::grpc::StatusCode::INTERNAL:
      return true;
    default:
      return false;
  }
}

}  // namespace

struct GrpcShardAssigner::Call {
  bool assign = true;
  v1::AssignShardRequest assign_request;
  v1::DropShardRequest drop_request;
  absl::Time made;

  std::string Describe(const std::string& address) const {
    return assign ? absl::StrCat("AssignShard(", assign_request.job_id(), ", epoch ", assign_request.placement_epoch(),
                                 ", ", assign_request.shards_size(), " shard(s)) to ", address)
                  : absl::StrCat("DropShard(", drop_request.job_id(), ", epoch ", drop_request.placement_epoch(), ", ",
                                 drop_request.shards_size() == 0 ? std::string("all")
                                                                 : absl::StrCat(drop_request.shards_size()),
                                 " shard(s)) to ", address);
  }
};

struct GrpcShardAssigner::Peer {
  std::string address;
  std::shared_ptr<v1::Shard::Stub> stub;  // shared with WriteCheckpoint calls in progress
  absl::CondVar wake;                           // a call was queued, or stopping
  std::deque<Call> queue;                       // guarded by the assigner's mu_
  ::grpc::ClientContext* in_flight = nullptr;   // guarded by the assigner's mu_
  std::thread worker;
};

GrpcShardAssigner::GrpcShardAssigner(GrpcShardAssignerOptions options) : options_(options) {}

GrpcShardAssigner::~GrpcShardAssigner() { Shutdown(); }

void GrpcShardAssigner::Assign(const std::string& daemon_address, const v1::AssignShardRequest& request) {
  Call call;
  call.assign = true;
  call.assign_request = request;
  Enqueue(daemon_address, std::move(call));
}

void GrpcShardAssigner::Drop(const std::string& daemon_address, const v1::DropShardRequest& request) {
  Call call;
  call.assign = false;
  call.drop_request = request;
  Enqueue(daemon_address, std::move(call));
}

void GrpcShardAssigner::Enqueue(const std::string& address, Call call) {
  call.made = absl::Now();
  JoinEnded();
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    Log(LogLevel::kWarning, kComponent, absl::StrCat("shutting down: not sending ", call.Describe(address)));
    return;
  }
  Peer* peer = PeerLocked(address);
  peer->queue.push_back(std::move(call));
  peer->wake.Signal();
}

GrpcShardAssigner::Peer* GrpcShardAssigner::PeerLocked(const std::string& address) {
  std::unique_ptr<Peer>& peer = peers_[address];
  if (peer == nullptr) {
    peer = std::make_unique<Peer>();
    peer->address = address;
    // The channel's own reconnect backoff (by default up to 2 minutes) must not outlast ours.
    ::grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(absl::ToInt64Milliseconds(options_.initial_backoff)));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(absl::ToInt64Milliseconds(options_.max_backoff)));
    peer->stub = v1::Shard::NewStub(options_.security.CreateChannel(address, args));
    Peer* raw = peer.get();
    peer->worker = std::thread([this, raw] { RunWorker(raw); });
  }
  return peer.get();
}

absl::StatusOr<v1::WriteCheckpointResponse> GrpcShardAssigner::WriteCheckpoint(
    const std::string& address, const v1::WriteCheckpointRequest& request, absl::Time deadline) {
  std::shared_ptr<v1::Shard::Stub> stub;  // kept alive by this call if the worker ends meanwhile
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the coordinator is shutting down");
    stub = PeerLocked(address)->stub;
  }
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::WriteCheckpointResponse response;
  const ::grpc::Status status = stub->WriteCheckpoint(&context, request, &response);
  if (status.ok()) return response;
  return Annotate(FromGrpcCall(status, context.GetServerTrailingMetadata()),
                  absl::StrCat("WriteCheckpoint on daemon ", address));
}

void GrpcShardAssigner::RunWorker(Peer* peer) {
  while (true) {
    Call call;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time idle_until = absl::Now() + options_.idle_timeout;
      while (!stopping_ && peer->queue.empty() && absl::Now() < idle_until) {
        peer->wake.WaitWithDeadline(&mu_, idle_until);
      }
      if (stopping_) return;
      if (peer->queue.empty()) {
        // Idle: this worker ends; Enqueue, WriteCheckpoint or Shutdown joins it. A call made
        // after this point starts a new worker.
        auto it = peers_.find(peer->address);
        ended_.push_back(std::move(it->second));
        peers_.erase(it);
        return;
      }
      call = std::move(peer->queue.front());
      peer->queue.pop_front();
    }
    Deliver(peer, call);
  }
}

void GrpcShardAssigner::Deliver(Peer* peer, const Call& call) {
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + options_.attempt_timeout));
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      peer->in_flight = &context;
    }
    ::grpc::Status status;
    if (call.assign) {
      v1::AssignShardResponse response;
      status = peer->stub->AssignShard(&context, call.assign_request, &response);
    } else {
      v1::DropShardResponse response;
      status = peer->stub->DropShard(&context, call.drop_request, &response);
    }
    const absl::Status answered = FromGrpcCall(status, context.GetServerTrailingMetadata());
    std::optional<v1::ErrorDetail> detail = GetErrorDetail(answered);
    if (call.assign && status.error_code() == ::grpc::StatusCode::RESOURCE_EXHAUSTED && detail.has_value() &&
        detail->memory_needed_bytes() > 0) {
      // The daemon has no room for the job: asking again changes nothing; the coordinator
      // places the shards elsewhere. (gRPC's own RESOURCE_EXHAUSTED, e.g. a message over the
      // size limit, carries no such detail and is retried as before.)
      RefusedHandler handler;
      {
        absl::MutexLock lock(&mu_);
        peer->in_flight = nullptr;
        if (stopping_) return;
        handler = refused_;
        if (handler) ++refused_calls_;
      }
      Log(LogLevel::kWarning, kComponent, absl::StrCat(call.Describe(peer->address), " refused: ", answered.ToString()));
      if (handler) {
        handler(peer->address, call.assign_request, answered);
        absl::MutexLock lock(&mu_);
        --refused_calls_;
      }
      return;
    }
    absl::MutexLock lock(&mu_);
    peer->in_flight = nullptr;
    if (status.ok()) {
      if (attempt > 1) Log(LogLevel::kInfo, kComponent, absl::StrCat("delivered ", call.Describe(peer->address),
                                                                       " at attempt ", attempt));
      return;
    }
    if (stopping_) return;
    const std::string what = absl::StrCat(call.Describe(peer->address), ": ", FromGrpcStatus(status).ToString());
    if (!Retryable(status.error_code())) {
      Log(LogLevel::kWarning, kComponent, absl::StrCat("dropped ", what, " (not retryable)"));
      return;
    }
    if (absl::Now() + backoff - call.made > options_.give_up_after) {
      Log(LogLevel::kError, kComponent, absl::StrCat("gave up after ", attempt, " attempt(s) over ",
                                                     absl::FormatDuration(absl::Now() - call.made), ": ", what));
      return;
    }
    if (attempt == 1) Log(LogLevel::kWarning, kComponent, absl::StrCat("retrying ", what));
    // Sleep the backoff, but wake at once for a shutdown.
    const absl::Time until = absl::Now() + backoff;
    while (!stopping_ && absl::Now() < until) peer->wake.WaitWithDeadline(&mu_, until);
    if (stopping_) return;
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

void GrpcShardAssigner::SetRefusedHandler(RefusedHandler handler) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return refused_calls_ == 0; };
  mu_.Await(absl::Condition(&idle));
  refused_ = std::move(handler);
}

void GrpcShardAssigner::JoinEnded() {
  std::vector<std::unique_ptr<Peer>> ended;
  {
    absl::MutexLock lock(&mu_);
    ended.swap(ended_);
  }
  for (auto& peer : ended) peer->worker.join();
}

size_t GrpcShardAssigner::live_workers() const {
  absl::MutexLock lock(&mu_);
  return peers_.size();
}

void GrpcShardAssigner::Shutdown() {
  std::map<std::string, std::unique_ptr<Peer>> peers;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    size_t dropped = 0;
    for (auto& [address, peer] : peers_) {
      dropped += peer->queue.size();
      if (peer->in_flight != nullptr) peer->in_flight->TryCancel();
      peer->wake.SignalAll();
    }
    if (dropped > 0) Log(LogLevel::kWarning, kComponent, absl::StrCat("shutting down: ", dropped, " queued call(s) not sent"));
    peers.swap(peers_);
  }
  for (auto& [address, peer] : peers) peer->worker.join();
  JoinEnded();
}

}  // namespace mainstay::coordinator

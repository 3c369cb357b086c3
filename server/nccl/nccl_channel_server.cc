#include "server/nccl/nccl_channel_server.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/logging.h"
#include "common/nccl_link.h"
#include "common/status.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {
namespace {

constexpr char kComponent[] = "nccl-server";
constexpr char kTransport[] = "nccl";  // the `transport` label of the byte counters
constexpr absl::Duration kMaxCall = absl::Hours(1);  // bound on a call without a deadline
constexpr absl::Duration kKvWait = absl::Seconds(10);
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);

// A push's or pull's own answer, in band.
v1::NcclReply ErrorReply(const absl::Status& status) {
  v1::NcclReply reply;
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(std::string(status.message()));
  if (std::optional<v1::ErrorDetail> detail = GetErrorDetail(status); detail.has_value()) {
    reply.set_error_detail(detail->SerializeAsString());
  }
  return reply;
}

struct Channel {
  uint64_t id = 0;
  std::string job_id;
  int32_t rank = 0;
  std::string node;
  std::unique_ptr<nccl::Link> link;
  bool busy = false;     // an operation runs (guarded by the server's mu_)
  bool dropped = false;  // guarded by the server's mu_
};

class Server final : public NcclChannelServer {
 public:
  explicit Server(Options options) : options_(options), rng_(std::random_device{}()) {
    if (metrics::DaemonMetrics* m = options_.daemon->metrics(); m != nullptr) {
      pushed_bytes_ = m->PushedBytes(kTransport);
      pulled_bytes_ = m->PulledBytes(kTransport);
    }
  }
  ~Server() override { Shutdown(); }

  std::string Describe() const override {
    cudaDeviceProp prop{};
    const std::string name =
        cudaGetDeviceProperties(&prop, options_.device) == cudaSuccess ? std::string(prop.name) : "unknown";
    return absl::StrCat("NCCL ", nccl::VersionString(nccl::Version()), ", CUDA device ", options_.device, " (", name,
                        ")");
  }

  absl::StatusOr<v1::OpenNcclChannelResponse> Open(const v1::OpenNcclChannelRequest& request, absl::Time deadline,
                                                  const Cancelled& cancelled) override {
    deadline = std::min(deadline, absl::Now() + kMaxCall);
    const std::string prefix = absl::StrCat("nccl/", request.job_id(), "/");
    if (request.job_id().empty()) return absl::InvalidArgumentError("OpenNcclChannel: job_id is required");
    if (!absl::StartsWith(request.kv_key(), prefix) || request.kv_key().size() == prefix.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("OpenNcclChannel: kv_key must start with '", prefix, "', got '", request.kv_key(), "'"));
    }
    if (request.chunk_bytes() < nccl::kMinChunkBytes || request.chunk_bytes() > nccl::kMaxChunkBytes) {
      return absl::InvalidArgumentError(absl::StrCat("OpenNcclChannel: chunk_bytes ", request.chunk_bytes(),
                                                     " is not in [", nccl::kMinChunkBytes, ", ", nccl::kMaxChunkBytes,
                                                     "]"));
    }
    MAINSTAY_RETURN_IF_ERROR(options_.daemon->CheckJobToken(request.job_id(), request.job_token()));
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::UnavailableError("the daemon is stopping");
      if (static_cast<int>(channels_.size()) >= options_.max_channels) {
        return absl::ResourceExhaustedError(
            absl::StrCat("this daemon has ", channels_.size(), " NCCL channels open, its maximum"));
      }
    }
    absl::StatusOr<std::string> id = options_.kv->Get(request.kv_key(), std::min(deadline, absl::Now() + kKvWait));
    if (!id.ok()) {
      if (id.status().code() == absl::StatusCode::kDeadlineExceeded) {
        return absl::FailedPreconditionError(
            absl::StrCat("OpenNcclChannel: no ncclUniqueId under '", request.kv_key(), "' in the coordinator's KV"));
      }
      return Annotate(id.status(), absl::StrCat("OpenNcclChannel: reading '", request.kv_key(), "' from the KV"));
    }
    if (id->size() != nccl::kUniqueIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("OpenNcclChannel: the value under '", request.kv_key(), "' has ",
                                                     id->size(), " bytes, not an ncclUniqueId's ",
                                                     nccl::kUniqueIdBytes));
    }
    auto channel = std::make_shared<Channel>();
    channel->job_id = request.job_id();
    channel->rank = request.rank();
    channel->node = request.node_name();
    {
      absl::MutexLock lock(&mu_);
      ++running_;
    }
    absl::StatusOr<std::unique_ptr<nccl::Link>> link = nccl::Link::Connect(
        {options_.device, /*rank=*/1, request.chunk_bytes()}, *id, deadline, [&] { return Interrupted(cancelled); });
    std::shared_ptr<Channel> replaced;
    {
      absl::MutexLock lock(&mu_);
      --running_;
      if (link.ok() && stopping_) link = absl::UnavailableError("the daemon is stopping");
      if (link.ok()) {
        channel->link = *std::move(link);
        do {
          channel->id = rng_();
        } while (channel->id == 0 || channels_.count(channel->id) > 0);
        channels_[channel->id] = channel;
        auto [it, fresh] = by_rank_.try_emplace({channel->job_id, channel->rank}, channel->id);
        if (!fresh) {
          auto old = channels_.find(it->second);
          if (old != channels_.end()) replaced = old->second;
          it->second = channel->id;
        }
      }
    }
    if (!link.ok()) {
      Log(LogLevel::kWarning, kComponent,
          absl::StrCat("job ", request.job_id(), " rank ", request.rank(), " from ", request.node_name(),
                       ": no channel: ", link.status().message()));
      return link.status();
    }
    if (replaced != nullptr) Drop(replaced, "replaced by a new channel of the same job and rank");
    options_.daemon->connections()->Record(channel->job_id, channel->rank, v1::TRANSPORT_NCCL, channel->node, 0, 0,
                                           /*open=*/true);
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("channel ", absl::Hex(channel->id), ": job ", channel->job_id, " rank ", channel->rank, " from ",
                     channel->node, " (chunks of ", request.chunk_bytes(), " bytes)"));
    v1::OpenNcclChannelResponse response;
    response.set_channel_id(channel->id);
    response.set_device(options_.device);
    response.set_nccl_version(nccl::Version());
    return response;
  }

  absl::Status Push(const v1::NcclPushRequest& request, absl::Time deadline, const Write& write,
                    const Cancelled& cancelled) override {
    deadline = std::min(deadline, absl::Now() + kMaxCall);
    const v1::PushGradHeader& h = request.header();
    MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, Acquire(request.channel_id(), h.job_id(), deadline));
    absl::Status status = PushOn(*c, h, deadline, write, cancelled);
    Release(c, status,
            absl::StrCat("push of bucket ", h.bucket(), " shard ", h.shard(), " step ", h.step(), " (nothing stored)"));
    return status;
  }

  absl::Status Pull(const v1::NcclPullRequest& request, absl::Time deadline, const Write& write,
                    const Cancelled& cancelled) override {
    deadline = std::min(deadline, absl::Now() + kMaxCall);
    const v1::PullParamsRequest& r = request.request();
    MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<Channel> c, Acquire(request.channel_id(), r.job_id(), deadline));
    absl::Status status = PullOn(*c, r, deadline, write, cancelled);
    Release(c, status, absl::StrCat("pull of bucket ", r.bucket(), " shard ", r.shard()));
    return status;
  }

  absl::Status Close(const v1::CloseNcclChannelRequest& request) override {
    std::shared_ptr<Channel> c;
    {
      absl::MutexLock lock(&mu_);
      auto it = channels_.find(request.channel_id());
      if (it == channels_.end()) return absl::OkStatus();
      c = it->second;
    }
    if (c->job_id != request.job_id()) {
      return absl::PermissionDeniedError(
          absl::StrCat("CloseNcclChannel: channel ", absl::Hex(request.channel_id()), " is not job ", request.job_id(), "'s"));
    }
    // A job that left this daemon cannot check its token any more; the random channel id is
    // then the only credential.
    if (absl::Status s = options_.daemon->CheckJobToken(request.job_id(), request.job_token());
        !s.ok() && s.code() != absl::StatusCode::kUnavailable) {
      return s;
    }
    Drop(c, "closed by the trainer");
    return absl::OkStatus();
  }

  void Shutdown() override {
    std::map<uint64_t, std::shared_ptr<Channel>> channels;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
      channels = channels_;
    }
    for (auto& [id, c] : channels) Drop(c, "the daemon is stopping");
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0; };
    mu_.Await(absl::Condition(&idle));
  }

 private:
  absl::Status Interrupted(const Cancelled& cancelled) {
    if (cancelled && cancelled()) return absl::UnavailableError("the call was cancelled, or the daemon is stopping");
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the daemon is stopping");
    return absl::OkStatus();
  }

  // The channel `id` of `job_id`, reserved for one operation (Release ends it).
  absl::StatusOr<std::shared_ptr<Channel>> Acquire(uint64_t id, const std::string& job_id, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the daemon is stopping");
    auto it = channels_.find(id);
    if (it == channels_.end()) {
      return absl::UnavailableError(absl::StrCat("NCCL channel ", absl::Hex(id),
                                                 " is not open on this daemon (closed, failed, or the daemon restarted)"));
    }
    std::shared_ptr<Channel> c = it->second;
    if (c->job_id != job_id) {
      return absl::PermissionDeniedError(
          absl::StrCat("NCCL channel ", absl::Hex(id), " belongs to job ", c->job_id, ", not ", job_id));
    }
    // The trainer runs one operation per channel at a time; a second one waits for the first.
    auto free = [&c]() { return !c->busy || c->dropped; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&free), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("NCCL channel ", absl::Hex(id), " stayed busy until the deadline"));
    }
    if (c->dropped) return absl::UnavailableError(absl::StrCat("NCCL channel ", absl::Hex(id), " was closed"));
    c->busy = true;
    ++running_;
    return c;
  }

  // Ends the operation; a failed channel (`status` not OK) is dropped.
  void Release(const std::shared_ptr<Channel>& c, const absl::Status& status, const std::string& what) {
    if (!status.ok() || c->link->broken()) {
      Drop(c, absl::StrCat(what, " failed: ", status.ok() ? "the link broke" : status.message()));
    }
    absl::MutexLock lock(&mu_);
    c->busy = false;
    --running_;
  }

  void Drop(const std::shared_ptr<Channel>& c, const std::string& why) {
    {
      absl::MutexLock lock(&mu_);
      if (c->dropped) return;
      c->dropped = true;
      channels_.erase(c->id);
      auto it = by_rank_.find({c->job_id, c->rank});
      if (it != by_rank_.end() && it->second == c->id) by_rank_.erase(it);
    }
    // An operation in flight ends at its next poll; the communicator goes with the last holder.
    c->link->Break(why);
    options_.daemon->connections()->Close(c->job_id, c->rank, v1::TRANSPORT_NCCL, c->node);
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("channel ", absl::Hex(c->id), " (job ", c->job_id, " rank ", c->rank, " on ", c->node,
                     ") closed: ", why));
  }

  absl::Status PushOn(Channel& c, const v1::PushGradHeader& h, absl::Time deadline, const Write& write,
                      const Cancelled& cancelled) {
    absl::StatusOr<std::unique_ptr<PushSession>> session;
    if (h.crc32c_follows()) {  // refused like any bad header: before anything moves
      session = absl::InvalidArgumentError(
          "NcclPush: crc32c_follows, but an nccl push has no trailer to carry a CRC-32C (device memory: crc32c 0, "
          "or the CRC in the header)");
    } else {
      session = options_.daemon->BeginPush(h);
    }
    if (session.ok() && options_.drain != nullptr) {
      if (absl::Status s = options_.drain->AdmitPush(h.job_id(), h.step()); !s.ok()) session = s;
    }
    if (!session.ok()) {  // refused: nothing moves, the channel stays as it is
      write(ErrorReply(session.status()));
      return absl::OkStatus();
    }
    PushSession& push = **session;
    v1::NcclReply accept;
    accept.set_duplicate(push.duplicate());
    if (!write(accept)) return absl::CancelledError("the trainer went away before the payload");
    const std::span<uint8_t> dest = push.destination();
    // Dropped with the session on failure: nothing of this push is stored.
    MAINSTAY_RETURN_IF_ERROR(c.link->RecvToHost(dest.data(), static_cast<int64_t>(dest.size()), deadline,
                                                [&] { return Interrupted(cancelled); }));
    push.Landed(static_cast<int64_t>(dest.size()));
    absl::StatusOr<v1::PushGradResponse> stored = push.Finish();
    if (!stored.ok()) {
      write(ErrorReply(stored.status()));
      return absl::OkStatus();
    }
    const int64_t total = static_cast<int64_t>(dest.size());
    if (pushed_bytes_ != nullptr) pushed_bytes_->Increment(static_cast<double>(total));
    options_.daemon->connections()->Record(c.job_id, c.rank, v1::TRANSPORT_NCCL, c.node, total, 0);
    v1::NcclReply outcome;
    *outcome.mutable_push() = *std::move(stored);
    write(outcome);  // the push is stored either way; a trainer that missed this retries as a duplicate
    return absl::OkStatus();
  }

  absl::Status PullOn(Channel& c, const v1::PullParamsRequest& request, absl::Time deadline, const Write& write,
                      const Cancelled& cancelled) {
    // Waits in slices, like the gRPC service: a stop or a cancelled call ends the wait early.
    absl::StatusOr<PullResult> result;
    while (true) {
      result = options_.daemon->PullParams(request, std::min(deadline, absl::Now() + kWaitSlice));
      if (result.ok() || result.status().code() != absl::StatusCode::kDeadlineExceeded || absl::Now() >= deadline) {
        break;
      }
      MAINSTAY_RETURN_IF_ERROR(Interrupted(cancelled));
    }
    if (!result.ok()) {
      write(ErrorReply(result.status()));
      return absl::OkStatus();
    }
    v1::NcclReply header;
    *header.mutable_pull() = PullHeaderOf(*result);
    if (!write(header)) return absl::CancelledError("the trainer went away before the payload");
    if (result->unchanged) return absl::OkStatus();
    const QuantizedShard& s = *result->shard;  // immutable; alive while `result` is
    auto abort = [&] { return Interrupted(cancelled); };
    MAINSTAY_RETURN_IF_ERROR(c.link->Send(s.data.data(), static_cast<int64_t>(s.data.size()), deadline, abort));
    MAINSTAY_RETURN_IF_ERROR(c.link->Send(s.scales.data(), static_cast<int64_t>(s.scales.size()), deadline, abort));
    const int64_t total = static_cast<int64_t>(s.data.size() + s.scales.size());
    if (pulled_bytes_ != nullptr) pulled_bytes_->Increment(static_cast<double>(total));
    options_.daemon->connections()->Record(c.job_id, c.rank, v1::TRANSPORT_NCCL, c.node, 0, total);
    return absl::OkStatus();
  }

  const Options options_;
  std::shared_ptr<metrics::Counter> pushed_bytes_, pulled_bytes_;  // null: no metrics
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // operations and opens in progress
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int32_t>, uint64_t> by_rank_ ABSL_GUARDED_BY(mu_);  // (job, rank) -> channel
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclChannelServer>> NcclChannelServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  if (options.kv == nullptr) return absl::InvalidArgumentError("kv: required");
  if (options.max_channels < 1) return absl::InvalidArgumentError("max_channels: must be >= 1");
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("no CUDA device: ", cudaGetErrorString(e)));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device is visible");
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", options.device, " is not one of the ", count, " visible CUDA devices"));
  }
  return std::unique_ptr<NcclChannelServer>(new Server(options));
}

}  // namespace mainstay::daemon

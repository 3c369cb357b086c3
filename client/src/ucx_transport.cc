// The ucx transport (docs/transports.md): one UCP worker per client, one endpoint per daemon
// (opened at attach with a hello round trip), control messages as serialized UcxRequest /
// UcxReply, payloads as tagged messages placed straight into the caller's buffers in chunks.
//
// An attempt that fails anywhere but in the daemon's answer (peer gone, deadline, a reply that
// breaks the protocol) closes its connection: whatever the daemon still had in flight for it ends
// there, and the next attempt opens a fresh one.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/src/transport.h"
#include "common/crc32c.h"
#include "common/error_detail.h"
#include "common/process_identity.h"
#include "common/status.h"
#include "common/ucx_worker.h"
#include "mainstay/v1/data_plane.pb.h"

namespace mainstay::client_internal {
namespace {

using ucx::Kind;

absl::Time ToAbsl(Deadline d) { return absl::FromChrono(d); }

int64_t RemainingMs(Deadline d) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - std::chrono::system_clock::now());
  return std::max<int64_t>(1, left.count());
}

void SetProcess(v1::UcxProcess* p) {
  const ucx::ProcessIdentity& self = ucx::ProcessIdentity::Self();
  p->set_boot_id(self.boot_id);
  p->set_pid_namespace(self.pid_namespace);
  p->set_pid(self.pid);
}

// Where UCX cannot report the daemon's failure (shared memory), watch its process if we can.
void WatchPeer(ucx::Endpoint& ep, const v1::UcxProcess& p) {
  if (ep.detects_peer_failure()) return;
  const ucx::ProcessIdentity peer{p.boot_id(), p.pid_namespace(), p.pid()};
  if (ucx::ProcessIdentity::Self().SameProcessSpace(peer)) ep.WatchProcess(peer.pid);
}

// The daemon's error in a reply, with its ErrorDetail.
absl::Status StatusOfReply(const v1::UcxReply& reply) {
  if (reply.code() == 0) return absl::OkStatus();
  absl::Status status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  if (!reply.error_detail().empty()) {
    v1::ErrorDetail detail;
    if (detail.ParseFromString(reply.error_detail())) status = AttachErrorDetail(status, detail);
  }
  return status;
}

// A UCX transfer waits on a daemon that may be cut off without a reset (a partition), which UCX
// notices only by its keepalive. While an attempt waits, a cheap gRPC call to the daemon every
// few seconds (GetStepStats, answered without touching the job's step) tells a slow transfer
// from an unreachable daemon: no answer in kProbeTimeout, or no connection, is UNAVAILABLE, and
// the retry loop re-reads the placement as it does for gRPC transfers.
constexpr absl::Duration kProbeEvery = absl::Seconds(5);
constexpr absl::Duration kProbeTimeout = absl::Seconds(5);
constexpr absl::Duration kHelloTimeout = absl::Seconds(10);
// Marks a status as the daemon's answer to the hello (not a timeout): Attach retries an
// UNAVAILABLE one.
constexpr const char* kRefusedPayload = kAttachNotYetPayload;

absl::StatusOr<std::unique_ptr<ucx::Worker>> NewTrainerWorker(int32_t rank) {
  ucx::Worker::Options options;
  options.name = absl::StrCat("mainstay-trainer-", rank);
  return ucx::Worker::Create(std::move(options));
}

class UcxTransport final : public DataTransport {
 public:
  UcxTransport(const TransportContext& context, std::shared_ptr<ucx::Worker> worker)
      : context_(context), worker_(std::move(worker)) {}

  ~UcxTransport() override {
    Shutdown();
    absl::MutexLock lock(&mu_);
    connections_.clear();  // each connection closes its endpoint before its worker may go
  }

  v1::Transport kind() const override { return v1::TRANSPORT_UCX; }
  bool ComputesPushCrc32c() const override { return true; }

  absl::Status Attach(const v1::DaemonEndpoint& daemon, Deadline deadline) override {
    // A daemon that has not received the job's assignment yet (it comes moments after
    // CreateJob) refuses the hello with UNAVAILABLE: ask again until the deadline.
    absl::Duration backoff = absl::Milliseconds(20);
    while (true) {
      absl::Status s = ConnectionTo(daemon, deadline).status();
      if (s.ok() || !absl::IsUnavailable(s) || !s.GetPayload(kRefusedPayload).has_value() ||
          absl::Now() + backoff >= ToAbsl(deadline) || shutdown_.load()) {
        return s;
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(500));
    }
  }

  absl::StatusOr<v1::PushGradResponse> Push(const Route& route, const v1::PushGradHeader& header, ElementSpan data,
                                            Deadline deadline, grpc::ClientContext*,
                                            std::optional<uint32_t>* payload_crc32c) override {
    absl::StatusOr<std::shared_ptr<Connection>> connected = ConnectionTo(route.endpoint, deadline);
    if (!connected.ok()) return connected.status();
    const std::shared_ptr<Connection> c = *std::move(connected);
    const uint64_t seq = next_seq_.fetch_add(1);
    v1::UcxRequest request;
    *request.mutable_push() = header;
    const std::string request_bytes = Serialize(request, seq, deadline);
    std::string reply_bytes(ucx::kMaxControlBytes, '\0');
    std::string trailer_bytes;  // declared before `outcome`, whose send reads it until the group goes
    std::optional<uint32_t> crc;  // computed while the payload is in flight
    Watch abort(this, route, *c);

    // The outcome's receive is posted first, so it is never an unexpected message.
    ucx::OpGroup outcome(c->worker.get());
    outcome.Recv(ucx::TrainerTag(Kind::kReply, seq), ucx::kExactMask, reply_bytes.data(), reply_bytes.size());
    absl::StatusOr<v1::UcxReply> accept = Call(c, seq, request_bytes, Kind::kAccept, deadline, abort, "push request");
    if (!accept.ok()) return accept.status();
    if (absl::Status s = StatusOfReply(*accept); !s.ok()) return s;  // refused: nothing was sent, nothing stored
    if (!accept->duplicate()) {
      const int64_t chunk = ucx::PushChunkBytes(context_.chunk_bytes, data.element_bytes());
      const auto* bytes = static_cast<const uint8_t*>(data.data);
      const int64_t total = data.bytes();
      for (int64_t off = 0; off < total; off += chunk) {
        outcome.Send(*c->ep, ucx::DaemonTag(Kind::kPushData, c->id, static_cast<uint32_t>(seq)), bytes + off,
                     static_cast<size_t>(std::min(chunk, total - off)));
      }
      // While the chunks are in flight (both only read the caller's buffer).
      if (header.crc32c() == 0 && (header.crc32c_follows() || payload_crc32c != nullptr)) {
        crc = Crc32c(bytes, static_cast<size_t>(total));
      }
      if (header.crc32c_follows()) {
        v1::PushGradTrailer trailer;
        trailer.set_crc32c(crc.value_or(0));
        trailer_bytes = trailer.SerializeAsString();
        outcome.Send(*c->ep, ucx::DaemonTag(Kind::kPushTrailer, c->id, static_cast<uint32_t>(seq)),
                     trailer_bytes.data(), trailer_bytes.size());
      }
    }
    if (absl::Status s = outcome.Wait(ToAbsl(deadline), [&] { return abort(); }); !s.ok()) {
      return Fail(c, s, "push payload");
    }
    v1::UcxReply reply;
    if (!reply.ParseFromArray(reply_bytes.data(), static_cast<int>(outcome.received_bytes(0)))) {
      return Fail(c, absl::InternalError("unparseable push outcome"), "push payload");
    }
    if (absl::Status s = StatusOfReply(reply); !s.ok()) return s;
    if (crc.has_value() && payload_crc32c != nullptr) *payload_crc32c = crc;
    return reply.push();
  }

  absl::Status Pull(const Route& route, const v1::PullParamsRequest& pull, ShardPullAssembler& assembler,
                    Deadline deadline, grpc::ClientContext*) override {
    absl::StatusOr<std::shared_ptr<Connection>> connected = ConnectionTo(route.endpoint, deadline);
    if (!connected.ok()) return connected.status();
    const std::shared_ptr<Connection> c = *std::move(connected);
    const uint64_t seq = next_seq_.fetch_add(1);
    v1::UcxRequest request;
    *request.mutable_pull() = pull;
    const std::string request_bytes = Serialize(request, seq, deadline);
    Watch abort(this, route, *c);
    absl::StatusOr<v1::UcxReply> reply = Call(c, seq, request_bytes, Kind::kReply, deadline, abort, "pull request");
    if (!reply.ok()) return reply.status();
    if (absl::Status s = StatusOfReply(*reply); !s.ok()) return s;  // nothing follows an error
    v1::PullParamsResponse header;
    *header.mutable_header() = reply->pull();
    if (absl::Status s = assembler.OnMessage(header); !s.ok()) return Fail(c, s, "pull header");
    if (assembler.unchanged()) return absl::OkStatus();

    const std::span<uint8_t> data = assembler.data_destination();
    const std::span<uint8_t> scales = assembler.scale_destination();
    const int64_t chunk = ucx::PullChunkBytes(context_.chunk_bytes);
    ucx::OpGroup group(c->worker.get());
    std::vector<size_t> expected;
    for (int64_t off = 0; off < static_cast<int64_t>(data.size()); off += chunk) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(chunk, static_cast<int64_t>(data.size()) - off));
      group.Recv(ucx::TrainerTag(Kind::kPullData, seq), ucx::kExactMask, data.data() + off, n);
      expected.push_back(n);
    }
    if (!scales.empty()) {
      group.Recv(ucx::TrainerTag(Kind::kPullScales, seq), ucx::kExactMask, scales.data(), scales.size());
      expected.push_back(scales.size());
    }
    // Chunk by chunk, in order: each is checked (and its bytes folded into the CRC) while later
    // ones are still in flight.
    const size_t data_chunks = expected.size() - (scales.empty() ? 0 : 1);
    for (size_t i = 0; i < expected.size(); ++i) {
      if (absl::Status s = group.WaitRecv(i, ToAbsl(deadline), [&] { return abort(); }); !s.ok()) {
        return Fail(c, s, "pull payload");
      }
      if (group.received_bytes(i) != expected[i]) {
        return Fail(c,
                    absl::InternalError(absl::StrCat("chunk ", i, " of the pull has ", group.received_bytes(i),
                                                     " bytes, expected ", expected[i])),
                    "pull payload");
      }
      if (i < data_chunks) assembler.DataLanded(static_cast<int64_t>(expected[i]));
    }
    return assembler.Placed();
  }

  void Shutdown() override {
    if (shutdown_.exchange(true)) return;
    std::map<std::string, std::shared_ptr<Connection>> connections;
    {
      absl::MutexLock lock(&mu_);
      connections = connections_;
    }
    // Tell each daemon first (briefly), so it forgets the connection now rather than at UCX's
    // keepalive timeout; then close, which ends whatever is still in flight.
    std::deque<std::string> goodbyes;  // stable addresses while the sends run
    std::deque<ucx::OpGroup> groups;  // one per connection (each has its worker)
    for (auto& [address, c] : connections) {
      if (c->ep->failed()) continue;
      v1::UcxRequest bye;
      bye.set_close(true);
      const uint64_t seq = next_seq_.fetch_add(1);
      bye.set_seq(seq);
      goodbyes.push_back(bye.SerializeAsString());
      groups.emplace_back(c->worker.get());
      groups.back().Send(*c->ep, ucx::DaemonTag(Kind::kRequest, c->id, static_cast<uint32_t>(seq)),
                         goodbyes.back().data(), goodbyes.back().size());
    }
    const absl::Time until = absl::Now() + absl::Milliseconds(200);
    for (ucx::OpGroup& group : groups) group.Wait(until, nullptr).IgnoreError();
    for (auto& [address, c] : connections) c->ep->Close();
  }

 private:
  // Members are destroyed bottom up: the endpoint closes before its worker may go.
  struct Connection {
    std::shared_ptr<ucx::Worker> worker;  // the client's worker when the connection was opened
    std::shared_ptr<ucx::Endpoint> ep;    // to the daemon's worker for this connection
    uint32_t id = 0;
    std::string ep_key;  // the daemon's worker address: connections_' key
    std::string daemon;  // "id (address)", for messages
  };

  // The abort check of one attempt's waits: Aborted, plus the reachability probe.
  class Watch {
   public:
    Watch(const UcxTransport* t, const Route& route, const Connection& c)
        : t_(t), route_(route), c_(c), next_probe_(absl::Now() + kProbeEvery) {}
    absl::Status operator()() {
      MAINSTAY_RETURN_IF_ERROR(t_->Aborted(c_));
      if (route_.stub == nullptr || absl::Now() < next_probe_) return absl::OkStatus();
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + kProbeTimeout));
      v1::GetStepStatsRequest request;
      request.set_job_id(t_->context_.job_id);
      request.set_job_token(t_->context_.job_token);
      request.set_latest(true);
      v1::GetStepStatsResponse response;
      const grpc::Status s = route_.stub->GetStepStats(&context, request, &response);
      next_probe_ = absl::Now() + kProbeEvery;
      // No answer in time, or no connection (the daemon holds this job: it has no reason to
      // answer UNAVAILABLE itself but a stop): the transfer cannot finish either.
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        return absl::UnavailableError(absl::StrCat("the daemon does not answer gRPC (", s.error_message(),
                                                   "): unreachable, or stopping"));
      }
      return absl::OkStatus();  // any other answer, even an error, means it is reachable
    }

   private:
    const UcxTransport* const t_;
    const Route& route_;
    const Connection& c_;
    absl::Time next_probe_;
  };

  // Sends a serialized request on `c` and waits for its first answer, of kind `answer`. A
  // failure (not the daemon's error answer) closes the connection.
  absl::StatusOr<v1::UcxReply> Call(const std::shared_ptr<Connection>& c, uint64_t seq, const std::string& request,
                                    Kind answer, Deadline deadline, Watch& abort, const char* what) {
    std::string bytes(ucx::kMaxControlBytes, '\0');
    ucx::OpGroup group(c->worker.get());
    group.Recv(ucx::TrainerTag(answer, seq), ucx::kExactMask, bytes.data(), bytes.size());
    group.Send(*c->ep, ucx::DaemonTag(Kind::kRequest, c->id, static_cast<uint32_t>(seq)), request.data(),
               request.size());
    if (absl::Status s = group.Wait(ToAbsl(deadline), [&] { return abort(); }); !s.ok()) return Fail(c, s, what);
    v1::UcxReply reply;
    if (!reply.ParseFromArray(bytes.data(), static_cast<int>(group.received_bytes(0)))) {
      return Fail(c, absl::InternalError("an unparseable answer"), what);
    }
    return reply;
  }

  // `request` with the fields every request carries, as bytes.
  std::string Serialize(v1::UcxRequest& request, uint64_t seq, Deadline deadline) const {
    request.set_seq(seq);
    request.set_timeout_ms(RemainingMs(deadline));
    request.set_chunk_bytes(context_.chunk_bytes);
    return request.SerializeAsString();
  }

  absl::Status Aborted(const Connection& c) const {
    if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
    if (c.ep->failed()) return c.ep->failure();
    return absl::OkStatus();
  }


  // Closes `c` (so nothing of this attempt stays in flight on either end) and annotates `s`.
  absl::Status Fail(const std::shared_ptr<Connection>& c, const absl::Status& s, const char* what) {
    c->ep->failed();  // runs the process watch once more
    const bool peer_exited = c->ep->peer_exited();
    c->ep->Close();
    // A daemon that died while connected over shared memory may have died in the middle of a
    // write into this worker's receive queue, which then stalls for good (UCX 1.13 does not
    // recover it): later connections get a fresh worker. This one stays with the connections
    // that use it (to other daemons, over other transports) until they end.
    std::shared_ptr<ucx::Worker> fresh;
    if (peer_exited) {
      if (absl::StatusOr<std::unique_ptr<ucx::Worker>> w = NewTrainerWorker(context_.rank); w.ok()) fresh = *std::move(w);
    }
    {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(c->ep_key);
      if (it != connections_.end() && it->second == c) connections_.erase(it);
      if (fresh != nullptr && worker_ == c->worker) worker_ = std::move(fresh);
    }
    absl::Status out = s;
    if (shutdown_.load()) out = absl::CancelledError("the client is shutting down");
    // A transfer cut short by the peer is UNAVAILABLE whatever UCX called it; retried.
    if (out.code() == absl::StatusCode::kCancelled && !shutdown_.load()) out = absl::UnavailableError(s.message());
    return absl::Status(out.code(), absl::StrCat("UCX ", what, " to daemon ", c->daemon, ": ", out.message()));
  }

  absl::StatusOr<std::shared_ptr<Connection>> ConnectionTo(const v1::DaemonEndpoint& daemon, Deadline deadline) {
    if (shutdown_.load()) return absl::CancelledError("the client is shutting down");
    const std::string& key = daemon.ucx_worker_address();
    if (key.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("daemon ", daemon.daemon_id(), " at ", daemon.address(),
                                                        " advertises no UCX worker address"));
    }
    absl::MutexLock connect_lock(&connect_mu_);  // one hello at a time: no duplicate connections
    {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(key);
      if (it != connections_.end() && !it->second->ep->failed()) return it->second;
      if (it != connections_.end()) connections_.erase(it);
    }
    auto c = std::make_shared<Connection>();
    c->daemon = absl::StrCat(daemon.daemon_id(), " (", daemon.address(), ")");
    c->ep_key = key;
    {
      absl::MutexLock lock(&mu_);
      c->worker = worker_;
    }
    // The hello goes to the daemon's listening worker; the connection then uses the worker the
    // daemon serves it on (UcxHelloReply.data_worker_address).
    absl::StatusOr<std::shared_ptr<ucx::Endpoint>> hello_ep = c->worker->Connect(key, nullptr);
    if (!hello_ep.ok()) {
      return absl::UnavailableError(absl::StrCat("UCX to daemon ", c->daemon, ": ", hello_ep.status().message()));
    }
    c->ep = *hello_ep;

    const uint64_t nonce = next_seq_.fetch_add(1);
    v1::UcxHello hello;
    hello.set_worker_address(c->worker->address());
    hello.set_nonce(nonce);
    hello.set_job_id(context_.job_id);
    hello.set_job_token(context_.job_token);
    hello.set_rank(context_.rank);
    hello.set_node_name(HostName());
    SetProcess(hello.mutable_process());
    const std::string hello_bytes = hello.SerializeAsString();
    std::string reply_bytes(ucx::kMaxControlBytes, '\0');
    v1::UcxHelloReply reply;
    {
      ucx::OpGroup group(c->worker.get());
      group.Recv(ucx::TrainerTag(Kind::kHelloReply, nonce), ucx::kExactMask, reply_bytes.data(), reply_bytes.size());
      group.Send(*c->ep, ucx::TrainerTag(Kind::kHello, nonce), hello_bytes.data(), hello_bytes.size());
      // Bounded on its own: a daemon that cannot be reached must leave the caller's deadline to
      // the retry loop, which re-reads the placement.
      absl::Status s = group.Wait(std::min(ToAbsl(deadline), absl::Now() + kHelloTimeout), [&] { return Aborted(*c); });
      if (s.ok() && !reply.ParseFromArray(reply_bytes.data(), static_cast<int>(group.received_bytes(0)))) {
        s = absl::InternalError("unparseable hello reply");
      }
      if (!s.ok()) {
        c->ep->Close();
        return absl::UnavailableError(absl::StrCat("UCX hello to daemon ", c->daemon, ": ", s.message()));
      }
    }
    if (reply.code() != 0) {
      c->ep->Close();
      absl::Status refused(static_cast<absl::StatusCode>(reply.code()),
                           absl::StrCat("UCX hello to daemon ", c->daemon, ": refused: ", reply.message()));
      refused.SetPayload(kRefusedPayload, absl::Cord("1"));
      return refused;
    }
    c->id = reply.connection_id();
    if (!reply.data_worker_address().empty()) {
      absl::StatusOr<std::shared_ptr<ucx::Endpoint>> data_ep = c->worker->Connect(reply.data_worker_address(), nullptr);
      c->ep->Close();  // the hello endpoint: nothing more goes to the listening worker
      if (!data_ep.ok()) {
        return absl::UnavailableError(
            absl::StrCat("UCX to daemon ", c->daemon, " (its connection's worker): ", data_ep.status().message()));
      }
      c->ep = *std::move(data_ep);
    }
    WatchPeer(*c->ep, reply.process());
    absl::MutexLock lock(&mu_);
    connections_[key] = c;
    return c;
  }

  const TransportContext context_;
  std::atomic<uint64_t> next_seq_{1};
  std::atomic<bool> shutdown_{false};
  absl::Mutex connect_mu_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);  // by worker address
  std::shared_ptr<ucx::Worker> worker_ ABSL_GUARDED_BY(mu_);  // for new connections
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataTransport>> MakeUcxTransport(const TransportContext& context) {
  if (context.chunk_bytes < ucx::kMinChunkBytes || context.chunk_bytes > ucx::kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", context.chunk_bytes, " is not in [",
                                                   ucx::kMinChunkBytes, ", ", ucx::kMaxChunkBytes, "]"));
  }
  absl::StatusOr<std::unique_ptr<ucx::Worker>> worker = NewTrainerWorker(context.rank);
  if (!worker.ok()) return absl::UnavailableError(absl::StrCat("UCX: ", worker.status().message()));
  return std::unique_ptr<DataTransport>(new UcxTransport(context, *std::move(worker)));
}

}  // namespace mainstay::client_internal

#include "server/ucx/ucx_data_server.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/logging.h"
#include "common/ucx_worker.h"
#include "mainstay/v1/data_plane.pb.h"

namespace mainstay::daemon {
namespace {

using ucx::Kind;

constexpr char kComponent[] = "ucx-server";
constexpr char kTransport[] = "ucx";  // the `transport` label of the byte counters
constexpr int64_t kDefaultTimeoutMs = 60000;
constexpr int64_t kMaxTimeoutMs = 3600 * 1000;
constexpr absl::Duration kControlTimeout = absl::Seconds(30);
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);

// One trainer connection (opened by its hello).
struct Connection {
  uint32_t id = 0;
  std::shared_ptr<ucx::Endpoint> ep;
  std::string job_id;
  int32_t rank = 0;
  std::string node;
  std::atomic<bool> dropped{false};
};

// A standing receive of one kind of incoming control message, driven by the progress thread.
struct Inbox {
  explicit Inbox(Kind k) : kind(k), buffer(ucx::kMaxControlBytes) {}
  const Kind kind;
  std::vector<char> buffer;
  void* request = nullptr;  // posted and not yet freed (progress thread only)
  bool cancelled = false;   // by Poll, once stopping (progress thread only)
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  ucp_tag_t tag = 0;
  size_t length = 0;
};

v1::UcxReply ErrorReply(const absl::Status& status) {
  v1::UcxReply reply;
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(std::string(status.message()));
  if (std::optional<v1::ErrorDetail> detail = GetErrorDetail(status); detail.has_value()) {
    reply.set_error_detail(detail->SerializeAsString());
  }
  return reply;
}

class Server final : public UcxDataServer {
 public:
  explicit Server(Options options) : options_(options) {
    if (metrics::DaemonMetrics* m = options_.daemon->metrics(); m != nullptr) {
      pushed_bytes_ = m->PushedBytes(kTransport);
      pulled_bytes_ = m->PulledBytes(kTransport);
    }
  }
  ~Server() override {
    Shutdown();
    worker_.reset();  // joins the progress thread before the members it reads go
  }

  absl::Status Init() {
    ucx::Worker::Options wo;
    wo.name = "mainstayd";
    wo.after_progress = [this] { Poll(); };
    absl::StatusOr<std::unique_ptr<ucx::Worker>> w = ucx::Worker::Create(std::move(wo));
    if (!w.ok()) return absl::UnavailableError(absl::StrCat("UCX: ", w.status().message()));
    worker_ = *std::move(w);
    ready_.store(true);
    return absl::OkStatus();
  }

  const std::string& worker_address() const override { return worker_->address(); }
  std::string Describe() const override { return worker_->Describe(); }

  void Shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (worker_ == nullptr) return;
    worker_->Signal();  // Poll cancels the inboxes' receives
    std::map<uint32_t, std::shared_ptr<Connection>> conns;
    {
      absl::MutexLock lock(&mu_);
      conns = connections_;
    }
    for (auto& [id, c] : conns) Drop(c, "the daemon is stopping");
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0 && inbox_freed_ == 2; };
    mu_.Await(absl::Condition(&idle));
    connections_.clear();
  }

 private:
  // ---- Progress thread.

  void Poll() {
    if (!ready_.load()) return;  // the progress thread starts before Init has stored worker_
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    for (Inbox* inbox : {&hello_, &request_}) {
      if (stopping && inbox->request != nullptr && !inbox->cancelled) {
        ucp_request_cancel(worker_->worker(), inbox->request);
        inbox->cancelled = true;
      }
      for (int round = 0; round < 16; ++round) {  // drain what queued up, within reason
        if (inbox->request != nullptr) {
          if (!inbox->done.load(std::memory_order_acquire)) break;
          ucp_request_free(inbox->request);
          inbox->request = nullptr;
          Deliver(*inbox);
        }
        if (inbox->request == nullptr && !Post(*inbox)) break;
      }
    }
    if (any_failed_.exchange(false)) {
      std::vector<std::shared_ptr<Connection>> failed;
      {
        absl::MutexLock lock(&mu_);
        for (auto& [id, c] : connections_) {
          if (c->ep->failed()) failed.push_back(c);
        }
      }
      for (auto& c : failed) Drop(c, std::string(c->ep->failure().message()));
    }
  }

  static void OnInbox(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
    auto* inbox = static_cast<Inbox*>(user_data);
    inbox->status = status;
    if (info != nullptr) {
      inbox->tag = info->sender_tag;
      inbox->length = info->length;
    }
    inbox->done.store(true, std::memory_order_release);
  }

  // Posts the inbox's receive (it completes through OnInbox; false: not posted).
  bool Post(Inbox& inbox) {
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
      if (stopping && inbox.request == nullptr && !inbox_counted_[inbox.kind == Kind::kHello ? 0 : 1]) {
        inbox_counted_[inbox.kind == Kind::kHello ? 0 : 1] = true;
        ++inbox_freed_;
      }
    }
    if (stopping) return false;
    inbox.done.store(false);
    // Always through the callback (UCX 1.13 leaves recv_info unset for some immediate
    // completions: the sender's tag would be lost).
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = &Server::OnInbox;
    param.user_data = &inbox;
    ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_->worker(), inbox.buffer.data(), inbox.buffer.size(),
                                          ucx::KindTag(inbox.kind), ucx::kKindMask, &param);
    if (UCS_PTR_IS_ERR(r) || r == nullptr) {
      Log(LogLevel::kError, kComponent,
          absl::StrCat("cannot post a receive: ", ucs_status_string(r == nullptr ? UCS_ERR_IO_ERROR : UCS_PTR_STATUS(r))));
      return false;
    }
    inbox.request = r;
    return true;
  }

  void Deliver(Inbox& inbox) {
    if (inbox.status != UCS_OK) {
      if (inbox.status != UCS_ERR_CANCELED) {
        Log(LogLevel::kWarning, kComponent,
            absl::StrCat("dropped an incoming message: ", ucs_status_string(inbox.status)));
      }
      return;
    }
    std::string message(inbox.buffer.data(), inbox.length);
    const uint64_t tag = inbox.tag;
    if (inbox.kind == Kind::kHello) {
      Spawn([this, message = std::move(message)] { OnHello(message); });
    } else {
      Spawn([this, tag, message = std::move(message)] { OnRequest(tag, message); });
    }
  }

  // ---- Handler threads.

  void Spawn(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      ++running_;
    }
    std::thread([this, fn = std::move(fn)] {
      fn();
      absl::MutexLock lock(&mu_);
      --running_;
    }).detach();
  }

  void Drop(const std::shared_ptr<Connection>& c, const std::string& why) {
    if (c->dropped.exchange(true)) return;
    c->ep->Close();
    {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(c->id);
      if (it != connections_.end() && it->second == c) connections_.erase(it);
    }
    options_.daemon->connections()->Close(c->job_id, c->rank, v1::TRANSPORT_UCX, c->node);
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("connection ", c->id, " (job ", c->job_id, " rank ", c->rank, " on ", c->node, ") closed: ", why));
  }

  absl::Status Abort(const Connection& c) {
    if (c.ep->failed()) return c.ep->failure();
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the daemon is stopping");
    return absl::OkStatus();
  }

  void OnHello(const std::string& message) {
    v1::UcxHello hello;
    if (!hello.ParseFromString(message) || hello.worker_address().empty()) {
      Log(LogLevel::kWarning, kComponent, "ignored a malformed UCX hello");
      return;
    }
    auto c = std::make_shared<Connection>();
    c->job_id = hello.job_id();
    c->rank = hello.rank();
    c->node = hello.node_name();
    absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep = worker_->Connect(hello.worker_address(), [this](const absl::Status&) {
      any_failed_.store(true);
      worker_->Signal();
    });
    if (!ep.ok()) {
      Log(LogLevel::kWarning, kComponent, absl::StrCat("cannot connect back to a trainer: ", ep.status().message()));
      return;
    }
    c->ep = *std::move(ep);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) {
        c->ep->Close();
        return;
      }
      do {
        next_id_ = (next_id_ + 1) & 0xffffffu;
      } while (next_id_ == 0 || connections_.count(next_id_) > 0);
      c->id = next_id_;
      connections_[c->id] = c;
    }
    options_.daemon->connections()->Record(c->job_id, c->rank, v1::TRANSPORT_UCX, c->node, 0, 0, /*open=*/true);
    v1::UcxHelloReply reply;
    reply.set_connection_id(c->id);
    const ucx::ProcessIdentity& self = ucx::ProcessIdentity::Self();
    reply.mutable_process()->set_boot_id(self.boot_id);
    reply.mutable_process()->set_pid_namespace(self.pid_namespace);
    reply.mutable_process()->set_pid(self.pid);
    if (!c->ep->detects_peer_failure()) {
      // UCX cannot report this trainer's failure (shared memory): watch its process, or else
      // rely on each request's timeout.
      const ucx::ProcessIdentity peer{hello.process().boot_id(), hello.process().pid_namespace(), hello.process().pid()};
      if (self.SameProcessSpace(peer)) {
        c->ep->WatchProcess(peer.pid);
      } else {
        Log(LogLevel::kWarning, kComponent,
            absl::StrCat("connection from job ", c->job_id, " rank ", c->rank,
                         ": UCX cannot detect this peer's failure over the transports in common and its process is not "
                         "visible here; a dead trainer is noticed at its request's timeout"));
      }
    }
    const std::string bytes = reply.SerializeAsString();
    ucx::OpGroup group(worker_.get());
    group.Send(*c->ep, ucx::TrainerTag(Kind::kHelloReply, hello.nonce()), bytes.data(), bytes.size());
    if (absl::Status s = group.Wait(absl::Now() + kControlTimeout, [&] { return Abort(*c); }); !s.ok()) {
      Drop(c, absl::StrCat("hello reply: ", s.message()));
      return;
    }
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("connection ", c->id, ": job ", c->job_id, " rank ", c->rank, " from ", c->node));
  }

  void OnRequest(uint64_t tag, const std::string& message) {
    const uint32_t id = ucx::ConnectionOfTag(tag);
    std::shared_ptr<Connection> c;
    {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(id);
      if (it != connections_.end()) c = it->second;
    }
    if (c == nullptr) {
      Log(LogLevel::kWarning, kComponent, absl::StrCat("request on unknown connection ", id, " ignored"));
      return;
    }
    v1::UcxRequest request;
    if (!request.ParseFromString(message) || static_cast<uint32_t>(request.seq()) != ucx::SeqOfTag(tag)) {
      Drop(c, "a malformed request (protocol violation)");
      return;
    }
    if (request.close()) {
      Drop(c, "the trainer closed it");
      return;
    }
    const int64_t timeout_ms = request.timeout_ms() > 0 ? std::min(request.timeout_ms(), kMaxTimeoutMs) : kDefaultTimeoutMs;
    const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
    const Kind answer = request.has_push() ? Kind::kAccept : Kind::kReply;
    if (request.chunk_bytes() < ucx::kMinChunkBytes || request.chunk_bytes() > ucx::kMaxChunkBytes) {
      Answer(c, answer, request.seq(),
             ErrorReply(absl::InvalidArgumentError(absl::StrCat("chunk_bytes ", request.chunk_bytes(), " is not in [",
                                                                ucx::kMinChunkBytes, ", ", ucx::kMaxChunkBytes, "]"))));
      return;
    }
    switch (request.op_case()) {
      case v1::UcxRequest::kPush:
        return Push(c, request, deadline);
      case v1::UcxRequest::kPull:
        return Pull(c, request, deadline);
      default:
        Answer(c, Kind::kReply, request.seq(), ErrorReply(absl::InvalidArgumentError("a request with no operation")));
    }
  }

  // Sends one control reply and waits for it.
  void Answer(const std::shared_ptr<Connection>& c, Kind kind, uint64_t seq, const v1::UcxReply& reply) {
    const std::string bytes = reply.SerializeAsString();
    ucx::OpGroup group(worker_.get());
    group.Send(*c->ep, ucx::TrainerTag(kind, seq), bytes.data(), bytes.size());
    if (absl::Status s = group.Wait(absl::Now() + kControlTimeout, [&] { return Abort(*c); }); !s.ok()) {
      Drop(c, absl::StrCat("reply: ", s.message()));
    }
  }

  void Push(const std::shared_ptr<Connection>& c, const v1::UcxRequest& request, absl::Time deadline) {
    const v1::PushGradHeader& h = request.push();
    const uint64_t seq = request.seq();
    absl::StatusOr<std::unique_ptr<PushSession>> session = options_.daemon->BeginPush(h);
    if (!session.ok()) return Answer(c, Kind::kAccept, seq, ErrorReply(session.status()));
    if (options_.drain != nullptr) {
      if (absl::Status s = options_.drain->AdmitPush(h.job_id(), h.step()); !s.ok()) {
        return Answer(c, Kind::kAccept, seq, ErrorReply(s));  // the session is dropped: nothing stored
      }
    }
    PushSession& push = **session;
    v1::UcxReply accept;
    accept.set_duplicate(push.duplicate());
    const std::string accept_bytes = accept.SerializeAsString();
    std::vector<size_t> expected;
    int64_t total = 0;
    {
      ucx::OpGroup group(worker_.get());
      // The chunks' receives go first: the payload never waits as an unexpected message.
      const std::span<uint8_t> dest = push.destination();
      const int64_t chunk = ucx::PushChunkBytes(request.chunk_bytes(), push.element_bytes());
      for (int64_t off = 0; off < static_cast<int64_t>(dest.size()); off += chunk) {
        const size_t n = static_cast<size_t>(std::min<int64_t>(chunk, static_cast<int64_t>(dest.size()) - off));
        group.Recv(ucx::DaemonTag(Kind::kPushData, c->id, static_cast<uint32_t>(seq)), ucx::kExactMask,
                   dest.data() + off, n);
        expected.push_back(n);
      }
      total = static_cast<int64_t>(dest.size());
      group.Send(*c->ep, ucx::TrainerTag(Kind::kAccept, seq), accept_bytes.data(), accept_bytes.size());
      if (absl::Status s = group.Wait(deadline, [&] { return Abort(*c); }); !s.ok()) {
        // The trainer died, went silent past its timeout, or the daemon is stopping: the session
        // goes with this scope, nothing of the push is stored.
        Drop(c, absl::StrCat("push of job ", h.job_id(), " bucket ", h.bucket(), " shard ", h.shard(), " step ", h.step(),
                             " abandoned (", s.message(), "); nothing was stored"));
        return;
      }
      for (size_t i = 0; i < expected.size(); ++i) {
        if (group.received_bytes(i) != expected[i]) {
          return Answer(c, Kind::kReply, seq,
                        ErrorReply(absl::InvalidArgumentError(absl::StrCat(
                            "PushGrad: chunk ", i, " has ", group.received_bytes(i), " bytes, expected ", expected[i],
                            " (chunk_bytes ", request.chunk_bytes(), "); nothing was stored"))));
        }
      }
    }
    push.Placed();
    absl::StatusOr<v1::PushGradResponse> stored = push.Finish();
    if (!stored.ok()) return Answer(c, Kind::kReply, seq, ErrorReply(stored.status()));
    if (pushed_bytes_ != nullptr) pushed_bytes_->Increment(static_cast<double>(total));
    options_.daemon->connections()->Record(c->job_id, c->rank, v1::TRANSPORT_UCX, c->node, total, 0);
    v1::UcxReply reply;
    *reply.mutable_push() = *std::move(stored);
    Answer(c, Kind::kReply, seq, reply);
  }

  void Pull(const std::shared_ptr<Connection>& c, const v1::UcxRequest& request, absl::Time deadline) {
    const uint64_t seq = request.seq();
    // Waits in slices, like the gRPC service: a stop or a dead trainer ends the wait early.
    absl::StatusOr<PullResult> result;
    while (true) {
      result = options_.daemon->PullParams(request.pull(), std::min(deadline, absl::Now() + kWaitSlice));
      if (result.ok() || result.status().code() != absl::StatusCode::kDeadlineExceeded || absl::Now() >= deadline) {
        break;
      }
      if (absl::Status s = Abort(*c); !s.ok()) {
        if (!c->ep->failed()) Answer(c, Kind::kReply, seq, ErrorReply(s));
        return;
      }
    }
    if (!result.ok()) return Answer(c, Kind::kReply, seq, ErrorReply(result.status()));
    v1::UcxReply reply;
    *reply.mutable_pull() = PullHeaderOf(*result);
    const std::string header = reply.SerializeAsString();
    const QuantizedShard& s = *result->shard;  // immutable; alive while `result` is
    ucx::OpGroup group(worker_.get());
    group.Send(*c->ep, ucx::TrainerTag(Kind::kReply, seq), header.data(), header.size());
    int64_t total = 0;
    if (!result->unchanged) {
      const int64_t chunk = ucx::PullChunkBytes(request.chunk_bytes());
      const int64_t size = static_cast<int64_t>(s.data.size());
      for (int64_t off = 0; off < size; off += chunk) {
        group.Send(*c->ep, ucx::TrainerTag(Kind::kPullData, seq), s.data.data() + off,
                   static_cast<size_t>(std::min(chunk, size - off)));
      }
      if (!s.scales.empty()) {
        group.Send(*c->ep, ucx::TrainerTag(Kind::kPullScales, seq), s.scales.data(), s.scales.size());
      }
      total = size + static_cast<int64_t>(s.scales.size());
    }
    if (absl::Status st = group.Wait(deadline, [&] { return Abort(*c); }); !st.ok()) {
      Drop(c, absl::StrCat("pull of job ", request.pull().job_id(), " bucket ", request.pull().bucket(), " shard ",
                           request.pull().shard(), " abandoned: ", st.message()));
      return;
    }
    if (pulled_bytes_ != nullptr) pulled_bytes_->Increment(static_cast<double>(total));
    options_.daemon->connections()->Record(c->job_id, c->rank, v1::TRANSPORT_UCX, c->node, 0, total);
  }

  const Options options_;
  std::unique_ptr<ucx::Worker> worker_;
  std::shared_ptr<metrics::Counter> pushed_bytes_, pulled_bytes_;  // null: no metrics
  Inbox hello_{Kind::kHello};
  Inbox request_{Kind::kRequest};
  std::atomic<bool> any_failed_{false};
  std::atomic<bool> ready_{false};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int inbox_freed_ ABSL_GUARDED_BY(mu_) = 0;  // inboxes done for good (Shutdown waits for both)
  bool inbox_counted_[2] ABSL_GUARDED_BY(mu_) = {false, false};
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint32_t, std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxDataServer>> UcxDataServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  auto server = std::make_unique<Server>(options);
  if (absl::Status s = server->Init(); !s.ok()) return s;
  return std::unique_ptr<UcxDataServer>(std::move(server));
}

}  // namespace mainstay::daemon

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
constexpr size_t kTrailerBytes = 32;  // a PushGradTrailer is at most 5 bytes
constexpr int kMaxRefusals = 2;  // threads answering hellos for jobs not (yet) here, at a time

// A standing receive of one kind of incoming control message, driven by the progress thread.
struct Inbox {
  explicit Inbox(Kind k) : kind(k), buffer(ucx::kMaxControlBytes) {}
  const Kind kind;
  std::vector<char> buffer;
  void* request = nullptr;  // posted and not yet freed (progress thread only)
  bool cancelled = false;   // once stopping (progress thread only)
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  ucp_tag_t tag = 0;
  size_t length = 0;
  std::atomic<bool> freed{false};  // cancelled and released for good
};

struct Connection;

// A UCP worker serving trainer connections (the listening worker takes hellos only): its
// progress thread, and one standing receive for the requests of every connection it serves
// (each request's tag names its connection). Dedicated to one connection, or one of the pool
// that the others share (Options.dedicated_workers).
//
// Lifetime: held by the connections it serves, and by the pool when shared. Its progress thread
// reads it through a raw pointer: the destructor stops that thread before the members go.
struct ServingWorker {
  explicit ServingWorker(bool dedicated) : dedicated(dedicated) {}
  ~ServingWorker() {
    if (worker == nullptr) return;
    closing.store(true);
    worker->Signal();
    // The progress thread cancels and frees the standing receive before the worker goes.
    while (ready.load() && !requests.freed.load()) absl::SleepFor(absl::Milliseconds(1));
    worker.reset();  // joins the progress thread
  }

  const bool dedicated;
  std::unique_ptr<ucx::Worker> worker;
  Inbox requests{Kind::kRequest};
  std::atomic<bool> ready{false};    // `worker` is set: the inbox may be posted
  std::atomic<bool> closing{false};  // the inbox's receive is cancelled, for good
  // The connections it serves, for the progress thread's failure checks. A connection leaves
  // (under the lock) before its endpoint closes, so the progress thread never reads a gone one.
  absl::Mutex members_mu;
  std::vector<Connection*> members ABSL_GUARDED_BY(members_mu);
};

// One trainer connection (opened by its hello), on a serving worker.
//
// Lifetime: shared by the connection table and the handler threads working on it; the serving
// worker's progress thread reads it only as a member (see ServingWorker).
struct Connection {
  uint32_t id = 0;
  std::shared_ptr<ServingWorker> serving;
  std::shared_ptr<ucx::Endpoint> ep;  // from serving->worker to the trainer's worker
  std::string job_id;
  int32_t rank = 0;
  std::string node;
  std::atomic<bool> dropped{false};
  std::atomic<bool> drop_scheduled{false};  // the endpoint failed and a Drop is on its way

  ucx::Worker* worker() const { return serving->worker.get(); }

  ~Connection() {
    if (serving == nullptr) return;
    {
      absl::MutexLock lock(&serving->members_mu);
      std::erase(serving->members, this);
    }
    if (ep != nullptr) ep->Close();  // needs the progress thread, which the serving worker still has
    ep.reset();
    serving.reset();  // a dedicated worker goes here, with its thread
  }
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
    worker_->Signal();  // Poll cancels the hello inbox's receive
    std::map<uint32_t, std::shared_ptr<Connection>> conns;
    {
      absl::MutexLock lock(&mu_);
      conns = connections_;
    }
    for (auto& [id, c] : conns) Drop(c, "the daemon is stopping");
    std::map<uint32_t, std::shared_ptr<Connection>> left;
    {
      absl::MutexLock lock(&mu_);
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0 && hello_freed_; };
      mu_.Await(absl::Condition(&idle));
      left.swap(connections_);
    }
    // Outside mu_: a connection leaving its worker, and a worker going, wait for that worker's
    // progress thread, which takes mu_.
    left.clear();
    std::vector<std::shared_ptr<ServingWorker>> pool;
    {
      absl::MutexLock lock(&pool_mu_);
      pool.swap(pool_);
    }
  }

 private:
  // ---- Progress threads.

  // The listening worker's: hellos.
  void Poll() {
    // The progress thread starts before Init has stored worker_, and runs a few more rounds
    // while ~Server destroys it (worker_ is null by then; the inbox was freed at Shutdown).
    if (!ready_.load() || hello_.freed.load()) return;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    if (DrainInbox(*worker_, hello_, stopping, [this](Inbox& inbox) {
          Admit(std::string(inbox.buffer.data(), inbox.length));
        })) {
      absl::MutexLock lock(&mu_);
      hello_freed_ = true;
    }
  }

  // On the listening worker's progress thread: a hello gets a handler thread (and a worker, an
  // endpoint, a reply naming this process) only once its job token checks out. A hello for a
  // job not here yet (its assignment may be on its way) is refused with UNAVAILABLE, from at
  // most kMaxRefusals threads at a time; any other is dropped unanswered.
  void Admit(const std::string& message) {
    v1::UcxHello hello;
    absl::Status admitted = absl::InvalidArgumentError("a malformed UCX hello");
    if (hello.ParseFromString(message) && !hello.worker_address().empty()) {
      admitted = options_.daemon->CheckJobToken(hello.job_id(), hello.job_token());
    }
    if (admitted.ok()) {
      Spawn([this, hello = std::move(hello)] { OnHello(hello); });
      return;
    }
    if (admitted.code() == absl::StatusCode::kUnavailable && refusals_.fetch_add(1) < kMaxRefusals) {
      Spawn([this, hello = std::move(hello), admitted] {
        RefuseHello(hello, admitted);
        refusals_.fetch_sub(1);
      });
      return;
    }
    if (admitted.code() == absl::StatusCode::kUnavailable) refusals_.fetch_sub(1);
    absl::MutexLock lock(&mu_);
    ++dropped_hellos_;
    if (absl::Now() - last_drop_log_ >= absl::Seconds(10)) {
      last_drop_log_ = absl::Now();
      Log(LogLevel::kWarning, kComponent,
          absl::StrCat("dropped ", dropped_hellos_, " UCX hello(s) unanswered so far; the latest: ", admitted.message(),
                       " (job '", hello.job_id(), "' rank ", hello.rank(), ")"));
    }
  }

  // A serving worker's: its connections' requests, and their endpoints' failures. Never holds
  // a reference to a connection (see ServingWorker).
  void PollServing(ServingWorker* w) {
    // As in Poll: `w->worker` is not set yet, or is being destroyed (the inbox is freed then).
    if (!w->ready.load() || w->requests.freed.load()) return;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    DrainInbox(*w->worker, w->requests, stopping || w->closing.load(), [this, w](Inbox& inbox) {
      std::string message(inbox.buffer.data(), inbox.length);
      const uint64_t tag = inbox.tag;
      Spawn([this, w, tag, message = std::move(message)] { OnRequest(w, tag, message); });
    });
    absl::MutexLock lock(&w->members_mu);
    for (Connection* c : w->members) {
      if (c->ep->failed() && !c->drop_scheduled.exchange(true)) {
        Spawn([this, id = c->id] {
          if (std::shared_ptr<Connection> conn = Find(id)) Drop(conn, std::string(conn->ep->failure().message()));
        });
      }
    }
  }

  // Delivers what arrived in `inbox` (within reason) and keeps its receive posted; once
  // `closing`, cancels it instead. True once the receive is cancelled and freed for good.
  template <typename DeliverFn>
  bool DrainInbox(ucx::Worker& worker, Inbox& inbox, bool closing, const DeliverFn& deliver) {
    if (inbox.freed.load()) return true;
    if (closing && inbox.request != nullptr && !inbox.cancelled) {
      ucp_request_cancel(worker.worker(), inbox.request);
      inbox.cancelled = true;
    }
    for (int round = 0; round < 16; ++round) {
      if (inbox.request != nullptr) {
        if (!inbox.done.load(std::memory_order_acquire)) return false;
        ucp_request_free(inbox.request);
        inbox.request = nullptr;
        if (inbox.status == UCS_OK) {
          deliver(inbox);
        } else if (inbox.status != UCS_ERR_CANCELED) {
          Log(LogLevel::kWarning, kComponent,
              absl::StrCat("dropped an incoming message: ", ucs_status_string(inbox.status)));
        }
      }
      if (closing) {
        inbox.freed.store(true);
        return true;
      }
      if (!Post(worker, inbox)) return false;
    }
    return false;
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

  // Posts the inbox's receive on `worker` (it completes through OnInbox; false: not posted).
  bool Post(ucx::Worker& worker, Inbox& inbox) {
    inbox.done.store(false);
    // Always through the callback (UCX 1.13 leaves recv_info unset for some immediate
    // completions: the sender's tag would be lost).
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = &Server::OnInbox;
    param.user_data = &inbox;
    ucs_status_ptr_t r = ucp_tag_recv_nbx(worker.worker(), inbox.buffer.data(), inbox.buffer.size(),
                                          ucx::KindTag(inbox.kind), ucx::kKindMask, &param);
    if (UCS_PTR_IS_ERR(r) || r == nullptr) {
      Log(LogLevel::kError, kComponent,
          absl::StrCat("cannot post a receive: ", ucs_status_string(r == nullptr ? UCS_ERR_IO_ERROR : UCS_PTR_STATUS(r))));
      return false;
    }
    inbox.request = r;
    return true;
  }

  // A serving worker, on the listening worker's UCP context. Two hellos at once made two
  // workers on that context at once, and UCX 1.13 then failed one of them ("ucp_worker_create:
  // No such device", seen in CI's torch cluster test): creation is serialized, and a worker that
  // still cannot be made on the shared context gets a context of its own.
  absl::StatusOr<std::shared_ptr<ServingWorker>> NewServingWorker(bool dedicated) {
    auto serving = std::make_shared<ServingWorker>(dedicated);
    ServingWorker* raw = serving.get();
    ucx::Worker::Options wo;
    wo.name = dedicated ? "mainstayd-connection" : "mainstayd-shared";
    wo.share_context_of = worker_.get();
    wo.after_progress = [this, raw] { PollServing(raw); };
    absl::MutexLock lock(&create_mu_);
    absl::StatusOr<std::unique_ptr<ucx::Worker>> w = ucx::Worker::Create(wo);
    if (!w.ok()) {
      Log(LogLevel::kWarning, kComponent,
          absl::StrCat("a serving UCX worker on the shared context: ", w.status().message(),
                       "; trying a context of its own"));
      wo.share_context_of = nullptr;
      w = ucx::Worker::Create(std::move(wo));
    }
    if (!w.ok()) return w.status();
    serving->worker = *std::move(w);
    serving->ready.store(true);  // its progress thread posts the request inbox now
    return serving;
  }

  // The worker to serve a new connection from `peer`: a fresh one when it gets its own
  // (Options.dedicated_workers), else the pool's least loaded, the pool growing up to
  // Options.shared_workers.
  absl::StatusOr<std::shared_ptr<ServingWorker>> ServingWorkerFor(const ucx::ProcessIdentity& peer) {
    const ucx::ProcessIdentity& self = ucx::ProcessIdentity::Self();
    const bool same_host = !self.boot_id.empty() && self.boot_id == peer.boot_id;
    const bool dedicated = options_.dedicated_workers == DedicatedWorkers::kAll ||
                           (options_.dedicated_workers == DedicatedWorkers::kLocal && same_host);
    if (dedicated) return NewServingWorker(true);
    absl::MutexLock lock(&pool_mu_);
    std::shared_ptr<ServingWorker> least;
    size_t least_load = 0;
    for (const std::shared_ptr<ServingWorker>& w : pool_) {
      absl::MutexLock members(&w->members_mu);
      if (least == nullptr || w->members.size() < least_load) {
        least = w;
        least_load = w->members.size();
      }
    }
    if (least != nullptr && (least_load == 0 || static_cast<int>(pool_.size()) >= options_.shared_workers)) {
      return least;
    }
    absl::StatusOr<std::shared_ptr<ServingWorker>> fresh = NewServingWorker(false);
    if (!fresh.ok()) {
      if (least != nullptr) return least;
      return fresh.status();
    }
    pool_.push_back(*fresh);
    return fresh;
  }

  std::shared_ptr<Connection> Find(uint32_t id) {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(id);
    return it == connections_.end() ? nullptr : it->second;
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
    std::shared_ptr<Connection> removed;  // released outside the lock (~Connection waits for its worker)
    {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(c->id);
      if (it != connections_.end() && it->second == c) {
        removed = std::move(it->second);
        connections_.erase(it);
      }
    }
    options_.daemon->connections()->Close(c->job_id, c->rank, v1::TRANSPORT_UCX, c->node);
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("connection ", c->id, " (job ", c->job_id, " rank ", c->rank, " on ", c->node, ") closed: ", why));
  }

  absl::Status Abort(const Connection& c) {
    if (c.ep->failed()) return c.ep->failure();
    return Stopping();
  }

  void OnHello(const v1::UcxHello& hello) {
    const ucx::ProcessIdentity peer{hello.process().boot_id(), hello.process().pid_namespace(), hello.process().pid()};
    absl::StatusOr<std::shared_ptr<ServingWorker>> serving = ServingWorkerFor(peer);
    if (!serving.ok()) {
      return RefuseHello(hello, absl::UnavailableError(
                                    absl::StrCat("the daemon cannot start a UCX worker: ", serving.status().message())));
    }
    auto c = std::make_shared<Connection>();
    c->job_id = hello.job_id();
    c->rank = hello.rank();
    c->node = hello.node_name();
    ServingWorker* w = serving->get();
    absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep =
        w->worker->Connect(hello.worker_address(), [w](const absl::Status&) { w->worker->Signal(); });
    if (!ep.ok()) {
      return RefuseHello(hello, absl::UnavailableError(absl::StrCat("the daemon cannot connect back to this trainer: ",
                                                                    ep.status().message())));
    }
    c->serving = *std::move(serving);
    c->ep = *std::move(ep);
    const ucx::ProcessIdentity& self = ucx::ProcessIdentity::Self();
    if (!c->ep->detects_peer_failure()) {
      // UCX cannot report this trainer's failure (shared memory): watch its process, or else
      // rely on each request's timeout.
      if (self.SameProcessSpace(peer)) {
        c->ep->WatchProcess(peer.pid);
      } else {
        Log(LogLevel::kWarning, kComponent,
            absl::StrCat("connection from job ", c->job_id, " rank ", c->rank,
                         ": UCX cannot detect this peer's failure over the transports in common and its process is not "
                         "visible here; a dead trainer is noticed at its request's timeout"));
      }
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;  // ~Connection closes the endpoint
      do {
        next_id_ = (next_id_ + 1) & 0xffffffu;
      } while (next_id_ == 0 || connections_.count(next_id_) > 0);
      c->id = next_id_;
      connections_[c->id] = c;
    }
    {
      absl::MutexLock lock(&w->members_mu);
      w->members.push_back(c.get());
    }
    options_.daemon->connections()->Record(c->job_id, c->rank, v1::TRANSPORT_UCX, c->node, 0, 0, /*open=*/true);
    v1::UcxHelloReply reply;
    reply.set_connection_id(c->id);
    reply.set_data_worker_address(w->worker->address());
    reply.mutable_process()->set_boot_id(self.boot_id);
    reply.mutable_process()->set_pid_namespace(self.pid_namespace);
    reply.mutable_process()->set_pid(self.pid);
    const std::string bytes = reply.SerializeAsString();
    ucx::OpGroup group(c->worker());
    group.Send(*c->ep, ucx::TrainerTag(Kind::kHelloReply, hello.nonce()), bytes.data(), bytes.size());
    if (absl::Status s = group.Wait(absl::Now() + kControlTimeout, [&] { return Abort(*c); }); !s.ok()) {
      Drop(c, absl::StrCat("hello reply: ", s.message()));
      return;
    }
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("connection ", c->id, ": job ", c->job_id, " rank ", c->rank, " from ", c->node, " (",
                     w->dedicated ? "its own worker" : "a shared worker", ")"));
  }

  // Answers a hello that cannot be served, from the listening worker, so that the trainer
  // fails (or falls back to gRPC) at once instead of at its hello timeout.
  void RefuseHello(const v1::UcxHello& hello, const absl::Status& why) {
    Log(LogLevel::kWarning, kComponent,
        absl::StrCat("refused a UCX connection from job ", hello.job_id(), " rank ", hello.rank(), " on ",
                     hello.node_name(), ": ", why.message()));
    absl::StatusOr<std::shared_ptr<ucx::Endpoint>> ep = worker_->Connect(hello.worker_address(), nullptr);
    if (!ep.ok()) return;  // the trainer's hello times out
    v1::UcxHelloReply reply;
    reply.set_code(static_cast<int32_t>(why.code()));
    reply.set_message(std::string(why.message()));
    const std::string bytes = reply.SerializeAsString();
    ucx::OpGroup group(worker_.get());
    group.Send(**ep, ucx::TrainerTag(Kind::kHelloReply, hello.nonce()), bytes.data(), bytes.size());
    group.Wait(absl::Now() + kControlTimeout, [this] { return Stopping(); }).IgnoreError();
    (*ep)->Close();  // before the group goes: ends the send if it is still pending
  }

  absl::Status Stopping() {
    absl::MutexLock lock(&mu_);
    return stopping_ ? absl::UnavailableError("the daemon is stopping") : absl::OkStatus();
  }

  // A request that arrived on serving worker `w` (compared, never dereferenced: it may be gone).
  void OnRequest(const ServingWorker* w, uint64_t tag, const std::string& message) {
    std::shared_ptr<Connection> c = Find(ucx::ConnectionOfTag(tag));
    if (c == nullptr) return;  // dropped meanwhile
    if (c->serving.get() != w) {
      // Its payload would arrive at another worker than the one its receives are posted on.
      Log(LogLevel::kWarning, kComponent,
          absl::StrCat("ignored a request naming connection ", c->id, ", which another worker serves (protocol violation)"));
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
    ucx::OpGroup group(c->worker());
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
    const bool trailer = h.crc32c_follows() && !push.duplicate();  // a duplicate gets no payload, no trailer
    {
      // Declared before the group: its receive may still be posted until the group goes.
      std::string trailer_bytes(trailer ? kTrailerBytes : 0, '\0');
      ucx::OpGroup group(c->worker());
      // The chunks' receives go first: the payload never waits as an unexpected message.
      const std::span<uint8_t> dest = push.destination();
      const int64_t chunk = ucx::PushChunkBytes(request.chunk_bytes(), push.element_bytes());
      for (int64_t off = 0; off < static_cast<int64_t>(dest.size()); off += chunk) {
        const size_t n = static_cast<size_t>(std::min<int64_t>(chunk, static_cast<int64_t>(dest.size()) - off));
        group.Recv(ucx::DaemonTag(Kind::kPushData, c->id, static_cast<uint32_t>(seq)), ucx::kExactMask,
                   dest.data() + off, n);
        expected.push_back(n);
      }
      if (trailer) {
        group.Recv(ucx::DaemonTag(Kind::kPushTrailer, c->id, static_cast<uint32_t>(seq)), ucx::kExactMask,
                   trailer_bytes.data(), trailer_bytes.size());
      }
      total = static_cast<int64_t>(dest.size());
      group.Send(*c->ep, ucx::TrainerTag(Kind::kAccept, seq), accept_bytes.data(), accept_bytes.size());
      const auto abort = [&] { return Abort(*c); };
      // Chunk by chunk, in order: each is counted (and folded into the CRC) while later ones are
      // still in flight. A chunk of the wrong size ends that; the rest is still received.
      absl::Status bad_chunk;
      absl::Status s;
      for (size_t i = 0; i < expected.size() && s.ok() && bad_chunk.ok(); ++i) {
        s = group.WaitRecv(i, deadline, abort);
        if (!s.ok()) break;
        if (group.received_bytes(i) != expected[i]) {
          bad_chunk = absl::InvalidArgumentError(absl::StrCat("PushGrad: chunk ", i, " has ", group.received_bytes(i),
                                                              " bytes, expected ", expected[i], " (chunk_bytes ",
                                                              request.chunk_bytes(), "); nothing was stored"));
        } else {
          push.Landed(static_cast<int64_t>(expected[i]));
        }
      }
      if (s.ok()) s = group.Wait(deadline, abort);
      if (!s.ok()) {
        // The trainer died, went silent past its timeout, or the daemon is stopping: the session
        // goes with this scope, nothing of the push is stored.
        Drop(c, absl::StrCat("push of job ", h.job_id(), " bucket ", h.bucket(), " shard ", h.shard(), " step ", h.step(),
                             " abandoned (", s.message(), "); nothing was stored"));
        return;
      }
      if (!bad_chunk.ok()) return Answer(c, Kind::kReply, seq, ErrorReply(bad_chunk));
      if (trailer) {
        v1::PushGradTrailer t;
        if (!t.ParseFromArray(trailer_bytes.data(), static_cast<int>(group.received_bytes(expected.size())))) {
          return Answer(c, Kind::kReply, seq,
                        ErrorReply(absl::InvalidArgumentError("PushGrad: an unparseable CRC trailer; nothing was stored")));
        }
        push.SetTrailingCrc32c(t.crc32c());
      }
    }
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
    ucx::OpGroup group(c->worker());
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
  Inbox hello_{Kind::kHello};  // the listening worker's
  std::atomic<bool> ready_{false};

  absl::Mutex create_mu_;  // NewServingWorker
  absl::Mutex pool_mu_;    // ServingWorkerFor
  std::vector<std::shared_ptr<ServingWorker>> pool_ ABSL_GUARDED_BY(pool_mu_);  // the shared workers
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool hello_freed_ ABSL_GUARDED_BY(mu_) = false;  // Shutdown waits for it
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint32_t, std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> refusals_{0};  // refusal threads running (Admit)
  int64_t dropped_hellos_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_drop_log_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxDataServer>> UcxDataServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  auto server = std::make_unique<Server>(options);
  if (absl::Status s = server->Init(); !s.ok()) return s;
  return std::unique_ptr<UcxDataServer>(std::move(server));
}

}  // namespace mainstay::daemon

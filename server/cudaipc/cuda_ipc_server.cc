#include "server/cudaipc/cuda_ipc_server.h"

#include <map>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/process_identity.h"
#include "common/status.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {
namespace {

constexpr char kComponent[] = "cuda-ipc";
constexpr char kTransport[] = "cuda_ipc";  // the `transport` label of the byte counters

}  // namespace

struct CudaIpcServer::State {
  struct Session {
    uint64_t id = 0;
    std::string job_id;
    int32_t rank = 0;
    std::string node;
    int64_t pid = 0;  // watched when > 0 (same pid namespace)
  };

  explicit State(Options o) : options(std::move(o)), rng(std::random_device{}()) {
    if (options.boot_id.empty()) options.boot_id = ProcessIdentity::Self().boot_id;
    if (options.pid_namespace.empty()) options.pid_namespace = ProcessIdentity::Self().pid_namespace;
    if (!options.alive) options.alive = [](int64_t pid) { return !ProcessGone(pid); };
    if (metrics::DaemonMetrics* m = options.daemon->metrics(); m != nullptr) pushed_bytes = m->PushedBytes(kTransport);
  }

  // Forgets `s` (by value: it may be the map entry erased here); Closed() finishes outside mu.
  void DropLocked(std::shared_ptr<Session> s, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (sessions.erase(s->id) == 0) return;
    auto it = by_rank.find({s->job_id, s->rank});
    if (it != by_rank.end() && it->second == s->id) by_rank.erase(it);
    dropped.push_back({s, why});
  }

  // After DropLocked, outside mu: the connection records and the log.
  void Closed() {
    std::vector<std::pair<std::shared_ptr<Session>, std::string>> gone;
    {
      absl::MutexLock lock(&mu);
      gone.swap(dropped);
    }
    for (const auto& [s, why] : gone) {
      options.daemon->connections()->Close(s->job_id, s->rank, v1::TRANSPORT_CUDA_IPC, s->node);
      Log(LogLevel::kInfo, kComponent,
          absl::StrCat("session ", absl::Hex(s->id), " (job ", s->job_id, " rank ", s->rank, " on ", s->node,
                       ") closed: ", why));
    }
  }

  Options options;
  std::shared_ptr<metrics::Counter> pushed_bytes;  // null: no metrics
  mutable absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  int running ABSL_GUARDED_BY(mu) = 0;  // pushes in progress
  int open_mappings ABSL_GUARDED_BY(mu) = 0;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
  std::map<uint64_t, std::shared_ptr<Session>> sessions ABSL_GUARDED_BY(mu);
  std::map<std::pair<std::string, int32_t>, uint64_t> by_rank ABSL_GUARDED_BY(mu);
  std::vector<std::pair<std::shared_ptr<Session>, std::string>> dropped ABSL_GUARDED_BY(mu);
};

absl::StatusOr<std::unique_ptr<CudaIpcServer>> CudaIpcServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  if (options.memory == nullptr) return absl::InvalidArgumentError("memory: required");
  if (options.max_sessions < 1) return absl::InvalidArgumentError("max_sessions: must be >= 1");
  return std::unique_ptr<CudaIpcServer>(new CudaIpcServer(std::make_shared<State>(std::move(options))));
}

CudaIpcServer::~CudaIpcServer() { Shutdown(); }

std::string CudaIpcServer::Describe() const {
  return absl::StrCat("CUDA IPC on ", state_->options.device_name.empty()
                                          ? absl::StrCat("cuda:", state_->options.memory->device())
                                          : state_->options.device_name);
}

int CudaIpcServer::sessions() const {
  absl::MutexLock lock(&state_->mu);
  return static_cast<int>(state_->sessions.size());
}

int CudaIpcServer::mappings() const {
  absl::MutexLock lock(&state_->mu);
  return state_->open_mappings;
}

absl::StatusOr<v1::AttachCudaIpcResponse> CudaIpcServer::Attach(const v1::AttachCudaIpcRequest& request) {
  State& st = *state_;
  if (request.job_id().empty()) return absl::InvalidArgumentError("AttachCudaIpc: job_id is required");
  // The job's own token (a reader's is refused): a session pushes, and replaces the rank's older one.
  MAINSTAY_RETURN_IF_ERROR(st.options.daemon->CheckJobToken(request.job_id(), request.job_token(), /*writer=*/true));
  if (request.boot_id().empty() || request.boot_id() != st.options.boot_id) {
    return absl::FailedPreconditionError(
        "AttachCudaIpc: the trainer is on another node than this daemon (their boot ids differ): cuda_ipc reaches "
        "trainers on the daemon's own node only; use nccl, ucx or grpc");
  }
  const ProcessIdentity self{st.options.boot_id, st.options.pid_namespace, 0};
  const bool watch = self.SameProcessSpace({request.boot_id(), request.pid_namespace(), request.pid()});
  auto session = std::make_shared<State::Session>();
  session->job_id = request.job_id();
  session->rank = request.rank();
  session->node = request.node_name();
  session->pid = watch ? request.pid() : 0;
  absl::Status full;
  {
    absl::MutexLock lock(&st.mu);
    if (st.stopping) return absl::UnavailableError("the daemon is stopping");
    // Sessions of trainers that exited without detaching go first.
    std::vector<std::shared_ptr<State::Session>> dead;
    for (const auto& [id, s] : st.sessions) {
      if (s->pid > 0 && !st.options.alive(s->pid)) dead.push_back(s);
    }
    for (const auto& s : dead) st.DropLocked(s, absl::StrCat("its trainer process ", s->pid, " is gone"));
    if (auto old = st.by_rank.find({session->job_id, session->rank}); old != st.by_rank.end()) {
      st.DropLocked(st.sessions.at(old->second), "replaced by a new session of the same job and rank");
    }
    if (static_cast<int>(st.sessions.size()) >= st.options.max_sessions) {
      full = absl::ResourceExhaustedError(
          absl::StrCat("this daemon has ", st.sessions.size(), " cuda_ipc sessions open, its maximum"));
    } else {
      do {
        session->id = st.rng();
      } while (session->id == 0 || st.sessions.count(session->id) > 0);
      st.sessions[session->id] = session;
      st.by_rank[{session->job_id, session->rank}] = session->id;
    }
  }
  st.Closed();
  MAINSTAY_RETURN_IF_ERROR(full);
  st.options.daemon->connections()->Record(session->job_id, session->rank, v1::TRANSPORT_CUDA_IPC, session->node, 0, 0,
                                           /*open=*/true);
  Log(LogLevel::kInfo, kComponent,
      absl::StrCat("session ", absl::Hex(session->id), ": job ", session->job_id, " rank ", session->rank, " from ",
                   session->node, watch ? absl::StrCat(" (pid ", session->pid, ")") : " (pid not visible here)"));
  v1::AttachCudaIpcResponse response;
  response.set_session_id(session->id);
  response.set_device(st.options.memory->device());
  response.set_device_name(st.options.device_name);
  return response;
}

absl::StatusOr<v1::PushGradResponse> CudaIpcServer::Push(const v1::CudaIpcPushRequest& request) {
  State& st = *state_;
  const v1::PushGradHeader& h = request.header();
  const v1::CudaIpcRegion& region = request.memory();
  std::shared_ptr<State::Session> s;
  {
    absl::MutexLock lock(&st.mu);
    if (st.stopping) return absl::UnavailableError("the daemon is stopping");
    auto it = st.sessions.find(request.session_id());
    if (it == st.sessions.end()) {
      return absl::UnavailableError(absl::StrCat(kUnknownCudaIpcSession, " ", absl::Hex(request.session_id()),
                                                 " (detached, replaced, or the daemon restarted): attach again"));
    }
    s = it->second;
    if (s->job_id != h.job_id() || s->rank != h.rank()) {
      return absl::PermissionDeniedError(absl::StrCat("cuda_ipc session ", absl::Hex(s->id), " is job ", s->job_id,
                                                      " rank ", s->rank, "'s, not job ", h.job_id(), " rank ", h.rank(),
                                                      "'s"));
    }
    ++st.running;
  }
  absl::Cleanup done = [&st] {
    absl::MutexLock lock(&st.mu);
    --st.running;
  };
  if (region.handle().size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("CudaIpcPush: memory.handle has ", region.handle().size(),
                                                   " bytes; a CUDA IPC memory handle has ", kCudaIpcHandleBytes));
  }
  absl::StatusOr<std::unique_ptr<PushSession>> session = st.options.daemon->BeginPush(h);
  if (session.ok() && st.options.drain != nullptr) {
    if (absl::Status admitted = st.options.drain->AdmitPush(h.job_id(), h.step()); !admitted.ok()) session = admitted;
  }
  if (!session.ok()) return session.status();
  PushSession& push = **session;
  const std::span<uint8_t> dest = push.destination();  // empty for a duplicate: nothing to copy
  if (!dest.empty()) {
    // Mapped for this copy only: CUDA leaves it undefined what happens to a mapping whose
    // allocation its owner frees, and the trainer may free the buffer once the push's step
    // finished (the buffer contract), so no mapping outlives its push.
    absl::StatusOr<IpcMemory::Mapping> mapping = st.options.memory->Open(region.handle());
    if (!mapping.ok()) return Annotate(mapping.status(), "CudaIpcPush: opening the trainer's memory handle");
    {
      absl::MutexLock lock(&st.mu);
      ++st.open_mappings;
    }
    absl::Cleanup close = [&st, &mapping] {
      st.options.memory->Close(*mapping);
      absl::MutexLock lock(&st.mu);
      --st.open_mappings;
    };
    const uint64_t bytes = dest.size();
    if (region.offset() > mapping->bytes || bytes > mapping->bytes - region.offset()) {
      return absl::InvalidArgumentError(absl::StrCat("CudaIpcPush: ", bytes, " bytes at offset ", region.offset(),
                                                     " are outside the exported allocation of ", mapping->bytes,
                                                     " bytes; nothing was stored"));
    }
    MAINSTAY_RETURN_IF_ERROR(st.options.memory->CopyToHost(*mapping, region.offset(), dest.data(), bytes));
    push.Landed(static_cast<int64_t>(bytes));
  }
  MAINSTAY_ASSIGN_OR_RETURN(v1::PushGradResponse stored, push.Finish());
  const int64_t total = static_cast<int64_t>(dest.size());
  if (st.pushed_bytes != nullptr) st.pushed_bytes->Increment(static_cast<double>(total));
  st.options.daemon->connections()->Record(s->job_id, s->rank, v1::TRANSPORT_CUDA_IPC, s->node, total, 0);
  return stored;
}

absl::Status CudaIpcServer::Detach(const v1::DetachCudaIpcRequest& request) {
  State& st = *state_;
  std::shared_ptr<State::Session> s;
  {
    absl::MutexLock lock(&st.mu);
    auto it = st.sessions.find(request.session_id());
    if (it == st.sessions.end()) return absl::OkStatus();
    s = it->second;
  }
  if (s->job_id != request.job_id()) {
    return absl::PermissionDeniedError(absl::StrCat("DetachCudaIpc: session ", absl::Hex(request.session_id()),
                                                    " is not job ", request.job_id(), "'s"));
  }
  // A job that left this daemon cannot check its token any more; the random session id is then
  // the only credential.
  if (absl::Status t = st.options.daemon->CheckJobToken(request.job_id(), request.job_token());
      !t.ok() && t.code() != absl::StatusCode::kUnavailable) {
    return t;
  }
  {
    absl::MutexLock lock(&st.mu);
    st.DropLocked(s, "detached by the trainer");
  }
  st.Closed();
  return absl::OkStatus();
}

void CudaIpcServer::Shutdown() {
  State& st = *state_;
  {
    absl::MutexLock lock(&st.mu);
    if (st.stopping) return;
    st.stopping = true;
    std::vector<std::shared_ptr<State::Session>> all;
    for (const auto& [id, s] : st.sessions) all.push_back(s);
    for (const auto& s : all) st.DropLocked(s, "the daemon is stopping");
    auto idle = [&st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.running == 0; };
    st.mu.Await(absl::Condition(&idle));
  }
  st.Closed();
}

}  // namespace mainstay::daemon

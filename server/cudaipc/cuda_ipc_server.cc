#include "server/cudaipc/cuda_ipc_server.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <list>
#include <map>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {
namespace {

constexpr char kComponent[] = "cuda-ipc";
constexpr char kTransport[] = "cuda_ipc";  // the `transport` label of the byte counters

std::string ReadBootId() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, id);
  return id;
}

std::string ReadPidNamespace() {
  char link[256] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
}

bool ProcessAlive(int64_t pid) { return kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

}  // namespace

struct CudaIpcServer::State {
  struct Session {
    uint64_t id = 0;
    std::string job_id;
    int32_t rank = 0;
    std::string node;
    int64_t pid = 0;       // watched when > 0 (same pid namespace)
    bool dropped = false;  // guarded by State::mu
    // Mapped allocations by handle, most recently used first (guarded by State::mu). A push in
    // flight holds its mapping: it is closed when the last holder lets go.
    std::list<std::pair<std::string, std::shared_ptr<const IpcMemory::Mapping>>> mappings;
  };

  explicit State(Options o) : options(std::move(o)), rng(std::random_device{}()) {
    if (options.boot_id.empty()) options.boot_id = ReadBootId();
    if (options.pid_namespace.empty()) options.pid_namespace = ReadPidNamespace();
    if (!options.alive) options.alive = ProcessAlive;
    if (metrics::DaemonMetrics* m = options.daemon->metrics(); m != nullptr) pushed_bytes = m->PushedBytes(kTransport);
  }

  // A mapping that closes itself once its last holder lets go (which must not hold mu).
  std::shared_ptr<const IpcMemory::Mapping> Hold(const IpcMemory::Mapping& m) {
    IpcMemory* memory = options.memory;
    std::weak_ptr<State> weak = weak_self;
    auto close = [memory, weak](const IpcMemory::Mapping* p) { Close(memory, weak, p); };
    return std::shared_ptr<const IpcMemory::Mapping>(new IpcMemory::Mapping(m), close);
  }
  static void Close(IpcMemory* memory, const std::weak_ptr<State>& weak, const IpcMemory::Mapping* p) {
    memory->Close(*p);
    if (std::shared_ptr<State> self = weak.lock(); self != nullptr) {
      absl::MutexLock lock(&self->mu);
      --self->open_mappings;
    }
    delete p;
  }

  // Forgets `s` (its mappings close as their holders let go). Caller holds mu.
  // `s` by value: it may be the map entry that is erased here.
  std::vector<std::shared_ptr<const IpcMemory::Mapping>> DropLocked(std::shared_ptr<Session> s, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<std::shared_ptr<const IpcMemory::Mapping>> released;
    if (s->dropped) return released;
    s->dropped = true;
    sessions.erase(s->id);
    auto it = by_rank.find({s->job_id, s->rank});
    if (it != by_rank.end() && it->second == s->id) by_rank.erase(it);
    for (auto& [handle, m] : s->mappings) released.push_back(std::move(m));
    s->mappings.clear();
    dropped_log.push_back(absl::StrCat("session ", absl::Hex(s->id), " (job ", s->job_id, " rank ", s->rank, " on ",
                                       s->node, ") closed: ", why));
    dropped_sessions.push_back(s);
    return released;
  }

  // After DropLocked, outside mu: log and close the connection records.
  void AfterDrops() {
    std::vector<std::string> lines;
    std::vector<std::shared_ptr<Session>> gone;
    {
      absl::MutexLock lock(&mu);
      lines.swap(dropped_log);
      gone.swap(dropped_sessions);
    }
    for (const auto& s : gone) {
      options.daemon->connections()->Close(s->job_id, s->rank, v1::TRANSPORT_CUDA_IPC, s->node);
    }
    for (const std::string& line : lines) Log(LogLevel::kInfo, kComponent, line);
  }

  Options options;
  std::weak_ptr<State> weak_self;
  std::shared_ptr<metrics::Counter> pushed_bytes;  // null: no metrics
  mutable absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  int running ABSL_GUARDED_BY(mu) = 0;  // pushes in progress
  int open_mappings ABSL_GUARDED_BY(mu) = 0;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
  std::map<uint64_t, std::shared_ptr<Session>> sessions ABSL_GUARDED_BY(mu);
  std::map<std::pair<std::string, int32_t>, uint64_t> by_rank ABSL_GUARDED_BY(mu);
  std::vector<std::string> dropped_log ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Session>> dropped_sessions ABSL_GUARDED_BY(mu);
};

absl::StatusOr<std::unique_ptr<CudaIpcServer>> CudaIpcServer::Start(Options options) {
  if (options.daemon == nullptr) return absl::InvalidArgumentError("daemon: required");
  if (options.memory == nullptr) return absl::InvalidArgumentError("memory: required");
  if (options.max_sessions < 1) return absl::InvalidArgumentError("max_sessions: must be >= 1");
  if (options.max_mappings < 1) return absl::InvalidArgumentError("max_mappings: must be >= 1");
  auto state = std::make_shared<State>(std::move(options));
  state->weak_self = state;
  return std::unique_ptr<CudaIpcServer>(new CudaIpcServer(std::move(state)));
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
  if (request.boot_id().empty() || request.boot_id() != st.options.boot_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("AttachCudaIpc: the trainer is on another node than this daemon (its boot id '", request.boot_id(),
                     "', this host's '", st.options.boot_id,
                     "'): cuda_ipc reaches trainers on the daemon's own node only; "
                     "use nccl, ucx or grpc"));
  }
  MAINSTAY_RETURN_IF_ERROR(st.options.daemon->CheckJobToken(request.job_id(), request.job_token()));
  const bool watch =
      request.pid() > 0 && !st.options.pid_namespace.empty() && request.pid_namespace() == st.options.pid_namespace;
  std::vector<std::shared_ptr<const IpcMemory::Mapping>> released;  // closed outside the lock
  absl::Status full;
  std::shared_ptr<State::Session> session = std::make_shared<State::Session>();
  session->job_id = request.job_id();
  session->rank = request.rank();
  session->node = request.node_name();
  session->pid = watch ? request.pid() : 0;
  {
    absl::MutexLock lock(&st.mu);
    if (st.stopping) return absl::UnavailableError("the daemon is stopping");
    // Sessions of trainers that exited (without detaching) go first: their mappings keep the
    // dead process's device memory allocated.
    std::vector<std::shared_ptr<State::Session>> dead;
    for (const auto& [id, s] : st.sessions) {
      if (s->pid > 0 && !st.options.alive(s->pid)) dead.push_back(s);
    }
    for (const auto& s : dead) {
      auto r = st.DropLocked(s, absl::StrCat("its trainer process ", s->pid, " is gone"));
      released.insert(released.end(), r.begin(), r.end());
    }
    auto old = st.by_rank.find({session->job_id, session->rank});
    if (old != st.by_rank.end()) {
      auto r = st.DropLocked(st.sessions.at(old->second), "replaced by a new session of the same job and rank");
      released.insert(released.end(), r.begin(), r.end());
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
  released.clear();  // closes the mappings nothing else holds, outside the lock
  st.AfterDrops();
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
      return absl::UnavailableError(absl::StrCat("cuda_ipc session ", absl::Hex(request.session_id()),
                                                 " is not open on this daemon (detached, replaced, or the daemon "
                                                 "restarted): attach again"));
    }
    s = it->second;
    if (s->job_id != h.job_id()) {
      return absl::PermissionDeniedError(
          absl::StrCat("cuda_ipc session ", absl::Hex(s->id), " belongs to job ", s->job_id, ", not ", h.job_id()));
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
    // The session's mapping of this allocation, or a new one (opened outside the lock: it can
    // take milliseconds).
    std::shared_ptr<const IpcMemory::Mapping> mapping;
    {
      absl::MutexLock lock(&st.mu);
      for (auto it = s->mappings.begin(); it != s->mappings.end(); ++it) {
        if (it->first == region.handle()) {
          mapping = it->second;
          s->mappings.splice(s->mappings.begin(), s->mappings, it);
          break;
        }
      }
    }
    if (mapping == nullptr) {
      absl::StatusOr<IpcMemory::Mapping> opened = st.options.memory->Open(region.handle());
      if (!opened.ok()) return Annotate(opened.status(), "CudaIpcPush: opening the trainer's memory handle");
      {
        absl::MutexLock lock(&st.mu);
        ++st.open_mappings;
      }
      mapping = st.Hold(*opened);
      std::vector<std::shared_ptr<const IpcMemory::Mapping>> evicted;
      absl::MutexLock lock(&st.mu);
      if (!s->dropped) {
        s->mappings.emplace_front(region.handle(), mapping);
        while (static_cast<int>(s->mappings.size()) > st.options.max_mappings) {
          evicted.push_back(std::move(s->mappings.back().second));
          s->mappings.pop_back();
        }
      }
    }
    const uint64_t bytes = dest.size();
    if (region.offset() > mapping->bytes || bytes > mapping->bytes - region.offset()) {
      return absl::InvalidArgumentError(absl::StrCat("CudaIpcPush: bytes [", region.offset(), ", ",
                                                     region.offset() + bytes,
                                                     ") are outside the exported allocation "
                                                     "of ",
                                                     mapping->bytes, " bytes; nothing was stored"));
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
    std::vector<std::shared_ptr<const IpcMemory::Mapping>> released;
    absl::MutexLock lock(&st.mu);
    released = st.DropLocked(s, "detached by the trainer");
  }
  st.AfterDrops();
  return absl::OkStatus();
}

void CudaIpcServer::Shutdown() {
  State& st = *state_;
  {
    std::vector<std::shared_ptr<const IpcMemory::Mapping>> released;
    absl::MutexLock lock(&st.mu);
    if (st.stopping) return;
    st.stopping = true;
    std::vector<std::shared_ptr<State::Session>> all;
    for (const auto& [id, s] : st.sessions) all.push_back(s);
    for (const auto& s : all) {
      auto r = st.DropLocked(s, "the daemon is stopping");
      released.insert(released.end(), r.begin(), r.end());
    }
    auto idle = [&st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.running == 0; };
    st.mu.Await(absl::Condition(&idle));
  }
  st.AfterDrops();
}

}  // namespace mainstay::daemon

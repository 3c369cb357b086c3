#include "server/cudaipc/cuda_ipc_server.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
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
// How long a pull waits for its version between looks at its cancellation and at a stop.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);

absl::Status CheckHandle(const v1::CudaIpcRegion& region, const char* what) {
  if (region.handle().size() == kCudaIpcHandleBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": memory.handle has ", region.handle().size(),
                                                 " bytes; a CUDA IPC memory handle has ", kCudaIpcHandleBytes));
}

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
    if (metrics::DaemonMetrics* m = options.daemon->metrics(); m != nullptr) {
      pushed_bytes = m->PushedBytes(kTransport);
      pulled_bytes = m->PulledBytes(kTransport);
    }
  }

  // The session `id` for a call of (job, rank), counted as running (Leave when done).
  absl::StatusOr<std::shared_ptr<Session>> Enter(uint64_t id, const std::string& job_id, int32_t rank) {
    absl::MutexLock lock(&mu);
    if (stopping) return absl::UnavailableError("the daemon is stopping");
    auto it = sessions.find(id);
    if (it == sessions.end()) {
      return absl::UnavailableError(absl::StrCat(kUnknownCudaIpcSession, " ", absl::Hex(id),
                                                 " (detached, replaced, or the daemon restarted): attach again"));
    }
    const std::shared_ptr<Session>& s = it->second;
    if (s->job_id != job_id || s->rank != rank) {
      return absl::PermissionDeniedError(absl::StrCat("cuda_ipc session ", absl::Hex(s->id), " is job ", s->job_id,
                                                      " rank ", s->rank, "'s, not job ", job_id, " rank ", rank, "'s"));
    }
    ++running;
    return s;
  }
  void Leave() {
    absl::MutexLock lock(&mu);
    --running;
  }

  // Maps `region` for one copy of `bytes` bytes at its offset, runs `copy` on it, and unmaps it.
  // `what` names the call in errors.
  absl::Status WithMapping(const v1::CudaIpcRegion& region, uint64_t bytes, const char* what,
                           const std::function<absl::Status(const IpcMemory::Mapping&)>& copy) {
    absl::StatusOr<IpcMemory::Mapping> mapping = options.memory->Open(region.handle());
    if (!mapping.ok()) return Annotate(mapping.status(), absl::StrCat(what, ": opening the trainer's memory handle"));
    {
      absl::MutexLock lock(&mu);
      ++open_mappings;
    }
    absl::Cleanup close = [this, &mapping] {
      options.memory->Close(*mapping);
      absl::MutexLock lock(&mu);
      --open_mappings;
    };
    if (region.offset() > mapping->bytes || bytes > mapping->bytes - region.offset()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes at offset ", region.offset(),
                                                     " are outside the exported allocation of ", mapping->bytes,
                                                     " bytes"));
    }
    return copy(*mapping);
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
  std::shared_ptr<metrics::Counter> pushed_bytes, pulled_bytes;  // null: no metrics
  mutable absl::Mutex mu;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  int running ABSL_GUARDED_BY(mu) = 0;  // pushes and pulls in progress
  // Pulls writing into trainers' memory now, by session id (ended sessions included): Detach
  // waits for a session's to end.
  std::map<uint64_t, int> writing ABSL_GUARDED_BY(mu);
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
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<State::Session> s, st.Enter(request.session_id(), h.job_id(), h.rank()));
  absl::Cleanup done = [&st] { st.Leave(); };
  MAINSTAY_RETURN_IF_ERROR(CheckHandle(request.memory(), "CudaIpcPush"));
  if (h.crc32c_follows()) {  // refused before anything moves, not after the copy
    return absl::InvalidArgumentError(
        "CudaIpcPush: crc32c_follows, but a cuda_ipc push has no trailer to carry a CRC-32C (device memory: "
        "crc32c 0, or the CRC in the header)");
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
    MAINSTAY_RETURN_IF_ERROR(
        st.WithMapping(request.memory(), dest.size(), "CudaIpcPush", [&](const IpcMemory::Mapping& m) {
          return st.options.memory->CopyToHost(m, request.memory().offset(), dest.data(), dest.size());
        }));
    push.Landed(static_cast<int64_t>(dest.size()));
  }
  MAINSTAY_ASSIGN_OR_RETURN(v1::PushGradResponse stored, push.Finish());
  const int64_t total = static_cast<int64_t>(dest.size());
  if (st.pushed_bytes != nullptr) st.pushed_bytes->Increment(static_cast<double>(total));
  st.options.daemon->connections()->Record(s->job_id, s->rank, v1::TRANSPORT_CUDA_IPC, s->node, total, 0);
  return stored;
}

absl::StatusOr<v1::CudaIpcPullResponse> CudaIpcServer::Pull(const v1::CudaIpcPullRequest& request, absl::Time deadline,
                                                            const std::function<bool()>& cancelled) {
  State& st = *state_;
  const v1::PullParamsRequest& r = request.request();
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<State::Session> s, st.Enter(request.session_id(), r.job_id(), r.rank()));
  absl::Cleanup done = [&st] { st.Leave(); };
  if (r.delta_chunk_bytes() != 0) {
    return absl::InvalidArgumentError("CudaIpcPull: delta pulls go over PullParams (delta_chunk_bytes must be 0)");
  }
  MAINSTAY_RETURN_IF_ERROR(CheckHandle(request.memory(), "CudaIpcPull"));
  // The session's own token: a reader's pulls are charged against the reader cap, over gRPC.
  MAINSTAY_RETURN_IF_ERROR(st.options.daemon->CheckJobToken(r.job_id(), r.job_token(), /*writer=*/true));
  absl::StatusOr<PullResult> result;
  while (true) {
    result = st.options.daemon->PullParams(r, std::min(deadline, absl::Now() + kWaitSlice));
    if (result.ok() || result.status().code() != absl::StatusCode::kDeadlineExceeded || absl::Now() >= deadline) {
      break;
    }
    if (cancelled && cancelled()) return absl::CancelledError("CudaIpcPull: the trainer went away");
    absl::MutexLock lock(&st.mu);
    if (st.stopping) return absl::UnavailableError("the daemon is stopping");
  }
  if (!result.ok()) return result.status();
  v1::CudaIpcPullResponse response;
  *response.mutable_header() = PullHeaderOf(*result);
  if (result->unchanged) return response;
  const QuantizedShard& shard = *result->shard;  // immutable; alive while `result` is
  if (request.bytes() != shard.data.size()) {
    return absl::InvalidArgumentError(absl::StrCat("CudaIpcPull: the destination has ", request.bytes(),
                                                   " bytes; bucket ", r.bucket(), " shard ", r.shard(),
                                                   "'s packed data has ", shard.data.size()));
  }
  // The trainer may reuse its buffer once its call ended: nothing is written after that as far as
  // this end can tell (a trainer whose call ended while the copy ran detaches, which waits for
  // the copy: Detach).
  {
    // Checked and counted in one step: a Detach of the session either ended it first (the write
    // is refused) or waits for this write.
    absl::MutexLock lock(&st.mu);
    if (st.sessions.count(s->id) == 0) {
      return absl::UnavailableError(absl::StrCat(kUnknownCudaIpcSession, " ", absl::Hex(s->id),
                                                 " (detached or replaced during the pull): attach again"));
    }
    if (cancelled && cancelled()) return absl::CancelledError("CudaIpcPull: the trainer went away");
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("CudaIpcPull: the call's deadline passed");
    ++st.writing[s->id];
  }
  absl::Cleanup written = [&st, id = s->id] {
    absl::MutexLock lock(&st.mu);
    if (--st.writing[id] == 0) st.writing.erase(id);
  };
  // Mapped for this copy only, as for a push. From where the GPU cast the version when that is
  // still there (device to device), else from the host copy.
  bool from_device = false;
  MAINSTAY_RETURN_IF_ERROR(
      st.WithMapping(request.memory(), shard.data.size(), "CudaIpcPull", [&](const IpcMemory::Mapping& m) {
        auto copy = [&](const void* src) {
          return st.options.memory->CopyIn(m, request.memory().offset(), src, shard.data.size());
        };
        if (shard.device != nullptr) {
          if (std::optional<absl::Status> copied = shard.device->Read(shard.device_cast, copy); copied.has_value()) {
            from_device = true;
            return *copied;
          }
        }
        return copy(shard.data.data());
      }));
  response.set_from_device_memory(from_device);
  response.set_scales(shard.scales.data(), shard.scales.size());
  const int64_t total = static_cast<int64_t>(shard.data.size() + shard.scales.size());
  if (st.pulled_bytes != nullptr) st.pulled_bytes->Increment(static_cast<double>(total));
  st.options.daemon->connections()->Record(s->job_id, s->rank, v1::TRANSPORT_CUDA_IPC, s->node, 0, total);
  return response;
}

absl::Status CudaIpcServer::Detach(const v1::DetachCudaIpcRequest& request, absl::Time deadline) {
  State& st = *state_;
  const uint64_t id = request.session_id();
  auto idle = [&st, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st.mu) { return st.writing.count(id) == 0; };
  const auto still_writing = [id] {
    return absl::DeadlineExceededError(absl::StrCat("DetachCudaIpc: a pull of session ", absl::Hex(id),
                                                    " is still writing into the trainer's memory"));
  };
  std::shared_ptr<State::Session> s;
  {
    absl::MutexLock lock(&st.mu);
    auto it = st.sessions.find(id);
    if (it == st.sessions.end()) {
      // Ended already (replaced, or the daemon is stopping); its pulls may still be writing.
      if (!st.mu.AwaitWithDeadline(absl::Condition(&idle), deadline)) return still_writing();
      return absl::OkStatus();
    }
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
  bool idle_in_time = true;
  {
    absl::MutexLock lock(&st.mu);
    st.DropLocked(s, "detached by the trainer");
    // The trainer may free its buffers once this answers: no pull of the session writes after
    // (a pull that has not started writing is refused now: Pull).
    idle_in_time = st.mu.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  st.Closed();
  if (!idle_in_time) return still_writing();
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

#include "server/grpc/coordinator_service.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/grpc_tls.h"
#include "common/logging.h"
#include "common/status.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "server/coordinator/admin_auth.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/state_store.h"
#include "server/grpc/calls.h"
#include "server/grpc/grpc_shard_assigner.h"
#include "server/grpc/health_port.h"
#include "server/grpc/caller_identity.h"
#include "server/grpc/rpc_metrics.h"
#include "server/metrics/coordinator_metrics.h"
#include "server/metrics/registry.h"

namespace mainstay::coordinator {
namespace {

using ::mainstay::grpc_server::CallDeadline;
using ::mainstay::grpc_server::Calls;

::grpc::Status ShuttingDown();

template <typename Response, typename Fn>
::grpc::ServerUnaryReactor* Serve(Calls* calls, ::grpc::CallbackServerContext* context, Response* response, Fn fn) {
  return ::mainstay::grpc_server::Serve(calls, context, response, ShuttingDown(), std::move(fn));
}

constexpr char kComponent[] = "coordinator-server";
// Every KvGet with wait_ms is parked under this key (WatchPlacement under its job's id).
constexpr char kKvWaitKey[] = "(the KV)";
// Running calls get this long to finish at Shutdown before gRPC cancels them.
constexpr absl::Duration kShutdownGrace = absl::Seconds(5);
// Then the server gets this long to answer the last calls (UNAVAILABLE, health checks) before
// it closes the connections.
constexpr absl::Duration kCloseGrace = absl::Milliseconds(500);

::grpc::Status ShuttingDown() { return ::grpc::Status(::grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down"); }

::grpc::ServerUnaryReactor* Unimplemented(::grpc::CallbackServerContext* context, const std::string& message) {
  ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(::grpc::Status(::grpc::StatusCode::UNIMPLEMENTED, message));
  return reactor;
}

// Answers a unary call at once with `status` (a refused admin check).
::grpc::ServerUnaryReactor* Refuse(::grpc::CallbackServerContext* context, const absl::Status& status) {
  ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// WatchPlacement: parked (server/grpc/waiters.h: no thread while it waits) until the job's
// placement passes the last epoch sent, then that placement is written; the next wait starts
// once the write is done. The stream ends at the call's deadline, when the watcher goes, at the
// server's wait limit (UNAVAILABLE: watch again) or at shutdown.
class WatchPlacementReactor final : public ::grpc::ServerWriteReactor<v1::WatchPlacementResponse> {
 public:
  WatchPlacementReactor(Coordinator* core, Calls* calls, grpc_server::Waiters* waiters,
                        ::grpc::CallbackServerContext* context, const v1::WatchPlacementRequest& request)
      : core_(core), calls_(calls), waiters_(waiters), context_(context), request_(request),
        known_epoch_(request.known_epoch()) {
    if (!calls_->Enter()) {
      Finish(ShuttingDown());
      return;
    }
    entered_ = true;
    WaitForNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(::grpc::Status(::grpc::StatusCode::CANCELLED, "the watcher went away"));
      return;
    }
    WaitForNext();
  }
  void OnDone() override {
    if (entered_) calls_->Exit();
    delete this;
  }

 private:
  void WaitForNext() {
    grpc_server::AnswerWhenReady<v1::Placement>(
        calls_, waiters_, context_, request_.job_id(), CallDeadline(context_),
        [this] {
          return core_->WaitPlacement(request_.job_id(), request_.job_token(), known_epoch_, absl::InfinitePast());
        },
        grpc_server::DeadlinePassed<v1::Placement>,
        [this](absl::StatusOr<v1::Placement> placement) {
          if (!placement.ok()) {
            Finish(ToGrpcStatus(placement.status()));
            return;
          }
          known_epoch_ = placement->epoch();
          response_.mutable_placement()->Swap(&*placement);
          StartWrite(&response_);
        },
        FromGrpcStatus(ShuttingDown()));
  }

  Coordinator* const core_;
  Calls* const calls_;
  grpc_server::Waiters* const waiters_;
  ::grpc::CallbackServerContext* const context_;
  const v1::WatchPlacementRequest request_;
  bool entered_ = false;
  // Touched by one thread at a time (each answer, then its OnWriteDone).
  int64_t known_epoch_;
  v1::WatchPlacementResponse response_;  // the write in flight
};

// KvWatch: parked like WatchPlacement until the KV changes past the last revision sent, then
// the matching changes are written one by one, oldest first; the next wait starts once they are
// all written. Ends at the call's deadline (DEADLINE_EXCEEDED), when the watcher goes, at the
// server's wait limit (UNAVAILABLE: watch again from the last revision received), with
// OUT_OF_RANGE when the history it needs is gone (a restarted coordinator keeps none), or at
// shutdown.
class KvWatchReactor final : public ::grpc::ServerWriteReactor<v1::KvWatchResponse> {
 public:
  KvWatchReactor(Coordinator* core, Calls* calls, grpc_server::Waiters* waiters,
                 ::grpc::CallbackServerContext* context, const v1::KvWatchRequest& request)
      : core_(core), calls_(calls), waiters_(waiters), context_(context), request_(request) {
    if (!calls_->Enter()) {
      Finish(ShuttingDown());
      return;
    }
    entered_ = true;
    if (request_.start_revision() < 0) {
      Finish(::grpc::Status(::grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("start_revision: must be >= 0, got ", request_.start_revision())));
      return;
    }
    after_ = request_.start_revision() > 0 ? request_.start_revision() : core_->KvRevision();
    WaitForNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(::grpc::Status(::grpc::StatusCode::CANCELLED, "the watcher went away"));
      return;
    }
    WriteNextOrWait();
  }
  void OnDone() override {
    if (entered_) calls_->Exit();
    delete this;
  }

 private:
  static constexpr size_t kMaxPerAnswer = 256;

  void WaitForNext() {
    grpc_server::AnswerWhenReady<Coordinator::KvChanges>(
        calls_, waiters_, context_, kKvWaitKey, CallDeadline(context_),
        [this] { return core_->KvChangesAfter(request_, after_, kMaxPerAnswer); },
        grpc_server::DeadlinePassed<Coordinator::KvChanges>,
        [this](absl::StatusOr<Coordinator::KvChanges> changes) {
          if (!changes.ok()) {
            Finish(ToGrpcStatus(changes.status()));
            return;
          }
          after_ = changes->revision;
          pending_.assign(std::make_move_iterator(changes->changes.begin()),
                          std::make_move_iterator(changes->changes.end()));
          WriteNextOrWait();
        },
        FromGrpcStatus(ShuttingDown()));
  }
  void WriteNextOrWait() {
    if (pending_.empty()) {
      WaitForNext();
      return;
    }
    response_ = std::move(pending_.front());
    pending_.pop_front();
    StartWrite(&response_);
  }

  Coordinator* const core_;
  Calls* const calls_;
  grpc_server::Waiters* const waiters_;
  ::grpc::CallbackServerContext* const context_;
  const v1::KvWatchRequest request_;
  bool entered_ = false;
  // Touched by one thread at a time (each answer, then its writes' OnWriteDone).
  int64_t after_ = 0;
  std::deque<v1::KvWatchResponse> pending_;
  v1::KvWatchResponse response_;  // the write in flight
};

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // Daemons' calls (membership, the KV) need an internal peer (server/grpc/peer_identity.h).
  CoordinatorService(Coordinator* core, Calls* calls, grpc_server::Waiters* waiters, const AdminAuth* auth,
                     grpc_server::InternalPeers internal, std::function<void(const std::string&)> fault_point)
      : core_(core),
        calls_(calls),
        waiters_(waiters),
        auth_(auth),
        internal_(std::move(internal)),
        fault_point_(std::move(fault_point)) {}

  ::grpc::ServerUnaryReactor* RegisterDaemon(::grpc::CallbackServerContext* context,
                                             const v1::RegisterDaemonRequest* request,
                                             v1::RegisterDaemonResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::RegisterDaemonResponse> {
      MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "RegisterDaemon"));
      return core_->RegisterDaemon(*request);
    });
  }
  ::grpc::ServerUnaryReactor* Heartbeat(::grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
                                        v1::HeartbeatResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::HeartbeatResponse> {
      MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "Heartbeat"));
      return core_->Heartbeat(*request);
    });
  }
  ::grpc::ServerUnaryReactor* DeregisterDaemon(::grpc::CallbackServerContext* context,
                                               const v1::DeregisterDaemonRequest* request,
                                               v1::DeregisterDaemonResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::Status {
      MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "DeregisterDaemon"));
      return core_->DeregisterDaemon(*request);
    });
  }
  ::grpc::ServerUnaryReactor* ListDaemons(::grpc::CallbackServerContext* context,
                                          const v1::ListDaemonsRequest* request,
                                          v1::ListDaemonsResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::ListDaemonsResponse> {
      MAINSTAY_RETURN_IF_ERROR(auth_->Check(grpc_server::AdminTokenOf(context, ""), "ListDaemons"));
      return core_->ListDaemons(*request);
    });
  }

  ::grpc::ServerUnaryReactor* CreateJob(::grpc::CallbackServerContext* context, const v1::CreateJobRequest* request,
                                        v1::CreateJobResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::CreateJobResponse> {
      MAINSTAY_RETURN_IF_ERROR(auth_->Check(grpc_server::AdminTokenOf(context, request->admin_token()), "CreateJob"));
      absl::StatusOr<v1::CreateJobResponse> created = core_->CreateJob(*request);
      if (created.ok() && fault_point_) fault_point_("create-job-committed");
      return created;
    });
  }
  ::grpc::ServerUnaryReactor* GetJob(::grpc::CallbackServerContext* context, const v1::GetJobRequest* request,
                                     v1::GetJobResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::GetJobResponse> {
      MAINSTAY_RETURN_IF_ERROR(CheckJobRead(context, request->job_token(), request->admin_token(), "GetJob"));
      return core_->GetJob(*request);
    });
  }
  ::grpc::ServerUnaryReactor* ListJobs(::grpc::CallbackServerContext* context, const v1::ListJobsRequest* request,
                                       v1::ListJobsResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::ListJobsResponse> {
      MAINSTAY_RETURN_IF_ERROR(auth_->Check(grpc_server::AdminTokenOf(context, request->admin_token()), "ListJobs"));
      return core_->ListJobs(*request);
    });
  }
  ::grpc::ServerUnaryReactor* DeleteJob(::grpc::CallbackServerContext* context, const v1::DeleteJobRequest* request,
                                        v1::DeleteJobResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::Status {
      MAINSTAY_RETURN_IF_ERROR(auth_->Check(grpc_server::AdminTokenOf(context, request->admin_token()), "DeleteJob"));
      return core_->DeleteJob(*request);
    });
  }
  ::grpc::ServerUnaryReactor* GetReaderToken(::grpc::CallbackServerContext* context,
                                             const v1::GetReaderTokenRequest* request,
                                             v1::GetReaderTokenResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::GetReaderTokenResponse> {
      if (request->job_token().empty()) {
        MAINSTAY_RETURN_IF_ERROR(auth_->Check(grpc_server::AdminTokenOf(context, request->admin_token()),
                                              "GetReaderToken without a job token"));
      }
      return core_->GetReaderToken(*request);
    });
  }
  ::grpc::ServerUnaryReactor* GetLayout(::grpc::CallbackServerContext* context, const v1::GetLayoutRequest* request,
                                        v1::GetLayoutResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::GetLayoutResponse> {
      MAINSTAY_RETURN_IF_ERROR(CheckJobRead(context, request->job_token(), "", "GetLayout"));
      return core_->GetLayout(*request);
    });
  }
  ::grpc::ServerUnaryReactor* GetPlacement(::grpc::CallbackServerContext* context,
                                           const v1::GetPlacementRequest* request,
                                           v1::GetPlacementResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::GetPlacementResponse> {
      MAINSTAY_RETURN_IF_ERROR(CheckJobRead(context, request->job_token(), "", "GetPlacement"));
      return core_->GetPlacement(*request);
    });
  }
  ::grpc::ServerWriteReactor<v1::WatchPlacementResponse>* WatchPlacement(
      ::grpc::CallbackServerContext* context, const v1::WatchPlacementRequest* request) override {
    if (absl::Status s = CheckJobRead(context, request->job_token(), "", "WatchPlacement"); !s.ok()) {
      return new grpc_server::FinishedWriter<v1::WatchPlacementResponse>(ToGrpcStatus(s));
    }
    return new WatchPlacementReactor(core_, calls_, waiters_, context, *request);
  }

  ::grpc::ServerUnaryReactor* KvPut(::grpc::CallbackServerContext* context, const v1::KvPutRequest* request,
                                    v1::KvPutResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::KvPutResponse> {
      MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "KvPut"));
      return core_->KvPut(*request);
    });
  }
  ::grpc::ServerUnaryReactor* KvGet(::grpc::CallbackServerContext* context, const v1::KvGetRequest* request,
                                    v1::KvGetResponse* response) override {
    if (absl::Status s = grpc_server::CheckInternalPeer(context, internal_, "KvGet"); !s.ok()) {
      return Refuse(context, s);
    }
    if (request->wait_ms() <= 0) {
      return Serve(calls_, context, response, [&] { return core_->KvGet(*request, absl::Now()); });
    }
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    // Until the key (or a key under the prefix) exists, parked without a thread.
    grpc_server::AnswerWhenReady<v1::KvGetResponse>(
        calls_, waiters_, context, kKvWaitKey,
        std::min(CallDeadline(context), absl::Now() + absl::Milliseconds(request->wait_ms())),
        [this, request] { return core_->KvGet(*request, absl::InfinitePast()); },
        [](const absl::StatusOr<v1::KvGetResponse>& r) {
          return r.ok() ? r->entries_size() == 0 : r.status().code() == absl::StatusCode::kNotFound;
        },
        [this, response, reactor](absl::StatusOr<v1::KvGetResponse> result) {
          if (result.ok()) *response = *std::move(result);
          reactor->Finish(ToGrpcStatus(result.status()));
          calls_->Exit();
        },
        FromGrpcStatus(ShuttingDown()));
    return reactor;
  }
  ::grpc::ServerUnaryReactor* KvDelete(::grpc::CallbackServerContext* context, const v1::KvDeleteRequest* request,
                                       v1::KvDeleteResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::KvDeleteResponse> {
      MAINSTAY_RETURN_IF_ERROR(grpc_server::CheckInternalPeer(context, internal_, "KvDelete"));
      return core_->KvDelete(*request);
    });
  }
  ::grpc::ServerWriteReactor<v1::KvWatchResponse>* KvWatch(::grpc::CallbackServerContext* context,
                                                           const v1::KvWatchRequest* request) override {
    if (absl::Status s = grpc_server::CheckInternalPeer(context, internal_, "KvWatch"); !s.ok()) {
      return new grpc_server::FinishedWriter<v1::KvWatchResponse>(ToGrpcStatus(s));
    }
    return new KvWatchReactor(core_, calls_, waiters_, context, *request);
  }

 private:
  // A job read with a job token is the core's to check (PERMISSION_DENIED for another job's);
  // without one it is a daemon's (an internal peer, when that is configured) or an admin's read,
  // which needs the admin token when one is configured.
  absl::Status CheckJobRead(const ::grpc::CallbackServerContext* context, const std::string& job_token,
                            const std::string& admin_field, absl::string_view call) const {
    if (!job_token.empty()) return absl::OkStatus();
    if (!internal_.open() && grpc_server::IsInternalPeer(context, internal_)) return absl::OkStatus();
    return auth_->Check(grpc_server::AdminTokenOf(context, admin_field), absl::StrCat(call, " without a job token"));
  }

  Coordinator* const core_;
  Calls* const calls_;
  grpc_server::Waiters* const waiters_;
  const AdminAuth* const auth_;
  const grpc_server::InternalPeers internal_;
  const std::function<void(const std::string&)> fault_point_;
};

// Every Admin RPC needs the admin token when one is configured (read-only ones too: they
// reveal jobs' data); the check comes first in each handler.
class AdminService final : public v1::Admin::CallbackService {
 public:
  AdminService(Coordinator* core, Calls* calls, const AdminAuth* auth) : core_(core), calls_(calls), auth_(auth) {}

  ::grpc::ServerUnaryReactor* CordonDaemon(::grpc::CallbackServerContext* context,
                                           const v1::CordonDaemonRequest* request,
                                           v1::CordonDaemonResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::CordonDaemonResponse> {
      MAINSTAY_RETURN_IF_ERROR(Admit(context, request->admin_token(), "CordonDaemon"));
      return core_->CordonDaemon(*request);
    });
  }
  ::grpc::ServerUnaryReactor* DrainDaemon(::grpc::CallbackServerContext* context, const v1::DrainDaemonRequest* request,
                                          v1::DrainDaemonResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::DrainDaemonResponse> {
      MAINSTAY_RETURN_IF_ERROR(Admit(context, request->admin_token(), "DrainDaemon"));
      return core_->DrainDaemon(*request);
    });
  }
  ::grpc::ServerUnaryReactor* MoveShard(::grpc::CallbackServerContext* context, const v1::MoveShardRequest* request,
                                        v1::MoveShardResponse* response) override {
    return Serve(calls_, context, response, [&]() -> absl::StatusOr<v1::MoveShardResponse> {
      MAINSTAY_RETURN_IF_ERROR(Admit(context, request->admin_token(), "MoveShard"));
      return core_->MoveShard(*request);
    });
  }
  ::grpc::ServerUnaryReactor* GetShardStats(::grpc::CallbackServerContext* context,
                                            const v1::GetShardStatsRequest* request, v1::GetShardStatsResponse*) override {
    if (absl::Status s = Admit(context, request->admin_token(), "GetShardStats"); !s.ok()) return Refuse(context, s);
    return Unimplemented(context, "GetShardStats: per-shard stats from the daemons are not implemented yet");
  }
  ::grpc::ServerWriteReactor<v1::DumpTensorResponse>* DumpTensor(::grpc::CallbackServerContext* context,
                                                                 const v1::DumpTensorRequest* request) override {
    if (absl::Status s = Admit(context, request->admin_token(), "DumpTensor"); !s.ok()) {
      return new grpc_server::FinishedWriter<v1::DumpTensorResponse>(ToGrpcStatus(s));
    }
    return new grpc_server::FinishedWriter<v1::DumpTensorResponse>(
        ::grpc::Status(::grpc::StatusCode::UNIMPLEMENTED, "DumpTensor: tensor dumps are not implemented yet"));
  }
  // The checkpoint RPCs read and write files (and CreateCheckpoint may wait for the daemons):
  // they run on spawned threads, never on gRPC's.
  ::grpc::ServerUnaryReactor* CreateCheckpoint(::grpc::CallbackServerContext* context,
                                               const v1::CreateCheckpointRequest* request,
                                               v1::CreateCheckpointResponse* response) override {
    if (absl::Status s = Admit(context, request->admin_token(), "CreateCheckpoint"); !s.ok()) return Refuse(context, s);
    return Blocking(context, response, [this, context, request] {
      return core_->CreateCheckpoint(*request, CallDeadline(context));
    });
  }
  ::grpc::ServerUnaryReactor* ListCheckpoints(::grpc::CallbackServerContext* context,
                                              const v1::ListCheckpointsRequest* request,
                                              v1::ListCheckpointsResponse* response) override {
    if (absl::Status s = Admit(context, request->admin_token(), "ListCheckpoints"); !s.ok()) return Refuse(context, s);
    return Blocking(context, response, [this, request] { return core_->ListCheckpoints(*request); });
  }
  ::grpc::ServerUnaryReactor* RestoreCheckpoint(::grpc::CallbackServerContext* context,
                                                const v1::RestoreCheckpointRequest* request,
                                                v1::RestoreCheckpointResponse* response) override {
    if (absl::Status s = Admit(context, request->admin_token(), "RestoreCheckpoint"); !s.ok()) return Refuse(context, s);
    return Blocking(context, response, [this, request] { return core_->RestoreCheckpoint(*request); });
  }
  ::grpc::ServerUnaryReactor* DeleteCheckpoint(::grpc::CallbackServerContext* context,
                                               const v1::DeleteCheckpointRequest* request,
                                               v1::DeleteCheckpointResponse* response) override {
    if (absl::Status s = Admit(context, request->admin_token(), "DeleteCheckpoint"); !s.ok()) return Refuse(context, s);
    return Blocking(context, response, [this, request]() -> absl::StatusOr<v1::DeleteCheckpointResponse> {
      MAINSTAY_RETURN_IF_ERROR(core_->DeleteCheckpoint(*request));
      return v1::DeleteCheckpointResponse();
    });
  }

 private:
  // Runs `fn` (returning StatusOr<Response>) on a spawned thread and finishes the call with it.
  template <typename Response, typename Fn>
  ::grpc::ServerUnaryReactor* Blocking(::grpc::CallbackServerContext* context, Response* response, Fn fn) {
    ::grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!calls_->Enter()) {
      reactor->Finish(ShuttingDown());
      return reactor;
    }
    const bool spawned = calls_->Spawn([this, response, reactor, fn = std::move(fn)] {
      absl::StatusOr<Response> result = fn();
      if (result.ok()) *response = *std::move(result);
      reactor->Finish(ToGrpcStatus(result.status()));
      calls_->Exit();
    });
    if (!spawned) {
      reactor->Finish(ShuttingDown());
      calls_->Exit();
    }
    return reactor;
  }

  absl::Status Admit(const ::grpc::CallbackServerContext* context, const std::string& field,
                     absl::string_view call) const {
    return auth_->Check(grpc_server::AdminTokenOf(context, field), call);
  }

  Coordinator* const core_;
  Calls* const calls_;
  const AdminAuth* const auth_;
};

// Holds an exclusive lock on <dir>/LOCK for the process's life, so that two coordinators
// never append to the same log. The lock dies with the process (kill -9 included).
absl::StatusOr<int> LockStateDir(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InvalidArgumentError(absl::StrCat("state_dir: cannot create ", dir, ": ", error.message()));
  const std::string path = (std::filesystem::path(dir) / "LOCK").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("state_dir: cannot open ", path, ": ", std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat("state_dir ", dir, " is in use by another coordinator"));
    }
    return absl::InternalError(absl::StrCat("flock ", path, ": ", std::strerror(err)));
  }
  return fd;
}

}  // namespace

struct CoordinatorServer::Impl {
  Options options;
  int lock_fd = -1;
  // Destroyed in reverse order: the server before the services, the core before the
  // assigner and the store it uses.
  AdminAuth auth;
  std::unique_ptr<metrics::CoordinatorMetrics> metrics;  // null: no registry
  metrics::Registry::CollectorId collector = 0;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<GrpcShardAssigner> assigner;
  std::unique_ptr<Coordinator> core;
  Calls calls;
  std::unique_ptr<grpc_server::Waiters> waiters;  // the parked WatchPlacement and KvGet calls
  std::unique_ptr<CoordinatorService> coordinator_service;
  std::unique_ptr<AdminService> admin_service;
  std::unique_ptr<::grpc::Server> server;
  std::unique_ptr<grpc_server::HealthPort> health_port;  // null: none
  int port = 0;

  absl::Mutex tick_mu;
  bool tick_stop ABSL_GUARDED_BY(tick_mu) = false;
  std::thread ticker;
  std::atomic<bool> shut_down{false};

  ~Impl() {
    Shutdown();
    if (lock_fd >= 0) ::close(lock_fd);
  }

  void RunTicker() {
    absl::MutexLock lock(&tick_mu);
    while (true) {
      tick_mu.AwaitWithTimeout(absl::Condition(&tick_stop), absl::Milliseconds(options.tick_interval_ms));
      if (tick_stop) return;
      tick_mu.Unlock();
      core->Tick();
      tick_mu.Lock();
    }
  }

  void Shutdown() {
    if (shut_down.exchange(true)) return;
    const absl::Time start = absl::Now();
    // New calls get UNAVAILABLE from here on; waiting ones end at their next slice.
    if (health_port != nullptr) health_port->SetServingStatus(false);
    if (core != nullptr) core->SetChangeListener(nullptr);
    ::mainstay::grpc_server::ShutdownServer(server.get(), calls, waiters.get(), kShutdownGrace, kCloseGrace,
                                            kComponent);
    if (health_port != nullptr) health_port->Shutdown();
    if (collector != 0) options.metrics->RemoveCollector(collector);  // it reads the core
    collector = 0;
    {
      absl::MutexLock lock(&tick_mu);
      tick_stop = true;
    }
    if (ticker.joinable()) ticker.join();
    if (assigner != nullptr) assigner->Shutdown();
    if (server != nullptr) {
      Log(LogLevel::kInfo, kComponent, absl::StrCat("stopped in ", absl::FormatDuration(absl::Now() - start)));
    }
  }
};

std::string CoordinatorServer::DefaultCoordinatorId() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "coordinator");
  return absl::StrCat(host, "-", ::getpid());
}

CoordinatorServer::CoordinatorServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CoordinatorServer::~CoordinatorServer() = default;

int CoordinatorServer::port() const { return impl_->port; }
int CoordinatorServer::health_port() const { return impl_->health_port == nullptr ? 0 : impl_->health_port->port(); }

void CoordinatorServer::Shutdown() { impl_->Shutdown(); }

grpc_server::InternalPeers CoordinatorServer::InternalPeersOf(const Options& options) {
  return grpc_server::InternalPeers{options.internal_peer_name, options.cluster_secret};
}

absl::Status CoordinatorServer::CheckOptions(const Options& options) {
  if (options.listen_address.empty()) return absl::InvalidArgumentError("listen_address: must not be empty");
  if (options.tick_interval_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("tick_interval_ms: must be > 0, got ", options.tick_interval_ms));
  }
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes: must be > 0, got ", options.max_message_bytes));
  }
  if (!options.internal_peer_name.empty() && !options.tls.require_client_cert) {
    return absl::InvalidArgumentError(
        "--tls-internal-name needs mutual TLS (--tls-client-auth require): the name is read from client certificates");
  }
  return grpc_server::CheckListenerIsSafe(InternalPeersOf(options), options.listen_address, options.insecure,
                                          "mainstay-coordinator");
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(Options options) {
  MAINSTAY_RETURN_IF_ERROR(CheckOptions(options));
  if (options.state_dir.empty() == (options.store == nullptr)) {
    return absl::InvalidArgumentError("state_dir or an external store: exactly one is required");
  }
  if (options.coordinator_id.empty()) options.coordinator_id = DefaultCoordinatorId();
  const grpc_server::InternalPeers internal = InternalPeersOf(options);

  // TLS files first: a bad one is the operator's to fix (INVALID_ARGUMENT), before any state is touched.
  MAINSTAY_ASSIGN_OR_RETURN(std::shared_ptr<::grpc::ServerCredentials> credentials, MakeServerCredentials(options.tls));
  GrpcShardAssignerOptions assigner_options;
  MAINSTAY_ASSIGN_OR_RETURN(ChannelSecurity security, ChannelSecurity::Create(options.tls));
  assigner_options.security = security.WithClusterSecret(options.cluster_secret);

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->auth = AdminAuth(options.admin_token);
  impl->options.admin_token.clear();  // kept only as a digest in `auth`
  if (options.metrics != nullptr) {
    MAINSTAY_ASSIGN_OR_RETURN(impl->metrics, metrics::CoordinatorMetrics::Create(options.metrics));
  }
  StateStore* store = options.store;
  if (store == nullptr) {
    MAINSTAY_ASSIGN_OR_RETURN(impl->lock_fd, LockStateDir(options.state_dir));
    MAINSTAY_ASSIGN_OR_RETURN(impl->store, OpenFileStateStore(options.state_dir));
    store = impl->store.get();
  }
  impl->assigner = std::make_unique<GrpcShardAssigner>(assigner_options);
  CoordinatorOptions core_options;
  core_options.store = store;
  core_options.assigner = impl->assigner.get();
  core_options.default_lease_ttl_ms = options.lease_ttl_ms;
  core_options.coordinator_id = options.coordinator_id;
  core_options.checkpoint_dir = options.checkpoint_dir;
  core_options.restore_on_daemon_loss = options.restore_on_daemon_loss;
  core_options.checkpoint_every_steps = options.checkpoint_every_steps;
  core_options.checkpoint_every_ms = options.checkpoint_every_ms;
  core_options.checkpoint_keep = options.checkpoint_keep;
  core_options.fault_point = options.fault_point;
  if (impl->metrics != nullptr) {
    core_options.on_lease_expired = [m = impl->metrics.get()](const std::string&) { m->LeaseExpired(); };
  }
  MAINSTAY_ASSIGN_OR_RETURN(impl->core, Coordinator::Create(core_options));

  grpc_server::Waiters::Options waits;  // the defaults; no flags (few calls wait here)
  waits.total_flag = waits.per_key_flag = waits.per_peer_flag = waits.max_wait_flag = "the coordinator's limit";
  impl->waiters = std::make_unique<grpc_server::Waiters>(waits);
  impl->core->SetChangeListener([waiters = impl->waiters.get()] { waiters->NotifyAll(); });
  impl->coordinator_service = std::make_unique<CoordinatorService>(impl->core.get(), &impl->calls,
                                                                   impl->waiters.get(), &impl->auth, internal,
                                                                   options.fault_point);
  impl->admin_service = std::make_unique<AdminService>(impl->core.get(), &impl->calls, &impl->auth);
  ::grpc::EnableDefaultHealthCheckService(true);
  ::grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ::grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, credentials, &impl->port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  // Two coordinators given one host:port must not share it silently (etcd standbys listen too).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients and standbys ping every 5 s during calls (client_internal::ChannelArgs), long polls included.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  if (impl->metrics != nullptr) {
    std::vector<std::unique_ptr<::grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(grpc_server::MakeRpcCounter(impl->metrics.get()));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  builder.RegisterService(impl->coordinator_service.get());
  builder.RegisterService(impl->admin_service.get());
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               " (address in use or not local?)"));
  }
  ::grpc::HealthCheckServiceInterface* health = impl->server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);  // every registered service
    health->SetServingStatus("", true);
    health->SetServingStatus("mainstay.v1.Coordinator", true);
    health->SetServingStatus("mainstay.v1.Admin", true);
  }
  if (!options.health_listen_address.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(impl->health_port, grpc_server::HealthPort::Start(options.health_listen_address));
    for (const char* service : {"", "mainstay.v1.Coordinator", "mainstay.v1.Admin"}) {
      impl->health_port->SetServingStatus(service, true);
    }
  }
  Impl* raw = impl.get();
  if (impl->metrics != nullptr) {
    impl->collector = options.metrics->AddCollector([raw] {
      v1::ListDaemonsRequest all;
      all.set_include_down(true);
      raw->metrics->SetState(raw->core->ListDaemons(all), raw->core->ListJobs(v1::ListJobsRequest()));
      // Reads the checkpoints' manifests: only with a checkpoint directory.
      if (absl::StatusOr<v1::ListCheckpointsResponse> c = raw->core->ListCheckpoints({}); c.ok()) {
        raw->metrics->SetCheckpoints(*c);
      }
    });
  }
  impl->ticker = std::thread([raw] { raw->RunTicker(); });
  Log(LogLevel::kInfo, kComponent,
      absl::StrCat("serving on port ", impl->port,
                   options.tls.ServerEnabled() ? (options.tls.require_client_cert ? " with mutual TLS" : " with TLS")
                                               : " in plaintext",
                   " (state ", options.store != nullptr ? options.state_description : options.state_dir, ", lease ", options.lease_ttl_ms, " ms, id ", options.coordinator_id,
                   impl->auth.enabled() ? ", admin token required" : ", no admin token", ", ",
                   grpc_server::DescribeInternalPeers(internal), ")"));
  return std::unique_ptr<CoordinatorServer>(new CoordinatorServer(std::move(impl)));
}

}  // namespace mainstay::coordinator

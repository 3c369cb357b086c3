// Client: connect (create or attach), placement cache, the retry loop, FinishStep.
#include "mainstay/client.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/src/client_impl.h"
#include "client/src/rpc_errors.h"
#include "common/chunk_limits.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/status.h"

namespace mainstay {

using client_internal::Route;
using client_internal::StepRecord;

namespace client_internal {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, const ChannelSecurity& security) {
  return security.CreateChannel(address, ChannelArgs());
}

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  // Chunks are at most 4 MiB of payload; layouts of large models are a few MiB.
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // A daemon cut off by the network (no RST) must not hold a call until its deadline: HTTP/2
  // pings every 5 s, unanswered for 5 s, close the connection, the attempt fails UNAVAILABLE
  // and the retry loop re-reads the placement. mainstayd accepts pings this often.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  return args;
}

StepStats StepStatsFromProto(const v1::StepStats& p) {
  StepStats s;
  s.step = p.step();
  s.version = p.version();
  s.skipped = p.skipped();
  s.grad_norm = p.grad_norm();
  s.clip_factor = p.clip_factor();
  s.loss_scale = p.loss_scale();
  s.lr = p.lr();
  s.weight_decay = p.weight_decay();
  s.groups = StepHyperFromProto(p.groups());
  s.nonfinite_count = p.nonfinite_count();
  s.commit_unix_ms = p.commit_unix_ms();
  s.step_time_ms = p.step_time_ms();
  s.phases = {p.phases().wait_inputs_ms(), p.phases().grad_stats_ms(),  p.phases().reduce_stats_ms(),
              p.phases().update_ms(),      p.phases().reduce_amax_ms(), p.phases().quantize_ms()};
  s.tensor_amax.assign(p.tensor_amax().begin(), p.tensor_amax().end());
  s.forwarded_bytes = p.forwarded_bytes();
  return s;
}

}  // namespace client_internal

namespace {

std::string RandomRequestId() {
  std::random_device rd;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    char buf[9];
    std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(rd()));
    id += buf;
  }
  return id;
}

absl::Status CheckOptions(const ClientOptions& o) {
  if (o.coordinator.empty()) return InvalidArgumentError("coordinator", "is required (host:port)");
  const bool create = !o.job_spec_json.empty();
  const bool attach = !o.job_id.empty() || !o.job_token.empty() || !o.reader_token.empty();
  if (create == attach) {
    return InvalidArgumentError("job_spec_json",
                                "give either a job spec (create) or job_id and job_token or reader_token (attach)");
  }
  if (!o.job_token.empty() && !o.reader_token.empty()) {
    return InvalidArgumentError("reader_token", "give either job_token (a trainer) or reader_token (a reader), not both");
  }
  if (attach && (o.job_id.empty() || (o.job_token.empty() && o.reader_token.empty()))) {
    return InvalidArgumentError("job_token", "attaching needs job_id and job_token (or reader_token)");
  }
  if (o.rank < 0) return InvalidArgumentError("rank", "must be >= 0, got ", o.rank);
  if (o.timeout.count() <= 0) return InvalidArgumentError("timeout", "must be > 0");
  if (o.initial_backoff.count() <= 0 || o.max_backoff < o.initial_backoff) {
    return InvalidArgumentError("initial_backoff", "must be > 0 and <= max_backoff");
  }
  if (o.chunk_bytes < kMinChunkBytes || o.chunk_bytes > kMaxChunkBytes) {
    return InvalidArgumentError("chunk_bytes", "must be in [1 KiB, 4 MiB], got ", o.chunk_bytes);
  }
  if (o.push_threads < 0 || o.pull_threads < 0) return InvalidArgumentError("push_threads", "must be >= 0");
  if (o.step_attempts < 1 || o.step_attempts > 100) {
    return InvalidArgumentError("step_attempts", "must be in [1, 100], got ", o.step_attempts);
  }
  if (o.pull_buffer_cache_bytes < -1) {
    return InvalidArgumentError("pull_buffer_cache_bytes", "must be >= 0, or -1 for the job's parameter bytes");
  }
  if (!o.transport.empty() && o.transport != "auto" && !client_internal::ParseTransport(o.transport).ok()) {
    return InvalidArgumentError("transport", "'", o.transport, "' is not one of auto, grpc, ucx, nccl, cuda_ipc");
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Impl: placement and retries.

Client::Impl::~Impl() {
  {
    absl::MutexLock lock(&mu);
    shutting_down = true;
    for (grpc::ClientContext* context : active_calls) context->TryCancel();
  }
  for (auto* t : {grpc_transport.get(), ucx_transport.get(), nccl_transport.get(), cuda_ipc_transport.get()}) {
    if (t != nullptr) t->Shutdown();
  }
  push_pool.reset();  // runs what is queued: each task now ends at once with CANCELLED
  pull_pool.reset();
}

Deadline Client::Impl::DeadlineAfter(std::chrono::milliseconds timeout) const {
  return std::chrono::system_clock::now() + (timeout.count() > 0 ? timeout : options.timeout);
}

int64_t Client::Impl::placement_epoch() const {
  absl::MutexLock lock(&mu);
  return placement.epoch();
}

void Client::Impl::SetPlacement(const v1::Placement& p) {
  const int64_t d = layout->data_parallel_size;
  std::vector<int> new_owners(layout->buckets.size() * d, -1);
  absl::flat_hash_map<std::string, int> daemon_index;
  for (int i = 0; i < p.daemons_size(); ++i) daemon_index[p.daemons(i).daemon_id()] = i;
  for (const v1::ShardPlacement& s : p.shards()) {
    const int32_t b = s.shard().bucket(), r = s.shard().shard();
    if (b < 0 || b >= static_cast<int32_t>(layout->buckets.size()) || r < 0 || r >= d) continue;
    auto it = daemon_index.find(s.daemon_id());
    if (it != daemon_index.end()) new_owners[b * d + r] = it->second;
  }
  absl::MutexLock lock(&mu);
  if (p.epoch() < placement.epoch()) return;
  placement = p;
  owners = std::move(new_owners);
}

absl::Status Client::Impl::RefreshPlacement(Deadline deadline, int64_t min_epoch) {
  absl::MutexLock refresh_lock(&refresh_mu);
  if (min_epoch > 0 && placement_epoch() >= min_epoch) return absl::OkStatus();
  v1::GetPlacementRequest request;
  request.set_job_id(job_id);
  request.set_job_token(job_token);
  v1::GetPlacementResponse response;
  grpc::ClientContext context;
  context.set_deadline(deadline);
  absl::Status s = client_internal::StatusFromCall(coordinator->GetPlacement(&context, request, &response),
                                                   &context);
  {
    absl::MutexLock lock(&mu);
    last_refresh = std::chrono::steady_clock::now();
  }
  if (!s.ok()) return Annotate(s, absl::StrCat("GetPlacement from coordinator ", options.coordinator));
  SetPlacement(response.placement());
  return absl::OkStatus();
}

std::shared_ptr<v1::Shard::Stub> Client::Impl::StubFor(const std::string& address) {
  Route route;
  route.address = address;
  ConnectRoute(&route);
  return route.stub;
}

void Client::Impl::ConnectRoute(Route* route) {
  absl::MutexLock lock(&mu);
  auto& [channel, stub] = stubs[route->address];
  if (stub == nullptr) {
    channel = client_internal::MakeChannel(route->address, security);
    stub = v1::Shard::NewStub(channel);
  }
  route->channel = channel;
  route->stub = stub;
}

absl::StatusOr<Route> Client::Impl::RouteForShard(int32_t bucket, int32_t shard) {
  Route route;
  {
    absl::MutexLock lock(&mu);
    const int owner = owners[bucket * layout->data_parallel_size + shard];
    route.epoch = placement.epoch();
    if (owner < 0) {
      return absl::UnavailableError(absl::StrCat("placement epoch ", route.epoch, " has no live owner for bucket ",
                                                 bucket, " shard ", shard));
    }
    route.daemon_id = placement.daemons(owner).daemon_id();
    route.address = placement.daemons(owner).address();
    route.endpoint = placement.daemons(owner);
  }
  ConnectRoute(&route);
  return route;
}

absl::StatusOr<Route> Client::Impl::RouteForAddress(const std::string& address, const std::string& daemon_id) {
  {
    // A daemon that left the placement (lost, or drained) took this rank's pushes of the
    // step with it: waiting for it cannot succeed, the step must be pushed again.
    absl::MutexLock lock(&mu);
    bool present = false;
    for (const v1::DaemonEndpoint& d : placement.daemons()) present |= d.daemon_id() == daemon_id;
    // (FinishStep and other control calls: gRPC, no data-plane endpoint needed.)
    if (!present) {
      return absl::AbortedError(absl::StrCat("daemon ", daemon_id, " is no longer in the job's placement (epoch ",
                                             placement.epoch(), "; it was lost or drained): pull the latest version "
                                             "and push the step again"));
    }
  }
  Route route;
  route.epoch = placement_epoch();
  route.daemon_id = daemon_id;
  route.address = address;
  ConnectRoute(&route);
  return route;
}

absl::Status Client::Impl::Retry(absl::string_view what, Deadline deadline, const client_internal::RouteFn& route_fn,
                                 const client_internal::AttemptFn& attempt, client_internal::CallGroup* group) {
  using client_internal::RetryAction;
  auto backoff = std::chrono::duration_cast<std::chrono::milliseconds>(options.initial_backoff);
  const auto start = std::chrono::system_clock::now();
  for (int attempts = 1;; ++attempts) {
    Route route;
    absl::Status status;
    if (route_fn) {
      absl::StatusOr<Route> r = route_fn();
      if (r.ok()) {
        route = *std::move(r);
      } else {
        status = r.status();
      }
    }
    if (group != nullptr && group->abandoned()) return absl::CancelledError(absl::StrCat(what, ": given up"));
    if (status.ok()) {
      grpc::ClientContext context;
      context.set_deadline(deadline);
      bool cancelled;
      {
        absl::MutexLock lock(&mu);
        cancelled = shutting_down;
        if (!cancelled) active_calls.insert(&context);
      }
      if (cancelled) return absl::CancelledError(absl::StrCat(what, ": the client is shutting down"));
      if (group != nullptr && !group->Register(&context)) {
        absl::MutexLock lock(&mu);
        active_calls.erase(&context);
        return absl::CancelledError(absl::StrCat(what, ": given up"));
      }
      status = attempt(route, &context);
      if (group != nullptr) group->Unregister(&context);
      {
        absl::MutexLock lock(&mu);
        active_calls.erase(&context);
        cancelled = shutting_down;
      }
      if (status.ok()) return status;
      if (group != nullptr && group->abandoned()) return absl::CancelledError(absl::StrCat(what, ": given up"));
      // Not cancelled here, so by the server: a gRPC server that is shutting down cancels the
      // calls that reach it in its last moments. Retried like any stopping server's UNAVAILABLE.
      if (status.code() == absl::StatusCode::kCancelled && !cancelled) {
        status = absl::UnavailableError(absl::StrCat("the server cancelled the call (stopping?): ", status.message()));
      }
    }
    const std::string where = route_fn && !route.address.empty()
                                  ? absl::StrCat(what, " at daemon ", route.daemon_id, " (", route.address, ")")
                                  : std::string(what);
    RetryAction action = client_internal::Classify(status, route.epoch, static_cast<bool>(route_fn));
    if (action == RetryAction::kRefreshPlacement) {
      const int64_t newer = client_internal::ErrorDetailOf(status)->placement_epoch();
      absl::Status refreshed = RefreshPlacement(deadline, newer);
      if (refreshed.ok() && placement_epoch() > route.epoch) continue;  // re-route at once
      action = RetryAction::kBackoff;  // the coordinator lags behind the daemon: wait
    }
    if (action == RetryAction::kFail) {
      // A job restored from a checkpoint answers ABORTED from its new placement epoch: learn
      // that placement now, so the caller's next call (the resume step) goes where it must
      // and never reaches a daemon still running the job's old state.
      if (status.code() == absl::StatusCode::kAborted && route_fn) {
        std::optional<v1::ErrorDetail> detail = client_internal::ErrorDetailOf(status);
        if (detail.has_value() && detail->placement_epoch() > route.epoch) {
          RefreshPlacement(deadline, detail->placement_epoch()).IgnoreError();
        }
      }
      return Annotate(status, where);
    }
    const auto now = std::chrono::system_clock::now();
    if (now + backoff >= deadline) {
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count();
      return Annotate(status, absl::StrCat(where, " (gave up after ", attempts, " attempts in ", waited,
                                           " ms: the call's deadline is near)"));
    }
    {
      absl::MutexLock lock(&mu);
      mu.AwaitWithTimeout(absl::Condition(&shutting_down), absl::FromChrono(backoff));
    }
    backoff = std::min(backoff * 2, std::chrono::duration_cast<std::chrono::milliseconds>(options.max_backoff));
    // A daemon that stays unreachable may have been replaced: re-read the placement now and
    // then (at most once per max_backoff over all calls).
    if (route_fn && attempts >= 3) {
      bool due;
      {
        absl::MutexLock lock(&mu);
        due = std::chrono::steady_clock::now() - last_refresh >= options.max_backoff;
      }
      if (due) RefreshPlacement(deadline, 0).IgnoreError();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Client.

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  MAINSTAY_RETURN_IF_ERROR(CheckOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  MAINSTAY_ASSIGN_OR_RETURN(impl->security, ChannelSecurity::Create(options.tls));
  MAINSTAY_ASSIGN_OR_RETURN(impl->coordinator_channel,
                            impl->security.CreateCoordinatorChannel(options.coordinator, client_internal::ChannelArgs()));
  impl->coordinator = v1::Coordinator::NewStub(impl->coordinator_channel);
  const Deadline deadline = impl->DeadlineAfter(options.timeout);
  const std::string where = absl::StrCat("coordinator ", options.coordinator);
  Impl* self = impl.get();

  if (!options.job_spec_json.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpecJson(options.job_spec_json));
    v1::CreateJobRequest request;
    JobSpecToProto(spec, request.mutable_spec());
    request.set_admin_token(options.admin_token);
    // Both make retrying CreateJob safe, also across a coordinator restart or takeover (the
    // coordinator keeps only the token's hash, so it cannot return one it made before).
    request.set_request_id(RandomRequestId());
    request.set_job_token(RandomRequestId() + RandomRequestId());
    v1::CreateJobResponse response;
    MAINSTAY_RETURN_IF_ERROR(self->Retry(absl::StrCat("CreateJob at ", where), deadline, nullptr,
                                         [&](const Route&, grpc::ClientContext* context) {
                                           return client_internal::StatusFromCall(
                                               self->coordinator->CreateJob(context, request, &response),
                                               context);
                                         }));
    impl->job_id = response.job_id();
    impl->job_token = response.job_token();
  } else {
    impl->job_id = options.job_id;
    impl->reader = !options.reader_token.empty();
    impl->job_token = impl->reader ? options.reader_token : options.job_token;
  }

  v1::GetLayoutRequest layout_request;
  layout_request.set_job_id(impl->job_id);
  layout_request.set_job_token(impl->job_token);
  v1::GetLayoutResponse layout_response;
  MAINSTAY_RETURN_IF_ERROR(self->Retry(absl::StrCat("GetLayout of job ", impl->job_id, " at ", where), deadline,
                                       nullptr, [&](const Route&, grpc::ClientContext* context) {
                                         return client_internal::StatusFromCall(
                                             self->coordinator->GetLayout(context, layout_request, &layout_response),
                                             context);
                                       }));
  absl::StatusOr<Layout> layout = LayoutFromProto(layout_response.layout());
  if (!layout.ok()) return Annotate(layout.status(), absl::StrCat("layout of job ", impl->job_id, " from ", where));
  if (options.rank >= layout->data_parallel_size && !impl->reader) {
    return InvalidArgumentError("rank", options.rank, " is not in [0, ", layout->data_parallel_size,
                                ") for job ", impl->job_id);
  }
  impl->layout = std::make_shared<const Layout>(*std::move(layout));
  impl->version_at_connect = layout_response.version();
  {
    absl::MutexLock lock(&impl->mu);
    impl->owners.assign(impl->layout->buckets.size() * impl->layout->data_parallel_size, -1);
  }
  MAINSTAY_RETURN_IF_ERROR(self->Retry(absl::StrCat("GetPlacement of job ", impl->job_id), deadline, nullptr,
                                       [&](const Route&, grpc::ClientContext*) {
                                         return self->RefreshPlacement(deadline, 0);
                                       }));

  // Connection costs (UCX endpoints and their wire-up, NCCL communicators) are paid here, at
  // attach, not by the first push.
  if (impl->options.transport.empty() || impl->options.transport == "auto") {
    const char* env = std::getenv("MAINSTAY_TRANSPORT");
    impl->transport_request = env != nullptr && *env != '\0' ? env : "auto";
    if (impl->transport_request != "auto" && !client_internal::ParseTransport(impl->transport_request).ok()) {
      return InvalidArgumentError("transport", "MAINSTAY_TRANSPORT='", impl->transport_request,
                                  "' is not one of auto, grpc, ucx, nccl, cuda_ipc");
    }
  } else {
    impl->transport_request = impl->options.transport;
  }
  MAINSTAY_RETURN_IF_ERROR(impl->StartTransports(deadline));

  const int d = static_cast<int>(impl->layout->data_parallel_size);
  impl->push_pool = std::make_unique<client_internal::ThreadPool>(
      options.push_threads > 0 ? options.push_threads : std::max(4, d));
  int64_t cache_bytes = options.pull_buffer_cache_bytes;
  if (cache_bytes < 0) {
    cache_bytes = 0;
    for (const Bucket& b : impl->layout->buckets) cache_bytes += DataBytes(b.format, b.numel);
  }
  impl->pull_buffers = client_internal::BufferPool::Create(cache_bytes);
  if (impl->options.reader_token.empty()) {
    // A trainer pulls every bucket each step: one buffer per bucket is written once here and
    // released into the pool, so the first step's pulls land in memory already faulted in
    // rather than in fresh pages. Only as many as the pool keeps (none with a cache of 0), or
    // they would be freed again at once. Readers pull what they read.
    std::vector<client_internal::PooledBytes> touched;
    int64_t kept = 0;
    for (const Bucket& b : impl->layout->buckets) {
      const int64_t bytes = DataBytes(b.format, b.numel);
      if (kept + bytes > cache_bytes) break;
      kept += bytes;
      touched.push_back(impl->pull_buffers->Acquire(static_cast<size_t>(bytes)));
      std::memset(touched.back().data(), 0, touched.back().size());
    }
  }
  impl->pull_pool = std::make_unique<client_internal::ThreadPool>(
      options.pull_threads > 0 ? options.pull_threads : std::max(4, d));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

const std::string& Client::job_id() const { return impl_->job_id; }
const std::string& Client::job_token() const {
  static const std::string kNone;
  return impl_->reader ? kNone : impl_->job_token;
}
bool Client::reader() const { return impl_->reader; }
int32_t Client::rank() const { return impl_->options.rank; }
int64_t Client::data_parallel_size() const { return impl_->layout->data_parallel_size; }
const Layout& Client::layout() const { return *impl_->layout; }
std::shared_ptr<const Layout> Client::shared_layout() const { return impl_->layout; }
int64_t Client::version_at_connect() const { return impl_->version_at_connect; }

std::vector<DataConnection> Client::connections() const {
  v1::Placement p;
  {
    absl::MutexLock lock(&impl_->mu);
    p = impl_->placement;
  }
  std::vector<DataConnection> out;
  for (const v1::DaemonEndpoint& d : p.daemons()) {
    DataConnection c;
    c.daemon_id = d.daemon_id();
    c.address = d.address();
    absl::StatusOr<client_internal::DataTransport*> t = impl_->TransportFor(d, &c.note);
    c.transport = t.ok() ? client_internal::TransportName((*t)->kind()) : "none";
    if (!t.ok()) c.note = std::string(t.status().message());
    out.push_back(std::move(c));
  }
  return out;
}

JobPlacement Client::placement() const {
  v1::Placement p;
  {
    absl::MutexLock lock(&impl_->mu);
    p = impl_->placement;
  }
  JobPlacement out;
  out.epoch = p.epoch();
  for (const v1::ShardPlacement& s : p.shards()) {
    out.shards.push_back({s.shard().bucket(), s.shard().shard(), s.daemon_id(),
                          std::vector<std::string>(s.replica_daemon_ids().begin(), s.replica_daemon_ids().end())});
  }
  for (const v1::DaemonEndpoint& d : p.daemons()) out.daemons.push_back({d.daemon_id(), d.address(), d.node_name()});
  return out;
}

absl::Status Client::RefreshPlacement() {
  const Deadline deadline = impl_->DeadlineAfter(impl_->options.timeout);
  return impl_->Retry("GetPlacement", deadline, nullptr, [&](const Route&, grpc::ClientContext*) {
    return impl_->RefreshPlacement(deadline, 0);
  });
}

absl::StatusOr<StepStats> Client::FinishStep(int64_t step, double lr, double weight_decay,
                                             std::chrono::milliseconds timeout) {
  const StepHyper groups(static_cast<size_t>(NumParamGroups(layout())), GroupHyper{lr, weight_decay});
  return FinishStep(step, groups, timeout);
}

absl::StatusOr<StepStats> Client::FinishStep(int64_t step, std::span<const GroupHyper> groups,
                                             std::chrono::milliseconds timeout) {
  if (step < 0) return InvalidArgumentError("step", "must be >= 0, got ", step);
  const int32_t num_groups = NumParamGroups(layout());
  if (groups.size() != static_cast<size_t>(num_groups)) {
    return InvalidArgumentError("groups", "job ", job_id(), " has ", num_groups,
                                " param groups (its tensors' param_group); got hyperparameters for ", groups.size());
  }
  MAINSTAY_RETURN_IF_ERROR(CheckStepHyper(groups, absl::StrCat("FinishStep(", step, ")")));
  if (impl_->reader) return impl_->ReaderRefusal();
  // One attempt: every push of the step done, FinishStep at the daemons they landed on.
  auto attempt = [&]() -> absl::StatusOr<StepStats> {
    const Deadline deadline = impl_->DeadlineAfter(timeout);
    std::vector<client_internal::StepPush> pushes;
    {
      absl::MutexLock lock(&impl_->mu);
      auto it = impl_->steps.find(step);
      if (it != impl_->steps.end()) pushes = it->second.pushes;
    }
    if (pushes.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("FinishStep(", step, "): rank ", rank(),
                                                        " pushed nothing for this step through this client"));
    }
    // The daemons count this rank's pushes of the step only once they are acknowledged.
    absl::Status failed;
    bool committed = false;  // a push was refused because the step is committed already
    for (const client_internal::StepPush& p : pushes) {  // all of them: none may still be running
      const absl::Status& s = p.done.get();
      committed |= client_internal::CommittedAtOrPast(s, step);
      if (!s.ok() && failed.ok()) {
        failed = Annotate(s, absl::StrCat("FinishStep(", step, "): the push of bucket ", p.bucket, " shard ", p.shard,
                                          " failed; push it again, then call FinishStep again"));
      }
    }
    if (committed) return CommittedStepStats(step, timeout);
    if (!failed.ok()) {
      // The step's record goes: pushing the step again starts it afresh (a record kept here
      // would fail every later FinishStep of this step with this old error).
      absl::MutexLock lock(&impl_->mu);
      impl_->steps.erase(step);
      return failed;
    }
    struct Target {
      std::string address, id;
      bool redirected = false;  // a new owner of shards pushed elsewhere (moved meanwhile)
      // (Not redirected) the oldest epoch the pushes there were routed at.
      int64_t pushed_epoch = 0;
    };
    std::map<std::string, client_internal::StepRecord::Landed> landed;  // by address
    {
      absl::MutexLock lock(&impl_->mu);
      landed = impl_->steps[step].daemons;
    }
    v1::FinishStepRequest request;
    request.set_job_id(impl_->job_id);
    request.set_job_token(impl_->job_token);
    request.set_step(step);
    request.set_rank(rank());
    StepHyperToProto(groups, request.mutable_groups());

    // Each call blocks until the step is decided: one thread per daemon, outside the pools. First
    // the daemons the pushes landed on; then, as soon as a call ends, the new owners of shards
    // that moved (with the pushes stored on them: job_move.cc) since their push landed: the
    // step there may wait for this very rank. A daemon that failed and no longer owns any shard
    // this rank pushed is passed over.
    absl::Mutex mu;
    // An ABORTED answer (the step failed, or this daemon lacks this rank's pushes) ends the whole
    // call at once: the step must be pushed again, and the other daemons' attempts cannot
    // succeed without the new pushes, so waiting for them only puts the daemons' next attempts
    // out of step with each other (docs/architecture.md, "Agreed outcome of a step").
    client_internal::CallGroup calls;
    std::set<std::string> asked;             // daemon ids
    std::set<std::string> asked_redirected;  // of those, the ones asked as a moved shard's new owner
    std::vector<std::pair<std::string, v1::FinishStepResponse>> responses;  // daemon id, answer
    std::vector<std::thread> threads;
    int running = 0;
    std::function<void(Target)> finish_at = [&](Target t) {
      v1::FinishStepResponse answer;
      absl::Status status = impl_->Retry(
          absl::StrCat("FinishStep(", step, ")"), deadline, [&] { return impl_->RouteForAddress(t.address, t.id); },
          [&](const Route& route, grpc::ClientContext* context) {
            v1::FinishStepRequest r = request;
            // The pushes' epoch, not a newer one the client learned since: the daemon then knows
            // whether a re-placement after them dropped them (job.cc, Job::FinishStep).
            r.set_placement_epoch(t.redirected ? route.epoch : std::min(route.epoch, t.pushed_epoch));
            r.set_redirected(t.redirected);
            absl::Status s = client_internal::StatusFromCall(route.stub->FinishStep(context, r, &answer), context);
            // A daemon fenced by a move before it got the new placement answers the pushes'
            // older epoch with the new one, which the client already routes at. When it still
            // owns shards this rank pushed, it is behind, not this call: the call waits and
            // retries (as UNAVAILABLE). (When it owns none, the failure passes it over to the
            // shards' new owners, below.)
            if (const std::optional<ErrorInfo> info = GetErrorInfo(s);
                s.code() == absl::StatusCode::kFailedPrecondition && info.has_value() &&
                r.placement_epoch() < route.epoch && info->placement_epoch <= route.epoch &&
                std::any_of(pushes.begin(), pushes.end(), [&](const client_internal::StepPush& p) {
                  absl::StatusOr<Route> owner = impl_->RouteForShard(p.bucket, p.shard);
                  return owner.ok() && owner->daemon_id == t.id;
                })) {
              return absl::UnavailableError(s.message());
            }
            return s;
          },
          &calls);
      if (!status.ok() && status.code() != absl::StatusCode::kAborted && calls.abandoned()) {
        absl::MutexLock lock(&mu);  // given up: another daemon's ABORTED decides the call
        --running;
        return;
      }
      // Where the shards this rank pushed are now (the cache; re-read after a failure): a shard
      // whose owner changed since its push landed moved with the push, and its new owner needs
      // this rank's FinishStep too, whether this call succeeded (the daemon kept other shards)
      // or failed (it kept none: the failure is passed over).
      if (!status.ok() && !t.redirected) impl_->RefreshPlacement(deadline, 0).IgnoreError();
      std::map<std::string, std::string> owners;  // id -> address
      bool passed_over = !status.ok() && !t.redirected;
      for (const client_internal::StepPush& p : pushes) {
        absl::StatusOr<Route> owner = impl_->RouteForShard(p.bucket, p.shard);
        // A shard without a live owner was lost, not moved: a failure stands.
        passed_over &= owner.ok() && owner->daemon_id != t.id;
        if (owner.ok()) owners[owner->daemon_id] = owner->address;
      }
      absl::MutexLock lock(&mu);
      if (status.ok()) {
        responses.emplace_back(t.id, std::move(answer));
      } else if (!passed_over && status.code() == absl::StatusCode::kAborted) {
        calls.Abandon();
        if (failed.code() != absl::StatusCode::kAborted) failed = status;
      } else if (!passed_over && failed.ok()) {
        failed = status;
      }
      if ((status.ok() || passed_over) && !calls.abandoned()) {
        for (const auto& [id, address] : owners) {
          // A daemon asked already (the pushes landed there too) is asked again when it is the
          // new owner of the shards a failed daemon held: only the redirected call tells it that
          // this rank's pushes to that daemon were lost with it (docs/architecture.md).
          if (id == t.id) continue;
          if (passed_over ? !asked_redirected.insert(id).second : !asked.insert(id).second) continue;
          asked.insert(id);
          asked_redirected.insert(id);
          ++running;
          threads.emplace_back(finish_at, Target{address, id, true});
        }
      }
      --running;
    };
    {
      absl::MutexLock lock(&mu);
      for (const auto& [address, at] : landed) {
        asked.insert(at.daemon_id);
        ++running;
        threads.emplace_back(finish_at, Target{address, at.daemon_id, false, at.epoch});
      }
      mu.Await(absl::Condition(+[](int* n) { return *n == 0; }, &running));
    }
    for (std::thread& t : threads) t.join();  // all have ended; none is added any more
    if (!failed.ok()) {
      if (failed.code() == absl::StatusCode::kAborted) {
        absl::MutexLock lock(&impl_->mu);
        impl_->steps.erase(step);  // the step must be pushed again from scratch
      }
      return failed;
    }
    if (responses.empty()) {
      return absl::AbortedError(absl::StrCat("FinishStep(", step, "): no daemon owns the shards rank ", rank(),
                                             " pushed; push the step again"));
    }
    StepStats stats = client_internal::StepStatsFromProto(responses[0].second.stats());
    for (size_t i = 1; i < responses.size(); ++i) {
      const StepStats other = client_internal::StepStatsFromProto(responses[i].second.stats());
      if (other.step != stats.step || other.version != stats.version || other.skipped != stats.skipped) {
        return absl::InternalError(absl::StrCat("FinishStep(", step, "): daemons disagree: ", responses[0].first,
                                                " says version ", stats.version, stats.skipped ? " (skipped)" : "",
                                                ", ", responses[i].first, " says version ", other.version,
                                                other.skipped ? " (skipped)" : ""));
      }
    }
    {
      absl::MutexLock lock(&impl_->mu);
      impl_->steps.erase(step);
    }
    return stats;
  };
  // A step a daemon gave up (ABORTED, nothing changed: a peer or the placement changed
  // mid-step) is pushed again from the caller's buffers and finished again, at most
  // step_attempts times in all; a restore (the daemons' committed step is behind the step)
  // and every other error go back to the caller.
  std::string first_abort;
  for (int n = 1;; ++n) {
    std::vector<client_internal::StepPush> pushes;
    {
      absl::MutexLock lock(&impl_->mu);
      auto it = impl_->steps.find(step);
      if (it != impl_->steps.end()) pushes = it->second.pushes;
    }
    absl::StatusOr<StepStats> result = attempt();
    if (result.ok()) {
      result->attempts = n;
      result->first_abort = first_abort;
      return result;
    }
    if (result.status().code() != absl::StatusCode::kAborted || n >= impl_->options.step_attempts || pushes.empty()) {
      return result;
    }
    const std::optional<ErrorInfo> info = GetErrorInfo(result.status());
    if (info.has_value() && info->committed_step + 1 < step) return result;  // restored: the caller rewinds
    if (first_abort.empty()) first_abort = std::string(result.status().message());
    if (absl::Status again = impl_->PushStepAgain(step, pushes); !again.ok()) {
      if (client_internal::CommittedAtOrPast(again, step)) {
        // The step committed after this attempt gave up (a move carried this rank's pushes
        // and its FinishStep to the new owner): its stats are what FinishStep returns.
        absl::StatusOr<StepStats> stats = CommittedStepStats(step, timeout);
        if (stats.ok()) {
          stats->attempts = n + 1;
          stats->first_abort = first_abort;
        }
        return stats;
      }
      // A refusal that says what to do instead (a restore rewound the job: ABORTED with the
      // committed step to resume after) is the answer; any other failure keeps the first abort's.
      if (again.code() == absl::StatusCode::kAborted && GetErrorInfo(again).has_value()) {
        return Annotate(again, absl::StrCat("FinishStep(", step, ") was aborted (", result.status().message(),
                                            ") and pushing it again was refused"));
      }
      return Annotate(result.status(), absl::StrCat("not pushed again by the client: ", again.message()));
    }
  }
}

absl::StatusOr<StepStats> Client::CommittedStepStats(int64_t step, std::chrono::milliseconds timeout) {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->steps.erase(step);
  }
  // The step is decided, but the daemon asked (the owner of (bucket 0, this rank)) may not have
  // committed it yet, or may be out of reach for a moment (a move, a failover): asked again,
  // with the placement re-read, until the client's timeout.
  const Deadline deadline = impl_->DeadlineAfter(timeout);
  for (std::chrono::milliseconds pause(20);; pause = std::min(2 * pause, std::chrono::milliseconds(1000))) {
    absl::StatusOr<StepStats> stats = GetStepStats(step);
    const absl::StatusCode code = stats.status().code();
    const bool again = code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
                       code == absl::StatusCode::kFailedPrecondition;
    if (stats.ok()) return stats;
    if (!again || std::chrono::system_clock::now() + pause > deadline) {
      return Annotate(stats.status(), absl::StrCat("FinishStep(", step, "): the daemons committed the step (a push of "
                                                   "it was refused as already decided) but its stats could not be "
                                                   "read"));
    }
    if (code != absl::StatusCode::kUnavailable) impl_->RefreshPlacement(deadline, 0).IgnoreError();
    std::this_thread::sleep_for(pause);
  }
}

absl::Status Client::Impl::ReaderRefusal() const {
  return absl::FailedPreconditionError(absl::StrCat(
      "job ", job_id, ": this client attached with a reader token, which only pulls published versions"));
}

absl::StatusOr<v1::PinVersionResponse> Client::Impl::PinCall(v1::Shard::Stub& stub, int64_t version, int64_t ttl_ms,
                                                             uint64_t pin_id, Deadline deadline) {
  v1::PinVersionRequest request;
  request.set_job_id(job_id);
  request.set_job_token(job_token);
  request.set_version(version);
  request.set_ttl_ms(ttl_ms);
  request.set_pin_id(pin_id);
  v1::PinVersionResponse response;
  grpc::ClientContext context;
  context.set_deadline(deadline);
  MAINSTAY_RETURN_IF_ERROR(client_internal::StatusFromCall(stub.PinVersion(&context, request, &response), &context));
  return response;
}

absl::StatusOr<std::string> Client::GetReaderToken(bool rotate) {
  if (impl_->reader) return impl_->ReaderRefusal();
  const Deadline deadline = impl_->DeadlineAfter(impl_->options.timeout);
  v1::GetReaderTokenRequest request;
  request.set_job_id(impl_->job_id);
  request.set_job_token(impl_->job_token);
  request.set_rotate(rotate);
  v1::GetReaderTokenResponse response;
  // (Retried: a rotation whose answer was lost rotates again, which is what was asked.)
  MAINSTAY_RETURN_IF_ERROR(impl_->Retry(absl::StrCat("GetReaderToken of job ", impl_->job_id), deadline, nullptr,
                                        [&](const Route&, grpc::ClientContext* context) {
                                          return client_internal::StatusFromCall(
                                              impl_->coordinator->GetReaderToken(context, request, &response),
                                              context);
                                        }));
  return response.reader_token();
}

absl::StatusOr<VersionPin> Client::PinVersion(int64_t version, std::chrono::milliseconds ttl) {
  if (version < 0) return InvalidArgumentError("version", "must be >= 0, got ", version);
  if (ttl.count() <= 0 || ttl > std::chrono::minutes(10)) {
    return InvalidArgumentError("ttl", "must be in (0, 10 min], got ", ttl.count(), " ms");
  }
  const Deadline deadline = impl_->DeadlineAfter(impl_->options.timeout);
  // Every daemon that serves a pull of the job: the owners of the shards.
  std::map<std::string, client_internal::Route> daemons;
  for (const Bucket& b : layout().buckets) {
    for (const Shard& s : b.shards) {
      MAINSTAY_ASSIGN_OR_RETURN(client_internal::Route route, impl_->RouteForShard(b.index, s.rank));
      daemons.emplace(route.address, std::move(route));
    }
  }
  VersionPin pin;
  pin.version = version;
  for (const auto& [address, route] : daemons) {
    absl::StatusOr<v1::PinVersionResponse> pinned = impl_->PinCall(*route.stub, version, ttl.count(), 0, deadline);
    if (!pinned.ok()) {
      (void)ReleasePin(pin);  // no half-pinned version left behind (and they expire anyway)
      return Annotate(pinned.status(), absl::StrCat("PinVersion(", version, ") at daemon ", route.daemon_id));
    }
    pin.pins.push_back({address, pinned->pin_id()});
    pin.expires_unix_ms = pin.expires_unix_ms == 0 ? pinned->expires_unix_ms()
                                                   : std::min(pin.expires_unix_ms, pinned->expires_unix_ms());
  }
  // The replicas too (replication_factor >= 2), so that the pin survives a failover that
  // promotes one. Best effort: a replica still being copied does not keep the version yet, and
  // the pin on the primaries is what the reader needs now.
  std::map<std::string, std::string> replicas;  // address -> daemon id
  {
    absl::MutexLock lock(&impl_->mu);
    std::map<std::string, std::string> address_of;
    for (const v1::DaemonEndpoint& d : impl_->placement.daemons()) address_of[d.daemon_id()] = d.address();
    for (const v1::ShardPlacement& s : impl_->placement.shards()) {
      for (const std::string& id : s.replica_daemon_ids()) {
        auto it = address_of.find(id);
        if (it != address_of.end() && !daemons.count(it->second)) replicas[it->second] = id;
      }
    }
  }
  for (const auto& [address, id] : replicas) {
    absl::StatusOr<client_internal::Route> route = impl_->RouteForAddress(address, id);
    if (!route.ok()) continue;
    absl::StatusOr<v1::PinVersionResponse> pinned = impl_->PinCall(*route->stub, version, ttl.count(), 0, deadline);
    if (pinned.ok()) pin.pins.push_back({address, pinned->pin_id()});
  }
  return pin;
}

absl::StatusOr<VersionPin> Client::PinNewestVersion(std::chrono::milliseconds ttl) {
  // A newer version can evict the newest between learning it and pinning it: then the next.
  absl::Status last;
  for (int attempt = 0; attempt < 20; ++attempt) {
    absl::StatusOr<PulledBucket> newest = PullShard(0, 0, kLatestVersion).Wait();
    if (!newest.ok()) return newest.status();
    absl::StatusOr<VersionPin> pin = PinVersion(newest->version(), ttl);
    if (pin.ok() || pin.status().code() != absl::StatusCode::kFailedPrecondition) return pin;
    last = pin.status();
  }
  return Annotate(last, "no version of the job stayed long enough to be pinned (20 tries)");
}

absl::Status Client::ReleasePin(const VersionPin& pin) {
  const Deadline deadline = impl_->DeadlineAfter(impl_->options.timeout);
  absl::Status first;
  for (const auto& [address, id] : pin.pins) {
    absl::Status s = impl_->PinCall(*impl_->StubFor(address), pin.version, 0, id, deadline).status();
    // A daemon that cannot be reached (lost in a failover) took its pins with it, or drops
    // them when they expire: nothing to release there.
    if (absl::IsUnavailable(s)) continue;
    if (!s.ok() && first.ok()) first = Annotate(s, absl::StrCat("releasing the pin of version ", pin.version, " at ", address));
  }
  return first;
}

absl::StatusOr<StepStats> Client::GetStepStats(int64_t step) {
  const Deadline deadline = impl_->DeadlineAfter(impl_->options.timeout);
  v1::GetStepStatsRequest request;
  request.set_job_id(impl_->job_id);
  request.set_job_token(impl_->job_token);
  request.set_step(step);
  v1::GetStepStatsResponse response;
  // UNAVAILABLE means "not decided yet" here: answer at once instead of retrying.
  grpc::ClientContext context;
  context.set_deadline(deadline);
  MAINSTAY_ASSIGN_OR_RETURN(Route route, impl_->RouteForShard(0, rank()));
  absl::Status s = client_internal::StatusFromCall(route.stub->GetStepStats(&context, request, &response),
                                                   &context);
  if (!s.ok()) return Annotate(s, absl::StrCat("GetStepStats(", step, ") at daemon ", route.daemon_id));
  return client_internal::StepStatsFromProto(response.stats());
}

}  // namespace mainstay

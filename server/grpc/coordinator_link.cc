#include "server/grpc/coordinator_link.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"

namespace mainstay::daemon {
namespace {

constexpr char kComponent[] = "daemon";

void SetDeadline(::grpc::ClientContext* context, absl::Time deadline) {
  context->set_deadline(absl::ToChronoTime(deadline));
}

}  // namespace

CoordinatorLink::CoordinatorLink(Options options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<CoordinatorLink>> CoordinatorLink::Start(Options options) {
  if (options.coordinator_address.empty()) return absl::InvalidArgumentError("coordinator address: required");
  std::unique_ptr<CoordinatorLink> link(new CoordinatorLink(std::move(options)));
  // A restarted coordinator (or a standby taking over) is found again within a heartbeat or
  // two: CreateCoordinatorChannel reconnects within a second.
  ::grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  MAINSTAY_ASSIGN_OR_RETURN(link->channel_,
                            link->options_.security.CreateCoordinatorChannel(link->options_.coordinator_address, args));
  link->stub_ = v1::Coordinator::NewStub(link->channel_);
  link->admin_ = v1::Admin::NewStub(link->channel_);
  MAINSTAY_RETURN_IF_ERROR(link->Register(absl::Now() + link->options_.register_timeout));
  link->heartbeat_ = std::thread([raw = link.get()] { raw->RunHeartbeat(); });
  return link;
}

CoordinatorLink::~CoordinatorLink() { Shutdown(); }

std::string CoordinatorLink::daemon_id() const {
  absl::MutexLock lock(&mu_);
  return daemon_id_;
}

absl::Status CoordinatorLink::Register(absl::Time deadline) {
  v1::RegisterDaemonRequest request = options_.registration;
  {
    absl::MutexLock lock(&mu_);
    request.set_daemon_id(daemon_id_);
    request.set_daemon_key(daemon_key_);
  }
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    ::grpc::ClientContext context;
    SetDeadline(&context, std::min(deadline, absl::Now() + options_.call_timeout));
    v1::RegisterDaemonResponse response;
    const absl::Status status = FromGrpcStatus(stub_->RegisterDaemon(&context, request, &response));
    if (status.ok()) {
      {
        absl::MutexLock lock(&mu_);
        daemon_id_ = response.daemon_id();
        daemon_key_ = response.daemon_key();
        lease_id_ = response.lease_id();
        heartbeat_ms_ = std::max<int64_t>(response.heartbeat_interval_ms(), 50);
        lease_renewed_ = absl::Now();
        lease_ttl_ = absl::Milliseconds(response.lease_ttl_ms() > 0 ? response.lease_ttl_ms() : 3 * heartbeat_ms_);
      }
      Log(LogLevel::kInfo, kComponent,
          absl::StrCat("registered with coordinator ", options_.coordinator_address, " as ", response.daemon_id(),
                       " (lease ", response.lease_ttl_ms(), " ms)"));
      if (options_.on_registered) options_.on_registered(response);
      return absl::OkStatus();
    }
    // ALREADY_EXISTS: the address is still another daemon's (this one's previous process, whose
    // lease has not run out yet).
    const bool retry = status.code() == absl::StatusCode::kUnavailable ||
                       status.code() == absl::StatusCode::kDeadlineExceeded ||
                       status.code() == absl::StatusCode::kAlreadyExists;
    if (!retry) return Annotate(status, "registering with the coordinator");
    if (absl::Now() + backoff >= deadline) {
      return absl::UnavailableError(absl::StrCat("the coordinator at ", options_.coordinator_address,
                                                 " did not answer: ", status.message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

void CoordinatorLink::RunHeartbeat() {
  while (true) {
    int64_t period_ms;
    {
      absl::MutexLock lock(&mu_);
      period_ms = heartbeat_ms_;
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(period_ms));
      if (stopping_) return;
    }
    v1::HeartbeatRequest request;
    {
      absl::MutexLock lock(&mu_);
      request.set_daemon_id(daemon_id_);
      request.set_lease_id(lease_id_);
    }
    if (options_.report) options_.report(&request);
    ::grpc::ClientContext context;
    const absl::Time sent = absl::Now();  // the coordinator renews the lease after this
    SetDeadline(&context, sent + options_.call_timeout);
    v1::HeartbeatResponse response;
    const absl::Status status = FromGrpcStatus(stub_->Heartbeat(&context, request, &response));
    if (status.code() == absl::StatusCode::kNotFound) {
      Log(LogLevel::kWarning, kComponent, absl::StrCat("lease lost (", status.message(), "): registering again"));
      if (absl::Status s = Register(absl::Now() + options_.call_timeout); !s.ok()) {
        Log(LogLevel::kWarning, kComponent, absl::StrCat("re-registration failed: ", s.ToString()));
      }
    } else if (!status.ok()) {
      Log(LogLevel::kWarning, kComponent, absl::StrCat("heartbeat failed: ", status.ToString()));
    } else {
      absl::MutexLock lock(&mu_);
      lease_renewed_ = sent;
      if (response.lease_ttl_ms() > 0) lease_ttl_ = absl::Milliseconds(response.lease_ttl_ms());
    }
  }
}

void CoordinatorLink::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  v1::DeregisterDaemonRequest request;
  {
    absl::MutexLock lock(&mu_);
    request.set_daemon_id(daemon_id_);
    request.set_lease_id(lease_id_);
  }
  ::grpc::ClientContext context;
  SetDeadline(&context, absl::Now() + options_.call_timeout);
  v1::DeregisterDaemonResponse response;
  const absl::Status status = FromGrpcStatus(stub_->DeregisterDaemon(&context, request, &response));
  if (!status.ok()) Log(LogLevel::kWarning, kComponent, absl::StrCat("deregistration failed: ", status.ToString()));
}

absl::Status CoordinatorLink::Put(const std::string& key, const std::string& value, absl::Duration ttl) {
  v1::KvPutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  // Retried while the coordinator is unreachable (restarting), up to one call timeout: a peer
  // group's rendezvous must not fail a step because of a coordinator blip.
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  while (true) {
    ::grpc::ClientContext context;
    SetDeadline(&context, deadline);
    v1::KvPutResponse response;
    const absl::Status status = FromGrpcStatus(stub_->KvPut(&context, request, &response));
    if (status.code() != absl::StatusCode::kUnavailable || absl::Now() + absl::Milliseconds(200) >= deadline) {
      return Annotate(status, absl::StrCat("KvPut ", key));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

absl::StatusOr<std::string> CoordinatorLink::Get(const std::string& key, absl::Time deadline) {
  while (true) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("KvGet ", key, ": the key did not appear before the deadline"));
    }
    const absl::Time slice = std::min(deadline, now + absl::Seconds(5));
    v1::KvGetRequest request;
    request.set_key(key);
    request.set_wait_ms(std::max<int64_t>(absl::ToInt64Milliseconds(slice - now), 1));
    ::grpc::ClientContext context;
    SetDeadline(&context, slice + absl::Seconds(1));
    v1::KvGetResponse response;
    const absl::Status status = FromGrpcStatus(stub_->KvGet(&context, request, &response));
    if (status.ok() && response.entries_size() > 0) return response.entries(0).value();
    if (!status.ok() && status.code() != absl::StatusCode::kNotFound &&
        status.code() != absl::StatusCode::kDeadlineExceeded && status.code() != absl::StatusCode::kUnavailable) {
      return Annotate(status, absl::StrCat("KvGet ", key));
    }
    if (status.code() == absl::StatusCode::kUnavailable) absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::StatusOr<int64_t> CoordinatorLink::RaiseCounter(const std::string& key, int64_t at_least, absl::Time deadline) {
  while (true) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("KV counter ", key, ": the coordinator did not answer in time"));
    }
    v1::KvGetRequest get;
    get.set_key(key);
    v1::KvGetResponse current;
    {
      ::grpc::ClientContext context;
      SetDeadline(&context, std::min(deadline, absl::Now() + options_.call_timeout));
      const absl::Status status = FromGrpcStatus(stub_->KvGet(&context, get, &current));
      if (status.code() == absl::StatusCode::kUnavailable) {
        absl::SleepFor(absl::Milliseconds(100));  // the coordinator restarts: retry until the deadline
        continue;
      }
      if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
        return Annotate(status, absl::StrCat("KvGet ", key));
      }
    }
    int64_t value = 0, version = 0;
    if (current.entries_size() > 0) {
      version = current.entries(0).version();
      if (!absl::SimpleAtoi(current.entries(0).value(), &value)) {
        return absl::InvalidArgumentError(absl::StrCat("KV counter ", key, " does not hold an integer"));
      }
    }
    if (value >= at_least) return value;
    v1::KvPutRequest put;
    put.set_key(key);
    put.set_value(absl::StrCat(at_least));
    put.set_expected_version(version);  // 0: only if still absent
    v1::KvPutResponse response;
    ::grpc::ClientContext context;
    SetDeadline(&context, std::min(deadline, absl::Now() + options_.call_timeout));
    const absl::Status status = FromGrpcStatus(stub_->KvPut(&context, put, &response));
    if (status.ok() && response.applied()) return at_least;
    if (!status.ok() && status.code() != absl::StatusCode::kUnavailable) return Annotate(status, absl::StrCat("KvPut ", key));
    // Another member raised it meanwhile (or the coordinator blinked): read again.
  }
}

absl::StatusOr<v1::CheckpointInfo> CoordinatorLink::CreateCheckpoint(const std::string& job_id,
                                                                     const std::string& admin_token,
                                                                     absl::Time deadline) {
  v1::CreateCheckpointRequest request;
  request.set_admin_token(admin_token);
  request.set_job_id(job_id);
  request.set_wait(true);
  ::grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::CreateCheckpointResponse response;
  MAINSTAY_RETURN_IF_ERROR(
      Annotate(FromGrpcStatus(admin_->CreateCheckpoint(&context, request, &response)), "CreateCheckpoint"));
  return response.checkpoint();
}

}  // namespace mainstay::daemon

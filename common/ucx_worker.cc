#include "common/ucx_worker.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "ucs/config/global_opts.h"

namespace mainstay::ucx {
namespace {

thread_local const Worker* progress_thread_of = nullptr;
absl::Mutex log_level_mu(absl::kConstInit);

// After a round that progressed nothing, the progress thread spins (yielding) this long, then
// sleeps on the event fd: 20 ms when idle (an idle worker costs nothing), 200 us with operations
// in flight. It once spun all through a transfer: on two cores that held a core against the
// threads doing the work (the CRC, the peer's progress thread), and 16 MiB pushes and pulls over
// shared memory ran at 0.27 of tag_bw; sleeping between events, 0.3-0.7 (bench/transport_bench).
constexpr auto kSpin = std::chrono::microseconds(200);
constexpr timespec kIdleWait{0, 20'000'000};   // 20 ms
constexpr timespec kActiveWait{0, 200'000};    // 200 us
constexpr absl::Duration kWaitSlice = absl::Milliseconds(5);
// How long a dropped group waits for its cancelled operations before giving them up.
constexpr absl::Duration kDrainTimeout = absl::Seconds(5);

}  // namespace

absl::Status FromUcs(ucs_status_t status, const std::string& what) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_BUSY:
    // Over shared memory, a peer killed mid-transfer takes its segments with it: attaching to
    // one then fails ("Shared memory error"). The peer is gone, like a reset connection.
    case UCS_ERR_SHMEM_SEGMENT:
      return absl::UnavailableError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

// ---------------------------------------------------------------------------------------------
// Endpoint.

Endpoint::~Endpoint() { Close(); }

bool Endpoint::failed() const {
  if (failed_.load()) return true;
  const int64_t pid = watch_pid_.load();
  if (pid <= 0) return false;
  const int64_t now = absl::GetCurrentTimeNanos();
  int64_t last = last_check_ns_.load();
  if (now - last < 50'000'000 || !last_check_ns_.compare_exchange_strong(last, now)) return false;
  if (!ProcessGone(pid)) return false;
  {
    absl::MutexLock lock(&failure_mu_);
    if (failure_.ok()) failure_ = absl::UnavailableError(absl::StrCat("the peer process (pid ", pid, ") exited"));
  }
  peer_exited_.store(true);
  failed_.store(true);
  return true;
}

absl::Status Endpoint::failure() const {
  absl::MutexLock lock(&failure_mu_);
  if (!failure_.ok()) return failure_;
  return failed_.load() ? absl::UnavailableError("the UCX endpoint was closed") : absl::OkStatus();
}

void Endpoint::OnError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* self = static_cast<Endpoint*>(arg);
  absl::Status failure = FromUcs(status, "UCX peer failed");
  if (failure.code() != absl::StatusCode::kUnavailable) failure = absl::UnavailableError(failure.message());
  {
    absl::MutexLock lock(&self->failure_mu_);
    if (self->failure_.ok()) self->failure_ = failure;
  }
  self->failed_.store(true);
  if (self->on_error_) self->on_error_(failure);
}

void Endpoint::Close() {
  {
    absl::MutexLock lock(&close_mu_);  // waits for a send being posted on the endpoint
    if (closed_ || ep_ == nullptr) return;
    closed_ = true;
  }
  {
    absl::MutexLock lock(&failure_mu_);
    if (failure_.ok()) failure_ = absl::UnavailableError("the UCX endpoint was closed");
  }
  failed_.store(true);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep_, &param);
  worker_->Signal();
  if (UCS_PTR_IS_PTR(request)) {
    const bool on_progress_thread = progress_thread_of == worker_;
    while (ucp_request_check_status(request) == UCS_INPROGRESS) {
      if (on_progress_thread) {
        ucp_worker_progress(worker_->worker());
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    ucp_request_free(request);
  }
}

// ---------------------------------------------------------------------------------------------
// Worker.

namespace {

using ContextPtr = std::shared_ptr<std::remove_pointer_t<ucp_context_h>>;

absl::StatusOr<ContextPtr> NewContext(const std::string& name) {
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return FromUcs(s, "reading the UCX configuration (UCX_* environment variables)");
  }
  // A peer cut off without a reset (a partition) must fail its transfers in seconds, as gRPC's
  // 5 s keepalive pings do, not after UCX's default interval; UCX_KEEPALIVE_INTERVAL overrides.
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) ucp_config_modify(config, "KEEPALIVE_INTERVAL", "2s");
  // Every worker is shared by its progress thread and the threads that post transfers
  // (UCS_THREAD_MODE_MULTI). UCX's default lock is a spin lock, and the progress thread holds it
  // through a rendezvous chunk's copy (hundreds of microseconds): the posting threads spun for
  // it, 25 % of both cores in a 256M step on 2 vCPUs. A mutex sleeps instead (benchmarks.md,
  // "UCX's worker lock"): the worker's lock becomes a recursive pthread mutex, and the context's
  // (shared by its workers, mt_workers_shared) a plain one. UCX_USE_MT_MUTEX in the environment
  // overrides (a ucx.conf setting does not).
  if (std::getenv("UCX_USE_MT_MUTEX") == nullptr) ucp_config_modify(config, "USE_MT_MUTEX", "y");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = name.c_str();
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  const ucs_status_t init = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (init != UCS_OK) return FromUcs(init, "ucp_init (no usable UCX transport? check UCX_TLS)");
  return ContextPtr(context, [](ucp_context_h c) { ucp_cleanup(c); });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(Options options) {
  std::unique_ptr<Worker> w(new Worker());
  w->options_ = std::move(options);
  if (w->options_.share_context_of != nullptr) {
    w->context_ = w->options_.share_context_of->context_;
  } else {
    absl::StatusOr<ContextPtr> context = NewContext(w->options_.name);
    if (!context.ok()) return context.status();
    w->context_ = *std::move(context);
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  if (ucs_status_t s = ucp_worker_create(w->context_.get(), &wp, &w->worker_); s != UCS_OK) {
    return FromUcs(s, "ucp_worker_create");
  }
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  if (ucp_worker_query(w->worker_, &attr) == UCS_OK && attr.thread_mode != UCS_THREAD_MODE_MULTI) {
    return absl::FailedPreconditionError("this UCX library was built without multi-thread support (--enable-mt)");
  }
  ucp_address_t* address = nullptr;
  size_t length = 0;
  if (ucs_status_t s = ucp_worker_get_address(w->worker_, &address, &length); s != UCS_OK) {
    return FromUcs(s, "ucp_worker_get_address");
  }
  w->address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(w->worker_, address);
  if (ucs_status_t s = ucp_worker_get_efd(w->worker_, &w->event_fd_); s != UCS_OK) {
    return FromUcs(s, "ucp_worker_get_efd");
  }
  Worker* raw = w.get();
  w->thread_ = std::thread([raw] { raw->Loop(); });
  return w;
}

Worker::~Worker() {
  stop_.store(true);
  if (thread_.joinable()) {
    Signal();
    thread_.join();
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
}

std::string Worker::Describe() const {
  const char* tls = std::getenv("UCX_TLS");
  return absl::StrCat("UCX ", ucp_get_version_string(), ", UCX_TLS=", tls == nullptr ? "all" : tls);
}

void Worker::RunOnProgressThread(std::function<void()> task) {
  {
    absl::MutexLock lock(&tasks_mu_);
    tasks_.push_back(std::move(task));
  }
  Signal();
}

void Worker::Signal() {
  if (worker_ != nullptr) ucp_worker_signal(worker_);
}

void Worker::Loop() {
  progress_thread_of = this;
  auto idle_since = std::chrono::steady_clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    const unsigned progressed = ucp_worker_progress(worker_);
    if (options_.after_progress) options_.after_progress();
    std::vector<std::function<void()>> tasks;
    {
      absl::MutexLock lock(&tasks_mu_);
      tasks.swap(tasks_);
    }
    for (auto& task : tasks) task();
    if (!tasks.empty()) continue;
    const auto now = std::chrono::steady_clock::now();
    if (progressed != 0) {
      idle_since = now;
      continue;
    }
    if (now - idle_since < kSpin) {
      std::this_thread::yield();
      continue;
    }
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress them
    pollfd fd{event_fd_, POLLIN, 0};
    // With operations in flight, wake up soon even without an event: the event fd does not
    // fire for everything (e.g. a TCP socket becoming writable again mid-transfer).
    const timespec wait = active_.load(std::memory_order_relaxed) > 0 ? kActiveWait : kIdleWait;
    ppoll(&fd, 1, &wait, nullptr);
    idle_since = std::chrono::steady_clock::now();
  }
  progress_thread_of = nullptr;
}

absl::StatusOr<std::shared_ptr<Endpoint>> Worker::Connect(const std::string& remote_address,
                                                          std::function<void(const absl::Status&)> on_error) {
  if (remote_address.empty()) return absl::InvalidArgumentError("the peer advertised no UCX worker address");
  auto endpoint = std::shared_ptr<Endpoint>(new Endpoint());
  endpoint->worker_ = this;
  endpoint->on_error_ = std::move(on_error);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(remote_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Endpoint::OnError;
  params.err_handler.arg = endpoint.get();
  ucs_status_t created;
  {
    // UCX logs an ERROR when peer-failure detection is not available over the transports in
    // common; that is an expected outcome here (handled below), not an error to show users.
    absl::MutexLock lock(&log_level_mu);
    const ucs_log_level_t level = ucs_global_opts.log_component.log_level;
    if (level <= UCS_LOG_LEVEL_WARN) ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_FATAL;
    created = ucp_ep_create(worker_, &params, &endpoint->ep_);
    ucs_global_opts.log_component.log_level = level;
  }
  if (created == UCS_ERR_UNREACHABLE) {
    // Only transports without peer-failure detection in common (shared memory, UCX 1.13):
    // connect without it; the caller watches the peer process instead.
    params.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    endpoint->peer_errors_ = false;
    created = ucp_ep_create(worker_, &params, &endpoint->ep_);
  }
  if (ucs_status_t s = created; s != UCS_OK) {
    endpoint->ep_ = nullptr;
    return FromUcs(s, "connecting to the peer's UCX worker (no transport in common? check UCX_TLS on both ends)");
  }
  Signal();
  return endpoint;
}

// ---------------------------------------------------------------------------------------------
// OpGroup.

// Requests are freed here, not by their callbacks: CancelAndDrain may cancel a receive that has
// just completed on another thread (a forced endpoint close purges its rendezvous receives),
// which is harmless only while the request is still allocated. An abandoned group's state (see
// CancelAndDrain) is never freed: a late callback may still write into it.
OpGroup::~OpGroup() {
  if (!CancelAndDrain()) {
    (void)s_.release();
    return;
  }
  for (Slot& slot : s_->slots) {
    if (slot.request != nullptr) ucp_request_free(slot.request);
  }
}

void OpGroup::OnSend(void*, ucs_status_t status, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  Complete(slot, status, 0);
}

void OpGroup::OnRecv(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  Complete(slot, status, info != nullptr ? info->length : 0);
}

void OpGroup::Complete(Slot* slot, ucs_status_t status, size_t length) {
  State& s = *slot->state;
  absl::MutexLock lock(&s.mu);
  if (!s.abandoned) s.worker->AddActive(-1);  // (a given-up operation was counted out already)
  slot->done = true;
  slot->length = length;
  --s.pending;
  if (status != UCS_OK && s.error.ok()) {
    s.error = FromUcs(status, slot->is_recv ? "UCX receive" : "UCX send");
  }
}

void OpGroup::Track(Slot* slot, ucs_status_ptr_t result, const char* what) {
  if (UCS_PTR_IS_PTR(result)) {
    slot->request = result;  // the callback may already have run: it does not read this
  } else {
    worker_->AddActive(-1);
    absl::MutexLock lock(&s_->mu);
    --s_->pending;  // completed at once (or failed to post): no callback comes
    slot->done = true;
    if (UCS_PTR_IS_ERR(result) && s_->error.ok()) s_->error = FromUcs(UCS_PTR_STATUS(result), what);
  }
  worker_->Signal();
}

OpGroup::Slot* OpGroup::NewSlot(bool is_recv) {
  Slot* slot = &s_->slots.emplace_back();
  slot->state = s_.get();
  slot->is_recv = is_recv;
  if (is_recv) s_->recvs.push_back(slot);
  {
    absl::MutexLock lock(&s_->mu);
    ++s_->pending;
  }
  worker_->AddActive(1);
  return slot;
}

void OpGroup::Send(const Endpoint& ep, uint64_t tag, const void* data, size_t size) {
  Slot* slot = NewSlot(/*is_recv=*/false);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OpGroup::OnSend;
  param.user_data = slot;
  // Another thread may Close the endpoint at any time (a failed attempt on the same
  // connection): the send is posted under the endpoint's lock, or not at all once it is closed.
  absl::ReaderMutexLock lock(&ep.close_mu_);
  if (ep.closed_ || ep.ep_ == nullptr) {
    Track(slot, UCS_STATUS_PTR(UCS_ERR_CONNECTION_RESET), "UCX send on a closed endpoint");
    return;
  }
  Track(slot, ucp_tag_send_nbx(ep.ep_, data, size, tag, &param), "UCX send");
}

void OpGroup::Recv(uint64_t tag, uint64_t mask, void* data, size_t size) {
  Slot* slot = NewSlot(/*is_recv=*/true);
  // Always through the callback (UCX 1.13 leaves recv_info unset for some immediate
  // completions, so the length and tag would be lost).
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &OpGroup::OnRecv;
  param.user_data = slot;
  ucs_status_ptr_t result = ucp_tag_recv_nbx(worker_->worker(), data, size, tag, mask, &param);
  Track(slot, result, "UCX receive");
}

absl::Status OpGroup::Wait(absl::Time deadline, const std::function<absl::Status()>& abort) {
  State* s = s_.get();
  return WaitFor([s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->pending == 0; }, deadline, abort);
}

absl::Status OpGroup::WaitRecv(size_t index, absl::Time deadline, const std::function<absl::Status()>& abort) {
  const Slot* slot = s_->recvs.at(index);
  State* s = s_.get();
  return WaitFor([s, slot]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return slot->done; }, deadline, abort);
}

absl::Status OpGroup::WaitFor(const std::function<bool()>& finished, absl::Time deadline,
                              const std::function<absl::Status()>& abort) {
  State& s = *s_;
  auto done = [&s, &finished]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return finished() || !s.error.ok(); };
  while (true) {
    {
      absl::MutexLock lock(&s.mu);
      s.mu.AwaitWithDeadline(absl::Condition(&done), std::min(deadline, absl::Now() + kWaitSlice));
      if (!s.error.ok()) return s.error;
      if (finished()) return absl::OkStatus();
    }
    if (abort) {
      if (absl::Status st = abort(); !st.ok()) return st;
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("the UCX transfer did not finish in time");
  }
}

size_t OpGroup::received_bytes(size_t index) const { return s_->recvs.at(index)->length; }

bool OpGroup::CancelAndDrain() {
  State& s = *s_;
  {
    absl::MutexLock lock(&s.mu);
    if (s.pending == 0) return true;
  }
  // Sends are cancelled too (where UCX can). An operation may still complete between the check
  // and the cancel (on the progress thread, or on a thread force-closing an endpoint);
  // cancelling a completed one does nothing, and its request stays allocated until the
  // destructor.
  // The task reads this group: it must have run before the group can go, even when every
  // operation completes on its own meanwhile.
  auto ran = std::make_shared<absl::Notification>();
  worker_->RunOnProgressThread([this, ran] {
    for (Slot& slot : s_->slots) {
      bool done;
      {
        absl::MutexLock lock(&s_->mu);
        done = slot.done;
      }
      if (!done && slot.request != nullptr) ucp_request_cancel(worker_->worker(), slot.request);
    }
    ran->Notify();
  });
  ran->WaitForNotification();
  absl::MutexLock lock(&s.mu);
  auto drained = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.pending == 0; };
  if (s.mu.AwaitWithTimeout(absl::Condition(&drained), kDrainTimeout)) return true;
  // Over shared memory (UCX 1.13, no peer-failure detection there), sends queued to a peer that
  // died never complete: not when their endpoint is force-closed, not when cancelled (seen in
  // CI: transport_fault_test_ucx_sm, a push of 131072 chunks cut by a SIGKILL of its daemon,
  // waited here for ever). Their endpoint is closed (the caller's duty), so UCX starts nothing
  // more for them; the group gives them up, and its state stays allocated for good.
  int receives = 0;
  for (const Slot* slot : s.recvs) receives += slot->done ? 0 : 1;
  s.abandoned = true;
  worker_->AddActive(-s.pending);  // the progress thread goes back to its idle rhythm
  std::fprintf(stderr,
               "mainstay ucx: gave up %d operation(s) (%d receive(s)) still in flight %s after their cancellation; "
               "their bookkeeping is leaked\n",
               s.pending, receives, absl::FormatDuration(kDrainTimeout).c_str());
  return false;
}

}  // namespace mainstay::ucx

#include "server/peer/gloo_peer_group.h"

#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "gloo/allreduce.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/attr.h"
#include "gloo/transport/tcp/device.h"

namespace mainstay::peer {
namespace {

// While a member waits for the others' addresses, its abort check runs this often.
constexpr absl::Duration kAbortCheckEvery = absl::Milliseconds(250);

// Gloo's I/O errors do not say "timeout" with a type, only with words: "Timed out waiting
// ...", "Connect timeout", "Read timeout", "Application timeout caused pair closure".
bool IsTimeoutMessage(const std::string& message) {
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

// Turns whatever Gloo threw into a Status (see the header for the codes).
absl::Status StatusFromException(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const gloo::IoException& e) {
    const std::string message = e.what();
    return absl::Status(
        IsTimeoutMessage(message) ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kUnavailable,
        absl::StrCat("gloo: ", message));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(absl::StrCat("gloo: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gloo: ", e.what()));
  } catch (...) {
    return absl::InternalError("gloo: unknown exception");
  }
}

// Gloo takes whole milliseconds, and 0 means "no timeout" in places: round up, at least 1.
std::chrono::milliseconds GlooTimeout(absl::Duration left) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)))));
}

// Debian's Gloo checks getaddrinfo() only for -1 and walks an uninitialized result list on
// any other failure (EAI_NONAME, EAI_AGAIN): an unresolvable hostname makes CreateDevice spin
// in socket() calls or crash. So the name is resolved here, like Gloo would (the first address
// that binds), and Gloo gets that address as a numeric literal, which it resolves without DNS.
absl::StatusOr<std::string> NumericAddress(const std::string& hostname) {
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* result = nullptr;
  const int rv = getaddrinfo(hostname.c_str(), nullptr, &hints, &result);
  if (rv != 0)
    return absl::FailedPreconditionError(absl::StrCat("cannot resolve '", hostname, "': ", gai_strerror(rv)));
  std::string numeric;
  for (const struct addrinfo* rp = result; rp != nullptr && numeric.empty(); rp = rp->ai_next) {
    const int fd = socket(rp->ai_family, rp->ai_socktype, rp->ai_protocol);
    if (fd == -1) continue;
    const bool bindable = bind(fd, rp->ai_addr, rp->ai_addrlen) == 0;
    close(fd);
    char host[NI_MAXHOST];
    if (bindable && getnameinfo(rp->ai_addr, rp->ai_addrlen, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0) {
      numeric = host;
    }
  }
  freeaddrinfo(result);
  if (numeric.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("no address of '", hostname, "' can be bound on this machine"));
  }
  return numeric;
}

// Gloo throws without freeifaddrs() when the interface has no address (a leak per call), so
// check first; this also gives the caller a message that names the interface.
absl::Status CheckInterface(const std::string& interface) {
  struct ifaddrs* addresses = nullptr;
  if (getifaddrs(&addresses) != 0) return absl::FailedPreconditionError("getifaddrs failed");
  bool found = false;
  for (const struct ifaddrs* a = addresses; a != nullptr && !found; a = a->ifa_next) {
    found = a->ifa_addr != nullptr && interface == a->ifa_name &&
            (a->ifa_addr->sa_family == AF_INET || a->ifa_addr->sa_family == AF_INET6);
  }
  freeifaddrs(addresses);
  if (found) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("network interface '", interface, "' has no IP address"));
}

// Blocks SIGPIPE in this thread while Gloo writes to sockets (see the header), and discards
// a SIGPIPE that Gloo raised meanwhile so it is not delivered when the mask is restored.
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&sigpipe_);
    sigaddset(&sigpipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &sigpipe_, &previous_);
  }
  ~ScopedSigpipeBlock() {
    if (sigismember(&previous_, SIGPIPE) == 1) return;  // the caller blocks it: not ours to touch
    sigset_t pending;
    sigemptyset(&pending);
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const struct timespec zero = {0, 0};
      while (sigtimedwait(&sigpipe_, nullptr, &zero) == -1 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t sigpipe_;
  sigset_t previous_;
};

// Gloo's rendezvous store over the coordinator's KV. Every key is prefixed with the group key,
// so the addresses of an earlier generation are never read by a later one. Gloo reports store
// failures only as exceptions: this records the Status of the first one (status()) and throws
// gloo::IoException, which Create() catches. Used by one thread, for one Create().
class KvRendezvousStore : public gloo::rendezvous::Store {
 public:
  KvRendezvousStore(KvClient* kv, std::string prefix, absl::Duration ttl, absl::Time deadline, const AbortCheck& abort)
      : kv_(kv), prefix_(std::move(prefix)), ttl_(ttl), deadline_(deadline), abort_(abort) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const absl::Status status = kv_->Put(prefix_ + key, std::string(data.begin(), data.end()), ttl_);
    if (!status.ok()) Fail(Annotate(status, absl::StrCat("rendezvous: put '", prefix_, key, "'")));
  }

  std::vector<char> get(const std::string& key) override {
    auto cached = values_.find(key);
    if (cached == values_.end()) {
      Fetch(key, deadline_);
      cached = values_.find(key);
    }
    return std::vector<char>(cached->second.begin(), cached->second.end());
  }

  void wait(const std::vector<std::string>& keys) override { WaitUntil(keys, deadline_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    // Gloo passes the context's timeout (the time Create() had left when it started) and
    // applies it afresh to every wait; never wait beyond Create()'s deadline.
    absl::Time deadline = deadline_;
    if (timeout != gloo::kNoTimeout) deadline = std::min(deadline, absl::Now() + absl::FromChrono(timeout));
    WaitUntil(keys, deadline);
  }

  const absl::Status& status() const { return status_; }

 private:
  void WaitUntil(const std::vector<std::string>& keys, absl::Time deadline) {
    for (const std::string& key : keys) {
      if (values_.count(key) == 0) Fetch(key, deadline);
    }
  }

  void Fetch(const std::string& key, absl::Time deadline) {
    absl::StatusOr<std::string> value;
    while (true) {
      // In slices, with the caller's abort check between them (a member that will not come).
      value = kv_->Get(prefix_ + key, abort_ ? std::min(deadline, absl::Now() + kAbortCheckEvery) : deadline);
      const bool missing = absl::IsNotFound(value.status()) || absl::IsDeadlineExceeded(value.status());
      if (!missing || absl::Now() >= deadline || !abort_) break;
      if (absl::Status aborted = abort_(); !aborted.ok()) {
        Fail(Annotate(aborted, absl::StrCat("rendezvous: left while waiting for '", prefix_, key, "'")));
      }
    }
    if (value.ok()) {
      values_[key] = *std::move(value);
      return;
    }
    // A real KV answers NOT_FOUND for a key still missing after its wait (coordinator.proto).
    if (absl::IsNotFound(value.status()) || absl::IsDeadlineExceeded(value.status())) {
      Fail(absl::DeadlineExceededError(
          absl::StrCat("rendezvous: '", prefix_, key,
                       "' was not published by the deadline (a member did not join): ", value.status().message())));
    }
    Fail(Annotate(value.status(), absl::StrCat("rendezvous: get '", prefix_, key, "'")));
  }

  [[noreturn]] void Fail(absl::Status status) {
    if (status_.ok()) status_ = status;
    throw gloo::IoException(std::string(status.message()));
  }

  KvClient* const kv_;
  const std::string prefix_;
  const absl::Duration ttl_;
  const absl::Time deadline_;
  const AbortCheck& abort_;
  std::map<std::string, std::string> values_;  // read by wait(), returned by get()
  absl::Status status_;
};

enum class ReduceKind : int64_t { kSum = 1, kMax = 2 };

template <typename T>
void SumInto(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

template <typename T>
void MaxInto(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      o[i] = std::fmax(x[i], y[i]);
    } else {
      o[i] = std::max(x[i], y[i]);
    }
  }
}

class GlooPeerGroup : public PeerGroup {
 public:
  GlooPeerGroup(std::string key, int rank, int size, std::shared_ptr<gloo::rendezvous::Context> context)
      : key_(std::move(key)), rank_(rank), size_(size), context_(std::move(context)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(std::span<double> values, absl::Time deadline) override {
    return Reduce(values, ReduceKind::kSum, &SumInto<double>, sum_scratch_, deadline);
  }
  absl::Status AllReduceMax(std::span<float> values, absl::Time deadline) override {
    return Reduce(values, ReduceKind::kMax, &MaxInto<float>, max_scratch_, deadline);
  }

 private:
  // Gloo's ring needs the same length on every member and does not check it: with 3 values
  // on rank 0 and 4 on rank 1, rank 0 returns success with a wrong sum and rank 1 fails when
  // rank 0 moves on (seen with Debian's Gloo). So each reduction first reduces a 4-value
  // header (max of [n, -n, kind, -kind]: the largest and smallest length and kind) and only
  // then the values; the header costs one small extra allreduce per call. Results go through
  // a scratch buffer owned by the group so the caller's values change only on success, and
  // a transfer still in flight after a failure writes into memory that is still ours.
  template <typename T>
  absl::Status Reduce(std::span<T> values, ReduceKind kind, gloo::AllreduceOptions::Func fn, std::vector<T>& scratch,
                      absl::Time deadline) {
    if (!failure_.ok()) return failure_;
    ScopedSigpipeBlock sigpipe_blocked;
    const int64_t n = static_cast<int64_t>(values.size());
    const int64_t k = static_cast<int64_t>(kind);
    header_ = {n, -n, k, -k};
    absl::Status status = RunAllreduce(header_.data(), header_.size(), &MaxInto<int64_t>, deadline);
    if (!status.ok()) return Break(status);
    if (header_[0] != n || -header_[1] != n || header_[2] != k || -header_[3] != k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "peer group '", key_, "' member ", rank_, ": members disagree on the reduction (lengths from ", -header_[1],
          " to ", header_[0], ", kinds ", -header_[3], " to ", header_[2], "; 1 = sum of doubles, 2 = max of floats)"));
    }
    if (n == 0) return absl::OkStatus();
    scratch.assign(values.begin(), values.end());
    status = RunAllreduce(scratch.data(), scratch.size(), fn, deadline);
    if (!status.ok()) return Break(status);
    std::copy(scratch.begin(), scratch.end(), values.begin());
    return absl::OkStatus();
  }

  template <typename T>
  absl::Status RunAllreduce(T* data, size_t elements, gloo::AllreduceOptions::Func fn, absl::Time deadline) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      // Not taking part would leave the others waiting in this reduction: the group is over.
      return absl::DeadlineExceededError("the deadline passed before the reduction started");
    }
    try {
      gloo::AllreduceOptions options(context_);
      // The ring (not bcube): reduce-scatter then allgather, so each element is reduced on
      // one member and copied to the rest, bit-identical everywhere (see the header).
      options.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      options.setOutput(data, elements);
      options.setReduceFunction(std::move(fn));
      options.setTag(next_tag_++);
      options.setTimeout(GlooTimeout(left));
      gloo::allreduce(options);
    } catch (...) {
      return StatusFromException(std::current_exception());
    }
    return absl::OkStatus();
  }

  absl::Status Break(const absl::Status& status) {
    failure_ = Annotate(status, absl::StrCat("peer group '", key_, "' member ", rank_, " (group broken)"));
    return failure_;
  }

  const std::string key_;
  const int rank_;
  const int size_;
  // Buffers Gloo reads and writes: declared before context_ so they outlive the connections.
  std::array<int64_t, 4> header_ = {};
  std::vector<double> sum_scratch_;
  std::vector<float> max_scratch_;
  const std::shared_ptr<gloo::rendezvous::Context> context_;  // owns the pairs and the device
  uint32_t next_tag_ = 0;
  absl::Status failure_;  // sticky once set
};

}  // namespace

GlooPeerGroupFactory::GlooPeerGroupFactory(KvClient* kv, GlooPeerGroupOptions options)
    : kv_(kv), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<PeerGroup>> GlooPeerGroupFactory::Create(const std::string& group_key, int rank,
                                                                        int size, absl::Time deadline,
                                                                        const AbortCheck& abort) {
  if (group_key.empty()) return absl::InvalidArgumentError("peer group: empty group_key");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("peer group '", group_key, "': rank ", rank, " of size ", size));
  }
  if (size == 1) return std::make_unique<LocalPeerGroup>();
  const std::string where = absl::StrCat("peer group '", group_key, "' member ", rank);
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration())
    return absl::DeadlineExceededError(absl::StrCat(where, ": deadline already passed"));

  gloo::transport::tcp::attr attr;
  if (!options_.interface.empty()) {
    MAINSTAY_RETURN_IF_ERROR(Annotate(CheckInterface(options_.interface), where));
    attr.iface = options_.interface;
  } else {
    absl::StatusOr<std::string> address = NumericAddress(options_.hostname);
    if (!address.ok()) return Annotate(address.status(), where);
    attr.hostname = *std::move(address);
  }

  // Gloo's event thread starts inside CreateDevice and inherits this thread's signal mask.
  ScopedSigpipeBlock sigpipe_blocked;
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (...) {
    const absl::Status error = StatusFromException(std::current_exception());
    return absl::FailedPreconditionError(absl::StrCat(where, ": cannot listen on hostname '", options_.hostname,
                                                      "' / interface '", options_.interface, "': ", error.message()));
  }

  KvRendezvousStore store(kv_, group_key + "/", options_.kv_ttl, deadline, abort);
  std::shared_ptr<gloo::rendezvous::Context> context;
  try {
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(GlooTimeout(left));
    context->connectFullMesh(store, device);
  } catch (...) {
    // The store's own Status says more than the exception it threw to get out of Gloo.
    const absl::Status error = store.status().ok() ? StatusFromException(std::current_exception()) : store.status();
    return Annotate(error, where);
  }
  return std::make_unique<GlooPeerGroup>(group_key, rank, size, std::move(context));
}

absl::StatusOr<int64_t> GlooPeerGroupFactory::Generation(const std::string& base_key, int64_t at_least,
                                                        absl::Time deadline) {
  absl::StatusOr<int64_t> generation = kv_->RaiseCounter(base_key + "/generation", at_least, deadline);
  if (!generation.ok()) return Annotate(generation.status(), absl::StrCat("peer group ", base_key, ": generation"));
  return generation;
}

}  // namespace mainstay::peer

// Waiting calls without a thread each (DESIGN.md section 8: every per-caller resource is
// bounded). A call that must wait for the core (a PullParams of a version not yet published, a
// FinishStep of a step not yet decided, the coordinator's WatchPlacement and KvGet with wait_ms)
// is parked here instead of blocking a thread. One thread re-runs the parked calls of a key (a
// job, or the coordinator's state) when the core says the key changed (Notify), and every
// parked call every `recheck` as a safety net that also notices cancelled calls and a draining
// server. An attempt asks the core without waiting and either answers its call (done) or stays.
//
// Limits: at most `max_total` parked calls, `max_per_key` per key and `max_per_peer` per client
// host; beyond one of them Park is RESOURCE_EXHAUSTED naming its flag, and nothing is parked. No
// call stays parked past `max_wait`: its last attempt is then told so (kServerLimit), and the
// adapters answer UNAVAILABLE ("call again"), which every client retries.
//
// Thread safety: thread-safe. Attempts run on the waiter thread (or, for the first one, on the
// caller's), never under the registry's lock, so they may call into the core, and the core may
// call Notify from under its own locks.
#ifndef MAINSTAY_SERVER_GRPC_WAITERS_H_
#define MAINSTAY_SERVER_GRPC_WAITERS_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mainstay::grpc_server {

class Waiters {
 public:
  struct Options {
    int64_t max_total = 16384;
    int64_t max_per_key = 8192;
    int64_t max_per_peer = 8192;
    absl::Duration max_wait = absl::Minutes(10);
    absl::Duration recheck = absl::Milliseconds(500);
    // The flags that set the limits, named in RESOURCE_EXHAUSTED messages.
    std::string total_flag = "--max-waiting-calls";
    std::string per_key_flag = "--max-waiting-calls-per-job";
    std::string per_peer_flag = "--max-waiting-calls-per-peer";
    std::string max_wait_flag = "--max-wait-ms";
  };

  // Why an attempt runs. kChanged: the key changed, or the periodic recheck (the attempt may
  // stay parked by returning false). The others are final: the attempt must answer its call.
  enum class Why {
    kChanged,
    kDeadline,     // the call's own deadline passed
    kServerLimit,  // it waited max_wait
    kStopping,     // Shutdown
  };
  // Answers the call and returns true, or returns false to stay parked (kChanged only).
  using Attempt = std::function<bool(Why)>;

  explicit Waiters(Options options);
  ~Waiters();  // Shutdown()
  Waiters(const Waiters&) = delete;
  Waiters& operator=(const Waiters&) = delete;

  // Parks a call whose first attempt did not finish it, until an attempt does. `peer` is the
  // client's address as gRPC gives it ("ipv4:10.0.0.1:5555"; the port is ignored). Not
  // parked: RESOURCE_EXHAUSTED over a limit, UNAVAILABLE after Shutdown; the caller answers
  // its call with that status.
  absl::Status Park(const std::string& key, absl::string_view peer, absl::Time deadline, Attempt attempt);
  // Re-runs the attempts parked under `key` soon (on the waiter thread).
  void Notify(const std::string& key);
  // Re-runs every parked attempt soon.
  void NotifyAll();
  // Ends every parked call (kStopping) and joins the thread; later Parks are UNAVAILABLE.
  // Idempotent.
  void Shutdown();

  int64_t parked() const;
  const Options& options() const { return options_; }

 private:
  struct Entry {
    std::string key;
    std::string host;
    absl::Time deadline;   // the call's
    absl::Time give_up;    // min(deadline, parked + max_wait)
    Attempt attempt;
  };
  using Entries = std::list<Entry>;

  void Loop();
  // Removes `it` (under mu_).
  void EraseLocked(Entries::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  Entries entries_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> per_key_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> per_host_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> changed_ ABSL_GUARDED_BY(mu_);  // keys notified since the last round
  bool all_changed_ ABSL_GUARDED_BY(mu_) = false;       // NotifyAll since the last round
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// The host part of a gRPC peer string: "ipv4:10.0.0.1:5555" -> "10.0.0.1",
// "ipv6:[::1]:5555" -> "::1"; anything else as it is.
std::string PeerHost(absl::string_view peer);

}  // namespace mainstay::grpc_server

#endif  // MAINSTAY_SERVER_GRPC_WAITERS_H_

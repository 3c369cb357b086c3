// A UCP context and worker with a progress thread, shared by the trainer's UCX transport
// (client/src/ucx_transport.cc) and the daemon's UCX data server (server/ucx/). Built only
// with UCX (MAINSTAY_HAVE_UCX); nothing outside those two files includes it.
//
// Model: every UCP call may come from any thread (the worker is created multi-threaded); one
// progress thread drives completions, spinning briefly and then sleeping on the worker's event
// fd. A posted operation belongs to an OpGroup, which its owner waits on; callbacks only count.
//
// Tags (64 bits): the top byte is the message kind. Messages to a daemon carry the daemon-given
// connection id (24 bits) and the trainer's request sequence (32 bits); messages to a trainer
// carry the request sequence (56 bits), which is unique within the trainer's worker.
//
// Ownership: Worker owns the context, the worker and the progress thread; Endpoint owns a UCP
// endpoint (closed, forcibly, by Close or the destructor). An OpGroup must be destroyed (or
// Wait must have returned after all completions) before the buffers its operations use.
// Thread safety: Worker and Endpoint methods are thread-safe; an OpGroup belongs to one thread.
#ifndef MAINSTAY_COMMON_UCX_WORKER_H_
#define MAINSTAY_COMMON_UCX_WORKER_H_

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/process_identity.h"

namespace mainstay::ucx {

enum class Kind : uint8_t {
  kHello = 1,        // trainer -> daemon: UcxHello
  kHelloReply = 2,   // daemon -> trainer: UcxHelloReply
  kRequest = 3,      // trainer -> daemon: UcxRequest
  kAccept = 4,       // daemon -> trainer: UcxReply accepting (or refusing) a push
  kReply = 5,        // daemon -> trainer: UcxReply with a push's outcome or a pull's header
  kPushData = 6,     // trainer -> daemon: gradient payload chunks
  kPullData = 7,     // daemon -> trainer: parameter data chunks
  kPullScales = 8,   // daemon -> trainer: block scales, one message
  kPushTrailer = 9,  // trainer -> daemon: PushGradTrailer after a push's payload
};

inline constexpr uint64_t kKindMask = uint64_t{0xff} << 56;
inline constexpr uint64_t kExactMask = ~uint64_t{0};
inline constexpr size_t kMaxControlBytes = 64 << 10;  // control messages (hello, request, reply)

// Payload chunking, the same on both ends: a request carries the trainer's chunk size.
inline constexpr int64_t kMinChunkBytes = int64_t{1} << 10;
inline constexpr int64_t kMaxChunkBytes = int64_t{64} << 20;
// Push chunks hold whole gradient elements.
inline int64_t PushChunkBytes(int64_t chunk_bytes, int element_bytes) {
  return std::max<int64_t>(1, chunk_bytes / element_bytes) * element_bytes;
}
// Pull chunks are multiples of 8 bytes: whole elements of every format.
inline int64_t PullChunkBytes(int64_t chunk_bytes) { return std::max<int64_t>(8, chunk_bytes - chunk_bytes % 8); }

inline uint64_t DaemonTag(Kind kind, uint32_t connection, uint32_t seq) {
  return (uint64_t{static_cast<uint8_t>(kind)} << 56) | (uint64_t{connection & 0xffffffu} << 32) | seq;
}
inline uint64_t TrainerTag(Kind kind, uint64_t seq) {
  return (uint64_t{static_cast<uint8_t>(kind)} << 56) | (seq & ((uint64_t{1} << 56) - 1));
}
inline uint64_t KindTag(Kind kind) { return uint64_t{static_cast<uint8_t>(kind)} << 56; }
inline uint32_t ConnectionOfTag(uint64_t tag) { return static_cast<uint32_t>(tag >> 32) & 0xffffffu; }
inline uint32_t SeqOfTag(uint64_t tag) { return static_cast<uint32_t>(tag); }

// A UCS status as absl::Status: peer failures are UNAVAILABLE, cancellation CANCELLED,
// truncation INTERNAL. `what` prefixes the message.
absl::Status FromUcs(ucs_status_t status, const std::string& what);

class Worker;

// This process as its peers identify it (common/process_identity.h).
using ::mainstay::ProcessIdentity;

// One UCP endpoint to a remote worker. `failed()` turns true (once) when UCX reports the peer
// gone, or after Close.
class Endpoint {
 public:
  ~Endpoint();
  ucp_ep_h ep() const { return ep_; }
  // Whether UCX reports the peer's failure on this endpoint. UCX 1.13 cannot over shared
  // memory, so an endpoint whose only common transports are shm ones is made without it
  // (Worker::Connect); then WatchProcess, where the peer's pid is visible, stands in.
  bool detects_peer_failure() const { return peer_errors_; }
  // The watched process (WatchProcess) was found gone.
  bool peer_exited() const { return peer_exited_.load(); }
  // Counts the endpoint failed once process `pid` is gone (checked at most every 50 ms, by
  // failed()). For a peer on this host in this pid namespace (SameProcessSpace).
  void WatchProcess(int64_t pid) { watch_pid_.store(pid); }
  bool failed() const;
  absl::Status failure() const;
  // Force-closes the endpoint: every operation on it completes (with an error). Idempotent.
  void Close();

 private:
  friend class Worker;
  friend class OpGroup;  // sends hold close_mu_ shared, so Close never frees the UCP endpoint under one
  static void OnError(void* arg, ucp_ep_h ep, ucs_status_t status);
  Worker* worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  bool peer_errors_ = true;
  std::atomic<int64_t> watch_pid_{0};
  mutable std::atomic<int64_t> last_check_ns_{0};
  mutable std::atomic<bool> failed_{false};
  mutable std::atomic<bool> peer_exited_{false};
  // Two locks: close_mu_ is held shared by senders while they post, and exclusively by Close
  // to mark the endpoint closed; failure_mu_ guards the failure, which UCX's error callback sets
  // on the progress thread (it must not wait for a sender, who may wait for that thread).
  mutable absl::Mutex close_mu_;
  bool closed_ ABSL_GUARDED_BY(close_mu_) = false;
  mutable absl::Mutex failure_mu_;
  mutable absl::Status failure_ ABSL_GUARDED_BY(failure_mu_);
  std::function<void(const absl::Status&)> on_error_;
};

class Worker {
 public:
  struct Options {
    std::string name = "mainstay";  // UCX's name for the context (its logs)
    // Called on the progress thread after each round of progress (the daemon dispatches its
    // incoming messages there). Must not block.
    std::function<void()> after_progress;
    // Another worker whose UCP context this one shares (kept alive by it); null: a context of
    // its own. A process that makes many workers (the daemon: one per connection) shares one,
    // so UCX reads its configuration and opens its transports once, not per worker.
    const Worker* share_context_of = nullptr;
  };
  static absl::StatusOr<std::unique_ptr<Worker>> Create(Options options);
  ~Worker();

  // The worker's address, to be given to peers (opaque bytes).
  const std::string& address() const { return address_; }
  ucp_worker_h worker() const { return worker_; }
  // "tcp", "posix", ...: the transports UCX may use here (UCX_TLS), for logs.
  std::string Describe() const;

  // An endpoint to the worker at `remote_address`, with peer-failure detection; `on_error`
  // (may be empty) runs once on the progress thread when the peer fails.
  absl::StatusOr<std::shared_ptr<Endpoint>> Connect(const std::string& remote_address,
                                                    std::function<void(const absl::Status&)> on_error);
  // Wakes the progress thread (after posting work from another thread).
  void Signal();
  // Operations posted and not complete (OpGroup keeps the count): while any is, the progress
  // thread sleeps on the event fd at most 200 us at a time (the fd does not fire for, e.g., a
  // TCP socket becoming writable again mid-transfer).
  void AddActive(int delta) { active_.fetch_add(delta, std::memory_order_relaxed); }
  // Runs `task` on the progress thread after its next round of progress.
  void RunOnProgressThread(std::function<void()> task);

 private:
  Worker() = default;
  void Loop();

  Options options_;
  std::shared_ptr<std::remove_pointer_t<ucp_context_h>> context_;  // ucp_cleanup when the last user goes
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::atomic<int> active_{0};
  absl::Mutex tasks_mu_;
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(tasks_mu_);
  std::thread thread_;
};

// Operations posted together and waited for together.
class OpGroup {
 public:
  explicit OpGroup(Worker* worker) : worker_(worker), s_(std::make_unique<State>(worker)) {}
  // Cancels what is outstanding and waits for it: buffers are free afterwards. Where UCX never
  // completes an operation (a send queued to a shared-memory peer that died, after its endpoint
  // was closed) the group gives it up after a few seconds, with a line on stderr; UCX is not
  // expected to touch its buffer again (the endpoint is gone), but nothing guarantees it.
  ~OpGroup();

  // Post one operation. A failure to post is remembered and returned by Wait.
  void Send(const Endpoint& ep, uint64_t tag, const void* data, size_t size);
  void Recv(uint64_t tag, uint64_t mask, void* data, size_t size);

  // Waits until every operation completed: OK, or the first error. Gives up at `deadline`
  // (DEADLINE_EXCEEDED) or when `abort` returns an error (checked every few milliseconds);
  // the group's destructor then cancels what is outstanding, and the caller must close the
  // endpoints its sends use before the group is destroyed.
  absl::Status Wait(absl::Time deadline, const std::function<absl::Status()>& abort);
  // Waits, as Wait does, until only the receive posted `index`-th among receives completed (its
  // buffer then holds the message while later operations are still in flight). An error of any
  // operation of the group ends the wait.
  absl::Status WaitRecv(size_t index, absl::Time deadline, const std::function<absl::Status()>& abort);
  // Size of the message that completed the receive posted `index`-th among receives.
  size_t received_bytes(size_t index) const;

 private:
  struct State;
  struct Slot {
    State* state = nullptr;
    void* request = nullptr;  // UCP request, freed by the destructor
    bool is_recv = false;
    bool done = false;
    size_t length = 0;
  };
  // What the callbacks write: on the heap, so that a group that gives operations up can leave
  // it behind for them.
  struct State {
    explicit State(Worker* w) : worker(w) {}
    Worker* const worker;
    std::deque<Slot> slots;  // stable addresses: the callbacks' user data
    std::vector<Slot*> recvs;
    absl::Mutex mu;
    int pending ABSL_GUARDED_BY(mu) = 0;
    absl::Status error ABSL_GUARDED_BY(mu);
    bool abandoned ABSL_GUARDED_BY(mu) = false;  // the group gave its outstanding operations up
  };
  static void OnSend(void* request, ucs_status_t status, void* user_data);
  static void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data);
  static void Complete(Slot* slot, ucs_status_t status, size_t length);
  Slot* NewSlot(bool is_recv);
  void Track(Slot* slot, ucs_status_ptr_t result, const char* what);
  // `finished` is called under s_->mu.
  absl::Status WaitFor(const std::function<bool()>& finished, absl::Time deadline,
                       const std::function<absl::Status()>& abort);
  // Cancels outstanding operations (sends too) and waits for every one to complete: true, or
  // false when some did not within a few seconds (they are given up).
  bool CancelAndDrain();

  Worker* const worker_;
  std::unique_ptr<State> s_;
};

}  // namespace mainstay::ucx

#endif  // MAINSTAY_COMMON_UCX_WORKER_H_

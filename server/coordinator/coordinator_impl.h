// Internal to server/coordinator: the Coordinator's state and helpers, shared by its .cc
// files (membership, jobs, kv). Not a public header.
#ifndef MAINSTAY_SERVER_COORDINATOR_COORDINATOR_IMPL_H_
#define MAINSTAY_SERVER_COORDINATOR_COORDINATOR_IMPL_H_

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/placement.h"
#include "server/coordinator/state.h"

namespace mainstay::coordinator {

inline namespace internal {

inline std::string RandomHex(int bytes) {
  std::string raw(bytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), bytes) != 1) {
    // OpenSSL's CSPRNG failing is not recoverable for a secret.
    Log(LogLevel::kError, "coordinator", "RAND_bytes failed");
    std::abort();
  }
  return absl::BytesToHexString(raw);
}

inline std::string Sha256(const std::string& data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

inline bool HasPrefix(const std::string& s, const std::string& prefix) { return absl::StartsWith(s, prefix); }

}  // namespace internal

// A change under construction: the records of one atomic batch.
struct Batch {
  v1::StateBatch proto;
  void PutDaemon(const v1::DaemonInfo& d) { *proto.add_records()->mutable_put_daemon() = d; }
  void PutJob(const v1::StoredJob& j) { *proto.add_records()->mutable_put_job() = j; }
  void DeleteJob(const std::string& id) { proto.add_records()->set_delete_job(id); }
  void PutKv(const v1::KvEntry& e) { *proto.add_records()->mutable_put_kv() = e; }
  void DeleteKv(const std::string& key) { proto.add_records()->set_delete_kv(key); }
  bool empty() const { return proto.records_size() == 0; }
  bool kv_expiry = false;  // its KV deletions are TTL expiries (KvWatch reports them so)
};

struct Coordinator::Impl {
  CoordinatorOptions options;
  absl::Mutex mu;
  absl::CondVar changed;  // signalled after every commit
  State state ABSL_GUARDED_BY(mu);
  // Leases live in memory only: a restarted coordinator grants every known daemon a grace
  // period of one TTL and answers unknown lease ids NOT_FOUND, so daemons re-register.
  struct Lease {
    std::string id;
    int64_t ttl_ms = 0;
    int64_t expires_ms = 0;  // monotonic (Mono())
    int64_t used_bytes = 0;
    std::vector<v1::DataConnection> connections;  // as of the latest heartbeat
  };
  std::map<std::string, Lease> leases ABSL_GUARDED_BY(mu);
  std::map<std::string, std::string> tokens ABSL_GUARDED_BY(mu);  // job id -> token, for idempotent retries
  // Job progress as the daemons last reported it (memory only): job id -> daemon id -> progress.
  std::map<std::string, std::map<std::string, v1::JobProgress>> progress ABSL_GUARDED_BY(mu);

  // The job's info with the progress of its least advanced reporting daemon; that daemon's
  // stats go to `last_stats` when given.
  v1::JobInfo InfoWithProgress(const v1::StoredJob& job, v1::StepStats* last_stats = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::JobInfo info = job.info();
    *info.mutable_moves() = job.moves();
    auto it = progress.find(info.job_id());
    if (it == progress.end()) return info;
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      auto p = it->second.find(e.daemon_id());
      if (p == it->second.end() || p->second.load_error().empty()) continue;
      v1::DaemonLoadError* error = info.add_load_errors();
      error->set_daemon_id(e.daemon_id());
      error->set_error(p->second.load_error());
    }
    const v1::JobProgress* least = nullptr;
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      auto p = it->second.find(e.daemon_id());
      if (p == it->second.end()) return info;  // a daemon has not reported yet
      if (p->second.loading()) continue;        // a move's target or a restore: no state yet
      if (least == nullptr || p->second.committed_step() < least->committed_step()) least = &p->second;
    }
    if (least == nullptr) return info;
    info.set_progress_known(true);
    info.set_committed_step(least->committed_step());
    info.set_version(std::max<int64_t>(least->version(), 0));
    if (last_stats != nullptr && least->has_last_step_stats()) *last_stats = least->last_step_stats();
    return info;
  }
  int64_t batches_since_snapshot ABSL_GUARDED_BY(mu) = 0;

  // Checkpoints being written (memory only: one whose coordinator died has no manifest and
  // lists as FAILED), and the threads writing those created without `wait`.
  std::map<std::string, v1::CheckpointInfo> checkpoints_in_flight ABSL_GUARDED_BY(mu);
  struct Background {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Background> checkpoint_threads ABSL_GUARDED_BY(mu);
  // Runs `work` on a thread of its own (a background checkpoint), after joining the ones that
  // have finished: a long-lived coordinator keeps only the threads still writing.
  void StartBackgroundLocked(std::function<void()> work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = checkpoint_threads.begin(); it != checkpoint_threads.end();) {
      if (it->done->load()) {
        it->thread.join();  // it has returned from `work`; it takes no lock on its way out
        it = checkpoint_threads.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    checkpoint_threads.push_back({std::thread([work = std::move(work), done] {
                                    work();
                                    done->store(true);
                                  }),
                                  done});
  }
  bool stopping ABSL_GUARDED_BY(mu) = false;
  // Jobs that lost a daemon and wait to be restored from their latest checkpoint.
  std::set<std::string> jobs_to_recover ABSL_GUARDED_BY(mu);
  // Reconciliation (coordinator.cc, Heartbeat; memory only, rebuilt from the next heartbeats
  // after a restart): since when a placed daemon has reported a job behind its placement epoch
  // or not at all, and when its assignment was last re-sent; and, per started job, the live
  // daemons that no longer hold it (they restarted: the job is DEGRADED until it is restored).
  struct Resend {
    int64_t since_ms = 0;
    int64_t last_ms = 0;
  };
  std::map<std::pair<std::string, std::string>, Resend> resends ABSL_GUARDED_BY(mu);  // (job, daemon)
  std::map<std::string, std::set<std::string>> lost_state ABSL_GUARDED_BY(mu);         // job -> daemons

  // coordinator_checkpoints.cc.
  checkpoint::CheckpointFs& Fs() const;
  // Writes checkpoint `info` of its job at `step` or later; returns it COMMITTED or FAILED.
  v1::CheckpointInfo RunCheckpoint(v1::CheckpointInfo info, int64_t step, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu);
  // Every checkpoint on disk and in flight, for one job or all (""), newest first.
  std::vector<v1::CheckpointInfo> ScanCheckpoints(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu);
  // Reassigns every shard of `job` from the checkpoint at a new epoch; ranks whose daemon is
  // not ready move to ready ones.
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreLocked(v1::StoredJob job,  // a copy: Commit replaces the stored one
                                                              const v1::CheckpointManifest& manifest,
                                                              const std::string& dir) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void RecoverJobs() ABSL_LOCKS_EXCLUDED(mu);
  // coordinator.cc: compares the jobs a daemon's heartbeat reports with the placements that
  // name it; re-sends what it lacks, marks jobs started, and recovers jobs it lost.
  void ReconcileLocked(const v1::HeartbeatRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A move's target reports `job` at the move's epoch with nothing loading: the move is done
  // (`batch` gets the job without the move), and the source is to drop the rank: `drops` gets
  // (address, request), which the caller sends once `batch` is saved.
  void FinishMovesLocked(const v1::StoredJob& job, const std::string& daemon_id, const v1::JobProgress& progress,
                         Batch& batch, std::vector<std::pair<std::string, v1::DropShardRequest>>& drops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Registers a checkpoint of the job as WRITING; returns it and the step to write.
  absl::StatusOr<std::pair<v1::CheckpointInfo, int64_t>> BeginCheckpointLocked(const std::string& job_id,
                                                                                bool periodic)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Records the outcome; after a periodic one, applies the retention.
  void EndCheckpoint(const v1::CheckpointInfo& done) ABSL_LOCKS_EXCLUDED(mu);
  absl::Status DeleteFiles(const std::string& checkpoint_id);
  // Starts the periodic checkpoints that are due (options.checkpoint_every_*).
  void RunCheckpointPolicy() ABSL_LOCKS_EXCLUDED(mu);
  // Per job: (step, time) of the last periodic checkpoint, or of when the policy first saw it.
  std::map<std::string, std::pair<int64_t, int64_t>> policy_last ABSL_GUARDED_BY(mu);

  // Per job and daemon, when it last refused the job's shards for lack of memory
  // (AssignmentRefused) or could not allocate them. Re-placing refused ranks and re-replication
  // pass such a daemon over for kRefusalRememberedMs (RecentRefusers), then try it again: it
  // would likely refuse again at once, and each try costs a placement epoch, but its memory may
  // have been freed since (a job deleted), and a drain or fewer than R copies that waits for
  // good is worse than an epoch per try. In memory only.
  std::map<std::string, std::map<std::string, int64_t>> refused_at ABSL_GUARDED_BY(mu);
  static constexpr int64_t kRefusalRememberedMs = 5 * 60 * 1000;
  std::set<std::string> RecentRefusers(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Coordinator::SetChangeListener's; its own lock, taken under mu.
  absl::Mutex listener_mu ABSL_ACQUIRED_AFTER(mu);
  std::function<void()> listener ABSL_GUARDED_BY(listener_mu);

  int64_t Now() const { return options.clock->NowUnixMs(); }
  // Leases run on this: a wall-clock step must not expire (or extend) them.
  int64_t Mono() const { return options.clock->MonotonicMs(); }

  // Writes ahead, then applies. Nothing changes when the store fails. The batch is durable
  // only once a Sync covered it: the StateLock this runs under waits for that before the call
  // answers, and assignments made meanwhile wait in the outbox (group commit, state_store.h).
  absl::Status Commit(Batch& batch, const v1::StateCounters& counters) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    batch.proto.set_sequence(state.sequence + 1);
    *batch.proto.mutable_counters() = counters;
    const int64_t before = Mono();
    absl::Status written = options.store->Write(batch.proto);
    ExtendLeasesAfterStall(Mono() - before, "a state store write");
    MAINSTAY_RETURN_IF_ERROR(written);
    RecordKvChanges(batch);
    state.Apply(batch.proto);
    written_seq.store(state.sequence);
    changed.SignalAll();
    if (++batches_since_snapshot >= options.snapshot_every_batches) {
      // The state is taken here; the snapshot is written by the next Sync, without the lock.
      absl::Status s = options.store->StartSnapshot(state.ToProto());
      if (s.ok()) {
        batches_since_snapshot = 0;
      } else if (!absl::IsFailedPrecondition(s)) {  // (one still being written: later)
        Log(LogLevel::kWarning, "coordinator", absl::StrCat("snapshot failed (the log keeps growing): ", s.message()));
      }
    }
    return absl::OkStatus();
  }
  absl::Status Commit(Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return Commit(batch, state.counters); }

  // The KV's recent changes, for KvWatch (memory only: a restarted coordinator, or a new leader,
  // starts with none). Complete for the revisions above kv_history_floor.
  static constexpr size_t kKvHistoryKept = 10000;
  std::deque<v1::KvWatchResponse> kv_history ABSL_GUARDED_BY(mu);
  int64_t kv_history_floor ABSL_GUARDED_BY(mu) = 0;  // set when the state is loaded
  // Before `batch` (whose counters are set) is applied: its KV changes.
  void RecordKvChanges(const Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const v1::StateRecord& r : batch.proto.records()) {
      v1::KvWatchResponse change;
      if (r.has_put_kv()) {
        change.set_type(v1::KV_EVENT_TYPE_PUT);
        *change.mutable_entry() = r.put_kv();
        change.set_revision(r.put_kv().mod_revision());
      } else if (r.change_case() == v1::StateRecord::kDeleteKv) {
        change.set_type(batch.kv_expiry ? v1::KV_EVENT_TYPE_EXPIRE : v1::KV_EVENT_TYPE_DELETE);
        change.mutable_entry()->set_key(r.delete_kv());
        if (auto it = state.kv.find(r.delete_kv()); it != state.kv.end()) {
          change.mutable_entry()->set_version(it->second.version());
        }
        change.set_revision(batch.proto.counters().kv_revision());
      } else {
        continue;
      }
      kv_history.push_back(std::move(change));
    }
    while (kv_history.size() > kKvHistoryKept) {
      kv_history_floor = kv_history.front().revision();
      // (Changes of one revision go together: a prefix delete's keys share one.)
      while (!kv_history.empty() && kv_history.front().revision() == kv_history_floor) kv_history.pop_front();
    }
  }

  // A Write (not its sync: that runs without the lock) that blocks this long under the lock
  // (write(2) to a stalled disk) extends every lease by as much, rather than declaring live
  // daemons DOWN for the coordinator's own delay.
  void ExtendLeasesAfterStall(int64_t stalled_ms, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (stalled_ms < kStallMs) return;
    for (auto& [id, lease] : leases) lease.expires_ms += stalled_ms;
    Log(LogLevel::kWarning, "coordinator",
        absl::StrCat(what, " took ", stalled_ms, " ms while holding the coordinator's lock: every lease extended by as "
                     "much (a slow disk under --state-dir?)"));
  }
  static constexpr int64_t kStallMs = 500;

  // ---- Group commit.
  std::atomic<int64_t> written_seq{0};  // the last batch written to the store (set under mu)
  absl::Mutex deliver_mu ABSL_ACQUIRED_BEFORE(sync_mu);  // orders the outbox's deliveries
  absl::Mutex sync_mu ABSL_ACQUIRED_AFTER(mu);
  absl::CondVar synced_cv;
  int64_t synced_seq ABSL_GUARDED_BY(sync_mu) = 0;  // the last batch a Sync covered
  bool syncing ABSL_GUARDED_BY(sync_mu) = false;
  // Assignments and drops made under mu, held until the batch written before them is durable.
  struct Outgoing {
    int64_t after_seq = 0;
    std::string address;
    std::optional<v1::AssignShardRequest> assign;
    v1::DropShardRequest drop;
  };
  std::deque<Outgoing> outbox ABSL_GUARDED_BY(sync_mu);
  ShardAssigner* delivery = nullptr;  // the real assigner (options.assigner is the outbox's)

  // Waits (without mu) until every batch written so far is durable: the first caller to find
  // no Sync running runs one for everybody's batches, the others wait for it. Then sends what
  // waited in the outbox, in order. A failed Sync stops the coordinator (what is on disk is
  // unknown, so nothing may go on from memory); a restart replays what is.
  void AwaitDurable() ABSL_LOCKS_EXCLUDED(mu) {
    const int64_t target = written_seq.load();
    bool ran = false;
    {
      absl::MutexLock lock(&sync_mu);
      while (synced_seq < target) {
        if (syncing) {
          synced_cv.Wait(&sync_mu);
          continue;
        }
        syncing = true;
        const int64_t covering = written_seq.load();  // every batch written by now
        sync_mu.Unlock();
        const int64_t start = Mono();
        const absl::Status synced = options.store->Sync();
        const int64_t took = Mono() - start;
        sync_mu.Lock();
        syncing = false;
        if (!synced.ok()) {
          Log(LogLevel::kError, "coordinator",
              absl::StrCat("the state store could not make its log durable: ", synced.ToString(),
                           "; stopping (a restart replays what reached the disk)"));
          std::abort();
        }
        synced_seq = std::max(synced_seq, covering);
        synced_cv.SignalAll();
        ran = true;
        if (took >= kStallMs) {
          Log(LogLevel::kWarning, "coordinator",
              absl::StrCat("a state store sync took ", took, " ms (a slow disk under --state-dir?); the coordinator "
                           "went on meanwhile, answering what did not wait for it"));
        }
      }
    }
    DeliverDurable();
    if (ran) {  // parked calls (WatchPlacement, KvGet) may be answerable, from durable state
      absl::MutexLock listener_lock(&listener_mu);
      if (listener) listener();
    }
  }

  // Sends, in order, what waits in the outbox behind batches that are durable already.
  void DeliverDurable() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock order(&deliver_mu);
    std::deque<Outgoing> due;
    {
      absl::MutexLock lock(&sync_mu);
      while (!outbox.empty() && outbox.front().after_seq <= synced_seq) {
        due.push_back(std::move(outbox.front()));
        outbox.pop_front();
      }
    }
    for (Outgoing& o : due) {
      if (o.assign.has_value()) {
        delivery->Assign(o.address, *o.assign);
      } else {
        delivery->Drop(o.address, o.drop);
      }
    }
  }

  // The coordinator's lock for a call or a background task: releasing it waits, without it,
  // until what was written is durable (AwaitDurable). So nothing leaves the coordinator (an
  // answer, an AssignShard) before the state it reflects is on disk, and no fdatasync runs
  // under mu. A heartbeat that wrote nothing does not wait (`wait_durable` false): it has
  // renewed its lease in memory, its answer is advisory, and a daemon must keep its lease
  // through a stalled disk; what it sends to daemons still waits in the outbox behind any
  // batch not yet durable (the ticker's next round syncs it).
  class ABSL_SCOPED_LOCKABLE StateLock {
   public:
    explicit StateLock(Impl& s, bool wait_durable = true) ABSL_EXCLUSIVE_LOCK_FUNCTION(s.mu)
        : s_(s), wait_durable_(wait_durable) {
      s_.mu.Lock();
      written_before_ = s_.written_seq.load();
    }
    ~StateLock() ABSL_UNLOCK_FUNCTION() {
      const bool wrote = s_.written_seq.load() != written_before_;
      s_.mu.Unlock();
      if (wait_durable_ || wrote) {
        s_.AwaitDurable();
      } else {
        s_.DeliverDurable();
      }
    }
    StateLock(const StateLock&) = delete;
    StateLock& operator=(const StateLock&) = delete;

   private:
    Impl& s_;
    const bool wait_durable_;
    int64_t written_before_ = 0;
  };

  // The ShardAssigner the coordinator's code calls (under mu): it queues into the outbox.
  class HeldAssigner : public ShardAssigner {
   public:
    explicit HeldAssigner(Impl* s) : s_(s) {}
    void Assign(const std::string& address, const v1::AssignShardRequest& request) override {
      absl::MutexLock lock(&s_->sync_mu);
      s_->outbox.push_back({s_->written_seq.load(), address, request, {}});
    }
    void Drop(const std::string& address, const v1::DropShardRequest& request) override {
      absl::MutexLock lock(&s_->sync_mu);
      s_->outbox.push_back({s_->written_seq.load(), address, std::nullopt, request});
    }
    absl::StatusOr<v1::WriteCheckpointResponse> WriteCheckpoint(const std::string& address,
                                                                const v1::WriteCheckpointRequest& request,
                                                                absl::Time deadline) override {
      return s_->delivery->WriteCheckpoint(address, request, deadline);
    }
    void SetRefusedHandler(RefusedHandler handler) override { s_->delivery->SetRefusedHandler(std::move(handler)); }

   private:
    Impl* const s_;
  };
  std::unique_ptr<HeldAssigner> held_assigner;

  v1::DaemonInfo Decorated(const v1::DaemonInfo& d) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::DaemonInfo out = d;
    out.clear_key_sha256();  // the coordinator's alone
    auto it = leases.find(d.endpoint().daemon_id());
    if (it != leases.end()) {
      out.set_lease_expires_unix_ms(Now() + (it->second.expires_ms - Mono()));  // shown in wall time
      out.set_used_bytes(it->second.used_bytes);
      for (const v1::DataConnection& c : it->second.connections) *out.add_connections() = c;
    }
    int count = 0;
    for (const auto& [id, job] : state.jobs) {
      for (const v1::ShardPlacement& p : job.placement().shards()) count += p.daemon_id() == d.endpoint().daemon_id();
    }
    out.set_shard_count(count);
    return out;
  }

  // READY when every owner is up, DEGRADED otherwise.
  v1::JobState HealthOf(const v1::StoredJob& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return HealthIn(state, job);
  }
  // DEGRADED when a daemon of the job is down or has lost the job's state.
  v1::JobState HealthIn(const State& in, const v1::StoredJob& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto lost = lost_state.find(job.info().job_id());
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      auto it = in.daemons.find(e.daemon_id());
      if (it == in.daemons.end() || it->second.state() == v1::DAEMON_STATE_DOWN) return v1::JOB_STATE_DEGRADED;
      if (lost != lost_state.end() && lost->second.count(e.daemon_id())) return v1::JOB_STATE_DEGRADED;
    }
    return v1::JOB_STATE_READY;
  }

  // Adds job state changes implied by daemon changes already in `batch` (computed on a copy).
  void AddJobHealth(Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    State after = state;
    after.Apply(batch.proto);
    for (const auto& [id, job] : after.jobs) {
      const v1::JobState health = HealthIn(after, job);
      if (job.info().state() != health) {
        v1::StoredJob updated = job;
        updated.mutable_info()->set_state(health);
        batch.PutJob(updated);
      }
    }
  }

  // Whether the daemon can serve a job's shards: registered, not DOWN, and still holding the
  // job's state (not in lost_state).
  bool HoldsJob(const std::string& job_id, const std::string& daemon_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto d = state.daemons.find(daemon_id);
    if (d == state.daemons.end() || d->second.state() == v1::DAEMON_STATE_DOWN) return false;
    auto lost = lost_state.find(job_id);
    return lost == lost_state.end() || !lost->second.count(daemon_id);
  }

  // Failover (coordinator_replicas.cc): a job with replicas that lost daemons continues on
  // their surviving copies at the next epoch; a move whose source was lost copies from another
  // copy of its rank. False, with nothing changed, when some shard has no copy left (or the job
  // has no replicas): the job is then restored from a checkpoint.
  bool FailoverLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Re-replication (coordinator_replicas.cc): every started job with fewer than R copies of a
  // rank, no move pending and every daemon at its placement epoch gets new replicas on ready
  // daemons at the next epoch, each copied from the rank's primary (a move that keeps its
  // source). A job that cannot get them (no daemon with room) is logged once per epoch and
  // tried again at later ticks.
  void ReReplicateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  std::map<std::string, int64_t> rereplication_waiting ABSL_GUARDED_BY(mu);  // job -> epoch logged

  // Queues every job placed on the daemon, or copying a rank from it (a move's source, out of
  // the placement already), for RecoverJobs (the next Tick).
  void MarkJobsToRecover(const std::string& daemon_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& [job_id, job] : state.jobs) {
      for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
        if (e.daemon_id() == daemon_id) jobs_to_recover.insert(job_id);
      }
      for (const v1::PendingMove& m : job.moves()) {
        if (m.source_daemon_id() == daemon_id) jobs_to_recover.insert(job_id);
      }
    }
  }

  void TickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t now = Now();
    const int64_t mono = Mono();
    Batch batch;
    for (const auto& [id, d] : state.daemons) {
      if (d.state() == v1::DAEMON_STATE_DOWN) continue;
      auto it = leases.find(id);
      if (it != leases.end() && it->second.expires_ms > mono) continue;
      v1::DaemonInfo down = d;
      down.set_state(v1::DAEMON_STATE_DOWN);
      batch.PutDaemon(down);
      leases.erase(id);
      Log(LogLevel::kWarning, "coordinator", absl::StrCat("daemon ", id, " (", d.endpoint().address(), ") missed its lease: DOWN"));
      MarkJobsToRecover(id);
      if (options.on_lease_expired) options.on_lease_expired(id);
    }
    v1::StateCounters counters = state.counters;
    bool expired_kv = false;
    for (const auto& [key, e] : state.kv) {
      if (e.expires_unix_ms() != 0 && e.expires_unix_ms() <= now) {
        batch.DeleteKv(key);
        expired_kv = true;
      }
    }
    if (batch.empty()) return;
    if (expired_kv) counters.set_kv_revision(counters.kv_revision() + 1);
    batch.kv_expiry = expired_kv;
    AddJobHealth(batch);
    absl::Status s = Commit(batch, counters);
    if (!s.ok()) Log(LogLevel::kError, "coordinator", absl::StrCat("tick not saved: ", s.message()));
  }

  const v1::StoredJob* FindJob(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = state.jobs.find(id);
    return it == state.jobs.end() ? nullptr : &it->second;
  }

  absl::StatusOr<const v1::StoredJob*> JobOrNotFound(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (id.empty()) return absl::InvalidArgumentError("job_id: must not be empty");
    const v1::StoredJob* job = FindJob(id);
    if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
    return job;
  }

  // The job, for a caller presenting `job_token` (the job token, or with kRead the job's reader
  // token too): any other token is PERMISSION_DENIED (a trainer of job A never reads job B). An
  // empty token is accepted here: the gRPC layer lets such a call through only with the admin
  // token when one is configured (server/grpc/coordinator_service.cc, CheckJobRead).
  enum class Access { kTrainer, kRead };
  absl::StatusOr<const v1::StoredJob*> JobForCaller(const std::string& id, const std::string& job_token,
                                                    Access access = Access::kRead) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MAINSTAY_ASSIGN_OR_RETURN(const v1::StoredJob* job, JobOrNotFound(id));
    if (job_token.empty() || Sha256(job_token) == job->job_token_sha256()) return job;
    if (!job->reader_token().empty() && job_token == job->reader_token()) {
      if (access == Access::kRead) return job;
      return absl::PermissionDeniedError(
          absl::StrCat("job '", id, "': a reader token only reads the job's weights; this call needs the job_token"));
    }
    return absl::PermissionDeniedError(absl::StrCat("job '", id, "': the token is not this job's"));
  }

  // Ready daemons and the memory they have left after every job's ranks placed on them.
  std::vector<DaemonCandidate> Candidates(const std::string& exclude) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::map<std::string, int64_t> reserved;
    for (const auto& [id, job] : state.jobs) {
      std::set<std::pair<std::string, int>> seen;  // (daemon, rank)
      for (const v1::ShardPlacement& p : job.placement().shards()) {
        if (seen.insert({p.daemon_id(), p.shard().shard()}).second) reserved[p.daemon_id()] += job.bytes_per_rank();
        for (const std::string& r : p.replica_daemon_ids()) {
          if (seen.insert({r, p.shard().shard()}).second) reserved[r] += job.bytes_per_rank();
        }
      }
    }
    std::vector<DaemonCandidate> out;
    for (const auto& [id, d] : state.daemons) {
      if (d.state() != v1::DAEMON_STATE_READY || id == exclude) continue;
      const v1::DaemonResources& r = d.resources();
      const int64_t capacity = r.memory_kind() == v1::MEMORY_KIND_DEVICE ? r.device_memory_bytes() : r.host_memory_bytes();
      out.push_back({id, d.endpoint().node_name(), capacity - reserved[id]});
    }
    return out;
  }

  v1::DaemonEndpoint EndpointOf(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = state.daemons.find(id);
    return it == state.daemons.end() ? v1::DaemonEndpoint() : it->second.endpoint();
  }

  // Placement proto for owners[r] of every bucket's shard r, with replicas[r] when given.
  v1::Placement MakePlacement(const std::string& job_id, int64_t epoch, int num_buckets,
                              const std::vector<std::string>& owners,
                              const std::vector<std::vector<std::string>>& replicas = {}) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::Placement p;
    p.set_job_id(job_id);
    p.set_epoch(epoch);
    for (int b = 0; b < num_buckets; ++b) {
      for (size_t r = 0; r < owners.size(); ++r) {
        v1::ShardPlacement* s = p.add_shards();
        s->mutable_shard()->set_bucket(b);
        s->mutable_shard()->set_shard(static_cast<int32_t>(r));
        s->set_daemon_id(owners[r]);
        if (r < replicas.size()) {
          for (const std::string& id : replicas[r]) s->add_replica_daemon_ids(id);
        }
      }
    }
    SetDaemons(p);
    return p;
  }

  // Rebuilds `p.daemons` from its shards: every primary and replica, once, sorted by id.
  void SetDaemons(v1::Placement& p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::set<std::string> unique;
    for (const v1::ShardPlacement& s : p.shards()) {
      unique.insert(s.daemon_id());
      unique.insert(s.replica_daemon_ids().begin(), s.replica_daemon_ids().end());
    }
    p.clear_daemons();
    for (const std::string& id : unique) *p.add_daemons() = EndpointOf(id);
  }

  // The daemons holding every bucket's shard of each rank (primary first, then replicas).
  static std::vector<std::vector<std::string>> HoldersByRank(const v1::StoredJob& job) {
    std::vector<std::vector<std::string>> holders(static_cast<size_t>(job.info().spec().data_parallel_size()));
    for (const v1::ShardPlacement& p : job.placement().shards()) {
      std::vector<std::string>& h = holders.at(static_cast<size_t>(p.shard().shard()));
      if (!h.empty()) continue;  // (every bucket's shard r has the same holders)
      h.push_back(p.daemon_id());
      h.insert(h.end(), p.replica_daemon_ids().begin(), p.replica_daemon_ids().end());
    }
    return holders;
  }

  // One rank's move: `source`'s copy of every bucket's shard of `rank` goes to `target`, which
  // takes the source's role there (primary or replica). With `keep_source` (re-replication)
  // the source keeps its role and the target becomes one more replica.
  struct RankMove {
    int rank = 0;
    std::string source, target;
    bool keep_source = false;
  };
  // Moves (drain, MoveShard, re-replication): `job` at its next epoch with `moves` applied, the
  // moves recorded (StoredJob.moves) and described in `out`. Commit it, then SendMoves. A source
  // that no longer holds the rank keeps its copy until the target reports the job loaded.
  v1::StoredJob PlanMoves(const v1::StoredJob& job, const std::vector<RankMove>& moves,
                          std::vector<v1::ShardMove>* out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::StoredJob updated = job;
    const int64_t epoch = job.placement().epoch() + 1;
    v1::Placement& placement = *updated.mutable_placement();
    placement.set_epoch(epoch);
    for (const RankMove& m : moves) {
      v1::PendingMove* move = updated.add_moves();
      move->set_rank(m.rank);
      move->set_source_daemon_id(m.source);
      move->set_target_daemon_id(m.target);
      move->set_epoch(epoch);
      for (v1::ShardPlacement& p : *placement.mutable_shards()) {
        if (p.shard().shard() != m.rank) continue;
        v1::ShardMove& shard_move = out->emplace_back();
        shard_move.set_job_id(job.info().job_id());
        *shard_move.mutable_shard() = p.shard();
        shard_move.set_from_daemon_id(m.source);
        shard_move.set_to_daemon_id(m.target);
        shard_move.set_placement_epoch(epoch);
        if (m.keep_source) {
          p.add_replica_daemon_ids(m.target);
        } else if (p.daemon_id() == m.source) {
          p.set_daemon_id(m.target);
        } else {
          for (std::string& r : *p.mutable_replica_daemon_ids()) {
            if (r == m.source) r = m.target;
          }
        }
      }
    }
    SetDaemons(placement);
    updated.mutable_info()->set_placement_epoch(epoch);
    return updated;
  }

  // Sends `daemon_id` its shards of `job` at the job's epoch: the ranks a pending move brings to
  // it come from the move's source, the others as they are (or from `from_checkpoint`).
  void SendAssignmentTo(const v1::StoredJob& job, const std::string& daemon_id,
                        const v1::SourceCheckpoint* from_checkpoint) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::map<int, std::string> moving_in;  // rank -> source
    for (const v1::PendingMove& m : job.moves()) {
      if (m.target_daemon_id() == daemon_id) moving_in[m.rank()] = m.source_daemon_id();
    }
    std::set<int> rest;
    for (const v1::ShardPlacement& p : job.placement().shards()) {
      const bool holds = p.daemon_id() == daemon_id || std::count(p.replica_daemon_ids().begin(),
                                                                  p.replica_daemon_ids().end(), daemon_id) > 0;
      if (holds && !moving_in.count(p.shard().shard())) rest.insert(p.shard().shard());
    }
    for (const auto& [rank, from] : moving_in) SendAssignments(job, {rank}, from, nullptr, daemon_id);
    if (!rest.empty()) SendAssignments(job, rest, "", from_checkpoint, daemon_id);
  }

  // Tests only: CoordinatorOptions::fault_point at `point`, here under the lock (the hook only
  // kills the process).
  void FaultPoint(const char* point) const {
    if (options.fault_point) options.fault_point(point);
  }

  // Coordinator::AssignmentRefused's work, for `job` at its current epoch (coordinator_admission.cc):
  // the ranks `refuser` was to gain go elsewhere at a new epoch (`restore`: the assignment was a
  // restore's). Also called when a move's target reports that it cannot allocate the copy
  // (`moves_only`: only the ranks pending moves bring to it).
  void PlaceRefusedRanks(const std::string& refuser, const v1::StoredJob& job, bool restore, const absl::Status& status,
                         bool moves_only = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // After PlanMoves' job is committed: every daemon of the placement gets the new epoch, each
  // target its moved ranks from their source.
  void SendMoves(const v1::StoredJob& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) SendAssignmentTo(job, e.daemon_id(), nullptr);
  }

  // Sends each holder (primary or replica) its shards of `job` (those of `only_ranks`, or all
  // of its ranks when empty). The gained shards start from the trainers (new job), from
  // `from_peer`'s copy or, with `from_checkpoint`, from a checkpoint (the daemons then replace
  // the whole job).
  // With `only_daemon`, only that daemon's assignment is sent (reconciliation).
  void SendAssignments(const v1::StoredJob& job, const std::set<int>& only_ranks, const std::string& from_peer,
                       const v1::SourceCheckpoint* from_checkpoint = nullptr, const std::string& only_daemon = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (options.assigner == nullptr) return;
    std::map<std::string, std::vector<v1::ShardRef>> by_daemon;
    for (const v1::ShardPlacement& p : job.placement().shards()) {
      if (!only_ranks.empty() && !only_ranks.count(p.shard().shard())) continue;
      // Primaries and replicas alike (the daemon reads each shard's role from the placement).
      if (only_daemon.empty() || p.daemon_id() == only_daemon) by_daemon[p.daemon_id()].push_back(p.shard());
      for (const std::string& r : p.replica_daemon_ids()) {
        if (only_daemon.empty() || r == only_daemon) by_daemon[r].push_back(p.shard());
      }
    }
    for (const auto& [daemon, shards] : by_daemon) {
      v1::AssignShardRequest req;
      req.set_job_id(job.info().job_id());
      req.set_placement_epoch(job.placement().epoch());
      *req.mutable_spec() = job.info().spec();
      *req.mutable_layout() = job.layout();
      *req.mutable_placement() = job.placement();
      req.set_job_token_sha256(job.job_token_sha256());
      if (!job.reader_token().empty()) req.set_reader_token_sha256(Sha256(job.reader_token()));
      for (const v1::ShardRef& s : shards) *req.add_shards() = s;
      req.set_role(v1::SHARD_ROLE_PRIMARY);
      if (from_checkpoint != nullptr) {
        *req.mutable_from_checkpoint() = *from_checkpoint;
      } else if (from_peer.empty()) {
        req.mutable_from_trainer();
      } else {
        *req.mutable_from_peer()->mutable_daemon() = EndpointOf(from_peer);
      }
      options.assigner->Assign(EndpointOf(daemon).address(), req);
    }
  }
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_COORDINATOR_IMPL_H_

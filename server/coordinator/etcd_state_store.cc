#include "server/coordinator/etcd_state_store.h"

#include <algorithm>
#include <optional>
#include <cstdio>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "etcd/etcdserver/etcdserverpb/rpc.pb.h"
#include "server/coordinator/state.h"

namespace mainstay::coordinator {

namespace {

using etcdserverpb::Compare;
using etcdserverpb::RangeRequest;
using etcdserverpb::RequestOp;
using etcdserverpb::TxnRequest;

constexpr char kComponent[] = "coordinator-etcd";
// etcd refuses requests above 1.5 MiB and transactions above 128 operations (its defaults).
constexpr size_t kMaxTxnBytes = 1 << 20;
constexpr int kMaxTxnOps = 100;
constexpr int64_t kLoadPage = 64;  // log batches per Range in Load

// The end of the range of every key that starts with `prefix`.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<unsigned char>(prefix.back()) < 0xff) {
      prefix.back() = static_cast<char>(prefix.back() + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');
}

std::string LogKey(const std::string& prefix, int64_t sequence) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%020lld", static_cast<long long>(sequence));
  return absl::StrCat(prefix, "state/log/", digits);
}

void AddPut(TxnRequest& txn, const std::string& key, const std::string& value, int64_t lease = 0) {
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  if (lease != 0) put->set_lease(lease);
}

void AddCompare(TxnRequest& txn, const std::string& key, Compare::CompareTarget target, int64_t revision) {
  Compare* c = txn.add_compare();
  c->set_key(key);
  c->set_result(Compare::EQUAL);
  c->set_target(target);
  if (target == Compare::CREATE) {
    c->set_create_revision(revision);
  } else {
    c->set_mod_revision(revision);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Leadership.

absl::StatusOr<std::unique_ptr<EtcdLeadership>> EtcdLeadership::TryAcquire(EtcdClient* etcd, const std::string& value,
                                                                           std::string* holder) {
  const std::string key = etcd->options().prefix + "leader";
  const absl::Time asked = absl::Now();
  absl::StatusOr<int64_t> lease = etcd->GrantLease(etcd->options().lease_ttl);
  if (!lease.ok()) return lease.status();
  TxnRequest txn;
  AddCompare(txn, key, Compare::CREATE, 0);  // nobody holds it
  AddPut(txn, key, value, *lease);
  txn.add_failure()->mutable_request_range()->set_key(key);
  absl::StatusOr<etcdserverpb::TxnResponse> r = etcd->Txn(txn);
  if (r.ok() && !r->succeeded()) {
    const auto& kvs = r->responses(0).response_range().kvs();
    // An earlier copy of this transaction (sent to another endpoint, its answer lost) created
    // the key: under our lease, it is ours.
    if (!kvs.empty() && kvs[0].lease() == *lease) {
      return std::unique_ptr<EtcdLeadership>(new EtcdLeadership(etcd, key, *lease, kvs[0].create_revision(), asked));
    }
    etcd->RevokeLease(*lease).IgnoreError();
    *holder = kvs.empty() ? "(its lease just expired)" : kvs[0].value();
    return std::unique_ptr<EtcdLeadership>();
  }
  if (!r.ok()) {
    etcd->RevokeLease(*lease).IgnoreError();  // (a key made under it goes with it)
    return r.status();
  }
  return std::unique_ptr<EtcdLeadership>(new EtcdLeadership(etcd, key, *lease, r->header().revision(), asked));
}

absl::StatusOr<std::string> EtcdLeadership::Holder(EtcdClient* etcd) {
  RangeRequest read;
  read.set_key(etcd->options().prefix + "leader");
  absl::StatusOr<etcdserverpb::RangeResponse> r = etcd->Range(read);
  if (!r.ok()) return r.status();
  return r->kvs().empty() ? std::string() : r->kvs(0).value();
}

void EtcdLeadership::Start(std::function<void(const absl::Status&)> on_lost) {
  keep_alive_ = std::thread([this, on_lost = std::move(on_lost)] { KeepAliveLoop(on_lost); });
}

void EtcdLeadership::KeepAliveLoop(std::function<void(const absl::Status&)> on_lost) {
  const absl::Duration ttl = etcd_->options().lease_ttl;
  absl::Time renewed = granted_;
  absl::Status last;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), ttl / 3)) return;
    }
    const absl::Time sent = absl::Now();  // etcd renews it at some moment after this
    absl::StatusOr<int64_t> left = etcd_->KeepAlive(lease_);
    if (left.ok() && *left > 0) {
      renewed = sent;
      continue;
    }
    last = left.ok() ? absl::FailedPreconditionError(absl::StrCat("etcd says lease ", lease_, " has expired"))
                     : left.status();
    // Alive at etcd until `renewed` + TTL at the latest; past that another coordinator may lead.
    if (left.ok() || absl::Now() - renewed >= ttl) {
      on_lost(absl::UnavailableError(absl::StrCat("the coordinator lost its leadership (lease ", lease_,
                                                  " of key ", key_, "): ", last.message())));
      return;
    }
    Log(LogLevel::kWarning, kComponent, absl::StrCat("cannot renew the leader's lease yet: ", last.message()));
  }
}

EtcdLeadership::~EtcdLeadership() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (keep_alive_.joinable()) keep_alive_.join();
  etcd_->RevokeLease(lease_).IgnoreError();
}

// ---------------------------------------------------------------------------------------------
// The store.

namespace {

class EtcdStateStore : public StateStore {
 public:
  EtcdStateStore(EtcdClient* etcd, const EtcdLeadership* leadership)
      : etcd_(etcd),
        leadership_(leadership),
        prefix_(etcd->options().prefix),
        head_key_(prefix_ + "state/head"),
        snapshot_key_(prefix_ + "state/snapshot") {}

  absl::StatusOr<v1::CoordinatorState> Load() override {
    // Every read at one revision: a consistent view even if someone wrote meanwhile.
    RangeRequest head;
    head.set_key(head_key_);
    absl::StatusOr<etcdserverpb::RangeResponse> h = etcd_->Range(head);
    if (!h.ok()) return h.status();
    const int64_t at = h->header().revision();
    int64_t head_sequence = 0;
    int64_t head_revision = 0;
    if (!h->kvs().empty()) {
      head_revision = h->kvs(0).mod_revision();
      if (!absl::SimpleAtoi(h->kvs(0).value(), &head_sequence)) {
        return absl::DataLossError(absl::StrCat("etcd key ", head_key_, " holds '", h->kvs(0).value(),
                                                "', not a sequence number"));
      }
    }
    RangeRequest snap;
    snap.set_key(snapshot_key_);
    snap.set_revision(at);
    absl::StatusOr<etcdserverpb::RangeResponse> s = etcd_->Range(snap);
    if (!s.ok()) return s.status();
    State state;
    if (!s->kvs().empty()) {
      v1::CoordinatorState proto;
      if (!proto.ParseFromString(s->kvs(0).value())) {
        return absl::DataLossError(absl::StrCat("etcd key ", snapshot_key_, " is not a CoordinatorState"));
      }
      state = State::FromProto(proto);
    }
    // The log after the snapshot, a page at a time (each batch up to 1 MiB), all at revision `at`.
    int64_t replayed = 0;
    while (true) {
      RangeRequest log;
      log.set_key(LogKey(prefix_, state.sequence + 1));
      log.set_range_end(PrefixEnd(prefix_ + "state/log/"));
      log.set_revision(at);
      log.set_sort_order(RangeRequest::ASCEND);
      log.set_sort_target(RangeRequest::KEY);
      log.set_limit(kLoadPage);
      absl::StatusOr<etcdserverpb::RangeResponse> l = etcd_->Range(log);
      if (!l.ok()) return l.status();
      for (const auto& kv : l->kvs()) {
        v1::StateBatch batch;
        if (!batch.ParseFromString(kv.value())) {
          return absl::DataLossError(absl::StrCat("etcd key ", kv.key(), " is not a StateBatch"));
        }
        if (batch.sequence() != state.sequence + 1) {
          return absl::DataLossError(absl::StrCat("etcd's state log jumps from batch ", state.sequence, " to ",
                                                  batch.sequence(), " (key ", kv.key(), ")"));
        }
        state.Apply(batch);
        ++replayed;
      }
      if (!l->more()) break;
    }
    if (state.sequence != head_sequence) {
      return absl::DataLossError(absl::StrCat("etcd's state log ends at batch ", state.sequence, " but ", head_key_,
                                              " says ", head_sequence));
    }
    absl::MutexLock lock(&mu_);
    head_revision_ = head_revision;
    head_sequence_ = head_sequence;
    loaded_ = true;
    Log(LogLevel::kInfo, kComponent,
        absl::StrCat("state loaded from etcd (", prefix_, "): batch ", state.sequence, ", ", replayed,
                     " after the snapshot"));
    return state.ToProto();
  }

  absl::Status Write(const v1::StateBatch& batch) override {
    absl::MutexLock lock(&mu_);
    MAINSTAY_RETURN_IF_ERROR(CheckUsableLocked());
    std::string bytes = batch.SerializeAsString();
    if (bytes.size() > kMaxTxnBytes) {
      return absl::ResourceExhaustedError(absl::StrCat("a state batch of ", bytes.size(),
                                                       " bytes is over etcd's request limit (", kMaxTxnBytes, ")"));
    }
    pending_.push_back({batch.sequence(), std::move(bytes)});
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    absl::MutexLock sync_lock(&sync_mu_);  // one Sync at a time, Writes go on meanwhile
    std::vector<Pending> batches;
    std::optional<v1::CoordinatorState> snapshot;
    {
      absl::MutexLock lock(&mu_);
      MAINSTAY_RETURN_IF_ERROR(CheckUsableLocked());
      batches.swap(pending_);
      snapshot = snapshot_;
    }
    for (size_t begin = 0; begin < batches.size();) {
      TxnRequest txn;
      size_t bytes = 0;
      size_t end = begin;
      while (end < batches.size() && end - begin < kMaxTxnOps &&
             (end == begin || bytes + batches[end].bytes.size() <= kMaxTxnBytes)) {
        bytes += batches[end].bytes.size();
        AddPut(txn, LogKey(prefix_, batches[end].sequence), batches[end].bytes);
        ++end;
      }
      MAINSTAY_RETURN_IF_ERROR(Commit(txn, batches[end - 1].sequence));
      begin = end;
    }
    if (snapshot.has_value()) {
      // The snapshot, and the log before it goes: one transaction. One etcd cannot take more than
      // its request limit: then the log just grows (a warning), and a later snapshot tries again.
      std::string bytes = snapshot->SerializeAsString();
      {
        absl::MutexLock lock(&mu_);
        snapshot_.reset();
      }
      if (bytes.size() > kMaxTxnBytes) {
        Log(LogLevel::kWarning, kComponent,
            absl::StrCat("snapshot of ", bytes.size(), " bytes not written: over etcd's request limit (",
                         kMaxTxnBytes, "); the state log in etcd keeps growing"));
        return absl::OkStatus();
      }
      TxnRequest txn;
      AddPut(txn, snapshot_key_, bytes);
      etcdserverpb::DeleteRangeRequest* drop = txn.add_success()->mutable_request_delete_range();
      drop->set_key(prefix_ + "state/log/");
      drop->set_range_end(LogKey(prefix_, snapshot->sequence() + 1));
      int64_t head;
      {
        absl::MutexLock lock(&mu_);
        head = head_sequence_;
      }
      // (A snapshot that cannot be written is no error, as for the file store: the log stays
      // whole. Only a fence that moved breaks the store, in Commit.)
      if (absl::Status s = Commit(txn, head, /*fatal=*/false); !s.ok()) {
        if (absl::IsFailedPrecondition(s)) return s;
        Log(LogLevel::kWarning, kComponent,
            absl::StrCat("snapshot not written to etcd (the log keeps growing; a later one tries again): ", s.message()));
      }
    }
    return absl::OkStatus();
  }

  absl::Status StartSnapshot(const v1::CoordinatorState& state) override {
    absl::MutexLock lock(&mu_);
    MAINSTAY_RETURN_IF_ERROR(CheckUsableLocked());
    if (snapshot_.has_value()) return absl::FailedPreconditionError("a snapshot is still being written");
    snapshot_ = state;
    return absl::OkStatus();
  }

 private:
  struct Pending {
    int64_t sequence;
    std::string bytes;
  };

  absl::Status CheckUsableLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (!loaded_) return absl::FailedPreconditionError("the etcd state store was not loaded");
    return broken_;
  }

  // `txn`'s success operations, plus the head update to `head`, under the fence. Retries an
  // unanswered attempt (etcd restarting, a member down) until twice the lease TTL has passed.
  // A failed compare may be this store's own earlier attempt that landed without an answer
  // (the client resends a timed-out call to the next endpoint): it is checked before the fence
  // is declared moved. A moved fence breaks the store; another error does so only when
  // `fatal` (a snapshot's is not).
  absl::Status Commit(TxnRequest txn, int64_t head, bool fatal = true) {
    int64_t expected;
    {
      absl::MutexLock lock(&mu_);
      expected = head_revision_;
    }
    AddCompare(txn, leadership_->key(), Compare::CREATE, leadership_->revision());
    AddCompare(txn, head_key_, Compare::MOD, expected);
    AddPut(txn, head_key_, absl::StrCat(head));
    const absl::Time give_up = absl::Now() + 2 * etcd_->options().lease_ttl;
    absl::Duration backoff = absl::Milliseconds(50);
    absl::Status last;
    while (true) {
      absl::StatusOr<etcdserverpb::TxnResponse> r = etcd_->Txn(txn);
      if (r.ok() && r->succeeded()) {
        absl::MutexLock lock(&mu_);
        head_revision_ = r->header().revision();
        head_sequence_ = head;
        return absl::OkStatus();
      }
      if (r.ok()) {
        // Did an earlier copy land? Then the head says `head`, moved on from `expected`, and
        // we still lead.
        absl::StatusOr<bool> landed = Landed(head, expected);
        if (landed.ok() && *landed) return absl::OkStatus();
        if (landed.ok()) {
          return Break(absl::FailedPreconditionError(
              "the etcd transaction's fence failed: this coordinator is no longer the leader, or another "
              "coordinator wrote the state"));
        }
        last = landed.status();
      } else {
        last = r.status();
        if (!absl::IsUnavailable(last) && !absl::IsDeadlineExceeded(last)) {
          return fatal ? Break(last) : last;
        }
      }
      if (absl::Now() + backoff >= give_up) {
        absl::Status why = absl::UnavailableError(absl::StrCat("etcd did not take the state for ",
                                                               absl::FormatDuration(2 * etcd_->options().lease_ttl),
                                                               ": ", last.message()));
        return fatal ? Break(why) : why;
      }
      Log(LogLevel::kWarning, kComponent, absl::StrCat("writing the state to etcd: ", last.message(), "; retrying"));
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }

  // Whether the head key holds `head`, written after `expected` by this leader (whose key has
  // still the create revision it was elected with).
  absl::StatusOr<bool> Landed(int64_t head, int64_t expected) {
    RangeRequest read;
    read.set_key(head_key_);
    absl::StatusOr<etcdserverpb::RangeResponse> h = etcd_->Range(read);
    if (!h.ok()) return h.status();
    RangeRequest leader;
    leader.set_key(leadership_->key());
    leader.set_revision(h->header().revision());
    absl::StatusOr<etcdserverpb::RangeResponse> l = etcd_->Range(leader);
    if (!l.ok()) return l.status();
    if (h->kvs().empty() || h->kvs(0).value() != absl::StrCat(head) || h->kvs(0).mod_revision() <= expected ||
        l->kvs().empty() || l->kvs(0).create_revision() != leadership_->revision()) {
      return false;
    }
    absl::MutexLock lock(&mu_);
    head_revision_ = h->kvs(0).mod_revision();
    head_sequence_ = head;
    return true;
  }

  absl::Status Break(absl::Status why) {
    absl::MutexLock lock(&mu_);
    broken_ = absl::FailedPreconditionError(absl::StrCat("the etcd state store stopped: ", why.message()));
    return broken_;
  }

  EtcdClient* const etcd_;
  const EtcdLeadership* const leadership_;
  const std::string prefix_, head_key_, snapshot_key_;
  absl::Mutex sync_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  bool loaded_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  int64_t head_revision_ ABSL_GUARDED_BY(mu_) = 0;  // 0: no head key yet
  int64_t head_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::CoordinatorState> snapshot_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<StateStore> NewEtcdStateStore(EtcdClient* etcd, const EtcdLeadership* leadership) {
  return std::make_unique<EtcdStateStore>(etcd, leadership);
}

}  // namespace mainstay::coordinator

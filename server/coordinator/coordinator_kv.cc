// Coordinator: the small KV used for peer rendezvous (compare-and-set, TTLs, waits).
#include <algorithm>

#include "server/coordinator/coordinator_impl.h"

namespace mainstay::coordinator {
namespace {

constexpr size_t kMaxKeyBytes = 1024;

absl::Status CheckKey(const std::string& key) {
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key: at most ", kMaxKeyBytes, " bytes, got ", key.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::KvPutResponse> Coordinator::KvPut(const v1::KvPutRequest& request) {
  MAINSTAY_RETURN_IF_ERROR(CheckKey(request.key()));
  Impl& s = *impl_;
  if (static_cast<int64_t>(request.value().size()) > s.options.max_kv_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("value: at most ", s.options.max_kv_value_bytes, " bytes, got ",
                                                   request.value().size()));
  }
  if (request.ttl_ms() < 0) return absl::InvalidArgumentError(absl::StrCat("ttl_ms: must be >= 0, got ", request.ttl_ms()));
  if (request.has_expected_version() && request.expected_version() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected_version: must be >= 0, got ", request.expected_version()));
  }
  Impl::StateLock lock(s);
  s.TickLocked();
  auto it = s.state.kv.find(request.key());
  const int64_t current_version = it == s.state.kv.end() ? 0 : it->second.version();
  v1::KvPutResponse response;
  if (request.has_expected_version() && request.expected_version() != current_version) {
    response.set_applied(false);
    if (it != s.state.kv.end()) *response.mutable_current() = it->second;
    response.set_revision(s.state.counters.kv_revision());
    return response;
  }
  v1::StateCounters counters = s.state.counters;
  counters.set_kv_revision(counters.kv_revision() + 1);
  v1::KvEntry entry;
  entry.set_key(request.key());
  entry.set_value(request.value());
  entry.set_version(current_version + 1);
  entry.set_mod_revision(counters.kv_revision());
  entry.set_expires_unix_ms(request.ttl_ms() > 0 ? s.Now() + request.ttl_ms() : 0);
  Batch batch;
  batch.PutKv(entry);
  MAINSTAY_RETURN_IF_ERROR(s.Commit(batch, counters));
  response.set_applied(true);
  *response.mutable_current() = entry;
  response.set_revision(counters.kv_revision());
  return response;
}

absl::StatusOr<v1::KvGetResponse> Coordinator::KvGet(const v1::KvGetRequest& request, absl::Time deadline) {
  if (!request.prefix()) MAINSTAY_RETURN_IF_ERROR(CheckKey(request.key()));
  if (request.wait_ms() < 0) return absl::InvalidArgumentError(absl::StrCat("wait_ms: must be >= 0, got ", request.wait_ms()));
  Impl& s = *impl_;
  const absl::Time wait_until = std::min(deadline, absl::Now() + absl::Milliseconds(request.wait_ms()));
  Impl::StateLock lock(s);
  while (true) {
    s.TickLocked();
    v1::KvGetResponse response;
    response.set_revision(s.state.counters.kv_revision());
    if (request.prefix()) {
      for (auto it = s.state.kv.lower_bound(request.key()); it != s.state.kv.end() && HasPrefix(it->first, request.key());
           ++it) {
        *response.add_entries() = it->second;
      }
    } else if (auto it = s.state.kv.find(request.key()); it != s.state.kv.end()) {
      *response.add_entries() = it->second;
    }
    if (response.entries_size() > 0) return response;
    // Wake up for changes, and at least every 100 ms so TTL expiry is noticed.
    const absl::Time next = std::min(wait_until, absl::Now() + absl::Milliseconds(100));
    if (absl::Now() >= wait_until) {
      if (request.prefix()) return response;
      return absl::NotFoundError(absl::StrCat("no key '", request.key(), "'"));
    }
    s.changed.WaitWithDeadline(&s.mu, next);
  }
}

absl::StatusOr<v1::KvDeleteResponse> Coordinator::KvDelete(const v1::KvDeleteRequest& request) {
  if (!request.prefix()) MAINSTAY_RETURN_IF_ERROR(CheckKey(request.key()));
  if (request.prefix() && request.has_expected_version()) {
    return absl::InvalidArgumentError("expected_version: only for a single key, not a prefix");
  }
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  Batch batch;
  if (request.prefix()) {
    for (auto it = s.state.kv.lower_bound(request.key()); it != s.state.kv.end() && HasPrefix(it->first, request.key());
         ++it) {
      batch.DeleteKv(it->first);
    }
  } else if (auto it = s.state.kv.find(request.key()); it != s.state.kv.end()) {
    if (!request.has_expected_version() || request.expected_version() == it->second.version()) batch.DeleteKv(it->first);
  }
  v1::KvDeleteResponse response;
  response.set_deleted(batch.proto.records_size());
  if (!batch.empty()) {
    v1::StateCounters counters = s.state.counters;
    counters.set_kv_revision(counters.kv_revision() + 1);
    MAINSTAY_RETURN_IF_ERROR(s.Commit(batch, counters));
  }
  response.set_revision(s.state.counters.kv_revision());
  return response;
}

int64_t Coordinator::KvRevision() {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  return s.state.counters.kv_revision();
}

absl::StatusOr<Coordinator::KvChanges> Coordinator::KvChangesAfter(const v1::KvWatchRequest& request, int64_t after,
                                                                    size_t max) {
  if (!request.prefix()) MAINSTAY_RETURN_IF_ERROR(CheckKey(request.key()));
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();  // expiries due now are changes too
  const int64_t now = s.state.counters.kv_revision();
  if (after > now) {
    return absl::InvalidArgumentError(absl::StrCat("start_revision ", after, " is ahead of the KV's revision ", now));
  }
  if (after < s.kv_history_floor) {
    return absl::OutOfRangeError(absl::StrCat("the KV's changes after revision ", after,
                                              " are no longer kept (this coordinator keeps them from revision ",
                                              s.kv_history_floor, "): re-read with KvGet and watch from its revision"));
  }
  if (after == now) return absl::DeadlineExceededError("no change yet");
  KvChanges out;
  out.revision = after;
  for (auto it = std::upper_bound(s.kv_history.begin(), s.kv_history.end(), after,
                                  [](int64_t r, const v1::KvWatchResponse& c) { return r < c.revision(); });
       it != s.kv_history.end(); ++it) {
    // Whole revisions only: a prefix delete's changes share one, and go in one answer.
    if (out.changes.size() >= max && it->revision() != out.revision) break;
    const std::string& key = it->entry().key();
    if (request.prefix() ? HasPrefix(key, request.key()) : key == request.key()) out.changes.push_back(*it);
    out.revision = it->revision();
  }
  if (out.changes.size() < max) out.revision = now;  // read to the end
  return out;
}

}  // namespace mainstay::coordinator

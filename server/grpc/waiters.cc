#include "server/grpc/waiters.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mainstay::grpc_server {

std::string PeerHost(absl::string_view peer) {
  for (absl::string_view scheme : {"ipv4:", "ipv6:"}) {
    if (peer.substr(0, scheme.size()) != scheme) continue;
    absl::string_view rest = peer.substr(scheme.size());
    if (!rest.empty() && rest.front() == '[') {
      const size_t close = rest.find(']');
      if (close != absl::string_view::npos) return std::string(rest.substr(1, close - 1));
    }
    const size_t colon = rest.rfind(':');
    return std::string(colon == absl::string_view::npos ? rest : rest.substr(0, colon));
  }
  return std::string(peer);
}

Waiters::Waiters(Options options) : options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

Waiters::~Waiters() { Shutdown(); }

absl::Status Waiters::Park(const std::string& key, absl::string_view peer, absl::Time deadline, Attempt attempt) {
  const std::string host = PeerHost(peer);
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  const int64_t total = static_cast<int64_t>(entries_.size());
  if (total >= options_.max_total) {
    return absl::ResourceExhaustedError(absl::StrCat("the server already holds ", total, " waiting calls (",
                                                     options_.total_flag, " ", options_.max_total,
                                                     "); call again later"));
  }
  if (int64_t& n = per_key_[key]; n >= options_.max_per_key) {
    return absl::ResourceExhaustedError(absl::StrCat(key, " already has ", n, " waiting calls here (",
                                                     options_.per_key_flag, " ", options_.max_per_key,
                                                     "); call again later"));
  }
  if (int64_t& n = per_host_[host]; n >= options_.max_per_peer) {
    return absl::ResourceExhaustedError(absl::StrCat("host ", host, " already has ", n, " waiting calls here (",
                                                     options_.per_peer_flag, " ", options_.max_per_peer,
                                                     "); call again later"));
  }
  ++per_key_[key];
  ++per_host_[host];
  entries_.push_back(Entry{key, host, deadline, std::min(deadline, absl::Now() + options_.max_wait), std::move(attempt)});
  // One more attempt at once: a change between the caller's first attempt and now notified
  // nobody.
  changed_.insert(key);
  return absl::OkStatus();
}

void Waiters::Notify(const std::string& key) {
  absl::MutexLock lock(&mu_);
  if (per_key_.count(key)) changed_.insert(key);
}

void Waiters::NotifyAll() {
  absl::MutexLock lock(&mu_);
  if (!entries_.empty()) all_changed_ = true;
}

int64_t Waiters::parked() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(entries_.size());
}

void Waiters::EraseLocked(Entries::iterator it) {
  for (auto* counts : {&per_key_, &per_host_}) {
    const std::string& name = counts == &per_key_ ? it->key : it->host;
    auto c = counts->find(name);
    if (c != counts->end() && --c->second <= 0) counts->erase(c);
  }
  entries_.erase(it);
}

void Waiters::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Waiters::Loop() {
  absl::Time next_round = absl::Now() + options_.recheck;
  mu_.Lock();
  while (true) {
    absl::Time wake = next_round;
    for (const Entry& e : entries_) wake = std::min(wake, e.give_up);
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || all_changed_ || !changed_.empty();
    };
    mu_.AwaitWithDeadline(absl::Condition(&woken), wake);
    const absl::Time now = absl::Now();
    const bool stopping = stopping_;
    const bool full = stopping || all_changed_ || now >= next_round;
    all_changed_ = false;
    if (now >= next_round) next_round = now + options_.recheck;
    // The attempts that run this round leave the list while they run (without the lock), so
    // Park and Notify never wait for them; the ones that stay go back afterwards.
    Entries batch;
    for (auto it = entries_.begin(); it != entries_.end();) {
      auto next = std::next(it);
      if (full || changed_.count(it->key) || it->give_up <= now) batch.splice(batch.end(), entries_, it);
      it = next;
    }
    changed_.clear();
    mu_.Unlock();
    std::vector<bool> done;
    done.reserve(batch.size());
    for (Entry& e : batch) {
      Why why = Why::kChanged;
      if (stopping) {
        why = Why::kStopping;
      } else if (e.give_up <= now) {
        why = e.deadline <= now ? Why::kDeadline : Why::kServerLimit;
      }
      const bool finished = e.attempt(why);
      done.push_back(finished || why != Why::kChanged);
    }
    mu_.Lock();
    size_t i = 0;
    for (auto it = batch.begin(); it != batch.end(); ++i) {
      auto next = std::next(it);
      entries_.splice(entries_.end(), batch, it);  // back, so that EraseLocked counts it out
      if (done[i]) EraseLocked(std::prev(entries_.end()));
      it = next;
    }
    if (stopping && entries_.empty()) break;
  }
  mu_.Unlock();
}

}  // namespace mainstay::grpc_server

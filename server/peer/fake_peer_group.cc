#include "server/peer/fake_peer_group.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace mainstay::peer {
namespace {

constexpr absl::Duration kAbortCheckEvery = absl::Milliseconds(50);

enum class ReduceKind { kSum, kMax };

const char* KindName(ReduceKind kind) { return kind == ReduceKind::kSum ? "sum" : "max"; }

// One reduction: the k-th call of every member meets in round k.
struct Round {
  explicit Round(int size) : inputs(size), kinds(size), arrived(size, false) {}
  std::vector<std::vector<double>> inputs;  // by rank; floats are widened exactly
  std::vector<ReduceKind> kinds;
  std::vector<bool> arrived;
  int num_arrived = 0;
  bool done = false;
  absl::Status status;         // OK, or INVALID_ARGUMENT for every member
  std::vector<double> result;  // valid when done and status is OK
  int num_collected = 0;
};

// Everything the members of one group_key share.
struct GroupState {
  explicit GroupState(std::string key) : key(std::move(key)) {}
  const std::string key;
  absl::Mutex mu;
  int size ABSL_GUARDED_BY(mu) = 0;  // 0 until the first Create (Kill may come before)
  std::vector<bool> joined ABSL_GUARDED_BY(mu);
  int num_joined ABSL_GUARDED_BY(mu) = 0;
  std::set<int> dead ABSL_GUARDED_BY(mu);
  // The first failure that broke the group; OK while it is healthy.
  absl::Status broken ABSL_GUARDED_BY(mu);
  std::map<uint64_t, Round> rounds ABSL_GUARDED_BY(mu);
};

void BreakLocked(GroupState& state, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  if (state.broken.ok()) state.broken = std::move(why);
}

void KillLocked(GroupState& state, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  state.dead.insert(rank);
  BreakLocked(state,
              absl::UnavailableError(absl::StrCat("peer group '", state.key, "': member ", rank, " left the group")));
}

// Combines the inputs in rank order once every member has arrived.
void CompleteLocked(Round& round) {
  round.done = true;
  const size_t n = round.inputs[0].size();
  for (size_t r = 1; r < round.inputs.size(); ++r) {
    if (round.inputs[r].size() != n || round.kinds[r] != round.kinds[0]) {
      std::vector<std::string> calls;
      for (size_t i = 0; i < round.inputs.size(); ++i) {
        calls.push_back(absl::StrCat("rank ", i, ": ", KindName(round.kinds[i]), " of ", round.inputs[i].size()));
      }
      round.status = absl::InvalidArgumentError(
          absl::StrCat("peer group members disagree on the reduction (", absl::StrJoin(calls, ", "), ")"));
      return;
    }
  }
  round.result = round.inputs[0];
  for (size_t r = 1; r < round.inputs.size(); ++r) {
    const std::vector<double>& in = round.inputs[r];
    if (round.kinds[0] == ReduceKind::kSum) {
      for (size_t i = 0; i < n; ++i) round.result[i] += in[i];
    } else {
      for (size_t i = 0; i < n; ++i) round.result[i] = std::fmax(round.result[i], in[i]);
    }
  }
}

// The factory's hold on reductions (HoldReductions), shared with its groups.
struct Hold {
  absl::Mutex mu;
  bool on ABSL_GUARDED_BY(mu) = false;
  bool max_only ABSL_GUARDED_BY(mu) = false;
  int waiting ABSL_GUARDED_BY(mu) = 0;

  void Wait(ReduceKind kind) {
    absl::MutexLock lock(&mu);
    if (!on || (max_only && kind != ReduceKind::kMax)) return;
    ++waiting;
    auto released = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return !on; };
    mu.Await(absl::Condition(&released));
    --waiting;
  }
};

class InProcessPeerGroup : public PeerGroup {
 public:
  InProcessPeerGroup(std::shared_ptr<GroupState> state, int rank, int size, std::shared_ptr<Hold> hold)
      : state_(std::move(state)), rank_(rank), size_(size), hold_(std::move(hold)) {}

  ~InProcessPeerGroup() override {
    absl::MutexLock lock(&state_->mu);
    KillLocked(*state_, rank_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(std::span<double> values, absl::Time deadline) override {
    std::vector<double> result;
    absl::Status status =
        Reduce(ReduceKind::kSum, std::vector<double>(values.begin(), values.end()), deadline, &result);
    if (status.ok()) std::copy(result.begin(), result.end(), values.begin());
    return status;
  }

  absl::Status AllReduceMax(std::span<float> values, absl::Time deadline) override {
    std::vector<double> result;
    absl::Status status =
        Reduce(ReduceKind::kMax, std::vector<double>(values.begin(), values.end()), deadline, &result);
    if (status.ok()) {
      // Exact: the maximum of floats is one of them.
      for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(result[i]);
    }
    return status;
  }

 private:
  absl::Status Reduce(ReduceKind kind, std::vector<double> input, absl::Time deadline, std::vector<double>* result) {
    hold_->Wait(kind);
    GroupState& state = *state_;
    absl::MutexLock lock(&state.mu);
    if (!failure_.ok()) return failure_;
    if (!state.broken.ok()) return failure_ = state.broken;

    const auto it = state.rounds.try_emplace(next_round_++, size_).first;
    Round* round = &it->second;  // std::map nodes do not move
    round->inputs[rank_] = std::move(input);
    round->kinds[rank_] = kind;
    round->arrived[rank_] = true;
    if (++round->num_arrived == size_) CompleteLocked(*round);

    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(state.mu) { return round->done || !state.broken.ok(); };
    state.mu.AwaitWithDeadline(absl::Condition(&ready), deadline);
    if (!round->done) {
      if (!state.broken.ok()) return failure_ = state.broken;
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (!round->arrived[r]) missing.push_back(r);
      }
      failure_ =
          absl::DeadlineExceededError(absl::StrCat("peer group '", state.key, "': member ", rank_,
                                                   " timed out waiting for members ", absl::StrJoin(missing, ",")));
      // The others can no longer complete this round: they must not wait for their deadlines.
      BreakLocked(state, absl::UnavailableError(absl::StrCat("peer group '", state.key, "': member ", rank_,
                                                             " gave up on a reduction (deadline)")));
      return failure_;
    }
    absl::Status status = round->status;
    if (status.ok()) *result = round->result;
    if (++round->num_collected == size_) state.rounds.erase(it);
    return status;  // INVALID_ARGUMENT does not break the group: every member saw it
  }

  const std::shared_ptr<GroupState> state_;
  const int rank_;
  const int size_;
  const std::shared_ptr<Hold> hold_;
  uint64_t next_round_ = 0;  // guarded by the one-thread-at-a-time contract
  absl::Status failure_;     // sticky: the first failure this member saw
};

}  // namespace

struct InProcessPeerGroupFactory::Registry {
  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<GroupState>> groups ABSL_GUARDED_BY(mu);
  std::map<std::string, int64_t> generations ABSL_GUARDED_BY(mu);
  const std::shared_ptr<Hold> hold = std::make_shared<Hold>();

  std::shared_ptr<GroupState> Get(const std::string& key) {
    absl::MutexLock lock(&mu);
    std::shared_ptr<GroupState>& state = groups[key];
    if (state == nullptr) state = std::make_shared<GroupState>(key);
    return state;
  }
};

InProcessPeerGroupFactory::InProcessPeerGroupFactory() : registry_(std::make_shared<Registry>()) {}
InProcessPeerGroupFactory::~InProcessPeerGroupFactory() = default;

absl::StatusOr<std::unique_ptr<PeerGroup>> InProcessPeerGroupFactory::Create(const std::string& group_key, int rank,
                                                                             int size, absl::Time deadline,
                                                                             const AbortCheck& abort) {
  if (group_key.empty()) return absl::InvalidArgumentError("peer group: empty group_key");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("peer group '", group_key, "': rank ", rank, " of size ", size));
  }
  if (size == 1) return std::make_unique<LocalPeerGroup>();

  std::shared_ptr<GroupState> state = registry_->Get(group_key);
  absl::MutexLock lock(&state->mu);
  if (state->size == 0) {
    state->size = size;
    state->joined.assign(size, false);
  } else if (state->size != size) {
    return absl::InvalidArgumentError(absl::StrCat("peer group '", group_key, "': member ", rank, " says size ", size,
                                                   ", others said ", state->size));
  }
  if (state->joined[rank]) {
    return absl::InvalidArgumentError(absl::StrCat("peer group '", group_key, "': rank ", rank, " already joined"));
  }
  if (state->dead.count(rank) > 0) {
    return absl::UnavailableError(absl::StrCat("peer group '", group_key, "': member ", rank, " was killed"));
  }
  if (!state->broken.ok()) return state->broken;

  state->joined[rank] = true;
  ++state->num_joined;
  GroupState* s = state.get();
  auto formed = [s]() ABSL_SHARED_LOCKS_REQUIRED(s->mu) { return s->num_joined == s->size || !s->broken.ok(); };
  absl::Status aborted;
  while (!state->mu.AwaitWithDeadline(absl::Condition(&formed), std::min(deadline, absl::Now() + kAbortCheckEvery)) &&
         absl::Now() < deadline) {
    if (!abort) continue;
    state->mu.Unlock();  // (the check may read what other members hold)
    aborted = abort();
    state->mu.Lock();
    if (!aborted.ok() && !formed()) break;
  }
  if (!aborted.ok() && state->num_joined < size && state->broken.ok()) {
    state->joined[rank] = false;
    --state->num_joined;
    return Annotate(aborted, absl::StrCat("peer group '", group_key, "': member ", rank, " left before it formed"));
  }
  // Once formed, the group is this member's even if a peer has died since: its first
  // reduction reports that, as it would over a network.
  if (state->num_joined < size && !state->broken.ok()) return state->broken;
  if (state->num_joined < size) {
    // Leave, so that the key's state says who is still missing.
    state->joined[rank] = false;
    --state->num_joined;
    std::vector<int> missing;
    for (int r = 0; r < size; ++r) {
      if (!state->joined[r] && r != rank) missing.push_back(r);
    }
    return absl::DeadlineExceededError(absl::StrCat("peer group '", group_key, "': member ", rank,
                                                    " timed out waiting for members ", absl::StrJoin(missing, ","),
                                                    " to join"));
  }
  return std::make_unique<InProcessPeerGroup>(std::move(state), rank, size, registry_->hold);
}

void InProcessPeerGroupFactory::Kill(const std::string& group_key, int rank) {
  std::shared_ptr<GroupState> state = registry_->Get(group_key);
  absl::MutexLock lock(&state->mu);
  KillLocked(*state, rank);
}

void InProcessPeerGroupFactory::HoldReductions(bool hold, bool max_only) {
  absl::MutexLock lock(&registry_->hold->mu);
  registry_->hold->on = hold;
  registry_->hold->max_only = max_only;
}

int InProcessPeerGroupFactory::reductions_held() const {
  absl::MutexLock lock(&registry_->hold->mu);
  return registry_->hold->waiting;
}

absl::StatusOr<int64_t> InProcessPeerGroupFactory::Generation(const std::string& base_key, int64_t at_least,
                                                              absl::Time) {
  absl::MutexLock lock(&registry_->mu);
  int64_t& generation = registry_->generations[base_key];
  generation = std::max(generation, at_least);
  return generation;
}

}  // namespace mainstay::peer

// The agreed outcome of a step (DESIGN.md section 8; docs/architecture.md, "Agreed outcome of a
// step"): the job's peer group and its generations, the step's peer reductions as decision
// points, and how a daemon whose reduction failed learns the decision from its peers.
//
// The rule: a step's outcome is a function of the results of its deciding reduction (the stats
// SUM when it finds a non-finite gradient, else the amax MAX). Such a result exists on a daemon
// only if every daemon contributed to that reduction, and once a daemon holds it, the step is
// decided for everyone: a daemon whose own copy of the reduction failed asks the others and
// finishes the step with theirs. It gives the step up only when every peer says it holds no
// result and runs no reduction of the step, and it leaves the group before asking, so no peer
// can complete one afterwards.
#include <signal.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/daemon/job.h"

namespace mainstay::daemon {

namespace {
constexpr size_t kDecisionsKept = 8;  // a peer in doubt is at most one step behind
constexpr absl::Duration kAskTimeout = absl::Seconds(2);
constexpr absl::Duration kAskInterval = absl::Milliseconds(200);
constexpr int kRoundsToGiveUpOnALeaver = 3;
}  // namespace

absl::StatusOr<bool> Job::EnsureGroup(const std::vector<std::string>& members, int64_t epoch, absl::Time deadline) {
  if (group_ != nullptr && group_epoch_ == epoch && group_members_ == members) return false;
  group_.reset();
  if (members.size() <= 1) {
    group_ = std::make_unique<peer::LocalPeerGroup>();
    group_base_.clear();
  } else {
    auto self = std::find(members.begin(), members.end(), options_.daemon_id);
    if (self == members.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id_, ": this daemon (", options_.daemon_id, ") is not in the placement"));
    }
    if (options_.peers == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id_, " spans ", members.size(),
                                                        " daemons but this daemon has no peer group configured"));
    }
    // The key comes from agreed state only: the placement epoch and the generation the members
    // share. A group that broke is rebuilt at the next generation by everyone (BreakGroup).
    const std::string base = absl::StrCat("mainstay/peer/", job_id_, "/", epoch);
    absl::StatusOr<int64_t> generation = options_.peers->Generation(base, 0, deadline);
    if (!generation.ok()) return Annotate(generation.status(), "joining the job's peer group");
    group_base_ = base;
    group_generation_ = *generation;
    // Waiting for members that will not come is how two daemons' attempts drift a whole peer
    // timeout apart and then keep missing each other: leave as soon as the job moved to a newer
    // placement epoch, or a member broke this generation.
    const int64_t joined = *generation;
    const peer::AbortCheck abort = [this, epoch, base, joined]() -> absl::Status {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return absl::UnavailableError("the job is stopping on this daemon");
        if (epoch_ > epoch) {
          return absl::AbortedError(absl::StrCat("the job moved on to placement epoch ", epoch_, " (this attempt is at ",
                                                 epoch, ")"));
        }
      }
      absl::StatusOr<int64_t> now = options_.peers->Generation(base, 0, absl::Now() + absl::Seconds(1));
      if (now.ok() && *now > joined) {
        return absl::AbortedError(
            absl::StrCat("a member left generation ", joined, " of the peer group for generation ", *now));
      }
      return absl::OkStatus();
    };
    absl::StatusOr<std::unique_ptr<peer::PeerGroup>> group =
        options_.peers->Create(absl::StrCat(base, "/g", *generation), static_cast<int>(self - members.begin()),
                               static_cast<int>(members.size()), deadline, abort);
    if (!group.ok()) {
      BreakGroup();  // members that joined this generation must not wait in it for us again
      return Annotate(group.status(), "joining the job's peer group");
    }
    group_ = *std::move(group);
  }
  group_epoch_ = epoch;
  group_members_ = members;
  return true;
}

void Job::BreakGroup() {
  group_.reset();
  group_epoch_ = -1;
  group_members_.clear();
  if (group_base_.empty() || options_.peers == nullptr) return;  // a one-daemon job
  absl::StatusOr<int64_t> next =
      options_.peers->Generation(group_base_, group_generation_ + 1, absl::Now() + absl::Seconds(10));
  if (!next.ok()) {
    // The members still meet: the next EnsureGroup reads the counter again, and any member
    // whose group fails raises it.
    Log(LogLevel::kWarning, "daemon",
        absl::StrCat("job ", job_id_, ": could not raise the peer group generation: ", next.status().ToString()));
  }
  group_base_.clear();
}

void Job::CrashIfInjected(StepFault::Phase phase, int64_t s, bool holds_primary, bool holds_replica,
                          absl::FunctionRef<std::string()> what) const {
  if (!options_.faults.CrashesAt(phase, s, holds_primary, holds_replica)) return;
  Log(LogLevel::kWarning, "daemon",
      absl::StrCat("job ", job_id_, ": injected fault: SIGKILL ", what(), " (--inject-fault)"));
  ::kill(::getpid(), SIGKILL);
}

void Job::CrashIfInjectedLocked(StepFault::Phase phase, int64_t s, absl::FunctionRef<std::string()> what) const {
  if (!options_.faults.armed()) return;
  bool primary = false;
  bool replica = false;
  for (const auto& [key, shard] : shards_) {
    primary |= !shard->replica;
    replica |= shard->replica;
  }
  CrashIfInjected(phase, s, primary, replica, what);
}

absl::Status Job::RunReduction(int64_t step, int index, const std::function<absl::Status()>& reduce,
                               const std::function<bool(v1::StepDecision*)>& decided) {
  {
    absl::MutexLock lock(&mu_);
    reducing_ = true;
  }
  absl::Status status = reduce();
  if (status.ok() && options_.faults.LosesReduction(step, index) && !fault_fired_) {
    fault_fired_ = true;
    status = absl::DeadlineExceededError(absl::StrCat("injected fault: the result of reduction ", index, " of step ",
                                                      step, " was lost (--inject-fault)"));
    Log(LogLevel::kWarning, "daemon", absl::StrCat("job ", job_id_, ": ", status.message()));
  }
  absl::MutexLock lock(&mu_);
  reducing_ = false;
  v1::StepDecision decision;
  decision.set_step(step);
  if (status.ok() && decided(&decision)) {
    decisions_[step] = std::move(decision);
    while (decisions_.size() > kDecisionsKept) decisions_.erase(decisions_.begin());
    CrashIfInjectedLocked(StepFault::Phase::kDecision, step, [&] {
      return absl::StrCat("after deciding step ", step);
    });
  }
  return status;
}

absl::StatusOr<v1::StepDecision> Job::LearnDecision(int64_t step, const std::vector<std::string>& members,
                                                    const absl::Status& cause) {
  // Leave first: a peer still inside the reduction then fails at once rather than at its
  // deadline, and no peer can complete a reduction of this attempt after it answered UNDECIDED.
  BreakGroup();
  if (options_.peer_client == nullptr) return cause;
  const absl::Time start = absl::Now();
  absl::Time next_log = start + absl::Seconds(10);
  v1::GetStepOutcomeRequest request;
  request.set_job_id(job_id_);
  request.set_step(step);
  request.set_asker_daemon_id(options_.daemon_id);
  std::map<std::string, int> unreachable_rounds;  // of members that left the placement
  while (true) {
    std::vector<v1::DaemonEndpoint> peers;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::UnavailableError(absl::StrCat("job ", job_id_, " stopped on this daemon"));
      if (!IsMemberLocked(options_.daemon_id)) return cause;
      // The step's members, and the placement's members that joined since: a move's target
      // holds the decisions its source made (they come with the copy), and the source, fenced
      // and dropped, may no longer answer.
      std::vector<std::string> asked = members;
      for (const std::string& id : members_) {
        if (std::find(members.begin(), members.end(), id) == members.end()) asked.push_back(id);
      }
      peers = PeersLocked(asked);
    }
    if (peers.empty()) return cause;
    bool undecided_everywhere = true;
    std::string unknown;
    for (const v1::DaemonEndpoint& peer : peers) {
      const bool in_step = std::find(members.begin(), members.end(), peer.daemon_id()) != members.end();
      absl::StatusOr<v1::GetStepOutcomeResponse> answer =
          options_.peer_client->GetStepOutcome(peer, request, absl::Now() + kAskTimeout);
      if (!answer.ok()) {
        absl::MutexLock lock(&mu_);
        // A member the placement has dropped since (dead, or its shards moved away) that cannot
        // be reached in three rounds takes no further part: it decided nothing anyone still
        // holds (a move's target, which holds its decisions, answers for it). A current member
        // is asked until it answers, or leaves the placement (a failover or restore).
        if (!IsMemberLocked(peer.daemon_id()) && ++unreachable_rounds[peer.daemon_id()] >= kRoundsToGiveUpOnALeaver) {
          continue;
        }
      }
      // A daemon not in the step that holds no decision of it (and is copying none) has no say.
      if (!in_step && answer.ok() && answer->state() == v1::STEP_OUTCOME_STATE_UNDECIDED) continue;
      if (answer.ok() && answer->state() == v1::STEP_OUTCOME_STATE_DECIDED) {
        if (answer->decision().step() != step) {
          return absl::InternalError(absl::StrCat("daemon ", peer.daemon_id(), " answered for step ",
                                                  answer->decision().step(), " when asked for ", step));
        }
        Log(LogLevel::kInfo, "daemon",
            absl::StrCat("job ", job_id_, ": step ", step, " failed here (", cause.message(), ") but daemon ",
                         peer.daemon_id(), " decided it: finishing it with that decision"));
        return answer->decision();
      }
      if (answer.ok() && answer->state() == v1::STEP_OUTCOME_STATE_UNDECIDED) continue;
      undecided_everywhere = false;
      absl::StrAppend(&unknown, unknown.empty() ? "" : ", ", peer.daemon_id(), " (",
                      !answer.ok() ? answer.status().ToString()
                      : in_step    ? std::string("still reducing")
                                   : std::string("copying the decisions of a daemon that left"),
                      ")");
    }
    if (undecided_everywhere) return cause;
    if (absl::Now() >= next_log) {
      next_log = absl::Now() + absl::Seconds(10);
      Log(LogLevel::kWarning, "daemon",
          absl::StrCat("job ", job_id_, ": step ", step, " is in doubt for ", absl::FormatDuration(absl::Now() - start),
                       ": waiting for ", unknown));
    }
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), kAskInterval);
  }
}

std::vector<v1::DaemonEndpoint> Job::PeersLocked(const std::vector<std::string>& members) const {
  std::vector<v1::DaemonEndpoint> peers;
  for (const std::string& id : members) {
    if (id == options_.daemon_id) continue;
    auto it = endpoints_.find(id);
    v1::DaemonEndpoint e;
    if (it != endpoints_.end()) e = it->second;
    e.set_daemon_id(id);
    peers.push_back(std::move(e));
  }
  return peers;
}

absl::Status Job::ConfirmDecisionHeld(int64_t step, const std::vector<std::string>& members) {
  if (group_ != nullptr) {
    float token = 0.0f;
    const absl::Status barrier =
        group_->AllReduceMax(std::span<float>(&token, 1), absl::Now() + options_.peer_timeout);
    if (barrier.ok()) return absl::OkStatus();  // every member entered it holding the decision
    Log(LogLevel::kWarning, "daemon",
        absl::StrCat("job ", job_id_, ": step ", step, " is decided here but the barrier after it failed (",
                     barrier.message(), "): asking the peers whether they hold the decision before committing"));
    BreakGroup();
  }
  if (options_.peer_client == nullptr) return absl::OkStatus();
  const absl::Time start = absl::Now();
  absl::Time next_log = start + absl::Seconds(10);
  v1::GetStepOutcomeRequest request;
  request.set_job_id(job_id_);
  request.set_step(step);
  request.set_asker_daemon_id(options_.daemon_id);
  while (true) {
    std::vector<v1::DaemonEndpoint> peers;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::UnavailableError(absl::StrCat("job ", job_id_, " stopped on this daemon"));
      for (v1::DaemonEndpoint& peer : PeersLocked(members)) {
        if (IsMemberLocked(peer.daemon_id())) peers.push_back(std::move(peer));  // one that left takes no part
      }
    }
    std::string missing;
    for (const v1::DaemonEndpoint& peer : peers) {
      absl::StatusOr<v1::GetStepOutcomeResponse> answer =
          options_.peer_client->GetStepOutcome(peer, request, absl::Now() + kAskTimeout);
      // (A peer past the step committed it: it keeps the decision of its last steps. Version 0,
      // step -1, is "past" everywhere, so only its decision counts.)
      if (answer.ok() &&
          (answer->state() == v1::STEP_OUTCOME_STATE_DECIDED || (step >= 0 && answer->committed_step() >= step))) {
        continue;
      }
      absl::StrAppend(&missing, missing.empty() ? "" : ", ", peer.daemon_id());
    }
    if (missing.empty()) return absl::OkStatus();
    if (absl::Now() >= next_log) {
      next_log = absl::Now() + absl::Seconds(10);
      Log(LogLevel::kWarning, "daemon",
          absl::StrCat("job ", job_id_, ": step ", step, " is decided here; waiting ",
                       absl::FormatDuration(absl::Now() - start), " so far for ", missing,
                       " to hold the decision too before committing it"));
    }
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), kAskInterval);
  }
}

v1::GetStepOutcomeResponse Job::GetStepOutcome(const v1::GetStepOutcomeRequest& request) const {
  absl::MutexLock lock(&mu_);
  v1::GetStepOutcomeResponse response;
  response.set_committed_step(committed_step_);
  if (auto it = decisions_.find(request.step()); it != decisions_.end()) {
    response.set_state(v1::STEP_OUTCOME_STATE_DECIDED);
    *response.mutable_decision() = it->second;
  } else if (reducing_ && executing_step_ == request.step()) {
    response.set_state(v1::STEP_OUTCOME_STATE_RUNNING);
  } else if (executing_step_ == -2 && IsMemberLocked(request.asker_daemon_id()) &&
             std::any_of(moves_in_.begin(), moves_in_.end(), [&](const MoveIn& m) ABSL_NO_THREAD_SAFETY_ANALYSIS {
               return !IsMemberLocked(m.source.daemon_id());
             })) {
    // A copy in progress from a daemon that left the placement (a move's source: fenced, soon
    // dropped, perhaps cut off from the asker) carries its decisions: a member asks again.
    // Never while a step runs here (the copy waits for the step thread); never for a copy from
    // a member (a re-replication's source answers for itself, and its copy may wait for the
    // asker's own step); never to a daemon that left (a fenced source, whose step the copy may
    // be waiting for, and which must not wait for copies in turn).
    response.set_state(v1::STEP_OUTCOME_STATE_RUNNING);
  } else {
    response.set_state(v1::STEP_OUTCOME_STATE_UNDECIDED);
  }
  return response;
}

}  // namespace mainstay::daemon

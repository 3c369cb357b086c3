// Replicated jobs (replication_factor >= 2; docs/architecture.md, "Replicas"): failover of a
// lost daemon's shards to their surviving copies, and re-replication back to R copies.
#include <algorithm>

#include "absl/strings/str_join.h"
#include "server/coordinator/coordinator_impl.h"

namespace mainstay::coordinator {

bool Coordinator::Impl::FailoverLocked(const std::string& job_id) {
  const v1::StoredJob* job = FindJob(job_id);
  if (job == nullptr || job->info().spec().replication_factor() < 2) return false;
  v1::StoredJob updated = *job;
  std::set<std::string> lost;
  int promoted = 0;
  for (v1::ShardPlacement& p : *updated.mutable_placement()->mutable_shards()) {
    std::vector<std::string> live;  // the primary first, then the replicas in their order
    std::vector<std::string> copies = {p.daemon_id()};
    copies.insert(copies.end(), p.replica_daemon_ids().begin(), p.replica_daemon_ids().end());
    for (const std::string& id : copies) {
      if (HoldsJob(job_id, id)) {
        live.push_back(id);
      } else {
        lost.insert(id);
      }
    }
    if (live.empty()) {
      Log(LogLevel::kError, "coordinator",
          absl::StrCat("job ", job_id, ": every copy of (bucket ", p.shard().bucket(), ", shard ", p.shard().shard(),
                       ") is lost (primary ", p.daemon_id(), "): failover is impossible"));
      return false;
    }
    if (live.front() != p.daemon_id()) ++promoted;
    p.set_daemon_id(live.front());
    p.clear_replica_daemon_ids();
    for (size_t i = 1; i < live.size(); ++i) p.add_replica_daemon_ids(live[i]);
  }
  for (const v1::PendingMove& m : job->moves()) {  // a source may be out of the placement already
    if (!HoldsJob(job_id, m.source_daemon_id())) lost.insert(m.source_daemon_id());
  }
  if (lost.empty()) return true;  // nothing to do: every copy is live
  const int64_t epoch = job->placement().epoch() + 1;
  updated.mutable_placement()->set_epoch(epoch);
  SetDaemons(*updated.mutable_placement());
  updated.mutable_info()->set_placement_epoch(epoch);
  // Moves in progress go on at the new epoch: one whose target was lost is over (its target is
  // out of the placement); one whose source was lost copies from another copy of the rank that
  // holds its state (a move's target may be in the placement with nothing loaded yet).
  const std::vector<std::vector<std::string>> holders = HoldersByRank(updated);
  std::set<std::pair<int, std::string>> targets;  // (rank, daemon) still waiting for a copy
  for (const v1::PendingMove& m : job->moves()) targets.insert({m.rank(), m.target_daemon_id()});
  updated.clear_moves();
  for (const v1::PendingMove& m : job->moves()) {
    if (lost.count(m.target_daemon_id())) continue;
    v1::PendingMove& next = *updated.add_moves();
    next = m;
    next.set_epoch(epoch);
    if (!lost.count(m.source_daemon_id())) continue;
    std::string from;
    for (const std::string& id : holders.at(static_cast<size_t>(m.rank()))) {
      if (!targets.count({m.rank(), id})) {
        from = id;
        break;
      }
    }
    if (from.empty()) {
      Log(LogLevel::kError, "coordinator",
          absl::StrCat("job ", job_id, ": rank ", m.rank(), " was being copied from ", m.source_daemon_id(), " to ",
                       m.target_daemon_id(), ", and no other copy of it is left: failover is impossible"));
      return false;
    }
    Log(LogLevel::kWarning, "coordinator",
        absl::StrCat("job ", job_id, ": the copy of rank ", m.rank(), " to ", m.target_daemon_id(), " lost its source ",
                     m.source_daemon_id(), "; it copies from ", from, " at placement epoch ", epoch));
    next.set_source_daemon_id(from);
  }
  auto lost_it = lost_state.find(job_id);
  if (lost_it != lost_state.end()) {
    for (const std::string& id : lost) lost_it->second.erase(id);
    if (lost_it->second.empty()) lost_state.erase(lost_it);
  }
  updated.mutable_info()->set_state(HealthOf(updated));
  Batch batch;
  batch.PutJob(updated);
  if (absl::Status saved = Commit(batch); !saved.ok()) {
    Log(LogLevel::kError, "coordinator", absl::StrCat("job ", job_id, ": failover not saved: ", saved.message()));
    jobs_to_recover.insert(job_id);  // tried again at the next tick
    return true;
  }
  for (const std::string& id : lost) {
    progress[job_id].erase(id);
    resends.erase({job_id, id});
  }
  std::vector<std::string> lost_list(lost.begin(), lost.end());
  Log(LogLevel::kWarning, "coordinator",
      absl::StrCat("job ", job_id, ": lost ", absl::StrJoin(lost_list, ", "), "; ", promoted,
                   " shard(s) fail over to their replicas at placement epoch ", updated.placement().epoch(),
                   " (nothing rewound; the job runs with fewer copies until re-replication)"));
  FaultPoint("failover-committed");
  SendMoves(updated);  // a move's target gets its ranks from their (new) source
  return true;
}

void Coordinator::Impl::ReReplicateLocked() {
  std::vector<v1::StoredJob> planned;
  for (const auto& [job_id, job] : state.jobs) {
    const int r = job.info().spec().replication_factor();
    if (r < 2 || !job.started() || !job.moves().empty() || jobs_to_recover.count(job_id)) continue;
    std::vector<std::vector<std::string>> holders = HoldersByRank(job);
    if (std::all_of(holders.begin(), holders.end(), [&](const auto& h) { return static_cast<int>(h.size()) >= r; })) {
      continue;
    }
    // Only once every daemon of the job runs its current placement (a failover's epoch reached
    // them all): the copy then starts from a settled step.
    auto reported = progress.find(job_id);
    bool settled = reported != progress.end();
    for (const v1::DaemonEndpoint& e : job.placement().daemons()) {
      if (!settled) break;
      auto p = reported->second.find(e.daemon_id());
      settled = p != reported->second.end() && p->second.placement_epoch() >= job.placement().epoch() &&
                !p->second.loading();
    }
    if (!settled) continue;
    // Not on a daemon that refused the job's shards or could not allocate them in the last
    // kRefusalRememberedMs: it would likely refuse again, and each try costs a placement epoch.
    std::vector<DaemonCandidate> candidates = Candidates("");
    const std::set<std::string> refusers = RecentRefusers(job_id);
    std::erase_if(candidates, [&](const DaemonCandidate& c) { return refusers.count(c.id) > 0; });
    absl::StatusOr<std::vector<std::vector<std::string>>> added =
        AddCopies(holders, r, std::move(candidates), job.bytes_per_rank());
    if (!added.ok()) {
      if (rereplication_waiting[job_id] != job.placement().epoch()) {
        rereplication_waiting[job_id] = job.placement().epoch();
        Log(LogLevel::kWarning, "coordinator",
            absl::StrCat("job ", job_id, " has fewer than ", r, " copies of some rank and cannot get them back yet: ",
                         added.status().message(), "; re-replication waits for a ready daemon with room"));
      }
      continue;
    }
    rereplication_waiting.erase(job_id);
    std::vector<RankMove> moves;
    std::vector<std::string> described;
    for (size_t rank = 0; rank < added->size(); ++rank) {
      for (const std::string& to : (*added)[rank]) {
        moves.push_back({static_cast<int>(rank), holders[rank].front(), to, /*keep_source=*/true});
        described.push_back(absl::StrCat("rank ", rank, " to ", to));
      }
    }
    std::vector<v1::ShardMove> ignored;
    v1::StoredJob updated = PlanMoves(job, moves, &ignored);
    Batch batch;
    batch.PutJob(updated);
    if (absl::Status saved = Commit(batch); !saved.ok()) {
      Log(LogLevel::kError, "coordinator", absl::StrCat("job ", job_id, ": re-replication not saved: ", saved.message()));
      continue;
    }
    Log(LogLevel::kInfo, "coordinator",
        absl::StrCat("job ", job_id, ": re-replicating at placement epoch ", updated.placement().epoch(), " (",
                     absl::StrJoin(described, ", "), "; each copied from its primary while the job waits at a step "
                     "boundary)"));
    planned.push_back(std::move(updated));
  }
  if (!planned.empty()) FaultPoint("re-replication-committed");
  for (const v1::StoredJob& job : planned) SendMoves(job);
}

}  // namespace mainstay::coordinator

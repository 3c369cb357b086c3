// A daemon's refusal of an assignment for lack of memory (its AssignShard answered
// RESOURCE_EXHAUSTED: the job's MemoryPlan does not fit its --memory-bytes next to its other
// jobs), or a move's target that could not allocate the copy (its heartbeat's load error): the
// ranks it was to take go to other daemons at a new placement epoch.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/coordinator/coordinator_impl.h"

namespace mainstay::coordinator {

void Coordinator::AssignmentRefused(const std::string& address, const v1::AssignShardRequest& request,
                                    const absl::Status& status) {
  Impl& s = *impl_;
  Impl::StateLock lock(s);
  s.TickLocked();
  auto job_it = s.state.jobs.find(request.job_id());
  if (job_it == s.state.jobs.end()) return;
  if (request.placement_epoch() != job_it->second.placement().epoch()) return;  // overtaken by a newer epoch
  std::string refuser;
  for (const auto& [id, d] : s.state.daemons) {
    if (d.endpoint().address() == address && d.state() != v1::DAEMON_STATE_DOWN) refuser = id;
  }
  if (refuser.empty()) return;
  s.PlaceRefusedRanks(refuser, job_it->second, request.has_from_checkpoint(), status);
}

std::set<std::string> Coordinator::Impl::RecentRefusers(const std::string& job_id) const {
  std::set<std::string> out;
  if (auto no = refused_at.find(job_id); no != refused_at.end()) {
    for (const auto& [daemon_id, at] : no->second) {
      if (Now() - at < kRefusalRememberedMs) out.insert(daemon_id);
    }
  }
  return out;
}

void Coordinator::Impl::PlaceRefusedRanks(const std::string& refuser, const v1::StoredJob& job, bool restore,
                                          const absl::Status& status, bool moves_only) {
  Impl& s = *this;
  s.refused_at[job.info().job_id()][refuser] = s.Now();

  // The ranks the refuser was to gain: all of its ranks before the job started, or in a restore
  // (nothing of them exists on any daemon but the checkpoint), else those a pending move brings
  // to it (their source still has them).
  const std::vector<std::vector<std::string>> holders = Impl::HoldersByRank(job);
  std::map<int, std::string> gained;  // rank -> the move's source ("" for a fresh rank)
  for (size_t r = 0; r < holders.size(); ++r) {
    if (!moves_only && (!job.started() || restore) && std::count(holders[r].begin(), holders[r].end(), refuser)) {
      gained[static_cast<int>(r)] = "";
    }
  }
  for (const v1::PendingMove& m : job.moves()) {
    if (m.target_daemon_id() == refuser) gained[m.rank()] = m.source_daemon_id();
  }
  if (gained.empty()) {
    Log(LogLevel::kWarning, "coordinator",
        absl::StrCat("daemon ", refuser, " refused its shards of job ", job.info().job_id(), " at epoch ",
                     job.placement().epoch(), " (", status.message(), "); it holds them already, so they stay"));
    return;
  }

  std::vector<DaemonCandidate> candidates = s.Candidates("");
  const std::set<std::string> excluded = s.RecentRefusers(job.info().job_id());
  v1::StoredJob updated = job;
  v1::Placement& placement = *updated.mutable_placement();
  const int64_t epoch = placement.epoch() + 1;
  std::vector<std::string> lines;
  for (const auto& [rank, source] : gained) {
    const std::vector<std::string>& h = holders[static_cast<size_t>(rank)];
    const DaemonCandidate* best = nullptr;
    for (const DaemonCandidate& c : candidates) {
      if (excluded.count(c.id) || std::count(h.begin(), h.end(), c.id) || c.free_bytes < job.bytes_per_rank()) continue;
      if (best == nullptr || c.free_bytes > best->free_bytes) best = &c;
    }
    // Where no daemon has room, a move goes back to its source's copy; a fresh rank waits (the
    // refuser is asked again by reconciliation, and another daemon may register meanwhile).
    std::string to = best != nullptr ? best->id : source;
    if (to.empty()) {
      lines.push_back(absl::StrCat("rank ", rank, ": no other ready daemon has ", job.bytes_per_rank(),
                                   " bytes free; it waits"));
      continue;
    }
    for (DaemonCandidate& c : candidates) {
      if (c.id == to) c.free_bytes -= job.bytes_per_rank();
    }
    const bool back_to_source = to == source;
    for (v1::ShardPlacement& p : *placement.mutable_shards()) {
      if (p.shard().shard() != rank) continue;
      auto* replicas = p.mutable_replica_daemon_ids();
      const bool source_still_holds =
          p.daemon_id() == source || std::count(replicas->begin(), replicas->end(), source) > 0;
      if (back_to_source && source_still_holds) {
        // A re-replication (the source kept its role): the extra copy is dropped.
        replicas->erase(std::remove(replicas->begin(), replicas->end(), refuser), replicas->end());
      } else if (p.daemon_id() == refuser) {
        p.set_daemon_id(to);
      } else {
        std::replace(replicas->begin(), replicas->end(), refuser, to);
      }
    }
    for (int i = updated.moves_size() - 1; i >= 0; --i) {
      v1::PendingMove* m = updated.mutable_moves(i);
      if (m->rank() != rank || m->target_daemon_id() != refuser) continue;
      if (back_to_source) {
        updated.mutable_moves()->DeleteSubrange(i, 1);
      } else {
        m->set_target_daemon_id(to);
        m->set_epoch(epoch);
      }
    }
    lines.push_back(back_to_source ? absl::StrCat("rank ", rank, " stays on ", source, " (no other daemon has room)")
                                   : absl::StrCat("rank ", rank, " goes to ", to));
  }
  const std::string summary = absl::StrJoin(lines, "; ");
  if (updated.placement().SerializeAsString() == job.placement().SerializeAsString() &&
      updated.moves_size() == job.moves_size()) {
    Log(LogLevel::kWarning, "coordinator",
        absl::StrCat("daemon ", refuser, " has no room for job ", job.info().job_id(), " (", status.message(), "): ",
                     summary));
    return;
  }
  placement.set_epoch(epoch);
  s.SetDaemons(placement);
  updated.mutable_info()->set_placement_epoch(epoch);
  if (restore) updated.set_restored_epoch(epoch);  // every daemon loads the checkpoint at this epoch
  Batch batch;
  batch.PutJob(updated);
  if (absl::Status committed = s.Commit(batch); !committed.ok()) {
    Log(LogLevel::kError, "coordinator", absl::StrCat("could not re-place job ", job.info().job_id(), " after daemon ",
                                                     refuser, " refused it: ", committed.message()));
    return;
  }
  Log(LogLevel::kWarning, "coordinator",
      absl::StrCat("daemon ", refuser, " has no room for job ", job.info().job_id(), " (", status.message(),
                   "): at placement epoch ", epoch, " ", summary));
  if (restore) {
    s.SendAssignments(updated, {}, "", &updated.restored_from());
  } else {
    s.SendMoves(updated);
  }
}

}  // namespace mainstay::coordinator

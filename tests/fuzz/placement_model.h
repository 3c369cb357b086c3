// assign_shard_fuzzer's model of what a shard daemon holds after the AssignShard / DropShard
// messages it accepted: which jobs, at which epoch, which shards with which roles, and which
// wait for a copy. It restates the semantics of docs/daemon.md and server/daemon/job.cc
// (ApplyPlacement, Drop) independently of the daemon, so the fuzzer can compare the two.
// Plain values; not thread-safe.
#ifndef MAINSTAY_TESTS_FUZZ_PLACEMENT_MODEL_H_
#define MAINSTAY_TESTS_FUZZ_PLACEMENT_MODEL_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/job_spec.h"
#include "mainstay/v1/shard.pb.h"

namespace mainstay::fuzz {

using Key = std::pair<int32_t, int32_t>;  // (bucket, shard)

struct HeldShard {
  bool incoming = false;  // gained from_peer: waits for a copy (the fuzzer's daemon never gets one)
};

// What a placement says of daemon `self`.
struct PlacementView {
  std::string self;
  std::map<Key, std::string> owners;                 // the last entry of a shard wins
  std::map<Key, std::vector<std::string>> replicas;  // every entry's replicas
  std::set<std::string> members;

  PlacementView() = default;
  PlacementView(std::string self_id, const v1::Placement& p) : self(std::move(self_id)) {
    for (const v1::ShardPlacement& s : p.shards()) {
      const Key k{s.shard().bucket(), s.shard().shard()};
      owners[k] = s.daemon_id();
      members.insert(s.daemon_id());
      for (const std::string& r : s.replica_daemon_ids()) {
        replicas[k].push_back(r);
        members.insert(r);
      }
    }
  }
  // Primary or replica here; a shard the placement does not list stays where it is.
  bool Holds(const Key& k) const {
    auto owner = owners.find(k);
    if (owner == owners.end() || owner->second == self) return true;
    auto r = replicas.find(k);
    return r != replicas.end() && std::count(r->second.begin(), r->second.end(), self) > 0;
  }
  bool IsReplica(const Key& k) const {
    auto owner = owners.find(k);
    return owner != owners.end() && owner->second != self;
  }
  bool Alone() const {
    return std::all_of(members.begin(), members.end(), [&](const std::string& id) { return id == self; });
  }
};

struct JobModel {
  ResolvedJob job;
  std::string token;  // whose digest the job was created with; "" when not one the fuzzer knows
  bool restored = false;
  std::pair<std::string, int64_t> restored_from{"", -1};  // (checkpoint id, epoch), as Job keeps it
  int64_t epoch = 0;
  std::map<Key, HeldShard> held, moving_out;  // moving_out: given to another daemon, state kept
  std::set<Key> released;                     // moved out since last held (Job::released_)
  PlacementView placement;                    // of the last AssignShard
  // A from_peer message gained shards: the job's step thread retries the copy every 500 ms
  // until a newer epoch supersedes it, and takes no step meanwhile.
  bool queued_move = false;
};

using Model = std::map<std::string, JobModel>;  // by job id

inline bool InLayout(const Layout& layout, const Key& k) {
  return k.first >= 0 && k.first < static_cast<int32_t>(layout.buckets.size()) && k.second >= 0 &&
         k.second < layout.data_parallel_size;
}

// Why the daemon must refuse `req` ("": it may accept it). `existing` is the job's model when
// the daemon holds the job and the message does not replace it; `layout` the job's.
inline std::string MustRefuse(const v1::AssignShardRequest& req, const JobModel* existing, const Layout& layout) {
  if (existing != nullptr && req.placement_epoch() < existing->epoch) return "an epoch older than the job's";
  if (existing == nullptr && req.placement_epoch() < 0) return "a negative epoch for a new job";
  for (const v1::ShardPlacement& s : req.placement().shards()) {
    for (const std::string& r : s.replica_daemon_ids()) {
      if (r == s.daemon_id()) return "a daemon both primary and replica of a shard";
    }
  }
  for (const v1::ShardRef& ref : req.shards()) {
    if (!InLayout(layout, {ref.bucket(), ref.shard()})) return "a gained shard outside the layout";
    if (req.has_from_peer() && req.from_peer().daemon().daemon_id().empty()) return "from_peer naming no daemon";
    if (existing != nullptr && req.has_from_checkpoint() &&
        req.from_checkpoint().checkpoint_id() != existing->restored_from.first) {
      return "a restore into a job that runs (it must replace the job)";
    }
  }
  return "";
}

// What an accepted AssignShard changed, for the fuzzer's outcome counts.
struct PlacementChange {
  int moved_out = 0, given_back = 0, waiting_for_copy = 0;
};

// An accepted AssignShard: shards the placement gives away move out (state kept), shards it
// gives back are served again, the gained shards not held yet are added (waiting for a copy
// when from_peer), and so are those given back with from_peer that this daemon let go.
inline PlacementChange ApplyAssign(JobModel& m, const v1::AssignShardRequest& req, const std::string& self) {
  PlacementChange change;
  m.epoch = req.placement_epoch();
  m.placement = PlacementView(self, req.placement());
  for (auto it = m.held.begin(); it != m.held.end();) {
    if (m.placement.Holds(it->first)) {
      ++it;
      continue;
    }
    m.moving_out[it->first] = it->second;
    m.released.insert(it->first);
    it = m.held.erase(it);
    ++change.moved_out;
  }
  for (auto it = m.moving_out.begin(); it != m.moving_out.end();) {
    if (!m.placement.Holds(it->first)) {
      ++it;
      continue;
    }
    m.held[it->first] = it->second;
    it = m.moving_out.erase(it);
    ++change.given_back;
  }
  for (const v1::ShardRef& ref : req.shards()) {
    const Key k{ref.bucket(), ref.shard()};
    // A shard given back that this daemon let go, with a copy to make, is copied anew (what it
    // kept may be behind); one already waiting for its copy keeps waiting.
    if (m.held.count(k) && !(req.has_from_peer() && !m.held[k].incoming && m.released.count(k))) continue;
    m.held[k].incoming = req.has_from_peer();
    m.queued_move |= req.has_from_peer();
    change.waiting_for_copy += req.has_from_peer() ? 1 : 0;
  }
  return change;
}

// An accepted DropShard of a held job: the listed shards (all when none is listed) are gone.
// Returns whether the job is gone from the daemon.
inline bool ApplyDrop(JobModel& m, const v1::DropShardRequest& req) {
  m.epoch = req.placement_epoch();
  if (req.shards().empty()) {
    m.held.clear();
    m.moving_out.clear();
    m.released.clear();
  }
  for (const v1::ShardRef& ref : req.shards()) {
    m.held.erase({ref.bucket(), ref.shard()});
    m.moving_out.erase({ref.bucket(), ref.shard()});
    m.released.erase({ref.bucket(), ref.shard()});
  }
  return m.held.empty() && m.moving_out.empty();
}

}  // namespace mainstay::fuzz

#endif  // MAINSTAY_TESTS_FUZZ_PLACEMENT_MODEL_H_

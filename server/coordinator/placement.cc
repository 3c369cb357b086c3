#include "server/coordinator/placement.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mainstay::coordinator {

absl::StatusOr<std::vector<std::string>> PlaceRanks(int64_t data_parallel_size,
                                                    std::span<const std::string> trainer_nodes,
                                                    std::vector<DaemonCandidate> ready, int64_t bytes_per_rank) {
  if (ready.empty()) {
    return absl::ResourceExhaustedError("no ready daemon to place the job on (0 ready)");
  }
  std::sort(ready.begin(), ready.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  auto describe = [&] {
    std::vector<std::string> parts;
    for (const DaemonCandidate& d : ready) parts.push_back(absl::StrCat(d.id, " ", d.free_bytes));
    return absl::StrJoin(parts, ", ");
  };
  std::vector<std::string> owners(data_parallel_size);
  for (int64_t r = 0; r < data_parallel_size; ++r) {
    DaemonCandidate* best = nullptr;
    if (!trainer_nodes.empty() && !trainer_nodes[r].empty()) {
      for (DaemonCandidate& d : ready) {
        if (d.node_name == trainer_nodes[r] && d.free_bytes >= bytes_per_rank &&
            (best == nullptr || d.free_bytes > best->free_bytes)) {
          best = &d;
        }
      }
    }
    if (best == nullptr) {
      for (DaemonCandidate& d : ready) {
        if (d.free_bytes >= bytes_per_rank && (best == nullptr || d.free_bytes > best->free_bytes)) best = &d;
      }
    }
    if (best == nullptr) {
      int64_t total_free = 0;
      for (const DaemonCandidate& d : ready) total_free += d.free_bytes;
      return absl::ResourceExhaustedError(absl::StrCat(
          "not enough daemon memory: the job needs ", bytes_per_rank, " bytes per rank x ", data_parallel_size,
          " ranks = ", bytes_per_rank * data_parallel_size, " bytes; ", ready.size(), " ready daemon(s) have ",
          total_free, " bytes free in all (after placing ", r, " rank(s): ", describe(), ")"));
    }
    best->free_bytes -= bytes_per_rank;
    owners[r] = best->id;
  }
  return owners;
}

absl::StatusOr<std::vector<std::vector<std::string>>> AddCopies(const std::vector<std::vector<std::string>>& holders,
                                                                int r, std::vector<DaemonCandidate> ready,
                                                                int64_t bytes_per_rank) {
  std::vector<std::vector<std::string>> out(holders.size());
  std::sort(ready.begin(), ready.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  for (size_t rank = 0; rank < holders.size(); ++rank) {
    std::set<std::string> daemons(holders[rank].begin(), holders[rank].end()), nodes;
    for (const DaemonCandidate& d : ready) {
      if (daemons.count(d.id)) nodes.insert(d.node_name);
    }
    for (int k = static_cast<int>(holders[rank].size()); k < r; ++k) {
      DaemonCandidate* best = nullptr;
      auto better = [&](const DaemonCandidate& d) {
        if (best == nullptr) return true;
        const bool fresh = !nodes.count(d.node_name), best_fresh = !nodes.count(best->node_name);
        if (fresh != best_fresh) return fresh;
        return d.free_bytes > best->free_bytes;
      };
      for (DaemonCandidate& d : ready) {
        if (daemons.count(d.id) || d.free_bytes < bytes_per_rank) continue;
        if (better(d)) best = &d;
      }
      if (best == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "replication_factor ", r, ": copy ", k + 1, " of rank ", rank, " (", bytes_per_rank,
            " bytes) fits on no ready daemon other than those holding its other copies (", ready.size(),
            " ready daemon(s))"));
      }
      best->free_bytes -= bytes_per_rank;
      daemons.insert(best->id);
      nodes.insert(best->node_name);
      out[rank].push_back(best->id);
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<std::string>>> PlaceReplicas(std::span<const std::string> owners, int r,
                                                                    std::vector<DaemonCandidate> ready,
                                                                    int64_t bytes_per_rank) {
  std::vector<std::vector<std::string>> holders;
  for (const std::string& owner : owners) {
    holders.push_back({owner});
    for (DaemonCandidate& d : ready) {
      if (d.id == owner) d.free_bytes -= bytes_per_rank;
    }
  }
  if (r <= 1) return std::vector<std::vector<std::string>>(owners.size());
  if (static_cast<int>(ready.size()) < r) {
    return absl::ResourceExhaustedError(absl::StrCat("replication_factor ", r, " needs ", r,
                                                     " ready daemons (each copy of a shard on its own daemon); ",
                                                     ready.size(), " are ready"));
  }
  return AddCopies(holders, r, std::move(ready), bytes_per_rank);
}

}  // namespace mainstay::coordinator

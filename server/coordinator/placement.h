// Placement: which daemon owns shard r of a job's buckets (DESIGN.md section 6).
//
// Shard r of every bucket goes to one daemon, so trainer r talks to one daemon per job.
// Locality first: the daemon on trainer r's node when the job declares trainer nodes and
// that daemon has room; otherwise the ready daemon with the most free memory left (ties:
// smallest id). Pure functions; thread-safe.
#ifndef MAINSTAY_SERVER_COORDINATOR_PLACEMENT_H_
#define MAINSTAY_SERVER_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/layout.h"

namespace mainstay::coordinator {

struct DaemonCandidate {
  std::string id;
  std::string node_name;
  int64_t free_bytes = 0;  // memory left for new shards
};

// daemon id per rank (D entries). `trainer_nodes` has D entries or none. RESOURCE_EXHAUSTED
// with the numbers when no ready daemon exists or a rank does not fit anywhere.
absl::StatusOr<std::vector<std::string>> PlaceRanks(int64_t data_parallel_size,
                                                    std::span<const std::string> trainer_nodes,
                                                    std::vector<DaemonCandidate> ready, int64_t bytes_per_rank);

// The replicas of each rank for replication_factor `r` (docs/architecture.md, "Replicas"): r-1
// daemons per rank, none of them the rank's primary (`owners[rank]`) nor each other. First
// choice: a daemon on a node holding no copy of the rank yet; then the most free memory (ties:
// smallest id). `ready` is every ready daemon with its free memory before `owners` was placed
// (their bytes are taken here). RESOURCE_EXHAUSTED with the numbers when there are fewer than r
// ready daemons or a replica does not fit anywhere. r = 1: one empty list per rank.
absl::StatusOr<std::vector<std::vector<std::string>>> PlaceReplicas(std::span<const std::string> owners, int r,
                                                                    std::vector<DaemonCandidate> ready,
                                                                    int64_t bytes_per_rank);

// Re-replication: for each rank, the daemons to add so that it has `r` copies, given the daemons
// holding it now (`holders[rank]`, non-empty) and the ready daemons with the memory they have
// left (holders' bytes already taken). Same preferences as PlaceReplicas. RESOURCE_EXHAUSTED
// when some copy fits nowhere.
absl::StatusOr<std::vector<std::vector<std::string>>> AddCopies(const std::vector<std::vector<std::string>>& holders,
                                                                int r, std::vector<DaemonCandidate> ready,
                                                                int64_t bytes_per_rank);

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_PLACEMENT_H_

// A shard's whole state on the wire (FetchShardState): what a move's target needs to go on where
// the source stopped, bit for bit. The committed masters and moments, the job's scaling state as
// of that step, the newest published version (so trainers can pull it from the target), and the
// pushes of later steps the source had stored (so trainers need not push them again).
//
// WriteShardState encodes a ShardStateCopy as the stream's messages (a header, then chunks of
// each buffer in order); ShardStateReader decodes them and checks that every byte of every
// buffer came exactly once, landing the masters and moments straight in the state memory the
// reading daemon keeps them in (no second copy to install). Both are pure (no I/O, no gRPC) and
// not thread-safe.
#ifndef MAINSTAY_SERVER_DAEMON_SHARD_TRANSFER_H_
#define MAINSTAY_SERVER_DAEMON_SHARD_TRANSFER_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "mainstay/v1/shard.pb.h"
#include "server/daemon/job.h"

namespace mainstay::daemon {

// Writes `copy` of (bucket, shard) in chunks of at most `chunk_bytes` (a multiple of 8).
// CANCELLED when `write` returns false (the reader went away).
absl::Status WriteShardState(const ShardStateCopy& copy, int64_t chunk_bytes,
                             const std::function<bool(const v1::FetchShardStateResponse&)>& write);

class ShardStateReader {
 public:
  // The masters and moments are allocated in `land` (not owned; it outlives the copy).
  // `shard_numel`: the layout's size of the shard, which the header must announce (or 0: a
  // shard with no state yet, before version 0).
  ShardStateReader(kernels::StateMemory& land, int64_t shard_numel) : land_(land), shard_numel_(shard_numel) {}

  // INVALID_ARGUMENT (DATA_LOSS for overlapping or overrunning chunks, or a header announcing
  // another shard size) naming what is wrong;
  // RESOURCE_EXHAUSTED when `land` cannot hold the masters (at the header) or a moment (at its
  // first chunk; Finish, for an empty shard's).
  absl::Status Add(const v1::FetchShardStateResponse& message);
  // The copy, once every buffer is complete; DATA_LOSS when the stream ended short.
  absl::StatusOr<ShardStateCopy> Finish(int32_t bucket, int32_t shard);

 private:
  kernels::StateMemory& land_;
  const int64_t shard_numel_;
  bool have_header_ = false;
  v1::ShardStateHeader header_;
  ShardStateCopy copy_;
  static constexpr int kBuffers = 7;     // StateBuffer values
  std::vector<uint8_t> data_, scales_;  // the newest version's
  std::vector<uint8_t> pending_;        // the pending pushes' payloads, concatenated
  int64_t received_[kBuffers] = {};     // bytes, by StateBuffer
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_SHARD_TRANSFER_H_

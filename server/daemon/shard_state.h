// The published and copied forms of a shard's state, shared by the job (job.h), the move
// protocol (peer_client.h, shard_transfer.h) and the transports.
// Ownership: plain values; a QuantizedShard is immutable once published and shared by pointer.
#ifndef MAINSTAY_SERVER_DAEMON_SHARD_STATE_H_
#define MAINSTAY_SERVER_DAEMON_SHARD_STATE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/format.h"
#include "mainstay/v1/checkpoint.pb.h"
#include "mainstay/v1/shard.pb.h"
#include "server/daemon/state_buffer.h"

namespace mainstay::daemon {

// Quantization metadata of one fragment of a published shard.
struct FragmentMeta {
  int32_t tensor = 0;
  IndexRange elements;  // of the flattened tensor
  Format format = Format::kBF16;
  float scale = 0.0f;      // fp8: multiplier before the cast; nvfp4: S_enc; else 0
  float scale_inv = 0.0f;  // fp8: RN(1/scale); nvfp4: S_dec; else 0
  float amax = 0.0f;       // whole-tensor amax (reduced); 0 for formats without one
};

// A shard's cast output in state memory on a staged (GPU) daemon, readable while the cast that
// wrote it is the last one: a cuda_ipc pull of that version copies its data from there, device to
// device, instead of from the host copy. The step invalidates it before it casts into the buffer
// again or frees it, which waits for the reads in progress.
// Thread safety: every method is thread-safe.
class CastOutput {
 public:
  // Runs `read(data)` on the device bytes written by cast `cast` and returns its status, with no
  // cast or free of the buffer meanwhile; nullopt (nothing run) when they were overwritten or freed.
  std::optional<absl::Status> Read(uint64_t cast, const std::function<absl::Status(const void* data)>& read) const {
    absl::ReaderMutexLock lock(&mu_);
    if (cast_ == 0 || cast_ != cast) return std::nullopt;
    return read(data_);
  }
  // Before the buffer is written or freed: waits for the reads in progress; none start after.
  void Invalidate() {
    absl::MutexLock lock(&mu_);
    cast_ = 0;
    data_ = nullptr;
  }
  // After cast `cast` (> 0, unique: NextCast) wrote `data` and was synchronized.
  void Publish(uint64_t cast, const void* data) {
    absl::MutexLock lock(&mu_);
    cast_ = cast;
    data_ = data;
  }
  // A new cast id, never 0, unique in this process.
  static uint64_t NextCast() {
    static std::atomic<uint64_t> next{0};
    return ++next;
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t cast_ ABSL_GUARDED_BY(mu_) = 0;
  const void* data_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// One published version of one (bucket, shard). Immutable once published.
struct QuantizedShard {
  int64_t version = 0;
  int32_t bucket = 0;
  int32_t shard = 0;
  Format format = Format::kBF16;
  IndexRange elements;              // the shard's bucket elements
  std::vector<uint8_t> data;        // DataBytes(format, shard_numel); padding is 0
  bool has_scales = false;
  ElementType scale_type = ElementType::kE8M0;
  int64_t num_scales = 0;           // entries: the fragments' block ranges, concatenated
  std::vector<uint8_t> scales;
  std::vector<FragmentMeta> fragments;
  // Staged (GPU) daemons: the cast output this version's data came from, and the cast's id
  // there (CastOutput::Read); null on a CPU daemon, and for versions not cast here (moved in).
  std::shared_ptr<const CastOutput> device;
  uint64_t device_cast = 0;
};

struct PullResult {
  // The requested version, or (unchanged) the current one when the step before it was skipped.
  std::shared_ptr<const QuantizedShard> shard;
  bool unchanged = false;
  // A reader's pull (the job's reader token). A reader's delta pull is not charged against the
  // reader cap yet: the service charges what the delta sends (Job::AdmitReaderBytes).
  bool reader = false;
};

// One rank's push of a step not decided yet, carried by a move (ShardStateCopy::pending).
struct PendingPushCopy {
  int64_t step = 0;              // -1: initial parameters
  int32_t rank = 0;
  int32_t num_contributors = 1;
  ElementType dtype = ElementType::kFloat32;
  double loss_scale = 1.0;
  std::vector<uint8_t> payload;  // raw elements of dtype
};

// A copy of one shard's committed optimizer state (FetchShardState, tests). Its masters and
// moments are state memory: a re-replication's source's and tests' copies in HostCopyMemory(),
// a move's target's in its own state memory, where the stream lands them and the shard then
// keeps them. A move's source streams views of the shard's own buffers instead
// (Job::CopyForMove), which `hold` keeps alive and unchanged until the copy is destroyed.
struct ShardStateCopy {
  int64_t version = -1;         // the version this state produced; -1 before version 0
  int64_t committed_step = -1;  // last decided step
  StateBuffer<float> master;
  ElementType moment_type = ElementType::kFloat32;
  StateBuffer<uint8_t> m, v;  // raw little-endian elements of moment_type; v empty for SGD
  // For moves (CopyForMove): the job's scaling state as of committed_step, and the newest
  // published version (null before version 0).
  v1::CheckpointScalingState scaling;
  std::shared_ptr<const QuantizedShard> newest;
  // For moves: the pushes of the steps after committed_step that the source had stored (the
  // target takes them over, so the trainers need not push them again).
  std::vector<PendingPushCopy> pending;
  std::optional<v1::StepStats> committed_stats;  // of committed_step, when the source keeps them
  // For moves: the decisions of the newest steps the source decided (Job::GetStepOutcome).
  std::vector<v1::StepDecision> decisions;
  std::shared_ptr<void> hold;  // a source's views: see above
};

// Host memory for copies of shard state that belong to no job's state memory (a
// re-replication's source streams one; tests read state into one). Process-wide, thread-safe.
kernels::StateMemory& HostCopyMemory();

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_SHARD_STATE_H_

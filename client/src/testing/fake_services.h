// Test doubles for the client: an in-process fake coordinator and fake shard daemons speaking
// the real gRPC protocol (proto/mainstay/v1), so client tests run without mainstayd.
//
// The fakes share one FakeCluster state (no AssignShard): CreateJob resolves the spec into the
// real Layout (ResolveJob) and places shard r of every bucket on daemon r % num_daemons at epoch
// 1. Daemons check job id, token and epoch like the protocol says (UNAVAILABLE for an epoch they
// have not seen, FAILED_PRECONDITION + ErrorDetail for a shard they do not own any more), store
// pushes (duplicates acknowledged), apply plain SGD with decoupled weight decay to FP32 masters
// once every rank has called FinishStep and every shard has its contributions, skip the step
// on non-finite gradients, and publish each tensor quantized whole (kernels::Quantize, model
// dtype bf16, fp8 delayed scale 1) sliced into the fragments of the shard. The coordinator's
// port also serves Admin CreateCheckpoint / RestoreCheckpoint, keeping checkpoints in memory
// (restore puts back the masters, version and committed step, and advances the epoch). The
// daemons serve the cuda_ipc calls too, for the tests' fake CUDA driver: a "handle" holds the
// allocation's address in this process in its first 8 bytes.
//
// Thread safety: everything may be called concurrently. Not production code.
#ifndef MAINSTAY_CLIENT_SRC_TESTING_FAKE_SERVICES_H_
#define MAINSTAY_CLIENT_SRC_TESTING_FAKE_SERVICES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/status/statusor.h"
#include "common/layout.h"
#include "mainstay/v1/shard.pb.h"

namespace mainstay::testing_fakes {

struct FakeClusterOptions {
  int num_daemons = 2;
  int unavailable_calls = 0;       // each daemon answers UNAVAILABLE to its first N data-plane calls
  int create_job_unavailable = 0;  // the coordinator answers UNAVAILABLE to the first N CreateJob
  // Admin service (checkpoints kept in memory): the admin token it requires ("" = none), or
  // no Admin service at all (its calls answer UNIMPLEMENTED: an old coordinator).
  std::string admin_token;
  bool serve_admin = true;
  bool offer_cuda_ipc = false;  // the placement lists TRANSPORT_CUDA_IPC for every daemon
  // The placement says the daemons take a push's CRC-32C in a trailer (false: a daemon from
  // before December 2026, which is sent the CRC in the header).
  bool take_crc32c_trailers = true;
};

struct FakeStats {
  int64_t push_streams = 0;        // PushGrad streams accepted (duplicates included)
  int64_t duplicate_pushes = 0;
  int64_t max_chunk_bytes = 0;     // largest GradChunk seen
  int64_t unavailable_answers = 0;
  int64_t stale_epoch_answers = 0;
  int64_t finish_calls = 0;
  int64_t pull_streams = 0;
  int64_t wrong_crc = 0;           // pushes whose crc32c did not match (rejected)
  int64_t crc_checked = 0;         // PushGrad streams whose CRC-32C (header or trailer) matched
  int64_t crc_trailers = 0;        // of those, the ones whose CRC-32C came in a PushGradTrailer
  int64_t cuda_ipc_attaches = 0;   // AttachCudaIpc calls answered OK
  int64_t cuda_ipc_pushes = 0;     // CudaIpcPush calls admitted
  int64_t cuda_ipc_pulls = 0;      // CudaIpcPull calls of a known session
  int64_t cuda_ipc_detaches = 0;   // DetachCudaIpc calls
};

class FakeCluster {
 public:
  static absl::StatusOr<std::unique_ptr<FakeCluster>> Start(const FakeClusterOptions& options);
  ~FakeCluster();

  std::string coordinator_address() const;
  std::vector<std::string> daemon_addresses() const;
  std::string job_id() const;      // empty before CreateJob
  std::string job_token() const;

  // Moves (bucket, shard) to daemon `daemon` under a new epoch.
  void MoveShard(int32_t bucket, int32_t shard, int daemon);
  // Makes the daemons answer `code` (UNAVAILABLE; or e.g. CANCELLED, as a stopping gRPC server
  // does) to their next `calls` data-plane calls.
  void FailNextCalls(int calls, grpc::StatusCode code = grpc::StatusCode::UNAVAILABLE);
  // Gives `step` up once, when it is complete (every rank finished, every push there): its
  // FinishStep calls answer ABORTED (ErrorDetail.committed_step = the committed step) and its
  // pushes are dropped, as a daemon whose peer died mid-step does. The next attempt commits.
  // With `then_commit`, the step commits right after the ABORTED answers, with the pushes it
  // had (as a move's target finishing the step with the pushes the move carried).
  void GiveUpStep(int64_t step, bool then_commit = false);
  int GivenUp(int64_t step) const;  // how often `step` was given up
  // The daemons answer their next `calls` FinishStep calls at an epoch older than the current
  // one with FAILED_PRECONDITION and ErrorDetail.placement_epoch = the current epoch: a move's
  // source fenced at the new epoch before it received that placement (it still owns its shards).
  void FenceNextFinishes(int calls);
  // The daemons answer their next `calls` GetStepStats calls UNAVAILABLE (a daemon that has not
  // committed the step yet).
  void FailNextStatsReads(int calls);
  // Current FP32 master of a bucket (numel elements) and the current version (-1 before the
  // initial parameters are complete).
  std::vector<float> Master(int32_t bucket) const;
  int64_t version() const;
  FakeStats stats() const;

  struct State;

 private:
  FakeCluster() = default;
  std::shared_ptr<State> state_;
};

// The PullParams stream a daemon sends for (bucket, shard) of `bucket_master` (the whole
// bucket's FP32 values): header, data chunks, scale chunks, with at most max_chunk_bytes each.
absl::StatusOr<std::vector<v1::PullParamsResponse>> MakePullStream(const Layout& layout, int32_t bucket,
                                                                   int32_t shard, int64_t version,
                                                                   std::span<const float> bucket_master,
                                                                   int64_t max_chunk_bytes);

// The changed chunks of one array of a delta pull (data or block scales) from `was` to `now`
// (equal sizes), cut every `chunk` bytes, as a daemon sends them: each changed chunk's index is
// appended to `listed` and add(first byte, whole bytes, byte patch) is called with one of the
// two empty; with `patches`, a patch (common/byte_patch.h) whenever smaller than the chunk.
void ForEachDeltaChunk(std::span<const uint8_t> was, std::span<const uint8_t> now, int64_t chunk, bool patches,
                       google::protobuf::RepeatedField<int32_t>* listed,
                       const std::function<void(int64_t begin, std::string data, std::string patch)>& add);

}  // namespace mainstay::testing_fakes

#endif  // MAINSTAY_CLIENT_SRC_TESTING_FAKE_SERVICES_H_

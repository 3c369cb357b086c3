// libmainstay_client: the trainer side of Mainstay (DESIGN.md sections 1, 6 and 8).
//
// Client::Connect creates a job from a JSON spec (docs/job_spec.md) or attaches to an existing
// one (job id + token), reads its Layout and placement, and then moves data per (bucket, shard):
//   - PushGrad / PushBucketUnreduced / PushInitialParams stream gradients (or initial FP32
//     parameters) to the daemon owning each shard, asynchronously, returning a PushHandle;
//   - FinishStep(step, lr, weight_decay) waits for the step's pushes, tells every daemon pushed
//     to that this rank is done, and returns the StepStats once the step is committed or skipped;
//   - PullShard / PullBucket fetch a version's quantized parameters (PullBucket: every shard of a
//     bucket in parallel, an all-gather through the daemons) as a PulledBucket (pulled.h);
//     PullShardInto / PullBucketInto put one shard's (every shard's) packed data into the
//     caller's host or device memory.
// docs/client.md shows the step loop of a trainer in both push modes.
//
// Deadlines and retries: every operation has a deadline (ClientOptions::timeout, or the call's
// own timeout) covering all of its attempts. UNAVAILABLE (daemon not reachable, or it has not
// received the job's shards / placement epoch yet) is retried with exponential backoff
// (initial_backoff doubling up to max_backoff) until that deadline. FAILED_PRECONDITION that
// names a newer placement epoch re-reads the placement and retries at once. Every other error is
// returned unchanged in code, with context in the message and the daemon's ErrorDetail (if any)
// as a payload readable with GetErrorInfo.
//
// Ownership: the Client owns its channels (one per daemon address), its placement cache and two
// small thread pools (pushes, pulls). Data handed to a gradient push (ElementSpan) is NOT copied:
// it must stay valid until FinishStep of its step succeeded, the step was pushed again, or the
// Client is destroyed (FinishStep may push it again: ClientOptions::step_attempts; a host
// buffer changed meanwhile is detected by its CRC-32C and not pushed again, a device buffer is
// pushed again as it is); initial parameters until the push's
// handle is ready (Wait returned). Destroying the Client cancels
// the operations still in flight (their handles complete with CANCELLED) and waits for them.
// Pushed buffers are host memory for the grpc and ucx transports, which read them with the CPU:
// a device pointer is refused (INVALID_ARGUMENT) before anything is sent. The nccl and cuda_ipc
// transports take host and device memory (docs/transports.md).
// Thread safety: every method may be called concurrently from any thread. Handles may be waited
// on from any thread, any number of times.
#ifndef MAINSTAY_CLIENT_CLIENT_H_
#define MAINSTAY_CLIENT_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/layout.h"
#include "common/step_hyper.h"
#include "common/tls.h"
#include "mainstay/buffers.h"
#include "mainstay/export.h"
#include "mainstay/pulled.h"

namespace mainstay {

struct ClientOptions {
  // "host:port" of mainstay-coordinator, or a comma-separated list of the coordinators sharing
  // one etcd (the leader is found by connecting; docs/coordinator.md); required.
  std::string coordinator;
  // Create a job: the job spec as JSON text (docs/job_spec.md). Exactly one of job_spec_json and
  // (job_id, job_token) is given.
  std::string job_spec_json;
  std::string admin_token;    // for CreateJob when the coordinator requires one (never logged)
  // Attach to a job: its id and the token CreateJob returned to the launcher.
  std::string job_id;
  std::string job_token;
  // Or attach read-only (an inference engine, an evaluator): job_id and the job's reader token
  // (Coordinator.GetReaderToken, `mainstayctl jobs reader-token`). Such a client pulls published
  // versions (PullShard, PullBucket) and does nothing else: pushes and FinishStep answer
  // FAILED_PRECONDITION, and the daemons refuse the reader token for them anyway. `rank` is
  // not used. docs/weight_serving.md.
  std::string reader_token;
  int32_t rank = 0;           // this trainer's rank, in [0, D)
  // TLS to the coordinator and the daemons (common/tls.h): ca_file verifies their certificates
  // (TLS), cert_file + key_file are this trainer's certificate where they require one (mutual
  // TLS), server_name overrides the name verified. Plaintext when all are empty. Connect
  // answers INVALID_ARGUMENT naming a file that cannot be read or does not match.
  TlsOptions tls;

  std::chrono::milliseconds timeout{60000};         // deadline of each operation, all attempts
  std::chrono::milliseconds initial_backoff{50};    // first wait after UNAVAILABLE
  std::chrono::milliseconds max_backoff{2000};      // the wait doubles up to this
  // Data-plane transport to the daemons (docs/transports.md): "auto" picks, per daemon, the best
  // both ends have (ucx, else grpc); "grpc", "ucx", "nccl" or "cuda_ipc" insist on one (Connect
  // fails with FAILED_PRECONDITION naming the daemon that does not offer it). Empty: the
  // environment variable MAINSTAY_TRANSPORT, else "auto". "nccl" uses the CUDA device current on
  // the thread calling Connect: pushes take buffers in its memory (host memory is staged), and
  // NCCL refuses a daemon on the same GPU (docs/transports.md, NCCL). "cuda_ipc" is for daemons
  // on this node with their state on a GPU: they read pushed device buffers by CUDA IPC handle;
  // host pushes and pulls go by gRPC (docs/transports.md, CUDA IPC).
  std::string transport;
  // Payload chunk size, both directions (push chunks, pull max_chunk_bytes); 1 KiB .. 4 MiB.
  // A shard moves as a pipeline of chunks, never as one message.
  int64_t chunk_bytes = 4 << 20;
  bool push_crc32c = true;        // send the CRC-32C of each pushed payload
  // FinishStep's attempts at a step. When a daemon gives a step up having changed nothing
  // (ABORTED: a peer daemon died mid-step, a failover or move changed the placement), FinishStep
  // checks that each buffer pushed for the step still holds the pushed bytes (CRC-32C), pushes
  // them again at the new placement and finishes again, so the training loop sees no error. 1:
  // the caller pushes again itself. A buffer that changed, or one in device memory, is not
  // pushed again: the ABORTED is returned, saying why.
  int step_attempts = 8;
  // Replicated jobs (replication_factor >= 2): each reduced gradient push also goes, at the same
  // time, to the daemons holding the shard's replicas, so the primary forwards them only the
  // step's header instead of the payload (docs/architecture.md, "Replicas"). A copy that fails
  // is ignored (the primary then sends the payload itself); a push completes, and its buffer is
  // free, once its copies ended too. Only host-readable data is copied. false: primaries forward
  // every payload.
  bool replica_copies = true;
  bool verify_crc32c = true;      // check pulled data against the daemon's CRC-32C when sent
  int push_threads = 0;           // concurrent push streams; 0 = max(4, D)
  int pull_threads = 0;           // concurrent pull streams; 0 = max(4, D)
  // Buffers of released PulledBuckets kept for the next pulls of the same size (a fresh large
  // allocation is zero-filled by the kernel on first touch, which costs more than the transfer).
  // -1: the job's quantized parameter bytes (one version of every bucket); 0: none kept. A
  // trainer (not a reader) fills the pool at Connect with one written buffer per bucket, so the
  // first step's pulls do not land in fresh pages.
  int64_t pull_buffer_cache_bytes = -1;
};

// Outcome of one optimizer step (mirrors mainstay.v1.StepStats).
struct StepStats {
  int64_t step = 0;
  int64_t version = 0;         // current after the step: step + 1, or unchanged when skipped
  bool skipped = false;        // a gradient was non-finite: no update, no version bump
  double grad_norm = 0.0;      // global L2 norm of the unscaled gradients, before clipping
  double clip_factor = 1.0;    // 1 = no clipping
  double loss_scale = 1.0;     // loss scale for the NEXT step (fp16 recipes); 1 otherwise
  double lr = 0.0;               // of param group 0
  double weight_decay = 0.0;     // of param group 0
  StepHyper groups;              // applied per param group (index = TensorSpec::param_group)
  int64_t nonfinite_count = 0;
  int64_t commit_unix_ms = 0;
  int64_t step_time_ms = 0;      // first push of the step to commit, on the answering daemon
  // Where the answering daemon's time went, milliseconds (mirrors mainstay.v1.StepPhaseTimes).
  struct Phases {
    double wait_inputs_ms = 0, grad_stats_ms = 0, reduce_stats_ms = 0, update_ms = 0, reduce_amax_ms = 0,
           quantize_ms = 0;
  } phases;
  std::vector<float> tensor_amax;  // per Layout::tensors index; empty for a skipped step
  // Gradient bytes the answering daemon sent its replicas for the step itself (replicated jobs):
  // 0 where the replicas took the trainers' copies of their pushes (ClientOptions::replica_copies).
  int64_t forwarded_bytes = 0;
  // FinishStep's attempts at the step (ClientOptions::step_attempts): 1, or more when it pushed
  // the step again after a daemon gave it up; first_abort is that first ABORTED's message.
  int attempts = 1;
  std::string first_abort;
};

// A published version held against eviction on every daemon that serves the job's pulls
// (Client::PinVersion); released by Client::ReleasePin, or when it expires.
struct VersionPin {
  int64_t version = 0;
  std::vector<std::pair<std::string, uint64_t>> pins;  // (daemon address, its pin id)
  int64_t expires_unix_ms = 0;                          // the earliest of the daemons' expiries
};

// The job's placement (mirrors mainstay.v1.Placement).
struct DaemonAddress {
  std::string daemon_id;
  std::string address;    // gRPC "host:port" of its Shard service
  std::string node_name;
};
// How this client reaches one daemon of the placement (Client::connections).
struct DataConnection {
  std::string daemon_id;
  std::string address;
  std::string transport;  // "grpc", "ucx", "nccl" or "cuda_ipc"
  std::string note;       // why "auto" did not pick a faster transport; empty otherwise
};
struct ShardOwner {
  int32_t bucket = 0;
  int32_t shard = 0;
  std::string daemon_id;                        // primary: serves pushes and pulls
  std::vector<std::string> replica_daemon_ids;
};
struct JobPlacement {
  int64_t epoch = 0;
  std::vector<ShardOwner> shards;
  std::vector<DaemonAddress> daemons;
};

// Result of a push (for several shards: duplicate when all were, elements summed,
// contributions the minimum).
struct PushResult {
  bool duplicate = false;         // the daemon already had this (bucket, shard, step, rank); ignored
  int64_t received_elements = 0;
  int32_t contributions = 0;      // distinct ranks the daemon holds for the (bucket, shard, step)
};

struct PushOptions {
  double loss_scale = 0.0;               // multiplied into the gradients (fp16 recipes); 0 = none
  std::chrono::milliseconds timeout{0};  // 0 = ClientOptions::timeout
  // The CUDA work that produces the pushed buffer, when it is still in flight at the push (an
  // asynchronous copy into a pinned buffer, the kernel that writes the gradients): the push
  // waits for it, on the client's own thread, before it reads the buffer, so the caller needs
  // no synchronize of its own. Both are handles of the CUDA context current on the calling
  // thread (cudaEvent_t / cudaStream_t, or the driver's CUevent / CUstream).
  //   cuda_event: a recorded event; it must not be recorded again before the push's handle
  //     is ready.
  //   cuda_stream (when cuda_event is unset; nullptr = the legacy default stream): the work
  //     enqueued on the stream before the push call (the client records an event there).
  // A failed wait (the producing work faulted) fails the push (INTERNAL, nothing sent);
  // FAILED_PRECONDITION when either is set and the process has no CUDA driver.
  void* cuda_event = nullptr;
  std::optional<void*> cuda_stream;
};

// Options of Client::PullShardInto and PullBucketInto.
struct PullIntoOptions {
  std::chrono::milliseconds timeout{0};  // 0 = ClientOptions::timeout
  // The CUDA work that still uses the destination (the forward that reads the weights being
  // replaced): the pull waits for it, on the client's own thread, before the daemon writes, as
  // PushOptions's pushes wait for their producing work (the same handles and errors).
  void* cuda_event = nullptr;
  std::optional<void*> cuda_stream;
};

// Machine-readable detail a daemon or the coordinator attached to an error (ErrorDetail).
struct ErrorInfo {
  int64_t placement_epoch = 0;  // current placement epoch
  int64_t committed_step = 0;   // last committed step (answer to a push for an old step)
  int64_t version = 0;          // current version of the shard
};
// The ErrorInfo carried by `status`, if any.
MAINSTAY_CLIENT_EXPORT std::optional<ErrorInfo> GetErrorInfo(const absl::Status& status);

// A checkpoint of a job (mirrors mainstay.v1.CheckpointInfo; admin.proto).
struct CheckpointInfo {
  std::string checkpoint_id;
  std::string job_id;          // job it was taken from
  std::string job_name;
  int64_t version = 0;         // version saved
  std::string state;           // "WRITING", "COMMITTED", "FAILED", "CORRUPT" (or "UNSPECIFIED")
  int64_t created_unix_ms = 0;
  int64_t size_bytes = 0;
  int32_t file_count = 0;
  std::string manifest_uri;
  std::string error;           // why it FAILED or is CORRUPT
};

// What RestoreCheckpoint answered.
struct RestoreResult {
  int64_t version = 0;          // version the job now serves
  int64_t placement_epoch = 0;  // the job's new placement epoch (already re-read by the client)
};

// Options of the admin calls a Client makes for its own job.
struct AdminCallOptions {
  // Admin token sent with the call; unset: ClientOptions::admin_token.
  std::optional<std::string> admin_token;
  std::chrono::milliseconds timeout{0};  // 0 = ClientOptions::timeout
};

// The result of an asynchronous operation, like std::shared_future: copyable, waitable from any
// thread, any number of times. A default-constructed handle is not valid().
template <typename T>
class Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_future<absl::StatusOr<T>> future) : future_(std::move(future)) {}
  static Handle Ready(absl::StatusOr<T> value) {
    std::promise<absl::StatusOr<T>> p;
    p.set_value(std::move(value));
    return Handle(p.get_future().share());
  }

  bool valid() const { return future_.valid(); }
  // True when Wait would not block.
  bool ready() const {
    return valid() && future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  // Blocks until done. On an invalid handle: FAILED_PRECONDITION. The reference lives as long
  // as any copy of this handle; on a temporary handle (`client.PullBucket(b, v).Wait()`) the
  // result is returned by value instead, so it cannot dangle.
  const absl::StatusOr<T>& Wait() const& {
    if (!valid()) {
      static const absl::StatusOr<T> kInvalid = absl::FailedPreconditionError("Wait on an invalid handle");
      return kInvalid;
    }
    return future_.get();
  }
  absl::StatusOr<T> Wait() && { return static_cast<const Handle&>(*this).Wait(); }
  // Waits at most `timeout`; true when done.
  bool WaitFor(std::chrono::milliseconds timeout) const {
    return valid() && future_.wait_for(timeout) == std::future_status::ready;
  }

 private:
  std::shared_future<absl::StatusOr<T>> future_;
};

using PushHandle = Handle<PushResult>;
using PullHandle = Handle<PulledBucket>;
using ShardPullHandle = Handle<PulledShard>;
using BucketPullHandle = Handle<std::vector<PulledShard>>;

class MAINSTAY_CLIENT_EXPORT Client {
 public:
  // PullShard / PullBucket version meaning "the newest committed version, without waiting".
  static constexpr int64_t kLatestVersion = -1;

  // Creates or attaches to the job, then reads its layout and placement. Errors:
  // INVALID_ARGUMENT for bad options or a bad spec (never retried), the coordinator's errors
  // (UNAUTHENTICATED for a wrong token, NOT_FOUND for an unknown job), DEADLINE_EXCEEDED /
  // UNAVAILABLE when the coordinator stays unreachable for `timeout`.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();  // cancels outstanding operations and waits for them to end

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& job_id() const;
  const std::string& job_token() const;  // hand it to the other ranks after a create; "" for a reader
  bool reader() const;                   // attached with ClientOptions::reader_token
  int32_t rank() const;
  int64_t data_parallel_size() const;
  const Layout& layout() const;
  std::shared_ptr<const Layout> shared_layout() const;
  int64_t version_at_connect() const;    // version the coordinator said trainers can pull
  JobPlacement placement() const;        // a copy of the cached placement
  // The transport used with each daemon of the cached placement.
  std::vector<DataConnection> connections() const;
  // Re-reads the placement from the coordinator now.
  absl::Status RefreshPlacement();

  // Reduced mode: this rank's shard of bucket `bucket` (shard = rank, shard_numel elements,
  // after the trainers' own reduce-scatter) for `step` (>= 0), num_contributors = 1.
  PushHandle PushGrad(int32_t bucket, int64_t step, ElementSpan shard_data, const PushOptions& options = {});
  // Unreduced mode: the whole bucket (numel elements) of this rank's own gradient; every shard
  // goes to its daemon with num_contributors = D, and the daemons sum the D ranks in FP32. Only
  // for jobs whose spec sets "unreduced_pushes": true (INVALID_ARGUMENT otherwise), as the
  // daemons plan D gradient buffers per shard for them.
  PushHandle PushBucketUnreduced(int32_t bucket, int64_t step, ElementSpan bucket_data,
                                 const PushOptions& options = {});
  // General form: one shard, explicit contributor count (1 or D).
  PushHandle PushShard(int32_t bucket, int32_t shard, int64_t step, ElementSpan shard_data,
                       int32_t num_contributors, const PushOptions& options = {});
  // Initial FP32 master parameters (step -1, version 0). `data` is either this rank's shard
  // (shard_numel elements; pushed as shard `rank`) or the whole bucket (numel elements): then
  // only this rank's shard is pushed, or every shard when `all_shards` (one process pushes the
  // whole model; the other ranks then push nothing).
  PushHandle PushInitialParams(int32_t bucket, std::span<const float> data, bool all_shards = false,
                               const PushOptions& options = {});

  // Ends `step` for this rank: waits for every push of the step made through this Client, then
  // calls FinishStep on every daemon those pushes went to (in parallel) and returns their
  // StepStats, checked to agree. Blocks until the step is committed or skipped on all of them.
  // A failed push of the step is returned (its code) without calling the daemons: push it again,
  // then call FinishStep again; a push refused because the step is committed already (a move
  // carried the step's pushes to a new owner, which finished it) is no error: the committed
  // step's stats are returned. ABORTED: the step failed on a daemon, push the step again (it is
  // returned as soon as one daemon answers it; the calls at the others are cancelled).
  // FAILED_PRECONDITION when nothing was pushed for `step`. A shard that moved to another daemon
  // after its push landed (a drain or `shards move`) moved with the push: FinishStep follows it
  // to the new owner, and the step goes on without an error.
  //
  // `groups` gives each param group of the job its hyperparameters (index = the tensors'
  // param_group; exactly NumParamGroups(layout()) entries, each finite and >= 0, else
  // INVALID_ARGUMENT before anything is sent). The (lr, weight_decay) form applies one pair to
  // every group.
  absl::StatusOr<StepStats> FinishStep(int64_t step, std::span<const GroupHyper> groups,
                                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  absl::StatusOr<StepStats> FinishStep(int64_t step, double lr, double weight_decay,
                                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // The job's read-only reader token, for inference engines and evaluators (ClientOptions::
  // reader_token, docs/weight_serving.md): created by the coordinator on first use, replaced
  // with `rotate` (the old one then stops working). FAILED_PRECONDITION on a reader client;
  // UNAVAILABLE (retried until the deadline) while a move of the job's shards is in progress.
  absl::StatusOr<std::string> GetReaderToken(bool rotate = false);
  // Keeps `version` from eviction on every daemon that serves the job's pulls for `ttl` (at
  // most 10 minutes; pin again to renew), so that a reader can pull all of it while training
  // goes on. FAILED_PRECONDITION (ErrorDetail.version = the newest) when a daemon no longer
  // keeps it; RESOURCE_EXHAUSTED when a daemon holds 4 pinned versions of the job already. On
  // an error nothing stays pinned. Readers and trainers alike. With replicas (replication_factor
  // >= 2) the version is pinned on them too, where they keep it, so that the pin outlives a
  // failover that promotes one.
  absl::StatusOr<VersionPin> PinVersion(int64_t version, std::chrono::milliseconds ttl);
  // The newest published version, pinned (VersionPin::version says which): when a newer one
  // evicts it before the pin lands, the newer one is pinned instead.
  absl::StatusOr<VersionPin> PinNewestVersion(std::chrono::milliseconds ttl);
  // Releases the pin on every daemon (an expired one is released already; an unreachable one
  // keeps it until it expires, and is no error). The first error.
  absl::Status ReleasePin(const VersionPin& pin);
  // Stats of a decided step without waiting (UNAVAILABLE while undecided), from the daemon
  // owning this rank's shard of bucket 0.
  absl::StatusOr<StepStats> GetStepStats(int64_t step);

  // Quantized parameters of `version` (step + 1 after pushing `step`; kLatestVersion for the
  // newest). The daemon waits for an undecided version until the deadline.
  PullHandle PullShard(int32_t bucket, int32_t shard, int64_t version,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  PullHandle PullBucket(int32_t bucket, int64_t version,
                        std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Delta sync (readers; docs/weight_serving.md): bucket `bucket` at `version`, given `since`, a
  // whole earlier pull of it. Each daemon sends only the 64 KiB chunks of packed data and of
  // block scales whose XXH3-64 differs from since's, each as a byte patch against since's
  // version when the daemon still keeps that version and the patch is smaller (plus the
  // per-tensor metadata); the result is a new PulledBucket that starts as a copy of since's data
  // and scales with those chunks patched in, checked against the CRC-32Cs of the daemon's
  // version before it is returned (DATA_LOSS otherwise; since is never changed, and may be
  // dropped once this returns). PulledShard::data_bytes_received and scale_bytes_received say
  // what came. Over the grpc transport whatever the client's transport. INVALID_ARGUMENT when since
  // is not a whole, changed pull of this bucket or version is kLatestVersion.
  PullHandle PullBucketSince(int32_t bucket, int64_t version, const PulledBucket& since,
                             std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // One shard of `version` (as PullShard) straight into the caller's memory: `destination` gets
  // the shard's packed data, which must be exactly destination_bytes = DataBytes(format,
  // shard_numel) bytes (ShardByteRange, common/layout.h), else INVALID_ARGUMENT before anything is
  // sent. The PulledShard returned holds the rest: the version, unchanged (then nothing was
  // written: keep the weights held), the block scales (in host memory) and the per-tensor values
  // of each fragment.
  //   Host memory: over any transport, the data's CRC-32C checked as for PullShard.
  //   Device memory: only over the cuda_ipc transport (ClientOptions::transport "cuda_ipc"),
  //     where the daemon writes the bytes into the allocation by its CUDA IPC handle: nothing
  //     passes through this process's host memory. The bytes are there, for any stream of this
  //     process, once the handle is ready. Not CRC-checked (the client would have to read them
  //     back); the daemon's copy is CUDA's. INVALID_ARGUMENT with another transport.
  // The destination must stay allocated, and must not be read or written, until the handle is
  // ready (CUDA work queued before the call that uses it: name it in options.cuda_stream or
  // cuda_event); a failed pull may have written part of it.
  ShardPullHandle PullShardInto(int32_t bucket, int32_t shard, int64_t version, void* destination,
                                int64_t destination_bytes, const PullIntoOptions& options = {});
  // Every shard of the bucket, as PullShardInto, in parallel, each into its slice of
  // `destination`: the whole bucket's packed data (DataBytes(format, numel) bytes), in bucket
  // order, exactly as a trainer's flat parameter buffer of the bucket holds it (for a bf16 bucket
  // the bf16 values themselves, padding 0): the all-gather of a version through the daemons,
  // straight into that buffer. The result: every shard's PulledShard, in order. ABORTED when the
  // shards came at different versions (kLatestVersion while a step committed): pull again.
  BucketPullHandle PullBucketInto(int32_t bucket, int64_t version, void* destination, int64_t destination_bytes,
                                  const PullIntoOptions& options = {});

  // Admin RPCs on this client's job, over the coordinator's channel (Admin service). The
  // coordinator checks the admin token when it has one (PERMISSION_DENIED); FAILED_PRECONDITION
  // from a coordinator started without --checkpoint-dir. UNAVAILABLE is retried until the deadline like every call
  // (a CreateCheckpoint whose answer was lost may then leave a second checkpoint behind).
  //
  // CreateCheckpoint: a checkpoint of the job at its current committed version; with `wait`,
  // returns once it is COMMITTED (bounded by the deadline), otherwise at once (state WRITING).
  absl::StatusOr<CheckpointInfo> CreateCheckpoint(bool wait = true, const AdminCallOptions& options = {});
  // RestoreCheckpoint: loads a COMMITTED checkpoint into this job (tensors must match by name and
  // shape; D, layout and formats may differ); the job's committed step and version become the
  // checkpoint's and every shard is reassigned, so the client re-reads the placement before
  // returning. DATA_LOSS for a torn or corrupt checkpoint (nothing changed). Pull the returned
  // version afterwards; no pushes of this client may be in flight.
  absl::StatusOr<RestoreResult> RestoreCheckpoint(const std::string& checkpoint_id,
                                                  const AdminCallOptions& options = {});

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  // FinishStep's answer for a step the daemons committed although a push of it was refused as
  // already decided: the step's stats (GetStepStats, asked again until `timeout`, 0: the
  // client's); its record here goes.
  absl::StatusOr<StepStats> CommittedStepStats(int64_t step, std::chrono::milliseconds timeout);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mainstay

#endif  // MAINSTAY_CLIENT_CLIENT_H_

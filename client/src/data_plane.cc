// Client data plane: PushGrad streams (reduced, unreduced, initial parameters) and PullParams
// streams (one shard, or every shard of a bucket into one packed buffer).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/src/client_impl.h"
#include "common/chunk_hash.h"
#include "common/crc32c.h"
#include "client/src/pull_assembly.h"
#include "client/src/rpc_errors.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "mainstay/client.h"

namespace mainstay {

using client_internal::Route;

namespace {

absl::Status CheckBucketIndex(const Layout& layout, int32_t bucket) {
  if (bucket < 0 || bucket >= static_cast<int32_t>(layout.buckets.size())) {
    return InvalidArgumentError("bucket", "index ", bucket, " is not in [0, ", layout.buckets.size(), ")");
  }
  return absl::OkStatus();
}

absl::Status CheckSpan(ElementSpan data, int64_t want, absl::string_view what, bool fp32_only) {
  if (data.type != ElementType::kFloat32 && (fp32_only || (data.type != ElementType::kBFloat16 &&
                                                           data.type != ElementType::kFloat16))) {
    return InvalidArgumentError("data", what, " must be ", fp32_only ? "fp32" : "fp32, bf16 or fp16", ", got ",
                                ElementTypeName(data.type));
  }
  if (data.numel != want) return InvalidArgumentError("data", what, " must have ", want, " elements, got ", data.numel);
  if (data.data == nullptr && want > 0) return InvalidArgumentError("data", "is null");
  return absl::OkStatus();
}

// The CUDA work a call's pushes wait for (PushOptions::cuda_event / cuda_stream), waited for once
// by whichever of them runs first; the others get the same result.
class CudaReady {
 public:
  CudaReady(const client_internal::CudaDriver& cuda, client_internal::PendingCudaWork work)
      : cuda_(cuda), work_(std::move(work)) {}
  absl::Status Await() {
    absl::MutexLock lock(&mu_);  // the others wait here while the first one waits for CUDA
    if (!done_) {
      status_ = cuda_.Wait(std::move(work_));
      done_ = true;
    }
    return status_;
  }

 private:
  const client_internal::CudaDriver& cuda_;
  absl::Mutex mu_;
  client_internal::PendingCudaWork work_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Completes one handle once every part of a multi-shard push has finished.
struct PushCountdown {
  absl::Mutex mu;
  int remaining ABSL_GUARDED_BY(mu) = 0;
  bool all_duplicate ABSL_GUARDED_BY(mu) = true;
  int64_t elements ABSL_GUARDED_BY(mu) = 0;
  int32_t contributions ABSL_GUARDED_BY(mu) = 0;
  bool first ABSL_GUARDED_BY(mu) = true;
  absl::Status error ABSL_GUARDED_BY(mu);
  std::promise<absl::StatusOr<PushResult>> promise;

  void Done(const absl::StatusOr<PushResult>& r) {
    absl::StatusOr<PushResult> out;
    {
      absl::MutexLock lock(&mu);
      if (!r.ok()) {
        if (error.ok()) error = r.status();
      } else {
        all_duplicate = all_duplicate && r->duplicate;
        elements += r->received_elements;
        contributions = first ? r->contributions : std::min(contributions, r->contributions);
        first = false;
      }
      if (--remaining > 0) return;
      if (!error.ok()) {
        out = error;
      } else {
        out = PushResult{all_duplicate, elements, contributions};
      }
    }
    promise.set_value(std::move(out));
  }
};

}  // namespace

absl::Status Client::Impl::StartTransports(Deadline deadline) {
  client_internal::TransportContext context;
  context.job_id = job_id;
  context.job_token = job_token;
  context.rank = options.rank;
  context.chunk_bytes = options.chunk_bytes;
  context.kv_put = [this](const std::string& key, const std::string& value, std::chrono::milliseconds ttl,
                          Deadline kv_deadline) {
    v1::KvPutRequest request;
    request.set_key(key);
    request.set_value(value);
    request.set_ttl_ms(ttl.count());
    v1::KvPutResponse response;
    grpc::ClientContext call;
    call.set_deadline(kv_deadline);
    return client_internal::StatusFromCall(coordinator->KvPut(&call, request, &response), &call);
  };
  context.stub_for = [this](const std::string& address) { return StubFor(address); };
  grpc_transport = client_internal::MakeGrpcTransport(context);
  const std::string& want = transport_request;
  if (want == "auto" || want == "ucx") {
    absl::StatusOr<std::unique_ptr<client_internal::DataTransport>> ucx = client_internal::MakeUcxTransport(context);
    if (ucx.ok()) {
      ucx_transport = *std::move(ucx);
    } else if (want == "ucx") {
      return Annotate(ucx.status(), "transport ucx");
    } else {
      ucx_note = std::string(ucx.status().message());
    }
  }
  if (want == "nccl") {
    absl::StatusOr<std::unique_ptr<client_internal::DataTransport>> nccl = client_internal::MakeNcclTransport(context);
    if (!nccl.ok()) return Annotate(nccl.status(), "transport nccl");
    nccl_transport = *std::move(nccl);
  }
  if (want == "cuda_ipc") {
    absl::StatusOr<std::unique_ptr<client_internal::DataTransport>> ipc =
        client_internal::MakeCudaIpcTransport(context, *cuda);
    if (!ipc.ok()) return Annotate(ipc.status(), "transport cuda_ipc");
    cuda_ipc_transport = *std::move(ipc);
  }
  // A daemon that does not have the job yet is asked again for a few seconds at a time, with the
  // placement re-read in between: the job may have gone to another daemon meanwhile (one that
  // had no room for it refused it), and the old one would never have it.
  constexpr auto kAttachSlice = std::chrono::seconds(5);
  std::set<std::string> attached_ids;
  while (true) {
    v1::Placement p;
    {
      absl::MutexLock lock(&mu);
      p = placement;
    }
    bool waiting = false;
    for (const v1::DaemonEndpoint& d : p.daemons()) {
      if (attached_ids.count(d.daemon_id())) continue;
      MAINSTAY_ASSIGN_OR_RETURN(client_internal::DataTransport * t, TransportFor(d));
      absl::Status attached = t->Attach(d, std::min(deadline, std::chrono::system_clock::now() + kAttachSlice));
      if (absl::IsUnavailable(attached) && attached.GetPayload(client_internal::kAttachNotYetPayload).has_value() &&
          std::chrono::system_clock::now() < deadline) {
        waiting = true;
        continue;
      }
      attached_ids.insert(d.daemon_id());
      if (!attached.ok() && want == "auto" && t->kind() == v1::TRANSPORT_UCX) {
        // "auto" still works where UCX cannot reach a daemon (no transport in common): by gRPC.
        absl::MutexLock lock(&mu);
        ucx_fallback[d.ucx_worker_address()] = std::string(attached.message());
        continue;
      }
      if (!attached.ok()) {
        return Annotate(attached, absl::StrCat("attaching to daemon ", d.daemon_id(), " (", d.address(), ") over ",
                                               client_internal::TransportName(t->kind())));
      }
    }
    if (!waiting) return absl::OkStatus();
    RefreshPlacement(deadline, 0).IgnoreError();
  }
}

absl::StatusOr<client_internal::DataTransport*> Client::Impl::TransportFor(const v1::DaemonEndpoint& daemon,
                                                                           std::string* note) {
  std::vector<v1::Transport> available = {v1::TRANSPORT_GRPC};
  if (ucx_transport != nullptr) available.push_back(v1::TRANSPORT_UCX);
  if (nccl_transport != nullptr) available.push_back(v1::TRANSPORT_NCCL);
  if (cuda_ipc_transport != nullptr) available.push_back(v1::TRANSPORT_CUDA_IPC);
  absl::StatusOr<v1::Transport> chosen = client_internal::ChooseTransport(transport_request, available, daemon);
  if (!chosen.ok()) return chosen.status();
  if (*chosen == v1::TRANSPORT_UCX && transport_request == "auto") {
    absl::MutexLock lock(&mu);
    auto it = ucx_fallback.find(daemon.ucx_worker_address());
    if (it != ucx_fallback.end()) {
      if (note != nullptr) *note = absl::StrCat("ucx attach failed: ", it->second);
      return grpc_transport.get();
    }
  }
  if (note != nullptr && *chosen == v1::TRANSPORT_GRPC && transport_request == "auto") {
    if (ucx_transport == nullptr && !ucx_note.empty()) {
      *note = absl::StrCat("no ucx here: ", ucx_note);
    } else if (ucx_transport != nullptr) {
      *note = "the daemon offers no ucx";
    }
  }
  switch (*chosen) {
    case v1::TRANSPORT_UCX:
      return ucx_transport.get();
    case v1::TRANSPORT_NCCL:
      return nccl_transport.get();
    case v1::TRANSPORT_CUDA_IPC:
      return cuda_ipc_transport.get();
    default:
      return grpc_transport.get();
  }
}

v1::PushGradHeader Client::Impl::PushHeader(int32_t bucket, int32_t shard, int64_t step, v1::PushKind kind,
                                            ElementSpan data, int32_t num_contributors,
                                            const PushOptions& push_options) const {
  v1::PushGradHeader h;
  h.set_job_id(job_id);
  h.set_job_token(job_token);
  h.set_bucket(bucket);
  h.set_shard(shard);
  h.set_step(step);
  h.set_rank(options.rank);
  h.set_kind(kind);
  h.set_dtype(ElementTypeToProto(data.type));
  h.set_total_bytes(data.bytes());
  h.set_num_contributors(num_contributors);
  h.set_loss_scale(push_options.loss_scale);
  return h;
}

absl::StatusOr<PushResult> Client::Impl::PushShardSync(int32_t bucket, int32_t shard, int64_t step,
                                                       v1::PushKind kind, ElementSpan data, int32_t num_contributors,
                                                       const PushOptions& push_options, Deadline deadline,
                                                       Route* landed, std::optional<uint32_t>* crc_out,
                                                       bool copies_sent) {
  v1::PushGradHeader header = PushHeader(bucket, shard, step, kind, data, num_contributors, push_options);
  v1::PushGradHeader* h = &header;  // sent as is by every transport
  h->set_copies_sent(copies_sent);
  // The payload's CRC-32C once an attempt computed it (or given: the replicas' copies).
  std::optional<uint32_t> crc = crc_out != nullptr ? *crc_out : std::nullopt;

  PushResult result;
  const std::string what = absl::StrCat(kind == v1::PUSH_KIND_INITIAL_PARAMS ? "PushGrad(initial params)" : "PushGrad",
                                        " bucket ", bucket, " shard ", shard, " step ", step);
  MAINSTAY_RETURN_IF_ERROR(Retry(
      what, deadline, [&] { return RouteForShard(bucket, shard); },
      [&](const Route& route, grpc::ClientContext* context) -> absl::Status {
        MAINSTAY_ASSIGN_OR_RETURN(client_internal::DataTransport * transport, TransportFor(route.endpoint));
        h->set_placement_epoch(route.epoch);
        // The payload's CRC-32C goes to the daemon (ClientOptions::push_crc32c), and a
        // gradient's is also kept for FinishStep's check before it pushes the step again
        // (step_attempts). Device memory has none (crc32c 0, "not sent"). Where it is known
        // (the replicas' copies needed it up front) the header carries it; a transport that
        // computes it as it copies or sends the payload sends it after the payload, to a daemon
        // that takes trailers; else it is computed here, first.
        h->clear_crc32c();
        h->set_crc32c_follows(false);
        const bool kept = kind == v1::PUSH_KIND_GRADIENT && options.step_attempts > 1 && crc_out != nullptr;
        const bool host = transport->HostReadable(data.data);
        std::optional<uint32_t> sent_crc;
        std::optional<uint32_t>* sent_crc_out = nullptr;
        if (host && (options.push_crc32c || kept)) {
          if (!crc && transport->ComputesPushCrc32c() && route.endpoint.takes_crc32c_trailer()) {
            h->set_crc32c_follows(options.push_crc32c);
            sent_crc_out = kept ? &sent_crc : nullptr;
          } else {
            if (!crc) crc = ::mainstay::Crc32c(data.data, data.bytes());
            if (options.push_crc32c) h->set_crc32c(*crc);
          }
        }
        absl::StatusOr<v1::PushGradResponse> response =
            transport->Push(route, *h, data, deadline, context, sent_crc_out);
        if (!response.ok()) return response.status();
        // A duplicate over ucx sends no payload, so nothing computed its CRC: done here.
        if (sent_crc_out != nullptr) crc = sent_crc ? *sent_crc : ::mainstay::Crc32c(data.data, data.bytes());
        result = PushResult{response->duplicate(), response->received_elements(), response->contributions()};
        *landed = route;
        return absl::OkStatus();
      }));
  if (crc_out != nullptr) *crc_out = crc;
  return result;
}

client_internal::ReplicaCopies Client::Impl::StartReplicaCopies(int32_t bucket, int32_t shard, int64_t step,
                                                                v1::PushKind kind, ElementSpan data,
                                                                int32_t num_contributors,
                                                                const PushOptions& push_options, Deadline deadline,
                                                                std::optional<uint32_t>* crc) {
  client_internal::ReplicaCopies copies;
  if (!options.replica_copies || kind != v1::PUSH_KIND_GRADIENT || num_contributors > 1) return copies;
  std::vector<v1::DaemonEndpoint> replicas;
  int64_t epoch = 0;
  {
    absl::MutexLock lock(&mu);
    if (shutting_down) return copies;
    epoch = placement.epoch();
    for (const v1::ShardPlacement& s : placement.shards()) {
      if (s.shard().bucket() != bucket || s.shard().shard() != shard) continue;
      for (const std::string& id : s.replica_daemon_ids()) {
        for (const v1::DaemonEndpoint& d : placement.daemons()) {
          if (d.daemon_id() == id) replicas.push_back(d);
        }
      }
    }
  }
  if (replicas.empty()) return copies;
  for (const v1::DaemonEndpoint& endpoint : replicas) {
    absl::StatusOr<client_internal::DataTransport*> transport = TransportFor(endpoint);
    if (!transport.ok() || !(*transport)->HostReadable(data.data)) return copies;
  }
  if (!crc->has_value()) *crc = ::mainstay::Crc32c(data.data, data.bytes());
  v1::PushGradHeader h = PushHeader(bucket, shard, step, kind, data, 1, push_options);
  h.set_placement_epoch(epoch);
  h.set_crc32c(**crc);
  h.set_replica_copy(true);
  for (const v1::DaemonEndpoint& endpoint : replicas) {
    // One attempt, no retry: whatever fails, the primary forwards the payload instead.
    copies.calls_.push_back(std::make_unique<client_internal::ReplicaCopies::Call>());
    client_internal::ReplicaCopies::Call* call = copies.calls_.back().get();
    copies.threads_.emplace_back([this, endpoint, h, data, deadline, call] {
      Route route;
      route.epoch = h.placement_epoch();
      route.daemon_id = endpoint.daemon_id();
      route.address = endpoint.address();
      route.endpoint = endpoint;
      ConnectRoute(&route);
      absl::Cleanup done = [call] { call->done.Notify(); };
      absl::StatusOr<client_internal::DataTransport*> transport = TransportFor(endpoint);
      if (!transport.ok()) return;
      grpc::ClientContext& context = call->context;
      context.set_deadline(deadline);
      {
        absl::MutexLock lock(&mu);  // cancelled with the client's other calls at shutdown
        if (shutting_down) return;
        active_calls.insert(&context);
      }
      (*transport)->Push(route, h, data, deadline, &context, /*payload_crc32c=*/nullptr).IgnoreError();
      absl::MutexLock lock(&mu);
      active_calls.erase(&context);
    });
  }
  return copies;
}

PushHandle Client::Impl::SchedulePushes(int32_t bucket, const std::vector<int32_t>& shards, int64_t step,
                                        v1::PushKind kind, const std::vector<ElementSpan>& data,
                                        int32_t num_contributors, const PushOptions& push_options) {
  if (reader) return PushHandle::Ready(ReaderRefusal());
  // The grpc and ucx transports read a push's payload with the CPU: device memory is refused
  // here, before anything is recorded or sent. "auto" never picks nccl or cuda_ipc (transport.h).
  if (transport_request != "nccl" && transport_request != "cuda_ipc") {
    for (size_t i = 0; i < shards.size(); ++i) {
      if (std::optional<int> device = cuda->DeviceOf(data[i].data); device.has_value()) {
        const std::string readers = transport_request == "auto"
                                        ? "the grpc and ucx transports read"
                                        : absl::StrCat("the ", transport_request, " transport reads");
        return PushHandle::Ready(InvalidArgumentError(
            "data", "the buffer pushed for bucket ", bucket, " shard ", shards[i], " is in the memory of CUDA device ",
            *device, ", and ", readers, " pushes with the CPU: copy it to host memory (pinned memory, with ",
            "PushOptions::cuda_stream or cuda_event naming the copy), or connect with transport \"nccl\" (or ",
            "\"cuda_ipc\" to a daemon on the trainer's node)"));
      }
    }
  }
  absl::StatusOr<client_internal::PendingCudaWork> work = cuda->Capture(push_options.cuda_stream,
                                                                        push_options.cuda_event);
  if (!work.ok()) return PushHandle::Ready(work.status());
  // Most pushes name no CUDA work: then there is nothing to share or wait for.
  std::shared_ptr<CudaReady> cuda_ready =
      work->empty() ? nullptr : std::make_shared<CudaReady>(*cuda, *std::move(work));
  const Deadline deadline = DeadlineAfter(push_options.timeout);
  auto countdown = std::make_shared<PushCountdown>();
  {
    absl::MutexLock lock(&countdown->mu);
    countdown->remaining = static_cast<int>(shards.size());
  }
  PushHandle handle(countdown->promise.get_future().share());
  for (size_t i = 0; i < shards.size(); ++i) {
    auto done = std::make_shared<std::promise<absl::Status>>();
    auto crc = std::make_shared<std::optional<uint32_t>>();
    if (kind == v1::PUSH_KIND_GRADIENT) {
      absl::MutexLock lock(&mu);
      steps[step].pushes.push_back(
          {bucket, shards[i], done->get_future().share(), data[i], num_contributors, push_options, crc});
    }
    const int32_t shard = shards[i];
    const ElementSpan part = data[i];
    push_pool->Schedule([this, bucket, shard, step, kind, part, num_contributors, push_options, deadline, done,
                         countdown, crc, cuda_ready] {
      if (absl::Status ready = cuda_ready != nullptr ? cuda_ready->Await() : absl::OkStatus(); !ready.ok()) {
        countdown->Done(ready);
        done->set_value(ready);
        return;
      }
      Route landed;
      client_internal::ReplicaCopies copies =
          StartReplicaCopies(bucket, shard, step, kind, part, num_contributors, push_options, deadline, crc.get());
      const auto started = std::chrono::steady_clock::now();
      absl::StatusOr<PushResult> r = PushShardSync(bucket, shard, step, kind, part, num_contributors, push_options,
                                                   deadline, &landed, crc.get(), !copies.empty());
      // They read `part` too. A copy that lags its push by more than the push took (at least
      // 2 s) is given up: a replica that stopped answering never holds the push up for long.
      copies.Finish(std::max(std::chrono::milliseconds(2000), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                  std::chrono::steady_clock::now() - started)));
      if (r.ok() && kind == v1::PUSH_KIND_GRADIENT) {
        absl::MutexLock lock(&mu);
        auto [at, first] = steps[step].daemons.try_emplace(
            landed.address, client_internal::StepRecord::Landed{landed.daemon_id, landed.epoch});
        at->second.daemon_id = landed.daemon_id;
        if (!first) at->second.epoch = std::min(at->second.epoch, landed.epoch);
      }
      // The handle first: once FinishStep has seen every `done`, every handle of the step is ready.
      countdown->Done(r);
      done->set_value(r.status());
    });
  }
  return handle;
}

absl::Status Client::Impl::PushStepAgain(int64_t step, const std::vector<client_internal::StepPush>& pushes) {
  for (const client_internal::StepPush& p : pushes) {
    const std::string which = absl::StrCat("bucket ", p.bucket, " shard ", p.shard);
    // Device memory (the nccl and cuda_ipc transports) has no CRC here: it is pushed again as
    // it is, which the contract allows (the buffer stays unchanged until FinishStep returns).
    if (!p.crc->has_value()) continue;
    if (::mainstay::Crc32c(p.data.data, p.data.bytes()) != **p.crc) {
      return absl::FailedPreconditionError(
          absl::StrCat("the buffer pushed for ", which, " changed after its push (it must stay unchanged until "
                       "FinishStep of its step returns for the client to push the step again)"));
    }
  }
  RefreshPlacement(DeadlineAfter(std::chrono::milliseconds(0)), 0).IgnoreError();
  std::vector<PushHandle> handles;
  for (const client_internal::StepPush& p : pushes) {
    PushOptions options = p.options;  // the buffer was produced (its CRC matched): no CUDA wait
    options.cuda_event = nullptr;
    options.cuda_stream.reset();
    handles.push_back(SchedulePushes(p.bucket, {p.shard}, step, v1::PUSH_KIND_GRADIENT, {p.data}, p.num_contributors,
                                     options));
  }
  // A push answered "already decided" (FAILED_PRECONDITION naming a committed step at or past
  // this one) says the step committed after all (the pushes a move carried): that answer wins.
  absl::Status first;
  for (PushHandle& h : handles) {
    const absl::StatusOr<PushResult>& r = h.Wait();
    if (r.ok()) continue;
    if (first.ok() || client_internal::CommittedAtOrPast(r.status(), step)) first = r.status();
  }
  return first;
}

PushHandle Client::PushShard(int32_t bucket, int32_t shard, int64_t step, ElementSpan shard_data,
                             int32_t num_contributors, const PushOptions& options) {
  const Layout& l = *impl_->layout;
  absl::Status s = CheckBucketIndex(l, bucket);
  if (s.ok() && (shard < 0 || shard >= l.data_parallel_size)) {
    s = InvalidArgumentError("shard", "index ", shard, " is not in [0, ", l.data_parallel_size, ")");
  }
  if (s.ok() && step < 0) s = InvalidArgumentError("step", "must be >= 0 for a gradient, got ", step);
  if (s.ok() && (num_contributors < 1 || num_contributors > l.data_parallel_size)) {
    s = InvalidArgumentError("num_contributors", "must be in [1, ", l.data_parallel_size, "], got ", num_contributors);
  }
  if (s.ok()) s = CheckSpan(shard_data, l.buckets[bucket].shard_numel, "a shard", false);
  if (!s.ok()) return PushHandle::Ready(s);
  return impl_->SchedulePushes(bucket, {shard}, step, v1::PUSH_KIND_GRADIENT, {shard_data}, num_contributors, options);
}

PushHandle Client::PushGrad(int32_t bucket, int64_t step, ElementSpan shard_data, const PushOptions& options) {
  return PushShard(bucket, rank(), step, shard_data, 1, options);
}

PushHandle Client::PushBucketUnreduced(int32_t bucket, int64_t step, ElementSpan bucket_data,
                                       const PushOptions& options) {
  const Layout& l = *impl_->layout;
  absl::Status s = CheckBucketIndex(l, bucket);
  if (s.ok() && step < 0) s = InvalidArgumentError("step", "must be >= 0 for a gradient, got ", step);
  if (s.ok()) s = CheckSpan(bucket_data, l.buckets[bucket].numel, "a whole bucket", false);
  if (!s.ok()) return PushHandle::Ready(s);
  const Bucket& b = l.buckets[bucket];
  std::vector<int32_t> shards;
  std::vector<ElementSpan> parts;
  for (int32_t r = 0; r < static_cast<int32_t>(l.data_parallel_size); ++r) {
    shards.push_back(r);
    parts.push_back(bucket_data.Sub(r * b.shard_numel, b.shard_numel));
  }
  return impl_->SchedulePushes(bucket, shards, step, v1::PUSH_KIND_GRADIENT, parts,
                               static_cast<int32_t>(l.data_parallel_size), options);
}

PushHandle Client::PushInitialParams(int32_t bucket, std::span<const float> data, bool all_shards,
                                     const PushOptions& options) {
  const Layout& l = *impl_->layout;
  absl::Status s = CheckBucketIndex(l, bucket);
  if (!s.ok()) return PushHandle::Ready(s);
  const Bucket& b = l.buckets[bucket];
  const ElementSpan span = ElementSpan::Fp32(data);
  std::vector<int32_t> shards;
  std::vector<ElementSpan> parts;
  if (span.numel == b.numel) {
    for (int32_t r = 0; r < static_cast<int32_t>(l.data_parallel_size); ++r) {
      if (!all_shards && r != rank()) continue;
      shards.push_back(r);
      parts.push_back(span.Sub(r * b.shard_numel, b.shard_numel));
    }
  } else if (span.numel == b.shard_numel && !all_shards) {
    shards.push_back(rank());
    parts.push_back(span);
  } else {
    return PushHandle::Ready(InvalidArgumentError(
        "data", "initial parameters of bucket ", bucket, " must have ", b.numel, " elements (whole bucket)",
        all_shards ? "" : absl::StrCat(" or ", b.shard_numel, " (this rank's shard)"), ", got ", span.numel));
  }
  return impl_->SchedulePushes(bucket, shards, -1, v1::PUSH_KIND_INITIAL_PARAMS, parts, 1, options);
}

// ---------------------------------------------------------------------------------------------
// Pulls.

absl::StatusOr<PulledShard> Client::Impl::PullShardSync(int32_t bucket, int32_t shard, int64_t version,
                                                        std::span<uint8_t> data_out, Deadline deadline,
                                                        const DeltaBase* delta, bool on_device) {
  v1::PullParamsRequest request;
  request.set_job_id(job_id);
  request.set_job_token(job_token);
  request.set_bucket(bucket);
  request.set_shard(shard);
  request.set_rank(options.rank);
  if (version == Client::kLatestVersion) {
    request.set_latest(true);
  } else {
    request.set_version(version);
  }
  request.set_max_chunk_bytes(options.chunk_bytes);
  if (delta != nullptr) {
    request.set_delta_chunk_bytes(delta->chunk_bytes);
    request.mutable_have_chunk_hashes()->Assign(delta->have.begin(), delta->have.end());
    request.mutable_have_scale_chunk_hashes()->Assign(delta->have_scales.begin(), delta->have_scales.end());
    if (delta->since_version >= 0) request.set_delta_since_version(delta->since_version);
  }
  absl::StatusOr<PulledShard> result;
  const std::string what = absl::StrCat("PullParams bucket ", bucket, " shard ", shard, " version ", version);
  MAINSTAY_RETURN_IF_ERROR(Retry(
      what, deadline, [&] { return RouteForShard(bucket, shard); },
      [&](const Route& route, grpc::ClientContext* context) -> absl::Status {
        client_internal::DataTransport* transport = grpc_transport.get();  // deltas go over grpc only
        if (delta == nullptr) {
          MAINSTAY_ASSIGN_OR_RETURN(transport, TransportFor(route.endpoint));
        }
        if (on_device && transport->kind() != v1::TRANSPORT_CUDA_IPC) {
          return absl::FailedPreconditionError(
              absl::StrCat("a pull into device memory needs the cuda_ipc transport; daemon ", route.daemon_id,
                           " is reached by ", client_internal::TransportName(transport->kind())));
        }
        request.set_placement_epoch(route.epoch);
        client_internal::ShardPullAssembler assembler(*layout, bucket, shard,
                                                      version == Client::kLatestVersion ? -1 : version, data_out,
                                                      options.verify_crc32c && !on_device);
        if (delta != nullptr) {
          assembler.ExpectDelta(delta->chunk_bytes, delta->since_version >= 0,
                                delta->have_scales.empty() ? std::span<const uint8_t>() : delta->scales);
        }
        MAINSTAY_RETURN_IF_ERROR(transport->Pull(route, request, assembler, deadline, context));
        result = assembler.Finish();
        return result.status();
      }));
  return result;
}

PullHandle Client::Impl::SchedulePull(int32_t bucket, int32_t shard_begin, int32_t shard_end, int64_t version,
                                      std::chrono::milliseconds timeout, const PulledBucket* since) {
  struct PullState {
    absl::Mutex mu;
    int remaining ABSL_GUARDED_BY(mu) = 0;
    client_internal::PooledBytes data;
    std::vector<absl::StatusOr<PulledShard>> shards;
    std::promise<absl::StatusOr<PulledBucket>> promise;
  };
  const Deadline deadline = DeadlineAfter(timeout);
  const Bucket& b = layout->buckets[bucket];
  auto state = std::make_shared<PullState>();
  const int64_t base = DataBytes(b.format, shard_begin * b.shard_numel);
  state->data = pull_buffers->Acquire(DataBytes(b.format, shard_end * b.shard_numel) - base);
  state->shards.resize(shard_end - shard_begin);
  // A delta pull patches a copy of `since` (left as it is, whatever happens), in 64 KiB chunks,
  // whole or as byte patches against since's version. The tasks share since's buffers (its
  // scales), so the caller may drop it at once.
  std::shared_ptr<const PulledBucket> base_copy;
  if (since != nullptr) {
    std::memcpy(state->data.span().data(), since->data().data(), state->data.span().size());
    base_copy = std::make_shared<const PulledBucket>(*since);
  }
  {
    absl::MutexLock lock(&state->mu);
    state->remaining = shard_end - shard_begin;
  }
  PullHandle handle(state->promise.get_future().share());
  for (int32_t shard = shard_begin; shard < shard_end; ++shard) {
    pull_pool->Schedule([this, state, bucket, shard, shard_begin, version, deadline, base,
                         since = base_copy] {
      const Bucket& bk = layout->buckets[bucket];
      const IndexRange bytes = ShardByteRange(bk, shard);
      std::span<uint8_t> out = state->data.span().subspan(bytes.begin - base, bytes.size());
      DeltaBase delta;
      if (since != nullptr) {
        delta.chunk_bytes = int64_t{64} << 10;
        delta.since_version = since->version();
        delta.have = ChunkHashes(out, delta.chunk_bytes);
        delta.scales = since->shards()[static_cast<size_t>(shard - since->shard_begin())].scales;
        if (!delta.scales.empty()) delta.have_scales = ChunkHashes(delta.scales, delta.chunk_bytes);
      }
      absl::StatusOr<PulledShard> r =
          PullShardSync(bucket, shard, version, out, deadline, since != nullptr ? &delta : nullptr);
      {
        absl::MutexLock lock(&state->mu);
        state->shards[shard - shard_begin] = std::move(r);
        if (--state->remaining > 0) return;
      }
      // The last shard to finish assembles the bucket (no task ever waits for another).
      std::vector<PulledShard> shards;
      for (absl::StatusOr<PulledShard>& s : state->shards) {
        if (!s.ok()) {
          state->promise.set_value(s.status());
          return;
        }
        shards.push_back(*std::move(s));
      }
      state->promise.set_value(
          client_internal::MakePulledBucket(layout, bucket, shard_begin, std::move(state->data), std::move(shards)));
    });
  }
  return handle;
}

PullHandle Client::PullShard(int32_t bucket, int32_t shard, int64_t version, std::chrono::milliseconds timeout) {
  absl::Status s = CheckBucketIndex(*impl_->layout, bucket);
  if (s.ok() && (shard < 0 || shard >= data_parallel_size())) {
    s = InvalidArgumentError("shard", "index ", shard, " is not in [0, ", data_parallel_size(), ")");
  }
  if (s.ok() && version < kLatestVersion) s = InvalidArgumentError("version", "must be >= 0 or kLatestVersion");
  if (!s.ok()) return PullHandle::Ready(s);
  return impl_->SchedulePull(bucket, shard, shard + 1, version, timeout);
}

absl::Status Client::Impl::SchedulePullsInto(int32_t bucket, int32_t shard_begin, int32_t shard_end, int64_t version,
                                             void* destination, int64_t destination_bytes,
                                             const PullIntoOptions& options, PullsIntoDone done) {
  const Bucket& b = layout->buckets[bucket];
  const int64_t base = DataBytes(b.format, shard_begin * b.shard_numel);
  const int64_t bytes = DataBytes(b.format, shard_end * b.shard_numel) - base;
  if (destination == nullptr || destination_bytes != bytes) {
    return InvalidArgumentError("destination", "bucket ", bucket, "'s shards [", shard_begin, ", ", shard_end,
                                ") hold ", bytes, " bytes of packed ", FormatName(b.format), " data; got ",
                                destination == nullptr ? "a null pointer" : absl::StrCat(destination_bytes, " bytes"));
  }
  const std::optional<int> device = cuda->DeviceOf(destination);
  if (device.has_value() && transport_request != "cuda_ipc") {
    return InvalidArgumentError("destination", "is in the memory of CUDA device ", *device,
                                ", which only the cuda_ipc transport writes (ClientOptions::transport \"cuda_ipc\", a "
                                "daemon on this node); this client uses \"",
                                transport_request, "\": pull into host memory");
  }
  MAINSTAY_ASSIGN_OR_RETURN(client_internal::PendingCudaWork work,
                            cuda->Capture(options.cuda_stream, options.cuda_event));
  struct State {
    absl::Mutex mu;
    int remaining ABSL_GUARDED_BY(mu) = 0;
    std::vector<absl::StatusOr<PulledShard>> shards;
    PullsIntoDone done;
  };
  auto state = std::make_shared<State>();
  state->shards.resize(static_cast<size_t>(shard_end - shard_begin));
  state->done = std::move(done);
  {
    absl::MutexLock lock(&state->mu);
    state->remaining = shard_end - shard_begin;
  }
  auto cuda_ready = std::make_shared<CudaReady>(*cuda, std::move(work));
  const Deadline deadline = DeadlineAfter(options.timeout);
  for (int32_t shard = shard_begin; shard < shard_end; ++shard) {
    const IndexRange range = ShardByteRange(b, shard);
    const std::span<uint8_t> out(static_cast<uint8_t*>(destination) + (range.begin - base),
                                 static_cast<size_t>(range.size()));
    pull_pool->Schedule(
        [this, state, cuda_ready, bucket, shard, shard_begin, version, out, deadline, on_device = device.has_value()] {
          const absl::Status ready = cuda_ready->Await();
          absl::StatusOr<PulledShard> r = ready.ok()
                                              ? PullShardSync(bucket, shard, version, out, deadline, nullptr, on_device)
                                              : absl::StatusOr<PulledShard>(ready);
          {
            absl::MutexLock lock(&state->mu);
            state->shards[static_cast<size_t>(shard - shard_begin)] = std::move(r);
            if (--state->remaining > 0) return;
          }
          // The last shard to finish answers (no task waits for another).
          std::vector<PulledShard> shards;
          for (absl::StatusOr<PulledShard>& s : state->shards) {
            if (!s.ok()) {
              state->done(s.status());
              return;
            }
            shards.push_back(*std::move(s));
          }
          for (const PulledShard& s : shards) {
            if (s.version != shards[0].version || s.unchanged != shards[0].unchanged) {
              state->done(absl::AbortedError(absl::StrCat(
                  "bucket ", bucket, ": shard ", shards[0].shard, " answered version ", shards[0].version,
                  " but shard ", s.shard, " version ", s.version, " (a step committed during the pull): pull again")));
              return;
            }
          }
          state->done(std::move(shards));
        });
  }
  return absl::OkStatus();
}

ShardPullHandle Client::PullShardInto(int32_t bucket, int32_t shard, int64_t version, void* destination,
                                      int64_t destination_bytes, const PullIntoOptions& options) {
  absl::Status s = CheckBucketIndex(*impl_->layout, bucket);
  if (s.ok() && (shard < 0 || shard >= data_parallel_size())) {
    s = InvalidArgumentError("shard", "index ", shard, " is not in [0, ", data_parallel_size(), ")");
  }
  if (s.ok() && version < kLatestVersion) s = InvalidArgumentError("version", "must be >= 0 or kLatestVersion");
  if (!s.ok()) return ShardPullHandle::Ready(s);
  auto promise = std::make_shared<std::promise<absl::StatusOr<PulledShard>>>();
  ShardPullHandle handle(promise->get_future().share());
  s = impl_->SchedulePullsInto(bucket, shard, shard + 1, version, destination, destination_bytes, options,
                               [promise](absl::StatusOr<std::vector<PulledShard>> r) {
                                 if (r.ok()) {
                                   promise->set_value(std::move(r->front()));
                                 } else {
                                   promise->set_value(r.status());
                                 }
                               });
  if (!s.ok()) return ShardPullHandle::Ready(s);
  return handle;
}

BucketPullHandle Client::PullBucketInto(int32_t bucket, int64_t version, void* destination, int64_t destination_bytes,
                                        const PullIntoOptions& options) {
  absl::Status s = CheckBucketIndex(*impl_->layout, bucket);
  if (s.ok() && version < kLatestVersion) s = InvalidArgumentError("version", "must be >= 0 or kLatestVersion");
  if (!s.ok()) return BucketPullHandle::Ready(s);
  auto promise = std::make_shared<std::promise<absl::StatusOr<std::vector<PulledShard>>>>();
  BucketPullHandle handle(promise->get_future().share());
  s = impl_->SchedulePullsInto(
      bucket, 0, static_cast<int32_t>(data_parallel_size()), version, destination, destination_bytes, options,
      [promise](absl::StatusOr<std::vector<PulledShard>> r) { promise->set_value(std::move(r)); });
  if (!s.ok()) return BucketPullHandle::Ready(s);
  return handle;
}

PullHandle Client::PullBucket(int32_t bucket, int64_t version, std::chrono::milliseconds timeout) {
  absl::Status s = CheckBucketIndex(*impl_->layout, bucket);
  if (s.ok() && version < kLatestVersion) s = InvalidArgumentError("version", "must be >= 0 or kLatestVersion");
  if (!s.ok()) return PullHandle::Ready(s);
  return impl_->SchedulePull(bucket, 0, static_cast<int32_t>(data_parallel_size()), version, timeout);
}

PullHandle Client::PullBucketSince(int32_t bucket, int64_t version, const PulledBucket& since,
                                   std::chrono::milliseconds timeout) {
  absl::Status s = CheckBucketIndex(*impl_->layout, bucket);
  if (s.ok() && version < 0) s = InvalidArgumentError("version", "must be >= 0 (a delta needs a version)");
  if (s.ok() && (since.bucket() != bucket || !since.complete() || since.unchanged() ||
                 since.layout().buckets.size() != impl_->layout->buckets.size() ||
                 since.data().size() != static_cast<size_t>(DataBytes(impl_->layout->buckets[bucket].format,
                                                                      impl_->layout->buckets[bucket].numel)))) {
    s = InvalidArgumentError("since", "must be a whole pull of bucket ", bucket, " of this job (PullBucket), got bucket ",
                             since.bucket(), " shards [", since.shard_begin(), ", ", since.shard_end(), ")",
                             since.unchanged() ? ", unchanged" : "");
  }
  if (!s.ok()) return PullHandle::Ready(s);
  return impl_->SchedulePull(bucket, 0, static_cast<int32_t>(data_parallel_size()), version, timeout, &since);
}

}  // namespace mainstay

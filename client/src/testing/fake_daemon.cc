// The fake shard daemon of fake_services.h: PushGrad, PullParams, FinishStep, GetStepStats.
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/src/testing/fake_state.h"
#include "common/crc32c.h"
#include "common/layout_proto.h"
#include "kernels/casts.h"
#include "mainstay/v1/shard.grpc.pb.h"

namespace mainstay::testing_fakes {
namespace {

grpc::Status Invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "fake daemon: " + message);
}

// Waits on the cluster's condition until `done`, the call's deadline or its cancellation (a
// client that goes away, a server shutting down). False unless `done`.
template <typename Done>
bool WaitFor(FakeCluster::State* s, grpc::ServerContext* context, Done done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) {
  const absl::Time deadline = absl::FromChrono(context->deadline());
  while (!done()) {
    if (context->IsCancelled() || absl::Now() >= deadline) return false;
    s->changed.WaitWithTimeout(&s->mu, absl::Milliseconds(20));
  }
  return true;
}

class FakeDaemon final : public v1::Shard::Service {
 public:
  FakeDaemon(FakeCluster::State* s, int index) : s_(s), index_(index) {}

  grpc::Status PushGrad(grpc::ServerContext* context, grpc::ServerReader<v1::PushGradRequest>* reader,
                        v1::PushGradResponse* response) override {
    v1::PushGradRequest message;
    if (!reader->Read(&message) || !message.has_header()) return Invalid("the first message must be a header");
    const v1::PushGradHeader h = message.header();
    int64_t shard_numel = 0;
    {
      absl::MutexLock lock(&s_->mu);
      grpc::Status admitted =
          s_->Admit(context, index_, h.job_id(), h.job_token(), h.placement_epoch(), h.bucket(), h.shard());
      if (!admitted.ok()) return admitted;
      shard_numel = s_->layout->buckets[h.bucket()].shard_numel;
    }
    if (grpc::Status checked = CheckHeader(context, h, shard_numel); !checked.ok()) return checked;
    const int elem = h.dtype() == v1::ELEMENT_TYPE_FP32 ? 4 : 2;
    std::string payload;
    int64_t max_chunk = 0;
    std::optional<uint32_t> trailer;
    while (reader->Read(&message)) {
      if (trailer.has_value()) return Invalid("a message after the trailer");
      if (message.has_trailer()) {
        // A daemon from before trailers knows no such message: to it, it is no chunk.
        if (!s_->options.take_crc32c_trailers) return Invalid("a second header (an old daemon)");
        if (!h.crc32c_follows()) return Invalid("a trailer the header did not announce");
        trailer = message.trailer().crc32c();
        continue;
      }
      if (!message.has_chunk()) return Invalid("a second header");
      const v1::GradChunk& c = message.chunk();
      if (c.element_offset() * elem != static_cast<int64_t>(payload.size())) return Invalid("chunk out of order");
      if (c.data().size() % elem != 0 || c.data().size() > (4u << 20) || c.data().empty()) return Invalid("bad chunk");
      max_chunk = std::max<int64_t>(max_chunk, c.data().size());
      payload += c.data();
    }
    if (static_cast<int64_t>(payload.size()) != h.total_bytes()) return Invalid("short payload");
    if (h.crc32c_follows() && !trailer.has_value()) return Invalid("no trailer");
    v1::PushGradHeader checked = h;  // the trailer's CRC-32C is checked as the header's would be
    if (trailer.has_value()) checked.set_crc32c(*trailer);
    grpc::Status stored = Store(checked, payload, shard_numel, response, max_chunk);
    if (stored.ok() && checked.crc32c() != 0) {
      absl::MutexLock lock(&s_->mu);
      ++s_->stats.crc_checked;
      if (trailer.has_value()) ++s_->stats.crc_trailers;
    }
    return stored;
  }

  // The cuda_ipc transport's calls. A "handle" here is what the tests' fake CUDA driver exports:
  // the allocation's address in this process in its first 8 bytes.
  grpc::Status AttachCudaIpc(grpc::ServerContext* context, const v1::AttachCudaIpcRequest* request,
                             v1::AttachCudaIpcResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    grpc::Status admitted = s_->Admit(context, index_, request->job_id(), request->job_token(), 0, -1, 0);
    if (!admitted.ok()) return admitted;
    if (request->boot_id().empty()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "fake daemon: another node (no boot id)");
    }
    ++s_->stats.cuda_ipc_attaches;
    response->set_session_id(static_cast<uint64_t>(1000 + s_->stats.cuda_ipc_attaches));
    response->set_device(0);
    return grpc::Status::OK;
  }
  grpc::Status CudaIpcPush(grpc::ServerContext* context, const v1::CudaIpcPushRequest* request,
                           v1::PushGradResponse* response) override {
    const v1::PushGradHeader& h = request->header();
    int64_t shard_numel = 0;
    {
      absl::MutexLock lock(&s_->mu);
      if (request->session_id() <= 1000 ||
          request->session_id() > 1000 + static_cast<uint64_t>(s_->stats.cuda_ipc_attaches)) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "unknown cuda_ipc session (fake daemon)");
      }
      grpc::Status admitted =
          s_->Admit(context, index_, h.job_id(), h.job_token(), h.placement_epoch(), h.bucket(), h.shard());
      if (!admitted.ok()) return admitted;
      shard_numel = s_->layout->buckets[h.bucket()].shard_numel;
      ++s_->stats.cuda_ipc_pushes;
    }
    if (grpc::Status checked = CheckHeader(context, h, shard_numel); !checked.ok()) return checked;
    const v1::CudaIpcRegion& m = request->memory();
    if (m.handle().size() != 64) return Invalid("a CUDA IPC handle has 64 bytes");
    if (m.offset() + static_cast<uint64_t>(h.total_bytes()) > m.allocation_bytes()) return Invalid("range outside");
    uintptr_t base = 0;
    std::memcpy(&base, m.handle().data(), sizeof(base));
    const std::string payload(reinterpret_cast<const char*>(base) + m.offset(), static_cast<size_t>(h.total_bytes()));
    return Store(h, payload, shard_numel, response, /*stream_chunk=*/-1);
  }

  grpc::Status DetachCudaIpc(grpc::ServerContext* context, const v1::DetachCudaIpcRequest* request,
                             v1::DetachCudaIpcResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    ++s_->stats.cuda_ipc_detaches;
    return grpc::Status::OK;
  }

  grpc::Status PullParams(grpc::ServerContext* context, const v1::PullParamsRequest* request,
                          grpc::ServerWriter<v1::PullParamsResponse>* writer) override {
    {
      absl::MutexLock lock(&s_->mu);
      ++s_->stats.pull_streams;
    }
    return Pull(context, *request, [writer](const v1::PullParamsResponse& m) { return writer->Write(m); });
  }

  // A pull whose data the fake writes at the destination's address (the handle's first 8 bytes,
  // plus the offset), as the real daemon writes into the trainer's device memory.
  grpc::Status CudaIpcPull(grpc::ServerContext* context, const v1::CudaIpcPullRequest* request,
                           v1::CudaIpcPullResponse* response) override {
    {
      absl::MutexLock lock(&s_->mu);
      if (request->session_id() <= 1000 ||
          request->session_id() > 1000 + static_cast<uint64_t>(s_->stats.cuda_ipc_attaches)) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "unknown cuda_ipc session (fake daemon)");
      }
      ++s_->stats.cuda_ipc_pulls;
    }
    const v1::CudaIpcRegion& m = request->memory();
    if (m.handle().size() != 64) return Invalid("a CUDA IPC handle has 64 bytes");
    if (m.offset() + request->bytes() > m.allocation_bytes()) return Invalid("range outside");
    uintptr_t base = 0;
    std::memcpy(&base, m.handle().data(), sizeof(base));
    char* dest = reinterpret_cast<char*>(base) + m.offset();
    Format format = Format::kBF16;
    return Pull(context, request->request(), [&](const v1::PullParamsResponse& r) {
      if (r.has_header()) {
        *response->mutable_header() = r.header();
        if (absl::StatusOr<Format> f = FormatFromProto(r.header().format()); f.ok()) format = *f;
        return static_cast<uint64_t>(r.header().total_data_bytes()) == request->bytes() || r.header().unchanged();
      }
      if (r.has_data()) {
        std::memcpy(dest + DataBytes(format, r.data().element_offset()), r.data().data().data(),
                    r.data().data().size());
      } else {
        response->mutable_scales()->append(r.scales().data());
      }
      return true;
    });
  }

  grpc::Status FinishStep(grpc::ServerContext* context, const v1::FinishStepRequest* request,
                          v1::FinishStepResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    grpc::Status admitted =
        s_->Admit(context, index_, request->job_id(), request->job_token(), request->placement_epoch(), -1, -1);
    if (!admitted.ok()) return admitted;
    ++s_->stats.finish_calls;
    if (s_->fenced_finishes_left > 0 && request->placement_epoch() < s_->epoch) {
      --s_->fenced_finishes_left;
      v1::ErrorDetail detail;
      detail.set_placement_epoch(s_->epoch);
      return WithDetail(context, grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("FinishStep: job ", request->job_id(), " is moving to placement epoch ", s_->epoch,
                                     " (fake: fenced before it got that placement)"),
                        detail);
    }
    // One (lr, weight_decay) for the whole job: the fake has no param groups.
    std::pair<double, double> hyper{request->lr(), request->weight_decay()};
    if (request->groups_size() > 1) return Invalid("the fake daemon applies one lr / weight_decay (no param groups)");
    if (request->groups_size() == 1) hyper = {request->groups(0).lr(), request->groups(0).weight_decay()};
    auto& ranks = s_->finished[request->step()];
    if (!ranks.empty() && ranks.begin()->second != hyper) return Invalid("lr / weight_decay differ between ranks");
    ranks[request->rank()] = hyper;
    const int given_up = s_->given_up[request->step()];
    s_->TryCommit();
    auto decided = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu) {
      return s_->results.count(request->step()) > 0 || s_->given_up[request->step()] != given_up;
    };
    if (!WaitFor(s_, context, decided)) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "step not decided before the deadline");
    }
    if (s_->given_up[request->step()] != given_up) {
      v1::ErrorDetail detail;
      detail.set_committed_step(s_->committed_step);
      return WithDetail(context, grpc::StatusCode::ABORTED,
                        absl::StrCat("step ", request->step(), " failed on this daemon and changed nothing; push it again"),
                        detail);
    }
    *response->mutable_stats() = s_->results[request->step()];
    return grpc::Status::OK;
  }

  grpc::Status GetStepStats(grpc::ServerContext* context, const v1::GetStepStatsRequest* request,
                            v1::GetStepStatsResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    if (s_->stats_unavailable_left > 0) {
      --s_->stats_unavailable_left;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: the step is not committed on this daemon yet");
    }
    auto it = s_->results.find(request->step());
    if (it == s_->results.end()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "step not decided");
    *response->mutable_stats() = it->second;
    return grpc::Status::OK;
  }

 private:
  // PullParams's answer, message by message, to `write` (false: stop).
  grpc::Status Pull(grpc::ServerContext* context, const v1::PullParamsRequest& request,
                    const std::function<bool(const v1::PullParamsResponse&)>& write) {
    std::shared_ptr<const Layout> layout;
    std::vector<float> master;
    int64_t version = 0;
    bool unchanged = false;
    {
      absl::MutexLock lock(&s_->mu);
      grpc::Status admitted = s_->Admit(context, index_, request.job_id(), request.job_token(),
                                        request.placement_epoch(), request.bucket(), request.shard());
      if (!admitted.ok()) return admitted;
      const int64_t want = request.latest() ? 0 : request.version();
      auto decided = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu) {
        return s_->version >= want || (want >= 1 && s_->results.count(want - 1) > 0);
      };
      if (!decided() && request.no_wait()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "version not decided");
      if (!WaitFor(s_, context, decided)) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "version not decided before the deadline");
      }
      if (!request.latest() && s_->version > want) {
        v1::ErrorDetail detail;
        detail.set_version(s_->version);
        return WithDetail(context, grpc::StatusCode::FAILED_PRECONDITION, "version no longer kept", detail);
      }
      version = request.latest() ? s_->version : want;
      unchanged = !request.latest() && s_->version < want;  // step want-1 was skipped
      if (unchanged) version = s_->version;
      layout = s_->layout;
      master = s_->master[request.bucket()];
    }
    if (unchanged) {
      v1::PullParamsResponse m;
      m.mutable_header()->set_version(version);
      m.mutable_header()->set_unchanged(true);
      write(m);
      return grpc::Status::OK;
    }
    absl::StatusOr<std::vector<v1::PullParamsResponse>> stream =
        MakePullStream(*layout, request.bucket(), request.shard(), version, master, request.max_chunk_bytes());
    if (!stream.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(stream.status().message()));
    for (const v1::PullParamsResponse& m : *stream) {
      if (!write(m)) return Invalid("the destination is not the shard's packed data");
    }
    return grpc::Status::OK;
  }

  // A push header's own checks, before any payload moves.
  grpc::Status CheckHeader(grpc::ServerContext* context, const v1::PushGradHeader& h, int64_t shard_numel) {
    {
      absl::MutexLock lock(&s_->mu);
      if (h.kind() == v1::PUSH_KIND_GRADIENT && h.step() <= s_->committed_step) {
        v1::ErrorDetail detail;
        detail.set_committed_step(s_->committed_step);
        return WithDetail(context, grpc::StatusCode::FAILED_PRECONDITION, "step already committed", detail);
      }
    }
    if (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS && (h.step() != -1 || h.dtype() != v1::ELEMENT_TYPE_FP32)) {
      return Invalid("initial parameters need step -1 and fp32");
    }
    if (h.kind() == v1::PUSH_KIND_GRADIENT && h.step() < 0) return Invalid("negative step");
    if (h.dtype() != v1::ELEMENT_TYPE_FP32 && h.dtype() != v1::ELEMENT_TYPE_BF16 &&
        h.dtype() != v1::ELEMENT_TYPE_FP16) {
      return Invalid("bad dtype");
    }
    const int elem = h.dtype() == v1::ELEMENT_TYPE_FP32 ? 4 : 2;
    if (h.total_bytes() != shard_numel * elem) return Invalid("wrong total_bytes");
    return grpc::Status::OK;
  }

  // Stores a checked push's whole payload. `stream_chunk`: a PushGrad stream's largest chunk (the
  // stream is counted), -1 for a cuda_ipc push.
  grpc::Status Store(const v1::PushGradHeader& h, const std::string& payload, int64_t shard_numel,
                     v1::PushGradResponse* response, int64_t stream_chunk) {
    const int elem = h.dtype() == v1::ELEMENT_TYPE_FP32 ? 4 : 2;
    if (h.crc32c() != 0 && ::mainstay::Crc32c(payload.data(), payload.size()) != h.crc32c()) {
      absl::MutexLock lock(&s_->mu);
      ++s_->stats.wrong_crc;
      return grpc::Status(grpc::StatusCode::DATA_LOSS, "crc32c mismatch");
    }
    std::vector<float> values(shard_numel);
    for (int64_t i = 0; i < shard_numel; ++i) {
      if (elem == 4) {
        std::memcpy(&values[i], payload.data() + 4 * i, 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, payload.data() + 2 * i, 2);
        values[i] = h.dtype() == v1::ELEMENT_TYPE_BF16 ? kernels::Bf16ToFloat(bits) : kernels::Fp16ToFloat(bits);
      }
      if (h.loss_scale() > 0) values[i] = static_cast<float>(values[i] / h.loss_scale());
    }
    absl::MutexLock lock(&s_->mu);
    if (stream_chunk >= 0) {
      ++s_->stats.push_streams;
      s_->stats.max_chunk_bytes = std::max(s_->stats.max_chunk_bytes, stream_chunk);
    }
    response->set_received_elements(shard_numel);
    if (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS) {
      if (s_->version >= 1) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "already trained");
      std::copy(values.begin(), values.end(), s_->master[h.bucket()].begin() + h.shard() * shard_numel);
      s_->initial.insert({h.bucket(), h.shard()});
      const size_t all = s_->layout->buckets.size() * s_->layout->data_parallel_size;
      if (s_->initial.size() == all && s_->version < 0) s_->version = 0;
      s_->changed.SignalAll();
      response->set_contributions(1);
      return grpc::Status::OK;
    }
    const GradKey key{h.step(), h.bucket(), h.shard()};
    auto& by_rank = s_->grads[key];
    if (by_rank.count(h.rank())) {
      ++s_->stats.duplicate_pushes;
      response->set_duplicate(true);
    } else {
      by_rank[h.rank()] = std::move(values);
      s_->contributors[key] = std::max(1, h.num_contributors());
    }
    response->set_contributions(static_cast<int32_t>(by_rank.size()));
    s_->TryCommit();
    return grpc::Status::OK;
  }

  FakeCluster::State* s_;
  const int index_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeFakeDaemon(FakeCluster::State* state, int index) {
  return std::make_unique<FakeDaemon>(state, index);
}

}  // namespace mainstay::testing_fakes

#include "client/src/testing/fake_services.h"
#include "client/src/testing/fake_state.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/byte_patch.h"
#include "common/chunk_hash.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "kernels/casts.h"
#include "kernels/kernels.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"

namespace mainstay::testing_fakes {
namespace {

struct QuantizedTensor {
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;  // the whole compact grid
  float scale = 0, scale_inv = 0, amax = 0;
};

absl::StatusOr<QuantizedTensor> QuantizeWhole(const LayoutTensor& t, std::span<const float> values) {
  const Format f = t.format;
  const FormatDescriptor& d = Describe(f);
  const Matrix2D view = View2D(t.shape);
  const kernels::Fragment frag{view, {0, t.numel}};
  const IndexRange blocks = ScaleBlockRange(f, view, frag.elements);
  std::vector<float> block_amax(blocks.size());
  float tensor_amax = 0;
  MAINSTAY_RETURN_IF_ERROR(kernels::ComputePartialAmax(kernels::Device{}, f, Format::kBF16, frag, values,
                                                       {&tensor_amax, std::span<float>(block_amax)}));
  QuantizedTensor q;
  q.data.resize(DataBytes(f, t.numel));
  q.scales.resize(d.has_block_scales() ? blocks.size() * BitsOf(d.block_scale) / 8 : 0);
  kernels::ScaleInputs in;
  in.tensor_scale = 1.0f;
  in.tensor_amax = tensor_amax;
  in.block_amax = block_amax;
  MAINSTAY_RETURN_IF_ERROR(kernels::Quantize(kernels::Device{}, f, Format::kBF16, frag, values, in,
                                             {q.data, q.scales, &q.scale_inv}));
  if (d.tensor_scale) {
    q.scale = d.scaling == ScalingMode::kDelayed ? 1.0f : 1.0f / q.scale_inv;
    q.amax = tensor_amax;
  } else {
    q.scale_inv = 0;
  }
  return q;
}


}  // namespace

absl::StatusOr<std::vector<v1::PullParamsResponse>> MakePullStream(const Layout& layout, int32_t bucket,
                                                                   int32_t shard, int64_t version,
                                                                   std::span<const float> master,
                                                                   int64_t max_chunk_bytes) {
  const Bucket& b = layout.buckets.at(bucket);
  const Shard& sh = b.shards.at(shard);
  const Format f = b.format;
  const FormatDescriptor& d = Describe(f);
  const int entry = d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
  if (max_chunk_bytes <= 0) max_chunk_bytes = 1 << 20;
  std::vector<uint8_t> data(DataBytes(f, b.shard_numel), 0);
  std::vector<uint8_t> scales;
  v1::PullParamsResponse first;
  v1::PullParamsHeader* h = first.mutable_header();
  std::map<int32_t, QuantizedTensor> cache;
  for (const TensorFragment& frag : sh.fragments) {
    const LayoutTensor& t = layout.tensors[frag.tensor];
    if (!cache.count(frag.tensor)) {
      MAINSTAY_ASSIGN_OR_RETURN(cache[frag.tensor], QuantizeWhole(t, master.subspan(t.bucket_offset, t.numel)));
    }
    const QuantizedTensor& q = cache[frag.tensor];
    const int64_t src = DataBytes(f, frag.elements.begin);
    std::memcpy(data.data() + DataBytes(f, frag.bucket_offset - sh.elements.begin), q.data.data() + src,
                DataBytes(f, frag.elements.end) - src);
    const IndexRange r = FragmentScaleBlocks(layout, frag);
    scales.insert(scales.end(), q.scales.begin() + r.begin * entry, q.scales.begin() + r.end * entry);
    v1::FragmentQuantization* fq = h->add_fragments();
    fq->set_tensor(frag.tensor);
    fq->mutable_elements()->set_begin(frag.elements.begin);
    fq->mutable_elements()->set_end(frag.elements.end);
    fq->set_format(FormatToProto(t.format));
    fq->set_scale(q.scale);
    fq->set_scale_inv(q.scale_inv);
    fq->set_amax(q.amax);
  }
  h->set_version(version);
  h->set_format(FormatToProto(f));
  h->mutable_elements()->set_begin(sh.elements.begin);
  h->mutable_elements()->set_end(sh.elements.end);
  h->set_total_data_bytes(static_cast<int64_t>(data.size()));
  h->set_scale_type(d.has_block_scales() ? ElementTypeToProto(d.block_scale) : v1::ELEMENT_TYPE_UNSPECIFIED);
  h->set_total_scales(entry ? static_cast<int64_t>(scales.size()) / entry : 0);
  h->set_total_scale_bytes(static_cast<int64_t>(scales.size()));
  h->set_data_crc32c(::mainstay::Crc32c(data.data(), data.size()));
  std::vector<v1::PullParamsResponse> out{first};
  const int64_t chunk_elements = std::max<int64_t>(2, (max_chunk_bytes * 8 / d.bits_per_element) / 2 * 2);
  for (int64_t e = 0; e < b.shard_numel; e += chunk_elements) {
    const int64_t n = std::min(chunk_elements, b.shard_numel - e);
    v1::PullParamsResponse m;
    m.mutable_data()->set_element_offset(e);
    m.mutable_data()->set_data(data.data() + DataBytes(f, e), DataBytes(f, e + n) - DataBytes(f, e));
    out.push_back(std::move(m));
  }
  const int64_t total_scales = entry ? static_cast<int64_t>(scales.size()) / entry : 0;
  const int64_t chunk_scales = entry ? std::max<int64_t>(1, max_chunk_bytes / entry) : 1;
  for (int64_t s = 0; s < total_scales; s += chunk_scales) {
    const int64_t n = std::min(chunk_scales, total_scales - s);
    v1::PullParamsResponse m;
    m.mutable_scales()->set_scale_offset(s);
    m.mutable_scales()->set_data(scales.data() + s * entry, n * entry);
    out.push_back(std::move(m));
  }
  return out;
}

namespace {

class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  explicit FakeCoordinator(FakeCluster::State* s) : s_(s) {}

  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest* request,
                         v1::CreateJobResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    if (s_->create_unavailable_left > 0) {
      --s_->create_unavailable_left;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake coordinator: too few daemons");
    }
    if (s_->layout != nullptr) {
      if (!request->request_id().empty() && request->request_id() == s_->request_id) {
        response->set_job_id(s_->job_id);
        response->set_job_token(s_->job_token);
        return grpc::Status::OK;
      }
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "fake coordinator holds one job");
    }
    absl::StatusOr<JobSpec> spec = JobSpecFromProto(request->spec());
    if (!spec.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(spec.status().message()));
    absl::StatusOr<ResolvedJob> job = ResolveJob(*spec);
    if (!job.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(job.status().message()));
    s_->layout = std::make_shared<const Layout>(job->layout);
    s_->job_id = "job-1";
    s_->job_token = "token-of-job-1";
    s_->request_id = request->request_id();
    s_->epoch = 1;
    const int64_t d = s_->layout->data_parallel_size;
    s_->owners.assign(s_->layout->buckets.size() * d, 0);
    for (size_t i = 0; i < s_->owners.size(); ++i) s_->owners[i] = static_cast<int>((i % d) % s_->options.num_daemons);
    for (const Bucket& b : s_->layout->buckets) s_->master.emplace_back(b.numel, 0.0f);
    response->set_job_id(s_->job_id);
    response->set_job_token(s_->job_token);
    return grpc::Status::OK;
  }

  grpc::Status GetLayout(grpc::ServerContext*, const v1::GetLayoutRequest* request,
                         v1::GetLayoutResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    if (s_->layout == nullptr || request->job_id() != s_->job_id) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no job");
    if (request->job_token() != s_->job_token) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad token");
    LayoutToProto(*s_->layout, response->mutable_layout());
    response->set_version(std::max<int64_t>(0, s_->version));
    return grpc::Status::OK;
  }

  grpc::Status GetPlacement(grpc::ServerContext*, const v1::GetPlacementRequest* request,
                            v1::GetPlacementResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    if (s_->layout == nullptr || request->job_id() != s_->job_id) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no job");
    if (request->job_token() != s_->job_token) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad token");
    v1::Placement* p = response->mutable_placement();
    p->set_job_id(s_->job_id);
    p->set_epoch(s_->epoch);
    const int64_t d = s_->layout->data_parallel_size;
    for (size_t i = 0; i < s_->owners.size(); ++i) {
      v1::ShardPlacement* sp = p->add_shards();
      sp->mutable_shard()->set_bucket(static_cast<int32_t>(i / d));
      sp->mutable_shard()->set_shard(static_cast<int32_t>(i % d));
      sp->set_daemon_id(absl::StrCat("daemon-", s_->owners[i]));
    }
    for (size_t i = 0; i < s_->daemon_addresses.size(); ++i) {
      v1::DaemonEndpoint* e = p->add_daemons();
      e->set_daemon_id(absl::StrCat("daemon-", i));
      e->set_address(s_->daemon_addresses[i]);
      e->set_node_name("localhost");
      e->add_transports(v1::TRANSPORT_GRPC);
      if (s_->options.offer_cuda_ipc) e->add_transports(v1::TRANSPORT_CUDA_IPC);
      e->set_takes_crc32c_trailer(s_->options.take_crc32c_trailers);
    }
    return grpc::Status::OK;
  }

 private:
  FakeCluster::State* s_;
};

class FakeAdmin final : public v1::Admin::Service {
 public:
  explicit FakeAdmin(FakeCluster::State* s) : s_(s) {}

  grpc::Status CreateCheckpoint(grpc::ServerContext*, const v1::CreateCheckpointRequest* request,
                                v1::CreateCheckpointResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    if (request->admin_token() != s_->options.admin_token) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "fake admin: wrong admin token");
    }
    if (s_->layout == nullptr || request->job_id() != s_->job_id) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no job");
    if (s_->version < 0) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "fake admin: no version yet");
    const std::string id = absl::StrCat("ckpt-", s_->checkpoints.size() + 1);
    s_->checkpoints[id] = {s_->master, s_->version, s_->committed_step};
    v1::CheckpointInfo* info = response->mutable_checkpoint();
    info->set_checkpoint_id(id);
    info->set_job_id(s_->job_id);
    info->set_version(s_->version);
    info->set_state(request->wait() ? v1::CHECKPOINT_STATE_COMMITTED : v1::CHECKPOINT_STATE_WRITING);
    info->set_manifest_uri(absl::StrCat("mem://", id));
    return grpc::Status::OK;
  }

  grpc::Status RestoreCheckpoint(grpc::ServerContext*, const v1::RestoreCheckpointRequest* request,
                                 v1::RestoreCheckpointResponse* response) override {
    absl::MutexLock lock(&s_->mu);
    if (request->admin_token() != s_->options.admin_token) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "fake admin: wrong admin token");
    }
    if (s_->layout == nullptr || request->job_id() != s_->job_id) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no job");
    auto it = s_->checkpoints.find(request->checkpoint_id());
    if (it == s_->checkpoints.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "fake admin: no such checkpoint");
    s_->master = it->second.master;
    s_->version = it->second.version;
    s_->committed_step = it->second.committed_step;
    s_->grads.clear();
    s_->contributors.clear();
    s_->finished.clear();
    s_->results.erase(s_->results.upper_bound(s_->committed_step), s_->results.end());
    ++s_->epoch;
    s_->changed.SignalAll();
    response->set_version(s_->version);
    response->set_placement_epoch(s_->epoch);
    return grpc::Status::OK;
  }

 private:
  FakeCluster::State* s_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<FakeCluster>> FakeCluster::Start(const FakeClusterOptions& options) {
  std::unique_ptr<FakeCluster> cluster(new FakeCluster());
  cluster->state_ = std::make_shared<State>();
  State* s = cluster->state_.get();
  s->options = options;
  {
    absl::MutexLock lock(&s->mu);
    s->unavailable_left = options.unavailable_calls;
    s->create_unavailable_left = options.create_job_unavailable;
  }
  auto serve = [&](grpc::Service* service, grpc::Service* second = nullptr) -> absl::StatusOr<std::string> {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(service);
    if (second != nullptr) builder.RegisterService(second);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr || port == 0) return absl::UnavailableError("fake cluster: cannot start a server");
    s->servers.push_back(std::move(server));
    return absl::StrCat("127.0.0.1:", port);
  };
  for (int i = 0; i < options.num_daemons; ++i) {
    s->services.push_back(MakeFakeDaemon(s, i));
    MAINSTAY_ASSIGN_OR_RETURN(std::string address, serve(s->services.back().get()));
    s->daemon_addresses.push_back(address);
  }
  s->services.push_back(std::make_unique<FakeCoordinator>(s));
  grpc::Service* coordinator = s->services.back().get();
  grpc::Service* admin = nullptr;
  if (options.serve_admin) {
    s->services.push_back(std::make_unique<FakeAdmin>(s));
    admin = s->services.back().get();
  }
  MAINSTAY_ASSIGN_OR_RETURN(s->coordinator_address, serve(coordinator, admin));
  return cluster;
}

FakeCluster::~FakeCluster() {
  for (auto& server : state_->servers) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

std::string FakeCluster::coordinator_address() const { return state_->coordinator_address; }
std::vector<std::string> FakeCluster::daemon_addresses() const { return state_->daemon_addresses; }
std::string FakeCluster::job_id() const {
  absl::MutexLock lock(&state_->mu);
  return state_->job_id;
}
std::string FakeCluster::job_token() const {
  absl::MutexLock lock(&state_->mu);
  return state_->job_token;
}
void FakeCluster::MoveShard(int32_t bucket, int32_t shard, int daemon) {
  absl::MutexLock lock(&state_->mu);
  state_->owners[bucket * state_->layout->data_parallel_size + shard] = daemon;
  ++state_->epoch;
}
void FakeCluster::FailNextCalls(int calls, grpc::StatusCode code) {
  absl::MutexLock lock(&state_->mu);
  state_->unavailable_left = calls;
  state_->unavailable_code = code;
}
void FakeCluster::GiveUpStep(int64_t step, bool then_commit) {
  absl::MutexLock lock(&state_->mu);
  state_->give_up_step = step;
  state_->give_up_then_commit = then_commit;
}
void FakeCluster::FenceNextFinishes(int calls) {
  absl::MutexLock lock(&state_->mu);
  state_->fenced_finishes_left = calls;
}
void FakeCluster::FailNextStatsReads(int calls) {
  absl::MutexLock lock(&state_->mu);
  state_->stats_unavailable_left = calls;
}
int FakeCluster::GivenUp(int64_t step) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->given_up.find(step);
  return it == state_->given_up.end() ? 0 : it->second;
}
std::vector<float> FakeCluster::Master(int32_t bucket) const {
  absl::MutexLock lock(&state_->mu);
  return state_->master.at(bucket);
}
int64_t FakeCluster::version() const {
  absl::MutexLock lock(&state_->mu);
  return state_->version;
}
FakeStats FakeCluster::stats() const {
  absl::MutexLock lock(&state_->mu);
  return state_->stats;
}

void ForEachDeltaChunk(std::span<const uint8_t> was, std::span<const uint8_t> now, int64_t chunk, bool patches,
                       google::protobuf::RepeatedField<int32_t>* listed,
                       const std::function<void(int64_t begin, std::string data, std::string patch)>& add) {
  const auto size = static_cast<int64_t>(now.size());
  for (int64_t i = 0; i < ChunkCount(size, chunk); ++i) {
    const int64_t begin = i * chunk;
    const auto n = static_cast<size_t>(std::min(chunk, size - begin));
    const std::span<const uint8_t> w = was.subspan(static_cast<size_t>(begin), n);
    const std::span<const uint8_t> c = now.subspan(static_cast<size_t>(begin), n);
    if (std::equal(w.begin(), w.end(), c.begin())) continue;
    listed->Add(static_cast<int32_t>(i));
    std::optional<std::string> patch = patches ? EncodeBytePatch(w, c, n) : std::nullopt;
    if (patch.has_value()) {
      add(begin, std::string(), *std::move(patch));
    } else {
      add(begin, std::string(c.begin(), c.end()), std::string());
    }
  }
}

}  // namespace mainstay::testing_fakes

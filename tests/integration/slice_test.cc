// The vertical slice end to end: the real mainstay-coordinator and mainstayd binaries on
// 127.0.0.1:0, trainers as threads of this process using the public client library
// (libmainstay_client), each with its own Client. After N steps the daemons' masters (read
// with the Shard service's FetchShardState) equal the unsharded reference run with the same
// kernels BIT FOR BIT (tolerance 0: no clipping; the update is elementwise and the unreduced
// sums are in rank order on both sides), and the published bytes and scales equal quantizing
// the reference masters whole.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/src/transport.h"
#include "common/grpc_status.h"
#include "common/job_spec.h"
#include "common/recipe.h"
#include "common/status.h"
#include "mainstay/client.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::BinaryPath;
using ::mainstay::testing::GradValue;
using ::mainstay::testing::InitialValue;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::ReferenceModel;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;

constexpr absl::Duration kStartTimeout = absl::Seconds(60);

// A coordinator and `daemons` daemons on loopback, each a real process (the programs built with
// this test, or MAINSTAY_COORDINATOR_BIN / MAINSTAYD_BIN where set: the GPU check's bundle).
class LocalCluster {
 public:
  static std::unique_ptr<LocalCluster> Start(int daemons) {
    auto c = std::unique_ptr<LocalCluster>(new LocalCluster());
    c->dir_ = *TempDir::Create("mainstay-slice");
    auto coordinator =
        Subprocess::Start({{BinaryPath("MAINSTAY_COORDINATOR_BIN", MAINSTAY_COORDINATOR_BIN), "--listen", "127.0.0.1:0",
                            "--state-dir", c->dir_->File("state"), "--port-file", c->dir_->File("cport")},
                           c->dir_->File("coordinator.log")});
    EXPECT_THAT(coordinator.status(), IsOk());
    c->coordinator_ = *std::move(coordinator);
    absl::StatusOr<int> port = testing::WaitForPortFile(c->dir_->File("cport"), *c->coordinator_, kStartTimeout);
    EXPECT_THAT(port.status(), IsOk());
    c->address_ = absl::StrCat("127.0.0.1:", *port);
    for (int i = 0; i < daemons; ++i) {
      const std::string port_file = c->dir_->File(absl::StrCat("dport", i));
      std::vector<std::string> argv = {BinaryPath("MAINSTAYD_BIN", MAINSTAYD_BIN),
                                       "--coordinator", c->address_, "--listen", "127.0.0.1:0",
                                       "--node-name", absl::StrCat("node", i), "--threads", "1", "--metrics-listen", "off",
                                       "--memory-bytes", "4000000000", "--peer-timeout-ms", "20000", "--port-file", port_file};
      // E.g. "--ucx-dedicated-workers none --ucx-shared-workers 1" (CTest's slice_test_ucx_tcp_shared),
      // "--device cpu-staged" (slice_test_cpu_staged), "--device cuda:0" (the GPU check).
      if (const char* extra = std::getenv("MAINSTAY_TEST_DAEMON_FLAGS"); extra != nullptr) {
        for (absl::string_view flag : absl::StrSplit(extra, ' ', absl::SkipEmpty())) argv.emplace_back(flag);
      }
      auto d = Subprocess::Start({argv, c->dir_->File(absl::StrCat("daemon", i, ".log"))});
      EXPECT_THAT(d.status(), IsOk());
      c->daemons_.push_back(*std::move(d));
      EXPECT_THAT(testing::WaitForPortFile(port_file, *c->daemons_.back(), kStartTimeout).status(), IsOk());
    }
    return c;
  }

  const std::string& address() const { return address_; }
  std::string Logs() const {
    std::string out = "--- coordinator\n" + ReadFileOrEmpty(dir_->File("coordinator.log"));
    for (size_t i = 0; i < daemons_.size(); ++i) {
      out += absl::StrCat("--- daemon ", i, "\n", ReadFileOrEmpty(dir_->File(absl::StrCat("daemon", i, ".log"))));
    }
    return out;
  }

 private:
  LocalCluster() = default;
  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::vector<std::unique_ptr<Subprocess>> daemons_;
  std::string address_;
};

std::string SpecJson(const std::string& recipe, const std::string& policy, int64_t d, const std::string& name) {
  JobSpec spec;
  spec.name = name;
  spec.recipe = recipe;
  spec.data_parallel_size = d;
  spec.layout_policy = policy == "whole_tensor" ? LayoutPolicy::kWholeTensor : LayoutPolicy::kFlat;
  spec.bucket_numel = 16384;
  spec.optimizer.max_grad_norm = 0.0f;  // no clipping: bit-exact comparison (see the file comment)
  spec.optimizer.weight_decay = 0.0f;
  spec.tensors = testing::TestTensors();
  spec.unreduced_pushes = true;  // the unreduced cases push whole buckets
  return JobSpecToJson(spec);
}

float Lr(int64_t step) { return 1e-3f * static_cast<float>(step + 1); }

// Fills a bucket buffer with value(tensor, element) for every tensor of the bucket.
template <typename Fn>
std::vector<float> BucketValues(const Layout& layout, int32_t bucket, Fn value) {
  std::vector<float> out = *MakeBucketBuffer(layout, bucket);
  for (int32_t t : layout.buckets[static_cast<size_t>(bucket)].tensors) {
    const LayoutTensor& tensor = layout.tensors[static_cast<size_t>(t)];
    for (int64_t i = 0; i < tensor.numel; ++i) out[static_cast<size_t>(tensor.bucket_offset + i)] = value(t, i);
  }
  return out;
}

// One trainer rank: rank 0 pushes the initial parameters of the whole model, then every rank
// pushes each step (reduced: its shard of the reduced gradient; unreduced: its own whole
// bucket) and finishes it. Returns the stats of every step.
absl::StatusOr<std::vector<StepStats>> Train(Client& client, int steps, bool unreduced, int64_t first_step = 0) {
  const Layout& layout = client.layout();
  const int32_t rank = client.rank();
  std::vector<StepStats> all;
  if (first_step == 0 && rank == 0) {
    std::vector<PushHandle> pushes;
    std::vector<std::vector<float>> buffers;
    for (const Bucket& b : layout.buckets) {
      buffers.push_back(BucketValues(layout, b.index, [](int32_t t, int64_t i) { return InitialValue(t, i); }));
      pushes.push_back(client.PushInitialParams(b.index, buffers.back(), /*all_shards=*/true));
    }
    for (PushHandle& p : pushes) {
      MAINSTAY_RETURN_IF_ERROR(p.Wait().status());
    }
  }
  for (int64_t step = first_step; step < first_step + steps; ++step) {
    std::vector<std::vector<float>> buffers;
    buffers.reserve(layout.buckets.size());
    for (const Bucket& b : layout.buckets) {
      if (unreduced) {
        buffers.push_back(BucketValues(layout, b.index, [&](int32_t t, int64_t i) { return GradValue(t, i, step, rank); }));
        client.PushBucketUnreduced(b.index, step, ElementSpan::Fp32(buffers.back()));
      } else {
        buffers.push_back(BucketValues(layout, b.index, [&](int32_t t, int64_t i) { return GradValue(t, i, step); }));
        std::span<float> shard = *ShardSpan(layout, b.index, rank, std::span<float>(buffers.back()));
        client.PushGrad(b.index, step, ElementSpan::Fp32(shard));
      }
    }
    MAINSTAY_ASSIGN_OR_RETURN(StepStats stats, client.FinishStep(step, Lr(step), 0.0));
    all.push_back(stats);
  }
  return all;
}

// Connects `trainers` clients: rank 0 creates the job, the others attach with its token.
std::vector<std::unique_ptr<Client>> ConnectTrainers(const LocalCluster& cluster, const std::string& spec_json,
                                                     int trainers) {
  std::vector<std::unique_ptr<Client>> clients;
  ClientOptions o;
  o.coordinator = cluster.address();
  o.job_spec_json = spec_json;
  o.rank = 0;
  absl::StatusOr<std::unique_ptr<Client>> first = Client::Connect(o);
  EXPECT_THAT(first.status(), IsOk());
  if (!first.ok()) return clients;
  clients.push_back(*std::move(first));
  for (int r = 1; r < trainers; ++r) {
    ClientOptions a;
    a.coordinator = cluster.address();
    a.job_id = clients[0]->job_id();
    a.job_token = clients[0]->job_token();
    a.rank = r;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(a);
    EXPECT_THAT(c.status(), IsOk());
    if (c.ok()) clients.push_back(*std::move(c));
  }
  return clients;
}

// Runs every trainer on its own thread.
std::vector<absl::StatusOr<std::vector<StepStats>>> TrainAll(std::vector<std::unique_ptr<Client>>& clients, int steps,
                                                             bool unreduced, int64_t first_step = 0) {
  std::vector<absl::StatusOr<std::vector<StepStats>>> results(clients.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t r = 0; r < clients.size(); ++r) {
    threads.emplace_back([&, r] { results[r] = Train(*clients[r], steps, unreduced, first_step); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// The masters of one shard, through the daemon's FetchShardState.
absl::StatusOr<std::vector<float>> FetchMasters(const Client& client, int32_t bucket, int32_t shard) {
  const JobPlacement placement = client.placement();
  std::string daemon_id, address;
  for (const ShardOwner& o : placement.shards) {
    if (o.bucket == bucket && o.shard == shard) daemon_id = o.daemon_id;
  }
  for (const DaemonAddress& d : placement.daemons) {
    if (d.daemon_id == daemon_id) address = d.address;
  }
  auto stub = v1::Shard::NewStub(::grpc::CreateChannel(address, ::grpc::InsecureChannelCredentials()));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::FetchShardStateRequest request;
  request.set_job_id(client.job_id());
  request.mutable_shard()->set_bucket(bucket);
  request.mutable_shard()->set_shard(shard);
  auto reader = stub->FetchShardState(&context, request);
  v1::FetchShardStateResponse message;
  std::vector<float> master;
  while (reader->Read(&message)) {
    if (message.has_header()) master.assign(static_cast<size_t>(message.header().shard_numel()), 0.0f);
    if (message.has_chunk() && message.chunk().buffer() == v1::STATE_BUFFER_MASTER) {
      std::memcpy(master.data() + message.chunk().element_offset(), message.chunk().data().data(),
                  message.chunk().data().size());
    }
  }
  MAINSTAY_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  return master;
}

// Pulls `version` of every bucket and checks data, scales and masters against `ref`.
void ExpectMatchesReference(const Client& client, ReferenceModel& ref, int64_t version) {
  const Layout& layout = client.layout();
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    std::vector<uint8_t> data, scales;
    ref.Quantize(t, data, scales);
    const LayoutTensor& tensor = layout.tensors[t];
    absl::StatusOr<PulledBucket> pulled =
        const_cast<Client&>(client).PullBucket(tensor.bucket, version).Wait();
    ASSERT_THAT(pulled.status(), IsOk());
    ASSERT_EQ(pulled->version(), version);
    absl::StatusOr<TensorView> view = pulled->Tensor(static_cast<int32_t>(t));
    ASSERT_THAT(view.status(), IsOk());
    ASSERT_EQ(view->data.size(), data.size());
    EXPECT_EQ(0, std::memcmp(view->data.data(), data.data(), data.size())) << tensor.name << " data, v" << version;
    if (!scales.empty()) {
      absl::StatusOr<std::vector<uint8_t>> grid = pulled->TensorScaleGrid(static_cast<int32_t>(t));
      ASSERT_THAT(grid.status(), IsOk());
      EXPECT_EQ(*grid, scales) << tensor.name << " scales, v" << version;
    }
  }
  for (const Bucket& b : layout.buckets) {
    for (const Shard& s : b.shards) {
      absl::StatusOr<std::vector<float>> master = FetchMasters(client, b.index, s.rank);
      ASSERT_THAT(master.status(), IsOk());
      for (const TensorFragment& f : s.fragments) {
        EXPECT_EQ(0, std::memcmp(master->data() + (f.bucket_offset - s.elements.begin),
                                 ref.master(static_cast<size_t>(f.tensor)).data() + f.elements.begin,
                                 static_cast<size_t>(f.elements.size()) * 4))
            << "master of " << layout.tensors[static_cast<size_t>(f.tensor)].name << " in bucket " << b.index
            << " shard " << s.rank;
      }
    }
  }
}

// ---- 2 daemons x 2 trainers, every recipe, both policies (one cluster for all of them).

struct RecipeCase {
  std::string recipe;
  std::string policy;
};

class EveryRecipeTest : public ::testing::TestWithParam<RecipeCase> {
 protected:
  static void SetUpTestSuite() { cluster_ = LocalCluster::Start(2).release(); }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static LocalCluster* cluster_;
};
LocalCluster* EveryRecipeTest::cluster_ = nullptr;

TEST_P(EveryRecipeTest, MastersAndPublishedBytesEqualTheUnshardedReference) {
  const RecipeCase& p = GetParam();
  constexpr int kSteps = 3;
  const std::string spec = SpecJson(p.recipe, p.policy, 2, absl::StrCat(p.recipe, "-", p.policy));
  std::vector<std::unique_ptr<Client>> clients = ConnectTrainers(*cluster_, spec, 2);
  ASSERT_EQ(clients.size(), 2u);
  for (const auto& result : TrainAll(clients, kSteps, /*unreduced=*/false)) {
    ASSERT_THAT(result.status(), IsOk()) << cluster_->Logs();
    for (size_t s = 0; s < result->size(); ++s) EXPECT_EQ((*result)[s].version, static_cast<int64_t>(s) + 1);
  }
  ReferenceModel ref(*ResolveJob(*ParseJobSpecJson(spec)));
  std::vector<uint8_t> ignored_data, ignored_scales;
  for (int64_t v = 0; v < kSteps; ++v) {  // bring the delayed-scaling history to version kSteps
    for (size_t t = 0; t < clients[0]->layout().tensors.size(); ++t) ref.Quantize(t, ignored_data, ignored_scales);
    ref.Step(v, Lr(v));
  }
  ExpectMatchesReference(*clients[0], ref, kSteps);
}

std::vector<RecipeCase> AllRecipes() {
  std::vector<RecipeCase> cases;
  for (absl::string_view name : RecipeNames()) {
    cases.push_back({std::string(name), "flat"});
    cases.push_back({std::string(name), "whole_tensor"});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Slice, EveryRecipeTest, ::testing::ValuesIn(AllRecipes()),
                         [](const ::testing::TestParamInfo<RecipeCase>& info) {
                           return absl::StrCat(info.param.recipe, "_", info.param.policy);
                         });

// ---- 1 to 4 trainers with 1 to 3 daemons; unreduced pushes summed by the daemons.

struct ShapeCase {
  int trainers;
  int daemons;
  bool unreduced;
};

class ClusterShapeTest : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(ClusterShapeTest, TensorsStraddlingDaemonsStepExactly) {
  const ShapeCase& p = GetParam();
  std::unique_ptr<LocalCluster> cluster = LocalCluster::Start(p.daemons);
  const std::string spec = SpecJson("bf16_with_nvfp4_mixed", "flat", p.trainers, "shape");
  std::vector<std::unique_ptr<Client>> clients = ConnectTrainers(*cluster, spec, p.trainers);
  ASSERT_EQ(clients.size(), static_cast<size_t>(p.trainers));
  constexpr int kSteps = 2;
  for (const auto& result : TrainAll(clients, kSteps, p.unreduced)) ASSERT_THAT(result.status(), IsOk()) << cluster->Logs();
  ReferenceModel ref(*ResolveJob(*ParseJobSpecJson(spec)));
  std::vector<uint8_t> data, scales;
  for (int64_t v = 0; v < kSteps; ++v) ref.Step(v, Lr(v), 0.0f, p.unreduced ? p.trainers : 0);
  ExpectMatchesReference(*clients[0], ref, kSteps);
}

INSTANTIATE_TEST_SUITE_P(Slice, ClusterShapeTest,
                         ::testing::Values(ShapeCase{1, 1, false}, ShapeCase{2, 3, false}, ShapeCase{3, 2, true},
                                           ShapeCase{4, 3, true}, ShapeCase{4, 1, false}),
                         [](const ::testing::TestParamInfo<ShapeCase>& info) {
                           return absl::StrCat(info.param.trainers, "trainers_", info.param.daemons, "daemons_",
                                               info.param.unreduced ? "unreduced" : "reduced");
                         });

// ---- Protocol behaviour through the public interfaces.

class SliceProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = LocalCluster::Start(2);
    clients_ = ConnectTrainers(*cluster_, SpecJson("bf16_with_fp8_current_scaling_mixed", "flat", 2, "protocol"), 2);
    ASSERT_EQ(clients_.size(), 2u);
    for (const auto& r : TrainAll(clients_, 1, false)) ASSERT_THAT(r.status(), IsOk()) << cluster_->Logs();
  }
  // The job's placement as the coordinator serves it.
  absl::StatusOr<v1::Placement> Placement() {
    auto coordinator =
        v1::Coordinator::NewStub(::grpc::CreateChannel(cluster_->address(), ::grpc::InsecureChannelCredentials()));
    v1::GetPlacementRequest get;
    get.set_job_id(clients_[0]->job_id());
    get.set_job_token(clients_[0]->job_token());
    v1::GetPlacementResponse placement;
    ::grpc::ClientContext context;
    MAINSTAY_RETURN_IF_ERROR(FromGrpcStatus(coordinator->GetPlacement(&context, get, &placement)));
    return placement.placement();
  }
  std::unique_ptr<LocalCluster> cluster_;
  std::vector<std::unique_ptr<Client>> clients_;
};

// mainstayd registers that it takes a push's CRC-32C in a trailer, and the coordinator passes
// that on in the placement: the trainers in these tests send trailers to it (docs/transports.md).
TEST_F(SliceProtocolTest, ThePlacementSaysRealDaemonsTakeCrcTrailers) {
  absl::StatusOr<v1::Placement> placement = Placement();
  ASSERT_THAT(placement.status(), IsOk());
  ASSERT_GT(placement->daemons_size(), 0);
  for (const v1::DaemonEndpoint& d : placement->daemons()) {
    EXPECT_TRUE(d.takes_crc32c_trailer()) << d.daemon_id();
  }
}

TEST_F(SliceProtocolTest, AUcxHelloWithoutTheJobsTokenGetsNoConnectionAndNoAnswer) {
  // Issue 18, item 5: the daemon checks the hello's job token on its progress thread, before
  // any thread, worker or endpoint is spent on it; only a trainer of a job it holds is answered.
  const char* transport = std::getenv("MAINSTAY_TRANSPORT");
  if (transport == nullptr || std::string(transport) != "ucx") GTEST_SKIP() << "a UCX test (slice_test_ucx_*)";
  absl::StatusOr<v1::Placement> placement = Placement();
  ASSERT_THAT(placement.status(), IsOk());
  ASSERT_GT(placement->daemons_size(), 0);
  const v1::DaemonEndpoint& daemon = placement->daemons(0);
  ASSERT_FALSE(daemon.ucx_worker_address().empty());
  auto attach = [&](const std::string& job_id, const std::string& token, absl::Duration within) {
    client_internal::TransportContext c;
    c.job_id = job_id;
    c.job_token = token;
    absl::StatusOr<std::unique_ptr<client_internal::DataTransport>> t = client_internal::MakeUcxTransport(c);
    EXPECT_THAT(t.status(), IsOk());
    return (*t)->Attach(daemon, absl::ToChronoTime(absl::Now() + within));
  };
  absl::Time start = absl::Now();
  EXPECT_THAT(attach(clients_[0]->job_id(), "not-the-token", absl::Seconds(2)),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("hello")));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900)) << "a hello with a wrong token must get no answer";
  start = absl::Now();
  EXPECT_THAT(attach(clients_[0]->job_id(), "", absl::Seconds(2)), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900)) << "a hello without a token must get no answer";
  // A job the daemon does not hold (yet) is refused at once; Attach asks again until its deadline.
  start = absl::Now();
  EXPECT_THAT(attach("no-such-job", "any", absl::Seconds(1)),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("has no shards on this daemon")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  const std::string logs = cluster_->Logs();
  EXPECT_THAT(logs, ::testing::HasSubstr("UCX hello(s) unanswered"));
  EXPECT_THAT(logs, ::testing::Not(::testing::HasSubstr("not-the-token")));
  // The job's own trainers still connect and train.
  EXPECT_THAT(attach(clients_[0]->job_id(), clients_[0]->job_token(), absl::Seconds(10)), IsOk()) << cluster_->Logs();
  for (const auto& r : TrainAll(clients_, 1, false, /*first_step=*/1)) ASSERT_THAT(r.status(), IsOk()) << cluster_->Logs();
}

TEST_F(SliceProtocolTest, NonFiniteGradientOnOneRankSkipsTheStepOnEveryDaemon) {
  const Layout& layout = clients_[0]->layout();
  std::vector<absl::StatusOr<StepStats>> stats(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Client& c = *clients_[static_cast<size_t>(r)];
      std::vector<std::vector<float>> buffers;
      for (const Bucket& b : layout.buckets) {
        buffers.push_back(std::vector<float>(static_cast<size_t>(b.shard_numel), 0.001f));
        if (r == 1 && b.index == 0) buffers.back()[3] = INFINITY;
        c.PushGrad(b.index, 1, ElementSpan::Fp32(buffers.back()));
      }
      stats[static_cast<size_t>(r)] = c.FinishStep(1, 1e-3, 0.0);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& s : stats) {
    ASSERT_THAT(s.status(), IsOk());
    EXPECT_TRUE(s->skipped);
    EXPECT_EQ(s->version, 1);  // not bumped
    EXPECT_EQ(s->nonfinite_count, 1);
  }
  absl::StatusOr<PulledBucket> pulled = clients_[0]->PullBucket(0, 2).Wait();
  ASSERT_THAT(pulled.status(), IsOk());
  EXPECT_TRUE(pulled->unchanged());
  EXPECT_EQ(pulled->version(), 1);
}

TEST_F(SliceProtocolTest, DuplicatePushIsAcknowledgedAndIgnored) {
  const Bucket& b = clients_[0]->layout().buckets[0];
  std::vector<float> g(static_cast<size_t>(b.shard_numel), 0.001f);
  absl::StatusOr<PushResult> first = clients_[0]->PushGrad(0, 1, ElementSpan::Fp32(g)).Wait();
  ASSERT_THAT(first.status(), IsOk());
  EXPECT_FALSE(first->duplicate);
  std::vector<float> other(g.size(), 5.0f);
  absl::StatusOr<PushResult> second = clients_[0]->PushGrad(0, 1, ElementSpan::Fp32(other)).Wait();
  ASSERT_THAT(second.status(), IsOk());
  EXPECT_TRUE(second->duplicate);
}

// Raw Shard-service pushes (the daemon's own validation, below the client library's checks).
absl::Status RawPush(const std::string& address, v1::PushGradHeader header, int64_t elements) {
  auto stub = v1::Shard::NewStub(::grpc::CreateChannel(address, ::grpc::InsecureChannelCredentials()));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  v1::PushGradResponse response;
  auto writer = stub->PushGrad(&context, &response);
  v1::PushGradRequest request;
  *request.mutable_header() = header;
  writer->Write(request);
  request.Clear();
  request.mutable_chunk()->set_element_offset(0);
  request.mutable_chunk()->set_data(std::string(static_cast<size_t>(elements) * 4, '\0'));
  writer->Write(request);
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish());
}

TEST_F(SliceProtocolTest, WrongSizeDtypeOrBucketIsRejectedWithNothingStored) {
  Client& c = *clients_[0];
  const JobPlacement placement = c.placement();
  std::string address;
  std::string owner;
  for (const ShardOwner& o : placement.shards) {
    if (o.bucket == 0 && o.shard == 0) owner = o.daemon_id;
  }
  for (const DaemonAddress& d : placement.daemons) {
    if (d.daemon_id == owner) address = d.address;
  }
  const int64_t n = c.layout().buckets[0].shard_numel;
  v1::PushGradHeader h;
  h.set_job_id(c.job_id());
  h.set_job_token(c.job_token());
  h.set_placement_epoch(placement.epoch);
  h.set_bucket(0);
  h.set_shard(0);
  h.set_step(1);
  h.set_rank(0);
  h.set_kind(v1::PUSH_KIND_GRADIENT);
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_total_bytes(n * 4 + 4);
  EXPECT_THAT(RawPush(address, h, n + 1), StatusIs(absl::StatusCode::kInvalidArgument));
  h.set_total_bytes(n * 4);
  h.set_dtype(v1::ELEMENT_TYPE_E4M3);
  EXPECT_THAT(RawPush(address, h, n), StatusIs(absl::StatusCode::kInvalidArgument));
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_bucket(999);
  EXPECT_THAT(RawPush(address, h, n), StatusIs(absl::StatusCode::kNotFound));
  h.set_bucket(0);
  h.set_job_token("not-the-token");
  EXPECT_THAT(RawPush(address, h, n), StatusIs(absl::StatusCode::kPermissionDenied));
  // Nothing was stored: the real push of step 1 is not a duplicate.
  std::vector<float> g(static_cast<size_t>(n), 0.001f);
  absl::StatusOr<PushResult> real = c.PushGrad(0, 1, ElementSpan::Fp32(g)).Wait();
  ASSERT_THAT(real.status(), IsOk());
  EXPECT_FALSE(real->duplicate);
}

TEST_F(SliceProtocolTest, PullThatCannotBeServedInTimeIsDeadlineExceeded) {
  // Version 2 needs step 1, which nobody pushes.
  absl::StatusOr<PulledBucket> pulled =
      clients_[0]->PullBucket(0, 2, std::chrono::milliseconds(500)).Wait();
  EXPECT_THAT(pulled.status(), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

}  // namespace
}  // namespace mainstay

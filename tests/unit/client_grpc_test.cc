// libmainstay_client end to end over real gRPC against the in-process fake coordinator and
// daemons (client/src/testing/fake_services.h): create/attach, both push modes, FinishStep,
// pulls, retries on UNAVAILABLE, stale placement epochs, deadlines and errors.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "client/src/cuda_driver.h"
#include "client/src/testing/fake_services.h"
#include "client/src/testing/test_specs.h"
#include "kernels/casts.h"
#include "mainstay/client.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using testing_fakes::FakeCluster;
using testing_fakes::FakeClusterOptions;

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 0.1f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

float Bf16Round(float x) { return kernels::Bf16ToFloat(kernels::FloatToBf16(x)); }

// A CUDA driver for machines without a GPU: one host range stands for device memory of device
// 1, and the CUDA work a push waits for ends when the test says (or fails).
class FakeCudaDriver : public client_internal::CudaDriver {
 public:
  FakeCudaDriver(const void* device_begin, size_t device_bytes) : begin_(device_begin), bytes_(device_bytes) {}

  std::optional<int> DeviceOf(const void* p) const override {
    const auto* b = static_cast<const char*>(begin_);
    const auto* q = static_cast<const char*>(p);
    if (q >= b && q < b + bytes_) return 1;
    return std::nullopt;
  }
  absl::StatusOr<client_internal::PendingCudaWork> Capture(std::optional<void*> stream, void* event) const override {
    if (event != nullptr) return client_internal::PendingCudaWork(event, nullptr, nullptr);
    if (!stream.has_value()) return client_internal::PendingCudaWork();
    // The "recorded event" is the release counter: its release counts.
    return client_internal::PendingCudaWork(&released_, nullptr,
                                            [](void* e) { static_cast<std::atomic<int>*>(e)->fetch_add(1); });
  }
  absl::Status Wait(client_internal::PendingCudaWork work) const override {
    if (work.empty()) return absl::OkStatus();
    ++waits_;
    finished_.WaitForNotification();
    return fail_ ? absl::InternalError("the CUDA work that produces the pushed buffer failed (fake)")
                 : absl::OkStatus();
  }

  // The fake daemons' convention (fake_services.h): the handle holds the allocation's address.
  absl::Status CanExportIpc() const override { return absl::OkStatus(); }
  absl::StatusOr<IpcRegion> ExportIpc(const void* p) const override {
    if (!DeviceOf(p).has_value()) return absl::InvalidArgumentError("not device memory");
    ++exports_;
    IpcRegion r;
    r.handle.assign(64, '\0');
    const auto base = reinterpret_cast<uintptr_t>(begin_);
    std::memcpy(r.handle.data(), &base, sizeof(base));
    r.offset = static_cast<uint64_t>(static_cast<const char*>(p) - static_cast<const char*>(begin_));
    r.allocation_bytes = bytes_;
    return r;
  }
  int exports() const { return exports_.load(); }

  void Finish(bool fail) {
    fail_ = fail;
    finished_.Notify();
  }
  int waits() const { return waits_.load(); }
  int released() const { return released_.load(); }

 private:
  const void* begin_;
  size_t bytes_;
  absl::Notification finished_;
  bool fail_ = false;
  mutable std::atomic<int> waits_{0};
  mutable std::atomic<int> released_{0};
  mutable std::atomic<int> exports_{0};
};

class ClientGrpcTest : public ::testing::Test {
 protected:
  void StartCluster(const FakeClusterOptions& options = {}) {
    auto cluster = FakeCluster::Start(options);
    ASSERT_THAT(cluster, IsOk());
    cluster_ = *std::move(cluster);
  }
  // Rank 0 creates the job; the other ranks attach with the token rank 0 got.
  void ConnectRanks(const std::string& spec, int d, ClientOptions base = {}) {
    base.coordinator = cluster_->coordinator_address();
    base.timeout = std::chrono::milliseconds(20000);
    ClientOptions create = base;
    create.job_spec_json = spec;
    auto c0 = Client::Connect(create);
    ASSERT_THAT(c0, IsOk());
    clients_.push_back(*std::move(c0));
    for (int r = 1; r < d; ++r) {
      ClientOptions attach = base;
      attach.job_id = clients_[0]->job_id();
      attach.job_token = clients_[0]->job_token();
      attach.rank = r;
      auto c = Client::Connect(attach);
      ASSERT_THAT(c, IsOk());
      clients_.push_back(*std::move(c));
    }
  }
  // Every rank pushes its own shard of `init` (whole buckets) as initial parameters.
  void PushInitial(const std::vector<std::vector<float>>& init) {
    for (auto& c : clients_) {
      for (size_t b = 0; b < init.size(); ++b) {
        ASSERT_THAT(c->PushInitialParams(static_cast<int32_t>(b), init[b]).Wait(), IsOk());
      }
    }
  }
  std::vector<std::vector<float>> RandomBuckets(uint32_t seed, float scale = 0.1f) {
    std::vector<std::vector<float>> out;
    for (const Bucket& b : clients_[0]->layout().buckets) out.push_back(Random(b.numel, seed++, scale));
    return out;
  }
  // Every rank pushes its shard (reduced mode) of `grad` (whole buckets) for `step`.
  std::vector<PushHandle> PushReduced(int64_t step, const std::vector<std::vector<float>>& grad) {
    std::vector<PushHandle> handles;
    const Layout& layout = clients_[0]->layout();
    for (int32_t r = 0; r < static_cast<int32_t>(clients_.size()); ++r) {
      for (int32_t b = 0; b < static_cast<int32_t>(layout.buckets.size()); ++b) {
        const int64_t n = layout.buckets[b].shard_numel;
        handles.push_back(
            clients_[r]->PushGrad(b, step, ElementSpan::Fp32(std::span<const float>(grad[b]).subspan(r * n, n))));
      }
    }
    return handles;
  }
  // A one-rank job on a fresh cluster whose client takes `cuda` for the CUDA driver (the
  // client keeps the driver it was made with), initial parameters pushed.
  // nullptr (the failure reported) when that did not work.
  Client* ConnectWithCudaDriver(const client_internal::CudaDriver& cuda) {
    StartCluster();
    if (cluster_ == nullptr) return nullptr;
    client_internal::ScopedCudaDriverForTesting use(&cuda);
    ConnectRanks(testing_fakes::SmallSpec(1), 1);
    if (clients_.empty()) return nullptr;
    PushInitial(RandomBuckets(4));
    return ::testing::Test::HasFailure() ? nullptr : clients_[0].get();
  }
  // FinishStep on every rank at once (`timeout` 0: the client's).
  std::vector<absl::StatusOr<StepStats>> FinishAll(int64_t step, double lr, double wd,
                                                   std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
    std::vector<absl::StatusOr<StepStats>> out(clients_.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t r = 0; r < clients_.size(); ++r) {
      threads.emplace_back([&, r] { out[r] = clients_[r]->FinishStep(step, lr, wd, timeout); });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  std::unique_ptr<FakeCluster> cluster_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_F(ClientGrpcTest, CreateAttachPushPullReducedModeStep) {
  StartCluster();
  ConnectRanks(testing_fakes::AllFormatsSpec(2), 2);
  ASSERT_EQ(clients_.size(), 2u);
  EXPECT_EQ(clients_[0]->job_id(), cluster_->job_id());
  EXPECT_EQ(clients_[0]->job_token(), cluster_->job_token());
  EXPECT_EQ(clients_[1]->layout(), clients_[0]->layout());
  EXPECT_EQ(clients_[1]->placement().epoch, 1);
  EXPECT_EQ(clients_[1]->placement().daemons.size(), 2u);
  const Layout& layout = clients_[0]->layout();
  const auto init = RandomBuckets(1);
  PushInitial(init);
  EXPECT_EQ(cluster_->version(), 0);

  // Version 0 through the daemons equals what they hold.
  for (int32_t b = 0; b < static_cast<int32_t>(layout.buckets.size()); ++b) {
    const absl::StatusOr<PulledBucket>& pulled = clients_[1]->PullBucket(b, 0).Wait();
    ASSERT_THAT(pulled, IsOk());
    EXPECT_EQ(pulled->version(), 0);
    EXPECT_TRUE(pulled->complete());
    for (int32_t t : pulled->tensors()) {
      MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> v, pulled->Dequantize(t));
      const LayoutTensor& info = layout.tensors[t];
      if (info.format != Format::kBF16) continue;
      for (int64_t i = 0; i < info.numel; ++i) ASSERT_EQ(v[i], Bf16Round(init[b][info.bucket_offset + i])) << info.name;
    }
  }

  // Step 0, reduced: rank r pushes shard r of the (already reduced) gradient.
  const auto grad = RandomBuckets(100);
  std::vector<PushHandle> handles;
  for (int32_t r = 0; r < 2; ++r) {
    for (int32_t b = 0; b < static_cast<int32_t>(layout.buckets.size()); ++b) {
      const int64_t n = layout.buckets[b].shard_numel;
      handles.push_back(clients_[r]->PushGrad(b, 0, ElementSpan::Fp32(std::span<const float>(grad[b]).subspan(r * n, n))));
    }
  }
  const auto stats = FinishAll(0, 0.5, 0.0);
  for (const auto& s : stats) {
    ASSERT_THAT(s, IsOk());
    EXPECT_EQ(s->step, 0);
    EXPECT_EQ(s->version, 1);
    EXPECT_FALSE(s->skipped);
    EXPECT_EQ(s->lr, 0.5);
  }
  for (auto& h : handles) {
    ASSERT_TRUE(h.ready());
    EXPECT_FALSE(h.Wait()->duplicate);
  }
  for (int32_t b = 0; b < static_cast<int32_t>(layout.buckets.size()); ++b) {
    const std::vector<float> master = cluster_->Master(b);
    for (int64_t i = 0; i < layout.buckets[b].numel; ++i) {
      ASSERT_FLOAT_EQ(master[i], init[b][i] - 0.5f * grad[b][i]);
    }
    const absl::StatusOr<PulledBucket>& pulled = clients_[0]->PullBucket(b, 1).Wait();
    ASSERT_THAT(pulled, IsOk());
    EXPECT_EQ(pulled->version(), 1);
  }
  // Every push's CRC-32C was checked, and came after its payload (computed as the chunks were
  // copied, not in a pass of its own).
  const auto pushes = cluster_->stats();
  EXPECT_EQ(pushes.wrong_crc, 0);
  EXPECT_EQ(pushes.crc_checked, pushes.push_streams);
  EXPECT_EQ(pushes.crc_trailers, pushes.push_streams);
}

// A daemon that does not list takes_crc32c_trailer (one built before December 2026) is sent the
// CRC in the header, which it checks: a new trainer works with an old daemon.
TEST_F(ClientGrpcTest, DaemonsWithoutTrailersGetTheCrcInTheHeader) {
  FakeClusterOptions options;
  options.take_crc32c_trailers = false;
  StartCluster(options);
  ConnectRanks(testing_fakes::SmallSpec(2), 2);
  ASSERT_EQ(clients_.size(), 2u);
  PushInitial(RandomBuckets(1));
  const auto grad = RandomBuckets(100);  // pushed from: it outlives the pushes
  for (PushHandle& h : PushReduced(0, grad)) ASSERT_THAT(h.Wait(), IsOk());
  for (const auto& s : FinishAll(0, 0.5, 0.0)) ASSERT_THAT(s, IsOk());
  const auto pushes = cluster_->stats();
  EXPECT_GT(pushes.push_streams, 0);
  EXPECT_EQ(pushes.crc_checked, pushes.push_streams);
  EXPECT_EQ(pushes.crc_trailers, 0);
}

// With push_crc32c off nothing is sent (no trailer, no header CRC), and FinishStep still keeps
// each gradient's CRC-32C (computed as the push's chunks were copied) for its check before it
// pushes a step again: a buffer changed after its push is caught.
TEST_F(ClientGrpcTest, WithoutPushCrcTheKeptCrcStillCatchesAChangedBuffer) {
  StartCluster();
  ClientOptions options;
  options.push_crc32c = false;
  ConnectRanks(testing_fakes::SmallSpec(2), 2, options);
  ASSERT_EQ(clients_.size(), 2u);
  PushInitial(RandomBuckets(1));
  cluster_->GiveUpStep(0);
  auto grad = RandomBuckets(200);
  for (PushHandle& h : PushReduced(0, grad)) ASSERT_THAT(h.Wait(), IsOk());
  EXPECT_EQ(cluster_->stats().crc_checked, 0);
  for (auto& bucket : grad) bucket[0] += 1.0f;  // rank 0's shard of every bucket
  const auto finished = FinishAll(0, 0.5, 0.0, std::chrono::milliseconds(1500));
  EXPECT_THAT(finished[0], StatusIs(absl::StatusCode::kAborted, HasSubstr("changed after its push")));
  EXPECT_FALSE(finished[1].ok());
}

// A daemon fenced by a move (of another of its shards) before it received the new placement
// answers FinishStep at the pushes' epoch with FAILED_PRECONDITION and the new epoch, even once
// the client routes at that epoch. It still owns the shard this rank pushed there, so it is
// behind, not the call: FinishStep waits and asks again, and the step commits. (The fresh-clone
// CI's fault matrix got that error out of a trainer's FinishStep before the client did so.)
TEST_F(ClientGrpcTest, FinishStepWaitsForADaemonFencedBeforeItGotTheNewPlacement) {
  StartCluster();
  ClientOptions base;
  base.initial_backoff = std::chrono::milliseconds(5);
  ConnectRanks(testing_fakes::SmallSpec(1), 1, base);
  PushInitial(RandomBuckets(1));
  for (PushHandle& h : PushReduced(0, RandomBuckets(100))) ASSERT_THAT(h.Wait(), IsOk());
  cluster_->MoveShard(0, 0, 0);  // a new placement epoch; the pushed shard stays on daemon 0
  // The first answer names epoch 2 (the client re-reads the placement); the second comes at it.
  cluster_->FenceNextFinishes(2);
  const auto finished = FinishAll(0, 0.5, 0.0);
  ASSERT_THAT(finished[0], IsOk());
  EXPECT_EQ(finished[0]->version, 1);
  EXPECT_EQ(clients_[0]->placement().epoch, 2);
  EXPECT_EQ(cluster_->stats().finish_calls, 3);
}

// A step the daemons gave up having changed nothing (a peer daemon died mid-step, the placement
// changed) is pushed again by FinishStep itself, from the caller's buffers: the training loop
// sees no error, and the update is the one of a single attempt.
TEST_F(ClientGrpcTest, FinishStepPushesAStepTheDaemonsGaveUpAgainItself) {
  StartCluster();
  ConnectRanks(testing_fakes::AllFormatsSpec(2), 2);
  const Layout& layout = clients_[0]->layout();
  const auto init = RandomBuckets(1);
  PushInitial(init);
  cluster_->GiveUpStep(0);
  const auto grad = RandomBuckets(100);
  PushReduced(0, grad);
  for (const auto& s : FinishAll(0, 0.5, 0.0)) {
    ASSERT_THAT(s, IsOk());
    EXPECT_EQ(s->version, 1);
    EXPECT_EQ(s->attempts, 2);
    EXPECT_THAT(s->first_abort, HasSubstr("changed nothing"));
  }
  EXPECT_EQ(cluster_->GivenUp(0), 1);
  for (int32_t b = 0; b < static_cast<int32_t>(layout.buckets.size()); ++b) {
    const std::vector<float> master = cluster_->Master(b);
    for (int64_t i = 0; i < layout.buckets[b].numel; ++i) ASSERT_FLOAT_EQ(master[i], init[b][i] - 0.5f * grad[b][i]);
  }

  // A buffer reused after its push finished is caught (CRC-32C) and not pushed again: the
  // ABORTED goes back to the caller, saying why. The caller's own push again then commits.
  cluster_->GiveUpStep(1);
  auto grad1 = RandomBuckets(200);
  const auto kept = grad1;
  std::vector<PushHandle> handles = PushReduced(1, grad1);
  for (PushHandle& h : handles) ASSERT_THAT(h.Wait(), IsOk());
  for (auto& bucket : grad1) bucket[0] += 1.0f;  // shard 0 of every bucket: rank 0's data
  // Rank 1's data is intact: it pushes again, then waits for rank 0, which did not.
  const auto finished = FinishAll(1, 0.5, 0.0, std::chrono::milliseconds(1500));
  EXPECT_THAT(finished[0], StatusIs(absl::StatusCode::kAborted, HasSubstr("changed after its push")));
  EXPECT_FALSE(finished[1].ok());
  grad1 = kept;
  PushReduced(1, grad1);
  for (const auto& s : FinishAll(1, 0.5, 0.0)) {
    ASSERT_THAT(s, IsOk());
    EXPECT_EQ(s->version, 2);
  }
}

// A step given up and then committed after all (a move's new owner finished it with the pushes
// the move carried): the push again is refused as already decided, and FinishStep returns the
// committed step's stats instead of an error, reading them again while the daemon it asks has
// not committed the step yet.
TEST_F(ClientGrpcTest, AStepCommittedAfterItsAttemptGaveUpIsReturnedAsCommitted) {
  StartCluster();
  ConnectRanks(testing_fakes::AllFormatsSpec(2), 2);
  PushInitial(RandomBuckets(1));
  cluster_->GiveUpStep(0, /*then_commit=*/true);
  cluster_->FailNextStatsReads(3);
  const auto grad = RandomBuckets(100);
  PushReduced(0, grad);
  for (const auto& s : FinishAll(0, 0.5, 0.0)) {
    ASSERT_THAT(s, IsOk());
    EXPECT_EQ(s->version, 1);
    EXPECT_EQ(s->attempts, 2);
  }
  EXPECT_EQ(cluster_->GivenUp(0), 1);
  EXPECT_EQ(cluster_->version(), 1);
}

// step_attempts = 1: the caller pushes again itself, as before.
TEST_F(ClientGrpcTest, WithOneStepAttemptAGivenUpStepIsTheCallersToPushAgain) {
  StartCluster();
  ClientOptions base;
  base.step_attempts = 1;
  ConnectRanks(testing_fakes::AllFormatsSpec(2), 2, base);
  PushInitial(RandomBuckets(1));
  cluster_->GiveUpStep(0);
  const auto grad = RandomBuckets(100);
  for (int attempt = 0; attempt < 2; ++attempt) {
    PushReduced(0, grad);
    for (const auto& s : FinishAll(0, 0.5, 0.0)) {
      if (attempt == 0) {
        EXPECT_THAT(s, StatusIs(absl::StatusCode::kAborted, HasSubstr("push it again")));
      } else {
        ASSERT_THAT(s, IsOk());
        EXPECT_EQ(s->attempts, 1);
      }
    }
  }
  ClientOptions bad = base;
  bad.step_attempts = 0;
  bad.coordinator = cluster_->coordinator_address();
  bad.job_id = clients_[0]->job_id();
  bad.job_token = clients_[0]->job_token();
  EXPECT_THAT(Client::Connect(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step_attempts")));
}

// The trainers' all-gather of quantized shards: each rank's pulled shard as a record, the D
// records rebuilt into the bucket, which dequantizes bit for bit as the bucket pulled whole
// (every format: the fake publishes each of them).
TEST_F(ClientGrpcTest, ShardRecordsRebuildTheBucketBitForBit) {
  StartCluster();
  ConnectRanks(testing_fakes::AllFormatsSpec(2), 2);
  const Layout& layout = clients_[0]->layout();
  PushInitial(RandomBuckets(3));
  for (int32_t b = 0; b < static_cast<int32_t>(layout.buckets.size()); ++b) {
    const int64_t record = PulledBucket::ShardRecordBytes(layout, b);
    std::vector<uint8_t> records(static_cast<size_t>(2 * record));
    for (int32_t r = 0; r < 2; ++r) {
      const absl::StatusOr<PulledBucket>& shard = clients_[r]->PullShard(b, r, 0).Wait();
      ASSERT_THAT(shard, IsOk());
      EXPECT_THAT(shard->WriteShardRecord(std::span<uint8_t>(records).subspan(0, record - 1)),
                  StatusIs(absl::StatusCode::kInvalidArgument));
      ASSERT_THAT(shard->WriteShardRecord(std::span<uint8_t>(records).subspan(r * record, record)), IsOk());
    }
    const std::shared_ptr<const Layout> shared = clients_[0]->shared_layout();
    MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket rebuilt, PulledBucket::FromShardRecords(shared, b, records));
    const absl::StatusOr<PulledBucket>& whole = clients_[0]->PullBucket(b, 0).Wait();
    ASSERT_THAT(whole, IsOk());
    EXPECT_TRUE(rebuilt.complete());
    const size_t n = static_cast<size_t>(layout.buckets[b].numel);
    std::vector<float> got(n), want(n);
    ASSERT_THAT(rebuilt.DequantizeCovered(got), IsOk());
    ASSERT_THAT(whole->DequantizeCovered(want), IsOk());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), n * 4)) << "bucket " << b << " " << FormatName(layout.buckets[b].format);
    // Records in the wrong order, or too few bytes: INVALID_ARGUMENT naming the problem.
    std::vector<uint8_t> swapped(records.begin() + record, records.end());
    swapped.insert(swapped.end(), records.begin(), records.begin() + record);
    EXPECT_THAT(PulledBucket::FromShardRecords(shared, b, swapped).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("is not shard 0's")));
    EXPECT_THAT(PulledBucket::FromShardRecords(shared, b, std::span<const uint8_t>(records).subspan(1)).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("needs 2 records")));
  }
  // A bucket covering both shards has no single record to write.
  const absl::StatusOr<PulledBucket>& whole = clients_[0]->PullBucket(0, 0).Wait();
  ASSERT_THAT(whole, IsOk());
  std::vector<uint8_t> out(static_cast<size_t>(PulledBucket::ShardRecordBytes(layout, 0)));
  EXPECT_THAT(whole->WriteShardRecord(out), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// The checkpoint admin calls over the coordinator's channel: a checkpoint taken at version 1
// is restored after step 1 made version 2; the job serves version 1 again under a new
// placement epoch, which the client has already re-read.
TEST_F(ClientGrpcTest, CheckpointCreateAndRestoreGoToTheCoordinatorsAdminService) {
  FakeClusterOptions options;
  options.admin_token = "admin-secret";
  StartCluster(options);
  ClientOptions base;
  base.admin_token = "admin-secret";
  ConnectRanks(testing_fakes::SmallSpec(1), 1, base);
  Client& c = *clients_[0];
  PushInitial(RandomBuckets(1));
  auto step = [&](int64_t s) {
    for (int32_t b = 0; b < static_cast<int32_t>(c.layout().buckets.size()); ++b) {
      const std::vector<float> grad = Random(c.layout().buckets[b].shard_numel, static_cast<uint32_t>(50 + s));
      EXPECT_THAT(c.PushGrad(b, s, ElementSpan::Fp32(grad)).Wait(), IsOk());
    }
    return c.FinishStep(s, 0.1, 0.0);
  };
  ASSERT_THAT(step(0), IsOk());
  const std::vector<float> saved = cluster_->Master(0);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(CheckpointInfo info, c.CreateCheckpoint(/*wait=*/true));
  EXPECT_FALSE(info.checkpoint_id.empty());
  EXPECT_EQ(info.job_id, c.job_id());
  EXPECT_EQ(info.version, 1);
  EXPECT_EQ(info.state, "COMMITTED");
  ASSERT_THAT(step(1), IsOk());
  ASSERT_NE(cluster_->Master(0), saved);

  // The token given with the call wins over ClientOptions::admin_token.
  AdminCallOptions wrong;
  wrong.admin_token = "not-the-token";
  EXPECT_THAT(c.CreateCheckpoint(true, wrong), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(c.RestoreCheckpoint(info.checkpoint_id, wrong), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(c.RestoreCheckpoint("no-such-checkpoint"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("RestoreCheckpoint no-such-checkpoint")));
  EXPECT_THAT(c.RestoreCheckpoint(""), StatusIs(absl::StatusCode::kInvalidArgument));

  const int64_t epoch_before = c.placement().epoch;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(RestoreResult restored, c.RestoreCheckpoint(info.checkpoint_id));
  EXPECT_EQ(restored.version, 1);
  EXPECT_GT(restored.placement_epoch, epoch_before);
  EXPECT_EQ(c.placement().epoch, restored.placement_epoch);
  EXPECT_EQ(cluster_->Master(0), saved);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket pulled, c.PullBucket(0, Client::kLatestVersion).Wait());
  EXPECT_EQ(pulled.version(), 1);
  // Training goes on from the restored step.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(StepStats again, step(1));
  EXPECT_EQ(again.version, 2);
}

TEST_F(ClientGrpcTest, CheckpointCallsWithoutAnAdminServiceAreUnimplemented) {
  FakeClusterOptions options;
  options.serve_admin = false;
  StartCluster(options);
  ConnectRanks(testing_fakes::SmallSpec(1), 1);
  EXPECT_THAT(clients_[0]->CreateCheckpoint(true),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("CreateCheckpoint of job")));
  EXPECT_THAT(clients_[0]->RestoreCheckpoint("ckpt-1"), StatusIs(absl::StatusCode::kUnimplemented));
}

TEST_F(ClientGrpcTest, UnreducedModeSumsEveryRanksBf16Gradient) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(2), 2);
  const Layout& layout = clients_[0]->layout();
  const auto init = RandomBuckets(7);
  PushInitial(init);
  std::vector<std::vector<uint16_t>> grads;  // [rank], bucket 0, bf16 bits
  for (int r = 0; r < 2; ++r) {
    std::vector<uint16_t> g;
    for (float x : Random(layout.buckets[0].numel, 50 + r)) g.push_back(kernels::FloatToBf16(x));
    grads.push_back(std::move(g));
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(layout.buckets.size(), 1u);
    PushHandle h = clients_[r]->PushBucketUnreduced(0, 0, ElementSpan::Bf16(grads[r]));
    ASSERT_THAT(h.Wait(), IsOk());
    EXPECT_EQ(h.Wait()->received_elements, layout.buckets[0].numel);
  }
  for (const auto& s : FinishAll(0, 0.25, 0.0)) ASSERT_THAT(s, IsOk());
  const std::vector<float> master = cluster_->Master(0);
  for (int64_t i = 0; i < layout.buckets[0].numel; ++i) {
    const float g = kernels::Bf16ToFloat(grads[0][i]) + kernels::Bf16ToFloat(grads[1][i]);
    ASSERT_FLOAT_EQ(master[i], init[0][i] - 0.25f * g);
  }
}

TEST_F(ClientGrpcTest, UnavailableDaemonsAreRetriedUntilTheyHaveTheJob) {
  FakeClusterOptions options;
  options.unavailable_calls = 6;
  options.create_job_unavailable = 2;
  StartCluster(options);
  ClientOptions base;
  base.initial_backoff = std::chrono::milliseconds(5);
  ConnectRanks(testing_fakes::SmallSpec(1), 1, base);
  PushInitial(RandomBuckets(3));
  EXPECT_EQ(cluster_->stats().unavailable_answers, 6);
  EXPECT_EQ(cluster_->version(), 0);
}

TEST_F(ClientGrpcTest, CallsCancelledByAStoppingServerAreRetried) {
  StartCluster();
  ClientOptions base;
  base.initial_backoff = std::chrono::milliseconds(5);
  ConnectRanks(testing_fakes::SmallSpec(1), 1, base);
  cluster_->FailNextCalls(3, grpc::StatusCode::CANCELLED);
  PushInitial(RandomBuckets(3));
  EXPECT_EQ(cluster_->stats().unavailable_answers, 3);
  EXPECT_EQ(cluster_->version(), 0);
}

TEST_F(ClientGrpcTest, GivesUpWithUnavailableAtTheDeadline) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(1), 1);
  cluster_->FailNextCalls(1000000);
  PushOptions options;
  options.timeout = std::chrono::milliseconds(400);
  std::vector<float> data(clients_[0]->layout().buckets[0].numel);
  EXPECT_THAT(clients_[0]->PushInitialParams(0, data, false, options).Wait(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("attempts")));
}

TEST_F(ClientGrpcTest, StaleEpochRereadsThePlacementAndReroutes) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(2), 2);
  EXPECT_EQ(clients_[0]->placement().epoch, 1);
  cluster_->MoveShard(0, 0, 1);  // shard 0 leaves daemon 0
  PushInitial(RandomBuckets(9));
  EXPECT_GE(cluster_->stats().stale_epoch_answers, 1);
  EXPECT_EQ(clients_[0]->placement().epoch, 2);
  const JobPlacement p = clients_[0]->placement();
  for (const ShardOwner& o : p.shards) {
    if (o.bucket == 0 && o.shard == 0) {
      EXPECT_EQ(o.daemon_id, "daemon-1");
    }
  }
}

TEST_F(ClientGrpcTest, WrongTokenAndUnknownJobAreNotRetried) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(1), 1);
  ClientOptions o;
  o.coordinator = cluster_->coordinator_address();
  o.job_id = clients_[0]->job_id();
  o.job_token = "wrong";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("GetLayout")));
  o.job_id = "job-404";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kNotFound));
  o.job_id = clients_[0]->job_id();
  o.job_token = clients_[0]->job_token();
  o.rank = 5;
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
}

TEST_F(ClientGrpcTest, FinishStepNeedsPushesAndAllRanks) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(2), 2);
  PushInitial(RandomBuckets(4));
  EXPECT_THAT(clients_[0]->FinishStep(0, 0.1, 0.0), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(clients_[0]->FinishStep(-1, 0.1, 0.0), StatusIs(absl::StatusCode::kInvalidArgument));
  const int64_t n = clients_[0]->layout().buckets[0].shard_numel;
  std::vector<float> g(n, 0.01f);
  clients_[0]->PushGrad(0, 0, ElementSpan::Fp32(g));
  // Rank 1 never finishes: the daemon keeps rank 0 waiting until the deadline.
  EXPECT_THAT(clients_[0]->FinishStep(0, 0.1, 0.0, std::chrono::milliseconds(300)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(ClientGrpcTest, OldStepsDuplicatesChunksAndSkippedSteps) {
  StartCluster();
  ClientOptions base;
  base.chunk_bytes = 1024;
  ConnectRanks(testing_fakes::SmallSpec(1), 1, base);
  Client& c = *clients_[0];
  PushInitial(RandomBuckets(5));
  const int64_t n = c.layout().buckets[0].numel;
  std::vector<float> g(n, 0.01f);
  ASSERT_THAT(c.PushGrad(0, 0, ElementSpan::Fp32(g)).Wait(), IsOk());
  const absl::StatusOr<PushResult>& dup = c.PushGrad(0, 0, ElementSpan::Fp32(g)).Wait();
  ASSERT_THAT(dup, IsOk());
  EXPECT_TRUE(dup->duplicate);
  EXPECT_LE(cluster_->stats().max_chunk_bytes, 1024);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(StepStats s0, c.FinishStep(0, 0.1, 0.01));
  EXPECT_EQ(s0.version, 1);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(StepStats again, c.GetStepStats(0));
  EXPECT_EQ(again.version, 1);

  // A push for the committed step: FAILED_PRECONDITION naming the committed step.
  const absl::Status old = c.PushGrad(0, 0, ElementSpan::Fp32(g)).Wait().status();
  EXPECT_THAT(old, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("bucket 0")));
  ASSERT_TRUE(GetErrorInfo(old).has_value());
  EXPECT_EQ(GetErrorInfo(old)->committed_step, 0);

  // Non-finite gradients skip step 1: version 2 never exists, the pull says unchanged.
  g[3] = std::nanf("");
  ASSERT_THAT(c.PushGrad(0, 1, ElementSpan::Fp32(g)).Wait(), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(StepStats s1, c.FinishStep(1, 0.1, 0.01));
  EXPECT_TRUE(s1.skipped);
  EXPECT_EQ(s1.version, 1);
  const absl::StatusOr<PulledBucket>& pulled = c.PullBucket(0, 2).Wait();
  ASSERT_THAT(pulled, IsOk());
  EXPECT_TRUE(pulled->unchanged());
  EXPECT_EQ(pulled->version(), 1);
  const absl::StatusOr<PulledBucket>& latest = c.PullShard(0, 0, Client::kLatestVersion).Wait();
  ASSERT_THAT(latest, IsOk());
  EXPECT_EQ(latest->version(), 1);
  EXPECT_FALSE(latest->unchanged());
}

TEST_F(ClientGrpcTest, DestroyingTheClientCancelsWaitingPulls) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(1), 1);
  PushInitial(RandomBuckets(11));
  PullHandle waiting = clients_[0]->PullBucket(0, 5);  // step 4 never comes: the daemon waits
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(waiting.ready());
  const auto start = std::chrono::steady_clock::now();
  clients_.clear();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_TRUE(waiting.ready());
  EXPECT_THAT(waiting.Wait(), StatusIs(absl::StatusCode::kCancelled));
}

TEST_F(ClientGrpcTest, BadArgumentsAreRefusedWithoutACall) {
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(2), 2);
  Client& c = *clients_[0];
  std::vector<float> small(3);
  EXPECT_THAT(c.PushGrad(0, 0, ElementSpan::Fp32(small)).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.PushGrad(7, 0, ElementSpan::Fp32(small)).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> shard(c.layout().buckets[0].shard_numel);
  EXPECT_THAT(c.PushGrad(0, -1, ElementSpan::Fp32(shard)).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.PushBucketUnreduced(0, 0, ElementSpan::Fp32(shard)).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("whole bucket")));
  EXPECT_THAT(c.PushInitialParams(0, small).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.PullShard(0, 2, 0).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.PullBucket(0, -5).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(cluster_->stats().push_streams, 0);
  EXPECT_EQ(cluster_->stats().pull_streams, 0);
}

TEST_F(ClientGrpcTest, DeviceMemoryIsRefusedBeforeAnythingIsSent) {
  StartCluster();
  const int64_t n = 4096;
  std::vector<float> device(n, 0.01f);  // stands for device memory
  FakeCudaDriver cuda(device.data(), device.size() * sizeof(float));
  client_internal::ScopedCudaDriverForTesting use(&cuda);
  ConnectRanks(testing_fakes::SmallSpec(1), 1);
  Client& c = *clients_[0];
  const Bucket& b = c.layout().buckets[0];
  ASSERT_LE(b.numel, n);
  const int before = cluster_->stats().push_streams;
  EXPECT_THAT(c.PushInitialParams(0, std::span<const float>(device.data(), b.numel)).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("memory of CUDA device 1")));
  const absl::StatusOr<PushResult> refused =
      c.PushGrad(0, 0, ElementSpan::Fp32(std::span<const float>(device.data(), b.shard_numel))).Wait();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket 0 shard 0")));
  EXPECT_THAT(refused.status().message(), HasSubstr("transport \"nccl\""));
  EXPECT_EQ(cluster_->stats().push_streams, before);
  // Nothing of the step was recorded: FinishStep has no push to wait for.
  EXPECT_THAT(c.FinishStep(0, 0.1, 0.0), StatusIs(absl::StatusCode::kFailedPrecondition));
  // The same values from host memory go through.
  PushInitial(RandomBuckets(4));
  std::vector<float> host(device.begin(), device.begin() + b.shard_numel);
  for (int32_t k = 0; k < static_cast<int32_t>(c.layout().buckets.size()); ++k) {
    std::vector<float> g(c.layout().buckets[k].shard_numel, 0.01f);
    ASSERT_THAT(c.PushGrad(k, 0, ElementSpan::Fp32(k == 0 ? host : g)).Wait(), IsOk());
  }
  EXPECT_THAT(c.FinishStep(0, 0.1, 0.0), IsOk());
}

// A one-rank job whose client takes a fake CUDA driver with no device memory.
class ClientCudaWaitTest : public ClientGrpcTest {
 protected:
  void SetUp() override {
    client_ = ConnectWithCudaDriver(cuda_);
    ASSERT_NE(client_, nullptr);
    before_ = cluster_->stats().push_streams;
  }

  FakeCudaDriver cuda_{nullptr, 0};
  Client* client_ = nullptr;
  int before_ = 0;  // push streams the daemons saw before the test's pushes
};

TEST_F(ClientCudaWaitTest, PushWaitsForTheCudaWorkThatProducesItsBuffer) {
  Client& c = *client_;
  std::vector<std::vector<float>> g;
  for (const Bucket& b : c.layout().buckets) g.emplace_back(b.shard_numel, 0.01f);
  PushOptions on_stream;
  on_stream.cuda_stream = nullptr;  // the legacy default stream
  std::vector<PushHandle> handles;
  for (int32_t k = 0; k < static_cast<int32_t>(g.size()); ++k) {
    handles.push_back(c.PushGrad(k, 0, ElementSpan::Fp32(g[k]), on_stream));
  }
  EXPECT_FALSE(handles[0].WaitFor(std::chrono::milliseconds(300)));
  EXPECT_EQ(cluster_->stats().push_streams, before_);  // nothing read or sent while the work runs
  cuda_.Finish(/*fail=*/false);
  for (PushHandle& h : handles) EXPECT_THAT(h.Wait(), IsOk());
  EXPECT_EQ(cuda_.waits(), static_cast<int>(g.size()));
  EXPECT_EQ(cuda_.released(), static_cast<int>(g.size()));  // each recorded event released once
  EXPECT_THAT(c.FinishStep(0, 0.1, 0.0), IsOk());
}

TEST_F(ClientCudaWaitTest, FailedCudaWorkFailsThePushAndSendsNothing) {
  Client& c = *client_;
  std::vector<float> g(c.layout().buckets[0].shard_numel, 0.01f);
  int event = 0;  // any handle: the fake only passes it on
  PushOptions options;
  options.cuda_event = &event;
  cuda_.Finish(/*fail=*/true);
  EXPECT_THAT(c.PushGrad(0, 0, ElementSpan::Fp32(g), options).Wait(),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("CUDA work")));
  EXPECT_EQ(cluster_->stats().push_streams, before_);
  EXPECT_THAT(c.FinishStep(0, 0.1, 0.0), StatusIs(absl::StatusCode::kInternal));
}

TEST_F(ClientGrpcTest, CudaStreamWithoutADriverIsRefused) {
  if (void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); lib != nullptr) {
    dlclose(lib);
    GTEST_SKIP() << "this machine has a CUDA driver";
  }
  StartCluster();
  ConnectRanks(testing_fakes::SmallSpec(1), 1);
  Client& c = *clients_[0];
  std::vector<float> g(c.layout().buckets[0].shard_numel, 0.01f);
  PushOptions options;
  options.cuda_stream = nullptr;
  EXPECT_THAT(c.PushGrad(0, 0, ElementSpan::Fp32(g), options).Wait(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("libcuda.so.1")));
  EXPECT_EQ(cluster_->stats().push_streams, 0);
}

// The cuda_ipc transport against the fake daemons: device memory goes by its IPC handle (no
// PushGrad stream), host memory and pulls by gRPC, and the job trains exactly as over grpc.
TEST_F(ClientGrpcTest, CudaIpcPushesDeviceMemoryByHandleAndTrainsAsOverGrpc) {
  constexpr int kSteps = 3;
  auto run = [&](const std::string& transport) -> std::vector<std::vector<float>> {
    clients_.clear();
    FakeClusterOptions options;
    options.offer_cuda_ipc = true;
    StartCluster(options);
    std::vector<float> device(1 << 20);  // stands for one device allocation
    FakeCudaDriver cuda(device.data(), device.size() * sizeof(float));
    client_internal::ScopedCudaDriverForTesting use(&cuda);
    ClientOptions base;
    base.transport = transport;
    ConnectRanks(testing_fakes::SmallSpec(1), 1, base);
    if (clients_.empty()) return {};
    Client& c = *clients_[0];
    PushInitial(RandomBuckets(4));
    const int64_t initial_streams = cluster_->stats().push_streams;
    // The daemons give step 1 up once: FinishStep pushes it again itself, from device memory too.
    cluster_->GiveUpStep(1);
    const auto& buckets = c.layout().buckets;
    for (int64_t step = 0; step < kSteps; ++step) {
      size_t offset = 64;  // shards at offsets inside the allocation, as a caching allocator places them
      std::vector<std::vector<float>> host(buckets.size());  // unchanged until FinishStep returns
      for (int32_t k = 0; k < static_cast<int32_t>(buckets.size()); ++k) {
        std::vector<float>& g = host[k];
        g = Random(buckets[k].shard_numel, 100 + static_cast<uint32_t>(step * 10 + k));
        std::copy(g.begin(), g.end(), device.begin() + static_cast<ptrdiff_t>(offset));
        const std::span<const float> on_device(device.data() + offset, g.size());
        EXPECT_THAT(c.PushGrad(k, step, ElementSpan::Fp32(transport == "cuda_ipc" ? on_device : std::span(g))).Wait(),
                    IsOk());
        offset += g.size() + 64;
      }
      const absl::StatusOr<StepStats> stats = c.FinishStep(step, 0.1, 0.0);
      EXPECT_THAT(stats, IsOk());
      if (stats.ok()) {
        EXPECT_EQ(stats->attempts, step == 1 ? 2 : 1) << "step " << step;
      }
    }
    if (transport == "cuda_ipc") {
      const int64_t pushes = (kSteps + 1) * static_cast<int64_t>(buckets.size());  // step 1 twice
      EXPECT_EQ(cluster_->stats().cuda_ipc_pushes, pushes);
      EXPECT_EQ(cuda.exports(), pushes);
      EXPECT_EQ(cluster_->stats().push_streams, initial_streams);  // no gradient went by PushGrad
      EXPECT_EQ(cluster_->stats().cuda_ipc_attaches, 2);           // one session per daemon, at Connect
      for (const DataConnection& d : c.connections()) EXPECT_EQ(d.transport, "cuda_ipc");
    }
    EXPECT_THAT(c.PullBucket(0, kSteps).Wait(), IsOk());  // pulls by gRPC
    std::vector<std::vector<float>> masters;
    for (int32_t k = 0; k < static_cast<int32_t>(buckets.size()); ++k) masters.push_back(cluster_->Master(k));
    clients_.clear();  // before the driver they use goes
    return masters;
  };
  const std::vector<std::vector<float>> over_ipc = run("cuda_ipc");
  const std::vector<std::vector<float>> over_grpc = run("grpc");
  ASSERT_FALSE(over_ipc.empty());
  EXPECT_EQ(over_ipc, over_grpc);
}

// PullShardInto: into device memory the daemon writes the shard by its IPC handle (no
// PullParams stream), after the CUDA work the options name; into host memory it comes over
// gRPC; either way the bytes, block scales and per-tensor values are PullShard's. A device
// destination is refused where no transport could write it, and a destination of the wrong
// size everywhere.
TEST_F(ClientGrpcTest, PullShardIntoDeviceMemoryGetsThePulledShardsBytes) {
  FakeClusterOptions options;
  options.offer_cuda_ipc = true;
  StartCluster(options);
  std::vector<uint8_t> device(4 << 20, 0xA5);  // stands for one device allocation
  FakeCudaDriver cuda(device.data(), device.size());
  client_internal::ScopedCudaDriverForTesting use(&cuda);
  ClientOptions base;
  base.transport = "cuda_ipc";
  ConnectRanks(testing_fakes::AllFormatsSpec(2), 2, base);
  ASSERT_EQ(clients_.size(), 2u);
  PushInitial(RandomBuckets(4));
  Client& c = *clients_[1];
  // The CUDA work still using the destination (named as a stream) ends before the daemon writes.
  {
    const Bucket& b = c.layout().buckets[0];
    PullIntoOptions wait_for;
    wait_for.cuda_stream = nullptr;
    ShardPullHandle h = c.PullShardInto(0, 0, 0, device.data(), DataBytes(b.format, b.shard_numel), wait_for);
    EXPECT_FALSE(h.WaitFor(std::chrono::milliseconds(200)));
    EXPECT_EQ(cluster_->stats().cuda_ipc_pulls, 0);
    cuda.Finish(/*fail=*/false);
    EXPECT_THAT(h.Wait(), IsOk());
    EXPECT_EQ(cluster_->stats().cuda_ipc_pulls, 1);
    EXPECT_EQ(cuda.waits(), 1);
  }
  // A device pull whose call ends without the daemon's answer (here its deadline, waiting for a
  // version to come) detaches, which waits for any write of the daemon's still running; the
  // next call attaches again.
  {
    const Bucket& b = c.layout().buckets[0];
    PullIntoOptions soon;
    soon.timeout = std::chrono::milliseconds(300);
    const int64_t attaches = cluster_->stats().cuda_ipc_attaches;
    EXPECT_THAT(c.PullShardInto(0, 0, 5, device.data(), DataBytes(b.format, b.shard_numel), soon).Wait(),
                StatusIs(absl::StatusCode::kDeadlineExceeded));
    EXPECT_EQ(cluster_->stats().cuda_ipc_detaches, 1);
    EXPECT_THAT(c.PullShardInto(0, 0, 0, device.data(), DataBytes(b.format, b.shard_numel)).Wait(), IsOk());
    EXPECT_EQ(cluster_->stats().cuda_ipc_attaches, attaches + 1);
  }
  const int64_t streams_before = cluster_->stats().pull_streams;
  int64_t device_pulls = 3;
  for (const Bucket& b : c.layout().buckets) {
    for (int32_t shard = 0; shard < 2; ++shard) {
      const absl::StatusOr<PulledBucket> want = c.PullShard(b.index, shard, 0).Wait();
      ASSERT_THAT(want, IsOk());
      const PulledShard& w = want->shards()[0];
      const int64_t bytes = static_cast<int64_t>(want->data().size());
      // Into "device memory", at an odd offset inside the allocation.
      const size_t offset = 4096 + 3;
      std::fill(device.begin(), device.end(), 0xA5);
      ShardPullHandle h = c.PullShardInto(b.index, shard, 0, device.data() + offset, bytes);
      const absl::StatusOr<PulledShard>& got = h.Wait();
      ASSERT_THAT(got, IsOk());
      ++device_pulls;
      EXPECT_TRUE(std::equal(want->data().begin(), want->data().end(), device.begin() + offset))
          << FormatName(b.format) << " shard " << shard;
      EXPECT_EQ(device[offset - 1], 0xA5);
      EXPECT_EQ(device[offset + static_cast<size_t>(bytes)], 0xA5);
      EXPECT_EQ(got->version, 0);
      EXPECT_FALSE(got->unchanged);
      EXPECT_EQ(got->scales, w.scales);
      ASSERT_EQ(got->fragments.size(), w.fragments.size());
      for (size_t i = 0; i < w.fragments.size(); ++i) {
        EXPECT_EQ(got->fragments[i].scale, w.fragments[i].scale);
        EXPECT_EQ(got->fragments[i].scale_offset, w.fragments[i].scale_offset);
      }
      // Into host memory the same client pulls over gRPC.
      std::vector<uint8_t> host(static_cast<size_t>(bytes));
      ASSERT_THAT(c.PullShardInto(b.index, shard, 0, host.data(), bytes).Wait(), IsOk());
      EXPECT_TRUE(std::equal(host.begin(), host.end(), want->data().begin()));
      // The wrong size, for either.
      EXPECT_THAT(c.PullShardInto(b.index, shard, 0, device.data(), bytes + 1).Wait(),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes of packed")));
    }
  }
  // A whole bucket into one device buffer: every shard into its slice, PullBucket's bytes.
  for (const Bucket& b : c.layout().buckets) {
    const absl::StatusOr<PulledBucket> want = c.PullBucket(b.index, 0).Wait();
    ASSERT_THAT(want, IsOk());
    const int64_t bytes = static_cast<int64_t>(want->data().size());
    std::fill(device.begin(), device.end(), 0xA5);
    const absl::StatusOr<std::vector<PulledShard>> got = c.PullBucketInto(b.index, 0, device.data() + 64, bytes).Wait();
    ASSERT_THAT(got, IsOk());
    device_pulls += 2;
    EXPECT_TRUE(std::equal(want->data().begin(), want->data().end(), device.begin() + 64)) << FormatName(b.format);
    EXPECT_EQ(device[64 + static_cast<size_t>(bytes)], 0xA5);
    ASSERT_EQ(got->size(), 2u);
    for (size_t k = 0; k < got->size(); ++k) {
      EXPECT_EQ((*got)[k].shard, static_cast<int32_t>(k));
      EXPECT_EQ((*got)[k].scales, want->shards()[k].scales);
    }
    EXPECT_THAT(c.PullBucketInto(b.index, 0, device.data(), bytes - 1).Wait(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shards [0, 2)")));
  }
  EXPECT_EQ(cluster_->stats().cuda_ipc_pulls, device_pulls);
  EXPECT_EQ(cuda.exports(), device_pulls);
  // One PullParams stream per PullShard, per host PullShardInto and per shard of a PullBucket;
  // none for the device pulls.
  EXPECT_EQ(cluster_->stats().pull_streams - streams_before,
            2 * (device_pulls - 3 - 2 * static_cast<int64_t>(c.layout().buckets.size())) +
                2 * static_cast<int64_t>(c.layout().buckets.size()));
  EXPECT_THAT(c.PullShardInto(0, 2, 0, device.data(), 1).Wait(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c.PullShardInto(0, 0, 0, nullptr, 0).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  // A client on another transport cannot have device memory written.
  ClientOptions grpc;
  grpc.coordinator = cluster_->coordinator_address();
  grpc.job_id = c.job_id();
  grpc.job_token = c.job_token();
  grpc.rank = 0;
  grpc.transport = "grpc";
  auto other = Client::Connect(grpc);
  ASSERT_THAT(other, IsOk());
  const Bucket& b0 = c.layout().buckets[0];
  const int64_t bytes0 = DataBytes(b0.format, b0.shard_numel);
  EXPECT_THAT((*other)->PullShardInto(0, 0, 0, device.data(), bytes0).Wait(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only the cuda_ipc transport")));
  other->reset();
  clients_.clear();  // before the driver they use goes
}

TEST_F(ClientGrpcTest, CudaIpcNeedsADaemonThatOffersItAndACudaDriver) {
  StartCluster();  // the daemons do not offer cuda_ipc
  std::vector<float> device(1024);
  FakeCudaDriver cuda(device.data(), device.size() * sizeof(float));
  ClientOptions options;
  options.coordinator = cluster_->coordinator_address();
  options.job_spec_json = testing_fakes::SmallSpec(1);
  options.transport = "cuda_ipc";
  {
    client_internal::ScopedCudaDriverForTesting use(&cuda);
    EXPECT_THAT(Client::Connect(options).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cuda_ipc is not offered by daemon")));
  }
  if (void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL); lib != nullptr) {
    dlclose(lib);
    GTEST_SKIP() << "this machine has a CUDA driver";
  }
  FakeClusterOptions offering;
  offering.offer_cuda_ipc = true;
  StartCluster(offering);
  options.coordinator = cluster_->coordinator_address();
  EXPECT_THAT(Client::Connect(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("transport cuda_ipc: CUDA: ")));
}

}  // namespace
}  // namespace mainstay

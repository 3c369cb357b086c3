// The cuda_ipc transport's daemon end (server/cudaipc/cuda_ipc_server.h) on a real ShardDaemon,
// with a fake IpcMemory whose "device allocations" are host buffers: sessions, pushes copied out
// of the trainer's allocation (the steps equal the reference bit for bit), pulls written into it
// (the bytes PullParams serves), the refusals (another node, wrong or reader token, another job
// or rank, bad handle, a range outside the allocation, a copy that fails: nothing stored),
// mappings that live only while their copy runs, and when sessions end.
#include "server/cudaipc/cuda_ipc_server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kernels/memory.h"
#include "tests/testing/daemon_cluster.h"

namespace mainstay {
namespace {

using ::mainstay::daemon::CudaIpcServer;
using ::mainstay::daemon::IpcMemory;
using ::mainstay::testing::Cluster;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::kJob;
using ::mainstay::testing::kToken;
using ::mainstay::testing::MakeSpec;
using ::mainstay::testing::Reference;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kBoot[] = "boot-A";
constexpr char kNamespace[] = "pid:[4026531836]";

// Allocations are host buffers named by 64-byte handles; counts what the server opens and closes.
class FakeIpcMemory : public IpcMemory {
 public:
  // A new "allocation" of `bytes` bytes and its handle.
  std::string Export(std::vector<uint8_t>* buffer) {
    absl::MutexLock lock(&mu_);
    std::string handle(daemon::kCudaIpcHandleBytes, '\0');
    const uint64_t id = ++next_;
    std::memcpy(handle.data(), &id, sizeof(id));
    allocations_[handle] = buffer;
    return handle;
  }
  int device() const override { return 0; }
  absl::StatusOr<Mapping> Open(absl::string_view handle) override {
    absl::MutexLock lock(&mu_);
    auto it = allocations_.find(std::string(handle));
    if (it == allocations_.end()) return absl::FailedPreconditionError("cudaIpcOpenMemHandle (fake): unknown handle");
    ++opens_;
    open_.insert(it->second->data());
    return Mapping{it->second->data(), it->second->size()};
  }
  absl::Status CopyToHost(const Mapping& m, uint64_t offset, void* dest, uint64_t bytes) override {
    if (fail_copies_.load()) return absl::InternalError("copying out of a trainer's CUDA IPC memory (fake failure)");
    {
      absl::MutexLock lock(&mu_);
      EXPECT_TRUE(open_.count(m.base)) << "a copy from a closed mapping";
    }
    std::memcpy(dest, static_cast<const uint8_t*>(m.base) + offset, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyIn(const Mapping& m, uint64_t offset, const void* src, uint64_t bytes) override {
    if (fail_copies_.load()) return absl::InternalError("copying into a trainer's CUDA IPC memory (fake failure)");
    if (write_started_ != nullptr) {  // a slow copy: it ends when the test says
      write_started_->Notify();
      write_may_end_->WaitForNotification();
    }
    {
      absl::MutexLock lock(&mu_);
      EXPECT_TRUE(open_.count(m.base)) << "a copy into a closed mapping";
    }
    std::memcpy(static_cast<uint8_t*>(m.base) + offset, src, bytes);
    return absl::OkStatus();
  }
  void Close(const Mapping& m) override {
    absl::MutexLock lock(&mu_);
    EXPECT_EQ(open_.erase(m.base), 1u) << "closed twice, or never opened";
    ++closes_;
  }
  int opens() const {
    absl::MutexLock lock(&mu_);
    return opens_;
  }
  int still_open() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(open_.size());
  }
  std::atomic<bool> fail_copies_{false};
  absl::Notification* write_started_ = nullptr;  // set before the copies start
  absl::Notification* write_may_end_ = nullptr;

 private:
  mutable absl::Mutex mu_;
  uint64_t next_ = 0;
  std::map<std::string, std::vector<uint8_t>*> allocations_;
  std::set<void*> open_;
  int opens_ = 0, closes_ = 0;
};

class CudaIpcServerTest : public ::testing::Test {
 protected:
  CudaIpcServerTest() : CudaIpcServerTest(nullptr) {}
  // `memory`: the daemon's state memory (null: host memory).
  explicit CudaIpcServerTest(kernels::StateMemory* memory)
      : cluster_(MakeSpec("bf16_with_fp8_mixed", LayoutPolicy::kFlat, 2), 1, nullptr, {}, true, memory) {}
  void SetUp() override {
    CudaIpcServer::Options o;
    o.daemon = &cluster_.daemon(0);
    o.memory = &memory_;
    o.device_name = "cuda:0 (fake)";
    o.boot_id = kBoot;
    o.pid_namespace = kNamespace;
    o.alive = [this](int64_t pid) {
      absl::MutexLock lock(&mu_);
      return dead_.count(pid) == 0;
    };
    auto server = CudaIpcServer::Start(std::move(o));
    ASSERT_THAT(server, IsOk());
    server_ = *std::move(server);
  }

  v1::AttachCudaIpcRequest AttachRequest(int32_t rank, int64_t pid = 0) const {
    v1::AttachCudaIpcRequest r;
    r.set_job_id(kJob);
    r.set_job_token(kToken);
    r.set_rank(rank);
    r.set_boot_id(kBoot);
    r.set_pid_namespace(kNamespace);
    r.set_pid(pid);
    r.set_node_name("node-a");
    return r;
  }
  uint64_t Attach(int32_t rank, int64_t pid = 0) {
    auto r = server_->Attach(AttachRequest(rank, pid));
    EXPECT_THAT(r, IsOk());
    return r.ok() ? r->session_id() : 0;
  }
  // Rank `shard`'s push of `values` at `step` out of `allocation` at byte `offset` (copied there).
  absl::StatusOr<v1::PushGradResponse> Push(uint64_t session, int32_t bucket, int32_t shard, int64_t step,
                                            v1::PushKind kind, const std::vector<float>& values,
                                            const std::string& handle, std::vector<uint8_t>& allocation,
                                            uint64_t offset = 0) {
    if (offset + values.size() * 4 <= allocation.size()) {
      std::memcpy(allocation.data() + offset, values.data(), values.size() * 4);
    }
    v1::CudaIpcPushRequest r;
    r.set_session_id(session);
    *r.mutable_header() = cluster_.PushHeader(bucket, shard, step, shard, kind, values);
    r.mutable_header()->set_num_contributors(1);
    r.mutable_memory()->set_handle(handle);
    r.mutable_memory()->set_offset(offset);
    r.mutable_memory()->set_allocation_bytes(allocation.size());
    return server_->Push(r);
  }

  // Rank `rank`'s CudaIpcPull of bucket `bucket` shard `shard` at `version` into `allocation` at
  // `offset` (`bytes`: the destination's size; -1: the shard's packed data bytes).
  absl::StatusOr<v1::CudaIpcPullResponse> PullInto(uint64_t session, int32_t rank, int32_t bucket, int32_t shard,
                                                   int64_t version, const std::string& handle,
                                                   std::vector<uint8_t>& allocation, uint64_t offset = 0,
                                                   int64_t bytes = -1, absl::Duration wait = absl::Seconds(10),
                                                   const std::function<bool()>& cancelled = nullptr) {
    const Bucket& b = cluster_.layout().buckets[bucket];
    v1::CudaIpcPullRequest r;
    r.set_session_id(session);
    v1::PullParamsRequest& p = *r.mutable_request();
    p.set_job_id(kJob);
    p.set_job_token(kToken);
    p.set_placement_epoch(cluster_.epoch());
    p.set_bucket(bucket);
    p.set_shard(shard);
    p.set_version(version);
    p.set_rank(rank);
    r.mutable_memory()->set_handle(handle);
    r.mutable_memory()->set_offset(offset);
    r.mutable_memory()->set_allocation_bytes(allocation.size());
    r.set_bytes(bytes >= 0 ? static_cast<uint64_t>(bytes) : static_cast<uint64_t>(DataBytes(b.format, b.shard_numel)));
    return server_->Pull(r, absl::Now() + wait, cancelled);
  }

  Cluster cluster_;
  FakeIpcMemory memory_;
  std::unique_ptr<CudaIpcServer> server_;
  absl::Mutex mu_;
  std::set<int64_t> dead_ ABSL_GUARDED_BY(mu_);
};

TEST_F(CudaIpcServerTest, PushesCopiedOutOfTheTrainersMemoryTrainLikeTheReference) {
  Reference ref(cluster_.resolved());
  const Layout& layout = cluster_.layout();
  // One "device allocation" per rank, each shard's gradient at its own offset in it (as a
  // trainer's caching allocator hands out parts of one block).
  std::vector<uint64_t> sessions;
  std::vector<std::vector<uint8_t>> allocations(2, std::vector<uint8_t>(8 << 20));
  std::vector<std::string> handles;
  for (int32_t r = 0; r < 2; ++r) {
    sessions.push_back(Attach(r));
    handles.push_back(memory_.Export(&allocations[r]));
  }
  auto offset_of = [&](int32_t bucket) { return static_cast<uint64_t>(bucket) * (1 << 20) + 256; };
  for (const Bucket& b : layout.buckets) {
    for (const Shard& s : b.shards) {
      auto values = cluster_.ShardValues(
          b, s, [&](int32_t t, int64_t i) { return ref.master(static_cast<size_t>(t))[static_cast<size_t>(i)]; });
      ASSERT_THAT(Push(sessions[s.rank], b.index, s.rank, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handles[s.rank],
                       allocations[s.rank], offset_of(b.index)),
                  IsOk());
    }
  }
  ExpectMatchesReference(cluster_, ref, 0);
  for (int64_t step = 0; step < 3; ++step) {
    const float lr = 1e-3f * static_cast<float>(step + 1);
    for (const Bucket& b : layout.buckets) {
      for (const Shard& s : b.shards) {
        auto pushed = Push(sessions[s.rank], b.index, s.rank, step, v1::PUSH_KIND_GRADIENT,
                           cluster_.GradShard(b, s, step), handles[s.rank], allocations[s.rank], offset_of(b.index));
        ASSERT_THAT(pushed, IsOk());
        EXPECT_FALSE(pushed->duplicate());
        EXPECT_EQ(pushed->received_elements(), b.shard_numel);
      }
    }
    for (const auto& stats : cluster_.Finish(step, lr)) ASSERT_THAT(stats.status(), IsOk());
    ref.Step(step, lr);
    ExpectMatchesReference(cluster_, ref, step + 1);
  }
  // Each push mapped its allocation for its copy only.
  int pushes = 0;
  for (const Bucket& b : layout.buckets) pushes += 4 * static_cast<int>(b.shards.size());
  EXPECT_EQ(memory_.opens(), pushes);
  EXPECT_EQ(memory_.still_open(), 0);
  EXPECT_EQ(server_->mappings(), 0);
  // The same push again is a duplicate: nothing is copied.
  const Bucket& b0 = layout.buckets[0];
  const std::vector<float> next = cluster_.GradShard(b0, b0.shards[0], 3);
  ASSERT_THAT(Push(sessions[0], 0, 0, 3, v1::PUSH_KIND_GRADIENT, next, handles[0], allocations[0]), IsOk());
  memory_.fail_copies_ = true;
  auto again = Push(sessions[0], 0, 0, 3, v1::PUSH_KIND_GRADIENT, next, handles[0], allocations[0]);
  ASSERT_THAT(again, IsOk());
  EXPECT_TRUE(again->duplicate());
  memory_.fail_copies_ = false;
  // Detaching ends the session; its id is refused afterwards, as a lost session.
  v1::DetachCudaIpcRequest detach;
  detach.set_session_id(sessions[0]);
  detach.set_job_id(kJob);
  detach.set_job_token(kToken);
  ASSERT_THAT(server_->Detach(detach), IsOk());
  EXPECT_EQ(server_->sessions(), 1);
  EXPECT_THAT(Push(sessions[0], 0, 0, 3, v1::PUSH_KIND_GRADIENT, next, handles[0], allocations[0]),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::StartsWith(daemon::kUnknownCudaIpcSession)));
  server_->Shutdown();
  EXPECT_EQ(server_->sessions(), 0);
}

TEST_F(CudaIpcServerTest, PullsWriteTheVersionIntoTheTrainersMemory) {
  Reference ref(cluster_.resolved());
  const Layout& layout = cluster_.layout();
  cluster_.PushInitial(ref);
  cluster_.PushGrads(0);
  for (const auto& stats : cluster_.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  const std::vector<uint64_t> sessions = {Attach(0), Attach(1)};
  // Each rank's destination at an offset inside one allocation, with guard bytes around it.
  std::vector<uint8_t> allocation(8 << 20, 0xA5);
  const std::string handle = memory_.Export(&allocation);
  const uint64_t offset = 4096 + 8;
  for (const Bucket& b : layout.buckets) {
    for (const Shard& s : b.shards) {
      std::fill(allocation.begin(), allocation.end(), 0xA5);
      auto pulled = PullInto(sessions[s.rank], s.rank, b.index, s.rank, 1, handle, allocation, offset);
      ASSERT_THAT(pulled, IsOk());
      absl::StatusOr<daemon::PullResult> served = cluster_.Pull(b.index, s.rank, 1);
      ASSERT_THAT(served, IsOk());
      const daemon::QuantizedShard& q = *served->shard;
      EXPECT_EQ(pulled->header().SerializeAsString(), daemon::PullHeaderOf(*served).SerializeAsString());
      EXPECT_FALSE(pulled->header().unchanged());
      EXPECT_FALSE(pulled->from_device_memory());  // a CPU daemon's versions are in host memory
      EXPECT_EQ(pulled->scales(), std::string(q.scales.begin(), q.scales.end()));
      ASSERT_TRUE(std::equal(q.data.begin(), q.data.end(), allocation.begin() + offset)) << "bucket " << b.index;
      EXPECT_EQ(allocation[offset - 1], 0xA5);
      EXPECT_EQ(allocation[offset + q.data.size()], 0xA5);
    }
  }
  EXPECT_EQ(memory_.still_open(), 0);
  // A version not decided yet: the pull waits, until its deadline or until its trainer goes away.
  EXPECT_THAT(PullInto(sessions[0], 0, 0, 0, 2, handle, allocation, 0, -1, absl::Milliseconds(100)).status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(
      PullInto(sessions[0], 0, 0, 0, 2, handle, allocation, 0, -1, absl::Seconds(30), [] { return true; }).status(),
      StatusIs(absl::StatusCode::kCancelled));
  EXPECT_EQ(memory_.opens(), static_cast<int>(2 * layout.buckets.size()));
}

// The trainer may reuse its destination once its call ended: a pull whose trainer went away
// writes nothing, and a write already running ends before the session's Detach answers.
TEST_F(CudaIpcServerTest, NoPullWritesAfterItsTrainerWentAwayOrDetached) {
  Reference ref(cluster_.resolved());
  cluster_.PushInitial(ref);
  const uint64_t session = Attach(0);
  const Bucket& b = cluster_.layout().buckets[0];
  std::vector<uint8_t> allocation(static_cast<size_t>(DataBytes(b.format, b.shard_numel)), 0xA5);
  const std::string handle = memory_.Export(&allocation);
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, handle, allocation, 0, -1, absl::Seconds(10), [] { return true; }).status(),
              StatusIs(absl::StatusCode::kCancelled));
  EXPECT_EQ(memory_.opens(), 0);
  EXPECT_TRUE(std::all_of(allocation.begin(), allocation.end(), [](uint8_t v) { return v == 0xA5; }));

  absl::Notification started, may_end, detached;
  memory_.write_started_ = &started;
  memory_.write_may_end_ = &may_end;
  absl::StatusOr<v1::CudaIpcPullResponse> pulled;
  std::thread puller([&] { pulled = PullInto(session, 0, 0, 0, 0, handle, allocation); });
  started.WaitForNotification();
  v1::DetachCudaIpcRequest detach;
  detach.set_session_id(session);
  detach.set_job_id(kJob);
  detach.set_job_token(kToken);
  std::thread detacher([&] {
    // Bounded by its deadline, it says a write still runs; without one it waits.
    EXPECT_THAT(server_->Detach(detach, absl::Now() + absl::Milliseconds(50)),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("still writing")));
    EXPECT_THAT(server_->Detach(detach), IsOk());
    detached.Notify();
  });
  EXPECT_FALSE(detached.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  may_end.Notify();
  detached.WaitForNotification();
  puller.join();
  detacher.join();
  EXPECT_THAT(pulled, IsOk());
  EXPECT_EQ(server_->sessions(), 0);
  // A session that ended already: its Detach answers at once.
  v1::DetachCudaIpcRequest again;
  again.set_session_id(session);
  again.set_job_id(kJob);
  EXPECT_THAT(server_->Detach(again), IsOk());

  // A pull waiting for its version when its session is detached writes nothing once the version
  // comes.
  memory_.write_started_ = nullptr;
  std::fill(allocation.begin(), allocation.end(), 0xA5);
  const uint64_t waiting = Attach(0);
  absl::StatusOr<v1::CudaIpcPullResponse> late;
  std::thread waiter([&] { late = PullInto(waiting, 0, 0, 0, 1, handle, allocation); });
  absl::SleepFor(absl::Milliseconds(100));
  detach.set_session_id(waiting);
  EXPECT_THAT(server_->Detach(detach), IsOk());
  cluster_.PushGrads(0);
  for (const auto& stats : cluster_.Finish(0, 1e-3)) EXPECT_THAT(stats.status(), IsOk());
  waiter.join();
  EXPECT_THAT(late, StatusIs(absl::StatusCode::kUnavailable, ::testing::StartsWith(daemon::kUnknownCudaIpcSession)));
  EXPECT_TRUE(std::all_of(allocation.begin(), allocation.end(), [](uint8_t v) { return v == 0xA5; }));
}

TEST_F(CudaIpcServerTest, BadPullsAreRefusedBeforeAnythingIsWritten) {
  Reference ref(cluster_.resolved());
  cluster_.PushInitial(ref);
  const uint64_t session = Attach(0);
  const Bucket& b = cluster_.layout().buckets[0];
  const int64_t bytes = DataBytes(b.format, b.shard_numel);
  std::vector<uint8_t> allocation(static_cast<size_t>(bytes) + 64, 0xA5);
  const std::string handle = memory_.Export(&allocation);
  auto untouched = [&] {
    return std::all_of(allocation.begin(), allocation.end(), [](uint8_t v) { return v == 0xA5; });
  };
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, handle, allocation, 128).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the exported allocation")));
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, handle, allocation, 0, bytes - 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("packed data has")));
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, "short", allocation).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("64")));
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, std::string(64, 'x'), allocation).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unknown handle")));
  // Another rank's pull on this session, an unknown session.
  EXPECT_THAT(PullInto(session, 1, 0, 1, 0, handle, allocation).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("rank 0")));
  EXPECT_THAT(PullInto(session + 1, 0, 0, 0, 0, handle, allocation).status(),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::StartsWith(daemon::kUnknownCudaIpcSession)));
  EXPECT_TRUE(untouched());
  // A delta, or a reader's token, goes over PullParams.
  v1::CudaIpcPullRequest r;
  r.set_session_id(session);
  r.mutable_request()->set_job_id(kJob);
  r.mutable_request()->set_job_token(kToken);
  r.mutable_request()->set_delta_chunk_bytes(64 << 10);
  r.mutable_memory()->set_handle(handle);
  EXPECT_THAT(server_->Pull(r, absl::Now() + absl::Seconds(1), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("delta")));
  cluster_.AssignAll("reader-token");
  r.mutable_request()->set_delta_chunk_bytes(0);
  r.mutable_request()->set_job_token("reader-token");
  EXPECT_THAT(server_->Pull(r, absl::Now() + absl::Seconds(1), nullptr).status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  // A copy that fails is reported.
  memory_.fail_copies_ = true;
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, handle, allocation).status(),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("fake failure")));
  memory_.fail_copies_ = false;
  EXPECT_THAT(PullInto(session, 0, 0, 0, 0, handle, allocation), IsOk());
  EXPECT_FALSE(untouched());
  EXPECT_EQ(memory_.still_open(), 0);
  EXPECT_EQ(server_->mappings(), 0);
}

// A daemon whose state memory is staged (a GPU's, here its stand-in on the CPU).
class CudaIpcServerStagedTest : public CudaIpcServerTest {
 protected:
  CudaIpcServerStagedTest() : CudaIpcServerTest(Staged()) {}
  static kernels::StateMemory* Staged() {
    static kernels::StateMemory* const memory = kernels::HostStateMemory(nullptr, /*staged=*/true).release();
    return memory;
  }
};

// On a staged (GPU) daemon a pull of the newest version copies from where the step cast it
// (device to device on a GPU); an older version, or the newest once the next cast began, comes
// from the host copy; and the next cast waits for a copy in progress before it overwrites.
TEST_F(CudaIpcServerStagedTest, PullsOfTheNewestVersionCopyFromTheCastOutput) {
  Reference ref(cluster_.resolved());
  cluster_.PushInitial(ref);
  cluster_.PushGrads(0);
  for (const auto& stats : cluster_.Finish(0, 1e-3)) ASSERT_THAT(stats.status(), IsOk());
  const uint64_t session = Attach(0);
  const Bucket& b = cluster_.layout().buckets[0];
  std::vector<uint8_t> allocation(static_cast<size_t>(DataBytes(b.format, b.shard_numel)));
  const std::string handle = memory_.Export(&allocation);
  auto expect_pulled = [&](int64_t version, bool from_device) {
    auto pulled = PullInto(session, 0, 0, 0, version, handle, allocation);
    ASSERT_THAT(pulled, IsOk());
    EXPECT_EQ(pulled->from_device_memory(), from_device) << "version " << version;
    absl::StatusOr<daemon::PullResult> served = cluster_.Pull(0, 0, version);
    ASSERT_THAT(served, IsOk());
    EXPECT_TRUE(std::equal(allocation.begin(), allocation.end(), served->shard->data.begin())) << "version " << version;
  };
  expect_pulled(1, true);
  expect_pulled(0, false);

  // Step 1's cast waits while a pull copies version 1 out of the cast output.
  absl::Notification started, may_end, finished;
  memory_.write_started_ = &started;
  memory_.write_may_end_ = &may_end;
  absl::StatusOr<v1::CudaIpcPullResponse> slow;
  std::thread puller([&] { slow = PullInto(session, 0, 0, 0, 1, handle, allocation); });
  started.WaitForNotification();
  std::thread stepper([&] {
    cluster_.PushGrads(1);
    for (const auto& stats : cluster_.Finish(1, 1e-3)) EXPECT_THAT(stats.status(), IsOk());
    finished.Notify();
  });
  EXPECT_FALSE(finished.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  may_end.Notify();
  puller.join();
  stepper.join();
  ASSERT_THAT(slow, IsOk());
  EXPECT_TRUE(slow->from_device_memory());
  absl::StatusOr<daemon::PullResult> version1 = cluster_.Pull(0, 0, 1);
  ASSERT_THAT(version1, IsOk());
  EXPECT_TRUE(std::equal(allocation.begin(), allocation.end(), version1->shard->data.begin()))
      << "the slow pull's bytes are not version 1's: the next cast overwrote them while they were copied";
  memory_.write_started_ = nullptr;
  expect_pulled(2, true);
  expect_pulled(1, false);
}

TEST_F(CudaIpcServerTest, AttachRefusesOtherNodesWrongTokensAndUnknownJobs) {
  v1::AttachCudaIpcRequest other = AttachRequest(0);
  other.set_boot_id("boot-B");
  EXPECT_THAT(server_->Attach(other).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another node")));
  other.clear_boot_id();
  EXPECT_THAT(server_->Attach(other).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  v1::AttachCudaIpcRequest wrong = AttachRequest(0);
  wrong.set_job_token("not-the-token");
  EXPECT_THAT(server_->Attach(wrong).status(), StatusIs(absl::StatusCode::kPermissionDenied));
  // A reader's token reads; it does not push, so it gets no session (which would replace the
  // trainer's).
  cluster_.AssignAll("reader-token");
  wrong.set_job_token("reader-token");
  EXPECT_THAT(server_->Attach(wrong).status(), StatusIs(absl::StatusCode::kPermissionDenied));
  // Another node is told so without being told this host's boot id.
  other.set_boot_id("boot-B");
  EXPECT_THAT(server_->Attach(other).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::Not(HasSubstr(kBoot))));
  v1::AttachCudaIpcRequest unknown = AttachRequest(0);
  unknown.set_job_id("no-such-job");
  EXPECT_THAT(server_->Attach(unknown).status(), StatusIs(absl::StatusCode::kUnavailable));
  unknown.clear_job_id();
  EXPECT_THAT(server_->Attach(unknown).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(server_->sessions(), 0);
  v1::AttachCudaIpcResponse ok = *server_->Attach(AttachRequest(0));
  EXPECT_NE(ok.session_id(), 0u);
  EXPECT_EQ(ok.device_name(), "cuda:0 (fake)");
}

TEST_F(CudaIpcServerTest, BadPushesAreRefusedAndStoreNothing) {
  const uint64_t session = Attach(0);
  const Bucket& b = cluster_.layout().buckets[0];
  const std::vector<float> values = cluster_.GradShard(b, b.shards[0], 0);
  std::vector<uint8_t> allocation(values.size() * 4 + 64);
  const std::string handle = memory_.Export(&allocation);
  // Beyond the allocation's end: the range is checked against the mapped size, not the claim.
  EXPECT_THAT(Push(session, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handle, allocation, 128),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the exported allocation")));
  // Not a handle.
  EXPECT_THAT(Push(session, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, "short", allocation),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("64")));
  // A handle this host cannot open.
  EXPECT_THAT(Push(session, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, std::string(64, 'x'), allocation),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unknown handle")));
  // The copy fails.
  memory_.fail_copies_ = true;
  EXPECT_THAT(Push(session, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handle, allocation),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("fake failure")));
  memory_.fail_copies_ = false;
  // Another job's or rank's header on this session; an unknown session.
  v1::CudaIpcPushRequest r;
  r.set_session_id(session);
  *r.mutable_header() = cluster_.PushHeader(0, 0, -1, 0, v1::PUSH_KIND_INITIAL_PARAMS, values);
  r.mutable_header()->set_job_id("job-2");
  r.mutable_memory()->set_handle(handle);
  EXPECT_THAT(server_->Push(r).status(), StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("job-1")));
  *r.mutable_header() = cluster_.PushHeader(0, 1, -1, 1, v1::PUSH_KIND_INITIAL_PARAMS, values);
  EXPECT_THAT(server_->Push(r).status(), StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("rank 0")));
  r.set_session_id(session + 1);
  EXPECT_THAT(server_->Push(r).status(), StatusIs(absl::StatusCode::kUnavailable));
  // A wrong token in the header is the core's refusal, as for PushGrad.
  r.set_session_id(session);
  *r.mutable_header() = cluster_.PushHeader(0, 0, -1, 0, v1::PUSH_KIND_INITIAL_PARAMS, values);
  r.mutable_header()->set_job_token("not-the-token");
  EXPECT_THAT(server_->Push(r).status(), StatusIs(absl::StatusCode::kPermissionDenied));
  // A CRC-32C trailer announced: a cuda_ipc push has none, so it is refused before the copy.
  const int opens_before = memory_.opens();
  *r.mutable_header() = cluster_.PushHeader(0, 0, -1, 0, v1::PUSH_KIND_INITIAL_PARAMS, values);
  r.mutable_header()->set_crc32c_follows(true);
  EXPECT_THAT(server_->Push(r).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("crc32c_follows")));
  EXPECT_EQ(memory_.opens(), opens_before);
  // Nothing of the failed pushes was stored: the same push now is new, not a duplicate. No
  // mapping outlived its push, failed or not.
  auto pushed = Push(session, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handle, allocation);
  ASSERT_THAT(pushed, IsOk());
  EXPECT_FALSE(pushed->duplicate());
  EXPECT_EQ(memory_.still_open(), 0);
}

TEST_F(CudaIpcServerTest, SessionsEndWhenReplacedOrWhenTheTrainerIsGone) {
  const uint64_t first = Attach(0, /*pid=*/4242);
  // A new session of the same rank (a restarted trainer) replaces the first.
  const uint64_t second = Attach(0, /*pid=*/4343);
  EXPECT_NE(second, first);
  EXPECT_EQ(server_->sessions(), 1);
  const Bucket& b = cluster_.layout().buckets[0];
  const std::vector<float> values = cluster_.GradShard(b, b.shards[0], 0);
  std::vector<uint8_t> allocation(values.size() * 4);
  const std::string handle = memory_.Export(&allocation);
  EXPECT_THAT(Push(first, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handle, allocation),
              StatusIs(absl::StatusCode::kUnavailable));
  ASSERT_THAT(Push(second, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handle, allocation), IsOk());
  // Its process exits without detaching: the next attach (of any trainer) ends its session.
  {
    absl::MutexLock lock(&mu_);
    dead_.insert(4343);
  }
  Attach(1, /*pid=*/4444);
  EXPECT_EQ(server_->sessions(), 1);
  EXPECT_THAT(Push(second, 0, 0, -1, v1::PUSH_KIND_INITIAL_PARAMS, values, handle, allocation),
              StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace mainstay

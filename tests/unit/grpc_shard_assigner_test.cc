// GrpcShardAssigner (server/grpc/grpc_shard_assigner.h) against a real gRPC Shard server on
// loopback: calls to one daemon arrive in order, and a daemon's worker thread and channel end
// once it has had nothing to send for idle_timeout (issue 18, item 10), and come back on demand.
#include "server/grpc/grpc_shard_assigner.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "mainstay/v1/shard.grpc.pb.h"

namespace mainstay::coordinator {
namespace {

// Records the epochs of the AssignShard calls it gets.
class RecordingShard final : public v1::Shard::Service {
 public:
  ::grpc::Status AssignShard(::grpc::ServerContext*, const v1::AssignShardRequest* request,
                             v1::AssignShardResponse*) override {
    absl::MutexLock lock(&mu_);
    epochs_.push_back(request->placement_epoch());
    return ::grpc::Status::OK;
  }
  std::vector<int64_t> WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return epochs_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
    return epochs_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> epochs_ ABSL_GUARDED_BY(mu_);
};

struct Daemon {
  RecordingShard service;
  std::unique_ptr<::grpc::Server> server;
  std::string address;
  Daemon() {
    int port = 0;
    ::grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", ::grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    address = absl::StrCat("127.0.0.1:", port);
  }
  ~Daemon() { server->Shutdown(); }
};

bool WaitUntil(const std::function<bool()>& done, absl::Duration within) {
  const absl::Time deadline = absl::Now() + within;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

v1::AssignShardRequest AssignAt(int64_t epoch) {
  v1::AssignShardRequest r;
  r.set_job_id("job-1");
  r.set_placement_epoch(epoch);
  return r;
}

TEST(GrpcShardAssignerTest, AnIdleDaemonsWorkerEndsAndALaterCallStartsANewOne) {
  Daemon a, b;
  GrpcShardAssignerOptions options;
  options.idle_timeout = absl::Milliseconds(300);
  GrpcShardAssigner assigner(options);
  for (int64_t e = 1; e <= 3; ++e) assigner.Assign(a.address, AssignAt(e));
  assigner.Assign(b.address, AssignAt(1));
  EXPECT_THAT(a.service.WaitFor(3), ::testing::ElementsAre(1, 2, 3));  // in order
  EXPECT_THAT(b.service.WaitFor(1), ::testing::ElementsAre(1));
  EXPECT_EQ(assigner.live_workers(), 2u);
  // Nothing more to send: both workers end (a daemon that went away leaves no thread behind).
  EXPECT_TRUE(WaitUntil([&] { return assigner.live_workers() == 0; }, absl::Seconds(10)));
  // A later call to a daemon starts its worker again and is delivered.
  assigner.Assign(a.address, AssignAt(4));
  EXPECT_THAT(a.service.WaitFor(4), ::testing::ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(assigner.live_workers(), 1u);
}

}  // namespace
}  // namespace mainstay::coordinator

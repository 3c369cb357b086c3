// server/grpc/waiters.h: parked calls are re-run when their key changes, answered at their
// deadline or the server's limit, refused over a limit (nothing parked), and answered at
// shutdown; none holds a thread of its own.
#include "server/grpc/waiters.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace mainstay::grpc_server {
namespace {

using ::testing::HasSubstr;
using Why = Waiters::Why;

// A call that finishes once `ready` is set, recording how it ended.
struct FakeCall {
  std::atomic<bool> ready{false};
  std::atomic<int> attempts{0};
  absl::Notification answered;
  Why why = Why::kChanged;

  Waiters::Attempt Attempt() {
    return [this](Why w) {
      ++attempts;
      if (w == Why::kChanged && !ready.load()) return false;
      why = w;
      answered.Notify();
      return true;
    };
  }
};

Waiters::Options SlowRecheck() {
  Waiters::Options o;
  o.recheck = absl::Seconds(60);  // only notifications (and deadlines) wake the waiter thread
  return o;
}

TEST(WaitersTest, AParkedCallIsAnsweredWhenItsKeyIsNotified) {
  Waiters waiters(SlowRecheck());
  FakeCall call;
  ASSERT_TRUE(waiters.Park("job-1", "ipv4:127.0.0.1:5000", absl::InfiniteFuture(), call.Attempt()).ok());
  // Parking re-runs it once (a change before it parked would otherwise be missed); still not ready.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(call.answered.HasBeenNotified());
  EXPECT_EQ(waiters.parked(), 1);
  call.ready = true;
  waiters.Notify("job-2");  // another job's change does not touch it
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(call.answered.HasBeenNotified());
  waiters.Notify("job-1");
  ASSERT_TRUE(call.answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(call.why, Why::kChanged);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(waiters.parked(), 0);
}

TEST(WaitersTest, NotifyAllReRunsEveryKey) {
  Waiters waiters(SlowRecheck());
  FakeCall a, b;
  ASSERT_TRUE(waiters.Park("job-1", "ipv4:10.0.0.1:1", absl::InfiniteFuture(), a.Attempt()).ok());
  ASSERT_TRUE(waiters.Park("(the KV)", "ipv4:10.0.0.2:1", absl::InfiniteFuture(), b.Attempt()).ok());
  absl::SleepFor(absl::Milliseconds(100));
  a.ready = b.ready = true;
  waiters.NotifyAll();
  EXPECT_TRUE(a.answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(b.answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(WaitersTest, TheRecheckAnswersWithoutANotification) {
  Waiters::Options o;
  o.recheck = absl::Milliseconds(50);
  Waiters waiters(o);
  FakeCall call;
  ASSERT_TRUE(waiters.Park("job-1", "ipv4:127.0.0.1:1", absl::InfiniteFuture(), call.Attempt()).ok());
  call.ready = true;
  EXPECT_TRUE(call.answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(WaitersTest, TheDeadlineAndTheServerLimitEndAWait) {
  Waiters::Options o = SlowRecheck();
  o.max_wait = absl::Milliseconds(300);
  Waiters waiters(o);
  FakeCall by_deadline, by_limit;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(waiters.Park("job-1", "ipv4:127.0.0.1:1", start + absl::Milliseconds(100), by_deadline.Attempt()).ok());
  ASSERT_TRUE(waiters.Park("job-1", "ipv4:127.0.0.1:1", start + absl::Seconds(30), by_limit.Attempt()).ok());
  ASSERT_TRUE(by_deadline.answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(by_deadline.why, Why::kDeadline);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  ASSERT_TRUE(by_limit.answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(by_limit.why, Why::kServerLimit);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(WaitersTest, EachLimitRefusesWithItsFlagAndParksNothing) {
  Waiters::Options o = SlowRecheck();
  o.max_total = 4;
  o.max_per_key = 2;
  o.max_per_peer = 3;
  Waiters waiters(o);
  std::vector<std::unique_ptr<FakeCall>> calls;
  auto park = [&](const std::string& key, const std::string& peer) {
    calls.push_back(std::make_unique<FakeCall>());
    return waiters.Park(key, peer, absl::InfiniteFuture(), calls.back()->Attempt());
  };
  ASSERT_TRUE(park("job-1", "ipv4:10.0.0.1:1").ok());
  ASSERT_TRUE(park("job-1", "ipv4:10.0.0.1:2").ok());  // another port of the same host
  absl::Status s = park("job-1", "ipv4:10.0.0.2:1");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("--max-waiting-calls-per-job 2"));
  ASSERT_TRUE(park("job-2", "ipv4:10.0.0.1:3").ok());
  s = park("job-3", "ipv4:10.0.0.1:4");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("host 10.0.0.1"));
  EXPECT_THAT(s.message(), HasSubstr("--max-waiting-calls-per-peer 3"));
  ASSERT_TRUE(park("job-3", "ipv6:[::1]:4").ok());
  s = park("job-4", "ipv4:10.0.0.9:1");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("--max-waiting-calls 4"));
  EXPECT_EQ(waiters.parked(), 4);
  // An answered call frees its places.
  calls[0]->ready = true;
  waiters.Notify("job-1");
  ASSERT_TRUE(calls[0]->answered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(park("job-1", "ipv4:10.0.0.2:1").ok());
  waiters.Shutdown();  // answers the rest while `calls` still holds them
}

TEST(WaitersTest, ShutdownAnswersEveryParkedCallAndRefusesNewOnes) {
  Waiters waiters(SlowRecheck());
  FakeCall a, b;
  ASSERT_TRUE(waiters.Park("job-1", "ipv4:127.0.0.1:1", absl::InfiniteFuture(), a.Attempt()).ok());
  ASSERT_TRUE(waiters.Park("job-2", "ipv4:127.0.0.1:1", absl::InfiniteFuture(), b.Attempt()).ok());
  waiters.Shutdown();
  EXPECT_TRUE(a.answered.HasBeenNotified());
  EXPECT_TRUE(b.answered.HasBeenNotified());
  EXPECT_EQ(a.why, Why::kStopping);
  FakeCall late;
  EXPECT_EQ(waiters.Park("job-1", "ipv4:127.0.0.1:1", absl::InfiniteFuture(), late.Attempt()).code(),
            absl::StatusCode::kUnavailable);
  waiters.Shutdown();  // idempotent
}

TEST(WaitersTest, PeerHostDropsThePort) {
  EXPECT_EQ(PeerHost("ipv4:10.1.2.3:5555"), "10.1.2.3");
  EXPECT_EQ(PeerHost("ipv6:[fe80::1]:5555"), "fe80::1");
  EXPECT_EQ(PeerHost("unix:/tmp/socket"), "unix:/tmp/socket");
}

}  // namespace
}  // namespace mainstay::grpc_server

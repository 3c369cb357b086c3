// The coordinator's admin token check (server/coordinator/admin_auth.h) and the daemon's
// step drain (server/daemon/step_drain.h), both transport-free.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "server/coordinator/admin_auth.h"
#include "server/daemon/step_drain.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

TEST(AdminAuthTest, WithoutATokenEveryCallPasses) {
  coordinator::AdminAuth auth;
  EXPECT_FALSE(auth.enabled());
  EXPECT_THAT(auth.Check("", "ListJobs"), IsOk());
  EXPECT_THAT(auth.Check("anything", "ListJobs"), IsOk());
  EXPECT_FALSE(coordinator::AdminAuth("").enabled());
}

TEST(AdminAuthTest, OnlyTheExactTokenPassesAndMessagesNeverEchoIt) {
  coordinator::AdminAuth auth(kToken);
  EXPECT_TRUE(auth.enabled());
  EXPECT_THAT(auth.Check(kToken, "ListJobs"), IsOk());
  EXPECT_THAT(auth.Check("", "ListJobs"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("ListJobs needs the coordinator's admin token")));
  for (const std::string& wrong : {std::string(kToken) + "0", std::string(kToken).substr(1), std::string("x"),
                                  std::string(kToken).substr(0, 31) + "g"}) {
    absl::Status status = auth.Check(wrong, "DeleteJob");
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("DeleteJob"))) << wrong;
    EXPECT_THAT(std::string(status.message()), Not(HasSubstr(wrong)));
    EXPECT_THAT(std::string(status.message()), Not(HasSubstr(kToken)));
  }
}

class TokenFileTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& text) {
    std::FILE* f = std::fopen(path_.c_str(), "w");
    std::fputs(text.c_str(), f);
    std::fclose(f);
    return path_;
  }
  void TearDown() override { std::remove(path_.c_str()); }
  const std::string path_ = ::testing::TempDir() + "/admin_auth_test_token";
};

TEST_F(TokenFileTest, TrailingNewlineIsDroppedAndBadFilesAreInvalidArgumentNamingThePath) {
  EXPECT_THAT(coordinator::AdminAuth::ReadTokenFile(Write(std::string(kToken) + "\n")),
              ::testing::Eq(absl::StatusOr<std::string>(kToken)));
  EXPECT_THAT(coordinator::AdminAuth::ReadTokenFile(Write("\n")).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is empty")));
  absl::Status short_token = coordinator::AdminAuth::ReadTokenFile(Write("secret-ish\n")).status();
  EXPECT_THAT(short_token, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shorter than 16")));
  EXPECT_THAT(std::string(short_token.message()), Not(HasSubstr("secret-ish")));
  EXPECT_THAT(coordinator::AdminAuth::ReadTokenFile("/nonexistent/token").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/nonexistent/token: cannot read")));
}

v1::JobProgress Progress(const std::string& job, int64_t committed_step, int64_t version) {
  v1::JobProgress p;
  p.set_job_id(job);
  p.set_committed_step(committed_step);
  p.set_version(version);
  return p;
}

TEST(StepDrainTest, BeforeTheDrainEveryPushIsAdmitted) {
  daemon::StepDrain drain;
  EXPECT_FALSE(drain.draining());
  EXPECT_THAT(drain.AdmitPush("a", -1), IsOk());
  EXPECT_THAT(drain.AdmitPush("a", 7), IsOk());
}

TEST(StepDrainTest, WhileDrainingOnlyTheStepInFlightIsAdmitted) {
  daemon::StepDrain drain;
  ASSERT_THAT(drain.AdmitPush("a", 3), IsOk());   // a: step 3 in flight (2 committed)
  ASSERT_THAT(drain.AdmitPush("b", 5), IsOk());   // b: step 5 already committed
  ASSERT_THAT(drain.AdmitPush("c", -1), IsOk());  // c: version 0 in flight
  const auto in_flight = drain.Begin({Progress("a", 2, 3), Progress("b", 5, 6), Progress("c", -1, -1)});
  EXPECT_EQ(in_flight, (std::map<std::string, int64_t>{{"a", 3}, {"c", -1}}));
  EXPECT_TRUE(drain.draining());
  EXPECT_THAT(drain.AdmitPush("a", 3), IsOk());
  EXPECT_THAT(drain.AdmitPush("a", 4), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("only step 3")));
  EXPECT_THAT(drain.AdmitPush("b", 6), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no step of the job")));
  EXPECT_THAT(drain.AdmitPush("c", -1), IsOk());
  EXPECT_THAT(drain.AdmitPush("c", 0), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(drain.AdmitPush("new", -1), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(drain.Begin({}), in_flight);  // idempotent
}

TEST(StepDrainTest, AwaitInFlightEndsWhenTheStepsAreDecidedOrTheJobIsGoneElseAtTheDeadline) {
  daemon::StepDrain drain;
  ASSERT_THAT(drain.AdmitPush("a", 0), IsOk());
  ASSERT_THAT(drain.AdmitPush("b", 4), IsOk());
  drain.Begin({Progress("a", -1, 0), Progress("b", 3, 4)});
  int polls = 0;
  // a's step 0 commits at the third poll; b disappears (dropped) at the fourth.
  EXPECT_THAT(drain.AwaitInFlight(
                  [&] {
                    ++polls;
                    std::vector<v1::JobProgress> now = {Progress("a", polls >= 3 ? 0 : -1, polls >= 3 ? 1 : 0)};
                    if (polls < 4) now.push_back(Progress("b", 3, 4));
                    return now;
                  },
                  absl::Now() + absl::Seconds(30), absl::Milliseconds(1)),
              IsOk());
  EXPECT_EQ(polls, 4);
  EXPECT_THAT(drain.AwaitInFlight([] { return std::vector<v1::JobProgress>{Progress("a", -1, 0)}; },
                                  absl::Now() + absl::Milliseconds(20), absl::Milliseconds(1)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("a step 0")));
}

TEST(StepDrainTest, AStepSkippedForNonFiniteGradientsCountsAsDecided) {
  EXPECT_TRUE(daemon::StepDecided(Progress("a", 4, 4), 4));  // skipped: no new version
  EXPECT_FALSE(daemon::StepDecided(Progress("a", 3, 4), 4));
  EXPECT_TRUE(daemon::StepDecided(Progress("a", -1, 0), -1));
  EXPECT_FALSE(daemon::StepDecided(Progress("a", -1, -1), -1));
}

}  // namespace
}  // namespace mainstay

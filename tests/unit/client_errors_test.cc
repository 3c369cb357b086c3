// The client's error mapping (ErrorDetail in trailing metadata -> absl::Status payload ->
// GetErrorInfo, retry classification), its CRC-32C and its thread pool: no daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "common/crc32c.h"
#include "client/src/rpc_errors.h"
#include "client/src/thread_pool.h"
#include "common/status.h"
#include "mainstay/client.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using client_internal::Classify;
using client_internal::RetryAction;
using client_internal::StatusFromCall;
using client_internal::TrailingMetadata;
using ::mainstay::testing::StatusIs;

absl::Status WithDetail(grpc::StatusCode code, int64_t epoch, int64_t committed_step, int64_t version) {
  v1::ErrorDetail detail;
  detail.set_placement_epoch(epoch);
  detail.set_committed_step(committed_step);
  detail.set_version(version);
  const std::string bytes = detail.SerializeAsString();
  TrailingMetadata trailing;
  trailing.emplace(grpc::string_ref("other-bin"), grpc::string_ref("zz"));
  trailing.emplace(grpc::string_ref(client_internal::kErrorDetailMetadataKey), grpc::string_ref(bytes));
  return StatusFromCall(grpc::Status(code, "daemon says no"), trailing);
}

TEST(ClientErrorsTest, ErrorDetailFromTrailingMetadataReachesTheCaller) {
  const absl::Status s = WithDetail(grpc::StatusCode::FAILED_PRECONDITION, 9, 41, 42);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition, "daemon says no"));
  // Context added on the way up keeps the detail.
  const absl::Status annotated = Annotate(s, "PushGrad bucket 0 shard 1 step 42");
  std::optional<ErrorInfo> info = GetErrorInfo(annotated);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->placement_epoch, 9);
  EXPECT_EQ(info->committed_step, 41);
  EXPECT_EQ(info->version, 42);
}

TEST(ClientErrorsTest, NoOrUnparseableDetailGivesNoErrorInfo) {
  EXPECT_FALSE(GetErrorInfo(absl::UnavailableError("x")).has_value());
  TrailingMetadata trailing;
  trailing.emplace(grpc::string_ref(client_internal::kErrorDetailMetadataKey), grpc::string_ref("\xff\xff\xff"));
  const absl::Status s = StatusFromCall(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "m"), trailing);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_FALSE(GetErrorInfo(s).has_value());
  EXPECT_TRUE(StatusFromCall(grpc::Status::OK, trailing).ok());
}

TEST(ClientErrorsTest, CodesMapOneToOne) {
  const TrailingMetadata none;
  EXPECT_THAT(StatusFromCall(grpc::Status(grpc::StatusCode::ABORTED, "a"), none), StatusIs(absl::StatusCode::kAborted));
  EXPECT_THAT(StatusFromCall(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "a"), none),
              StatusIs(absl::StatusCode::kUnauthenticated));
}

TEST(ClientErrorsTest, UnavailableIsRetriedWithBackoff) {
  EXPECT_EQ(Classify(absl::UnavailableError("not assigned yet"), 3, true), RetryAction::kBackoff);
  EXPECT_EQ(Classify(absl::UnavailableError("coordinator down"), 0, false), RetryAction::kBackoff);
}

TEST(ClientErrorsTest, NewerEpochRereadsThePlacementOnlyWhenRoutedByPlacement) {
  const absl::Status newer = WithDetail(grpc::StatusCode::FAILED_PRECONDITION, 4, 0, 0);
  EXPECT_EQ(Classify(newer, 3, true), RetryAction::kRefreshPlacement);
  EXPECT_EQ(Classify(newer, 4, true), RetryAction::kFail);   // not newer than ours
  EXPECT_EQ(Classify(newer, 3, false), RetryAction::kFail);  // a coordinator call
  // A committed step, not an epoch: the caller must act.
  EXPECT_EQ(Classify(WithDetail(grpc::StatusCode::FAILED_PRECONDITION, 0, 7, 0), 3, true), RetryAction::kFail);
}

TEST(ClientErrorsTest, OtherCodesAreReturnedToTheCaller) {
  for (absl::StatusCode code : {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                                absl::StatusCode::kAborted, absl::StatusCode::kDeadlineExceeded,
                                absl::StatusCode::kUnauthenticated, absl::StatusCode::kDataLoss}) {
    EXPECT_EQ(Classify(absl::Status(code, "x"), 1, true), RetryAction::kFail) << code;
  }
}

TEST(ClientErrorsTest, Crc32cMatchesTheCastagnoliCheckValues) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::string ones(32, '\xff');
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  // Extending piecewise equals one pass, across the 8-byte fast path's boundaries.
  std::string text = "The quick brown fox jumps over the lazy dog, twice: the quick brown fox.";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    EXPECT_EQ(Crc32cExtend(Crc32c(text.data(), cut), text.data() + cut, text.size() - cut),
              Crc32c(text.data(), text.size()));
  }
}

TEST(ClientErrorsTest, ThreadPoolRunsEveryTaskEvenWhenDestroyedEarly) {
  std::atomic<int> ran{0};
  {
    client_internal::ThreadPool pool(3);
    for (int i = 0; i < 200; ++i) pool.Schedule([&] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 200);
}

TEST(ClientErrorsTest, HandleReadyAndInvalid) {
  PushHandle ready = PushHandle::Ready(PushResult{true, 5, 1});
  EXPECT_TRUE(ready.ready());
  ASSERT_TRUE(ready.Wait().ok());
  EXPECT_TRUE(ready.Wait()->duplicate);
  PushHandle invalid;
  EXPECT_FALSE(invalid.valid());
  EXPECT_FALSE(invalid.ready());
  EXPECT_THAT(invalid.Wait(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(ClientErrorsTest, ConnectRejectsBadOptionsBeforeAnyCall) {
  ClientOptions o;
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("coordinator")));
  o.coordinator = "127.0.0.1:1";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument));  // neither spec nor job
  o.job_id = "j";
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("job_token")));
  o.job_token = "t";
  o.chunk_bytes = 8 << 20;
  EXPECT_THAT(Client::Connect(o), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("chunk_bytes")));
}

TEST(ClientErrorsTest, UnreachableCoordinatorIsUnavailableAfterTheDeadline) {
  ClientOptions o;
  o.coordinator = "127.0.0.1:1";  // nothing listens there
  o.job_id = "j";
  o.job_token = "t";
  o.timeout = std::chrono::milliseconds(600);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(o);
  EXPECT_THAT(c, StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("attempts")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace mainstay

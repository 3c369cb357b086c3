#include "common/status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/grpc_status.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  MAINSTAY_ASSIGN_OR_RETURN(int h, Half(x));
  MAINSTAY_ASSIGN_OR_RETURN(h, Half(h));
  return h;
}

absl::Status CheckEven(int x) {
  MAINSTAY_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusTest, MacrosPropagateErrorsAndValues) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckEven(4), IsOk());
  EXPECT_THAT(CheckEven(3), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StatusTest, AnnotateKeepsCodeAndPrefixesMessage) {
  absl::Status s = Annotate(absl::NotFoundError("no job 7"), "PullParams");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, "PullParams: no job 7"));
  EXPECT_THAT(Annotate(absl::OkStatus(), "x"), IsOk());
  EXPECT_THAT(InvalidArgumentError("tensors[1].shape[0]", "must be positive, got ", -1),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensors[1].shape[0]: must be positive, got -1"));
}

TEST(StatusTest, GrpcConversionRoundTripsEveryCode) {
  for (int code = 0; code <= 16; ++code) {
    absl::Status s(static_cast<absl::StatusCode>(code), code == 0 ? "" : "msg");
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
  EXPECT_THAT(FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(99), "weird")),
              StatusIs(absl::StatusCode::kUnknown, "weird"));
}

}  // namespace
}  // namespace mainstay

// GoogleTest matchers for absl::Status and absl::StatusOr<T>.
//
//   EXPECT_THAT(DoIt(), IsOk());
//   EXPECT_THAT(ComputeLayout(t, o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("D")));
//   MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeLayout(t, o));
#ifndef MAINSTAY_TESTS_TESTING_STATUS_MATCHERS_H_
#define MAINSTAY_TESTS_TESTING_STATUS_MATCHERS_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mainstay::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, "has status code " + ::testing::PrintToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has status code " + ::testing::PrintToString(code) + " and a matching message") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code &&
         ::testing::Matcher<std::string>(message_matcher).Matches(std::string(s.message()));
}

}  // namespace mainstay::testing

#define MAINSTAY_TESTING_CONCAT_INNER_(a, b) a##b
#define MAINSTAY_TESTING_CONCAT_(a, b) MAINSTAY_TESTING_CONCAT_INNER_(a, b)
#define MAINSTAY_ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                          \
  auto MAINSTAY_TESTING_CONCAT_(statusor_, __LINE__) = (rexpr);                            \
  ASSERT_TRUE(MAINSTAY_TESTING_CONCAT_(statusor_, __LINE__).ok())                          \
      << MAINSTAY_TESTING_CONCAT_(statusor_, __LINE__).status();                           \
  lhs = std::move(MAINSTAY_TESTING_CONCAT_(statusor_, __LINE__)).value()

#endif  // MAINSTAY_TESTS_TESTING_STATUS_MATCHERS_H_

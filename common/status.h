// Status helpers shared by every Mainstay library.
//
// Errors are absl::Status / absl::StatusOr<T>; the code says what the caller should do
// (UNAVAILABLE: retry the call, ABORTED: retry the step, FAILED_PRECONDITION: fix state
// first, INVALID_ARGUMENT: never retry). There is no project-specific error enum.
//
// Thread safety: everything here is stateless.
#ifndef MAINSTAY_COMMON_STATUS_H_
#define MAINSTAY_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define MAINSTAY_STATUS_CONCAT_INNER_(a, b) a##b
#define MAINSTAY_STATUS_CONCAT_(a, b) MAINSTAY_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function when not OK.
#define MAINSTAY_RETURN_IF_ERROR(expr)                                      \
  do {                                                                      \
    ::absl::Status mainstay_status_ = (expr);                               \
    if (!mainstay_status_.ok()) return mainstay_status_;                    \
  } while (0)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status when not OK.
// `lhs` may be a declaration: MAINSTAY_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(...));
#define MAINSTAY_ASSIGN_OR_RETURN(lhs, rexpr) \
  MAINSTAY_ASSIGN_OR_RETURN_IMPL_(MAINSTAY_STATUS_CONCAT_(mainstay_statusor_, __LINE__), lhs, rexpr)

#define MAINSTAY_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                    \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

namespace mainstay {

// Returns `status` with `context` prepended to its message ("context: message"), keeping
// its code and payloads. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// Convenience builders for the errors used everywhere; `field` is the path of the
// offending input field (for example "tensors[3].shape[1]").
template <typename... Args>
absl::Status InvalidArgumentError(absl::string_view field, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", args...));
}

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_STATUS_H_

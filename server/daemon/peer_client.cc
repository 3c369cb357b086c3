#include "server/daemon/peer_client.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace mainstay::daemon {

namespace {

absl::StatusOr<StepFault> ParseOne(absl::string_view spec) {
  StepFault fault;
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  int64_t step = 0;
  if (parts.size() == 3 && parts[0] == "lose-reduction" && absl::SimpleAtoi(parts[1], &step) && step >= -1 &&
      (parts[2] == "stats" || parts[2] == "amax")) {
    fault.step = step;
    fault.reduction = parts[2] == "stats" ? 0 : 1;
    return fault;
  }
  if (parts.size() == 2 && parts[0] == "drop-replica-input" && absl::SimpleAtoi(parts[1], &step) && step >= 0) {
    fault.kind = StepFault::Kind::kDropReplicaInput;
    fault.step = step;
    return fault;
  }
  static const std::map<absl::string_view, StepFault::Phase> kPhases = {
      {"input", StepFault::Phase::kInput},   {"finish", StepFault::Phase::kFinish},
      {"update", StepFault::Phase::kUpdate}, {"decision", StepFault::Phase::kDecision},
      {"copy", StepFault::Phase::kCopy},     {"install", StepFault::Phase::kInstall},
      {"pull", StepFault::Phase::kPull}};
  static const std::map<absl::string_view, StepFault::Role> kRoles = {
      {"any", StepFault::Role::kAny}, {"primary", StepFault::Role::kPrimary},
      {"replica-only", StepFault::Role::kReplicaOnly}};
  if ((parts.size() == 3 || parts.size() == 4) && parts[0] == "crash-at" && kPhases.count(parts[1]) &&
      absl::SimpleAtoi(parts[2], &step) && step >= 0 && (parts.size() == 3 || kRoles.count(parts[3]))) {
    fault.kind = StepFault::Kind::kCrash;
    fault.phase = kPhases.at(parts[1]);
    fault.step = step;
    if (parts.size() == 4) fault.role = kRoles.at(parts[3]);
    return fault;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--inject-fault: '", spec,
      "' is not 'lose-reduction:STEP:stats', 'lose-reduction:STEP:amax' (STEP >= -1), 'drop-replica-input:STEP', "
      "'crash-at:PHASE:STEP[:ROLE]' (STEP >= 0, PHASE one of input, finish, update, decision, copy, install, "
      "pull; ROLE one of any, primary, replica-only) or 'none'"));
}

}  // namespace

absl::StatusOr<StepFaults> ParseStepFaults(absl::string_view spec, const std::string& once_file) {
  StepFaults faults;
  if (spec.empty() || spec == "none") return faults;
  for (absl::string_view one : absl::StrSplit(spec, ',')) {
    MAINSTAY_ASSIGN_OR_RETURN(StepFault fault, ParseOne(one));
    fault.once_file = once_file;
    faults.list.push_back(std::move(fault));
  }
  return faults;
}

bool StepFaults::Is(StepFault::Kind kind, int64_t step) const {
  return std::any_of(list.begin(), list.end(), [&](const StepFault& f) { return f.Is(kind, step); });
}

bool StepFaults::LosesReduction(int64_t step, int index) const {
  return std::any_of(list.begin(), list.end(), [&](const StepFault& f) {
    return f.Is(StepFault::Kind::kLoseReduction, step) && f.reduction == index;
  });
}

bool StepFaults::CrashesAt(StepFault::Phase phase, int64_t s, bool holds_primary, bool holds_replica) const {
  for (const StepFault& f : list) {
    if (f.kind != StepFault::Kind::kCrash || f.phase != phase) continue;
    const bool at = phase == StepFault::Phase::kCopy || phase == StepFault::Phase::kInstall ? s >= f.step : s == f.step;
    const bool role_ok = f.role == StepFault::Role::kAny || (f.role == StepFault::Role::kPrimary && holds_primary) ||
                         (f.role == StepFault::Role::kReplicaOnly && holds_replica && !holds_primary);
    if (!at || !role_ok) continue;
    if (f.once_file.empty()) return true;
    const int fd = ::open(f.once_file.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);  // the first daemon to get here
    if (fd < 0) return false;
    ::close(fd);
    return true;
  }
  return false;
}

}  // namespace mainstay::daemon

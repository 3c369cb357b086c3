// Minimal structured logging to stderr: "2026-12-02T18:04:49.123Z I coordinator: message".
// (Debian 12's abseil predates absl/log.) Thread-safe: one write per line.
#ifndef MAINSTAY_COMMON_LOGGING_H_
#define MAINSTAY_COMMON_LOGGING_H_

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mainstay {

enum class LogLevel { kInfo, kWarning, kError };

inline void Log(LogLevel level, absl::string_view component, absl::string_view message) {
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  const std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
                                        " ", std::string(1, tag), " ", component, ": ", message, "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_LOGGING_H_

// Writes a bound port number for scripts and tests: to a temporary name, then renamed, so a
// reader never sees a partial number. Thread safety: none needed (called once at start-up).
#ifndef MAINSTAY_COMMON_PORT_FILE_H_
#define MAINSTAY_COMMON_PORT_FILE_H_

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mainstay {

inline absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("port file: cannot write ", tmp));
  }
  std::error_code error;
  std::filesystem::rename(tmp, path, error);
  if (error) return absl::InternalError(absl::StrCat("port file: cannot rename to ", path, ": ", error.message()));
  return absl::OkStatus();
}

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_PORT_FILE_H_

// Formatting shared by mainstayctl's commands: JSON of a proto, sizes, times, enum names.
#ifndef MAINSTAY_CLI_OUTPUT_FORMAT_H_
#define MAINSTAY_CLI_OUTPUT_FORMAT_H_

#include <cstdint>
#include <string>

#include <google/protobuf/message.h>

#include "absl/strings/string_view.h"
#include "cli/command.h"

namespace mainstay::cli {

// The message as indented JSON with the proto field names and every field printed.
void PrintJson(const google::protobuf::Message& message, Output& output);
// "DAEMON_STATE_READY" with prefix "DAEMON_STATE_" -> "READY".
std::string EnumShort(const std::string& name, absl::string_view prefix);
// 1536 -> "1.5 KiB".
std::string Bytes(int64_t n);
// Local time "YYYY-MM-DD HH:MM:SS"; "-" for 0.
std::string Time(int64_t unix_ms);

}  // namespace mainstay::cli

#endif  // MAINSTAY_CLI_OUTPUT_FORMAT_H_

#include "cli/output_format.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace mainstay::cli {

void PrintJson(const google::protobuf::Message& message, Output& output) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  output.out << json;
}

std::string EnumShort(const std::string& name, absl::string_view prefix) {
  return absl::StartsWith(name, prefix) ? name.substr(prefix.size()) : name;
}

std::string Bytes(int64_t n) {
  if (n < 1024) return absl::StrCat(n, " B");
  if (n < (int64_t{1} << 20)) return absl::StrFormat("%.1f KiB", n / 1024.0);
  if (n < (int64_t{1} << 30)) return absl::StrFormat("%.1f MiB", n / 1048576.0);
  return absl::StrFormat("%.1f GiB", n / 1073741824.0);
}

std::string Time(int64_t unix_ms) {
  if (unix_ms == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(unix_ms), absl::LocalTimeZone());
}

}  // namespace mainstay::cli

#include "server/coordinator/admin_auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace mainstay::coordinator {
namespace {

std::string Sha256(absl::string_view text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

}  // namespace

AdminAuth::AdminAuth(absl::string_view token) : enabled_(!token.empty()), digest_(Sha256(token)) {}

absl::StatusOr<std::string> AdminAuth::ReadTokenFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("admin token file ", path, ": cannot read: ", std::strerror(errno)));
  }
  std::string text;
  char buffer[1024];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0 && text.size() < (1 << 16)) text.append(buffer, n);
  std::fclose(f);
  absl::StripTrailingAsciiWhitespace(&text);
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat("admin token file ", path, ": is empty"));
  if (text.size() < kMinAdminTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("admin token file ", path, ": the token is shorter than ",
                                                   kMinAdminTokenBytes, " characters (make one with: openssl rand -hex 32)"));
  }
  return text;
}

absl::Status AdminAuth::Check(absl::string_view presented, absl::string_view call) const {
  if (!enabled_) return absl::OkStatus();
  if (presented.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat(call, " needs the coordinator's admin token (mainstayctl --admin-token-file FILE, or the "
                           "request's admin_token / `authorization: Bearer` metadata)"));
  }
  const std::string digest = Sha256(presented);
  if (CRYPTO_memcmp(digest.data(), digest_.data(), digest.size()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(call, ": the admin token is not the coordinator's"));
  }
  return absl::OkStatus();
}

}  // namespace mainstay::coordinator

#include "common/cluster_secret.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace mainstay {
namespace {

std::string Digest(absl::string_view text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

absl::Status Fail(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("cluster secret file ", path, ": ", what));
}

// A new secret in `path`, made atomically: written to a private temporary file, synced, then
// linked into place (link() fails if another process created `path` meanwhile: its file wins).
absl::Status Create(const std::string& path) {
  unsigned char random[32];
  if (RAND_bytes(random, sizeof(random)) != 1) return Fail(path, "cannot draw random bytes for a new secret");
  std::string hex;
  for (unsigned char b : random) absl::StrAppend(&hex, absl::Hex(b, absl::kZeroPad2));
  hex += "\n";
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Fail(path, absl::StrCat("cannot create a new secret: ", std::strerror(errno)));
  const bool written = ::write(fd, hex.data(), hex.size()) == static_cast<ssize_t>(hex.size()) && ::fsync(fd) == 0;
  const int error = errno;
  ::close(fd);
  if (!written) {
    ::unlink(tmp.c_str());
    return Fail(path, absl::StrCat("cannot write a new secret: ", std::strerror(error)));
  }
  const int linked = ::link(tmp.c_str(), path.c_str());
  const int link_error = errno;
  ::unlink(tmp.c_str());
  if (linked != 0 && link_error != EEXIST) {
    return Fail(path, absl::StrCat("cannot create a new secret: ", std::strerror(link_error)));
  }
  if (linked == 0) {
    const std::string dir = path.rfind('/') == std::string::npos ? "." : path.substr(0, path.rfind('/') + 1);
    if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
    Log(LogLevel::kInfo, "security",
        absl::StrCat("generated a new cluster secret in ", path, " (mode 0600): give every daemon a copy ",
                     "(--cluster-secret-file)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ClusterSecret> ClusterSecret::FromValue(absl::string_view value) {
  value = absl::StripTrailingAsciiWhitespace(value);
  if (value.size() < kMinClusterSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret: ", value.size(), " bytes, at least ",
                                                   kMinClusterSecretBytes, " needed (e.g. `openssl rand -hex 32`)"));
  }
  ClusterSecret s;
  s.value_ = std::string(value);
  s.digest_ = Digest(s.value_);
  return s;
}

absl::StatusOr<ClusterSecret> ClusterSecret::Load(const std::string& path, bool create) {
  if (path.empty()) return absl::InvalidArgumentError("cluster secret file: empty path");
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT || !create) return Fail(path, absl::StrCat("cannot read: ", std::strerror(errno)));
    if (absl::Status s = Create(path); !s.ok()) return s;
    if (::stat(path.c_str(), &st) != 0) return Fail(path, absl::StrCat("cannot read: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return Fail(path, "not a regular file");
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Fail(path, absl::StrCat("cannot read: ", std::strerror(errno)));
  std::string text;
  char buffer[512];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0 && text.size() < 65536) text.append(buffer, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return Fail(path, "cannot read");
  const absl::string_view value = absl::StripTrailingAsciiWhitespace(text);
  if (value.empty()) return Fail(path, "the file is empty");
  if (value.size() < kMinClusterSecretBytes) {
    return Fail(path, absl::StrCat("the secret is ", value.size(), " bytes, at least ", kMinClusterSecretBytes,
                                    " are needed (e.g. `openssl rand -hex 32 > ", path, "`)"));
  }
  if ((st.st_mode & 007) != 0) {  // group-readable is a choice (Kubernetes' fsGroup, a mainstay group)
    Log(LogLevel::kWarning, "security",
        absl::StrFormat("cluster secret file %s may be read by other users (mode %04o): chmod 600 it", path,
                        static_cast<unsigned>(st.st_mode & 0777)));
  }
  return FromValue(value);
}

bool ClusterSecret::Matches(absl::string_view presented) const {
  if (digest_.empty()) return false;
  const std::string d = Digest(presented);
  return CRYPTO_memcmp(d.data(), digest_.data(), d.size()) == 0;
}

bool IsLoopbackListenAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) return true;
  const size_t colon = address.rfind(':');
  absl::string_view host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  if (host == "[::1]" || host == "localhost" || host == "ip6-localhost") return true;
  // 127.0.0.0/8, written as four decimal octets.
  if (!absl::StartsWith(host, "127.")) return false;
  int parts = 0;
  for (absl::string_view octet : absl::StrSplit(host, '.')) {
    int v;
    if (!absl::SimpleAtoi(octet, &v) || v < 0 || v > 255) return false;
    ++parts;
  }
  return parts == 4;
}

}  // namespace mainstay

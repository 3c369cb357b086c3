// The systemd readiness protocol (sd_notify(3)) without libsystemd: a server tells its service
// manager "READY=1" once it serves and "STOPPING=1" when it begins a graceful stop, so that
// `Type=notify` units order their dependants correctly and `systemctl start` fails when the
// server never comes up. The protocol is one datagram to the AF_UNIX socket named by
// $NOTIFY_SOCKET (an abstract socket when the name starts with '@'); it is small and stable
// enough that linking libsystemd (and requiring it on every machine, containers included) is
// not worth it.
//
//   if (absl::Status s = SdNotify("READY=1\nSTATUS=serving on 0.0.0.0:7070"); !s.ok()) Log(...);
//
// Outside systemd (NOTIFY_SOCKET unset or empty: a shell, a test, Kubernetes) SdNotify does
// nothing and returns OK, so callers never need to know how they were started. Errors are for
// logging only; a server must not stop because its manager could not be told:
//   INVALID_ARGUMENT   NOTIFY_SOCKET is not an absolute path or '@name' (e.g. systemd's
//                      "vsock:" form, which is not supported here), or is too long;
//   UNAVAILABLE        the socket could not be created or the datagram not sent (errno text).
// Thread safety: safe to call from any thread (reads the environment, uses a fresh socket).
#ifndef MAINSTAY_COMMON_SD_NOTIFY_H_
#define MAINSTAY_COMMON_SD_NOTIFY_H_

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace mainstay {

inline absl::Status SdNotify(absl::string_view state) {
  const char* env = std::getenv("NOTIFY_SOCKET");
  if (env == nullptr || env[0] == '\0') return absl::OkStatus();
  const std::string name = env;
  if (name[0] != '/' && name[0] != '@') {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET='", name, "': expected an absolute path or @abstract-name"));
  }
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  // A path needs its terminating NUL inside sun_path; an abstract name does not have one.
  const size_t limit = sizeof(address.sun_path) - (name[0] == '/' ? 1 : 0);
  if (name.size() > limit) {
    return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET: longer than ", limit, " bytes"));
  }
  std::memcpy(address.sun_path, name.data(), name.size());
  // Abstract names start with a NUL byte and their length is given by the address length, not a
  // terminator (unix(7)).
  if (name[0] == '@') address.sun_path[0] = '\0';
  const socklen_t address_length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());

  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("sd_notify: socket: ", std::strerror(errno)));
  // MSG_NOSIGNAL: a vanished manager must not raise SIGPIPE (servers ignore it anyway).
  const ssize_t sent = sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                              reinterpret_cast<const sockaddr*>(&address), address_length);
  const int send_errno = errno;
  close(fd);
  if (sent < 0) {
    return absl::UnavailableError(absl::StrCat("sd_notify: send to ", name, ": ", std::strerror(send_errno)));
  }
  // A datagram is delivered whole or not at all; a short count would mean a truncated state.
  if (static_cast<size_t>(sent) != state.size()) {
    return absl::UnavailableError(absl::StrCat("sd_notify: sent ", sent, " of ", state.size(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_SD_NOTIFY_H_

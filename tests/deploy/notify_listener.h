// The service manager's side of sd_notify for tests: a bound AF_UNIX datagram socket whose
// name goes into $NOTIFY_SOCKET, and a bounded wait for the next message.
//
// Owns its socket (closed, and a path unlinked, by the destructor). Thread safety: one thread
// per object. Bind errors are INTERNAL with errno's text.
#ifndef MAINSTAY_TESTS_DEPLOY_NOTIFY_LISTENER_H_
#define MAINSTAY_TESTS_DEPLOY_NOTIFY_LISTENER_H_

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mainstay::testing {

class NotifyListener {
 public:
  // `name` as NOTIFY_SOCKET spells it: an absolute path, or '@' + an abstract name.
  static absl::StatusOr<std::unique_ptr<NotifyListener>> Bind(const std::string& name) {
    sockaddr_un address = {};
    address.sun_family = AF_UNIX;
    if (name.empty() || name.size() >= sizeof(address.sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat("bad socket name '", name, "'"));
    }
    std::memcpy(address.sun_path, name.data(), name.size());
    if (name[0] == '@') address.sun_path[0] = '\0';
    const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    const socklen_t length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
    if (bind(fd, reinterpret_cast<const sockaddr*>(&address), length) != 0) {
      const int error = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("bind ", name, ": ", std::strerror(error)));
    }
    return std::unique_ptr<NotifyListener>(new NotifyListener(fd, name));
  }

  ~NotifyListener() {
    close(fd_);
    if (name_[0] == '/') unlink(name_.c_str());
  }
  NotifyListener(const NotifyListener&) = delete;
  NotifyListener& operator=(const NotifyListener&) = delete;

  const std::string& name() const { return name_; }

  // The next datagram, or nullopt when none arrived within `timeout`.
  std::optional<std::string> Receive(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left_ms < 0) return std::nullopt;
      pollfd p = {fd_, POLLIN, 0};
      const int ready = poll(&p, 1, static_cast<int>(left_ms));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return std::nullopt;
      char buffer[4096];
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
      if (n >= 0) return std::string(buffer, static_cast<size_t>(n));
      if (errno != EINTR && errno != EAGAIN) return std::nullopt;
    }
  }

 private:
  NotifyListener(int fd, std::string name) : fd_(fd), name_(std::move(name)) {}
  const int fd_;
  const std::string name_;
};

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_DEPLOY_NOTIFY_LISTENER_H_

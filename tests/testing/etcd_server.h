// A real one-member etcd (Debian's etcd-server) on loopback ports, for the tests of the
// coordinator's etcd store: started in a TempDir, SIGKILLed and restarted on the same data.
//
//   MAINSTAY_ASSERT_OK_AND_ASSIGN(auto etcd, EtcdServer::Start());
//   options.endpoints = {etcd->endpoint()};
//
// Thread safety: one thread per object.
#ifndef MAINSTAY_TESTS_TESTING_ETCD_SERVER_H_
#define MAINSTAY_TESTS_TESTING_ETCD_SERVER_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testing/subprocess.h"

namespace mainstay::testing {

class EtcdServer {
 public:
  // The etcd binary: $MAINSTAY_ETCD_BIN, else /usr/bin/etcd.
  static std::string Binary() {
    const char* bin = std::getenv("MAINSTAY_ETCD_BIN");
    return bin != nullptr ? bin : "/usr/bin/etcd";
  }
  static bool Available() { return ::access(Binary().c_str(), X_OK) == 0; }

  static absl::StatusOr<std::unique_ptr<EtcdServer>> Start() {
    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("mainstay-etcd");
    if (!dir.ok()) return dir.status();
    auto server = std::unique_ptr<EtcdServer>(new EtcdServer(*std::move(dir)));
    server->client_port_ = FreePort();
    server->peer_port_ = FreePort();
    if (absl::Status s = server->Restart(); !s.ok()) return s;
    return server;
  }

  std::string endpoint() const { return absl::StrCat("http://127.0.0.1:", client_port_); }
  // etcd's output so far (for failure messages).
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // Starts etcd (again, on the same data directory) and waits until it serves.
  absl::Status Restart() {
    const std::string client = absl::StrCat("http://127.0.0.1:", client_port_);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port_);
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(
        {.argv = {Binary(), "--name", "t", "--data-dir", dir_->File("data"), "--listen-client-urls", client,
                  "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                  peer, "--initial-cluster", "t=" + peer, "--log-level", "warn"},
         .output_path = log_});
    if (!p.ok()) return p.status();
    process_ = *std::move(p);
    // Serving once its /health (HTTP on the client port) says so.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      if (!process_->Running()) return absl::InternalError(absl::StrCat("etcd exited; see ", log_));
      if (Healthy(client_port_)) return absl::OkStatus();
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::DeadlineExceededError(absl::StrCat("etcd did not serve within 30 s; see ", log_));
  }
  absl::Status Kill() { return process_->Kill().status(); }

 private:
  explicit EtcdServer(std::unique_ptr<TempDir> dir) : dir_(std::move(dir)), log_(dir_->File("etcd.log")) {}

  static int FreePort() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    return ntohs(a.sin_port);
  }
  static bool Healthy(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    timeval timeout{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    std::string answer;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
      const char request[] = "GET /health HTTP/1.0\r\n\r\n";
      if (::write(fd, request, sizeof(request) - 1) == static_cast<ssize_t>(sizeof(request) - 1)) {
        char buf[1024];
        for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) answer.append(buf, static_cast<size_t>(n));
      }
    }
    ::close(fd);
    return answer.find("\"health\":\"true\"") != std::string::npos;
  }

  std::unique_ptr<TempDir> dir_;
  std::string log_;
  int client_port_ = 0, peer_port_ = 0;
  std::unique_ptr<Subprocess> process_;
};

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_TESTING_ETCD_SERVER_H_

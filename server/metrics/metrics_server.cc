#include "server/metrics/metrics_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"

namespace mainstay::metrics {
namespace {

constexpr char kComponent[] = "metrics";
constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

}  // namespace

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("expected HOST:PORT, got '", address, "'"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = -1;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535 || host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected HOST:PORT with a port in [0, 65535], got '", address, "'"));
  }
  return std::make_pair(host, port);
}

struct MetricsServer::Impl {
  httplib::Server http;
  std::thread thread;
  int port = 0;
  std::atomic<bool> shut_down{false};

  ~Impl() { Shutdown(); }

  void Shutdown() {
    if (shut_down.exchange(true)) return;
    http.stop();
    if (thread.joinable()) thread.join();
  }
};

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() = default;
int MetricsServer::port() const { return impl_->port; }
void MetricsServer::Shutdown() { impl_->Shutdown(); }

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(Options options) {
  if (options.registry == nullptr) return absl::InvalidArgumentError("metrics server: registry is required");
  absl::StatusOr<std::pair<std::string, int>> address = SplitHostPort(options.listen_address);
  if (!address.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics listen address: ", address.status().message()));
  }
  const auto& [host, requested_port] = *address;
  auto impl = std::make_unique<Impl>();
  const int threads = std::max(options.threads, 1);
  impl->http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  // httplib's default also sets SO_REUSEPORT, which would let a second daemon bind the same
  // port silently; SO_REUSEADDR alone keeps "address in use" an error.
  impl->http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // An idle keep-alive connection holds a request thread (and Shutdown) until it times out.
  impl->http.set_keep_alive_timeout(2);
  const Registry* registry = options.registry;
  impl->http.Get("/metrics", [registry](const httplib::Request&, httplib::Response& response) {
    response.set_content(registry->Render(), kContentType);
  });
  impl->http.set_error_handler([](const httplib::Request& request, httplib::Response& response) {
    if (response.status == 404) {
      response.set_content(absl::StrCat("not found: ", request.path, " (metrics are at /metrics)\n"), "text/plain");
    }
  });
  if (requested_port == 0) {
    impl->port = impl->http.bind_to_any_port(host);
  } else {
    impl->port = impl->http.bind_to_port(host, requested_port) ? requested_port : -1;
  }
  if (impl->port <= 0) {
    impl->shut_down = true;
    return absl::UnavailableError(
        absl::StrCat("metrics server: cannot listen on ", options.listen_address, " (address in use or not local?)"));
  }
  Impl* raw = impl.get();
  raw->thread = std::thread([raw] { raw->http.listen_after_bind(); });
  // httplib's stop() only works once the accept loop runs: wait for it, so Shutdown right
  // after Start cannot hang.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!raw->http.is_running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  if (!raw->http.is_running()) {
    return absl::UnavailableError(
        absl::StrCat("metrics server: the listener on ", options.listen_address, " did not start"));
  }
  Log(LogLevel::kInfo, kComponent, absl::StrCat("serving /metrics on port ", raw->port));
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

}  // namespace mainstay::metrics

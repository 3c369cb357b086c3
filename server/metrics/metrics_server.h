// The HTTP endpoint Prometheus scrapes: `GET /metrics` answers the registry's text exposition
// (format 0.0.4, Content-Type text/plain; version=0.0.4), every other path 404. Plain HTTP on a
// port of its own, apart from the gRPC services (DESIGN.md section 9). Built on cpp-httplib,
// which stays inside metrics_server.cc.
//
// Ownership: the registry is not owned and must outlive the server. Thread safety: port() from
// any thread; Shutdown is idempotent (the destructor calls it) and waits for requests in
// progress. Requests are served by a small pool of threads (Options::threads).
// Errors: INVALID_ARGUMENT for a missing registry or an address that is not HOST:PORT;
// UNAVAILABLE when the address cannot be bound (in use, not local).
#ifndef MAINSTAY_SERVER_METRICS_METRICS_SERVER_H_
#define MAINSTAY_SERVER_METRICS_METRICS_SERVER_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "server/metrics/registry.h"

namespace mainstay::metrics {

class MetricsServer {
 public:
  struct Options {
    std::string listen_address = "127.0.0.1:0";  // HOST:PORT ([::]:PORT for IPv6); port 0 picks one
    const Registry* registry = nullptr;          // required, not owned
    int threads = 2;                             // request threads (a scrape is short)
  };

  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(Options options);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const;
  // Stops listening and waits for the requests in progress (and for idle keep-alive
  // connections to time out: at most 2 s).
  void Shutdown();

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Splits "host:port" / "[v6]:port" into host (brackets removed) and port (0..65535).
// INVALID_ARGUMENT otherwise.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address);

}  // namespace mainstay::metrics

#endif  // MAINSTAY_SERVER_METRICS_METRICS_SERVER_H_

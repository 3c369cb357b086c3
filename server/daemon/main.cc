// mainstayd: the shard daemon (DESIGN.md section 6).
//
//   mainstayd --coordinator HOST:PORT [--listen HOST:PORT] [--node-name NAME] ...
//   mainstayd --standalone --state-dir DIR ...   (embeds a coordinator: one node, no setup)
//
// SIGTERM / SIGINT: deregister and shut down (exit 0). Bad flags: a message and exit 2; a
// failure to start (port in use, coordinator unreachable): exit 1.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/port_file.h"
#include "common/sd_notify.h"
#include "common/stop_signals.h"
#include "common/status.h"
#include "kernels/cpu/executor.h"
#include "server/daemon/shard_daemon.h"
#include "server/grpc/coordinator_link.h"
#include "server/grpc/coordinator_service.h"
#include "server/grpc/shard_service.h"
#include "server/metrics/metrics_server.h"
#include "server/metrics/registry.h"
#include "server/peer/gloo_peer_group.h"

namespace mainstay::daemon {
namespace {

constexpr char kUsage[] = R"(usage: mainstayd (--coordinator HOST:PORT | --standalone --state-dir DIR) [flags]

The Mainstay shard daemon: keeps FP32 master weights and optimizer state of the shards the
coordinator places on it, runs the optimizer step when the trainers' gradients have arrived,
and serves the quantized parameters (gRPC service mainstay.v1.Shard, plus grpc.health.v1).

flags:
  --coordinator HOST:PORT     the coordinator to register with
  --standalone                embed a coordinator in this process (one-node use)
  --state-dir DIR             the embedded coordinator's state directory (with --standalone)
  --coordinator-listen H:P    where the embedded coordinator serves (default 127.0.0.1:7070)
  --checkpoint-dir DIR        the embedded coordinator's checkpoint directory (with --standalone;
                              unset: no checkpoints)
  --listen HOST:PORT          where the Shard service serves (default 0.0.0.0:7071; port 0 picks one)
  --advertise HOST            host name or IP that trainers and peers use to reach this daemon
                              (default: the --listen host, or the machine's host name for 0.0.0.0)
  --node-name NAME            node for locality (default: the host name)
  --threads N                 kernel threads (default: all hardware threads)
  --memory-bytes N            host memory offered for shard state (default: 80% of physical memory)
  --retained-versions N       published versions kept per shard (default 4)
  --peer-timeout-ms N         bound on one step's reductions among daemons (default 120000)
  --lease-ttl-ms N            lease to ask the coordinator for (default: the coordinator's)
  --port-file FILE            write the Shard service's port to FILE once serving
  --coordinator-port-file F   write the embedded coordinator's port to F (with --standalone)
  --metrics-listen HOST:PORT  where Prometheus scrapes GET /metrics over HTTP (default 0.0.0.0:9464;
                              port 0 picks one; "off": no metrics)
  --metrics-port-file FILE    write the metrics port to FILE once serving
  --help                      this text
)";

struct Flags {
  std::map<std::string, std::string> values;
  bool standalone = false;
  bool help = false;
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values.find(name);
    return it == values.end() ? fallback : it->second;
  }
};

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  static const std::set<std::string> kValued = {
      "--coordinator", "--state-dir",      "--coordinator-listen", "--listen",        "--advertise",
      "--node-name",   "--threads",        "--memory-bytes",       "--retained-versions", "--peer-timeout-ms",
      "--lease-ttl-ms", "--port-file",     "--coordinator-port-file", "--metrics-listen", "--metrics-port-file",
      "--checkpoint-dir"};
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      f.help = true;
      continue;
    }
    if (arg == "--standalone") {
      f.standalone = true;
      continue;
    }
    std::string name = arg;
    std::optional<std::string> value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    if (!kValued.count(name)) return absl::InvalidArgumentError(absl::StrCat("unknown flag '", arg, "'"));
    if (!value) {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(name, ": missing value"));
      value = argv[++i];
    }
    f.values[name] = *value;
  }
  if (f.help) return f;
  if (f.standalone == (f.values.count("--coordinator") > 0)) {
    return absl::InvalidArgumentError("give exactly one of --coordinator HOST:PORT and --standalone");
  }
  if (f.standalone && f.Get("--state-dir").empty()) return absl::InvalidArgumentError("--standalone needs --state-dir DIR");
  return f;
}

absl::StatusOr<int64_t> IntFlag(const Flags& f, const std::string& name, int64_t fallback) {
  const std::string text = f.Get(name);
  if (text.empty()) return fallback;
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a positive integer, got '", text, "'"));
  }
  return value;
}

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

int Fail(const absl::Status& status, int code) {
  std::fprintf(stderr, "mainstayd: %s\n", status.ToString().c_str());
  return code;
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (flags.ok() && flags->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!flags.ok()) {
    std::fprintf(stderr, "mainstayd: %s\n(see --help)\n", std::string(flags.status().message()).c_str());
    return 2;
  }
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  absl::StatusOr<int64_t> threads = IntFlag(*flags, "--threads", std::thread::hardware_concurrency());
  absl::StatusOr<int64_t> memory = IntFlag(*flags, "--memory-bytes", physical / 10 * 8);
  absl::StatusOr<int64_t> retained = IntFlag(*flags, "--retained-versions", 4);
  absl::StatusOr<int64_t> peer_timeout = IntFlag(*flags, "--peer-timeout-ms", 120000);
  absl::StatusOr<int64_t> lease = IntFlag(*flags, "--lease-ttl-ms", 0);
  for (const absl::Status& s : {threads.status(), memory.status(), retained.status(), peer_timeout.status(),
                                lease.status()}) {
    if (!s.ok()) return Fail(s, 2);
  }
  const std::string listen = flags->Get("--listen", "0.0.0.0:7071");
  if (listen.rfind(':') == std::string::npos) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--listen: expected HOST:PORT, got '", listen, "'")), 2);
  }
  const std::string listen_host = listen.substr(0, listen.rfind(':'));
  const std::string metrics_listen = flags->Get("--metrics-listen", "0.0.0.0:9464");
  std::unique_ptr<metrics::Registry> registry;  // null: --metrics-listen off
  if (metrics_listen != "off") {
    if (absl::Status s = metrics::SplitHostPort(metrics_listen).status(); !s.ok()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--metrics-listen: ", s.message())), 2);
    }
    registry = std::make_unique<metrics::Registry>();
  }
  const std::string advertise =
      flags->Get("--advertise", listen_host == "0.0.0.0" || listen_host == "[::]" ? HostName() : listen_host);

  const StopSignals stop_signals = StopSignals::Block();

  // The embedded coordinator, when asked for.
  std::unique_ptr<coordinator::CoordinatorServer> embedded;
  std::string coordinator_address = flags->Get("--coordinator");
  if (flags->standalone) {
    coordinator::CoordinatorServer::Options options;
    options.listen_address = flags->Get("--coordinator-listen", "127.0.0.1:7070");
    options.state_dir = flags->Get("--state-dir");
    options.checkpoint_dir = flags->Get("--checkpoint-dir");
    absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server =
        coordinator::CoordinatorServer::Start(options);
    if (!server.ok()) return Fail(server.status(), 1);
    embedded = *std::move(server);
    const std::string host = options.listen_address.substr(0, options.listen_address.rfind(':'));
    coordinator_address = absl::StrCat(host == "0.0.0.0" ? "127.0.0.1" : host, ":", embedded->port());
    std::fprintf(stderr, "mainstayd: embedded coordinator listening on %s\n", coordinator_address.c_str());
    if (const std::string path = flags->Get("--coordinator-port-file"); !path.empty()) {
      if (absl::Status s = WritePortFile(path, embedded->port()); !s.ok()) return Fail(s, 1);
    }
  }

  kernels::CpuExecutor executor(static_cast<int>(*threads));
  std::unique_ptr<CoordinatorLink> link;
  peer::GlooPeerGroupOptions gloo_options;
  gloo_options.hostname = advertise;
  // The link exists only after registration; the factory reaches the KV through this shim.
  struct LinkKv : peer::KvClient {
    CoordinatorLink** link;
    absl::Status Put(const std::string& k, const std::string& v, absl::Duration ttl) override {
      return (*link)->Put(k, v, ttl);
    }
    absl::StatusOr<std::string> Get(const std::string& k, absl::Time deadline) override {
      return (*link)->Get(k, deadline);
    }
  };
  CoordinatorLink* link_ptr = nullptr;
  LinkKv kv;
  kv.link = &link_ptr;
  peer::GlooPeerGroupFactory peers(&kv, gloo_options);

  ShardDaemonOptions daemon_options;
  daemon_options.device.executor = &executor;
  daemon_options.peers = &peers;
  daemon_options.retained_versions = static_cast<int>(*retained);
  daemon_options.peer_timeout = absl::Milliseconds(*peer_timeout);
  daemon_options.metrics = registry.get();
  ShardDaemon daemon(daemon_options);

  absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start({listen, 64 << 20, &daemon});
  if (!server.ok()) return Fail(server.status(), 1);
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> started_metrics =
      registry == nullptr ? absl::StatusOr<std::unique_ptr<metrics::MetricsServer>>(nullptr)
                          : metrics::MetricsServer::Start({metrics_listen, registry.get()});
  if (!started_metrics.ok() && flags->values.count("--metrics-listen")) {
    (*server)->Shutdown();
    return Fail(started_metrics.status(), 1);
  }
  if (!started_metrics.ok()) {
    // Only the default port: several daemons on one host (tests, the demo) must still start.
    Log(LogLevel::kWarning, "daemon",
        absl::StrCat("no metrics endpoint: ", started_metrics.status().message(),
                     "; pass --metrics-listen HOST:PORT (or off)"));
  } else if (*started_metrics != nullptr) {
    metrics_server = *std::move(started_metrics);
    std::fprintf(stderr, "mainstayd: metrics on http://%s:%d/metrics\n",
                 metrics_listen.substr(0, metrics_listen.rfind(':')).c_str(), metrics_server->port());
    if (const std::string path = flags->Get("--metrics-port-file"); !path.empty()) {
      if (absl::Status s = WritePortFile(path, metrics_server->port()); !s.ok()) return Fail(s, 1);
    }
  }
  const std::string address = absl::StrCat(advertise, ":", (*server)->port());

  CoordinatorLink::Options link_options;
  link_options.coordinator_address = coordinator_address;
  v1::RegisterDaemonRequest& reg = link_options.registration;
  reg.set_address(address);
  reg.set_node_name(flags->Get("--node-name", HostName()));
  reg.add_transports(v1::TRANSPORT_GRPC);
  reg.mutable_resources()->set_host_memory_bytes(*memory);
  reg.mutable_resources()->set_memory_kind(v1::MEMORY_KIND_HOST);
  reg.mutable_resources()->set_cpu_threads(static_cast<int32_t>(*threads));
  reg.set_version("0.1.0");
  reg.set_requested_lease_ttl_ms(*lease);
  link_options.on_registered = [&daemon](const std::string& id) { daemon.set_daemon_id(id); };
  link_options.report = [&daemon](v1::HeartbeatRequest* request) {
    request->set_used_bytes(daemon.used_bytes());
    request->set_active_jobs(daemon.active_jobs());
    for (v1::JobProgress& p : daemon.Progress()) *request->add_jobs() = std::move(p);
  };
  absl::StatusOr<std::unique_ptr<CoordinatorLink>> started = CoordinatorLink::Start(link_options);
  if (!started.ok()) {
    (*server)->Shutdown();
    return Fail(started.status(), 1);
  }
  link = *std::move(started);
  link_ptr = link.get();
  metrics::Registry::CollectorId lease_collector = 0;
  if (registry != nullptr && daemon.metrics() != nullptr) {
    lease_collector = registry->AddCollector(
        [m = daemon.metrics(), raw = link.get()] { m->SetLeaseLive(raw->has_live_lease()); });
  }
  std::fprintf(stderr, "mainstayd %s serving on %s (node %s, %lld threads)\n", link->daemon_id().c_str(),
               address.c_str(), reg.node_name().c_str(), static_cast<long long>(*threads));
  std::fflush(stderr);
  if (const std::string path = flags->Get("--port-file"); !path.empty()) {
    if (absl::Status s = WritePortFile(path, (*server)->port()); !s.ok()) return Fail(s, 1);
  }

  // Ready only once registered: a Type=notify unit (deploy/systemd) must not count as started
  // while the coordinator cannot place shards on it. A no-op outside systemd.
  if (absl::Status s = SdNotify(absl::StrCat("READY=1\nSTATUS=", link->daemon_id(), " serving on ", address));
      !s.ok()) {
    Log(LogLevel::kWarning, "daemon", s.message());
  }

  const int signal_number = stop_signals.Wait();
  Log(LogLevel::kInfo, "daemon", absl::StrCat("signal ", signal_number, ": shutting down"));
  if (absl::Status s = SdNotify("STOPPING=1"); !s.ok()) Log(LogLevel::kWarning, "daemon", s.message());
  link->Shutdown();
  daemon.Shutdown();
  (*server)->Shutdown();
  if (metrics_server != nullptr) metrics_server->Shutdown();
  if (lease_collector != 0) registry->RemoveCollector(lease_collector);
  if (embedded != nullptr) embedded->Shutdown();
  return 0;
}

}  // namespace
}  // namespace mainstay::daemon

int main(int argc, char** argv) { return mainstay::daemon::Main(argc, argv); }

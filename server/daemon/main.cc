// mainstayd: the shard daemon (DESIGN.md section 6).
//
//   mainstayd --coordinator HOST:PORT [--listen HOST:PORT] [--node-name NAME] ...
//   mainstayd --standalone --state-dir DIR ...   (embeds a coordinator: one node, no setup)
//
// SIGTERM / SIGINT: a graceful stop (exit 0): health NOT_SERVING, pushes of new steps refused,
// the steps in flight finish (up to --drain-timeout-ms), the checkpoint hook, deregistration,
// then the servers stop. Bad flags or TLS files: a message and exit 2; a failure to start
// (port in use, coordinator unreachable): exit 1.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/port_file.h"
#include "common/sd_notify.h"
#include "common/stop_signals.h"
#include "common/status.h"
#include "kernels/cpu/executor.h"
#include "kernels/memory.h"
#include "common/grpc_tls.h"
#include "common/tls.h"
#include "server/coordinator/admin_auth.h"
#include "server/daemon/shard_daemon.h"
#include "server/daemon/step_drain.h"
#include "server/grpc/coordinator_link.h"
#include "server/grpc/grpc_peer_client.h"
#include "server/grpc/coordinator_service.h"
#include "server/grpc/shard_service.h"
#include "server/cudaipc/cuda_ipc_server.h"
#include "server/cudaipc/ipc_memory.h"
#include "server/nccl/nccl_channel_server.h"
#include "server/ucx/ucx_data_server.h"
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
  --coordinator HOST:PORT     the coordinator to register with (or a comma-separated list of
                              the coordinators sharing one etcd: the leader is found by connecting)
  --standalone                embed a coordinator in this process (one-node use)
  --state-dir DIR             the embedded coordinator's state directory (with --standalone)
  --coordinator-listen H:P    where the embedded coordinator serves (default 127.0.0.1:7070)
  --checkpoint-dir DIR        the embedded coordinator's checkpoint directory (with --standalone;
                              unset: no checkpoints)
  --listen HOST:PORT          where the Shard service serves (default 0.0.0.0:7071; port 0 picks one)
  --advertise HOST            host name or IP that trainers and peers use to reach this daemon
                              (default: the --listen host, or the machine's host name for 0.0.0.0)
  --node-name NAME            node for locality (default: the host name)
  --device DEVICE             where shard state lives and the optimizer and casts run: cpu (default)
                              or cuda:N (CUDA device N as CUDA_VISIBLE_DEVICES numbers them; managed
                              memory resident on it, the CUDA kernels on a stream of the daemon's).
                              Exit 2 when that device is not there or cannot run this build.
                              cpu-staged: tests only, host memory staged as on a GPU
  --threads N                 kernel threads (default: the cores this process may use: its CPU
                              affinity, capped by its cgroup's CPU quota)
  --memory-bytes N            memory offered for shard state: host memory with --device cpu, device
                              memory with cuda:N (default: 80% of it); an assignment whose shards
                              would not fit is refused (RESOURCE_EXHAUSTED)
  --retained-versions N       published versions kept per shard (default 4)
  --reader-bytes-per-sec N    cap on what readers (pulls with a job's reader token) take from this
                              daemon, all jobs together; trainers are never capped (default 0: none)
  --peer-timeout-ms N         bound on one step's reductions among daemons (default 120000)
  --push-idle-timeout-ms N    a gRPC PushGrad stream silent this long is cancelled (default 60000)
  --max-waiting-calls N       PullParams and FinishStep calls that may wait at once (default 16384;
                              more are RESOURCE_EXHAUSTED); a waiting call holds no thread
  --max-waiting-calls-per-job N     of those, for one job (default 8192)
  --max-waiting-calls-per-peer N    of those, from one client host (default 8192)
  --max-wait-ms N             longest wait of one call; then UNAVAILABLE, and the client calls
                              again (default 600000)
  --lease-ttl-ms N            lease to ask the coordinator for (default: the coordinator's)
  --port-file FILE            write the Shard service's port to FILE once serving
  --coordinator-port-file F   write the embedded coordinator's port to F (with --standalone)
  --metrics-listen HOST:PORT  where Prometheus scrapes GET /metrics over HTTP (default 0.0.0.0:9464;
                              port 0 picks one; "off": no metrics)
  --metrics-port-file FILE    write the metrics port to FILE once serving
  --checkpoint-on-stop        on SIGTERM, once the steps in flight are decided, checkpoint every job
                              this daemon serves (through the coordinator, which needs
                              --checkpoint-dir) before deregistering
  --drain-timeout-ms N        on SIGTERM, how long the steps in flight may take to finish before
                              the daemon deregisters anyway (default 30000)
  --tls-cert-file FILE        PEM certificate to serve TLS with (also the client certificate of the
                              calls to the coordinator); without it the port is plaintext
  --tls-key-file FILE         PEM private key of --tls-cert-file
  --tls-ca-file FILE          PEM CA certificates that verify the coordinator and, with
                              --tls-client-auth require, clients' certificates; given alone,
                              outgoing calls use TLS while the port stays plaintext
  --tls-client-auth MODE      none (default) or require: mutual TLS, refuse clients without a
                              certificate signed by --tls-ca-file
  --tls-server-name NAME      verify the coordinator's certificate against NAME instead of its address
  --tls-internal-name NAME    with mutual TLS: the certificate name (CN or SAN) only the cluster's
                              servers carry; AssignShard, DropShard, FetchShardState and
                              WriteCheckpoint from other certificates (trainers') are refused
  --cluster-secret-file FILE  the cluster secret, the same file as the coordinator's: presented on
                              this daemon's calls to the coordinator and its peers, and required of
                              the internal calls it serves (docs/operations.md, "Threat model").
                              With --standalone it is made if missing (default DIR/cluster.secret
                              of --state-dir); otherwise it must exist
  --insecure                  without a cluster secret or --tls-internal-name, listen on a
                              non-loopback --listen anyway (anyone who reaches the port can then
                              assign, drop and read shards); without this flag that is refused
  --transports LIST           data-plane transports to offer trainers besides gRPC, comma-separated:
                              auto (default: every one this build has that starts here), grpc
                              (gRPC only), ucx (UCX; exit 1 if it cannot start), nccl (NCCL between
                              device buffers, on the --device GPU, else CUDA device 0 of
                              CUDA_VISIBLE_DEVICES; exit 1 if it cannot start), cuda_ipc (pushes
                              from trainers' device memory on this node, by CUDA IPC handles; needs
                              --device cuda:N; exit 1 if it cannot start). Trainers pick per connection (docs/transports.md);
                              `mainstayctl connections` shows it
  --ucx-dedicated-workers WHO which UCX trainer connections get a worker (and thread) of their own:
                              local (default: trainers on this host, which may use shared memory,
                              where a trainer killed mid-write stalls the worker it writes to),
                              all, or none; the others share a pool (--ucx-shared-workers)
  --ucx-shared-workers N      the size of that pool (default 4)
  --health-listen HOST:PORT   a plaintext port serving only grpc.health.v1 (for probes that cannot
                              speak TLS, e.g. Kubernetes'); default none
  --admin-token-file FILE     the embedded coordinator's admin token (with --standalone)
  --inject-fault SPEC[,SPEC]  tests only: lose-reduction:STEP:stats|amax makes this daemon throw
                              away the completed result of that peer reduction of STEP once, as
                              if it had timed out (docs/architecture.md, agreed outcome);
                              drop-replica-input:STEP makes its replicas update STEP with a zero
                              gradient (the replication mutation check);
                              crash-at:PHASE:STEP[:ROLE] SIGKILLs it at PHASE of STEP (input,
                              finish, update, decision; copy and install: a move's source asked
                              for a copy, its target holding one, once STEP is committed; pull:
                              a trainer's pull of version STEP + 1, STEP decided) if it
                              holds a primary (ROLE primary) or only replicas (replica-only) of
                              the job, or either (any, the default); default none
  --inject-fault-once FILE    tests only: the crash fires only if this daemon is the first to
                              create FILE (give every daemon the fault and the same FILE: one
                              of them crashes, whichever gets there first)
  --help                      this text
)";

struct Flags {
  std::map<std::string, std::string> values;
  bool standalone = false;
  bool checkpoint_on_stop = false;
  bool insecure = false;
  bool help = false;
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values.find(name);
    return it == values.end() ? fallback : it->second;
  }
};

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  static const std::set<std::string> kValued = {
      "--coordinator", "--state-dir",      "--coordinator-listen", "--listen",        "--advertise",
      "--node-name",   "--threads",        "--memory-bytes",       "--device",
      "--retained-versions", "--peer-timeout-ms",
      "--push-idle-timeout-ms", "--lease-ttl-ms", "--port-file",     "--coordinator-port-file", "--metrics-listen", "--metrics-port-file",
      "--drain-timeout-ms", "--tls-cert-file", "--tls-key-file", "--tls-ca-file", "--tls-client-auth",
      "--tls-server-name", "--admin-token-file", "--health-listen", "--tls-internal-name",
      "--checkpoint-dir", "--transports", "--ucx-dedicated-workers",
      "--ucx-shared-workers", "--inject-fault", "--inject-fault-once", "--cluster-secret-file", "--max-waiting-calls",
      "--max-waiting-calls-per-job", "--max-waiting-calls-per-peer", "--max-wait-ms", "--reader-bytes-per-sec"};
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
    if (arg == "--checkpoint-on-stop") {
      f.checkpoint_on_stop = true;
      continue;
    }
    if (arg == "--insecure") {
      f.insecure = true;
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
  if (!f.standalone && f.values.count("--admin-token-file")) {
    return absl::InvalidArgumentError("--admin-token-file is for the embedded coordinator: give it with --standalone "
                                      "(a separate coordinator takes it itself)");
  }
  return f;
}

absl::StatusOr<TlsOptions> TlsFromFlags(const Flags& f) {
  TlsOptions tls;
  tls.cert_file = f.Get("--tls-cert-file");
  tls.key_file = f.Get("--tls-key-file");
  tls.ca_file = f.Get("--tls-ca-file");
  tls.server_name = f.Get("--tls-server-name");
  const std::string client_auth = f.Get("--tls-client-auth", "none");
  if (client_auth != "none" && client_auth != "require") {
    return absl::InvalidArgumentError(absl::StrCat("--tls-client-auth: none or require, got '", client_auth, "'"));
  }
  tls.require_client_cert = client_auth == "require";
  // Checked here, before anything starts: a bad file is exit 2 with its path and the reason.
  MAINSTAY_RETURN_IF_ERROR(MakeServerCredentials(tls).status());
  return tls;
}

// With --checkpoint-on-stop: after the steps in flight are decided (or the drain timed out)
// and before the daemon deregisters, a checkpoint of every job it serves, through the
// coordinator (which has every daemon of the job write its shards at the same step). The
// coordinator still lists this daemon as their owner, so the checkpoint holds the last
// committed version; a job that lost this daemon is then restored from it without rewinding.
absl::Status CheckpointIfConfigured(bool enabled, ShardDaemon& daemon, CoordinatorLink& link,
                                    const std::string& admin_token, absl::Duration timeout) {
  if (!enabled) return absl::OkStatus();
  absl::Status first;
  for (const v1::JobProgress& job : daemon.Progress()) {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::CheckpointInfo> info = link.CreateCheckpoint(job.job_id(), admin_token, start + timeout);
    if (info.ok()) {
      Log(LogLevel::kInfo, "daemon",
          absl::StrCat("job ", job.job_id(), ": checkpoint ", info->checkpoint_id(), " (version ", info->version(),
                       ") written before stopping in ", absl::FormatDuration(absl::Now() - start)));
    } else if (first.ok()) {
      first = Annotate(info.status(), absl::StrCat("job ", job.job_id()));
    }
  }
  return first;
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

// --device: "cpu", or "cuda:N". The CPU kernels run on `executor`.
absl::StatusOr<std::unique_ptr<kernels::StateMemory>> OpenStateMemory(const std::string& device,
                                                                      kernels::CpuExecutor* executor) {
  if (device == "cpu") return kernels::HostStateMemory(executor);
  // Tests only: host memory that stages the kernels' inputs and outputs as a GPU does.
  if (device == "cpu-staged") return kernels::HostStateMemory(executor, /*staged=*/true);
  int ordinal = -1;
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &ordinal) && ordinal >= 0) {
    absl::StatusOr<std::unique_ptr<kernels::StateMemory>> memory = kernels::CudaStateMemory(ordinal);
    if (!memory.ok()) return absl::Status(memory.status().code(), absl::StrCat("--device ", memory.status().message()));
    return memory;
  }
  return absl::InvalidArgumentError(absl::StrCat("--device: expected cpu or cuda:N (N >= 0), got \"", device, "\""));
}

int Main(int argc, char** argv) {
  // First: any thread started later (gRPC's and UCX's own ones, started by credentials and
  // contexts as the flags are read) inherits the mask, so only Wait below takes SIGTERM.
  const StopSignals stop_signals = StopSignals::Block();
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (flags.ok() && flags->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (!flags.ok()) {
    std::fprintf(stderr, "mainstayd: %s\n(see --help)\n", std::string(flags.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<int64_t> threads = IntFlag(*flags, "--threads", kernels::AvailableCores());
  if (!threads.ok()) return Fail(threads.status(), 2);
  kernels::CpuExecutor executor(static_cast<int>(*threads));
  absl::StatusOr<std::unique_ptr<kernels::StateMemory>> state_memory =
      OpenStateMemory(flags->Get("--device", "cpu"), &executor);
  if (!state_memory.ok()) return Fail(state_memory.status(), 2);
  const bool on_device = (*state_memory)->device().kind == kernels::Device::Kind::kCuda;
  std::fprintf(stderr, "mainstayd: shard state on %s\n", (*state_memory)->Describe().c_str());
  absl::StatusOr<int64_t> memory = IntFlag(*flags, "--memory-bytes", (*state_memory)->capacity_bytes() / 10 * 8);
  absl::StatusOr<int64_t> retained = IntFlag(*flags, "--retained-versions", 4);
  absl::StatusOr<int64_t> peer_timeout = IntFlag(*flags, "--peer-timeout-ms", 120000);
  absl::StatusOr<int64_t> lease = IntFlag(*flags, "--lease-ttl-ms", 0);
  absl::StatusOr<int64_t> drain_timeout = IntFlag(*flags, "--drain-timeout-ms", 30000);
  absl::StatusOr<int64_t> push_idle = IntFlag(*flags, "--push-idle-timeout-ms", 60000);
  absl::StatusOr<int64_t> reader_cap = IntFlag(*flags, "--reader-bytes-per-sec", 0);
  if (reader_cap.ok() && *reader_cap < 0) {
    reader_cap = absl::InvalidArgumentError(absl::StrCat("--reader-bytes-per-sec: must be >= 0 (0: no cap), got ", *reader_cap));
  }
  if (push_idle.ok() && *push_idle < 1) {
    push_idle = absl::InvalidArgumentError(absl::StrCat("--push-idle-timeout-ms: must be >= 1, got ", *push_idle));
  }
  grpc_server::Waiters::Options waits;
  absl::StatusOr<int64_t> max_waiting = IntFlag(*flags, "--max-waiting-calls", waits.max_total);
  absl::StatusOr<int64_t> max_waiting_job = IntFlag(*flags, "--max-waiting-calls-per-job", waits.max_per_key);
  absl::StatusOr<int64_t> max_waiting_peer = IntFlag(*flags, "--max-waiting-calls-per-peer", waits.max_per_peer);
  absl::StatusOr<int64_t> max_wait = IntFlag(*flags, "--max-wait-ms", absl::ToInt64Milliseconds(waits.max_wait));
  for (auto [flag, value] : {std::pair{"--max-waiting-calls", &max_waiting},
                             std::pair{"--max-waiting-calls-per-job", &max_waiting_job},
                             std::pair{"--max-waiting-calls-per-peer", &max_waiting_peer},
                             std::pair{"--max-wait-ms", &max_wait}}) {
    if (value->ok() && **value < 1) *value = absl::InvalidArgumentError(absl::StrCat(flag, ": must be >= 1, got ", **value));
  }
  for (const absl::Status& s : {threads.status(), memory.status(), retained.status(), peer_timeout.status(),
                                lease.status(), drain_timeout.status(), push_idle.status(), max_waiting.status(),
                                max_waiting_job.status(), max_waiting_peer.status(), max_wait.status(),
                                reader_cap.status()}) {
    if (!s.ok()) return Fail(s, 2);
  }
  waits.max_total = *max_waiting;
  waits.max_per_key = *max_waiting_job;
  waits.max_per_peer = *max_waiting_peer;
  waits.max_wait = absl::Milliseconds(*max_wait);
  absl::StatusOr<TlsOptions> tls = TlsFromFlags(*flags);
  if (!tls.ok()) return Fail(tls.status(), 2);
  absl::StatusOr<ChannelSecurity> security = ChannelSecurity::Create(*tls);
  if (!security.ok()) return Fail(security.status(), 2);
  // The cluster secret: required to exist, except that a standalone daemon makes its own (in
  // its state directory unless told where), as the coordinator does.
  absl::StatusOr<ClusterSecret> secret = ClusterSecret();
  if (std::string path = flags->Get("--cluster-secret-file"); !path.empty() || flags->standalone) {
    if (path.empty()) {
      std::error_code error;  // the embedded coordinator makes it too; the secret goes in first
      std::filesystem::create_directories(flags->Get("--state-dir"), error);
      path = flags->Get("--state-dir") + "/cluster.secret";
    }
    secret = ClusterSecret::Load(path, /*create=*/flags->standalone);
    if (!secret.ok()) return Fail(secret.status(), 2);
  }
  *security = security->WithClusterSecret(*secret);
  absl::StatusOr<StepFaults> faults = ParseStepFaults(flags->Get("--inject-fault"), flags->Get("--inject-fault-once"));
  if (!faults.ok()) return Fail(faults.status(), 2);
  if (faults->armed()) {
    Log(LogLevel::kWarning, "daemon", absl::StrCat("fault injection on: --inject-fault ", flags->Get("--inject-fault")));
  }
  std::string admin_token;
  if (const std::string path = flags->Get("--admin-token-file"); !path.empty()) {
    absl::StatusOr<std::string> token = coordinator::AdminAuth::ReadTokenFile(path);
    if (!token.ok()) return Fail(token.status(), 2);
    admin_token = *std::move(token);
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


  // The embedded coordinator, when asked for.
  std::unique_ptr<coordinator::CoordinatorServer> embedded;
  std::string coordinator_address = flags->Get("--coordinator");
  if (flags->standalone) {
    coordinator::CoordinatorServer::Options options;
    options.listen_address = flags->Get("--coordinator-listen", "127.0.0.1:7070");
    options.state_dir = flags->Get("--state-dir");
    options.checkpoint_dir = flags->Get("--checkpoint-dir");
    options.tls = *tls;
    options.internal_peer_name = flags->Get("--tls-internal-name");
    options.cluster_secret = *secret;
    options.insecure = flags->insecure;
    options.admin_token = admin_token;
    options.metrics = registry.get();  // the coordinator's metrics on the daemon's endpoint
    absl::StatusOr<std::unique_ptr<coordinator::CoordinatorServer>> server =
        coordinator::CoordinatorServer::Start(options);
    if (!server.ok()) return Fail(server.status(), server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
    embedded = *std::move(server);
    const std::string host = options.listen_address.substr(0, options.listen_address.rfind(':'));
    coordinator_address = absl::StrCat(host == "0.0.0.0" ? "127.0.0.1" : host, ":", embedded->port());
    std::fprintf(stderr, "mainstayd: embedded coordinator listening on %s\n", coordinator_address.c_str());
    if (const std::string path = flags->Get("--coordinator-port-file"); !path.empty()) {
      if (absl::Status s = WritePortFile(path, embedded->port()); !s.ok()) return Fail(s, 1);
    }
  }

  std::unique_ptr<CoordinatorLink> link;
  peer::GlooPeerGroupOptions gloo_options;
  gloo_options.hostname = advertise;
  // The link exists only after registration; the factory reaches the KV through this shim.
  struct LinkKv : peer::KvClient {
    CoordinatorLink** link;
    absl::Status Put(const std::string& k, const std::string& v, absl::Duration ttl) override {
      if (*link == nullptr) return absl::UnavailableError("not registered with the coordinator yet");
      return (*link)->Put(k, v, ttl);
    }
    absl::StatusOr<std::string> Get(const std::string& k, absl::Time deadline) override {
      if (*link == nullptr) return absl::UnavailableError("not registered with the coordinator yet");
      return (*link)->Get(k, deadline);
    }
    absl::StatusOr<int64_t> RaiseCounter(const std::string& k, int64_t at_least, absl::Time deadline) override {
      if (*link == nullptr) return absl::UnavailableError("not registered with the coordinator yet");
      return (*link)->RaiseCounter(k, at_least, deadline);
    }
  };
  CoordinatorLink* link_ptr = nullptr;
  LinkKv kv;
  kv.link = &link_ptr;
  peer::GlooPeerGroupFactory peers(&kv, gloo_options);

  ShardDaemonOptions daemon_options;
  daemon_options.memory = state_memory->get();
  daemon_options.peers = &peers;
  daemon_options.retained_versions = static_cast<int>(*retained);
  daemon_options.reader_bytes_per_sec = *reader_cap;
  daemon_options.memory_bytes = *memory;
  daemon_options.peer_timeout = absl::Milliseconds(*peer_timeout);
  daemon_options.metrics = registry.get();
  GrpcPeerClient peer_client(*security);
  daemon_options.peer_client = &peer_client;
  daemon_options.faults = *std::move(faults);
  ShardDaemon daemon(daemon_options);
  StepDrain drain;

  bool want_ucx = false, need_ucx = false, want_nccl = false, need_nccl = false;
  bool want_ipc = false, need_ipc = false;
  for (absl::string_view t : absl::StrSplit(flags->Get("--transports", "auto"), ',')) {
    if (t == "auto") {
      want_ucx = want_nccl = want_ipc = true;
    } else if (t == "ucx") {
      want_ucx = need_ucx = true;
    } else if (t == "nccl") {
      want_nccl = need_nccl = true;
    } else if (t == "cuda_ipc") {
      want_ipc = need_ipc = true;
    } else if (t != "grpc") {
      return Fail(absl::InvalidArgumentError(
                      absl::StrCat("--transports: '", t, "' is not one of auto, grpc, ucx, nccl, cuda_ipc")),
                  2);
    }
  }
  if (need_ipc && !on_device) {
    return Fail(absl::InvalidArgumentError(
                    "--transports cuda_ipc needs the shard state on a GPU (--device cuda:N): the daemon copies "
                    "trainers' device memory with that GPU"),
                2);
  }
  UcxDataServer::Options ucx_options{&daemon, &drain};
  if (const std::string who = flags->Get("--ucx-dedicated-workers", "local"); who == "all") {
    ucx_options.dedicated_workers = UcxDataServer::DedicatedWorkers::kAll;
  } else if (who == "none") {
    ucx_options.dedicated_workers = UcxDataServer::DedicatedWorkers::kNone;
  } else if (who != "local") {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("--ucx-dedicated-workers: '", who, "' is not one of local, all, none")),
                2);
  }
  absl::StatusOr<int64_t> shared_workers = IntFlag(*flags, "--ucx-shared-workers", 4);
  if (!shared_workers.ok()) return Fail(shared_workers.status(), 2);
  if (*shared_workers < 1 || *shared_workers > 1024) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--ucx-shared-workers: ", *shared_workers, " is not in [1, 1024]")),
                2);
  }
  ucx_options.shared_workers = static_cast<int>(*shared_workers);
  // The nccl transport's daemon end: its calls arrive on the Shard service, so it starts first.
  std::unique_ptr<NcclChannelServer> nccl_server;
  if (want_nccl) {
    // On the daemon's GPU with --device cuda:N, else device 0 of CUDA_VISIBLE_DEVICES.
    const int nccl_device = on_device ? (*state_memory)->device().ordinal : 0;
    absl::StatusOr<std::unique_ptr<NcclChannelServer>> started =
        NcclChannelServer::Start({&daemon, &drain, &kv, nccl_device});
    if (started.ok()) {
      nccl_server = *std::move(started);
      Log(LogLevel::kInfo, "daemon", absl::StrCat("NCCL data plane: ", nccl_server->Describe()));
    } else if (need_nccl) {
      return Fail(started.status(), 1);
    } else {
      Log(LogLevel::kInfo, "daemon", absl::StrCat("no NCCL data plane: ", started.status().message()));
    }
  }
  // The cuda_ipc transport's daemon end (a daemon on a GPU): trainers on this node hand over
  // their device memory's IPC handles on the Shard service, so it starts first too.
  std::unique_ptr<IpcMemory> ipc_memory;
  std::unique_ptr<CudaIpcServer> ipc_server;
  if (want_ipc && on_device) {
    absl::StatusOr<std::unique_ptr<CudaIpcServer>> started = absl::UnknownError("not started");
    if (absl::StatusOr<std::unique_ptr<IpcMemory>> opened = MakeCudaIpcMemory((*state_memory)->device().ordinal);
        opened.ok()) {
      ipc_memory = *std::move(opened);
      CudaIpcServer::Options ipc_options;
      ipc_options.daemon = &daemon;
      ipc_options.drain = &drain;
      ipc_options.memory = ipc_memory.get();
      ipc_options.device_name = (*state_memory)->Describe();
      started = CudaIpcServer::Start(std::move(ipc_options));
    } else {
      started = opened.status();
    }
    if (started.ok()) {
      ipc_server = *std::move(started);
      Log(LogLevel::kInfo, "daemon", absl::StrCat("cuda_ipc data plane: ", ipc_server->Describe()));
    } else if (need_ipc) {
      return Fail(started.status(), 1);
    } else {
      Log(LogLevel::kInfo, "daemon", absl::StrCat("no cuda_ipc data plane: ", started.status().message()));
    }
  }
  ShardServer::Options server_options;
  server_options.listen_address = listen;
  server_options.daemon = &daemon;
  server_options.tls = *tls;
  server_options.internal_peer_name = flags->Get("--tls-internal-name");
  server_options.cluster_secret = *secret;
  server_options.insecure = flags->insecure;
  server_options.drain = &drain;
  server_options.health_listen_address = flags->Get("--health-listen");
  server_options.nccl = nccl_server.get();
  server_options.cuda_ipc = ipc_server.get();
  server_options.push_idle_timeout = absl::Milliseconds(*push_idle);
  server_options.waits = waits;
  absl::StatusOr<std::unique_ptr<ShardServer>> server = ShardServer::Start(server_options);
  if (!server.ok()) return Fail(server.status(), server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  // The UCX data plane next to gRPC: its worker address goes into the registration.
  std::unique_ptr<UcxDataServer> ucx_server;
  {
    if (want_ucx) {
      absl::StatusOr<std::unique_ptr<UcxDataServer>> started = UcxDataServer::Start(ucx_options);
      if (started.ok()) {
        ucx_server = *std::move(started);
        Log(LogLevel::kInfo, "daemon", absl::StrCat("UCX data plane: ", ucx_server->Describe()));
      } else if (need_ucx) {
        (*server)->Shutdown();
        return Fail(started.status(), 1);
      } else {
        Log(LogLevel::kInfo, "daemon", absl::StrCat("no UCX data plane: ", started.status().message()));
      }
    }
  }
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
  link_options.security = *security;
  v1::RegisterDaemonRequest& reg = link_options.registration;
  reg.set_address(address);
  reg.set_node_name(flags->Get("--node-name", HostName()));
  reg.add_transports(v1::TRANSPORT_GRPC);
  reg.set_takes_crc32c_trailer(true);
  if (ucx_server != nullptr) {
    reg.add_transports(v1::TRANSPORT_UCX);
    reg.set_ucx_worker_address(ucx_server->worker_address());
  }
  if (nccl_server != nullptr) reg.add_transports(v1::TRANSPORT_NCCL);
  if (ipc_server != nullptr) reg.add_transports(v1::TRANSPORT_CUDA_IPC);
  if (on_device) {
    reg.mutable_resources()->set_device_memory_bytes(*memory);
    reg.mutable_resources()->set_device_count(1);
    reg.mutable_resources()->set_memory_kind(v1::MEMORY_KIND_DEVICE);
  } else {
    reg.mutable_resources()->set_host_memory_bytes(*memory);
    reg.mutable_resources()->set_memory_kind(v1::MEMORY_KIND_HOST);
  }
  reg.mutable_resources()->set_cpu_threads(static_cast<int32_t>(*threads));
  // Where its shard state lives, as `mainstayctl daemons show` prints it: "cpu" or
  // "cuda:0 (NVIDIA H200, sm_90, 139 GiB)".
  (*reg.mutable_labels())["device"] = (*state_memory)->Describe();
  reg.set_version("0.1.0");
  reg.set_requested_lease_ttl_ms(*lease);
  link_options.on_registered = [&daemon](const v1::RegisterDaemonResponse& r) {
    daemon.set_checkpoint_root(r.checkpoint_dir());  // first: no assignment comes before the id
    daemon.set_daemon_id(r.daemon_id());
  };
  link_options.report = [&daemon](v1::HeartbeatRequest* request) {
    request->set_used_bytes(daemon.used_bytes());
    request->set_active_jobs(daemon.active_jobs());
    for (v1::JobProgress& p : daemon.Progress()) *request->add_jobs() = std::move(p);
    for (v1::DataConnection& c : daemon.connections()->Snapshot()) *request->add_connections() = std::move(c);
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
  // Registered, and a fresh process holds no shards yet (they arrive by AssignShard): ready.
  (*server)->SetReady(true);
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
  // 1. Not ready, and no new steps: only pushes of the steps in flight are admitted.
  (*server)->BeginDrain();
  const std::map<std::string, int64_t> in_flight = drain.Begin(daemon.Progress());
  // 2. The steps in flight finish and commit (their trainers' pushes, FinishStep and pulls
  // are still served), bounded by --drain-timeout-ms.
  if (!in_flight.empty()) {
    Log(LogLevel::kInfo, "daemon",
        absl::StrCat("draining: waiting up to ", *drain_timeout, " ms for ", in_flight.size(), " step(s) in flight"));
    const absl::Time drain_start = absl::Now();
    absl::Status drained = drain.AwaitInFlight([&daemon] { return daemon.Progress(); },
                                               drain_start + absl::Milliseconds(*drain_timeout));
    if (drained.ok()) {
      Log(LogLevel::kInfo, "daemon", absl::StrCat("steps in flight decided in ", absl::FormatDuration(absl::Now() - drain_start)));
    } else {
      Log(LogLevel::kWarning, "daemon", absl::StrCat("stopping anyway: ", drained.message()));
    }
  }
  // 3. Checkpoint if configured — issue 7.
  if (absl::Status s = CheckpointIfConfigured(flags->checkpoint_on_stop, daemon, *link, admin_token,
                                              absl::Milliseconds(*drain_timeout) + absl::Seconds(30));
      !s.ok()) {
    Log(LogLevel::kWarning, "daemon", absl::StrCat("checkpoint before exit failed: ", s.ToString()));
  }
  // 4. Deregister (the coordinator marks the daemon DOWN at once), 5. stop serving (calls
  // running now, e.g. pulls of the last version, get a few seconds), 6. stop the jobs.
  link->Shutdown();
  (*server)->Shutdown();
  if (ucx_server != nullptr) ucx_server->Shutdown();
  if (nccl_server != nullptr) nccl_server->Shutdown();
  if (ipc_server != nullptr) ipc_server->Shutdown();
  daemon.Shutdown();
  if (metrics_server != nullptr) metrics_server->Shutdown();
  if (lease_collector != 0) registry->RemoveCollector(lease_collector);
  if (embedded != nullptr) embedded->Shutdown();
  return 0;
}

}  // namespace
}  // namespace mainstay::daemon

int main(int argc, char** argv) { return mainstay::daemon::Main(argc, argv); }

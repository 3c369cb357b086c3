// mainstay-coordinator: the control-plane server (DESIGN.md section 6).
//
//   mainstay-coordinator --state-dir /var/lib/mainstay/coordinator [--listen 0.0.0.0:7070]
//                        [--lease-ttl-ms N] [--tick-ms N] [--config FILE] [--port-file FILE]
//
// Flags override the JSON config file. SIGTERM / SIGINT shut down gracefully (exit 0). Bad
// flags or config: a message and exit 2; a failure to start (port in use, state directory
// locked or corrupt): exit 1.
#include <pthread.h>
#include <signal.h>
#include <netdb.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/port_file.h"
#include "common/sd_notify.h"
#include "common/stop_signals.h"
#include "common/status.h"
#include "server/coordinator/admin_auth.h"
#include "server/coordinator/etcd_state_store.h"
#include "server/grpc/coordinator_service.h"
#include "server/grpc/standby_forwarder.h"
#include "server/metrics/metrics_server.h"
#include "server/metrics/registry.h"

namespace mainstay::coordinator {
namespace {

constexpr char kUsage[] = R"(usage: mainstay-coordinator (--state-dir DIR | --etcd-endpoints LIST) [flags]

The Mainstay coordinator: daemon membership, jobs, layouts, placement, a small KV store and
admin RPCs, over gRPC (services mainstay.v1.Coordinator and mainstay.v1.Admin, plus
grpc.health.v1.Health and server reflection).

flags:
  --listen HOST:PORT        address to serve on (default 0.0.0.0:7070; port 0 picks one)
  --state-dir DIR           directory of the durable state (one coordinator; required unless
                            --etcd-endpoints or the config gives the state's place)
  --etcd-endpoints LIST     keep the state in etcd instead (comma-separated [http://|https://]
                            HOST:PORT): run several coordinators against it; one leads, the
                            others wait as standbys and take over when its lease ends
                            (docs/coordinator.md, "State on etcd")
  --advertise-address HOST:PORT  with --etcd-endpoints: where the other coordinators reach this one
                            (default: the --listen host, or this host's name when that is a
                            wildcard, and the bound port); a standby passes every call it gets
                            to the leader's advertised address
  --etcd-prefix P           key prefix of this cluster's state in etcd (default /mainstay/)
  --etcd-lease-ttl-ms N     the leader's lease: a dead leader is replaced after about this long
                            (default 5000, at least 2000)
  --etcd-timeout-ms N       one call to one etcd member (default 2000)
  --etcd-ca-file FILE       PEM CA certificates that verify https:// etcd members
  --etcd-cert-file FILE     PEM client certificate for etcd (with --etcd-key-file)
  --etcd-key-file FILE      PEM private key of --etcd-cert-file
  --lease-ttl-ms N          default daemon lease in ms (default 10000)
  --tick-ms N               how often leases and KV TTLs are checked, ms (default 200)
  --coordinator-id ID       id reported to daemons (default <hostname>-<pid>)
  --max-message-bytes N     largest request accepted (default 67108864)
  --checkpoint-dir DIR      where checkpoints live; every daemon must reach it under the same path
                            (a shared file system across nodes). Unset: checkpoints are off
  --no-restore-on-loss      keep a job that lost a daemon DEGRADED instead of restoring it from
                            its newest checkpoint
  --checkpoint-every-steps N  checkpoint every job each N decided steps (default 0: off)
  --checkpoint-every-seconds N  ... or N seconds after its last one, if it decided a step since
                            (default 0: off)
  --checkpoint-keep N       periodic checkpoints kept per job, the newest (default 3; 0: all)
  --config FILE             JSON object with the keys listen, state_dir, etcd_endpoints,
                            etcd_prefix, lease_ttl_ms, tick_ms,
                            coordinator_id, max_message_bytes, checkpoint_dir, cluster_secret_file
                            (and the other file and TLS flags' names); flags override it
  --port-file FILE          write the bound port to FILE once serving (for scripts and tests)
  --tls-cert-file FILE      PEM certificate to serve TLS with (also the client certificate of the
                            calls to daemons); without it the port is plaintext
  --tls-key-file FILE       PEM private key of --tls-cert-file
  --tls-ca-file FILE        PEM CA certificates that verify daemons' servers and, with
                            --tls-client-auth require, clients' certificates
  --tls-client-auth MODE    none (default) or require: mutual TLS, refuse clients without a
                            certificate signed by --tls-ca-file
  --tls-server-name NAME    verify daemons' certificates against NAME instead of their address
  --tls-internal-name NAME  with mutual TLS: the certificate name (CN or SAN) only the cluster's
                            servers carry; daemons' calls (registration, heartbeats, the KV) from
                            other certificates (trainers', operators') are refused
  --cluster-secret-file FILE  the cluster secret (made, mode 0600, if FILE does not exist): daemons'
                            calls (registration, heartbeats, the KV) must present it, and the calls
                            to daemons present it; give every daemon a copy (docs/operations.md,
                            "Threat model")
  --insecure                without a cluster secret or --tls-internal-name, listen on a
                            non-loopback --listen anyway (anyone who reaches the port can then
                            register as a daemon); without this flag that is refused
  --health-listen HOST:PORT a plaintext port serving only grpc.health.v1 (for probes that cannot
                            speak TLS, e.g. Kubernetes'); default none
  --admin-token-file FILE   file holding the admin token; admin calls and job reads without a
                            job token then need it (PERMISSION_DENIED otherwise)
  --metrics-listen HOST:PORT  where Prometheus scrapes GET /metrics over HTTP (default
                            0.0.0.0:9464; port 0 picks one; "off": no metrics)
  --metrics-port-file FILE  write the metrics port to FILE once serving
  --inject-fault crash-at:POINT  tests only: SIGKILL this process at POINT, one of
                            create-job-committed (a CreateJob is durable, not yet answered) and
                            checkpoint-shards-written (the daemons wrote a checkpoint's shards,
                            its manifest is not written), move-committed, failover-committed,
                            re-replication-committed (that placement epoch is durable, no
                            daemon was sent it)
  --help                    this text

SIGTERM or SIGINT: graceful shutdown, exit 0. Bad flags or config: exit 2.
)";

// Values given on the command line or in the config; unset = not given.
struct Settings {
  std::optional<std::string> listen, advertise_address;
  std::optional<std::string> state_dir;
  std::optional<std::string> etcd_endpoints, etcd_prefix, etcd_ca_file, etcd_cert_file, etcd_key_file;
  std::optional<int64_t> etcd_lease_ttl_ms, etcd_timeout_ms;
  std::optional<int64_t> lease_ttl_ms;
  std::optional<int64_t> tick_ms;
  std::optional<std::string> coordinator_id;
  std::optional<int64_t> max_message_bytes;
  std::optional<std::string> checkpoint_dir;
  bool no_restore_on_loss = false;
  std::optional<int64_t> checkpoint_every_steps, checkpoint_every_seconds, checkpoint_keep;
  std::optional<std::string> config;
  std::optional<std::string> port_file;
  std::optional<std::string> tls_cert_file, tls_key_file, tls_ca_file, tls_client_auth, tls_server_name,
      tls_internal_name;
  std::optional<std::string> admin_token_file;
  std::optional<std::string> cluster_secret_file;
  bool insecure = false;
  std::optional<std::string> health_listen;
  std::optional<std::string> metrics_listen, metrics_port_file;
  std::optional<std::string> inject_fault;
  bool help = false;
};

absl::StatusOr<int64_t> ParsePositive(const std::string& name, const std::string& text) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a positive integer, got '", text, "'"));
  }
  return value;
}

absl::StatusOr<Settings> ParseFlags(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      s.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg;
    std::optional<std::string> value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    static const std::set<std::string> kKnown = {
        "--listen",          "--state-dir",       "--lease-ttl-ms",    "--tick-ms",
        "--coordinator-id",  "--max-message-bytes", "--config",        "--port-file",
        "--tls-cert-file",   "--tls-key-file",    "--tls-ca-file",     "--tls-client-auth",
        "--tls-server-name", "--admin-token-file", "--metrics-listen", "--metrics-port-file",
        "--health-listen",   "--tls-internal-name", "--checkpoint-dir", "--checkpoint-every-steps",
        "--checkpoint-every-seconds", "--checkpoint-keep", "--cluster-secret-file",
        "--etcd-endpoints",  "--etcd-prefix",     "--etcd-lease-ttl-ms", "--etcd-timeout-ms",
        "--etcd-ca-file",    "--etcd-cert-file",  "--etcd-key-file", "--advertise-address",
        "--inject-fault"};
    if (name == "--no-restore-on-loss") {
      s.no_restore_on_loss = true;
      continue;
    }
    if (name == "--insecure") {
      s.insecure = true;
      continue;
    }
    if (!kKnown.count(name)) return absl::InvalidArgumentError(absl::StrCat("unknown flag '", name, "'"));
    if (!value) {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(name, ": missing value"));
      value = argv[++i];
    }
    if (name == "--listen") s.listen = *value;
    if (name == "--advertise-address") s.advertise_address = *value;
    if (name == "--inject-fault") s.inject_fault = *value;
    if (name == "--state-dir") s.state_dir = *value;
    if (name == "--etcd-endpoints") s.etcd_endpoints = *value;
    if (name == "--etcd-prefix") s.etcd_prefix = *value;
    if (name == "--etcd-ca-file") s.etcd_ca_file = *value;
    if (name == "--etcd-cert-file") s.etcd_cert_file = *value;
    if (name == "--etcd-key-file") s.etcd_key_file = *value;
    if (name == "--coordinator-id") s.coordinator_id = *value;
    if (name == "--config") s.config = *value;
    if (name == "--port-file") s.port_file = *value;
    if (name == "--checkpoint-dir") s.checkpoint_dir = *value;
    if (name == "--tls-cert-file") s.tls_cert_file = *value;
    if (name == "--tls-key-file") s.tls_key_file = *value;
    if (name == "--tls-ca-file") s.tls_ca_file = *value;
    if (name == "--tls-client-auth") s.tls_client_auth = *value;
    if (name == "--tls-server-name") s.tls_server_name = *value;
    if (name == "--tls-internal-name") s.tls_internal_name = *value;
    if (name == "--cluster-secret-file") s.cluster_secret_file = *value;
    if (name == "--admin-token-file") s.admin_token_file = *value;
    if (name == "--health-listen") s.health_listen = *value;
    if (name == "--metrics-listen") s.metrics_listen = *value;
    if (name == "--metrics-port-file") s.metrics_port_file = *value;
    if (name == "--lease-ttl-ms") {
      MAINSTAY_ASSIGN_OR_RETURN(s.lease_ttl_ms, ParsePositive(name, *value));
    } else if (name == "--etcd-lease-ttl-ms") {
      MAINSTAY_ASSIGN_OR_RETURN(s.etcd_lease_ttl_ms, ParsePositive(name, *value));
    } else if (name == "--etcd-timeout-ms") {
      MAINSTAY_ASSIGN_OR_RETURN(s.etcd_timeout_ms, ParsePositive(name, *value));
    } else if (name == "--tick-ms") {
      MAINSTAY_ASSIGN_OR_RETURN(s.tick_ms, ParsePositive(name, *value));
    } else if (name == "--max-message-bytes") {
      MAINSTAY_ASSIGN_OR_RETURN(s.max_message_bytes, ParsePositive(name, *value));
    } else if (name == "--checkpoint-every-steps" || name == "--checkpoint-every-seconds" ||
               name == "--checkpoint-keep") {
      int64_t n = 0;
      if (!absl::SimpleAtoi(*value, &n) || n < 0 || n > (int64_t{1} << 40)) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": expected an integer >= 0, got '", *value, "'"));
      }
      (name == "--checkpoint-every-steps"    ? s.checkpoint_every_steps
       : name == "--checkpoint-every-seconds" ? s.checkpoint_every_seconds
                                              : s.checkpoint_keep) = n;
    }
  }
  return s;
}

// Fills the settings the flags left unset from the JSON config file.
absl::Status ApplyConfig(const std::string& path, Settings& s) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--config: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("--config ", path, ": not a JSON object"));
  }
  auto where = [&](const std::string& key) { return absl::StrCat("--config ", path, ": ", key); };
  auto get_string = [&](const std::string& key, std::optional<std::string>& out) -> absl::Status {
    if (!j.contains(key)) return absl::OkStatus();
    if (!j[key].is_string()) return absl::InvalidArgumentError(absl::StrCat(where(key), ": must be a string"));
    if (!out) out = j[key].get<std::string>();
    return absl::OkStatus();
  };
  auto get_int = [&](const std::string& key, std::optional<int64_t>& out) -> absl::Status {
    if (!j.contains(key)) return absl::OkStatus();
    if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(where(key), ": must be a positive integer, got ", j[key].dump()));
    }
    if (!out) out = j[key].get<int64_t>();
    return absl::OkStatus();
  };
  static const std::set<std::string> kKeys = {
      "listen",          "state_dir",       "lease_ttl_ms",    "tick_ms",          "coordinator_id",
      "max_message_bytes", "tls_cert_file", "tls_key_file",    "tls_ca_file",      "tls_client_auth",
      "tls_server_name", "admin_token_file", "metrics_listen", "health_listen", "tls_internal_name",
      "checkpoint_dir", "cluster_secret_file", "etcd_endpoints", "etcd_prefix", "etcd_ca_file",
      "etcd_cert_file", "etcd_key_file", "etcd_lease_ttl_ms", "etcd_timeout_ms", "advertise_address"};
  for (const auto& [key, value] : j.items()) {
    if (!kKeys.count(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(key), ": unknown key (known: ", absl::StrJoin(kKeys, ", "), ")"));
    }
  }
  MAINSTAY_RETURN_IF_ERROR(get_string("listen", s.listen));
  MAINSTAY_RETURN_IF_ERROR(get_string("advertise_address", s.advertise_address));
  MAINSTAY_RETURN_IF_ERROR(get_string("state_dir", s.state_dir));
  MAINSTAY_RETURN_IF_ERROR(get_string("etcd_endpoints", s.etcd_endpoints));
  MAINSTAY_RETURN_IF_ERROR(get_string("etcd_prefix", s.etcd_prefix));
  MAINSTAY_RETURN_IF_ERROR(get_string("etcd_ca_file", s.etcd_ca_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("etcd_cert_file", s.etcd_cert_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("etcd_key_file", s.etcd_key_file));
  MAINSTAY_RETURN_IF_ERROR(get_int("etcd_lease_ttl_ms", s.etcd_lease_ttl_ms));
  MAINSTAY_RETURN_IF_ERROR(get_int("etcd_timeout_ms", s.etcd_timeout_ms));
  MAINSTAY_RETURN_IF_ERROR(get_string("checkpoint_dir", s.checkpoint_dir));
  MAINSTAY_RETURN_IF_ERROR(get_string("coordinator_id", s.coordinator_id));
  MAINSTAY_RETURN_IF_ERROR(get_string("tls_cert_file", s.tls_cert_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("tls_key_file", s.tls_key_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("tls_ca_file", s.tls_ca_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("tls_client_auth", s.tls_client_auth));
  MAINSTAY_RETURN_IF_ERROR(get_string("tls_server_name", s.tls_server_name));
  MAINSTAY_RETURN_IF_ERROR(get_string("tls_internal_name", s.tls_internal_name));
  MAINSTAY_RETURN_IF_ERROR(get_string("admin_token_file", s.admin_token_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("cluster_secret_file", s.cluster_secret_file));
  MAINSTAY_RETURN_IF_ERROR(get_string("metrics_listen", s.metrics_listen));
  MAINSTAY_RETURN_IF_ERROR(get_string("health_listen", s.health_listen));
  MAINSTAY_RETURN_IF_ERROR(get_int("lease_ttl_ms", s.lease_ttl_ms));
  MAINSTAY_RETURN_IF_ERROR(get_int("tick_ms", s.tick_ms));
  MAINSTAY_RETURN_IF_ERROR(get_int("max_message_bytes", s.max_message_bytes));
  return absl::OkStatus();
}

absl::StatusOr<CoordinatorServer::Options> ToOptions(const Settings& s) {
  CoordinatorServer::Options o;
  o.listen_address = s.listen.value_or("0.0.0.0:7070");
  if (o.listen_address.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--listen: expected HOST:PORT, got '", o.listen_address, "'"));
  }
  const bool etcd = s.etcd_endpoints.has_value();
  if (etcd && s.state_dir) {
    return absl::InvalidArgumentError("--state-dir and --etcd-endpoints: the state lives in one place, give one");
  }
  if (!etcd && (!s.state_dir || s.state_dir->empty())) {
    return absl::InvalidArgumentError("--state-dir or --etcd-endpoints is required (or state_dir in --config)");
  }
  if (!etcd && (s.etcd_prefix || s.etcd_lease_ttl_ms || s.etcd_timeout_ms || s.etcd_ca_file || s.etcd_cert_file ||
                s.advertise_address)) {
    return absl::InvalidArgumentError("--etcd-* flags and --advertise-address need --etcd-endpoints");
  }
  if (s.advertise_address && s.advertise_address->rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--advertise-address: expected HOST:PORT, got '", *s.advertise_address, "'"));
  }
  if (s.state_dir) o.state_dir = *s.state_dir;
  if (s.checkpoint_dir) o.checkpoint_dir = *s.checkpoint_dir;
  o.restore_on_daemon_loss = !s.no_restore_on_loss;
  const bool policy = s.checkpoint_every_steps.value_or(0) > 0 || s.checkpoint_every_seconds.value_or(0) > 0;
  if (policy && o.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("--checkpoint-every-steps/--checkpoint-every-seconds need --checkpoint-dir");
  }
  o.checkpoint_every_steps = s.checkpoint_every_steps.value_or(0);
  o.checkpoint_every_ms = s.checkpoint_every_seconds.value_or(0) * 1000;
  o.checkpoint_keep = static_cast<int>(s.checkpoint_keep.value_or(3));
  if (s.lease_ttl_ms) o.lease_ttl_ms = *s.lease_ttl_ms;
  if (s.tick_ms) o.tick_interval_ms = *s.tick_ms;
  if (s.coordinator_id) o.coordinator_id = *s.coordinator_id;
  if (s.max_message_bytes) {
    if (*s.max_message_bytes > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("max_message_bytes: at most ", std::numeric_limits<int>::max()));
    }
    o.max_message_bytes = static_cast<int>(*s.max_message_bytes);
  }
  o.tls.cert_file = s.tls_cert_file.value_or("");
  o.tls.key_file = s.tls_key_file.value_or("");
  o.tls.ca_file = s.tls_ca_file.value_or("");
  o.tls.server_name = s.tls_server_name.value_or("");
  const std::string client_auth = s.tls_client_auth.value_or("none");
  if (client_auth != "none" && client_auth != "require") {
    return absl::InvalidArgumentError(absl::StrCat("--tls-client-auth: none or require, got '", client_auth, "'"));
  }
  o.tls.require_client_cert = client_auth == "require";
  o.internal_peer_name = s.tls_internal_name.value_or("");
  o.health_listen_address = s.health_listen.value_or("");
  if (!o.health_listen_address.empty() && o.health_listen_address.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--health-listen: expected HOST:PORT, got '", o.health_listen_address, "'"));
  }
  if (s.admin_token_file) {
    MAINSTAY_ASSIGN_OR_RETURN(o.admin_token, AdminAuth::ReadTokenFile(*s.admin_token_file));
  }
  if (s.cluster_secret_file) {  // made on first start: the daemons get a copy of it
    MAINSTAY_ASSIGN_OR_RETURN(o.cluster_secret, ClusterSecret::Load(*s.cluster_secret_file, /*create=*/true));
  }
  o.insecure = s.insecure;
  if (s.inject_fault) {
    static const std::set<std::string> kPoints = {"create-job-committed", "checkpoint-shards-written",
                                                  "move-committed", "failover-committed",
                                                  "re-replication-committed"};
    const std::string spec = *s.inject_fault;
    const std::string point = spec.rfind("crash-at:", 0) == 0 ? spec.substr(9) : "";
    if (!kPoints.count(point)) {
      return absl::InvalidArgumentError(absl::StrCat("--inject-fault: expected crash-at:POINT with POINT one of ",
                                                     absl::StrJoin(kPoints, ", "), ", got '", spec, "'"));
    }
    o.fault_point = [point](const std::string& at) {
      if (at != point) return;
      Log(LogLevel::kError, "coordinator", absl::StrCat("--inject-fault: killing this process at ", at));
      ::raise(SIGKILL);
    };
  }
  if (const std::string m = s.metrics_listen.value_or("0.0.0.0:9464"); m != "off") {
    if (absl::Status st = metrics::SplitHostPort(m).status(); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics-listen: ", st.message()));
    }
  }
  return o;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> ConnectEtcd(const Settings& s) {
  EtcdOptions o;
  MAINSTAY_ASSIGN_OR_RETURN(o.endpoints, ParseEtcdEndpoints(*s.etcd_endpoints));
  if (s.etcd_prefix) o.prefix = *s.etcd_prefix;
  if (s.etcd_lease_ttl_ms) o.lease_ttl = absl::Milliseconds(*s.etcd_lease_ttl_ms);
  if (s.etcd_timeout_ms) o.call_timeout = absl::Milliseconds(*s.etcd_timeout_ms);
  o.ca_file = s.etcd_ca_file.value_or("");
  o.cert_file = s.etcd_cert_file.value_or("");
  o.key_file = s.etcd_key_file.value_or("");
  return EtcdClient::Create(o);
}

// The leader key's value: "<coordinator id> at <advertised address> (takes forwarded calls)".
// The suffix says the leader reads the standbys' mark of callers that are not internal peers
// (caller_identity.h): a leader of an older version would not, and is never forwarded to.
constexpr char kTakesForwardedCalls[] = " (takes forwarded calls)";
std::string LeaderKeyValue(const std::string& id, const std::string& address) {
  return absl::StrCat(id, " at ", address, kTakesForwardedCalls);
}
// The leader's advertised address; "" when the value is not of a leader that takes forwarded calls.
std::string LeaderAddressOf(const std::string& value) {
  if (!absl::EndsWith(value, kTakesForwardedCalls)) return "";
  const std::string head = value.substr(0, value.size() - std::strlen(kTakesForwardedCalls));
  const size_t at = head.rfind(" at ");
  return at == std::string::npos ? "" : head.substr(at + 4);
}

// Where the other coordinators reach this one: --advertise-address, else the listen host (this
// host's name for a wildcard) with the bound port.
// INVALID_ARGUMENT when its host does not resolve here (it must resolve at the other
// coordinators too: a standby forwards every call there).
absl::StatusOr<std::string> AdvertisedAddress(const Settings& s, const std::string& listen_host, int port) {
  std::string address;
  if (s.advertise_address) {
    address = *s.advertise_address;
  } else {
    std::string host = listen_host;
    if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
      char name[256] = {};
      host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
    }
    address = absl::StrCat(host, ":", port);
  }
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo* found = nullptr;
  if (const int err = ::getaddrinfo(host.c_str(), nullptr, nullptr, &found); err != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--advertise-address: '", host, "' (of ", address,
                                                   ") does not resolve here: ", ::gai_strerror(err),
                                                   "; give --advertise-address HOST:PORT that the other coordinators reach"));
  }
  ::freeaddrinfo(found);
  return address;
}

int Main(int argc, char** argv) {
  // First: any thread started later (gRPC's and UCX's own ones, started by credentials and
  // contexts as the flags are read) inherits the mask, so only Wait below takes SIGTERM.
  const StopSignals stop_signals = StopSignals::Block();
  absl::StatusOr<Settings> settings = ParseFlags(argc, argv);
  if (settings.ok() && settings->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (settings.ok() && settings->config) {
    absl::Status s = ApplyConfig(*settings->config, *settings);
    if (!s.ok()) settings = s;
  }
  absl::StatusOr<CoordinatorServer::Options> options =
      settings.ok() ? ToOptions(*settings) : absl::StatusOr<CoordinatorServer::Options>(settings.status());
  if (!options.ok()) {
    std::fprintf(stderr, "mainstay-coordinator: %s\n(see --help)\n", std::string(options.status().message()).c_str());
    return 2;
  }

  if (settings->inject_fault) {
    Log(LogLevel::kWarning, "coordinator", absl::StrCat("fault injection on: --inject-fault ", *settings->inject_fault));
  }

  const std::string metrics_listen = settings->metrics_listen.value_or("0.0.0.0:9464");
  std::unique_ptr<metrics::Registry> registry;  // null: --metrics-listen off
  if (metrics_listen != "off") registry = std::make_unique<metrics::Registry>();
  options->metrics = registry.get();

  // With etcd: wait as a standby until this coordinator holds the leader key, passing every
  // call made to it to the leader meanwhile (server/grpc/standby_forwarder.h); then serve from
  // the state in etcd, on the same port. Losing the lease later stops the coordinator (exit 1):
  // a supervisor restarts it as a standby.
  std::unique_ptr<EtcdClient> etcd;
  std::unique_ptr<EtcdLeadership> leadership;
  std::unique_ptr<StateStore> etcd_store;
  static std::atomic<bool> leadership_lost{false};
  const std::string listen_host = options->listen_address.substr(0, options->listen_address.rfind(':'));
  bool port_file_written = false;
  if (settings->etcd_endpoints) {
    absl::StatusOr<std::unique_ptr<EtcdClient>> client = ConnectEtcd(*settings);
    absl::Status checked = client.ok() ? CoordinatorServer::CheckOptions(*options) : client.status();
    if (!checked.ok()) {
      std::fprintf(stderr, "mainstay-coordinator: %s\n(see --help)\n", std::string(checked.message()).c_str());
      return 2;
    }
    etcd = *std::move(client);
    if (options->coordinator_id.empty()) options->coordinator_id = CoordinatorServer::DefaultCoordinatorId();
    grpc_server::StandbyForwarder::Options forwarding;
    forwarding.listen_address = options->listen_address;
    forwarding.tls = options->tls;
    forwarding.max_message_bytes = options->max_message_bytes;
    forwarding.internal = CoordinatorServer::InternalPeersOf(*options);
    forwarding.id = options->coordinator_id;
    absl::StatusOr<std::unique_ptr<grpc_server::StandbyForwarder>> forwarder =
        grpc_server::StandbyForwarder::Start(forwarding);
    if (!forwarder.ok()) {
      std::fprintf(stderr, "mainstay-coordinator: %s\n", forwarder.status().ToString().c_str());
      return forwarder.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    // The port stays this coordinator's: the leader's server binds it again at takeover.
    const int port = (*forwarder)->port();
    options->listen_address = absl::StrCat(listen_host, ":", port);
    absl::StatusOr<std::string> advertised_or = AdvertisedAddress(*settings, listen_host, port);
    if (!advertised_or.ok()) {
      std::fprintf(stderr, "mainstay-coordinator: %s\n", std::string(advertised_or.status().message()).c_str());
      return 2;
    }
    const std::string advertised = *advertised_or;
    const std::string who = LeaderKeyValue(options->coordinator_id, advertised);
    if (settings->port_file) {
      if (absl::Status s = WritePortFile(*settings->port_file, port); !s.ok()) {
        std::fprintf(stderr, "mainstay-coordinator: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      port_file_written = true;
    }
    std::string last_holder;
    absl::Time next_warning = absl::InfinitePast();
    while (leadership == nullptr) {
      absl::StatusOr<std::string> holder = EtcdLeadership::Holder(etcd.get());
      if (holder.ok() && holder->empty()) {
        std::string taken;
        absl::StatusOr<std::unique_ptr<EtcdLeadership>> won = EtcdLeadership::TryAcquire(etcd.get(), who, &taken);
        if (won.ok() && *won != nullptr) {
          leadership = *std::move(won);
          break;
        }
        holder = won.ok() ? absl::StatusOr<std::string>(taken) : won.status();
      }
      if (!holder.ok() && absl::Now() >= next_warning) {
        Log(LogLevel::kWarning, "coordinator", absl::StrCat("standby: etcd does not answer: ", holder.status().message()));
        next_warning = absl::Now() + absl::Seconds(10);
      } else if (holder.ok() && *holder != last_holder) {
        // Not to itself (a key this coordinator wrote before a restart, its lease not ended).
        const std::string leader = LeaderAddressOf(*holder);
        (*forwarder)->SetLeader(leader == advertised ? "" : leader);
        if (leader.empty() && !holder->empty()) {
          Log(LogLevel::kWarning, "coordinator",
              absl::StrCat("standby: the leader (", *holder, ") does not take forwarded calls (an older version): ",
                           "calls here are refused until a coordinator of this version leads"));
        }
        Log(LogLevel::kInfo, "coordinator",
            absl::StrCat("standby: ", *holder, " leads (etcd key ", etcd->options().prefix,
                         "leader); calls to ", advertised, " go to it, and this one takes over when its lease ends"));
        last_holder = *holder;
        // A standby is a started unit (Type=notify): it runs as meant.
        if (absl::Status s = SdNotify(absl::StrCat("READY=1\nSTATUS=standby: ", *holder, " leads")); !s.ok()) {
          Log(LogLevel::kWarning, "coordinator", s.message());
        }
      }
      if (const int signal_number = stop_signals.WaitFor(300); signal_number != 0) {
        Log(LogLevel::kInfo, "coordinator", absl::StrCat("signal ", signal_number, ": standby stopping"));
        (*forwarder)->Shutdown();
        return 0;
      }
    }
    // The lease is kept alive from now on: closing the standby's port may take a second or two.
    leadership->Start([](const absl::Status& why) {
      Log(LogLevel::kError, "coordinator", absl::StrCat(why.message(), "; stopping (exit 1)"));
      leadership_lost = true;
      ::kill(::getpid(), SIGTERM);
    });
    (*forwarder)->Shutdown();
    Log(LogLevel::kInfo, "coordinator",
        absl::StrCat("leading (etcd key ", leadership->key(), ", lease ", leadership->lease(), ", TTL ",
                     absl::FormatDuration(etcd->options().lease_ttl), ", advertised as ", advertised, ")"));
    etcd_store = NewEtcdStateStore(etcd.get(), leadership.get());
    options->store = etcd_store.get();
    options->state_description = absl::StrCat("etcd ", *settings->etcd_endpoints, " prefix ", etcd->options().prefix);
  }

  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server = CoordinatorServer::Start(*options);
  if (!server.ok()) {
    std::fprintf(stderr, "mainstay-coordinator: %s\n", server.status().ToString().c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  const std::string& host = listen_host;
  std::fprintf(stderr, "mainstay-coordinator listening on %s:%d\n", host.c_str(), (*server)->port());
  if ((*server)->health_port() != 0) {
    std::fprintf(stderr, "mainstay-coordinator: plaintext health port %d\n", (*server)->health_port());
  }
  std::fflush(stderr);
  if (settings->port_file && !port_file_written) {
    absl::Status s = WritePortFile(*settings->port_file, (*server)->port());
    if (!s.ok()) {
      std::fprintf(stderr, "mainstay-coordinator: %s\n", std::string(s.message()).c_str());
      (*server)->Shutdown();
      return 1;
    }
  }

  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (registry != nullptr) {
    absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> started =
        metrics::MetricsServer::Start({metrics_listen, registry.get()});
    if (!started.ok() && settings->metrics_listen) {
      std::fprintf(stderr, "mainstay-coordinator: %s\n", started.status().ToString().c_str());
      (*server)->Shutdown();
      return 1;
    }
    if (!started.ok()) {
      // Only the default port: a daemon on the same host may hold it.
      Log(LogLevel::kWarning, "coordinator",
          absl::StrCat("no metrics endpoint: ", started.status().message(), "; pass --metrics-listen HOST:PORT (or off)"));
    } else {
      metrics_server = *std::move(started);
      std::fprintf(stderr, "mainstay-coordinator: metrics on http://%s:%d/metrics\n",
                   metrics_listen.substr(0, metrics_listen.rfind(':')).c_str(), metrics_server->port());
      if (settings->metrics_port_file) {
        if (absl::Status s = WritePortFile(*settings->metrics_port_file, metrics_server->port()); !s.ok()) {
          std::fprintf(stderr, "mainstay-coordinator: %s\n", std::string(s.message()).c_str());
          (*server)->Shutdown();
          return 1;
        }
      }
    }
  }

  // Type=notify units (deploy/systemd) count as started only now; a no-op outside systemd.
  if (absl::Status s = SdNotify(absl::StrCat("READY=1\nSTATUS=serving on ", host, ":", (*server)->port())); !s.ok()) {
    Log(LogLevel::kWarning, "coordinator", s.message());
  }

  const int signal_number = stop_signals.Wait();
  Log(LogLevel::kInfo, "coordinator", absl::StrCat("signal ", signal_number, ": shutting down"));
  if (absl::Status s = SdNotify("STOPPING=1"); !s.ok()) Log(LogLevel::kWarning, "coordinator", s.message());
  (*server)->Shutdown();
  if (metrics_server != nullptr) metrics_server->Shutdown();
  server->reset();
  return leadership_lost ? 1 : 0;
}

}  // namespace
}  // namespace mainstay::coordinator

int main(int argc, char** argv) { return mainstay::coordinator::Main(argc, argv); }

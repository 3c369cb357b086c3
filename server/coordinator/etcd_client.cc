#include "server/coordinator/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace mainstay::coordinator {

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& where) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(where, ": ", s.error_message()));
}

bool TryNext(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::string e(absl::StripAsciiWhitespace(part));
    absl::string_view hostport = e;
    if (absl::StartsWith(hostport, "http://")) hostport.remove_prefix(7);
    if (absl::StartsWith(hostport, "https://")) hostport.remove_prefix(8);
    const size_t colon = hostport.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 || !absl::SimpleAtoi(hostport.substr(colon + 1), &port) ||
        port <= 0 || port > 65535 || hostport.find('/') != absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--etcd-endpoints: '", e, "' is not [http://|https://]HOST:PORT (e.g. http://10.0.0.5:2379)"));
    }
    out.push_back(e);
  }
  if (out.empty()) return absl::InvalidArgumentError("--etcd-endpoints: no endpoint given");
  return out;
}

struct EtcdClient::Endpoint {
  std::string name;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
};

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {}
EtcdClient::~EtcdClient() = default;

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(const EtcdOptions& options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("etcd: no endpoints");
  if (options.lease_ttl < absl::Seconds(2)) {
    return absl::InvalidArgumentError(absl::StrCat("--etcd-lease-ttl-ms: at least 2000 (etcd leases count whole ",
                                                   "seconds), got ", absl::ToInt64Milliseconds(options.lease_ttl)));
  }
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--etcd-timeout-ms: must be > 0");
  }
  if (options.prefix.empty() || options.prefix.back() != '/') {
    return absl::InvalidArgumentError(absl::StrCat("--etcd-prefix: must end with '/', got '", options.prefix, "'"));
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError("--etcd-cert-file and --etcd-key-file go together");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("--etcd-ca-file", options.ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!options.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem("--etcd-cert-file", options.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem("--etcd-key-file", options.key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  auto client = std::unique_ptr<EtcdClient>(new EtcdClient(options));
  for (const std::string& e : options.endpoints) {
    const bool tls = absl::StartsWith(e, "https://");
    if (tls && options.ca_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--etcd-endpoints: ", e, " is https: give --etcd-ca-file"));
    }
    std::string target = e;
    if (absl::StartsWith(target, "http://")) target = target.substr(7);
    if (absl::StartsWith(target, "https://")) target = target.substr(8);
    grpc::ChannelArguments args;
    // An etcd member that restarts is back within a second or two: reconnect that fast. (gRPC's
    // defaults give each connection attempt 20 s and back off to 120 s between them; the
    // minimum is also the connect timeout, so not below a second.)
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // Load pages the log, but one page of batches (each up to 1 MiB) can pass gRPC's 4 MiB.
    args.SetMaxReceiveMessageSize(-1);
    std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
        target, tls ? grpc::SslCredentials(ssl) : grpc::InsecureChannelCredentials(), args);
    auto endpoint = std::make_unique<Endpoint>();
    endpoint->name = e;
    endpoint->kv = etcdserverpb::KV::NewStub(channel);
    endpoint->lease = etcdserverpb::Lease::NewStub(channel);
    client->endpoints_.push_back(std::move(endpoint));
  }
  return client;
}

template <typename Fn>
absl::Status EtcdClient::OnSomeEndpoint(const char* what, Fn call, absl::Duration timeout) {
  const size_t n = endpoints_.size();
  const size_t first = current_.load();
  absl::Status last;
  std::string tried;
  for (size_t i = 0; i < n; ++i) {
    const size_t index = (first + i) % n;
    Endpoint& e = *endpoints_[index];
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + std::min(timeout, options_.call_timeout)));
    // One endpoint: wait for it to come back (a restart) within the call's time. Several: a
    // member that is down fails at once and the next one is asked.
    context.set_wait_for_ready(n == 1);
    last = FromGrpc(call(e, &context), absl::StrCat("etcd ", what, " at ", e.name));
    if (!TryNext(last)) {
      current_.store(index);
      return last;
    }
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", last.message());
  }
  return absl::UnavailableError(absl::StrCat("no etcd endpoint answered (", tried, ")"));
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(const etcdserverpb::RangeRequest& request) {
  etcdserverpb::RangeResponse response;
  absl::Status s = OnSomeEndpoint("Range", [&](Endpoint& e, grpc::ClientContext* c) {
    response.Clear();
    return e.kv->Range(c, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status s = OnSomeEndpoint("Txn", [&](Endpoint& e, grpc::ClientContext* c) {
    response.Clear();
    return e.kv->Txn(c, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(absl::Duration ttl) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(ttl)));
  etcdserverpb::LeaseGrantResponse response;
  absl::Status s = OnSomeEndpoint("LeaseGrant", [&](Endpoint& e, grpc::ClientContext* c) {
    return e.lease->LeaseGrant(c, request, &response);
  });
  if (!s.ok()) return s;
  if (!response.error().empty()) return absl::UnavailableError(absl::StrCat("etcd LeaseGrant: ", response.error()));
  return response.id();
}

absl::StatusOr<int64_t> EtcdClient::KeepAlive(int64_t lease) {
  etcdserverpb::LeaseKeepAliveResponse response;
  // A round must leave time for the next endpoint (and the next round) within the lease.
  absl::Status s = OnSomeEndpoint("LeaseKeepAlive", [&](Endpoint& e, grpc::ClientContext* c) {
    auto stream = e.lease->LeaseKeepAlive(c);
    etcdserverpb::LeaseKeepAliveRequest request;
    request.set_id(lease);
    if (!stream->Write(request) || !stream->Read(&response)) {
      // (Finish without cancelling first: a cancel would turn the real error into CANCELLED,
      // which does not move on to the next endpoint.)
      grpc::Status finished = stream->Finish();
      return finished.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the keep-alive stream closed") : finished;
    }
    stream->WritesDone();
    c->TryCancel();  // one round is all we need
    stream->Finish();
    return grpc::Status::OK;
  }, options_.lease_ttl / 4);
  if (!s.ok()) return s;
  return response.ttl();
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseRevokeResponse response;
  return OnSomeEndpoint("LeaseRevoke", [&](Endpoint& e, grpc::ClientContext* c) {
    return e.lease->LeaseRevoke(c, request, &response);
  });
}

}  // namespace mainstay::coordinator

#include "common/grpc_tls.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include <grpcpp/support/client_interceptor.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace mainstay {
namespace {

// The whole file; INVALID_ARGUMENT with the path and errno's reason when it cannot be read.
absl::StatusOr<std::string> ReadPem(const std::string& what, const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot read: ", std::strerror(errno)));
  }
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) text.append(buffer, n);
  const bool failed = std::ferror(f) != 0;
  const int error = errno;
  std::fclose(f);
  if (failed) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot read: ", std::strerror(error)));
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": the file is empty"));
  return text;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioFree> MemoryBio(const std::string& text) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// The first certificate of a PEM text; null when there is none.
std::unique_ptr<X509, X509Free> FirstCertificate(const std::string& pem) {
  auto bio = MemoryBio(pem);
  std::unique_ptr<X509, X509Free> cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  return cert;
}

struct Pems {
  std::string cert, key, ca;
};

// Reads and checks the files the options name.
absl::StatusOr<Pems> LoadPems(const TlsOptions& o, bool server) {
  if (!o.cert_file.empty() && o.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS certificate file ", o.cert_file, " given without its key file"));
  }
  if (o.cert_file.empty() && !o.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS key file ", o.key_file, " given without a certificate file"));
  }
  if (server && o.require_client_cert && o.ca_file.empty()) {
    return absl::InvalidArgumentError("TLS client certificates required but no CA file to verify them with");
  }
  if (server && o.require_client_cert && o.cert_file.empty()) {
    return absl::InvalidArgumentError("TLS client certificates required but no server certificate and key");
  }
  Pems pems;
  if (!o.cert_file.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(pems.cert, ReadPem("TLS certificate file", o.cert_file));
    MAINSTAY_ASSIGN_OR_RETURN(pems.key, ReadPem("TLS key file", o.key_file));
    std::unique_ptr<X509, X509Free> cert = FirstCertificate(pems.cert);
    if (cert == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS certificate file ", o.cert_file, ": no PEM certificate in it"));
    }
    auto bio = MemoryBio(pems.key);
    std::unique_ptr<EVP_PKEY, KeyFree> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    ERR_clear_error();
    if (key == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS key file ", o.key_file, ": no unencrypted PEM private key in it"));
    }
    if (X509_check_private_key(cert.get(), key.get()) != 1) {
      ERR_clear_error();
      return absl::InvalidArgumentError(absl::StrCat("TLS key file ", o.key_file,
                                                     ": does not match the certificate in ", o.cert_file));
    }
  }
  if (!o.ca_file.empty()) {
    MAINSTAY_ASSIGN_OR_RETURN(pems.ca, ReadPem("TLS CA file", o.ca_file));
    if (FirstCertificate(pems.ca) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("TLS CA file ", o.ca_file, ": no PEM certificate in it"));
    }
  }
  return pems;
}

}  // namespace

absl::StatusOr<std::shared_ptr<::grpc::ServerCredentials>> MakeServerCredentials(const TlsOptions& options) {
  if (!options.ServerEnabled()) {
    if (!options.key_file.empty() || options.require_client_cert) {
      MAINSTAY_RETURN_IF_ERROR(LoadPems(options, /*server=*/true).status());  // names the inconsistency
    }
    return ::grpc::InsecureServerCredentials();
  }
  MAINSTAY_ASSIGN_OR_RETURN(Pems pems, LoadPems(options, /*server=*/true));
  ::grpc::SslServerCredentialsOptions ssl(options.require_client_cert
                                              ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                              : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  // Without mutual TLS the CA file is only for this process's outgoing calls.
  if (options.require_client_cert) ssl.pem_root_certs = pems.ca;
  ssl.pem_key_cert_pairs.push_back({pems.key, pems.cert});
  return ::grpc::SslServerCredentials(ssl);
}

ChannelSecurity::ChannelSecurity() : credentials_(::grpc::InsecureChannelCredentials()) {}

absl::StatusOr<ChannelSecurity> ChannelSecurity::Create(const TlsOptions& options) {
  ChannelSecurity security;
  if (!options.ClientEnabled()) return security;
  MAINSTAY_ASSIGN_OR_RETURN(Pems pems, LoadPems(options, /*server=*/false));
  ::grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = pems.ca;  // empty: gRPC's default roots
  ssl.pem_private_key = pems.key;
  ssl.pem_cert_chain = pems.cert;
  security.credentials_ = ::grpc::SslCredentials(ssl);
  security.server_name_ = options.server_name;
  security.tls_ = true;
  return security;
}

namespace {

// Adds the cluster secret to the initial metadata of every call.
class SecretInterceptor final : public ::grpc::experimental::Interceptor {
 public:
  explicit SecretInterceptor(const std::string* secret) : secret_(secret) {}
  void Intercept(::grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(::grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({kClusterSecretMetadata, *secret_});
    }
    methods->Proceed();
  }

 private:
  const std::string* secret_;
};

class SecretInterceptorFactory final : public ::grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit SecretInterceptorFactory(std::string secret) : secret_(std::move(secret)) {}
  ::grpc::experimental::Interceptor* CreateClientInterceptor(::grpc::experimental::ClientRpcInfo*) override {
    return new SecretInterceptor(&secret_);
  }

 private:
  const std::string secret_;  // outlives its interceptors: the channel owns the factory
};

}  // namespace

ChannelSecurity ChannelSecurity::WithClusterSecret(ClusterSecret secret) const {
  ChannelSecurity out = *this;
  out.secret_ = std::move(secret);
  return out;
}

std::shared_ptr<::grpc::Channel> ChannelSecurity::CreateChannel(const std::string& address,
                                                                ::grpc::ChannelArguments args) const {
  if (!server_name_.empty()) args.SetSslTargetNameOverride(server_name_);
  if (!secret_.enabled()) return ::grpc::CreateCustomChannel(address, credentials_, args);
  std::vector<std::unique_ptr<::grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<SecretInterceptorFactory>(secret_.value()));
  return ::grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials_, args,
                                                                   std::move(interceptors));
}

absl::StatusOr<std::shared_ptr<::grpc::Channel>> ChannelSecurity::CreateCoordinatorChannel(
    const std::string& addresses, ::grpc::ChannelArguments args) const {
  // A coordinator that restarts, or a standby that takes over, must be found within a second,
  // not after gRPC's default reconnect backoff (up to 2 minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  if (addresses.find(',') == std::string::npos) return CreateChannel(addresses, args);
  std::vector<std::string> v4, v6;
  for (absl::string_view part : absl::StrSplit(addresses, ',', absl::SkipWhitespace())) {
    const std::string entry(absl::StripAsciiWhitespace(part));
    const size_t colon = entry.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(entry.substr(colon + 1), &port) || port <= 0 ||
        port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("coordinator address list '", addresses, "': '", entry, "' is not HOST:PORT"));
    }
    std::string host = entry.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
      return absl::InvalidArgumentError(absl::StrCat("coordinator address list '", addresses, "': cannot resolve '",
                                                     host, "': ", ::gai_strerror(rc)));
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char ip[INET6_ADDRSTRLEN] = {0};
      if (a->ai_family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
        const std::string one = absl::StrCat(ip, ":", port);
        if (std::find(v4.begin(), v4.end(), one) == v4.end()) v4.push_back(one);
      } else if (a->ai_family == AF_INET6) {
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip, sizeof(ip));
        const std::string one = absl::StrCat("[", ip, "]:", port);
        if (std::find(v6.begin(), v6.end(), one) == v6.end()) v6.push_back(one);
      }
    }
    ::freeaddrinfo(found);
  }
  // gRPC's ipv4: and ipv6: targets take one family each: IPv4 where there is any.
  if (v4.empty() && v6.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("coordinator address list '", addresses, "': no address"));
  }
  const std::string target = v4.empty() ? absl::StrCat("ipv6:", absl::StrJoin(v6, ",")) : absl::StrCat("ipv4:", absl::StrJoin(v4, ","));
  return CreateChannel(target, args);
}

}  // namespace mainstay

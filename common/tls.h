// TLS settings shared by every gRPC server and client of Mainstay (DESIGN.md section 8): which
// PEM files a process presents and trusts. Plain data, no gRPC here; common/grpc_tls.h turns
// it into gRPC credentials (the one place that does).
//
// One set per process: a server presents cert_file/key_file to its clients; the same pair is
// the client certificate of its own outgoing calls (a daemon calling the coordinator, the
// coordinator calling daemons), and ca_file verifies the other side in both directions.
//
// Thread safety: a value type.
#ifndef MAINSTAY_COMMON_TLS_H_
#define MAINSTAY_COMMON_TLS_H_

#include <string>

namespace mainstay {

struct TlsOptions {
  // PEM certificate (chain) this side presents: a server's certificate, and the client
  // certificate of outgoing calls. A server serves TLS iff this is set.
  std::string cert_file;
  // PEM private key of cert_file; required with it.
  std::string key_file;
  // PEM CA certificates that verify the other side: servers' certificates (outgoing calls; the
  // system's roots when empty) and, with require_client_cert, clients' certificates.
  std::string ca_file;
  // Server side: mutual TLS, i.e. refuse clients without a certificate signed by ca_file.
  bool require_client_cert = false;
  // Client side: the name to verify servers' certificates against instead of the host in the
  // address (e.g. one certificate for every daemon, which are dialled by pod IP).
  std::string server_name;

  // Whether a server with these options serves TLS.
  bool ServerEnabled() const { return !cert_file.empty(); }
  // Whether a client with these options connects with TLS.
  bool ClientEnabled() const { return !cert_file.empty() || !ca_file.empty() || !server_name.empty(); }
};

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_TLS_H_

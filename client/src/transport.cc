// Transport names and the choice of a transport per daemon.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/src/transport.h"

namespace mainstay::client_internal {
namespace {
constexpr v1::Transport kTransports[] = {v1::TRANSPORT_GRPC, v1::TRANSPORT_UCX, v1::TRANSPORT_NCCL,
                                         v1::TRANSPORT_CUDA_IPC};
}  // namespace

std::string TransportName(v1::Transport t) {
  switch (t) {
    case v1::TRANSPORT_GRPC:
      return "grpc";
    case v1::TRANSPORT_UCX:
      return "ucx";
    case v1::TRANSPORT_NCCL:
      return "nccl";
    case v1::TRANSPORT_CUDA_IPC:
      return "cuda_ipc";
    default:
      return "unspecified";
  }
}

absl::StatusOr<v1::Transport> ParseTransport(absl::string_view name) {
  for (v1::Transport t : kTransports) {
    if (name == TransportName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("transport: '", name, "' is not one of auto, grpc, ucx, nccl, cuda_ipc"));
}

absl::StatusOr<v1::Transport> ChooseTransport(absl::string_view requested, const std::vector<v1::Transport>& available,
                                              const v1::DaemonEndpoint& daemon) {
  auto offered = [&](v1::Transport t) {
    return t == v1::TRANSPORT_GRPC ||
           std::find(daemon.transports().begin(), daemon.transports().end(), t) != daemon.transports().end();
  };
  auto here = [&](v1::Transport t) { return std::find(available.begin(), available.end(), t) != available.end(); };
  auto names = [&](auto pred) {
    std::vector<std::string> out;
    for (v1::Transport t : kTransports) {
      if (pred(t)) out.push_back(TransportName(t));
    }
    return absl::StrJoin(out, ",");
  };
  if (requested.empty() || requested == "auto") {
    if (offered(v1::TRANSPORT_UCX) && here(v1::TRANSPORT_UCX) && !daemon.ucx_worker_address().empty()) {
      return v1::TRANSPORT_UCX;
    }
    return v1::TRANSPORT_GRPC;
  }
  absl::StatusOr<v1::Transport> want = ParseTransport(requested);
  if (!want.ok()) return want.status();
  if (!here(*want)) {
    return absl::FailedPreconditionError(absl::StrCat("transport ", requested, " is not available in this client (it has ",
                                                      names(here), ")"));
  }
  if (!offered(*want)) {
    return absl::FailedPreconditionError(absl::StrCat("transport ", requested, " is not offered by daemon ",
                                                      daemon.daemon_id(), " at ", daemon.address(), " (it offers ",
                                                      names(offered), "; see mainstayd --transports)"));
  }
  return *want;
}

}  // namespace mainstay::client_internal

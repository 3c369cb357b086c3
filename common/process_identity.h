// This process as its peers on the node identify it: the host's boot id, the pid namespace and
// the pid (read once, from /proc), and the host name. The data-plane transports use it to tell a
// peer on the same node (ucx's dedicated workers and process watch, cuda_ipc's node check) and
// to notice a peer process that exited.
//
// Thread safety: everything here may be called from any thread.
#ifndef MAINSTAY_COMMON_PROCESS_IDENTITY_H_
#define MAINSTAY_COMMON_PROCESS_IDENTITY_H_

#include <cstdint>
#include <string>

namespace mainstay {

struct ProcessIdentity {
  std::string boot_id;        // /proc/sys/kernel/random/boot_id; empty if unreadable
  std::string pid_namespace;  // readlink /proc/self/ns/pid; empty if unreadable
  int64_t pid = 0;
  static const ProcessIdentity& Self();
  // Whether this process can watch `other`'s pid: same host (boot id) and pid namespace.
  bool SameProcessSpace(const ProcessIdentity& other) const {
    return !boot_id.empty() && boot_id == other.boot_id && !pid_namespace.empty() &&
           pid_namespace == other.pid_namespace && other.pid > 0;
  }
};

// Whether process `pid` of this pid namespace is gone (kill(pid, 0) says ESRCH).
bool ProcessGone(int64_t pid);

// gethostname(), or "unknown".
std::string HostName();

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_PROCESS_IDENTITY_H_

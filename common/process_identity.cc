#include "common/process_identity.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

namespace mainstay {

const ProcessIdentity& ProcessIdentity::Self() {
  static const ProcessIdentity* self = [] {
    auto* id = new ProcessIdentity();
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::getline(boot, id->boot_id);
    char link[256] = {0};
    const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
    if (n > 0) id->pid_namespace.assign(link, static_cast<size_t>(n));
    id->pid = static_cast<int64_t>(getpid());
    return id;
  }();
  return *self;
}

bool ProcessGone(int64_t pid) { return kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

std::string HostName() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

}  // namespace mainstay

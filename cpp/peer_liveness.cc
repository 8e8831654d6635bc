#include "cpp/peer_liveness.h"

#include <limits.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace freescale {

bool process_alive(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  std::ifstream in(path);
  if (!in) return false;
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Format: "pid (comm) S ...": the state letter follows the last ')'.
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  char state = stat[close + 2];
  return state != 'Z' && state != 'X' && state != 'x';
}

std::string host_identity() {
  std::ostringstream id;
  char host[HOST_NAME_MAX + 1] = {0};
  gethostname(host, HOST_NAME_MAX);
  id << host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) id << "|" << boot_id;
  char ns[PATH_MAX] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  if (n > 0) id << "|" << std::string(ns, static_cast<size_t>(n));
  return id.str();
}

}  // namespace freescale

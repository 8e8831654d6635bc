#include "cpp/peer_liveness.h"

#include <limits.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace freescale {

namespace {

// The fields of /proc/<pid>/stat after "pid (comm)": [0] is the state letter (field 3). Empty if
// the process is gone.
std::vector<std::string> stat_fields(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  std::ifstream in(path);
  if (!in) return {};
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = stat.rfind(')');  // comm may hold spaces and parentheses: the fields follow the last ')'
  if (close == std::string::npos) return {};
  std::istringstream rest(stat.substr(close + 1));
  std::vector<std::string> fields;
  for (std::string f; rest >> f;) fields.push_back(f);
  return fields;
}

constexpr size_t kStartTimeField = 22 - 3;  // field 22 (starttime), counted from field 3

}  // namespace

std::string ProcessId::encode() const { return std::to_string(pid) + ":" + std::to_string(start_ticks); }

ProcessId ProcessId::decode(const std::string& text) {
  auto colon = text.find(':');
  ProcessId id;
  id.pid = std::stoi(text.substr(0, colon));
  if (colon != std::string::npos) id.start_ticks = std::stoull(text.substr(colon + 1));
  return id;
}

ProcessId this_process() {
  ProcessId id;
  id.pid = static_cast<int>(getpid());
  auto fields = stat_fields(id.pid);
  if (fields.size() > kStartTimeField) id.start_ticks = std::stoull(fields[kStartTimeField]);
  return id;
}

bool process_alive(const ProcessId& process) {
  auto fields = stat_fields(process.pid);
  if (fields.empty() || fields[0].empty()) return false;
  char state = fields[0][0];
  if (state == 'Z' || state == 'X' || state == 'x') return false;
  if (process.start_ticks != 0 && fields.size() > kStartTimeField &&
      std::to_string(process.start_ticks) != fields[kStartTimeField]) {
    return false;  // the pid was reused: the process we knew is gone
  }
  return true;
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

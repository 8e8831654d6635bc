#include "cpp/peer_liveness.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace freescale {

namespace {

// The whole of a small /proc file, or nullopt if it cannot be read. Plain read(2): a process that
// is reaped between open and read fails the read with ESRCH, which std::filebuf would throw.
std::optional<std::string> read_proc_file(const char* path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[1024];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return text;
}

// The fields of /proc/<pid>/stat after "pid (comm)": [0] is the state letter (field 3). Empty if
// the process is gone.
std::vector<std::string> stat_fields(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  auto stat = read_proc_file(path);
  if (!stat) return {};
  auto close_paren = stat->rfind(')');  // comm may hold spaces and ')': the fields follow the last ')'
  if (close_paren == std::string::npos) return {};
  std::istringstream rest(stat->substr(close_paren + 1));
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

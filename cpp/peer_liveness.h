// Is a process on this host still alive? And is a peer on this host at all?
#pragma once

#include <cstdint>
#include <string>

namespace freescale {

// A process on this host, told apart from a later one that gets its pid: pid and start time.
struct ProcessId {
  int pid = -1;
  uint64_t start_ticks = 0;  // start time after boot in clock ticks (/proc/<pid>/stat field 22); 0: unknown

  std::string encode() const;  // "pid:start_ticks"
  // Throws std::invalid_argument / std::out_of_range on a malformed string.
  static ProcessId decode(const std::string& text);
};

ProcessId this_process();
// False when the process no longer exists, is a zombie (killed, not yet reaped), or its pid now
// belongs to a process that started later (pid reuse).
bool process_alive(const ProcessId& process);
// Identifies the host and PID namespace: equal strings mean shared memory and pids are shared.
std::string host_identity();

}  // namespace freescale

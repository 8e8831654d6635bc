// Is a process on this host still alive? And is a peer on this host at all?
#pragma once

#include <string>

namespace freescale {

// False when `pid` no longer exists or is a zombie (killed, not yet reaped).
bool process_alive(int pid);
// Identifies the host and PID namespace: equal strings mean shared memory and pids are shared.
std::string host_identity();

}  // namespace freescale

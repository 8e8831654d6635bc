// Passing file descriptors between the ranks of one host: what shares memory whose pages must
// outlive their owner (a memfd, or a CUDA allocation exported as a POSIX file descriptor, which
// keeps its physical memory alive while any process holds it). Over abstract Unix sockets
// (SCM_RIGHTS), so it works between sibling processes whatever ptrace allows (pidfd_getfd and
// /proc/<pid>/fd do not under Yama's default scope), and leaves nothing in the file system.
#pragma once

#include <chrono>
#include <vector>

#include "cpp/bootstrap.h"

namespace freescale {

// A file descriptor closed when this goes out of scope (-1: none).
struct OwnedFd {
  int fd = -1;
  explicit OwnedFd(int f = -1) : fd(f) {}
  ~OwnedFd();
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
};

// Collective over `bootstrap` (every rank of one host): rank r offers `fd` (-1: none). Returns,
// for each rank p, a descriptor of this process for what p offered (a dup of ours for this rank;
// -1 where p offered none); the caller closes them. Throws Error(kSystem) naming the rank and
// the call if a transfer fails or does not finish within `limit`; then every rank throws (the
// outcome is agreed on before returning), and no descriptor is left open.
std::vector<int> exchange_fds(Bootstrap& bootstrap, int fd,
                              std::chrono::milliseconds limit = std::chrono::milliseconds(30000));

}  // namespace freescale

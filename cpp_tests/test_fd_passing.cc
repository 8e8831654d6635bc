// exchange_fds: ranks of one host pass file descriptors over abstract Unix sockets. Forked ranks
// offer memfds; each reads every peer's through the descriptor it received.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "cpp/errors.h"
#include "cpp/fd_passing.h"
#include "cpp_tests/fork_ranks.h"

namespace freescale {
namespace {

// A memfd holding "rank <r>".
int memfd_saying(int rank) {
  int fd = memfd_create("fd-passing-test", MFD_CLOEXEC);
  const std::string text = "rank " + std::to_string(rank);
  if (fd < 0 || write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) return -1;
  return fd;
}

std::string read_all(int fd) {
  char buf[64] = {};
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  return n < 0 ? "" : std::string(buf, static_cast<size_t>(n));
}

TEST(FdPassing, EveryRankGetsEveryOfferedDescriptorAndNoneForRanksThatOfferNone) {
  auto outcomes = testing::run_forked_ranks(4, [](int rank, Bootstrap& bootstrap) -> std::string {
    const int mine = rank == 2 ? -1 : memfd_saying(rank);  // rank 2 offers nothing
    std::vector<int> got = exchange_fds(bootstrap, mine);
    std::string e;
    for (int p = 0; p < 4; ++p) {
      if (p == 2) {
        if (got[p] != -1) e = "a descriptor for rank 2, which offered none";
        continue;
      }
      if (got[p] < 0) {
        e = "no descriptor for rank " + std::to_string(p);
      } else if (read_all(got[p]) != "rank " + std::to_string(p)) {
        e = "rank " + std::to_string(p) + "'s descriptor reads '" + read_all(got[p]) + "'";
      }
    }
    for (int f : got)
      if (f >= 0) close(f);
    if (mine >= 0) close(mine);
    return e;
  });
  for (const auto& o : outcomes) EXPECT_EQ(o.exit_code, 0) << o.message;
}

// A peer's memfd stays readable after the peer closed every descriptor of it: what the ce arena
// relies on (its pages live while any process holds them).
TEST(FdPassing, AReceivedDescriptorOutlivesItsSender) {
  auto outcomes = testing::run_forked_ranks(2, [](int rank, Bootstrap& bootstrap) -> std::string {
    const int mine = memfd_saying(rank);
    std::vector<int> got = exchange_fds(bootstrap, mine);
    close(mine);
    if (rank == 1) {
      for (int f : got) close(f);  // rank 1 holds nothing of its memfd any more
      bootstrap.allgather("");
      return "";
    }
    bootstrap.allgather("");  // rank 1 closed every descriptor of its memfd
    void* view = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, got[1], 0);
    std::string e = view == MAP_FAILED ? "mmap failed" : std::string(static_cast<const char*>(view), 6) == "rank 1" ? "" : "wrong bytes";
    if (view != MAP_FAILED) munmap(view, 4096);
    for (int f : got) close(f);
    return e;
  });
  for (const auto& o : outcomes) EXPECT_EQ(o.exit_code, 0) << o.message;
}

}  // namespace
}  // namespace freescale

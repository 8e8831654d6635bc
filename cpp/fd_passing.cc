#include "cpp/fd_passing.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "cpp/errors.h"

namespace freescale {
namespace {

using Clock = std::chrono::steady_clock;

// Closes a descriptor when it goes out of scope (-1: nothing).
struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() {
    int f = fd;
    fd = -1;
    return f;
  }
};

// An abstract socket address (leading NUL: no file) for `name`.
sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  addr.sun_path[0] = '\0';
  std::memcpy(addr.sun_path + 1, name.data(), std::min(name.size(), sizeof(addr.sun_path) - 2));
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + std::min(name.size(), sizeof(addr.sun_path) - 2));
  return addr;
}

// Waits until `fd` is ready for `events`, or `deadline`. False on timeout.
bool ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

void send_fd(int conn, int fd) {
  char byte = 1;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (::sendmsg(conn, &msg, MSG_NOSIGNAL) != 1) throw SystemError("sendmsg (passing a file descriptor)", errno);
}

int receive_fd(int conn) {
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  if (::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC) != 1) throw SystemError("recvmsg (receiving a file descriptor)", errno);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
    throw Error(ErrorCode::kSystem, "recvmsg: the peer sent no file descriptor");
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

}  // namespace

std::vector<int> exchange_fds(Bootstrap& bootstrap, int fd, std::chrono::milliseconds limit) {
  const int rank = bootstrap.rank(), world = bootstrap.size();
  const auto deadline = Clock::now() + limit;
  std::string error, name;
  Fd listener;
  if (fd >= 0) {
    try {
      std::random_device rd;
      name = "freescale-fds-" + std::to_string(::getpid()) + "-" + std::to_string(rd()) + std::to_string(rd());
      listener.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (listener.fd < 0) throw SystemError("socket(AF_UNIX)", errno);
      socklen_t len = 0;
      sockaddr_un addr = abstract_address(name, &len);
      if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) throw SystemError("bind (abstract socket)", errno);
      if (::listen(listener.fd, world) != 0) throw SystemError("listen", errno);
    } catch (const std::exception& e) {
      error = e.what();
      name.clear();
    }
  }
  std::vector<std::string> names = bootstrap.allgather(error.empty() ? "+" + name : "!" + error);
  for (int p = 0; p < world; ++p) {
    if (!names[p].empty() && names[p][0] == '!') {
      throw Error(ErrorCode::kSystem, "passing file descriptors: rank " + std::to_string(p) + " could not listen: " + names[p].substr(1));
    }
    names[p] = names[p].substr(1);
  }
  // Serve every other rank once (they all connect), while this thread takes what peers offer.
  std::string serve_error;
  std::thread server;
  if (!name.empty()) {
    server = std::thread([&] {
      try {
        for (int served = 0; served < world - 1; ++served) {
          if (!ready(listener.fd, POLLIN, deadline)) throw Error(ErrorCode::kSystem, "a peer did not connect in time");
          Fd conn(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
          if (conn.fd < 0) throw SystemError("accept", errno);
          send_fd(conn.fd, fd);
        }
      } catch (const std::exception& e) {
        serve_error = e.what();
      }
    });
  }
  std::vector<int> out(static_cast<size_t>(world), -1);
  std::string take_error;
  for (int p = 0; p < world; ++p) {  // every peer, even after a failure: its server counts on us
    if (names[p].empty()) continue;
    try {
      if (p == rank) {
        out[p] = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (out[p] < 0) throw SystemError("dup", errno);
        continue;
      }
      Fd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (conn.fd < 0) throw SystemError("socket(AF_UNIX)", errno);
      socklen_t len = 0;
      sockaddr_un addr = abstract_address(names[p], &len);
      if (::connect(conn.fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
        throw SystemError("connect to rank " + std::to_string(p) + "'s socket (ranks on different hosts or network namespaces?)", errno);
      }
      if (!ready(conn.fd, POLLIN, deadline)) throw Error(ErrorCode::kSystem, "rank " + std::to_string(p) + " sent nothing in time");
      out[p] = receive_fd(conn.fd);
    } catch (const std::exception& e) {
      if (take_error.empty()) take_error = "from rank " + std::to_string(p) + ": " + e.what();
    }
  }
  if (server.joinable()) server.join();
  const std::string mine = !take_error.empty() ? take_error : serve_error.empty() ? "" : "serving: " + serve_error;
  std::vector<std::string> outcomes = bootstrap.allgather(mine);
  for (int p = 0; p < world; ++p) {
    if (outcomes[p].empty()) continue;
    for (int& f : out) {
      if (f >= 0) ::close(f);
      f = -1;
    }
    throw Error(ErrorCode::kSystem, "passing file descriptors failed on rank " + std::to_string(p) + ": " + outcomes[p]);
  }
  return out;
}

}  // namespace freescale

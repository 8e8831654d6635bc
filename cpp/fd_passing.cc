#include "cpp/fd_passing.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
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

// A one-byte message with room for one descriptor (SCM_RIGHTS), as send_fd and receive_fd use it.
struct FdMessage {
  char byte = 1;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;  // msg points into it
  FdMessage& operator=(const FdMessage&) = delete;
};

void send_fd(int conn, int fd) {
  FdMessage m;
  msghdr& msg = m.msg;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (::sendmsg(conn, &msg, MSG_NOSIGNAL) != 1) throw SystemError("sendmsg (passing a file descriptor)", errno);
}

// The process at the other end of `conn` (SO_PEERCRED): same user, and one of `pids`.
bool from_a_peer(int conn, const std::vector<pid_t>& pids) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  return cred.uid == ::getuid() && std::find(pids.begin(), pids.end(), cred.pid) != pids.end();
}

int receive_fd(int conn) {
  FdMessage m;
  msghdr& msg = m.msg;
  const ssize_t n = ::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
  if (n < 0) throw SystemError("recvmsg (receiving a file descriptor)", errno);
  if (n == 0) throw Error(ErrorCode::kSystem, "the peer closed the connection without sending its descriptor");
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if ((msg.msg_flags & MSG_CTRUNC) != 0 || c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
      c->cmsg_len != CMSG_LEN(sizeof(int))) {
    throw Error(ErrorCode::kSystem, "recvmsg: the peer sent no file descriptor");
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

}  // namespace

OwnedFd::~OwnedFd() {
  if (fd >= 0) ::close(fd);
}

std::vector<int> exchange_fds(Bootstrap& bootstrap, int fd, std::chrono::milliseconds limit) {
  const int rank = bootstrap.rank(), world = bootstrap.size();
  const auto deadline = Clock::now() + limit;
  std::string error, name;
  OwnedFd listener;
  if (fd >= 0) {
    try {
      std::random_device rd;
      name = std::to_string(::getpid()) + "-freescale-fds-" + std::to_string(rd()) + std::to_string(rd());
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
  // Each rank's pid and socket name ("" where it offers nothing): "+pid name" or "!error".
  std::vector<std::string> names =
      bootstrap.allgather(error.empty() ? "+" + std::to_string(::getpid()) + " " + name : "!" + error);
  std::vector<pid_t> peers;  // who may take our descriptor
  for (int p = 0; p < world; ++p) {
    if (!names[p].empty() && names[p][0] == '!') {
      throw Error(ErrorCode::kSystem, "passing file descriptors: rank " + std::to_string(p) + " could not listen: " + names[p].substr(1));
    }
    const size_t space = names[p].find(' ');
    if (p != rank) peers.push_back(static_cast<pid_t>(std::atol(names[p].c_str() + 1)));
    names[p] = space == std::string::npos ? "" : names[p].substr(space + 1);
  }
  // Serve every other rank once (they all connect), while this thread takes what peers offer.
  std::string serve_error;
  std::thread server;
  if (!name.empty()) {
    server = std::thread([&] {
      try {
        for (int served = 0; served < world - 1;) {
          if (!ready(listener.fd, POLLIN, deadline)) throw Error(ErrorCode::kSystem, "a peer did not connect in time");
          OwnedFd conn(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
          if (conn.fd < 0) throw SystemError("accept", errno);
          // Abstract sockets have no permissions: only our peers get device memory.
          if (!from_a_peer(conn.fd, peers)) continue;
          send_fd(conn.fd, fd);
          ++served;
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
      OwnedFd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (conn.fd < 0) throw SystemError("socket(AF_UNIX)", errno);
      socklen_t len = 0;
      sockaddr_un addr = abstract_address(names[p], &len);
      // Non-blocking: a full backlog (EAGAIN) is retried until the deadline, never waited on unbounded.
      while (::connect(conn.fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
        if (errno != EAGAIN || Clock::now() >= deadline) {
          throw SystemError("connect to rank " + std::to_string(p) + "'s socket (ranks on different hosts or network namespaces?)", errno);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (!ready(conn.fd, POLLIN, deadline)) throw Error(ErrorCode::kSystem, "rank " + std::to_string(p) + " sent nothing in time");
      out[p] = receive_fd(conn.fd);
    } catch (const std::exception& e) {
      if (take_error.empty()) take_error = "from rank " + std::to_string(p) + ": " + e.what();
    }
  }
  if (server.joinable()) server.join();
  auto close_all = [&out] {
    for (int& f : out) {
      if (f >= 0) ::close(f);
      f = -1;
    }
  };
  const std::string mine = !take_error.empty() ? take_error : serve_error.empty() ? "" : "serving: " + serve_error;
  std::vector<std::string> outcomes;
  try {
    outcomes = bootstrap.allgather(mine);
  } catch (...) {
    close_all();
    throw;
  }
  for (int p = 0; p < world; ++p) {
    if (outcomes[p].empty()) continue;
    close_all();
    throw Error(ErrorCode::kSystem, "passing file descriptors failed on rank " + std::to_string(p) + ": " + outcomes[p]);
  }
  return out;
}

}  // namespace freescale

#include "cpp_tests/fork_ranks.h"

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <thread>

#include "cpp/errors.h"
#include "cpp/peer_liveness.h"

namespace freescale::testing {
namespace {

void write_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CommError(ErrorCode::kPeerDied, "pipe bootstrap: write failed (peer gone?)");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void read_all(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = ::read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CommError(ErrorCode::kPeerDied, "pipe bootstrap: peer closed its pipe");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

int g_result_fd = -1;  // in a rank child: where its result goes

}  // namespace

void exit_rank_now(const std::string& message) {
  try { write_all(g_result_fd, message.data(), message.size()); } catch (...) {}
  _exit(message.empty() ? 0 : 1);
}

PipeBootstrap::PipeBootstrap(int rank, int size, std::vector<int> write_fds, std::vector<int> read_fds)
    : rank_(rank), size_(size), write_fds_(std::move(write_fds)), read_fds_(std::move(read_fds)) {}

std::vector<std::string> PipeBootstrap::allgather(const std::string& mine) {
  uint64_t len = mine.size();
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    write_all(write_fds_[p], &len, sizeof(len));
    write_all(write_fds_[p], mine.data(), mine.size());
  }
  std::vector<std::string> all(size_);
  all[rank_] = mine;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    uint64_t n = 0;
    read_all(read_fds_[p], &n, sizeof(n));
    all[p].resize(n);
    read_all(read_fds_[p], all[p].data(), n);
  }
  return all;
}

std::vector<RankOutcome> run_forked_ranks(int world, const RankFn& fn, std::chrono::seconds timeout) {
  // pipes[i][j] = {read, write} carrying i -> j.
  std::vector<std::vector<std::array<int, 2>>> pipes(world, std::vector<std::array<int, 2>>(world, {-1, -1}));
  for (int i = 0; i < world; ++i)
    for (int j = 0; j < world; ++j)
      if (i != j && pipe(pipes[i][j].data()) != 0) throw SystemError("pipe", errno);
  std::vector<std::array<int, 2>> results(world);
  for (auto& r : results)
    if (pipe(r.data()) != 0) throw SystemError("pipe", errno);

  std::vector<pid_t> pids(world);
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid < 0) throw SystemError("fork", errno);
    if (pid == 0) {
      std::vector<int> wfd(world, -1), rfd(world, -1);
      for (int i = 0; i < world; ++i) {
        for (int j = 0; j < world; ++j) {
          if (i == j) continue;
          if (i == rank) { wfd[j] = pipes[i][j][1]; close(pipes[i][j][0]); }
          else if (j == rank) { rfd[i] = pipes[i][j][0]; close(pipes[i][j][1]); }
          else { close(pipes[i][j][0]); close(pipes[i][j][1]); }
        }
      }
      for (int r = 0; r < world; ++r) {
        close(results[r][0]);
        if (r != rank) close(results[r][1]);
      }
      g_result_fd = results[rank][1];
      std::string message;
      try {
        PipeBootstrap bootstrap(rank, world, wfd, rfd);
        message = fn(rank, bootstrap);
      } catch (const std::exception& e) {
        message = std::string("exception: ") + e.what();
      } catch (...) {
        message = "unknown exception";
      }
      try { write_all(results[rank][1], message.data(), message.size()); } catch (...) {}
      _exit(message.empty() ? 0 : 1);
    }
    pids[rank] = pid;
  }
  for (auto& row : pipes)
    for (auto& p : row)
      for (int fd : p)
        if (fd >= 0) close(fd);
  for (auto& r : results) close(r[1]);

  std::vector<RankOutcome> out(world);
  for (int r = 0; r < world; ++r) out[r].pid = pids[r];
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<bool> done(world, false);
  for (int remaining = world; remaining > 0;) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        if (WIFEXITED(status)) out[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) out[r].signal = WTERMSIG(status);
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r) {
        if (done[r]) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        out[r].timed_out = true;
        done[r] = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int r = 0; r < world; ++r) {
    char buf[4096];
    ssize_t n;
    while ((n = read(results[r][0], buf, sizeof(buf))) > 0) out[r].message.append(buf, static_cast<size_t>(n));
    close(results[r][0]);
  }
  return out;
}

bool wait_until_gone(int pid, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (process_alive(ProcessId{pid, 0})) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

std::vector<std::string> leftover_segments(const std::vector<RankOutcome>& ranks) {
  std::vector<std::string> names;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      for (const RankOutcome& r : ranks) {
        std::string prefix = "freescale-" + std::to_string(r.pid) + "-";
        if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) names.emplace_back(e->d_name);
      }
    }
    closedir(dir);
  }
  return names;
}

}  // namespace freescale::testing

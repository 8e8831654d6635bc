// GoogleTest helper: runs a function in N forked rank processes joined by a pipe bootstrap.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "cpp/bootstrap.h"

namespace freescale::testing {

// Bootstrap over a full mesh of pipes created before fork(): pipe (i -> j) carries i's blobs to j.
class PipeBootstrap : public Bootstrap {
 public:
  PipeBootstrap(int rank, int size, std::vector<int> write_fds, std::vector<int> read_fds);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::vector<std::string> allgather(const std::string& mine) override;

 private:
  int rank_;
  int size_;
  std::vector<int> write_fds_;  // [size] our end towards peer p (-1 for self)
  std::vector<int> read_fds_;   // [size] peer p's end towards us (-1 for self)
};

struct RankOutcome {
  int pid = -1;          // the child's pid
  int exit_code = -1;    // exit status when the child exited
  int signal = 0;        // terminating signal, 0 if it exited
  bool timed_out = false;
  std::string message;   // what the rank function returned (empty = success) or threw
};

// Runs fn(rank, bootstrap) in `world` children. fn returns "" on success or a failure message;
// an escaping exception becomes its message. Children still running after `timeout` are killed.
using RankFn = std::function<std::string(int rank, Bootstrap& bootstrap)>;
std::vector<RankOutcome> run_forked_ranks(int world, const RankFn& fn,
                                          std::chrono::seconds timeout = std::chrono::seconds(60));

// In a rank function: reports `message` as its result ("" = success) and leaves the process at
// once, as a training script that dies on an exception does (no destructors, no close()).
[[noreturn]] void exit_rank_now(const std::string& message);

// In a rank function: waits until process `pid` is gone or a zombie (process_alive), at most
// `limit`. True if it is.
bool wait_until_gone(int pid, std::chrono::milliseconds limit = std::chrono::milliseconds(10000));

// Names in /dev/shm of segments these ranks created ("freescale-<pid>-..."): other tests may
// run beside this one.
std::vector<std::string> leftover_segments(const std::vector<RankOutcome>& ranks);

}  // namespace freescale::testing

// A communicator = bootstrap + scheduler + transport + one progress thread. Ops are matched
// across ranks by sequence number (program order); priorities only reorder execution.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/layout.h"
#include "cpp/op_state.h"
#include "cpp/scheduler.h"
#include "cpp/transport.h"

namespace freescale {

class Communicator {
 public:
  // Collective over `bootstrap` (used during construction only). config.timeout_ms == 0 means
  // the default of 30 minutes (torch's default group timeout).
  Communicator(Bootstrap& bootstrap, Config config);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return world_; }
  const Config& config() const { return config_; }
  const char* transport_name() const { return transport_->name(); }

  // AllToAllv of raw bytes. send/recv: base pointers the layout's offsets are relative to; they
  // must stay valid until the op completes. Validates the layout (InvalidArgument) and throws
  // CommError if the communicator is broken, before queuing anything. Never blocks on peers.
  std::shared_ptr<OpState> all_to_all(const uint8_t* send, uint8_t* recv, AllToAllLayout layout, int priority);

  // Stops the progress thread; pending ops fail with CommError; peers learn this rank left.
  // Idempotent. Call without holding locks the progress thread's callbacks need (the GIL).
  void close();
  bool closed() const;

 private:
  void progress_loop();
  void admit();
  bool send_round();
  void check_health(Clock::time_point now);
  void fail_all(ErrorCode code, const std::string& message);

  int rank_;
  int world_;
  Config config_;
  std::unique_ptr<Transport> transport_;
  Scheduler scheduler_;

  mutable std::mutex mu_;  // guards the fields below
  std::deque<std::shared_ptr<OpState>> submissions_;
  uint64_t next_seq_ = 0;
  bool closed_ = false;
  bool broken_ = false;
  ErrorCode broken_code_ = ErrorCode::kCommError;
  std::string broken_message_;

  // Progress thread only:
  std::deque<std::shared_ptr<OpState>> waiting_;  // submitted, not posted yet (window full)
  std::vector<std::shared_ptr<OpState>> active_;  // posted, not complete
  std::thread thread_;
};

}  // namespace freescale

// Priority queue of pending transfers: highest effective priority first, FIFO among equals,
// chunked so that a higher-priority transfer submitted later starts within one chunk. Waiting
// raises a transfer's effective priority by one level per aging quantum, so nothing starves.
// Knows nothing of transports or CUDA; not thread-safe (owned by the progress thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "cpp/layout.h"
#include "cpp/transfer.h"

namespace freescale {

class Scheduler {
 public:
  Scheduler(uint64_t chunk_bytes, std::chrono::microseconds aging_quantum);

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  void submit(Transfer t);
  size_t pending() const { return pending_.size(); }

  // priority + one level per aging quantum waited (saturating).
  int64_t effective_priority(const Transfer& t, Clock::time_point now) const;

  // The ready transfer (ready(t) true) with the highest effective priority at `now`, FIFO among
  // equals; nullptr when none is ready. The pointer stays valid until that transfer finishes.
  Transfer* pick(Clock::time_point now, const std::function<bool(const Transfer&)>& ready);
  // The next chunk of `t` (picked just before).
  Chunk next_chunk(const Transfer& t) const;
  // Records that `c` of `t` was handed over. Returns true (and forgets `t`) when it was the last.
  bool chunk_sent(Transfer* t, const Chunk& c);
  // Removes every pending transfer (after a failure).
  std::vector<Transfer> drain();

 private:
  uint64_t chunk_bytes_;
  std::chrono::microseconds aging_quantum_;
  uint64_t next_order_ = 0;
  std::vector<std::unique_ptr<Transfer>> pending_;
};

}  // namespace freescale

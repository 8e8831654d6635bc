// The shared state of one collective operation: completion, error and callbacks. Created by the
// submitting thread; its bookkeeping fields are touched only by the progress thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cpp/errors.h"
#include "cpp/layout.h"

namespace freescale {

using Clock = std::chrono::steady_clock;

// What the caller ran as this AllToAllv, carried in every chunk header so that ranks running
// different collectives at one sequence number learn it from the first header. Byte AllToAlls of
// any kind may meet (gloo completes an all_to_all against an all_to_all_single); a barrier meets
// only a barrier. Values cross processes: append, never renumber.
enum class OpKind : uint32_t { kAllToAllSingle = 1, kAllToAll = 2, kBarrier = 3, kDispatch = 4, kCombine = 5 };
// "all_to_all_single", ...; "op kind N" for a value no build of ours writes.
std::string op_kind_name(uint32_t kind);
// The kind named `name` (as op_kind_name spells it); InvalidArgument naming the known ones otherwise.
OpKind op_kind_from_name(const std::string& name);
// True if a rank running `a` and one running `b` at the same sequence number can complete it.
inline bool op_kinds_meet(uint32_t a, uint32_t b) {
  return (a == static_cast<uint32_t>(OpKind::kBarrier)) == (b == static_cast<uint32_t>(OpKind::kBarrier));
}

class OpState {
 public:
  // send/recv: base pointers the layout's offsets are relative to. Parts: one send and one
  // receive per rank (self included), plus one "every rank received its part" confirmation, so
  // the op completes after 2 * world + 1 part_done() calls.
  OpState(uint64_t seq, int priority, const uint8_t* send, uint8_t* recv, AllToAllLayout layout,
          Clock::time_point deadline, OpKind kind = OpKind::kAllToAllSingle);

  const uint64_t seq;               // per-communicator sequence number (program order)
  const int priority;               // larger = sooner
  const OpKind kind;                // what the caller ran (chunk headers carry it)
  const uint8_t* const send;        // send buffer base
  uint8_t* const recv;              // recv buffer base
  const AllToAllLayout layout;      // byte counts and offsets per peer
  const Clock::time_point submitted;
  const Clock::time_point deadline;  // past it, the op fails with kTimeout on every rank

  uintptr_t stream = 0;  // the submitter's CUDA stream (0: CPU tensors or the default stream)

  // --- progress-thread bookkeeping ---
  std::vector<uint64_t> recv_done;     // [world] bytes received from peer p
  std::vector<uint8_t> recv_finished;  // [world] 1 once every byte from p arrived (empty: header)
  std::vector<uint8_t> send_finished;  // [world] 1 once every byte for p was handed over
  int recv_parts_left;                 // receives not finished yet
  bool confirmed = false;              // every rank reported this op received

  int world() const { return static_cast<int>(layout.send_bytes.size()); }
  // True if this op still waits on data to or from `peer` (or on its confirmation).
  bool needs_peer(int peer) const { return !recv_finished[peer] || !send_finished[peer] || !confirmed; }

  // One part (a send or a receive with one peer) finished; the last one completes the op.
  void part_done();
  // Fails the op (first error wins); a completed op stays completed.
  // culprit: the rank at the root of the failure (-1 unknown), carried by the rethrown CommError.
  void fail(ErrorCode code, const std::string& message, int culprit = -1);

  bool is_completed() const { return state_.load(std::memory_order_acquire) != kPending; }
  bool failed() const { return state_.load(std::memory_order_acquire) == kFailed; }
  // Blocks until done (and its done-callbacks ran) or `timeout` passed (negative = no limit). False on timeout; throws the
  // op's CommError if it failed.
  bool wait(std::chrono::microseconds timeout);
  // Blocks until done (and its done-callbacks ran) or `timeout` passed (negative = no limit);
  // never throws. True if done.
  bool wait_done(std::chrono::microseconds timeout);
  // Throws the op's error if it failed; no-op otherwise.
  void rethrow_if_failed() const;
  // Runs `fn` once the op is done or failed: now (caller's thread) if it already is, else on
  // the thread that finishes it.
  void add_done_callback(std::function<void()> fn);

 private:
  enum : int { kPending = 0, kDone = 1, kFailed = 2 };
  void finish(int state);

  int parts_left_;
  std::atomic<int> state_{kPending};
  bool released_ = false;  // set after the callbacks ran: wait() returns only then
  mutable std::mutex mu_;
  std::condition_variable cv_;
  ErrorCode error_code_ = ErrorCode::kCommError;
  std::string error_message_;
  int error_culprit_ = -1;
  std::vector<std::function<void()>> callbacks_;
};

}  // namespace freescale

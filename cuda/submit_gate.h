// What the CUDA transports share about their callers' streams. Include from .cu sources only.
//
// An op records an event on its submitter's stream when it is submitted; the transport starts it
// (in program order) once that event completed, checked by the host: a comm stream never waits
// on a caller, so a caller whose stream waits for op N before submitting op N+1 cannot block op
// N's later copies behind that wait. Every op moves its completion flag (pinned, device-mapped:
// done[seq % kOpWindow] = seq + 1, ever increasing) when it completes or fails; stream_wait()
// makes a stream wait on it (cuStreamWaitValue64 GEQ) without blocking the CPU.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cpp/op_state.h"
#include "cuda/driver_api.h"

namespace freescale {

class SubmitGate {
 public:
  explicit SubmitGate(int device);
  // Frees the events and flags, best effort, unless leak() was called.
  ~SubmitGate();
  SubmitGate(const SubmitGate&) = delete;
  SubmitGate& operator=(const SubmitGate&) = delete;

  // Allocates the completion flags; `device` must be current. Throws Error(kSystem).
  void allocate();
  // Pending GPU work may still write the flags: keep them (and the events) for good.
  void leak() { leaked_ = true; }

  // Events of `device`, recycled (any thread): take one to record; event_done() gives it back.
  cudaEvent_t take_event();
  // True once `ev` completed (it is then recycled: do not use it again); throws Error(kSystem)
  // with `what` if the work before it failed.
  bool event_done(cudaEvent_t ev, const char* what);

  // Caller's thread, as the op gets its seq: records the event on op.stream.
  void on_submit(OpState& op);
  // Any thread: `stream` waits until `op` completed (or failed).
  void stream_wait(const OpState& op, uintptr_t stream);

  // Progress thread. post(): the op's flag follows its completion; it waits for its event.
  void post(const std::shared_ptr<OpState>& op);
  // Calls start(op) for each posted op whose event completed, in program order, stopping at the
  // first that has not. Returns true if any started.
  template <class Start>
  bool start_ready(Start&& start);
  bool started(const OpState& op) const { return op.seq < started_below_; }
  bool waiting() const { return !unready_.empty(); }

 private:
  void give_event(cudaEvent_t ev);
  // True once op's submission event completed (then recycled); throws if the stream failed.
  bool submitter_passed(const OpState& op);

  int device_;
  const DriverApi& driver_;
  bool leaked_ = false;
  uint64_t* done_ = nullptr;  // pinned, mapped: [kOpWindow]
  CUdeviceptr done_device_ = 0;
  std::mutex mu_;  // guards submitted_ and spare_
  std::unordered_map<const OpState*, cudaEvent_t> submitted_;
  std::vector<cudaEvent_t> spare_;
  std::deque<std::shared_ptr<OpState>> unready_;  // progress thread only
  uint64_t started_below_ = 0;                     // ops with seq < this were started
};

template <class Start>
bool SubmitGate::start_ready(Start&& start) {
  bool moved = false;
  while (!unready_.empty() && submitter_passed(*unready_.front())) {
    std::shared_ptr<OpState> op = unready_.front();
    unready_.pop_front();
    started_below_ = op->seq + 1;
    start(op);
    moved = true;
  }
  return moved;
}

}  // namespace freescale

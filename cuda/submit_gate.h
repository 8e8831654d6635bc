// What the CUDA transports share about their callers' streams (over the DeviceOps seam).
//
// An op records an event on its submitter's stream when it is submitted (mark(), before the
// communicator takes its lock: the record blocks while that stream's queue is full); the transport
// starts the op (in program order) once that event completed, checked by the host: a comm stream
// never waits on a caller, so a caller whose stream waits for op N before submitting op N+1
// cannot block op N's later copies behind that wait. From submission on, every op moves its
// completion flag (pinned, device-mapped: done[seq % kOpWindow] >= seq + 1, only increasing)
// when it completes or fails, admitted or not; stream_wait() makes a stream wait on it without
// blocking the CPU.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cpp/op_state.h"
#include "cuda/device_ops.h"

namespace freescale {

class SubmitGate {
 public:
  SubmitGate(DeviceOps& ops, int device);
  // Frees the events and flags, best effort, unless leak() was called.
  ~SubmitGate();
  SubmitGate(const SubmitGate&) = delete;
  SubmitGate& operator=(const SubmitGate&) = delete;

  // Allocates the completion flags; `device` must be current. Throws Error(kSystem).
  void allocate();
  // Pending GPU work may still read or write the flags: keep them (and the events) for good.
  void leak() { leaked_ = true; }

  // Events of `device`, recycled (any thread): take one to record; event_done() gives it back.
  Event take_event();
  void give_event(Event ev);
  // True once `ev` completed (it is then recycled: do not use it again); throws Error(kSystem)
  // with `what` if the work before it failed.
  bool event_done(Event ev, const char* what);

  // Caller's thread, before the op exists: records an event on `stream` (may block while the
  // stream's queue is full, so never under a lock others need). Returns it, for on_submit or,
  // if the op is refused, give_event.
  Event mark(Stream stream);
  // Caller's thread, as the op gets its seq (under the communicator's lock: quick, no device
  // call): ties `mark` to the op and its completion flag to its outcome.
  void on_submit(OpState& op, Event mark);
  // Any thread: `stream` waits until `op` completed (or failed).
  void stream_wait(const OpState& op, Stream stream);

  // Progress thread: the op waits for its submitter's event.
  void post(const std::shared_ptr<OpState>& op) { unready_.push_back(op); }
  // Calls start(op) for each posted op whose event completed, in program order, stopping at the
  // first that has not. Returns true if any started.
  template <class Start>
  bool start_ready(Start&& start);
  bool started(const OpState& op) const { return op.seq < started_below_; }
  bool waiting() const { return !unready_.empty(); }

 private:
  // True once op's submission event completed (then recycled); throws if the stream failed.
  bool submitter_passed(const OpState& op);

  DeviceOps& ops_;
  int device_;
  bool leaked_ = false;
  uint64_t* done_ = nullptr;  // pinned, mapped: [kOpWindow]
  DevicePtr done_device_ = 0;
  std::mutex mu_;  // guards submitted_ and spare_
  std::map<uint64_t, Event> submitted_;  // seq -> its submission event
  std::vector<Event> spare_;
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

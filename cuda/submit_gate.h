// What the CUDA transports share about their callers' streams (over the DeviceOps seam).
//
// An op records an event on its submitter's stream when it is submitted (mark(), before the
// communicator takes its lock: the record blocks while that stream's queue is full); the transport
// starts the op (in program order) once that event completed, checked by the host: a comm stream
// never waits on a caller, so a caller whose stream waits for op N before submitting op N+1
// cannot block op N's later copies behind that wait.
//
// A caller's stream waits for an op only on an event the transport recorded after the op's last
// device operation on this rank, once that operation is enqueued (all_enqueued()): a wait CUDA
// sees ordered after the work it depends on, which no shared hardware queue can deadlock
// (design.md §4). So stream_wait() blocks the host until then (or until the op completed or
// failed: its device work is then over, and no device wait is needed).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "cpp/op_state.h"
#include "cuda/device_ops.h"

namespace freescale {

class SubmitGate {
 public:
  SubmitGate(DeviceOps& ops, int device);
  // Frees the events, best effort, unless leak() was called.
  ~SubmitGate();
  SubmitGate(const SubmitGate&) = delete;
  SubmitGate& operator=(const SubmitGate&) = delete;

  // Pending GPU work may still use the events: keep them for good.
  void leak() { leaked_ = true; }

  // Events of `device`, recycled (any thread): take one to record; event_done() gives it back.
  Event take_event();
  void give_event(Event ev);
  // Creates `n` events for the pool now (setup: creation may block while a stream wait runs on
  // the device, so a progress thread that has enqueued waits must not create events), and keeps
  // them for try_take_event: take_event (callers' submissions) creates rather than go below `n`.
  void reserve(size_t n);
  // An event from the pool, or none (never creates one).
  std::optional<Event> try_take_event();
  // True once `ev` completed (it is then recycled: do not use it again); throws Error(kSystem)
  // with `what` if the work before it failed.
  bool event_done(Event ev, const char* what);

  // Caller's thread, before the op exists: records an event on `stream` (may block while the
  // stream's queue is full, so never under a lock others need). Returns it, for on_submit or,
  // if the op is refused, give_event.
  Event mark(Stream stream);
  // Caller's thread, as the op gets its seq (under the communicator's lock: quick, no device
  // call): ties `mark` to the op, and the op's completion to the callers blocked in stream_wait.
  void on_submit(OpState& op, Event mark);
  // Progress thread: every device operation of `op` on this rank is enqueued, and `ev` recorded
  // after the last of them (on the comm stream). The gate owns `ev` from now on.
  void all_enqueued(const OpState& op, Event ev);
  // Any thread but the progress thread: `stream` waits (on the device) for op's device work on
  // this rank. Blocks the host until all_enqueued(op) or until op completed or failed (then no
  // device wait: its work is over; the caller raises a failure); false if `timeout` (negative:
  // none) passed first.
  bool stream_wait(const OpState& op, Stream stream, std::chrono::microseconds timeout);

  // Progress thread: the op waits for its submitter's event.
  void post(const std::shared_ptr<OpState>& op) { unready_.push_back(op); }
  // Calls start(op) for each posted op whose event completed, in program order, stopping at the
  // first that has not. Returns true if any started.
  template <class Start>
  bool start_ready(Start&& start);
  bool started(const OpState& op) const { return op.seq < started_below_; }
  bool waiting() const { return !unready_.empty(); }

 private:
  // The event after an op's last device operation, while callers may still wait on it.
  struct Completion {
    Event event = 0;
    int users = 0;          // stream_wait calls between reading `event` and enqueuing their wait
    bool retired = false;   // the op completed: the last user gives `event` back
  };
  // True once op's submission event completed (then recycled); throws if the stream failed.
  bool submitter_passed(const OpState& op);
  void give_event_locked(Event ev);  // holder of mu_
  void op_done(uint64_t seq);

  DeviceOps& ops_;
  int device_;
  bool leaked_ = false;
  std::mutex mu_;  // guards submitted_, completions_ and spare_
  std::condition_variable enqueued_cv_;  // an op's last operation was enqueued, or an op completed
  std::map<uint64_t, Event> submitted_;  // seq -> its submission event
  std::map<uint64_t, Completion> completions_;  // seq -> after its last device operation
  std::vector<Event> spare_;
  size_t reserved_ = 0;  // spare_ events take_event leaves to try_take_event
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

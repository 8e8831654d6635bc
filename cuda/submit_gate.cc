#include "cuda/submit_gate.h"

#include <algorithm>
#include <atomic>

#include "cpp/host_layout.h"
#include "cuda/device_util.h"

namespace freescale {

SubmitGate::SubmitGate(DeviceOps& ops, int device) : ops_(ops), device_(device) {}

SubmitGate::~SubmitGate() {
  if (leaked_) return;
  ProgressScope guard(ops_, device_, std::nothrow);
  try {
    for (auto& [seq, ev] : submitted_) ops_.destroy_event(ev);
    for (auto& [seq, c] : completions_) ops_.destroy_event(c.event);
    for (Event ev : spare_) ops_.destroy_event(ev);
  } catch (...) {
    // Best effort: destructors never throw.
  }
}

Event SubmitGate::take_event() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (spare_.size() > reserved_) {
      Event ev = spare_.back();
      spare_.pop_back();
      return ev;
    }
  }
  return ops_.create_event();
}

void SubmitGate::reserve(size_t n) {
  std::vector<Event> made;
  try {
    for (size_t i = 0; i < n; ++i) made.push_back(ops_.create_event());
  } catch (...) {  // none reserved: the ones made so far go back
    for (Event ev : made) {
      try {
        ops_.destroy_event(ev);
      } catch (...) {
      }
    }
    throw;
  }
  std::lock_guard<std::mutex> lock(mu_);
  spare_.insert(spare_.end(), made.begin(), made.end());
  reserved_ += n;
}

std::optional<Event> SubmitGate::try_take_event() {
  std::lock_guard<std::mutex> lock(mu_);
  if (spare_.empty()) return std::nullopt;
  Event ev = spare_.back();
  spare_.pop_back();
  return ev;
}

void SubmitGate::give_event(Event ev) {
  std::lock_guard<std::mutex> lock(mu_);
  give_event_locked(ev);
}

void SubmitGate::give_event_locked(Event ev) {
  // An event given back twice would be handed to two users at once: one's record would complete
  // the other's wait early (an op finished before its copies landed). Never silently.
  if (std::find(spare_.begin(), spare_.end(), ev) != spare_.end())
    throw Error(ErrorCode::kInternal, "a CUDA event was given back to the pool twice");
  spare_.push_back(ev);
}

bool SubmitGate::event_done(Event ev, const char* what) {
  if (!ops_.event_done(ev, what)) return false;
  give_event(ev);
  return true;
}

Event SubmitGate::mark(Stream stream) {
  ProgressScope guard(ops_, device_);
  Event ev = take_event();
  try {
    ops_.record_event(ev, stream);
  } catch (...) {
    give_event(ev);
    throw;
  }
  return ev;
}

void SubmitGate::on_submit(OpState& op, Event mark) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    submitted_[op.seq] = mark;
  }
  // Completed or failed, admitted or not: callers blocked in stream_wait go on.
  op.add_done_callback([this, seq = op.seq] { op_done(seq); });
}

void SubmitGate::op_done(uint64_t seq) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = completions_.find(seq);
    if (it != completions_.end()) {
      if (it->second.users == 0) {
        give_event_locked(it->second.event);
        completions_.erase(it);
      } else {
        it->second.retired = true;
      }
    }
  }
  enqueued_cv_.notify_all();
}

void SubmitGate::all_enqueued(const OpState& op, Event ev) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (op.is_completed()) {
      give_event_locked(ev);  // its done-callback ran already: nobody will wait on it
    } else {
      completions_[op.seq] = Completion{ev, 0, false};
    }
  }
  enqueued_cv_.notify_all();
}

bool SubmitGate::stream_wait(const OpState& op, Stream stream, std::chrono::microseconds timeout) {
  Event ev = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return op.is_completed() || completions_.count(op.seq) > 0; };
    if (timeout.count() < 0) {
      enqueued_cv_.wait(lock, ready);
    } else if (!enqueued_cv_.wait_for(lock, timeout, ready)) {
      return false;
    }
    auto it = completions_.find(op.seq);
    if (it == completions_.end() || it->second.retired) return true;  // completed: its device work is over
    ++it->second.users;
    ev = it->second.event;
  }
  auto release = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = completions_.find(op.seq);
    if (--it->second.users == 0 && it->second.retired) {
      give_event_locked(it->second.event);
      completions_.erase(it);
    }
  };
  try {
    ProgressScope guard(ops_, device_);
    ops_.wait_event(stream, ev);  // captures the record made before: the event may be reused after
  } catch (...) {
    release();
    throw;
  }
  release();
  return true;
}

bool SubmitGate::submitter_passed(const OpState& op) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = submitted_.find(op.seq);
  if (it == submitted_.end()) return true;  // nothing recorded: nothing to wait for
  if (!ops_.event_done(it->second, "the submitter's stream failed before an all_to_all")) return false;
  spare_.push_back(it->second);
  submitted_.erase(it);
  return true;
}

}  // namespace freescale

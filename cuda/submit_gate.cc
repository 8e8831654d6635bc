#include "cuda/submit_gate.h"

#include <algorithm>
#include <atomic>

#include "cpp/host_layout.h"
#include "cuda/device_util.h"

namespace freescale {

SubmitGate::SubmitGate(DeviceOps& ops, int device) : ops_(ops), device_(device) {}

SubmitGate::~SubmitGate() {
  if (leaked_) return;
  DeviceGuard guard(ops_, device_, std::nothrow);
  try {
    for (auto& [seq, ev] : submitted_) ops_.destroy_event(ev);
    for (Event ev : spare_) ops_.destroy_event(ev);
    if (done_ != nullptr) ops_.host_free(done_);
  } catch (...) {
    // Best effort: destructors never throw.
  }
}

void SubmitGate::allocate() {
  done_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(sizeof(uint64_t) * kOpWindow, &done_device_));
  std::fill(done_, done_ + kOpWindow, 0);
}

Event SubmitGate::take_event() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spare_.empty()) {
      Event ev = spare_.back();
      spare_.pop_back();
      return ev;
    }
  }
  return ops_.create_event();
}

void SubmitGate::give_event(Event ev) {
  std::lock_guard<std::mutex> lock(mu_);
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
  DeviceGuard guard(ops_, device_);
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
  // Completed or failed, admitted or not, the flag moves: a stream waiting on a failed op must
  // not hang (the failure itself surfaces on the host). Only increasing: op s + kOpWindow may
  // fail before op s in the same slot.
  auto* flag = reinterpret_cast<std::atomic<uint64_t>*>(done_ + op.seq % kOpWindow);
  const uint64_t value = op.seq + 1;
  op.add_done_callback([flag, value] {
    uint64_t now = flag->load(std::memory_order_relaxed);
    while (now < value && !flag->compare_exchange_weak(now, value, std::memory_order_release)) {
    }
  });
}

void SubmitGate::stream_wait(const OpState& op, Stream stream) {
  DeviceGuard guard(ops_, device_);
  ops_.wait_value64(stream, done_device_ + sizeof(uint64_t) * (op.seq % kOpWindow), op.seq + 1, WaitCmp::kGeq);
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

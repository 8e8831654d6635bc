#include "cpp/op_state.h"

#include <string>
#include <utility>

namespace freescale {
namespace {

// Indexed by OpKind's value; the names users call the ops by.
constexpr const char* kOpKindNames[] = {nullptr, "all_to_all_single", "all_to_all", "barrier", "dispatch", "combine"};
constexpr uint32_t kOpKindCount = sizeof(kOpKindNames) / sizeof(kOpKindNames[0]);

}  // namespace

std::string op_kind_name(uint32_t kind) {
  if (kind > 0 && kind < kOpKindCount) return kOpKindNames[kind];
  return "op kind " + std::to_string(kind);
}

OpKind op_kind_from_name(const std::string& name) {
  std::string known;
  for (uint32_t k = 1; k < kOpKindCount; ++k) {
    if (name == kOpKindNames[k]) return static_cast<OpKind>(k);
    known += std::string(k > 1 ? ", " : "") + kOpKindNames[k];
  }
  throw InvalidArgument("kind must be one of " + known + ", got '" + name + "'");
}

OpState::OpState(uint64_t seq_, int priority_, const uint8_t* send_, uint8_t* recv_,
                 AllToAllLayout layout_, Clock::time_point deadline_, OpKind kind_)
    : seq(seq_),
      priority(priority_),
      kind(kind_),
      send(send_),
      recv(recv_),
      layout(std::move(layout_)),
      submitted(Clock::now()),
      deadline(deadline_),
      recv_done(layout.recv_bytes.size(), 0),
      recv_finished(layout.recv_bytes.size(), 0),
      send_finished(layout.send_bytes.size(), 0),
      recv_parts_left(static_cast<int>(layout.recv_bytes.size())),
      parts_left_(2 * static_cast<int>(layout.send_bytes.size()) + 1) {}

void OpState::part_done() {
  if (--parts_left_ == 0) finish(kDone);
  if (parts_left_ < 0) throw Error(ErrorCode::kInternal, "op seq " + std::to_string(seq) + " finished a part twice");
}

void OpState::fail(ErrorCode code, const std::string& message, int culprit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() != kPending) return;
    error_code_ = code;
    error_message_ = message;
    error_culprit_ = culprit;
  }
  finish(kFailed);
}

void OpState::finish(int state) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() != kPending) return;
    state_.store(state, std::memory_order_release);
    callbacks.swap(callbacks_);
  }
  for (auto& fn : callbacks) fn();
  {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
  }
  cv_.notify_all();
}

bool OpState::wait_done(std::chrono::microseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto done = [this] { return released_; };
  if (timeout.count() < 0) {
    cv_.wait(lock, done);
    return true;
  }
  return cv_.wait_for(lock, timeout, done);
}

bool OpState::wait(std::chrono::microseconds timeout) {
  if (!wait_done(timeout)) return false;
  rethrow_if_failed();
  return true;
}

void OpState::rethrow_if_failed() const {
  if (!failed()) return;
  std::lock_guard<std::mutex> lock(mu_);
  throw CommError(error_code_, error_message_, error_culprit_);
}

void OpState::add_done_callback(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() == kPending) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

}  // namespace freescale

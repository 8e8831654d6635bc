#include "cpp/scheduler.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "cpp/errors.h"

namespace freescale {

Scheduler::Scheduler(uint64_t chunk_bytes, std::chrono::microseconds aging_quantum)
    : chunk_bytes_(chunk_bytes), aging_quantum_(aging_quantum) {
  if (chunk_bytes == 0) throw InvalidArgument("chunk_bytes must be positive");
  if (aging_quantum.count() <= 0) throw InvalidArgument("aging_quantum must be positive");
}

void Scheduler::submit(Transfer t) {
  t.order = next_order_++;
  pending_.push_back(std::make_unique<Transfer>(std::move(t)));
}

int64_t Scheduler::effective_priority(const Transfer& t, Clock::time_point now) const {
  auto waited = std::chrono::duration_cast<std::chrono::microseconds>(now - t.submitted);
  int64_t levels = waited.count() <= 0 ? 0 : waited.count() / aging_quantum_.count();
  int64_t base = t.priority;  // int32 range; levels >= 0: only a positive base can overflow the sum
  if (base > 0 && levels > std::numeric_limits<int64_t>::max() - base) return std::numeric_limits<int64_t>::max();
  return base + levels;
}

Transfer* Scheduler::pick(Clock::time_point now, const std::function<bool(const Transfer&)>& ready) {
  Transfer* best = nullptr;
  int64_t best_priority = 0;
  for (auto& t : pending_) {
    int64_t p = effective_priority(*t, now);
    if (best != nullptr && (p < best_priority || (p == best_priority && t->order > best->order))) continue;
    if (!ready(*t)) continue;
    best = t.get();
    best_priority = p;
  }
  return best;
}

Chunk Scheduler::next_chunk(const Transfer& t) const { return freescale::next_chunk(t.bytes, t.sent, chunk_bytes_); }

bool Scheduler::chunk_sent(Transfer* t, const Chunk& c) {
  t->sent += c.bytes;
  if (t->sent < t->bytes) return false;
  auto it = std::find_if(pending_.begin(), pending_.end(), [t](const auto& p) { return p.get() == t; });
  if (it == pending_.end()) throw Error(ErrorCode::kInternal, "chunk_sent on a transfer the scheduler does not hold");
  pending_.erase(it);
  return true;
}

std::vector<Transfer> Scheduler::drain() {
  std::vector<Transfer> out;
  out.reserve(pending_.size());
  for (auto& t : pending_) out.push_back(std::move(*t));
  pending_.clear();
  return out;
}

}  // namespace freescale

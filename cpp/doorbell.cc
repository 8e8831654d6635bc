#include "cpp/doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace freescale {
namespace {

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

void Doorbell::ring() {
  counter.fetch_add(1, std::memory_order_seq_cst);
  if (sleeping.load(std::memory_order_seq_cst) != 0) futex(&counter, FUTEX_WAKE, INT_MAX, nullptr);
}

void Doorbell::wait(uint32_t epoch, std::chrono::microseconds timeout) {
  // Announce first, then re-check: a ringer either sees `sleeping` or we see its bump.
  sleeping.store(1, std::memory_order_seq_cst);
  if (counter.load(std::memory_order_seq_cst) == epoch && timeout.count() > 0) {
    struct timespec ts;
    ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
    ts.tv_nsec = static_cast<long>((timeout.count() % 1000000) * 1000);
    futex(&counter, FUTEX_WAIT, epoch, &ts);  // EAGAIN / ETIMEDOUT / EINTR all mean "look again"
  }
  sleeping.store(0, std::memory_order_seq_cst);
}

}  // namespace freescale

// Cross-process wake-ups on a 32-bit counter in shared memory (futex, not process-private).
// A ringer bumps the counter and wakes only if the owner announced it sleeps.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace freescale {

struct alignas(8) Doorbell {
  std::atomic<uint32_t> counter;   // bumped on every event the owner may wait for; only increases
  std::atomic<uint32_t> sleeping;  // 1 while the owner is (about to be) blocked on counter

  // Any process: record an event and wake the owner if it sleeps.
  void ring();
  // Owner only: block until counter != epoch or `timeout` passed (spurious returns allowed).
  void wait(uint32_t epoch, std::chrono::microseconds timeout);
};
static_assert(sizeof(Doorbell) == 8, "Doorbell crosses processes: keep its size fixed");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");

}  // namespace freescale

// The right to run a communicator's progress rounds: held by one thread at a time (its progress
// thread, or a waiter driving progress itself). A mutex and a condition variable rather than a
// std::timed_mutex: it knows its owner, so a done-callback (run by the holder) that blocks on
// another op of the same communicator is caught instead of deadlocking; and its waits are ones
// ThreadSanitizer understands (libtsan does not intercept pthread_mutex_clocklock).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace freescale {

class ProgressLock {
 public:
  void lock() {
    std::unique_lock<std::mutex> guard(mu_);
    free_.wait(guard, [this] { return owner_ == std::thread::id(); });
    owner_ = std::this_thread::get_id();
  }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& limit) {
    std::unique_lock<std::mutex> guard(mu_);
    if (!free_.wait_for(guard, limit, [this] { return owner_ == std::thread::id(); })) return false;
    owner_ = std::this_thread::get_id();
    return true;
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> guard(mu_);
      owner_ = std::thread::id();
    }
    free_.notify_one();
  }
  bool held_by_this_thread() const {
    std::lock_guard<std::mutex> guard(mu_);
    return owner_ == std::this_thread::get_id();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable free_;
  std::thread::id owner_;  // guarded by mu_; default-constructed = free
};

}  // namespace freescale

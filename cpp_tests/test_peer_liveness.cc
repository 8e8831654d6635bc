// Issue 22 item 12: liveness by pid alone took a reused pid for the dead peer, alive until the
// timeout. A peer is its pid and its start time.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "cpp/peer_liveness.h"

namespace freescale {

TEST(PeerLiveness, ThisProcessIsAliveAndKnowsItsStartTime) {
  ProcessId me = this_process();
  EXPECT_EQ(me.pid, static_cast<int>(getpid()));
  EXPECT_GT(me.start_ticks, 0u);
  EXPECT_TRUE(process_alive(me));
  EXPECT_EQ(ProcessId::decode(me.encode()).start_ticks, me.start_ticks);
}

TEST(PeerLiveness, AReusedPidIsNotThePeerWeKnew) {
  ProcessId earlier = this_process();
  earlier.start_ticks -= 1;  // the same pid, started at another time: what a reused pid looks like
  EXPECT_FALSE(process_alive(earlier));
}

TEST(PeerLiveness, AKilledUnreapedChildIsDead) {
  pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ProcessId id{static_cast<int>(child), 0};
  EXPECT_TRUE(process_alive(id));
  kill(child, SIGKILL);
  for (int i = 0; i < 1000 && process_alive(id); ++i) usleep(1000);
  EXPECT_FALSE(process_alive(id));  // a zombie until reaped below
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(process_alive(id));
}

// CI failure: a peer reaped while its /proc/<pid>/stat was being read made the read fail with ESRCH,
// which libstdc++'s filebuf threw as "[INTERNAL] basic_filebuf::underflow error" instead of
// reporting the peer dead. Poll children as they exit and are reaped: never throws, ends dead.
TEST(PeerLiveness, APeerReapedWhileItsStatIsReadIsDeadNotAnError) {
  for (int round = 0; round < 400; ++round) {
    pid_t child = fork();
    if (child == 0) _exit(0);
    ProcessId id{static_cast<int>(child), 0};
    std::atomic<bool> reaped{false};
    std::thread reaper([&] {
      waitpid(child, nullptr, 0);
      reaped = true;
    });
    bool threw = false;
    try {
      while (!reaped) {
        process_alive(id);
      }
      EXPECT_FALSE(process_alive(id));
    } catch (const std::exception& e) {
      threw = true;
      ADD_FAILURE() << "round " << round << ": process_alive threw: " << e.what();
    }
    reaper.join();
    if (threw) break;
  }
}

}  // namespace freescale

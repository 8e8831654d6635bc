#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cpp/scheduler.h"

namespace freescale {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;
constexpr uint64_t kMiB = 1ull << 20;

// A transfer with a dummy op: the scheduler never touches the op's buffers.
Transfer make_transfer(uint64_t bytes, int priority, Clock::time_point submitted, int peer = 1) {
  Transfer t;
  t.op = std::make_shared<OpState>(0, priority, nullptr, nullptr, AllToAllLayout::packed({0, 0}, {0, 0}),
                                   submitted + std::chrono::hours(1));
  t.peer = peer;
  t.bytes = bytes;
  t.priority = priority;
  t.submitted = submitted;
  return t;
}

auto always = [](const Transfer&) { return true; };

// Sends one chunk of the best ready transfer; returns the finished transfer's bytes tag or -1.
int64_t step(Scheduler& s, Clock::time_point now) {
  Transfer* t = s.pick(now, always);
  if (t == nullptr) return -2;
  int64_t tag = static_cast<int64_t>(t->bytes);
  Chunk c = s.next_chunk(*t);
  return s.chunk_sent(t, c) ? tag : -1;
}

}  // namespace

TEST(Scheduler, HigherPriorityFirstFifoAmongEquals) {
  Scheduler s(kMiB, milliseconds(1000));
  auto t0 = Clock::now();
  s.submit(make_transfer(100, 0, t0));
  s.submit(make_transfer(200, 5, t0));
  s.submit(make_transfer(300, 5, t0));
  s.submit(make_transfer(400, 0, t0));
  std::vector<int64_t> order;
  while (s.pending() > 0) order.push_back(step(s, t0));
  EXPECT_EQ(order, (std::vector<int64_t>{200, 300, 100, 400}));
}

TEST(Scheduler, LaterHigherPriorityTransferPreemptsAtChunkBoundary) {
  Scheduler s(kMiB, milliseconds(1000));
  auto t0 = Clock::now();
  s.submit(make_transfer(64 * kMiB, 0, t0));
  // The big transfer is in progress: three chunks out.
  for (int i = 0; i < 3; ++i) EXPECT_EQ(step(s, t0), -1);
  s.submit(make_transfer(64 * 1024, 10, t0 + microseconds(1)));
  // The very next chunk belongs to the small one, which completes first.
  EXPECT_EQ(step(s, t0 + microseconds(2)), int64_t{64 * 1024});
  int big_chunks_left = 0;
  int64_t last = -1;
  while (s.pending() > 0) {
    last = step(s, t0 + microseconds(3));
    ++big_chunks_left;
  }
  EXPECT_EQ(last, int64_t{64 * kMiB});
  EXPECT_EQ(big_chunks_left, 61);
}

TEST(Scheduler, AgingBoundsTheWaitBehindAnEndlessHighPriorityStream) {
  const auto quantum = milliseconds(1);
  const int gap = 10;  // priority levels between the stream and the waiting transfer
  const auto tick = microseconds(100);  // one chunk's worth of fake time
  Scheduler s(kMiB, quantum);
  auto t0 = Clock::now();
  s.submit(make_transfer(7, 0, t0));  // the low-priority transfer, tagged by its size 7
  Clock::time_point served{};
  for (int i = 1; i < 100000 && served == Clock::time_point{}; ++i) {
    auto now = t0 + tick * i;
    s.submit(make_transfer(1000, gap, now));  // endless stream, as fast as it is served
    if (step(s, now) == 7) served = now;
  }
  ASSERT_NE(served, Clock::time_point{}) << "the low-priority transfer starved";
  // Served once aging closed the gap (gap * quantum), within one tick of it, and not before.
  EXPECT_GE(served - t0, quantum * gap);
  EXPECT_LE(served - t0, quantum * gap + tick);
}

TEST(Scheduler, EffectivePriorityGrowsOneLevelPerQuantum) {
  Scheduler s(kMiB, milliseconds(2));
  auto t0 = Clock::now();
  Transfer t = make_transfer(1, 3, t0);
  EXPECT_EQ(s.effective_priority(t, t0), 3);
  EXPECT_EQ(s.effective_priority(t, t0 + milliseconds(5)), 5);
  EXPECT_EQ(s.effective_priority(t, t0 - milliseconds(5)), 3);
}

// Issue 22 item 7: the overflow guard computed INT64_MAX - base, itself an overflow for any
// negative base (UBSan: "signed integer overflow"; at -O0 priority -1 sorted first).
TEST(Scheduler, NegativePrioritiesSortBelowZeroAndAgeUp) {
  Scheduler s(kMiB, milliseconds(1));
  auto t0 = Clock::now();
  EXPECT_EQ(s.effective_priority(make_transfer(1, -1, t0), t0), -1);
  EXPECT_EQ(s.effective_priority(make_transfer(1, -2147483647 - 1, t0), t0 + milliseconds(3)), -2147483645);
  EXPECT_EQ(s.effective_priority(make_transfer(1, 2147483647, t0), t0 + milliseconds(2)), 2147483649);
  s.submit(make_transfer(100, -1, t0));
  s.submit(make_transfer(200, 0, t0));
  s.submit(make_transfer(300, -40, t0));
  std::vector<int64_t> order;
  while (s.pending() > 0) order.push_back(step(s, t0));
  EXPECT_EQ(order, (std::vector<int64_t>{200, 100, 300}));
}

TEST(Scheduler, SkipsTransfersThatAreNotReady) {
  Scheduler s(kMiB, milliseconds(1000));
  auto t0 = Clock::now();
  s.submit(make_transfer(10, 9, t0, /*peer=*/1));
  s.submit(make_transfer(20, 0, t0, /*peer=*/2));
  Transfer* t = s.pick(t0, [](const Transfer& x) { return x.peer != 1; });
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bytes, 20u);
  EXPECT_EQ(s.pick(t0, [](const Transfer&) { return false; }), nullptr);
}

TEST(Scheduler, EmptyTransferTakesOneChunk) {
  Scheduler s(kMiB, milliseconds(1));
  auto t0 = Clock::now();
  s.submit(make_transfer(0, 0, t0));
  EXPECT_EQ(step(s, t0), 0);
  EXPECT_EQ(s.pending(), 0u);
}

TEST(Scheduler, DrainEmptiesTheQueue) {
  Scheduler s(kMiB, milliseconds(1));
  auto t0 = Clock::now();
  s.submit(make_transfer(5, 0, t0));
  s.submit(make_transfer(6, 0, t0));
  EXPECT_EQ(s.drain().size(), 2u);
  EXPECT_EQ(s.pending(), 0u);
}

}  // namespace freescale

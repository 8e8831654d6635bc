#include <gtest/gtest.h>

#include <set>

#include "cpp/nvshmem_layout.h"

namespace freescale {
namespace {

TEST(NvshmemLayout, LanesFollowPriorityOrder) {
  EXPECT_EQ(nvshmem_lane(-5), 0);
  EXPECT_EQ(nvshmem_lane(0), 1);
  EXPECT_EQ(nvshmem_lane(1), 2);
  EXPECT_EQ(nvshmem_lane(99), 2);
  EXPECT_EQ(nvshmem_lane(100), 3);
  EXPECT_EQ(nvshmem_lane(INT32_MAX), 3);
  int last = 0;
  for (int32_t p : {INT32_MIN, -1, 0, 1, 50, 100, 1000}) {
    EXPECT_GE(nvshmem_lane(p), last) << "a higher priority must never get a lower lane";
    last = nvshmem_lane(p);
    EXPECT_LT(last, kNvshmemLanes);
  }
}

TEST(NvshmemLayout, SlotsAndSignalsAreAlignedDisjointAndInside) {
  for (int world : {1, 2, 5}) {
    NvshmemArenaLayout l = NvshmemArenaLayout::plan(world, 1000, 16);
    EXPECT_EQ(l.slot_bytes % NvshmemArenaLayout::kSlotAlign, 0u);
    EXPECT_GE(l.slot_bytes, 1000u);
    std::set<uint64_t> slots, words, records;
    for (int peer = 0; peer < world; ++peer) {
      for (int lane = 0; lane < kNvshmemLanes; ++lane) {
        for (uint64_t n = 0; n < kNvshmemSlotsPerLane; ++n) {
          EXPECT_TRUE(slots.insert(l.recv_slot(peer, lane, n)).second);
          EXPECT_TRUE(slots.insert(l.staging_slot(peer, lane, n)).second);
          EXPECT_EQ(l.recv_slot(peer, lane, n), l.recv_slot(peer, lane, n + kNvshmemSlotsPerLane));  // a ring
          EXPECT_TRUE(words.insert(l.ready(peer, lane, n)).second);  // a word per slot
          EXPECT_TRUE(words.insert(l.freed(peer, lane, n)).second);
          EXPECT_EQ(l.ready(peer, lane, n), l.ready(peer, lane, n + kNvshmemSlotsPerLane));
        }
        EXPECT_TRUE(words.insert(l.audit_out(peer, lane)).second);
        EXPECT_TRUE(records.insert(l.sizes_out(peer, lane)).second);
      }
      for (uint64_t seq = 0; seq < l.window; ++seq) {
        EXPECT_TRUE(words.insert(l.audit(peer, seq)).second);
        EXPECT_TRUE(words.insert(l.recvd(peer, seq)).second);
        EXPECT_TRUE(words.insert(l.audit_bytes(peer, seq)).second);
        EXPECT_TRUE(words.insert(l.sized(peer, seq)).second);
        EXPECT_TRUE(records.insert(l.posted_sizes(peer, seq)).second);
        EXPECT_EQ(l.posted_sizes(peer, seq), l.posted_sizes(0, seq) + l.sizes_bytes() * peer);  // an op's: contiguous
        EXPECT_EQ(l.audit(peer, seq), l.audit(peer, seq + l.window));
      }
      EXPECT_TRUE(words.insert(l.notice(peer)).second);
      EXPECT_TRUE(words.insert(l.kept(peer)).second);
    }
    for (uint64_t at : slots) {
      EXPECT_EQ(at % NvshmemArenaLayout::kSlotAlign, 0u);
      EXPECT_LE(at + l.slot_bytes, l.signals_offset());
    }
    EXPECT_EQ(slots.size() * l.slot_bytes, l.signals_offset());  // no gaps
    for (uint64_t at : words) {
      EXPECT_EQ(at % 8, 0u);
      EXPECT_GE(at, l.signals_offset());
      EXPECT_LE(at + 8, l.signals_offset() + l.signal_bytes());
    }
    EXPECT_EQ(words.size() * 8, l.signal_bytes());
    for (uint64_t at : records) {  // after the mirrored words, record by record
      EXPECT_EQ(at % 8, 0u);
      EXPECT_GE(at, l.signals_offset() + l.signal_bytes());
      EXPECT_LE(at + l.sizes_bytes(), l.num_bytes());
    }
    EXPECT_EQ(l.signals_offset() + l.signal_bytes() + records.size() * l.sizes_bytes(), l.num_bytes());
  }
}

}  // namespace
}  // namespace freescale

#include <gtest/gtest.h>

#include <set>

#include "cpp/ce_arena_layout.h"

namespace freescale {
namespace {

TEST(CeArenaLayout, SlotsAreAlignedDisjointAndInside) {
  for (int world : {2, 3, 8}) {
    for (int owner = 0; owner < world; ++owner) {
      CeArenaLayout l = CeArenaLayout::plan(world, owner, 1000, 64 << 10);
      EXPECT_EQ(l.slot_bytes % CeArenaLayout::kSlotAlign, 0u);
      EXPECT_GE(l.slot_bytes, 1000u);
      EXPECT_GE(l.slots_per_ring, 2u);
      std::set<uint64_t> starts;
      for (int peer = 0; peer < world; ++peer) {
        if (peer == owner) continue;
        for (uint64_t i = 0; i < l.slots_per_ring; ++i) {
          uint64_t at = l.slot_offset(peer, i);
          EXPECT_LE(at + l.slot_bytes, l.num_bytes());
          EXPECT_TRUE(starts.insert(at).second) << "slot reused: peer " << peer << " index " << i;
        }
      }
      EXPECT_EQ(starts.size() * l.slot_bytes, l.num_bytes());  // no gaps either
    }
  }
}

TEST(CeArenaLayout, CountersWrapOntoTheRing) {
  CeArenaLayout l = CeArenaLayout::plan(4, 1, 4096, 1 << 20);
  EXPECT_EQ(l.slot_offset(2, 5), l.slot_offset(2, 5 + l.slots_per_ring));
  EXPECT_NE(l.slot_offset(2, 5), l.slot_offset(3, 5));
}

TEST(CeArenaLayout, SmallArenasStillHoldTwoSlotsPerPeer) {
  CeArenaLayout l = CeArenaLayout::plan(8, 0, 1 << 20, 1, /*min_slots=*/0);
  EXPECT_EQ(l.slots_per_ring, 2u);
  EXPECT_EQ(l.num_bytes(), 2u * 7 * (1u << 20));
  EXPECT_EQ(CeArenaLayout::plan(1, 0, 4096, 1 << 20).num_bytes(), 0u);  // alone: no rings
}

TEST(CeArenaLayout, DefaultKeepsSixteenSlotsPerPeerAtAnyWorld) {
  // The host transport's 4 MiB default arena would leave 2 slots of 256 KiB per peer at world 8.
  for (int world : {2, 4, 8, 16}) {
    CeArenaLayout l = CeArenaLayout::plan(world, 0, 256 << 10, 4 << 20);
    EXPECT_GE(l.slots_per_ring, CeArenaLayout::kDefaultMinSlots) << "world " << world;
  }
}

}  // namespace
}  // namespace freescale

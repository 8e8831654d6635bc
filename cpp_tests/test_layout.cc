#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "cpp/errors.h"
#include "cpp/layout.h"

namespace freescale {

TEST(Layout, PackedOffsetsAreExclusiveSums) {
  auto l = AllToAllLayout::packed({3, 0, 5}, {1, 2, 0});
  EXPECT_EQ(l.send_offsets, (std::vector<uint64_t>{0, 3, 3}));
  EXPECT_EQ(l.recv_offsets, (std::vector<uint64_t>{0, 1, 3}));
  EXPECT_EQ(l.send_capacity, 8u);
  EXPECT_EQ(l.recv_capacity, 3u);
  EXPECT_NO_THROW(validate_alltoallv(l, 3));
}

TEST(Layout, WrongLengthNamesTheField) {
  auto l = AllToAllLayout::packed({1, 1}, {1, 1});
  try {
    validate_alltoallv(l, 3);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("send_bytes"), std::string::npos);
  }
}

TEST(Layout, BlockPastCapacityIsRejected) {
  auto l = AllToAllLayout::packed({4, 4}, {4, 4});
  l.recv_capacity = 7;
  EXPECT_THROW(validate_alltoallv(l, 2), InvalidArgument);
}

TEST(Layout, OffsetOverflowIsRejected) {
  auto l = AllToAllLayout::packed({4, 4}, {4, 4});
  l.send_offsets[1] = std::numeric_limits<uint64_t>::max() - 1;
  EXPECT_THROW(validate_alltoallv(l, 2), InvalidArgument);
}

TEST(Layout, OverlappingReceiveBlocksAreRejected) {
  auto l = AllToAllLayout::packed({4, 4}, {4, 4});
  l.recv_offsets[1] = 2;
  EXPECT_THROW(validate_alltoallv(l, 2), InvalidArgument);
  // Empty blocks may sit anywhere.
  auto e = AllToAllLayout::packed({4, 0}, {4, 0});
  e.recv_offsets[1] = 1;
  EXPECT_NO_THROW(validate_alltoallv(e, 2));
}

TEST(Layout, ChunkCutting) {
  EXPECT_EQ(chunk_count(0, 100), 1u);  // an empty transfer still announces itself
  EXPECT_EQ(chunk_count(100, 100), 1u);
  EXPECT_EQ(chunk_count(101, 100), 2u);
  Chunk c = next_chunk(250, 200, 100);
  EXPECT_EQ(c.offset, 200u);
  EXPECT_EQ(c.bytes, 50u);
  Chunk empty = next_chunk(0, 0, 100);
  EXPECT_EQ(empty.bytes, 0u);
  EXPECT_THROW(next_chunk(100, 100, 100), Error);
}

}  // namespace freescale

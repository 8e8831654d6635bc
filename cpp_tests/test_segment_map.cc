// Scatter/gather segment maps: merging, piecewise reads and writes, validation.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "cpp/errors.h"
#include "cpp/layout.h"
#include "cpp/segment_map.h"

namespace freescale {
namespace {

SegmentMap two_peers() {
  // Peer 0: bytes [10, 14) then [2, 5); peer 1: [5, 8) and [8, 10), which merge.
  SegmentMap m;
  m.begin_peer();
  m.add(10, 4);
  m.add(2, 3);
  m.begin_peer();
  m.add(5, 3);
  m.add(8, 2);
  m.add(0, 0);  // dropped
  m.finish();
  return m;
}

TEST(SegmentMap, AdjacentSegmentsMergeAndEmptyOnesDrop) {
  SegmentMap m = two_peers();
  EXPECT_EQ(m.start, (std::vector<uint64_t>{10, 2, 5}));
  EXPECT_EQ(m.bytes, (std::vector<uint64_t>{4, 3, 5}));
  EXPECT_EQ(m.block_offset, (std::vector<uint64_t>{0, 4, 0}));
  EXPECT_EQ(m.first, (std::vector<uint64_t>{0, 2, 3}));
  EXPECT_EQ(m.block_bytes(0), 7u);
  EXPECT_EQ(m.block_bytes(1), 5u);
}

TEST(SegmentMap, ReadsAndWritesCrossSegmentBoundaries) {
  SegmentMap m = two_peers();
  std::vector<uint8_t> buf(14);
  std::iota(buf.begin(), buf.end(), 0);
  std::vector<uint8_t> out(5);
  read_block(buf.data(), 0, m, 0, 2, 5, out.data());  // last 2 of [10,14), then [2,5)
  EXPECT_EQ(out, (std::vector<uint8_t>{12, 13, 2, 3, 4}));
  std::vector<uint8_t> dst(14, 0);
  std::vector<uint8_t> src{1, 2, 3, 4, 5};
  write_block(dst.data(), 0, m, 1, 0, src.data(), 5);
  EXPECT_EQ(std::vector<uint8_t>(dst.begin() + 5, dst.begin() + 10), src);
  // An empty map is one contiguous block at block_start.
  read_block(buf.data(), 3, SegmentMap{}, 0, 1, 2, out.data());
  EXPECT_EQ(out[0], 4);
  EXPECT_EQ(out[1], 5);
}

TEST(SegmentMap, ValidationNamesTheProblem) {
  SegmentMap m = two_peers();
  validate_segments(m, {7, 5}, 14, 2, true, "recv");
  auto message = [&](std::vector<uint64_t> blocks, uint64_t capacity, int world, bool disjoint) {
    try {
      validate_segments(m, blocks, capacity, world, disjoint, "recv");
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({7, 6}, 14, 2, true).find("peer 1 hold 5 bytes"), std::string::npos);
  EXPECT_NE(message({7, 5}, 13, 2, true).find("runs past"), std::string::npos);
  EXPECT_NE(message({7, 5, 0}, 14, 3, true).find("expected 3"), std::string::npos);
  SegmentMap overlapping;
  overlapping.begin_peer();
  overlapping.add(0, 4);
  overlapping.begin_peer();
  overlapping.add(2, 4);
  overlapping.finish();
  EXPECT_THROW(validate_segments(overlapping, {4, 4}, 8, 2, true, "recv"), InvalidArgument);
  validate_segments(overlapping, {4, 4}, 8, 2, false, "send");  // sends may read a byte twice
}

TEST(SegmentMap, AllToAllValidationChecksTheMaps) {
  AllToAllLayout layout = AllToAllLayout::packed({7, 5}, {7, 5});
  layout.recv_segments = two_peers();
  layout.recv_capacity = 14;
  validate_alltoallv(layout, 2);
  layout.send_segments = two_peers();  // 14 bytes of addresses, but the send buffer holds 12
  EXPECT_THROW(validate_alltoallv(layout, 2), InvalidArgument);
}

}  // namespace
}  // namespace freescale

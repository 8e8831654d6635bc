// Jagged dispatch layout: stable destination order, counts, home segments and the layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "cpp/errors.h"
#include "cpp/jagged_layout.h"

namespace freescale {
namespace {

TEST(JaggedLayout, StableDestinationOrderAndCounts) {
  std::vector<int64_t> lengths{3, 0, 2, 5, 1};
  std::vector<int64_t> dest{2, 0, 2, 0, 1};
  JaggedPlan plan = plan_jagged_dispatch(lengths.data(), dest.data(), 5, 3);
  EXPECT_EQ(plan.order, (std::vector<int64_t>{1, 3, 4, 0, 2}));
  EXPECT_EQ(plan.sent_lengths, (std::vector<int64_t>{0, 5, 1, 3, 2}));
  EXPECT_EQ(plan.sample_counts, (std::vector<int64_t>{2, 1, 2}));
  EXPECT_EQ(plan.row_counts, (std::vector<int64_t>{5, 1, 5}));
  EXPECT_EQ(plan.rows, 11);
}

TEST(JaggedLayout, HomeSegmentsReadThenWrittenAreTheIdentity) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 5);
    const int64_t samples = static_cast<int64_t>(rng() % 40);
    std::vector<int64_t> lengths(samples), dest(samples);
    for (auto& l : lengths) l = (rng() % 4 == 0) ? 0 : static_cast<int64_t>(rng() % 9);
    for (auto& d : dest) d = static_cast<int64_t>(rng() % world);
    JaggedPlan plan = plan_jagged_dispatch(lengths.data(), dest.data(), samples, world);
    const uint64_t row_bytes = 12;
    SegmentMap map = home_segments(plan, row_bytes);
    std::vector<uint64_t> block(world);
    for (int p = 0; p < world; ++p) block[p] = static_cast<uint64_t>(plan.row_counts[p]) * row_bytes;
    validate_segments(map, block, plan.rows * row_bytes, world, true, "home");
    std::vector<uint8_t> src(plan.rows * row_bytes), mid(src.size()), back(src.size());
    std::iota(src.begin(), src.end(), 0);
    uint64_t at = 0;
    for (int p = 0; p < world; ++p) {  // in odd-sized pieces, like chunks
      for (uint64_t off = 0; off < block[p]; off += 7) {
        read_block(src.data(), 0, map, p, off, std::min<uint64_t>(7, block[p] - off), mid.data() + at + off);
      }
      at += block[p];
    }
    // Sample k of the send order holds the bytes of original sample order[k].
    at = 0;
    for (int64_t s : plan.order) {
      for (uint64_t b = 0; b < lengths[s] * row_bytes; ++b) ASSERT_EQ(mid[at + b], src[plan.row_start[s] * row_bytes + b]);
      at += lengths[s] * row_bytes;
    }
    at = 0;
    for (int p = 0; p < world; ++p) {
      write_block(back.data(), 0, map, p, 0, mid.data() + at, block[p]);
      at += block[p];
    }
    EXPECT_EQ(back, src);
  }
}

TEST(JaggedLayout, DispatchAndCombineLayoutsMirrorEachOther) {
  std::vector<int64_t> lengths{3, 0, 2, 5, 1};
  std::vector<int64_t> dest{2, 0, 2, 0, 1};
  JaggedPlan plan = plan_jagged_dispatch(lengths.data(), dest.data(), 5, 3);
  std::vector<int64_t> recv_rows{4, 0, 6};
  AllToAllLayout out = dispatch_layout(plan, 8, recv_rows);
  AllToAllLayout back = combine_layout(plan, 8, recv_rows);
  EXPECT_EQ(out.send_bytes, (std::vector<uint64_t>{40, 8, 40}));
  EXPECT_EQ(out.recv_bytes, (std::vector<uint64_t>{32, 0, 48}));
  EXPECT_EQ(back.send_bytes, out.recv_bytes);
  EXPECT_EQ(back.recv_bytes, out.send_bytes);
  EXPECT_FALSE(out.send_segments.empty());
  EXPECT_TRUE(out.recv_segments.empty());
  EXPECT_TRUE(back.send_segments.empty());
  EXPECT_FALSE(back.recv_segments.empty());
  validate_alltoallv(out, 3);
  validate_alltoallv(back, 3);
  EXPECT_THROW(dispatch_layout(plan, 8, {4, 0}), InvalidArgument);
}

TEST(JaggedLayout, BadEntriesNameTheArgumentAndSample) {
  std::vector<int64_t> lengths{1, -2}, dest{0, 0};
  try {
    plan_jagged_dispatch(lengths.data(), dest.data(), 2, 2);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("lengths[1]"), std::string::npos) << e.what();
  }
  lengths = {1, 2};
  dest = {0, 2};
  try {
    plan_jagged_dispatch(lengths.data(), dest.data(), 2, 2);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("dest_ranks[1]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace freescale

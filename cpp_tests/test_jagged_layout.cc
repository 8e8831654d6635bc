// Jagged dispatch layout: stable destination order, counts, and gather/scatter round trips.
#include <gtest/gtest.h>

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

TEST(JaggedLayout, GatherThenScatterIsTheIdentity) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 20; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 5);
    const int64_t samples = static_cast<int64_t>(rng() % 40);
    std::vector<int64_t> lengths(samples), dest(samples);
    for (auto& l : lengths) l = (rng() % 4 == 0) ? 0 : static_cast<int64_t>(rng() % 9);
    for (auto& d : dest) d = static_cast<int64_t>(rng() % world);
    JaggedPlan plan = plan_jagged_dispatch(lengths.data(), dest.data(), samples, world);
    const uint64_t row_bytes = 12;
    std::vector<uint8_t> src(plan.rows * row_bytes), mid(src.size()), back(src.size());
    std::iota(src.begin(), src.end(), 0);
    gather_jagged(plan, src.data(), mid.data(), row_bytes);
    // Sample k of the send order holds the bytes of original sample order[k].
    uint64_t at = 0;
    for (int64_t s : plan.order) {
      for (uint64_t b = 0; b < lengths[s] * row_bytes; ++b) ASSERT_EQ(mid[at + b], src[plan.row_start[s] * row_bytes + b]);
      at += lengths[s] * row_bytes;
    }
    scatter_jagged(plan, mid.data(), back.data(), row_bytes);
    EXPECT_EQ(back, src);
  }
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

#include "cpp/jagged_layout.h"

#include <limits>
#include <string>

#include "cpp/errors.h"

namespace freescale {

JaggedPlan plan_jagged_dispatch(const int64_t* lengths, const int64_t* dest, int64_t samples, int world) {
  if (world <= 0) throw InvalidArgument("world size must be positive, got " + std::to_string(world));
  if (samples < 0) throw InvalidArgument("the number of samples must be >= 0, got " + std::to_string(samples));
  JaggedPlan plan;
  plan.world = world;
  const auto n = static_cast<size_t>(samples);
  plan.lengths.assign(lengths, lengths + n);
  plan.row_start.resize(n);
  plan.sample_counts.assign(static_cast<size_t>(world), 0);
  plan.row_counts.assign(static_cast<size_t>(world), 0);
  for (size_t i = 0; i < n; ++i) {
    if (lengths[i] < 0) {
      throw InvalidArgument("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) +
                            " is negative; every sample has >= 0 rows");
    }
    if (dest[i] < 0 || dest[i] >= world) {
      throw InvalidArgument("dest_ranks[" + std::to_string(i) + "] = " + std::to_string(dest[i]) +
                            " is not a rank of this group; it must be in [0, " + std::to_string(world) + ")");
    }
    if (lengths[i] > std::numeric_limits<int64_t>::max() - plan.rows) {
      throw InvalidArgument("lengths sum past 2^63 rows at sample " + std::to_string(i));
    }
    plan.row_start[i] = plan.rows;
    plan.rows += lengths[i];
    plan.sample_counts[static_cast<size_t>(dest[i])] += 1;
    plan.row_counts[static_cast<size_t>(dest[i])] += lengths[i];
  }
  // Counting sort by destination, stable.
  std::vector<int64_t> next(static_cast<size_t>(world), 0);
  for (int r = 1; r < world; ++r) next[r] = next[r - 1] + plan.sample_counts[r - 1];
  plan.order.resize(n);
  plan.sent_lengths.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto k = static_cast<size_t>(next[static_cast<size_t>(dest[i])]++);
    plan.order[k] = static_cast<int64_t>(i);
    plan.sent_lengths[k] = lengths[i];
  }
  return plan;
}

SegmentMap home_segments(const JaggedPlan& plan, uint64_t row_bytes) {
  SegmentMap map;
  size_t k = 0;  // position in send order
  for (int p = 0; p < plan.world; ++p) {
    map.begin_peer();
    for (int64_t left = plan.sample_counts[p]; left > 0; --left, ++k) {
      int64_t sample = plan.order[k];
      map.add(static_cast<uint64_t>(plan.row_start[sample]) * row_bytes,
              static_cast<uint64_t>(plan.lengths[sample]) * row_bytes);
    }
  }
  map.finish();
  return map;
}

namespace {

std::vector<uint64_t> bytes_of(const std::vector<int64_t>& rows, uint64_t row_bytes, const char* name, int world) {
  if (rows.size() != static_cast<size_t>(world)) {
    throw InvalidArgument(std::string(name) + " has " + std::to_string(rows.size()) + " entries, expected " +
                          std::to_string(world));
  }
  std::vector<uint64_t> bytes(rows.size());
  for (size_t p = 0; p < rows.size(); ++p) {
    if (rows[p] < 0) throw InvalidArgument(std::string(name) + "[" + std::to_string(p) + "] is negative");
    bytes[p] = static_cast<uint64_t>(rows[p]) * row_bytes;
  }
  return bytes;
}

}  // namespace

AllToAllLayout dispatch_layout(const JaggedPlan& plan, uint64_t row_bytes, const std::vector<int64_t>& recv_rows) {
  AllToAllLayout layout = AllToAllLayout::packed(bytes_of(plan.row_counts, row_bytes, "row_counts", plan.world),
                                                 bytes_of(recv_rows, row_bytes, "recv_rows", plan.world));
  layout.send_segments = home_segments(plan, row_bytes);
  return layout;
}

AllToAllLayout combine_layout(const JaggedPlan& plan, uint64_t row_bytes, const std::vector<int64_t>& recv_rows) {
  AllToAllLayout layout = AllToAllLayout::packed(bytes_of(recv_rows, row_bytes, "recv_rows", plan.world),
                                                 bytes_of(plan.row_counts, row_bytes, "row_counts", plan.world));
  layout.recv_segments = home_segments(plan, row_bytes);
  return layout;
}

}  // namespace freescale

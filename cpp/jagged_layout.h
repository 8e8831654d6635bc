// The layout work of dispatch/combine on CPU: jagged samples (runs of rows) are put in
// destination order (stable: a rank's samples keep their original order) and back.
#pragma once

#include <cstdint>
#include <vector>

#include "cpp/layout.h"
#include "cpp/segment_map.h"

namespace freescale {

struct JaggedPlan {
  int world = 0;
  int64_t rows = 0;                    // sum of lengths: rows of the original values
  std::vector<int64_t> order;          // [B] original sample index of the k-th sample sent
  std::vector<int64_t> row_start;      // [B] first row of sample i in the original values
  std::vector<int64_t> lengths;        // [B] rows of sample i
  std::vector<int64_t> sent_lengths;   // [B] lengths in send order (= lengths[order[k]])
  std::vector<int64_t> sample_counts;  // [world] samples sent to each rank
  std::vector<int64_t> row_counts;     // [world] rows sent to each rank
};

// Plans sending sample i (lengths[i] rows) to rank dest[i]. Throws InvalidArgument naming
// `lengths` or `dest_ranks` (and the sample) for a negative length or a rank out of [0, world).
JaggedPlan plan_jagged_dispatch(const int64_t* lengths, const int64_t* dest, int64_t samples, int world);

// Where each destination's samples sit in the original (home) buffer of plan.rows rows of
// row_bytes: peer p's block is its samples in send order. Adjacent samples merge into one segment.
SegmentMap home_segments(const JaggedPlan& plan, uint64_t row_bytes);

// The AllToAllv layouts that move the plan's rows with no staging copy. recv_rows: [world] rows
// received from each rank by the dispatch. dispatch: sent straight from home (segments), received
// packed by source rank; combine: the reverse, landing straight home.
AllToAllLayout dispatch_layout(const JaggedPlan& plan, uint64_t row_bytes, const std::vector<int64_t>& recv_rows);
AllToAllLayout combine_layout(const JaggedPlan& plan, uint64_t row_bytes, const std::vector<int64_t>& recv_rows);

}  // namespace freescale

// The layout work of dispatch/combine on CPU: jagged samples (runs of rows) are put in
// destination order (stable: a rank's samples keep their original order) and back.
#pragma once

#include <cstdint>
#include <vector>

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

// Copies the samples of `src` (original order, plan.rows rows of row_bytes) into `dst` in send
// order, and back. The buffers must not overlap.
void gather_jagged(const JaggedPlan& plan, const uint8_t* src, uint8_t* dst, uint64_t row_bytes);
void scatter_jagged(const JaggedPlan& plan, const uint8_t* src, uint8_t* dst, uint64_t row_bytes);

}  // namespace freescale

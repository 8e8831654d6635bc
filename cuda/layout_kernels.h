// The layout work of dispatch/combine on CUDA tensors: the only kernels freescale launches (the
// bytes between ranks move on copy engines). Plain C++ interface: callers never include CUDA
// headers. Pointers are device pointers of the current device; streams are cudaStream_t as ints.
#pragma once

#include <cstdint>

namespace freescale {

// Largest group a device plan serves: its per-rank cursors live in shared memory (4 B each).
constexpr int kMaxDevicePlanWorld = 8192;

// Entries of the `counts` output of plan_jagged_dispatch_cuda: [world] samples sent to each
// rank, [world] rows sent to each rank, then one: the smallest sample index with a negative
// length or a destination outside [0, world), or -1 when every sample is valid.
inline int64_t device_plan_counts_size(int world) { return 2 * static_cast<int64_t>(world) + 1; }

// Stable counting sort of `samples` jagged samples (sample i: lengths[i] rows, for rank dest[i])
// by destination rank; one thread block, enqueued on `stream`. Writes `counts` (above) and, for
// the k-th sample in send order (by destination, then original order), all int64 [samples]:
//   sent_lengths[k]  its rows;
//   home_row[k]      its first row in the original (home) values;
//   packed_row[k]    its first row in the packed send buffer (exclusive prefix of sent_lengths).
// When the error entry is not -1 the three arrays are left unspecified. Throws InvalidArgument
// for world outside [1, kMaxDevicePlanWorld] or samples < 0, Error(kSystem) if the launch fails.
void plan_jagged_dispatch_cuda(const int64_t* lengths, const int64_t* dest, int64_t samples, int world,
                               int64_t* counts, int64_t* sent_lengths, int64_t* home_row, int64_t* packed_row,
                               uintptr_t stream);

// Copies every run k (sent_lengths[k] rows of row_bytes bytes) between the home buffer (rows
// from home_row[k]) and the packed buffer (rows from packed_row[k]; packed_rows rows in all):
// home -> packed when to_packed (dispatch's gather), else packed -> home (combine's scatter).
// Work is cut evenly over the packed rows, so one long sample does not serialize the copy.
void copy_jagged_runs_cuda(void* home, void* packed, bool to_packed, const int64_t* sent_lengths,
                           const int64_t* home_row, const int64_t* packed_row, int64_t runs, int64_t packed_rows,
                           uint64_t row_bytes, uintptr_t stream);

}  // namespace freescale

// Layout kernels of dispatch/combine (see layout_kernels.h). The plan is one block: batches are
// thousands of samples, and one block keeps the stable order without a multi-pass sort. The run
// copy spreads the packed rows evenly over blocks and moves the widest aligned words it can.
#include "cuda/layout_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cub/block/block_scan.cuh>
#include <string>

#include "cpp/errors.h"
#include "cuda/driver_api.h"

namespace freescale {
namespace {

constexpr int kPlanThreads = 1024;
constexpr int kWarps = kPlanThreads / 32;
constexpr int kCopyThreads = 256;
constexpr uint64_t kCopyBytesPerBlock = 64 << 10;  // packed bytes one copy block moves (about)

using RowScan = cub::BlockScan<int64_t, kPlanThreads>;
using CountScan = cub::BlockScan<unsigned int, kPlanThreads>;

// Dynamic shared memory: cursor[world], first the samples per rank, then (after the scan) the
// next free send position of each rank's samples.
__global__ void __launch_bounds__(kPlanThreads)
    plan_kernel(const int64_t* lengths, const int64_t* dest, int64_t samples, int world, int64_t* counts,
                int64_t* sent_lengths, int64_t* home_row, int64_t* packed_row) {
  extern __shared__ unsigned int cursor[];
  __shared__ unsigned long long bad;  // smallest invalid sample index, ULLONG_MAX if none
  __shared__ union {
    RowScan::TempStorage rows;
    CountScan::TempStorage counts;
  } scan;
  const int tid = static_cast<int>(threadIdx.x);
  unsigned long long* row_counts = reinterpret_cast<unsigned long long*>(counts + world);

  // 1. Validate, count samples (shared) and rows (global) per destination.
  if (tid == 0) bad = ULLONG_MAX;
  for (int d = tid; d < world; d += kPlanThreads) {
    cursor[d] = 0;
    row_counts[d] = 0;
  }
  __syncthreads();
  for (int64_t i = tid; i < samples; i += kPlanThreads) {
    const int64_t d = dest[i];
    const int64_t len = lengths[i];
    if (d < 0 || d >= world || len < 0) {
      atomicMin(&bad, static_cast<unsigned long long>(i));
    } else {
      atomicAdd(&cursor[d], 1u);
      atomicAdd(&row_counts[d], static_cast<unsigned long long>(len));
    }
  }
  __syncthreads();
  if (bad != ULLONG_MAX) {
    if (tid == 0) counts[2 * world] = static_cast<int64_t>(bad);
    return;  // uniform: every thread read the same `bad`
  }
  if (tid == 0) counts[2 * world] = -1;

  // 2. Sample counts out; cursor[d] becomes the send position of rank d's first sample.
  unsigned int carry = 0;
  for (int base = 0; base < world; base += kPlanThreads) {
    const int d = base + tid;
    const unsigned int n = d < world ? cursor[d] : 0u;
    unsigned int first, total;
    CountScan(scan.counts).ExclusiveSum(n, first, total);
    if (d < world) {
      counts[d] = n;
      cursor[d] = carry + first;
    }
    carry += total;
    __syncthreads();  // scan storage is reused by the next tile
  }

  // 3. Place samples tile by tile, warp by warp (stable: earlier samples take earlier slots).
  const int warp = tid / 32;
  const int lane = tid % 32;
  const unsigned int lanes_before = (1u << lane) - 1u;
  int64_t home_carry = 0;  // home row of the tile's first sample
  for (int64_t tile = 0; tile < samples; tile += kPlanThreads) {
    const int64_t i = tile + tid;
    const bool valid = i < samples;
    const int64_t len = valid ? lengths[i] : 0;
    const int d = valid ? static_cast<int>(dest[i]) : -1;
    int64_t home, tile_rows;
    RowScan(scan.rows).ExclusiveSum(len, home, tile_rows);
    home += home_carry;
    home_carry += tile_rows;
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) {
      if (warp == w) {
        const unsigned int active = __ballot_sync(0xffffffffu, valid);
        if (valid) {
          const unsigned int same = __match_any_sync(active, d);  // lanes sending to rank d
          const unsigned int k = cursor[d] + __popc(same & lanes_before);
          sent_lengths[k] = len;
          home_row[k] = home;
          __syncwarp(active);  // every lane read cursor[d] before its group's first lane moves it
          if ((same & lanes_before) == 0) cursor[d] += __popc(same);
        }
      }
      __syncthreads();
    }
  }

  // 4. packed_row: exclusive prefix of sent_lengths in send order (written above, same block).
  int64_t packed_carry = 0;
  for (int64_t tile = 0; tile < samples; tile += kPlanThreads) {
    const int64_t k = tile + tid;
    const int64_t len = k < samples ? sent_lengths[k] : 0;
    int64_t first, tile_rows;
    RowScan(scan.rows).ExclusiveSum(len, first, tile_rows);
    if (k < samples) packed_row[k] = packed_carry + first;
    packed_carry += tile_rows;
    __syncthreads();
  }
}

// Block b moves packed rows [b * rows_per_block, (b + 1) * rows_per_block) in words of Word.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    copy_runs_kernel(uint8_t* home, uint8_t* packed, bool to_packed, const int64_t* sent_lengths,
                     const int64_t* home_row, const int64_t* packed_row, int64_t runs, int64_t packed_rows,
                     uint64_t row_bytes, int64_t rows_per_block) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t hi = min(lo + rows_per_block, packed_rows);
  if (lo >= hi) return;
  // The last run starting at or before lo (packed_row is non-decreasing, packed_row[0] == 0).
  int64_t left = 0, right = runs - 1;
  while (left < right) {
    const int64_t mid = (left + right + 1) / 2;
    if (packed_row[mid] <= lo) {
      left = mid;
    } else {
      right = mid - 1;
    }
  }
  for (int64_t k = left; k < runs && packed_row[k] < hi; ++k) {
    const int64_t start = packed_row[k];
    const int64_t first = max(lo, start);
    const int64_t last = min(hi, start + sent_lengths[k]);
    if (first >= last) continue;  // an empty run, or one that ends before lo
    uint8_t* packed_at = packed + static_cast<uint64_t>(first) * row_bytes;
    uint8_t* home_at = home + static_cast<uint64_t>(home_row[k] + (first - start)) * row_bytes;
    const Word* src = reinterpret_cast<const Word*>(to_packed ? home_at : packed_at);
    Word* dst = reinterpret_cast<Word*>(to_packed ? packed_at : home_at);
    const uint64_t words = static_cast<uint64_t>(last - first) * row_bytes / sizeof(Word);
    for (uint64_t w = threadIdx.x; w < words; w += kCopyThreads) dst[w] = src[w];
  }
}

template <typename Word>
void launch_copy(uint8_t* home, uint8_t* packed, bool to_packed, const int64_t* sent_lengths, const int64_t* home_row,
                 const int64_t* packed_row, int64_t runs, int64_t packed_rows, uint64_t row_bytes, cudaStream_t stream) {
  const int64_t rows_per_block = static_cast<int64_t>(std::max<uint64_t>(1, kCopyBytesPerBlock / row_bytes));
  const int64_t blocks = (packed_rows + rows_per_block - 1) / rows_per_block;
  if (blocks > INT_MAX) throw InvalidArgument("dispatch/combine: too many rows for one copy launch");
  copy_runs_kernel<Word><<<static_cast<unsigned int>(blocks), kCopyThreads, 0, stream>>>(
      home, packed, to_packed, sent_lengths, home_row, packed_row, runs, packed_rows, row_bytes, rows_per_block);
}

}  // namespace

void plan_jagged_dispatch_cuda(const int64_t* lengths, const int64_t* dest, int64_t samples, int world,
                               int64_t* counts, int64_t* sent_lengths, int64_t* home_row, int64_t* packed_row,
                               uintptr_t stream) {
  if (world < 1 || world > kMaxDevicePlanWorld) {
    throw InvalidArgument("dispatch of CUDA tensors serves groups of 1 ... " + std::to_string(kMaxDevicePlanWorld) +
                          " ranks, this one has " + std::to_string(world) + "; dispatch CPU tensors instead");
  }
  if (samples < 0 || samples > INT_MAX) {
    throw InvalidArgument("the number of samples must be in [0, 2^31), got " + std::to_string(samples));
  }
  const size_t shared = sizeof(unsigned int) * static_cast<size_t>(world);
  plan_kernel<<<1, kPlanThreads, shared, reinterpret_cast<cudaStream_t>(stream)>>>(lengths, dest, samples, world, counts,
                                                                                   sent_lengths, home_row, packed_row);
  check_cuda(cudaGetLastError(), "launching the dispatch plan kernel");
}

void copy_jagged_runs_cuda(void* home, void* packed, bool to_packed, const int64_t* sent_lengths,
                           const int64_t* home_row, const int64_t* packed_row, int64_t runs, int64_t packed_rows,
                           uint64_t row_bytes, uintptr_t stream) {
  if (runs <= 0 || packed_rows <= 0 || row_bytes == 0) return;
  auto* h = static_cast<uint8_t*>(home);
  auto* p = static_cast<uint8_t*>(packed);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  // Runs start at row boundaries: the word fits when both bases and the row size are multiples.
  const uint64_t align = reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(p) | row_bytes;
  if (align % 16 == 0) {
    launch_copy<uint4>(h, p, to_packed, sent_lengths, home_row, packed_row, runs, packed_rows, row_bytes, s);
  } else if (align % 8 == 0) {
    launch_copy<uint2>(h, p, to_packed, sent_lengths, home_row, packed_row, runs, packed_rows, row_bytes, s);
  } else if (align % 4 == 0) {
    launch_copy<unsigned int>(h, p, to_packed, sent_lengths, home_row, packed_row, runs, packed_rows, row_bytes, s);
  } else if (align % 2 == 0) {
    launch_copy<unsigned short>(h, p, to_packed, sent_lengths, home_row, packed_row, runs, packed_rows, row_bytes, s);
  } else {
    launch_copy<unsigned char>(h, p, to_packed, sent_lengths, home_row, packed_row, runs, packed_rows, row_bytes, s);
  }
  check_cuda(cudaGetLastError(), "launching the dispatch/combine copy kernel");
}

}  // namespace freescale

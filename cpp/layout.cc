#include "cpp/layout.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "cpp/errors.h"

namespace freescale {

uint64_t AllToAllLayout::total_send() const {
  return std::accumulate(send_bytes.begin(), send_bytes.end(), uint64_t{0});
}

uint64_t AllToAllLayout::total_recv() const {
  return std::accumulate(recv_bytes.begin(), recv_bytes.end(), uint64_t{0});
}

AllToAllLayout AllToAllLayout::packed(const std::vector<uint64_t>& send_bytes,
                                      const std::vector<uint64_t>& recv_bytes) {
  AllToAllLayout layout;
  layout.send_bytes = send_bytes;
  layout.recv_bytes = recv_bytes;
  layout.send_offsets.resize(send_bytes.size());
  layout.recv_offsets.resize(recv_bytes.size());
  std::exclusive_scan(send_bytes.begin(), send_bytes.end(), layout.send_offsets.begin(), uint64_t{0});
  std::exclusive_scan(recv_bytes.begin(), recv_bytes.end(), layout.recv_offsets.begin(), uint64_t{0});
  layout.send_capacity = layout.total_send();
  layout.recv_capacity = layout.total_recv();
  return layout;
}

namespace {

void check_length(const std::vector<uint64_t>& v, const char* name, int world) {
  if (v.size() != static_cast<size_t>(world)) {
    throw InvalidArgument(std::string(name) + " has " + std::to_string(v.size()) +
                          " entries; it needs one per rank (world size " + std::to_string(world) + ")");
  }
}

void check_within(const std::vector<uint64_t>& bytes, const std::vector<uint64_t>& offsets,
                  uint64_t capacity, const char* side) {
  for (size_t p = 0; p < bytes.size(); ++p) {
    // offset + bytes <= capacity without overflow.
    if (offsets[p] > capacity || bytes[p] > capacity - offsets[p]) {
      throw InvalidArgument(std::string(side) + " block for rank " + std::to_string(p) + " (offset " +
                            std::to_string(offsets[p]) + ", " + std::to_string(bytes[p]) +
                            " bytes) runs past the " + side + " buffer of " + std::to_string(capacity) +
                            " bytes; make the splits sum to the buffer's first dimension");
    }
  }
}

}  // namespace

void validate_alltoallv(const AllToAllLayout& layout, int world) {
  if (world <= 0) throw InvalidArgument("world size must be positive, got " + std::to_string(world));
  check_length(layout.send_bytes, "send_bytes", world);
  check_length(layout.send_offsets, "send_offsets", world);
  check_length(layout.recv_bytes, "recv_bytes", world);
  check_length(layout.recv_offsets, "recv_offsets", world);
  check_within(layout.send_bytes, layout.send_offsets, layout.send_capacity, "send");
  check_within(layout.recv_bytes, layout.recv_offsets, layout.recv_capacity, "recv");
  if (!layout.send_segments.empty()) {
    validate_segments(layout.send_segments, layout.send_bytes, layout.send_capacity, world, false, "send");
  }
  if (!layout.recv_segments.empty()) {
    validate_segments(layout.recv_segments, layout.recv_bytes, layout.recv_capacity, world, true, "recv");
    return;  // the segments, not the offsets, say where bytes land
  }
  // Receive blocks are written concurrently: they must not overlap.
  std::vector<std::pair<uint64_t, uint64_t>> blocks;  // (offset, end)
  for (int p = 0; p < world; ++p) {
    if (layout.recv_bytes[p] > 0) blocks.emplace_back(layout.recv_offsets[p], layout.recv_offsets[p] + layout.recv_bytes[p]);
  }
  std::sort(blocks.begin(), blocks.end());
  for (size_t i = 1; i < blocks.size(); ++i) {
    if (blocks[i].first < blocks[i - 1].second) {
      throw InvalidArgument("recv blocks overlap at byte " + std::to_string(blocks[i].first) +
                            "; every peer needs its own region of the output");
    }
  }
}

uint64_t chunk_count(uint64_t total, uint64_t chunk_bytes) {
  if (chunk_bytes == 0) throw InvalidArgument("chunk_bytes must be positive");
  return total == 0 ? 1 : (total + chunk_bytes - 1) / chunk_bytes;
}

Chunk next_chunk(uint64_t total, uint64_t sent, uint64_t chunk_bytes) {
  if (chunk_bytes == 0) throw InvalidArgument("chunk_bytes must be positive");
  if (sent > total || (sent == total && total != 0)) {
    throw Error(ErrorCode::kInternal, "next_chunk past the end of a transfer (" + std::to_string(sent) +
                                          " of " + std::to_string(total) + " bytes)");
  }
  return Chunk{sent, std::min(chunk_bytes, total - sent)};
}

}  // namespace freescale

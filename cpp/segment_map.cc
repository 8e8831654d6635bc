#include "cpp/segment_map.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "cpp/errors.h"

namespace freescale {

void SegmentMap::begin_peer() { first.push_back(start.size()); }

void SegmentMap::add(uint64_t start_byte, uint64_t n) {
  if (n == 0) return;
  size_t peer_first = first.back();
  if (start.size() > peer_first && start.back() + bytes.back() == start_byte) {
    bytes.back() += n;
    return;
  }
  uint64_t offset = start.size() > peer_first ? block_offset.back() + bytes.back() : 0;
  start.push_back(start_byte);
  bytes.push_back(n);
  block_offset.push_back(offset);
}

void SegmentMap::finish() { first.push_back(start.size()); }

uint64_t SegmentMap::block_bytes(int peer) const {
  uint64_t sum = 0;
  for (uint64_t s = first[peer]; s < first[peer + 1]; ++s) sum += bytes[s];
  return sum;
}

void validate_segments(const SegmentMap& map, const std::vector<uint64_t>& block_bytes, uint64_t capacity,
                       int world, bool disjoint, const std::string& side) {
  const std::string what = side + " segments";
  if (map.first.size() != static_cast<size_t>(world) + 1) {
    throw InvalidArgument(what + " describe " + std::to_string(static_cast<int64_t>(map.first.size()) - 1) +
                          " peers, expected " + std::to_string(world));
  }
  size_t n = map.start.size();
  if (map.bytes.size() != n || map.block_offset.size() != n || map.first.front() != 0 || map.first.back() != n) {
    throw InvalidArgument(what + ": inconsistent arrays");
  }
  for (int p = 0; p < world; ++p) {
    if (map.first[p] > map.first[p + 1]) throw InvalidArgument(what + ": peer ranges out of order");
    uint64_t offset = 0;
    for (uint64_t s = map.first[p]; s < map.first[p + 1]; ++s) {
      if (map.block_offset[s] != offset || map.bytes[s] == 0) throw InvalidArgument(what + ": bad segment " + std::to_string(s));
      if (map.start[s] > capacity || map.bytes[s] > capacity - map.start[s]) {
        throw InvalidArgument(what + ": segment " + std::to_string(s) + " runs past the buffer's " +
                              std::to_string(capacity) + " bytes");
      }
      offset += map.bytes[s];
    }
    if (offset != block_bytes[p]) {
      throw InvalidArgument(what + " for peer " + std::to_string(p) + " hold " + std::to_string(offset) +
                            " bytes, but its block is " + std::to_string(block_bytes[p]));
    }
  }
  if (!disjoint) return;
  std::vector<std::pair<uint64_t, uint64_t>> ranges(n);  // (start, end)
  for (size_t s = 0; s < n; ++s) ranges[s] = {map.start[s], map.start[s] + map.bytes[s]};
  std::sort(ranges.begin(), ranges.end());
  for (size_t s = 1; s < n; ++s) {
    if (ranges[s].first < ranges[s - 1].second) {
      throw InvalidArgument(what + " overlap at byte " + std::to_string(ranges[s].first) +
                            "; every received byte needs its own place");
    }
  }
}

void read_block(const uint8_t* base, uint64_t block_start, const SegmentMap& map, int peer, uint64_t offset,
                uint64_t n, uint8_t* dst) {
  for_each_piece(base, block_start, map, peer, offset, n, [&](const uint8_t* p, uint64_t k) {
    std::memcpy(dst, p, k);
    dst += k;
  });
}

void write_block(uint8_t* base, uint64_t block_start, const SegmentMap& map, int peer, uint64_t offset,
                 const uint8_t* src, uint64_t n) {
  for_each_piece(base, block_start, map, peer, offset, n, [&](uint8_t* p, uint64_t k) {
    std::memcpy(p, src, k);
    src += k;
  });
}

}  // namespace freescale

// Template part of segment_map.h.
#pragma once

#include <algorithm>

namespace freescale {

template <class Byte, class Fn>
void for_each_piece(Byte* base, uint64_t block_start, const SegmentMap& map, int peer, uint64_t offset,
                    uint64_t n, Fn&& fn) {
  if (n == 0) return;
  if (map.empty()) {
    fn(base + block_start + offset, n);
    return;
  }
  // The segment holding `offset`: the last one of the peer whose block_offset <= offset.
  auto begin = map.block_offset.begin() + static_cast<std::ptrdiff_t>(map.first[peer]);
  auto end = map.block_offset.begin() + static_cast<std::ptrdiff_t>(map.first[peer + 1]);
  size_t s = static_cast<size_t>(std::upper_bound(begin, end, offset) - map.block_offset.begin()) - 1;
  while (n > 0) {
    uint64_t within = offset - map.block_offset[s];
    uint64_t take = std::min(n, map.bytes[s] - within);
    fn(base + map.start[s] + within, take);
    offset += take;
    n -= take;
    ++s;
  }
}

}  // namespace freescale

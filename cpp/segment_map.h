// Scatter/gather blocks: one side of an AllToAllv where peer p's block is not one contiguous
// byte range of the buffer but a list of segments, concatenated. dispatch uses it to send rows
// straight from the user's samples (no staging copy) and combine to land them straight home.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace freescale {

struct SegmentMap {
  std::vector<uint64_t> start;         // [S] byte offset of segment s from the buffer base
  std::vector<uint64_t> bytes;         // [S] its length (> 0)
  std::vector<uint64_t> block_offset;  // [S] where segment s begins within its peer's block
  std::vector<uint64_t> first;         // [world + 1] peer p owns segments [first[p], first[p+1])

  // No map: blocks are contiguous (the layout's offsets apply).
  bool empty() const { return first.empty(); }
  // Appends a segment to the last peer begun with begin_peer(); merges it with the previous one
  // when they are adjacent in the buffer. Zero-byte segments are dropped.
  void begin_peer();
  void add(uint64_t start_byte, uint64_t n);
  void finish();  // closes the last peer: first.size() == peers + 1
  uint64_t block_bytes(int peer) const;
};

// Throws InvalidArgument (naming `side`) unless the map has world peers, each peer's segments sum
// to block_bytes[p], every segment lies within `capacity`, and, if `disjoint`, no two overlap.
void validate_segments(const SegmentMap& map, const std::vector<uint64_t>& block_bytes, uint64_t capacity,
                       int world, bool disjoint, const std::string& side);

// Copies bytes [offset, offset + n) of peer p's block of `base` (contiguous at base + block_start
// when the map is empty) to dst, and the reverse.
void read_block(const uint8_t* base, uint64_t block_start, const SegmentMap& map, int peer, uint64_t offset,
                uint64_t n, uint8_t* dst);
void write_block(uint8_t* base, uint64_t block_start, const SegmentMap& map, int peer, uint64_t offset,
                 const uint8_t* src, uint64_t n);

// Calls fn(pointer, bytes) for each contiguous piece of bytes [offset, offset + n) of peer p's
// block, in order. Byte: uint8_t or const uint8_t.
template <class Byte, class Fn>
void for_each_piece(Byte* base, uint64_t block_start, const SegmentMap& map, int peer, uint64_t offset,
                    uint64_t n, Fn&& fn);

}  // namespace freescale

#include "cpp/segment_map_inl.h"

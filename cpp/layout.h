// AllToAllv byte layouts: validation and chunk cutting. Pure functions, no I/O.
#pragma once

#include <cstdint>
#include <vector>

#include "cpp/segment_map.h"

namespace freescale {

// One rank's view of an AllToAllv, in bytes. Entry p of each vector concerns peer rank p.
struct AllToAllLayout {
  std::vector<uint64_t> send_bytes;    // [world] bytes sent to peer p
  std::vector<uint64_t> send_offsets;  // [world] byte offset of peer p's block in the send buffer
  std::vector<uint64_t> recv_bytes;    // [world] bytes expected from peer p
  std::vector<uint64_t> recv_offsets;  // [world] byte offset of peer p's block in the recv buffer
  uint64_t send_capacity = 0;          // bytes addressable from the send pointer
  uint64_t recv_capacity = 0;          // bytes addressable from the recv pointer
  // Optional scatter/gather: when a map is not empty, peer p's block on that side is its
  // segments (offsets from the buffer base) and that side's offsets above are not used.
  SegmentMap send_segments;
  SegmentMap recv_segments;

  uint64_t total_send() const;
  uint64_t total_recv() const;
  // Packed layout: blocks back to back in rank order (what dist.all_to_all_single uses).
  static AllToAllLayout packed(const std::vector<uint64_t>& send_bytes,
                               const std::vector<uint64_t>& recv_bytes);
};

// Throws InvalidArgument naming the field when: a vector is not [world] long, a block runs past
// its buffer's capacity (overflow-safe), two receive blocks (or receive segments) overlap, or a
// segment map does not match the block sizes.
void validate_alltoallv(const AllToAllLayout& layout, int world);

// A contiguous piece of one transfer.
struct Chunk {
  uint64_t offset;  // bytes from the transfer's start
  uint64_t bytes;   // 0 only for the single chunk of an empty transfer
};

// Number of chunks a transfer of `total` bytes is cut into; an empty transfer still sends one
// (zero-byte) chunk, which carries its byte count to the receiver.
uint64_t chunk_count(uint64_t total, uint64_t chunk_bytes);
// The chunk that follows `sent` bytes already moved (sent < total, or sent == total == 0).
Chunk next_chunk(uint64_t total, uint64_t sent, uint64_t chunk_bytes);

}  // namespace freescale

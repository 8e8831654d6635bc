// The device arena of the copy-engine transport: one rank's outgoing rings (owner -> peer) of
// chunk slots in GPU memory, mapped by every peer through a CUDA IPC handle. The slot headers
// (op, offset, bytes) and the head/tail counters stay in the host control segment
// (HostSegmentLayout without inline payload); the GPU writes those counters with stream
// memory operations once a copy landed. Pure arithmetic: compiled and tested without CUDA.
//
//   [slots of ring 0][slots of ring 1]...   the owner's own ring has none (self-copies go direct)
#pragma once

#include <algorithm>
#include <cstdint>

namespace freescale {

struct CeArenaLayout {
  static constexpr uint64_t kSlotAlign = 512;  // bytes: DMA-friendly slot starts

  int world = 0;
  int owner = 0;
  uint64_t slots_per_ring = 0;
  uint64_t slot_bytes = 0;  // payload per slot, a multiple of kSlotAlign (>= the chunk size)

  // Slots per ring by default: a receiver's host sees a landed chunk up to one poll period
  // (~50 us) after it landed, and the sender sees the freed slot as late again, so each ring
  // needs ~2 poll periods of traffic in flight to keep the copy engines busy: 16 slots of
  // 256 KiB (4 MiB per peer) carry ~40 GB/s per peer at a 100 us round trip.
  static constexpr uint64_t kDefaultMinSlots = 16;

  // At least `min_slots` per peer (>= 2: one landing while the next is copied), more when
  // `arena_bytes` (all rings together) holds more. chunk_bytes > 0.
  static CeArenaLayout plan(int world, int owner, uint64_t chunk_bytes, uint64_t arena_bytes,
                            uint64_t min_slots = kDefaultMinSlots) {
    CeArenaLayout l;
    l.world = world;
    l.owner = owner;
    l.slot_bytes = (chunk_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    if (world > 1) {
      l.slots_per_ring = std::max<uint64_t>(std::max<uint64_t>(2, min_slots), arena_bytes / (l.slot_bytes * (world - 1)));
    }
    return l;
  }

  uint64_t num_bytes() const { return world > 1 ? slot_bytes * slots_per_ring * (world - 1) : 0; }

  // Byte offset of slot `index` (any counter value: taken mod slots_per_ring) of the ring to
  // `peer` (!= owner).
  uint64_t slot_offset(int peer, uint64_t index) const {
    uint64_t ring = static_cast<uint64_t>(peer < owner ? peer : peer - 1);
    return slot_bytes * (ring * slots_per_ring + index % slots_per_ring);
  }
};

}  // namespace freescale

// The symmetric-heap arena of the NVSHMEM transport and the rules both ends of a transfer follow
// without talking: pure arithmetic, compiled and tested without CUDA or NVSHMEM.
//
// Traffic between two ranks runs in lanes picked by the op's priority (every rank passes the same
// priority for an op); within a (peer, lane) pair chunks travel in op order (FIFO by seq), so
// the receiver knows which op and offset the n-th chunk of a pair-lane carries with no header.
// A later urgent op overtakes bulk ones by travelling in a higher lane.
//
// Every rank's arena (same size on every rank, as symmetric allocations must be):
//   recv    [src][lane][slot] slot_bytes   chunks put here by rank src
//   staging [dst][lane][slot] slot_bytes   chunks staged here before the put to rank dst
//   ready   [src][lane][slot] uint64       n + 1 once src's chunk n (of that pair-lane) landed in the slot
//   freed   [dst][lane][slot] uint64       n + 1 once dst copied our chunk n out of its slot
//   audit   [src][window]     uint64       seq + 1 once src's byte count for op seq landed here
//   recvd   [src][window]     uint64       seq + 1 once src received all of op seq (from everyone)
//   audit_bytes [src][window] uint64       the bytes src sends us in op seq (put before audit)
//   sized   [src][window]     uint64       seq + 1 once src's posted sizes for op seq landed here
//   audit_out   [dst][lane]   uint64       our byte count for dst, staged as that put's source
//                                          (reused in the pair-lane's stream order)
//   notice  [src]             uint64       src's state, written by src: 0 running, 1 closed,
//                                          2 + ErrorCode aborted
//   kept    [src]             uint64       1 once src closed and kept its NVSHMEM reference
//                                          (it stopped waiting for the group's close)
//   (the words above, from ready on, are what the host mirror copies; those below are read on demand)
//   posted_sizes [window][src] [send x world][recv x world] uint64
//                                          what src sends to and expects from each rank in op seq
//                                          (put before sized; one op's records are contiguous)
//   sizes_out    [dst][lane]   [send x world][recv x world] uint64
//                                          our sizes staged as that put's source (as audit_out)
// Every signal word has one writer, and each SET to it is issued only after its reader saw the
// previous one (a slot is refilled only once freed, freed again only once refilled; an op's
// window entry is reused only once every rank confirmed the op before it): no two signals to one
// word are ever in flight, so NVSHMEM's unordered delivery (no fence) cannot lower a word.
#pragma once

#include <cstdint>

#include "cpp/errors.h"

namespace freescale {

constexpr int kNvshmemLanes = 4;
constexpr uint64_t kNvshmemSlotsPerLane = 2;  // one landing while the next is in flight

// Lane of an op: < 0 → 0 (below default), 0 → 1 (default), 1 ... 99 → 2, >= 100 → 3 (urgent).
inline int nvshmem_lane(int32_t priority) {
  if (priority < 0) return 0;
  if (priority == 0) return 1;
  return priority < 100 ? 2 : 3;
}

// notice values (see the arena above).
constexpr uint64_t kNvshmemNoticeClosed = 1;
constexpr uint64_t kNvshmemNoticeAbortBase = 2;  // + code + 256 * (culprit + 1): see nvshmem_abort_notice

// The notice of an abort with `code` because of rank `culprit` (-1: unknown), and back.
inline uint64_t nvshmem_abort_notice(ErrorCode code, int culprit) {
  return kNvshmemNoticeAbortBase + static_cast<uint64_t>(code) + 256 * static_cast<uint64_t>(culprit + 1);
}
inline ErrorCode nvshmem_notice_code(uint64_t notice) {
  return static_cast<ErrorCode>((notice - kNvshmemNoticeAbortBase) % 256);
}
inline int nvshmem_notice_culprit(uint64_t notice) {
  return static_cast<int>((notice - kNvshmemNoticeAbortBase) / 256) - 1;
}

struct NvshmemArenaLayout {
  static constexpr uint64_t kSlotAlign = 512;  // bytes: DMA-friendly slot starts

  int world = 0;
  uint64_t slot_bytes = 0;  // >= the chunk size, a multiple of kSlotAlign
  uint64_t window = 0;      // op-window entries of audit / recvd (ops in flight at most)

  static NvshmemArenaLayout plan(int world, uint64_t chunk_bytes, uint64_t op_window) {
    NvshmemArenaLayout l;
    l.world = world;
    l.slot_bytes = (chunk_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    l.window = op_window;
    return l;
  }

  uint64_t slots_per_region() const {
    return static_cast<uint64_t>(world) * kNvshmemLanes * kNvshmemSlotsPerLane;
  }
  uint64_t slot_index(int peer, int lane, uint64_t n) const {
    return (static_cast<uint64_t>(peer) * kNvshmemLanes + static_cast<uint64_t>(lane)) * kNvshmemSlotsPerLane +
           n % kNvshmemSlotsPerLane;
  }
  // Byte offsets from the arena base. n: the pair-lane's chunk counter (any value).
  uint64_t recv_slot(int src, int lane, uint64_t n) const { return slot_bytes * slot_index(src, lane, n); }
  uint64_t staging_slot(int dst, int lane, uint64_t n) const {
    return slot_bytes * (slots_per_region() + slot_index(dst, lane, n));
  }
  uint64_t signals_offset() const { return 2 * slot_bytes * slots_per_region(); }
  uint64_t ready(int src, int lane, uint64_t n) const { return signals_offset() + 8 * slot_index(src, lane, n); }
  uint64_t freed(int dst, int lane, uint64_t n) const {
    return signals_offset() + 8 * (slots_per_region() + slot_index(dst, lane, n));
  }
  uint64_t audit(int src, uint64_t seq) const { return words_offset() + 8 * window_word(src, seq); }
  uint64_t recvd(int src, uint64_t seq) const { return words_offset() + 8 * (window_words() + window_word(src, seq)); }
  uint64_t audit_bytes(int src, uint64_t seq) const {
    return words_offset() + 8 * (2 * window_words() + window_word(src, seq));
  }
  uint64_t sized(int src, uint64_t seq) const {
    return words_offset() + 8 * (3 * window_words() + window_word(src, seq));
  }
  uint64_t audit_out(int dst, int lane) const {
    return words_offset() + 8 * (4 * window_words() + lane_word(dst, lane));
  }
  uint64_t notice(int src) const { return words_offset() + 8 * (4 * window_words() + lane_words() + src); }
  uint64_t kept(int src) const { return notice(world) + 8 * static_cast<uint64_t>(src); }  // after the notices
  // Bytes of one rank's sizes for one op: [send x world][recv x world].
  uint64_t sizes_bytes() const { return 8 * 2 * static_cast<uint64_t>(world); }
  uint64_t posted_sizes(int src, uint64_t seq) const {
    return sizes_offset() + sizes_bytes() * ((seq % window) * static_cast<uint64_t>(world) + static_cast<uint64_t>(src));
  }
  uint64_t sizes_out(int dst, int lane) const {
    return sizes_offset() + sizes_bytes() * (window_words() + lane_word(dst, lane));
  }
  uint64_t num_bytes() const { return sizes_offset() + sizes_bytes() * (window_words() + lane_words()); }
  // Every word from ready to the kept words: what the transport's host mirror copies.
  uint64_t signal_bytes() const { return sizes_offset() - signals_offset(); }

 private:
  uint64_t words_offset() const { return signals_offset() + 8 * 2 * slots_per_region(); }
  uint64_t sizes_offset() const { return words_offset() + 8 * (4 * window_words() + lane_words() + 2 * world); }
  uint64_t lane_words() const { return static_cast<uint64_t>(world) * kNvshmemLanes; }
  uint64_t window_words() const { return static_cast<uint64_t>(world) * window; }
  uint64_t lane_word(int peer, int lane) const { return static_cast<uint64_t>(peer) * kNvshmemLanes + lane; }
  uint64_t window_word(int peer, uint64_t seq) const { return static_cast<uint64_t>(peer) * window + seq % window; }
};

}  // namespace freescale

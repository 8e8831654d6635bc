// The layout of one rank's shared segment in the host transport. The owner writes its outgoing
// rings (owner -> peer); each peer reads its ring and advances its tail there.
//
//   [RankControl][ReceivedWindow][AbortNotice][PostedKinds][DelegatedCalls]
//   [Registration x kMaxRegistrations]
//   [RecvTarget x kOpWindow x world][PostedSizes x kOpWindow]
//   [RingControl x world][slots of ring 0]...[slots of ring world-1]
//   the owner's own ring has no slots (self-copies go direct).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cpp/doorbell.h"

namespace freescale {

// "FSCSHM06": RingControl carries head_enqueued / tail_enqueued, the segment registrations and
// receive targets, SlotHeader flags and op kind, the abort notice's text, RankControl::left, the
// posted ops' sizes, the delegated calls (a peer of an older build fails at setup).
inline constexpr uint64_t kHostSegmentMagic = 0x46534353484d3036ull;

enum RankState : uint32_t { kRankRunning = 0, kRankClosed = 1, kRankAborted = 2 };

struct alignas(64) RankControl {
  Doorbell doorbell;                 // rung by anyone who changed what this rank waits on
  std::atomic<uint32_t> state;       // RankState; only increases
  std::atomic<int32_t> abort_code;   // ErrorCode that made this rank abort (valid once aborted)
  std::atomic<uint64_t> posted_ops;  // ops this rank has posted (seq < posted_ops); only increases
  uint64_t magic;                    // kHostSegmentMagic, written before the segment is shared
  std::atomic<int32_t> abort_culprit;  // the rank at the root of the abort, -1 unknown (valid once aborted)
  std::atomic<uint32_t> left;        // 1 once an aborted rank closed its communicator (state stays kRankAborted)
  char pad[24];
};
static_assert(sizeof(RankControl) == 64, "RankControl crosses processes");

// Op s counts as received by the owner once received[s % kOpWindow] >= s + 1: every byte of it
// arrived and matched the receiver's expected counts. A rank posts op s + kOpWindow only after
// op s completed, so a slot moving past s + 1 still means "s was received".
inline constexpr uint64_t kOpWindow = 64;
struct alignas(64) ReceivedWindow {
  std::atomic<uint64_t> received[kOpWindow];  // seq + 1 of the op last received in each slot
};
static_assert(sizeof(ReceivedWindow) == 8 * kOpWindow, "ReceivedWindow crosses processes");

// Why the owner aborted, in its own words (NUL-terminated, cut to fit): written once, before
// RankControl::state becomes kRankAborted (release), so a peer that read that state (acquire)
// reads it whole. Peers add it to the PEER_ABORTED they raise.
inline constexpr size_t kAbortWhyBytes = 512;
struct alignas(64) AbortNotice {
  char why[kAbortWhyBytes];
};
static_assert(sizeof(AbortNotice) == kAbortWhyBytes, "AbortNotice crosses processes");

// What the owner runs as each op it posted (OpKind), so that a rank that reads a chunk header of
// another kind can tell which rank is the odd one from what every posted rank runs:
// entry[seq % kOpWindow] = (seq + 1) << 8 | kind, written before posted_ops passes seq (release).
struct alignas(64) PostedKinds {
  std::atomic<uint64_t> entry[kOpWindow];
};
static_assert(sizeof(PostedKinds) == 8 * kOpWindow, "PostedKinds crosses processes");

// The collectives the owner's freescale group delegated to its inner gloo group, as text (the op,
// and what of its arguments must agree across ranks), so that a rank whose delegated call failed
// can tell which rank called another one. Call n lives in entry[n % kOpWindow]: its tag is zeroed,
// the text written, then tag = n + 1 (release); a reader takes the text only if it reads tag n + 1
// both before and after copying it (the owner rewrites the entry kOpWindow calls later).
inline constexpr size_t kCallTextWords = 15;  // 120 bytes of text, NUL-padded
struct alignas(64) DelegatedCall {
  std::atomic<uint64_t> tag;
  std::atomic<uint64_t> text[kCallTextWords];
};
static_assert(sizeof(DelegatedCall) == 128, "DelegatedCall crosses processes");
struct alignas(64) DelegatedCalls {
  DelegatedCall entry[kOpWindow];
};

struct alignas(64) RingControl {
  std::atomic<uint64_t> head;  // slots written by the owner (sender); only increases
  // Device transports: slots whose write (and the device's head update after it) the owner's host
  // has enqueued; the peer may enqueue work that waits for head to reach it. Only increases.
  std::atomic<uint64_t> head_enqueued;
  char pad0[48];
  std::atomic<uint64_t> tail;  // slots consumed by the peer (receiver); only increases
  std::atomic<uint64_t> tail_enqueued;  // likewise: consumption the peer's host has enqueued
  char pad1[48];
};
static_assert(sizeof(RingControl) == 128, "RingControl crosses processes");

inline constexpr uint64_t kSlotDirect = 1;  // SlotHeader::flags: the payload went straight into the receiver's buffer

struct alignas(64) SlotHeader {
  uint64_t seq;     // op sequence number
  uint64_t offset;  // bytes from the start of this (op, sender -> receiver) transfer
  uint64_t bytes;   // payload bytes in this slot
  uint64_t total;   // bytes of the whole transfer, as the sender counts them
  uint64_t flags;   // kSlotDirect or 0
  uint32_t kind;    // the sender's OpKind for this op
  char pad[20];
};

// Device transports: a buffer of the owner's that peers may write directly (its allocation's IPC
// handle, as text, and where in that allocation the buffer lies).
inline constexpr int kMaxRegistrations = 16;
struct alignas(64) Registration {
  std::atomic<uint64_t> ready;  // 1 once the fields below are written; never changes after
  uint64_t offset;              // of the buffer in its allocation
  uint64_t bytes;               // of the buffer
  char handle[168];             // NUL-terminated
};
static_assert(sizeof(Registration) == 192, "Registration crosses processes");

// Where the owner's op `seq` receives from one source: written before the op is posted.
struct RecvTarget {
  std::atomic<uint64_t> seq_plus_1;  // seq + 1 of the op this entry describes
  uint64_t registration_plus_1;      // 0: not a registered buffer (the payload goes through slots)
  uint64_t offset;                   // of the receive block in that registration
  uint64_t bytes;                    // the receive block's size, as the owner expects it
};
static_assert(sizeof(RecvTarget) == 32, "RecvTarget crosses processes");

// The bytes the owner's op `seq` sends to and expects from each rank, so that a rank whose sizes
// disagree with a peer's can tell which one is the odd one out from every posted rank's:
// [tag][send x world][recv x world] per window slot, tag = seq + 1, all written before
// posted_ops passes seq (release). 64-byte aligned slots.
struct PostedSizes {
  std::atomic<uint64_t>* words;  // the slot: 1 + 2 * world words
  int world;
  static uint64_t stride(int world) { return (8 + 16 * static_cast<uint64_t>(world) + 63) / 64 * 64; }
  std::atomic<uint64_t>& tag() const { return words[0]; }
  std::atomic<uint64_t>& send(int peer) const { return words[1 + peer]; }
  std::atomic<uint64_t>& recv(int peer) const { return words[1 + world + peer]; }
};
static_assert(sizeof(SlotHeader) == 64, "SlotHeader crosses processes");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");

struct HostSegmentLayout {
  int world = 0;                // ranks in the communicator
  int owner = 0;                // rank that owns (sends from) this segment
  uint64_t slots_per_ring = 0;  // chunks in flight per (owner -> peer) ring
  uint64_t slot_payload = 0;    // payload bytes per slot (= the owner's chunk_bytes)
  bool inline_payload = true;   // false: slots hold headers only, payloads live elsewhere (GPU arena)

  uint64_t slot_stride() const { return sizeof(SlotHeader) + (inline_payload ? round_up(slot_payload) : 0); }
  // Whole pages, so the segment can be registered with CUDA as it is.
  size_t num_bytes() const {
    size_t used = rings_offset() + sizeof(RingControl) * world + slot_stride() * slots_per_ring * (world - 1);
    static_assert(sizeof(RankControl) % 64 == 0 && sizeof(ReceivedWindow) % 64 == 0 && sizeof(AbortNotice) % 64 == 0 &&
                      sizeof(PostedKinds) % 64 == 0 && sizeof(DelegatedCalls) % 64 == 0,
                  "64-byte sections");
    return (used + 4095) / 4096 * 4096;
  }
  RankControl* control(void* base) const { return static_cast<RankControl*>(base); }
  ReceivedWindow* received(void* base) const {
    return reinterpret_cast<ReceivedWindow*>(static_cast<char*>(base) + sizeof(RankControl));
  }
  AbortNotice* abort_notice(void* base) const {
    return reinterpret_cast<AbortNotice*>(static_cast<char*>(base) + sizeof(RankControl) + sizeof(ReceivedWindow));
  }
  PostedKinds* posted_kinds(void* base) const {
    return reinterpret_cast<PostedKinds*>(static_cast<char*>(base) + sizeof(RankControl) + sizeof(ReceivedWindow) +
                                          sizeof(AbortNotice));
  }
  DelegatedCalls* delegated_calls(void* base) const {
    return reinterpret_cast<DelegatedCalls*>(static_cast<char*>(base) + sizeof(RankControl) + sizeof(ReceivedWindow) +
                                             sizeof(AbortNotice) + sizeof(PostedKinds));
  }
  Registration* registration(void* base, int index) const {
    return reinterpret_cast<Registration*>(static_cast<char*>(base) + registrations_offset()) + index;
  }
  RecvTarget* recv_target(void* base, uint64_t seq, int src) const {
    auto* targets = reinterpret_cast<RecvTarget*>(static_cast<char*>(base) + registrations_offset() +
                                                  sizeof(Registration) * kMaxRegistrations);
    return targets + (seq % kOpWindow) * static_cast<uint64_t>(world) + static_cast<uint64_t>(src);
  }
  PostedSizes posted_sizes(void* base, uint64_t seq) const {
    return {reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base) + sizes_offset() +
                                                     (seq % kOpWindow) * PostedSizes::stride(world)),
            world};
  }
  RingControl* ring(void* base, int peer) const {
    return reinterpret_cast<RingControl*>(static_cast<char*>(base) + rings_offset()) + peer;
  }
  SlotHeader* slot(void* base, int peer, uint64_t index) const {
    uint64_t ring_index = static_cast<uint64_t>(peer < owner ? peer : peer - 1);  // no slots for self
    char* slots = static_cast<char*>(base) + rings_offset() + sizeof(RingControl) * world;
    return reinterpret_cast<SlotHeader*>(slots + slot_stride() * (ring_index * slots_per_ring + index % slots_per_ring));
  }
  static uint8_t* payload(SlotHeader* s) { return reinterpret_cast<uint8_t*>(s + 1); }

 private:
  static uint64_t round_up(uint64_t bytes) { return (bytes + 63) / 64 * 64; }
  static size_t registrations_offset() {
    return sizeof(RankControl) + sizeof(ReceivedWindow) + sizeof(AbortNotice) + sizeof(PostedKinds) +
           sizeof(DelegatedCalls);
  }
  size_t sizes_offset() const {
    return registrations_offset() + sizeof(Registration) * kMaxRegistrations +
           round_up(sizeof(RecvTarget) * kOpWindow * static_cast<uint64_t>(world));
  }
  size_t rings_offset() const { return sizes_offset() + PostedSizes::stride(world) * kOpWindow; }
};

}  // namespace freescale

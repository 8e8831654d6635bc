// Host transport: CPU buffers, ranks on one host. Each rank owns one shared segment holding a
// bounded ring of chunk slots towards every peer (two copies: sender -> slot -> receiver), with
// flow control through monotone head/tail counters and futex doorbells. A sender writes op `seq`
// to a peer once that peer has posted `seq`, or before, if all its earlier ops' bytes for that
// peer are out: a ring then holds posted ops, followed by ops in the order the peer posts next,
// so it always drains.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/host_layout.h"
#include "cpp/peer_liveness.h"
#include "cpp/shm_segment.h"
#include "cpp/size_blame.h"
#include "cpp/transport.h"

namespace freescale {

// The control plane (rings of slot headers, counters, doorbells, liveness) is shared with the
// copy-engine transport, which derives from this class and moves payloads through GPU memory
// instead: the data-path hooks below are where the two differ.
class HostTransport : public Transport {
 public:
  // Collective over `bootstrap`. Throws kUnsupported if the ranks are not on one host.
  HostTransport(Bootstrap& bootstrap, const Config& config) : HostTransport(bootstrap, config, true, 0) {}
  ~HostTransport() override;

  const char* name() const override { return "host"; }
  std::string data_path() const override {
    return "host: CPU copies through shared memory (no GPU work)";
  }
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  void send_chunk(const Transfer& t, const Chunk& c) override;
  bool poll() override;
  uint64_t max_ops_in_flight() const override { return kOpWindow; }
  void check_peers() override;
  std::vector<PeerSight> peer_sight() const override;
  int peer_pid(int rank) const override { return rank >= 0 && rank < world_ ? peers_[rank].process.pid : -1; }
  uint64_t note_delegated_call(const std::string& text) override;
  std::vector<std::string> delegated_calls(uint64_t n) const override;
  uint32_t activity_epoch() const override;
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  void wake() override;
  void abort(ErrorCode code, int culprit, const std::string& why) override;
  void close() override;
  void leave() override;

 protected:
  // inline_payload false: slots carry headers only; the derived class moves payloads, through
  // its own slots: `slots_per_ring` must then be the number it has per ring (the host rings'
  // flow control is the only thing that keeps a sender off unread slots).
  HostTransport(Bootstrap& bootstrap, const Config& config, bool inline_payload, uint64_t slots_per_ring = 0);

  // --- data-path hooks (host: synchronous memcpy through the shared segment) ---
  // Copies `bytes` of op's block for `peer`, from `offset`, into ring slot `index` (whose header
  // is written), then makes head = index + 1 visible to the peer (now or once the copy landed).
  virtual void fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset, uint64_t bytes);
  // Where the payload of slot `index` of src's ring to this rank is (readable by land()).
  virtual const uint8_t* slot_payload(int src, uint64_t index, SlotHeader* slot) const;
  // Frees that slot for the sender: tail = index + 1 (now or once land() finished reading it).
  virtual void release_slot(int src, uint64_t index);
  // Copies one accepted chunk (h.bytes at h.offset of src's block) from `payload` into op's
  // receive buffer; `last`: the block's last chunk, after which the receive part from src is
  // finished (call finish_recv now, or once the copy landed).
  virtual void land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last);
  // Whether a chunk of `bytes` from src may be landed now (false: it waits in its slot, and the
  // ring's later chunks behind it, until a later poll). Host: always.
  virtual bool can_land(int /*src*/, uint64_t /*bytes*/) { return true; }
  // The receive part of op from src landed entirely.
  void finish_recv(OpState& op, int src);
  // Slots of our ring to `peer` written and not yet freed by it.
  uint64_t slots_in_flight(int peer) const { return filled_[peer] - freed_slots(peer); }
  // What the host acts on: slots of src's ring to us it may take (written), and slots of our
  // ring to `peer` it may write again (freed). Host: the rings' head and tail. A device
  // transport whose host enqueues work that waits on the device for them: what peers enqueued.
  virtual uint64_t written_slots(int src) const { return ring_of(src, rank_)->head.load(std::memory_order_acquire); }
  virtual uint64_t freed_slots(int peer) const { return ring_of(rank_, peer)->tail.load(std::memory_order_acquire); }
  // A peer that died or aborted: it completes nothing more.
  bool peer_gone(int p) const;
  // Ops peer p has posted (seq < it), its registrations and its receive targets (host_layout.h).
  uint64_t peer_posted(int p) const;
  Registration* registration_of(int owner, int index) const;
  RecvTarget* recv_target_of(int owner, uint64_t seq, int src) const;
  // Called in post(), before peers can see the op posted: a device transport describes where
  // the op receives (RecvTarget). Host: nothing.
  virtual void before_post(const OpState& /*op*/) {}
  // Wakes `peer`'s progress thread.
  void notify_peer(int peer) { ring_peer(peer); }
  // The posted, not yet completed op `seq` (null if none).
  std::shared_ptr<OpState> posted_op(uint64_t seq) const {
    auto it = posted_.find(seq);
    return it == posted_.end() ? nullptr : it->second;
  }
  bool ops_pending() const { return !posted_.empty(); }
  // seq -> posted, not yet completed ops.
  const std::map<uint64_t, std::shared_ptr<OpState>>& posted_ops() const { return posted_; }
  // Keeps every rank's segment mapped for the life of the process (names dropped): a device
  // transport whose stuck device work may still touch them. Only from the destructor's path.
  void leak_segments() {
    for (Peer& p : peers_) p.segment.leak();
  }
  // The control segments (ours: p == rank_), for registering them with a device.
  void* segment_base(int p) const { return peers_[p].segment.data(); }
  size_t segment_bytes(int p) const { return peers_[p].layout.num_bytes(); }
  // The ring `owner` writes towards `peer` (head: owner's slots written; tail: peer's consumed).
  RingControl* ring_of(int owner, int peer) const { return peers_[owner].layout.ring(peers_[owner].segment.data(), peer); }

  int rank_;
  int world_;

 private:
  struct Peer {
    ShmSegment segment;        // the peer's segment (ours for self)
    HostSegmentLayout layout;  // its layout
    ProcessId process;  // for liveness checks
    RankControl* control() const { return layout.control(segment.data()); }
    bool received(uint64_t seq) const {
      return layout.received(segment.data())->received[seq % kOpWindow].load(std::memory_order_acquire) >= seq + 1;
    }
  };
  // Checks one arrived chunk from `src` against its op and lands it.
  // Accepts a chunk from `src` for a posted op; false if it must wait in its slot (its kind differs
  // from ours and which rank is the odd one waits on peers yet to post the op). Throws CommError
  // on a mismatch.
  bool deliver(int src, const SlotHeader& header, const uint8_t* payload);
  // Op `seq` (posted here) meets rank `src`'s chunk of kind `theirs`, which cannot meet ours: the
  // rank alone in its kind against at least two others among the ranks that posted it (this one
  // or src), or -1 if that cannot be told (two ranks; a tie; peers yet to post).
  int odd_rank_out(uint64_t seq, int src, uint32_t theirs) const;
  // Op `seq` (posted here) disagrees in size with a peer's chunk: the odd one out among the ranks
  // that posted it (cpp/size_blame.h).
  OddSizeRank odd_size_rank_among_posted(uint64_t seq) const;
  // Every other rank has posted op `seq` (its kind and sizes are in its segment).
  bool every_peer_posted(uint64_t seq) const;
  bool drain_from(int src);
  void ring_peer(int peer) { peers_[peer].control()->doorbell.ring(); }
  void ring_all();
  void forget_completed();
  // Confirms posted ops that every rank has received (the op's last part). True if any.
  bool confirm_received();
  // Whether this rank's own reads of op's send buffer are over (a device transport's copies run
  // asynchronously). An op is confirmed only then, so its completion never rests on peers'
  // word alone (a peer's "received" implies it on honest peers, across processes).
  virtual bool sends_settled(const OpState&) { return true; }

  std::vector<Peer> peers_;                             // [world]; peers_[rank_] is our own
  std::vector<uint64_t> filled_;                        // [world] slots written towards peer p
  std::vector<uint64_t> taken_;                         // [world] slots of src's ring handed to land()
  std::map<uint64_t, std::shared_ptr<OpState>> posted_; // seq -> posted, not yet complete
  std::atomic<uint64_t> delegated_noted_{0};  // note_delegated_call()s so far
};

}  // namespace freescale

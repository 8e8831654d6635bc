#include "cpp/host_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <sstream>

#include "cpp/peer_liveness.h"
#include "cpp/root_cause.h"

namespace freescale {
namespace {

// What each rank announces during setup, one field per line.
struct Announcement {
  std::string error;     // non-empty: this rank could not create its segment
  std::string identity;  // host_identity()
  ProcessId process;
  std::string segment;   // shm name
  uint64_t slots_per_ring = 0;
  uint64_t slot_payload = 0;

  std::string encode() const {
    std::ostringstream out;
    out << error << '\n' << identity << '\n' << process.encode() << '\n' << segment << '\n' << slots_per_ring << '\n' << slot_payload << '\n';
    return out.str();
  }
  static Announcement decode(const std::string& blob, int from) {
    Announcement a;
    std::istringstream in(blob);
    std::string pid, slots, payload;
    if (!std::getline(in, a.error) || !std::getline(in, a.identity) || !std::getline(in, pid) ||
        !std::getline(in, a.segment) || !std::getline(in, slots) || !std::getline(in, payload)) {
      throw CommError(ErrorCode::kCommError, "host transport setup: malformed announcement from rank " +
                                                 std::to_string(from) + " (different freescale_comm versions?)");
    }
    a.process = ProcessId::decode(pid);
    a.slots_per_ring = std::stoull(slots);
    a.slot_payload = std::stoull(payload);
    return a;
  }
};

}  // namespace

HostTransport::HostTransport(Bootstrap& bootstrap, const Config& config, bool inline_payload, uint64_t slots_per_ring)
    : rank_(bootstrap.rank()),
      world_(bootstrap.size()),
      peers_(static_cast<size_t>(bootstrap.size())),
      filled_(static_cast<size_t>(bootstrap.size()), 0),
      taken_(static_cast<size_t>(bootstrap.size()), 0) {
  Announcement mine;
  mine.identity = host_identity();
  mine.process = this_process();
  mine.slot_payload = config.chunk_bytes;
  HostSegmentLayout layout{world_, rank_, 0, config.chunk_bytes, inline_payload};
  if (world_ > 1) {
    layout.slots_per_ring = slots_per_ring > 0 ? slots_per_ring
                                               : std::max<uint64_t>(2, config.arena_bytes / (layout.slot_stride() * (world_ - 1)));
  }
  mine.slots_per_ring = layout.slots_per_ring;
  try {
    peers_[rank_].segment = ShmSegment::create(layout.num_bytes());
    peers_[rank_].layout = layout;
    void* base = peers_[rank_].segment.data();
    RankControl* control = new (base) RankControl{};
    new (layout.received(base)) ReceivedWindow{};
    for (int p = 0; p < world_; ++p) new (layout.ring(base, p)) RingControl{};
    control->magic = kHostSegmentMagic;
    mine.segment = peers_[rank_].segment.name();
  } catch (const std::exception& e) {
    mine.error = e.what();  // announced, so every rank fails together instead of hanging
  }

  std::vector<std::string> blobs = bootstrap.allgather(mine.encode());
  std::vector<Announcement> all;
  for (int p = 0; p < world_; ++p) all.push_back(Announcement::decode(blobs[p], p));
  for (int p = 0; p < world_; ++p) {
    if (!all[p].error.empty()) {
      throw CommError(ErrorCode::kSystem, "host transport setup failed on rank " + std::to_string(p) + ": " + all[p].error);
    }
    if (all[p].identity != mine.identity) {
      throw CommError(ErrorCode::kUnsupported,
                      "the host transport needs every rank on one host (and PID namespace); rank " + std::to_string(p) +
                          " is on '" + all[p].identity + "', rank " + std::to_string(rank_) + " on '" + mine.identity +
                          "'. Use a gloo group for CPU tensors across hosts.");
    }
  }

  std::string attach_error;
  for (int p = 0; p < world_; ++p) {
    peers_[p].process = all[p].process;
    if (p == rank_) continue;
    // What a peer announces sizes the mapping of its segment: bound it before any arithmetic.
    if (all[p].slot_payload < 4096 || all[p].slot_payload > (1ull << 30) || all[p].slots_per_ring == 0 ||
        all[p].slots_per_ring > (Config::kMaxArenaBytes >> 12)) {
      if (attach_error.empty()) {  // reported through the allgather below: every rank fails together
        attach_error = "rank " + std::to_string(p) + " announced " + std::to_string(all[p].slots_per_ring) +
                       " slots of " + std::to_string(all[p].slot_payload) +
                       " bytes per ring, out of range (another freescale_comm build?)";
      }
      continue;
    }
    peers_[p].layout = HostSegmentLayout{world_, p, all[p].slots_per_ring, all[p].slot_payload, inline_payload};
    try {
      peers_[p].segment = ShmSegment::attach(all[p].segment, peers_[p].layout.num_bytes());
      if (peers_[p].control()->magic != kHostSegmentMagic) throw Error(ErrorCode::kSystem, "bad magic in " + all[p].segment);
    } catch (const std::exception& e) {
      if (attach_error.empty()) attach_error = "rank " + std::to_string(rank_) + " could not map rank " + std::to_string(p) + "'s segment: " + e.what();
    }
  }
  // Every rank has attached (or failed) once this returns: the names can go.
  std::vector<std::string> status = bootstrap.allgather(attach_error);
  peers_[rank_].segment.unlink();
  for (const auto& s : status) {
    if (!s.empty()) throw CommError(ErrorCode::kSystem, "host transport setup failed: " + s);
  }
}

HostTransport::~HostTransport() = default;

void HostTransport::ring_all() {
  for (int p = 0; p < world_; ++p) ring_peer(p);
}

void HostTransport::post(const std::shared_ptr<OpState>& op) {
  posted_[op->seq] = op;
  before_post(*op);
  peers_[rank_].layout.posted_kinds(peers_[rank_].segment.data())->entry[op->seq % kOpWindow].store(
      (op->seq + 1) << 8 | static_cast<uint64_t>(op->kind), std::memory_order_relaxed);  // published by posted_ops
  const PostedSizes sizes = peers_[rank_].layout.posted_sizes(peers_[rank_].segment.data(), op->seq);
  for (int p = 0; p < world_; ++p) {
    sizes.send(p).store(op->layout.send_bytes[p], std::memory_order_relaxed);
    sizes.recv(p).store(op->layout.recv_bytes[p], std::memory_order_relaxed);
  }
  sizes.tag().store(op->seq + 1, std::memory_order_relaxed);  // published by posted_ops
  peers_[rank_].control()->posted_ops.store(op->seq + 1, std::memory_order_release);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) ring_peer(p);
  }
}

bool HostTransport::can_send(const Transfer& t) const {
  if (t.peer == rank_) return true;
  const Peer& self = peers_[rank_];
  if (filled_[t.peer] - freed_slots(t.peer) >= self.layout.slots_per_ring) {
    return false;
  }
  if (peers_[t.peer].control()->posted_ops.load(std::memory_order_acquire) > t.op->seq) return true;
  // The peer has not posted this op yet. Sending anyway saves a round trip, and is safe when
  // every earlier op's bytes for that peer are out: then the ring's first unposted chunk belongs
  // to the lowest op the peer has yet to post, which its program order posts next.
  for (const auto& [seq, op] : posted_) {
    if (seq >= t.op->seq) break;
    if (!op->send_finished[t.peer]) return false;
  }
  return true;
}

void HostTransport::send_chunk(const Transfer& t, const Chunk& c) {
  SlotHeader header{};
  header.seq = t.op->seq;
  header.offset = c.offset;
  header.bytes = c.bytes;
  header.total = t.bytes;
  header.kind = static_cast<uint32_t>(t.op->kind);
  const OpState& op = *t.op;
  const uint64_t block_start = op.layout.send_offsets[t.peer];
  if (t.peer == rank_) {
    if (c.bytes == 0) {
      deliver(rank_, header, nullptr);  // the header of an empty block
      return;
    }
    // Straight from the send block into the recv block, one contiguous piece at a time.
    for_each_piece(op.send, block_start, op.layout.send_segments, t.peer, c.offset, c.bytes,
                   [&](const uint8_t* piece, uint64_t n) {
                     SlotHeader part = header;
                     part.bytes = n;
                     deliver(rank_, part, piece);
                     header.offset += n;
                   });
    return;
  }
  const Peer& self = peers_[rank_];
  if (c.bytes > self.layout.slot_payload) throw Error(ErrorCode::kInternal, "chunk larger than a ring slot");
  uint64_t index = filled_[t.peer]++;
  SlotHeader* slot = self.layout.slot(self.segment.data(), t.peer, index);
  *slot = header;
  fill_slot(t.peer, index, slot, op, c.offset, c.bytes);
}

void HostTransport::fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset,
                              uint64_t bytes) {
  read_block(op.send, op.layout.send_offsets[peer], op.layout.send_segments, peer, offset, bytes,
             HostSegmentLayout::payload(slot));
  ring_of(rank_, peer)->head.store(index + 1, std::memory_order_release);
  ring_peer(peer);
}

const uint8_t* HostTransport::slot_payload(int, uint64_t, SlotHeader* slot) const {
  return HostSegmentLayout::payload(slot);
}

void HostTransport::release_slot(int src, uint64_t index) {
  ring_of(src, rank_)->tail.store(index + 1, std::memory_order_release);
  ring_peer(src);  // room for the sender
}

void HostTransport::land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) {
  write_block(op.recv, op.layout.recv_offsets[src], op.layout.recv_segments, src, h.offset, payload, h.bytes);
  if (last) finish_recv(op, src);
}

void HostTransport::finish_recv(OpState& op, int src) {
  op.recv_finished[src] = 1;
  op.part_done();
  if (--op.recv_parts_left == 0) {
    // Everything for this op arrived and matched: tell every rank.
    peers_[rank_].layout.received(peers_[rank_].segment.data())->received[op.seq % kOpWindow].store(
        op.seq + 1, std::memory_order_release);
    ring_all();
  }
}

bool HostTransport::deliver(int src, const SlotHeader& h, const uint8_t* payload) {
  auto it = posted_.find(h.seq);
  if (it == posted_.end()) {
    throw CommError(ErrorCode::kCommError, "rank " + std::to_string(src) + " sent data for op #" + std::to_string(h.seq) +
                                               ", which rank " + std::to_string(rank_) +
                                               " has not posted (were collectives issued in a different order?)");
  }
  OpState& op = *it->second;
  const uint32_t mine = static_cast<uint32_t>(op.kind);
  if (!op_kinds_meet(h.kind, mine)) {
    // Who posted is read first: the kinds read next include all of theirs (a rank that posts in
    // between is seen by the next try).
    const bool all_posted = every_peer_posted(h.seq);
    const int odd = odd_rank_out(h.seq, src, h.kind);
    if (odd < 0 && world_ > 2 && !all_posted && Clock::now() < op.deadline) return false;  // their kinds will tell
    const std::string odd_one = odd >= 0 ? "; rank " + std::to_string(odd) + " is the odd one among the ranks that posted it" : "";
    throw CommError(ErrorCode::kCommError,
                    "op #" + std::to_string(h.seq) + ": rank " + std::to_string(rank_) + " runs " + op_kind_name(mine) +
                        " where rank " + std::to_string(src) + " runs " + op_kind_name(h.kind) + odd_one +
                        " (were collectives issued in a different order, or one skipped on a rank?)",
                    odd);
  }
  uint64_t expected = op.layout.recv_bytes[src];
  if (h.total != expected) {
    const bool all_posted = every_peer_posted(h.seq);  // (read before the sizes, as for the kinds above)
    const OddSizeRank odd = odd_size_rank_among_posted(h.seq);
    if (odd.rank < 0 && world_ > 2 && !all_posted && Clock::now() < op.deadline) return false;  // their sizes will tell
    const std::string theirs = h.kind == mine ? "" : " (its " + op_kind_name(h.kind) + ")";
    throw CommError(ErrorCode::kSizeMismatch,
                    op_kind_name(mine) + " op #" + std::to_string(h.seq) + ": rank " + std::to_string(rank_) +
                        " expected " + std::to_string(expected) + " bytes from rank " + std::to_string(src) +
                        ", which sends " + std::to_string(h.total) + " bytes" + theirs + odd_size_rank_words(odd, src) +
                        ": " + kSizesDisagree,
                    odd.rank >= 0 ? odd.rank : src);
  }
  // recv_done counts accepted bytes (landing may lag: recv_finished says when all landed).
  if (h.offset != op.recv_done[src] || h.bytes > expected - h.offset || op.recv_finished[src] ||
      (expected > 0 && op.recv_done[src] == expected)) {
    throw Error(ErrorCode::kInternal, "out-of-order chunk from rank " + std::to_string(src));
  }
  op.recv_done[src] += h.bytes;
  land(src, op, h, payload, op.recv_done[src] == expected);
  return true;
}

int HostTransport::odd_rank_out(uint64_t seq, int src, uint32_t theirs) const {
  const uint32_t mine = static_cast<uint32_t>(posted_.at(seq)->kind);
  std::vector<int> with_me{rank_}, with_them{src};
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || p == src || peer_posted(p) <= seq) continue;
    const uint64_t entry = peers_[p].layout.posted_kinds(peers_[p].segment.data())->entry[seq % kOpWindow].load(
        std::memory_order_relaxed);  // (read after posted_ops: acquire)
    if (entry >> 8 != seq + 1) continue;  // overwritten by a later op: this one completed there
    const uint32_t kind = static_cast<uint32_t>(entry & 0xff);
    if (op_kinds_meet(kind, mine)) {
      with_me.push_back(p);
    } else if (op_kinds_meet(kind, theirs)) {
      with_them.push_back(p);
    }
  }
  // The odd one is alone against at least two; a tie (two ranks, or as many each way) names none.
  if (with_me.size() == 1 && with_them.size() >= 2) return rank_;
  if (with_them.size() == 1 && with_me.size() >= 2) return src;
  return -1;
}

bool HostTransport::every_peer_posted(uint64_t seq) const {
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && peer_posted(p) <= seq) return false;
  }
  return true;
}

OddSizeRank HostTransport::odd_size_rank_among_posted(uint64_t seq) const {
  // Per rank that posted op `seq`: what it sends to and expects from each rank (ours from the op).
  std::vector<std::vector<uint64_t>> send(world_), recv(world_);
  const OpState& op = *posted_.at(seq);
  send[rank_] = op.layout.send_bytes;
  recv[rank_] = op.layout.recv_bytes;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || peer_posted(p) <= seq) continue;
    const PostedSizes sizes = peers_[p].layout.posted_sizes(peers_[p].segment.data(), seq);
    if (sizes.tag().load(std::memory_order_relaxed) != seq + 1) continue;  // (read after posted_ops: acquire)
    for (int q = 0; q < world_; ++q) {
      send[p].push_back(sizes.send(q).load(std::memory_order_relaxed));
      recv[p].push_back(sizes.recv(q).load(std::memory_order_relaxed));
    }
  }
  return odd_size_rank(send, recv);
}

bool HostTransport::confirm_received() {
  bool any = false;
  for (auto& [seq, op] : posted_) {
    if (op->confirmed || op->recv_parts_left > 0) continue;
    bool all = true;
    for (int p = 0; p < world_ && all; ++p) all = peers_[p].received(seq);
    if (!all || !sends_settled(*op)) continue;
    op->confirmed = true;
    op->part_done();
    any = true;
  }
  return any;
}

bool HostTransport::drain_from(int src) {
  const Peer& peer = peers_[src];
  uint64_t& tail = taken_[src];
  uint64_t head = written_slots(src);
  uint64_t posted = peers_[rank_].control()->posted_ops.load(std::memory_order_relaxed);
  uint64_t first = tail;
  for (; tail < head; ++tail) {
    SlotHeader* slot = peer.layout.slot(peer.segment.data(), rank_, tail);
    SlotHeader h;
    std::memcpy(&h, slot, sizeof h);  // read once: the peer can rewrite its shared memory at any time
    if (h.seq >= posted) break;  // sent ahead of our post: it waits for our program order
    if (h.bytes > peer.layout.slot_payload) {
      throw CommError(ErrorCode::kCommError,
                      "rank " + std::to_string(src) + " wrote a chunk header claiming " + std::to_string(h.bytes) +
                          " bytes into a slot of " + std::to_string(peer.layout.slot_payload) +
                          ": its shared memory is corrupt (or it runs another freescale_comm build)");
    }
    if (!can_land(src, h.bytes)) break;  // the data path is full: it waits in its slot
    if (!deliver(src, h, slot_payload(src, tail, slot))) break;  // waits in its slot (deliver says why)
    release_slot(src, tail);
  }
  return tail != first;
}

void HostTransport::forget_completed() {
  for (auto it = posted_.begin(); it != posted_.end();) {
    it = it->second->is_completed() ? posted_.erase(it) : std::next(it);
  }
}

bool HostTransport::poll() {
  bool moved = false;
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) moved |= drain_from(p);
  }
  moved |= confirm_received();
  forget_completed();
  return moved;
}

uint64_t HostTransport::peer_posted(int p) const {
  return peers_[p].control()->posted_ops.load(std::memory_order_acquire);
}

Registration* HostTransport::registration_of(int owner, int index) const {
  return peers_[owner].layout.registration(peers_[owner].segment.data(), index);
}

RecvTarget* HostTransport::recv_target_of(int owner, uint64_t seq, int src) const {
  return peers_[owner].layout.recv_target(peers_[owner].segment.data(), seq, src);
}

bool HostTransport::peer_gone(int p) const {
  if (p == rank_) return false;
  return !process_alive(peers_[p].process) ||
         peers_[p].control()->state.load(std::memory_order_acquire) == kRankAborted;
}

uint64_t HostTransport::note_delegated_call(const std::string& text) {
  const uint64_t n = delegated_noted_.fetch_add(1, std::memory_order_relaxed);
  DelegatedCall& entry = peers_[rank_].layout.delegated_calls(peers_[rank_].segment.data())->entry[n % kOpWindow];
  uint64_t words[kCallTextWords] = {};
  std::memcpy(words, text.data(), std::min(text.size(), sizeof words - 1));  // (the last byte stays NUL)
  entry.tag.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // a reader that sees new text sees tag 0 after it
  for (size_t i = 0; i < kCallTextWords; ++i) entry.text[i].store(words[i], std::memory_order_relaxed);
  entry.tag.store(n + 1, std::memory_order_release);
  return n;
}

std::vector<std::string> HostTransport::delegated_calls(uint64_t n) const {
  std::vector<std::string> calls(world_);
  for (int p = 0; p < world_; ++p) {
    const DelegatedCall& entry = peers_[p].layout.delegated_calls(peers_[p].segment.data())->entry[n % kOpWindow];
    if (entry.tag.load(std::memory_order_acquire) != n + 1) continue;
    uint64_t words[kCallTextWords];
    for (size_t i = 0; i < kCallTextWords; ++i) words[i] = entry.text[i].load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (entry.tag.load(std::memory_order_relaxed) != n + 1) continue;  // rewritten while read
    const char* text = reinterpret_cast<const char*>(words);
    calls[p].assign(text, strnlen(text, sizeof words));
  }
  return calls;
}

std::vector<PeerSight> HostTransport::peer_sight() const {
  // Liveness first, notices second (root_cause.h): a peer seen dead has its notice in view.
  std::vector<PeerSight> sight(static_cast<size_t>(world_));
  for (int p = 0; p < world_; ++p) sight[p].died = p != rank_ && !process_alive(peers_[p].process);
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const RankControl* control = peers_[p].control();
    const uint32_t state = control->state.load(std::memory_order_acquire);
    sight[p].closed = state == kRankClosed;
    sight[p].aborted = state == kRankAborted;
    sight[p].left = sight[p].aborted && control->left.load(std::memory_order_acquire) != 0;
    if (sight[p].aborted) {
      sight[p].code = static_cast<ErrorCode>(control->abort_code.load());
      sight[p].culprit = control->abort_culprit.load();
      // Written before the state (release, read above with acquire), never again.
      char why[kAbortWhyBytes];
      std::memcpy(why, peers_[p].layout.abort_notice(peers_[p].segment.data())->why, sizeof why);
      why[sizeof why - 1] = '\0';
      sight[p].why = why;
    }
  }
  return sight;
}

void HostTransport::check_peers() {
  std::vector<PeerSight> sight = peer_sight();
  for (int p = 0; p < world_; ++p) {
    if (sight[p].died || sight[p].closed) {
      drain_from(p);  // what it sent before leaving is still valid
      confirm_received();
      forget_completed();
    }
  }
  for (const auto& [seq, op] : posted_) {
    for (int p = 0; p < world_; ++p) sight[p].needed |= op->needs_peer(p);
  }
  throw_root_cause(find_root_cause(sight, rank_), rank_, [this](int r) { return peers_[r].process.pid; });
}

uint32_t HostTransport::activity_epoch() const {
  return peers_[rank_].control()->doorbell.counter.load(std::memory_order_seq_cst);
}

void HostTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  peers_[rank_].control()->doorbell.wait(epoch, timeout);
}

void HostTransport::wake() { peers_[rank_].control()->doorbell.ring(); }

void HostTransport::abort(ErrorCode code, int culprit, const std::string& why) {
  RankControl* control = peers_[rank_].control();
  if (control->state.load(std::memory_order_relaxed) == kRankAborted) return;  // the first notice stays (peers read it)
  AbortNotice* notice = peers_[rank_].layout.abort_notice(peers_[rank_].segment.data());
  const size_t n = std::min(why.size(), kAbortWhyBytes - 1);
  std::memcpy(notice->why, why.data(), n);
  notice->why[n] = '\0';
  control->abort_code.store(static_cast<int32_t>(code));
  control->abort_culprit.store(culprit);
  control->state.store(kRankAborted, std::memory_order_release);
  ring_all();
}

void HostTransport::leave() {
  peers_[rank_].control()->left.store(1, std::memory_order_release);
  ring_all();
}

void HostTransport::close() {
  RankControl* control = peers_[rank_].control();
  uint32_t running = kRankRunning;
  control->state.compare_exchange_strong(running, kRankClosed);
  ring_all();
}

}  // namespace freescale

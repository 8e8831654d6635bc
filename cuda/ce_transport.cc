// The copy-engine transport. The control plane is the host transport's (rings of slot headers in
// a shared host segment, posted / received counters, doorbells, liveness); payloads move through
// each rank's device arena (CeArenaLayout, shared with peers by IPC handles), whose rings have
// exactly the host rings' number of slots. Per chunk n of a ring, slot k = n % S:
//
//   sender's lane:    [wait tail >= n + 1 - S]  copy input piece(s) -> own arena slot k;  write head = n + 1
//   sender's host:    head_enqueued = n + 1 once that is enqueued
//   receiver's host sees head_enqueued, reads the header, then on its lane:
//                     [wait head >= n + 1]  copy peer's arena slot k -> output piece(s);  write tail = n + 1
//   receiver's host:  tail_enqueued = n + 1 once that is enqueued
//
// So the CPU runs ahead of the device: each host acts on what its peers enqueued, not on what
// landed, and Work.wait() returns once this rank's copies of the op are enqueued (up to a window
// ahead of the engines), as with NCCL. Every device-side wait is on a counter whose write the
// peer enqueued before it said so: work CUDA sees ordered before the wait (design.md §4), so no
// hardware queue, shared or not, can hold a write behind a wait that needs it. Heads and tails
// live in the host segments (registered, device-mapped), written by the device with stream
// memory operations. A wait on a counter already written is not enqueued. A peer that dies or
// aborts never writes what it enqueued: quiesce() writes those counters from the host (the CPU,
// unlike a stream, is never behind the wait), so a failed op ends on the device too.
//
// Lanes are comm streams, each serving a group of peers (so copies to different peers keep
// several copy engines busy). A progress round's work on a lane goes to the device at once, at
// the end of the round: the waits, one copy batch, one counter write per ring it moved, one
// event (a "flush"), so driver calls grow with rounds and peers, not with chunks; a lane still
// running earlier flushes holds its round until it has a quarter window or closes a part.
// Events for flushes and completions come from a pool made at setup: creating one can block
// while a stream wait runs.
//
// Priority reaches the engines through a window (Config::arena_bytes): a rank keeps at most that
// many bytes in its rings (written, not yet freed by the receiver) and at most that many bytes
// of copies enqueued on its lanes and not yet executed; a ring or lane with nothing in flight may
// always take one chunk. So an urgent chunk, which the scheduler hands over first, waits behind
// at most one window at the sender and one at the receiver, not behind every slot of every ring.
//
// An op is posted (its first copy may start, peers may send to it) once its submitter's stream
// passed its submission, and Work.wait() is a stream wait on an event after its last copy on
// every lane (both: SubmitGate). A receive part finishes when the flush holding its last copy ran.
#include "cuda/ce_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cpp/ce_arena_layout.h"
#include "cpp/fd_passing.h"
#include "cpp/host_transport.h"
#include "cpp/segment_map.h"
#include "cuda/device_util.h"
#include "cuda/submit_gate.h"

namespace freescale {
namespace {

constexpr std::chrono::microseconds kPollWhileBusy{50};  // device writes ring no doorbell: poll
constexpr const char* kUnsupportedMark = "unsupported: ";  // an announced setup error that is a refusal

// Who executes this transport's copies (design.md §4). Each chunk is copied into the sender's own
// arena slot and a rank's block to itself lands directly: copies within one device, which run as
// SM kernels unless the batch API carries cudaMemcpyFlagPreferOverlapWithCompute to a 13.1+
// driver (NCCL's ce_coll.cc: honored for intra-device copies only from CUDA 13.1); so do copies
// between ranks that share one GPU. Copies from a peer GPU's arena run on copy engines.
std::string ce_data_path(int driver_version, bool batch_copies) {
  const std::string driver = "driver " + driver_version_text(driver_version);
  const std::string registered =
      "; receive blocks in a buffer registered with Communicator.register_buffer are written by the sender "
      "directly, one copy from its input (on a copy engine to another GPU): no arena slot, no copy within a device "
      "but the self block";
  const std::string counters = registered +
      "; ring counters by stream memory writes and waits on counters peers already enqueued; Work.wait() returns "
      "to the CPU once this rank's last copy of the op is enqueued, up to a window ahead of the copies (none need "
      "to have run)";
  if (!batch_copies) {
    return "ce (" + driver + "): SM kernels for copies within a device (each chunk into this rank's arena slot, "
           "the block a rank sends itself, copies between ranks on one GPU): the driver refused cudaMemcpyBatchAsync, "
           "so copies go one by one through cudaMemcpyAsync; copies from peer GPUs' arenas on copy engines" + counters;
  }
  if (!copies_within_a_device_on_copy_engines(driver_version, batch_copies)) {
    return "ce (" + driver + "): SM kernels for copies within a device (each chunk into this rank's arena slot, "
           "the block a rank sends itself, copies between ranks on one GPU): drivers before 13.1 ignore "
           "cudaMemcpyFlagPreferOverlapWithCompute for them; copies from peer GPUs' arenas on copy engines "
           "(cudaMemcpyBatchAsync)" + counters;
  }
  return "ce (" + driver + "): no SM kernels: every copy on copy engines (cudaMemcpyBatchAsync with "
         "cudaMemcpyFlagPreferOverlapWithCompute, honored within a device from 13.1)" + counters;
}

constexpr int kMaxLanes = 4;  // comm streams per rank: peers spread over them
// Events made at setup for flushes and ops' completions. Enough for 64 ops in flight and dozens
// of flushes per lane; when all are taken a lane's round waits for a flush to retire (flushes
// only wait on device work already enqueued, so one always does).
constexpr size_t kPooledEvents = 256;
// quiesce() waits at most this long (or the op timeout, if shorter) for lanes that wait on a live
// peer's counters before it leaves them waiting: a failure is reported within it.
constexpr std::chrono::milliseconds kQuiesceAtMost{10000};

class CeTransport final : public HostTransport {
 public:
  CeTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops);
  ~CeTransport() override;

  const char* name() const override { return "ce"; }
  std::string data_path() const override { return ce_data_path(driver_version_, ops_.batch_copies()); }
  uintptr_t mark_submission(uintptr_t stream) override { return gate_.mark(stream); }
  void on_submit(OpState& op, uintptr_t mark) override { gate_.on_submit(op, mark); }
  void discard_submission(uintptr_t mark) override { gate_.give_event(mark); }
  bool stream_wait(const OpState& op, uintptr_t stream, std::chrono::microseconds timeout) override {
    return gate_.stream_wait(op, stream, timeout);
  }
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  // In a ProgressScope, as every entry point of ours: sending may open a peer's registration.
  void send_chunk(const Transfer& t, const Chunk& c) override {
    ProgressScope scope(ops_, device_);
    HostTransport::send_chunk(t, c);
  }
  // A whole window per round: sends only queue copies until the round's flush.
  int chunks_per_send_round() const override {
    return static_cast<int>(std::max<uint64_t>(8, window_bytes_ / arenas_[rank_].slot_bytes));
  }
  bool poll() override;
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  // Peers, and this device: an asynchronous fault (anywhere in the context) surfaces at the next
  // query of a comm stream, also when no event of ours is pending to report it.
  void check_peers() override;
  // The lanes hold copies and counter writes only, the join stream waits on lanes' events: all drain.
  void quiesce() override;
  bool device_work_abandoned() const override { return stuck_ || peer_writes_abandoned_; }

 protected:
  void fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset, uint64_t bytes) override;
  const uint8_t* slot_payload(int src, uint64_t index, SlotHeader* slot) const override;
  void release_slot(int src, uint64_t index) override;
  void land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) override;
  bool can_land(int src, uint64_t bytes) override;
  bool sends_settled(const OpState& op) override;
  void before_post(const OpState& op) override;
  int register_buffer(void* ptr, uint64_t bytes) override;
  // The host runs ahead of the device: it acts on what peers enqueued, and its lanes wait on the
  // device for the counters themselves.
  uint64_t written_slots(int src) const override {
    return ring_of(src, rank_)->head_enqueued.load(std::memory_order_acquire);
  }
  uint64_t freed_slots(int peer) const override {
    return ring_of(rank_, peer)->tail_enqueued.load(std::memory_order_acquire);
  }

 private:
  using Part = std::pair<uint64_t, int>;  // a receive part: (op seq, source rank)
  // A comm stream and the work of this round not yet given to it.
  struct Lane {
    Stream stream = 0;
    // This round's work, enqueued by flush(): waits for the device counters (peers' heads and
    // tails) the round's copies depend on, the copies, then each counter's last value.
    using Counters = std::map<const std::atomic<uint64_t>*, std::pair<int, uint64_t>>;  // -> (segment owner, value)
    struct Wait {
      int owner;   // whose control segment holds the counter
      int writer;  // whose device writes it
      uint64_t value;
    };
    std::map<const std::atomic<uint64_t>*, Wait> waits;
    CopyBatch copies;
    Counters counters;
    // After the flush, the host tells peers what it enqueued: (word, value, peer to wake).
    std::vector<std::tuple<std::atomic<uint64_t>*, uint64_t, int>> publish;
    std::vector<Part> finishing;  // parts whose last copy is in `copies`
    uint64_t pending_bytes = 0;
    bool closes_part = false;  // `copies` holds the last chunk of a send or receive part
    struct Flush {
      Event event;  // recorded after the flush's work
      uint64_t bytes;
      std::vector<Part> finishing;
    };
    std::deque<Flush> in_flight;  // enqueued, not known to have run; stream order
    uint64_t in_flight_bytes = 0;
    uint64_t flushes = 0;  // flushes enqueued so far (this round's will be number flushes + 1)
    uint64_t retired = 0;  // flushes known to have run (the first `retired` of them)
    uint64_t outstanding() const { return in_flight_bytes + pending_bytes; }
    // This round's copies wait until `counter` >= value (the highest asked for).
    void await(const std::atomic<uint64_t>* counter, int owner, int writer, uint64_t value) {
      Wait& w = waits.try_emplace(counter, Wait{owner, writer, 0}).first->second;
      w.value = std::max(w.value, value);
    }
  };

  // Collective over `bootstrap`: device resources, then the arenas' exchange. Throws (on every
  // rank alike) if any rank failed or refused.
  void setup(Bootstrap& bootstrap, const Config& config);
  // Frees what setup made (best effort, never throws); the streams drain first.
  void release() noexcept;
  // Posts to the host control plane (in program order) the ops whose submitter's stream passed
  // their submission (SubmitGate).
  bool post_ready_ops();
  Lane& lane_of(int peer) { return lanes_[static_cast<size_t>(lane_index(peer))]; }
  int lane_index(int peer) const {
    return peer == rank_ ? 0 : (peer < rank_ ? peer : peer - 1) % static_cast<int>(lanes_.size());
  }
  // Where our chunk of op for `peer` may go straight into the peer's registered receive buffer
  // (the peer posted the op, its block from us lies in one of its registrations): the chunk's
  // first byte there, or null (it goes through our arena).
  uint8_t* direct_target(int peer, const OpState& op, uint64_t offset);
  // The device address of a counter in `owner`'s control segment.
  DevicePtr device_address(const std::atomic<uint64_t>* counter, int owner) const {
    auto offset = reinterpret_cast<const char*>(counter) - static_cast<const char*>(segment_base(owner));
    return segment_device_[owner] + static_cast<DevicePtr>(offset);
  }
  // Ends, from the host, the lanes' waits on counters that no device will write any more (a
  // peer that died or aborted): each gets the highest value awaited. Never for a live peer: our
  // lane would then overwrite a slot it may still be reading.
  void release_waits();
  // Queues op's copies `batch` on `lane` for this round's flush.
  void add_copies(int lane, const OpState& op, const CopyBatch& batch);
  // Bytes of copies enqueued on all lanes (or about to be) and not yet executed.
  uint64_t device_outstanding() const;
  // Enqueues each lane's round of work: copies, counter writes, an event. True if any.
  // A lane's round is held back, to go with the next one, while its earlier flushes still run,
  // it is under flush_bytes_ and closes no part (an op waits on its last chunks): so a busy
  // engine gets a batch per quarter window, not per round, and an idle one never waits.
  bool flush();
  // Retires the flushes that ran, in order, finishing the receive parts they held. True if any.
  bool retire_flushes();
  // Records, for each posted op whose every copy on this rank is now enqueued (every send
  // chunk filled, every receive chunk landing, flushed), an event on the join stream after them
  // for callers' streams to wait on (SubmitGate::all_enqueued). True if any.
  bool mark_all_enqueued();

  DeviceOps& ops_;
  int device_;
  int driver_version_ = 0;  // cudaDriverGetVersion, read at setup
  uint64_t window_bytes_;   // Config::arena_bytes: in flight in our rings, and on our lanes
  uint64_t flush_bytes_;    // a busy lane's batch: a quarter window
  std::chrono::milliseconds timeout_;  // Config::timeout_ms: how long quiesce() waits for the lanes
  std::vector<Lane> lanes_;  // [min(kMaxLanes, world - 1), at least 1]: every copy and counter write
  Stream join_ = 0;          // waits on lanes' flushes; ops' completion events are recorded here
  std::vector<CeArenaLayout> arenas_;  // [world] each rank's arena layout
  std::vector<uint8_t*> arena_ptr_;    // [world] mapped base of each rank's arena (ours: own)
  std::vector<void*> registered_;      // host segments registered with the device
  std::vector<DevicePtr> segment_device_;  // [world] device address of each control segment
  SubmitGate gate_;                    // callers' streams: start gate, events, completion flags
  // seq -> [lane] number of the last flush holding the op's copies (0: none). Progress thread only.
  std::unordered_map<uint64_t, std::vector<uint64_t>> op_flushes_;
  std::unordered_set<uint64_t> enqueued_;  // posted ops whose copies are all enqueued. Progress thread only.
  // Counter -> the highest value a lane was made to wait for (release_waits). Progress thread only.
  std::map<const std::atomic<uint64_t>*, std::pair<int, uint64_t>> awaited_;  // -> (writer's rank, value)
  // quiesce() left a lane waiting: what it may still touch is never freed (its segments, arenas,
  // streams; the failed ops' buffers: device_work_abandoned). Written by quiesce(), read anywhere.
  std::atomic<bool> stuck_{false};
  // quiesce() stopped waiting for a live peer's copies into our registered buffers.
  std::atomic<bool> peer_writes_abandoned_{false};
  // Our registered buffers (register_buffer: any thread; before_post: progress thread).
  struct Registered {
    uint8_t* ptr;
    uint64_t bytes;
  };
  std::mutex registered_mu_;
  std::vector<Registered> registered_buffers_;
  // Progress thread only: peers' registrations mapped here, (peer, index) -> the buffer's start,
  // and the allocations opened for them, IPC handle -> mapped base (each opened once).
  std::map<std::pair<int, int>, uint8_t*> peer_buffers_;
  std::map<std::string, uint8_t*> opened_allocations_;  // (null: could not be opened here)
};

CeTransport::CeTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops)
    : HostTransport(bootstrap, config, /*inline_payload=*/false,
                    CeArenaLayout::plan(bootstrap.size(), bootstrap.rank(), config.chunk_bytes, config.arena_bytes)
                        .slots_per_ring),
      ops_(ops),
      device_(config.cuda_device),
      window_bytes_(config.arena_bytes),
      flush_bytes_(config.arena_bytes / 4),
      timeout_(config.timeout_ms > 0 ? std::chrono::milliseconds(static_cast<int64_t>(config.timeout_ms)) : kQuiesceAtMost),
      lanes_(static_cast<size_t>(std::clamp(bootstrap.size() - 1, 1, kMaxLanes))),
      arenas_(static_cast<size_t>(world_)),
      arena_ptr_(static_cast<size_t>(world_), nullptr),
      gate_(ops, device_) {
  try {
    setup(bootstrap, config);
  } catch (...) {
    release();  // the destructor does not run for a constructor that throws
    throw;
  }
}

void CeTransport::setup(Bootstrap& bootstrap, const Config& config) {
  // Local setup; a failure is announced so that every rank fails together instead of hanging.
  std::string error, handle;
  OwnedFd arena_fd;  // our arena's exported descriptor, until peers have theirs
  CeArenaLayout mine = CeArenaLayout::plan(world_, rank_, config.chunk_bytes, config.arena_bytes);
  std::optional<ProgressScope> guard;  // the caller's device comes back when setup ends
  try {
    guard.emplace(ops_, device_);
    // What the data path needs, checked before anything is made: counters written by the device
    // with 64-bit stream memory operations into registered, mapped host segments.
    // And arenas in memory that outlives its owner for peers (cuMem with POSIX handles): a peer's
    // copies from an arena whose owner freed it or died read stale bytes of a failed op, where
    // legacy IPC memory would be gone and fault the copying rank's whole context.
    std::string missing = missing_capability(ops_, device_, "ce",
                                             {DeviceAttribute::kCanUse64BitStreamMemOps, DeviceAttribute::kCanMapHostMemory,
                                              DeviceAttribute::kHostRegisterSupported, DeviceAttribute::kUnifiedAddressing,
                                              DeviceAttribute::kVirtualMemoryManagement, DeviceAttribute::kPosixFdHandles});
    if (!missing.empty()) throw Error(ErrorCode::kUnsupported, missing);
    driver_version_ = ops_.driver_version();
    for (Lane& lane : lanes_) lane.stream = ops_.create_stream();
    join_ = ops_.create_stream();
    gate_.reserve(kPooledEvents);  // flushes and completions take only these (flush())
    if (mine.num_bytes() > 0) {
      arena_ptr_[rank_] = static_cast<uint8_t*>(ops_.shareable_alloc(mine.num_bytes(), &arena_fd.fd));
      handle = "fd";  // passed below (exchange_fds)
    }
    for (int p = 0; p < world_; ++p) {  // counters the device writes: our heads, peers' tails
      segment_device_.push_back(ops_.host_register(segment_base(p), segment_bytes(p)));
      registered_.push_back(segment_base(p));
    }
  } catch (const Error& e) {
    error = (e.code() == ErrorCode::kUnsupported ? kUnsupportedMark : "") + e.message();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::string blob = error + "\n" + std::to_string(mine.slots_per_ring) + "\n" + std::to_string(mine.slot_bytes) + "\n" + handle;
  std::vector<std::string> all = bootstrap.allgather(blob);
  std::string open_error;
  for (int p = 0; p < world_; ++p) {
    std::vector<std::string> f;
    size_t start = 0;
    for (int i = 0; i < 3; ++i) {
      size_t nl = all[p].find('\n', start);
      if (nl == std::string::npos) throw Error(ErrorCode::kCommError, "ce transport setup: malformed announcement");
      f.push_back(all[p].substr(start, nl - start));
      start = nl + 1;
    }
    f.push_back(all[p].substr(start));
    if (f[0].rfind(kUnsupportedMark, 0) == 0) {  // every rank refuses: the backend falls back to NCCL
      throw Error(ErrorCode::kUnsupported, "ce transport refused on rank " + std::to_string(p) + ": " +
                                               f[0].substr(std::string(kUnsupportedMark).size()));
    }
    if (!f[0].empty()) throw CommError(ErrorCode::kSystem, "ce transport setup failed on rank " + std::to_string(p) + ": " + f[0]);
    arenas_[p] = CeArenaLayout{world_, p, std::stoull(f[1]), std::stoull(f[2])};
  }
  // Every rank got here (announcements agree): pass the arenas' descriptors, then map them.
  std::vector<int> fds;
  try {
    fds = exchange_fds(bootstrap, arena_fd.fd);
  } catch (const CommError&) {  // the bootstrap failed (a peer died...): not a refusal
    throw;
  } catch (const Error& e) {  // every rank throws alike
    throw Error(ErrorCode::kUnsupported, "ce transport: the ranks could not pass their arenas' file descriptors (" +
                                             e.message() + "); they must share a host and a network namespace");
  }
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || fds[p] < 0 || !open_error.empty()) continue;
    try {
      arena_ptr_[p] = static_cast<uint8_t*>(ops_.shareable_import(fds[p], arenas_[p].num_bytes()));
    } catch (const std::exception& e) {
      open_error = "rank " + std::to_string(rank_) + " could not map rank " + std::to_string(p) + "'s arena: " + e.what();
    }
  }
  for (int f : fds)
    if (f >= 0) ::close(f);
  // Mapping a peer GPU's memory needs peer access to it: where a rank cannot, every rank refuses
  // alike (kUnsupported: the backend falls back to NCCL).
  const std::vector<std::string> open_errors = bootstrap.allgather(open_error);
  for (const auto& e : open_errors) {
    if (!e.empty()) throw Error(ErrorCode::kUnsupported, "ce transport refused: " + e + " (GPUs without peer access?)");
  }

}

CeTransport::~CeTransport() { release(); }

void CeTransport::release() noexcept {
  // Best effort, never throws. The lanes hold copies and counter writes only, the join stream
  // waits on lanes' events: they drain; they must, before the segments and arenas their work
  // touches go away.
  ProgressScope guard(ops_, device_, std::nothrow);
  auto quietly = [](auto&& fn) {
    try {
      fn();
    } catch (...) {
    }
  };
  quiesce();
  if (stuck_) {  // a lane may still copy from or to the arenas and write the counters: keep all,
    leak_segments();  // the control segments too (registered, and the counters live there)
    return;
  }
  for (Lane& lane : lanes_) {
    for (const Lane::Flush& f : lane.in_flight) quietly([&] { ops_.destroy_event(f.event); });
    lane.in_flight.clear();
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && arena_ptr_[p] != nullptr) quietly([&] { ops_.shareable_release(arena_ptr_[p]); });
  }
  for (const auto& [handle, base] : opened_allocations_) {
    if (base != nullptr) quietly([&, base = base] { ops_.ipc_close(base); });
  }
  opened_allocations_.clear();
  peer_buffers_.clear();
  // Our reference only: a peer still copying from it keeps the pages (shareable memory).
  if (arena_ptr_[rank_] != nullptr) quietly([&] { ops_.shareable_release(arena_ptr_[rank_]); });
  for (void* base : registered_) quietly([&] { ops_.host_unregister(base); });
  for (Lane& lane : lanes_) {
    if (lane.stream != 0) quietly([&] { ops_.destroy_stream(lane.stream); });
    lane.stream = 0;
  }
  if (join_ != 0) quietly([&] { ops_.destroy_stream(join_); });
  join_ = 0;
  std::fill(arena_ptr_.begin(), arena_ptr_.end(), nullptr);
  registered_.clear();
}

void CeTransport::release_waits() {
  for (const auto& [counter, awaited] : awaited_) {
    if (!peer_gone(awaited.first)) continue;
    auto* word = const_cast<std::atomic<uint64_t>*>(counter);
    uint64_t now = word->load(std::memory_order_acquire);
    while (now < awaited.second && !word->compare_exchange_weak(now, awaited.second)) {
    }
  }
}

void CeTransport::quiesce() {
  ProgressScope guard(ops_, device_, std::nothrow);
  // Lanes wait only on counters whose writes peers had enqueued: they run out, but for a peer
  // that died or aborted, whose device writes nothing more; the host writes those counters.
  // A lane still waiting after the timeout (a peer that lies about what it enqueued) is left
  // as it is, and what it may touch is never freed.
  if (stuck_) return;  // an earlier call gave up on a lane already
  const auto deadline = std::chrono::steady_clock::now() + std::min(timeout_, kQuiesceAtMost);
  std::vector<Stream> streams{join_};
  for (const Lane& lane : lanes_) streams.push_back(lane.stream);
  if (!drain_streams(ops_, streams, deadline, nullptr, [this] { release_waits(); }).empty()) stuck_ = true;
  // Chunks peers copy straight into our registered buffers: each is followed on the peer's lane
  // by its head write, so our buffers are the callers' again once every live peer's head reached
  // what it enqueued.
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const RingControl* ring = ring_of(p, rank_);
    auto behind = [&] {
      return !peer_gone(p) && ring->head.load(std::memory_order_acquire) < ring->head_enqueued.load(std::memory_order_acquire);
    };
    while (behind() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (behind()) peer_writes_abandoned_ = true;
  }
  if (stuck_) gate_.leak();  // a waiting lane's flush events, and the join stream's, stay valid
}

void CeTransport::post(const std::shared_ptr<OpState>& op) {
  ProgressScope scope(ops_, device_);
  gate_.post(op);
  post_ready_ops();
}

bool CeTransport::post_ready_ops() {
  return gate_.start_ready([this](const std::shared_ptr<OpState>& op) { HostTransport::post(op); });
}

uint64_t CeTransport::device_outstanding() const {
  uint64_t bytes = 0;
  for (const Lane& lane : lanes_) bytes += lane.outstanding();
  return bytes;
}

bool CeTransport::can_send(const Transfer& t) const {
  if (!gate_.started(*t.op) || !HostTransport::can_send(t)) return false;
  if (t.peer == rank_) {  // the self block: copies on lane 0 only
    return lanes_[0].outstanding() == 0 || device_outstanding() + arenas_[rank_].slot_bytes <= window_bytes_;
  }
  // A peer with registered buffers may receive this op in one: wait for its post, which says,
  // rather than send ahead through our arena (a copy within our GPU).
  if (peer_posted(t.peer) <= t.op->seq && registration_of(t.peer, 0)->ready.load(std::memory_order_acquire) == 1) {
    return false;
  }
  // The window, over our rings and over our lanes. An empty ring may always take one chunk: a
  // peer that has not posted the op our other rings are full of still gets its bytes.
  if (slots_in_flight(t.peer) == 0) return true;
  const uint64_t chunk = arenas_[rank_].slot_bytes;
  uint64_t in_rings = 0;
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) in_rings += slots_in_flight(p);
  }
  return (in_rings + 1) * chunk <= window_bytes_ && device_outstanding() + chunk <= window_bytes_;
}

bool CeTransport::can_land(int src, uint64_t bytes) {
  const Lane& lane = lanes_[static_cast<size_t>(lane_index(src))];
  return lane.outstanding() == 0 || device_outstanding() + bytes <= window_bytes_;
}

void CeTransport::add_copies(int lane_index, const OpState& op, const CopyBatch& batch) {
  Lane& lane = lanes_[static_cast<size_t>(lane_index)];
  for (size_t i = 0; i < batch.dsts.size(); ++i) {
    lane.copies.add(batch.dsts[i], batch.srcs[i], batch.sizes[i]);
    lane.pending_bytes += batch.sizes[i];
  }
  auto& last = op_flushes_.try_emplace(op.seq, lanes_.size(), 0).first->second;
  last[static_cast<size_t>(lane_index)] = lane.flushes + 1;
}

int CeTransport::register_buffer(void* ptr, uint64_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "register_buffer: ptr and bytes must describe a device buffer (got " +
                                              std::string(ptr == nullptr ? "a null pointer" : "0 bytes") + ")");
  }
  ProgressScope guard(ops_, device_);
  size_t allocation_bytes = 0;
  uint8_t* base = nullptr;
  try {
    base = static_cast<uint8_t*>(ops_.allocation_base(ptr, &allocation_bytes));
  } catch (const Error& e) {
    throw Error(ErrorCode::kInvalidArgument, "register_buffer: ptr is not in a device allocation of cuda:" +
                                              std::to_string(device_) + " (" + e.message() + ")");
  }
  const uint64_t offset = static_cast<uint64_t>(static_cast<uint8_t*>(ptr) - base);
  if (offset + bytes > allocation_bytes) {
    throw Error(ErrorCode::kInvalidArgument, "register_buffer: the buffer runs " +
                                              std::to_string(offset + bytes - allocation_bytes) +
                                              " bytes past the end of its device allocation");
  }
  std::string handle;
  try {
    handle = ops_.ipc_handle(base);
  } catch (const Error& e) {
    throw Error(ErrorCode::kUnsupported,
                "register_buffer: CUDA cannot share this buffer's allocation with other processes (" + e.message() +
                    "); PyTorch's expandable_segments and cudaMallocAsync allocations cannot be: allocate it "
                    "with the default caching allocator");
  }
  std::lock_guard<std::mutex> lock(registered_mu_);
  const int index = static_cast<int>(registered_buffers_.size());
  if (index >= kMaxRegistrations) {
    throw Error(ErrorCode::kInvalidUsage, "register_buffer: at most " + std::to_string(kMaxRegistrations) +
                                              " buffers per communicator; register one buffer that holds the others");
  }
  Registration* entry = registration_of(rank_, index);
  if (handle.size() >= sizeof(entry->handle)) throw Error(ErrorCode::kInternal, "an IPC handle longer than its slot");
  entry->offset = offset;
  entry->bytes = bytes;
  std::memcpy(entry->handle, handle.c_str(), handle.size() + 1);
  entry->ready.store(1, std::memory_order_release);
  registered_buffers_.push_back(Registered{static_cast<uint8_t*>(ptr), bytes});
  return index;
}

void CeTransport::before_post(const OpState& op) {
  for (int src = 0; src < world_; ++src) {
    if (src == rank_) continue;
    RecvTarget* target = recv_target_of(rank_, op.seq, src);
    target->registration_plus_1 = 0;
    const uint64_t bytes = op.layout.recv_bytes[src];
    target->bytes = bytes;
    uint8_t* start = nullptr;
    int pieces = 0;
    if (bytes > 0) {
      for_each_piece(op.recv, op.layout.recv_offsets[src], op.layout.recv_segments, src, 0, bytes,
                     [&](uint8_t* piece, uint64_t) { start = pieces++ == 0 ? piece : nullptr; });
    }
    if (start != nullptr) {  // one contiguous block: is it inside a registered buffer?
      std::lock_guard<std::mutex> lock(registered_mu_);
      for (size_t i = 0; i < registered_buffers_.size(); ++i) {
        const Registered& r = registered_buffers_[i];
        if (start >= r.ptr && start + bytes <= r.ptr + r.bytes) {
          target->registration_plus_1 = i + 1;
          target->offset = static_cast<uint64_t>(start - r.ptr);
          break;
        }
      }
    }
    target->seq_plus_1.store(op.seq + 1, std::memory_order_release);
  }
}

uint8_t* CeTransport::direct_target(int peer, const OpState& op, uint64_t offset) {
  if (peer_posted(peer) <= op.seq || peer_gone(peer)) return nullptr;  // (its receive targets are not written yet)
  const RecvTarget* target = recv_target_of(peer, op.seq, rank_);
  const uint64_t block = op.layout.send_bytes[peer];
  // Only a block of the size the peer expects: a mismatch goes through the arena, where the
  // receiver's size audit fails the op before a byte lands in its buffer.
  if (target->seq_plus_1.load(std::memory_order_acquire) != op.seq + 1 || target->registration_plus_1 == 0 ||
      target->registration_plus_1 > static_cast<uint64_t>(kMaxRegistrations) || target->bytes != block) {
    return nullptr;
  }
  const int index = static_cast<int>(target->registration_plus_1 - 1);
  auto it = peer_buffers_.find({peer, index});
  if (it == peer_buffers_.end()) {
    Registration* entry = registration_of(peer, index);
    if (entry->ready.load(std::memory_order_acquire) != 1) return nullptr;
    std::string handle(entry->handle, strnlen(entry->handle, sizeof(entry->handle)));
    auto opened = opened_allocations_.find(handle);
    if (opened == opened_allocations_.end()) {
      uint8_t* base = nullptr;
      try {
        base = static_cast<uint8_t*>(ops_.ipc_open(handle));
      } catch (const std::exception&) {
        // Not mappable here: this registration's chunks go through the arena.
      }
      opened = opened_allocations_.emplace(handle, base).first;
    }
    it = peer_buffers_.emplace(std::make_pair(peer, index),
                               opened->second != nullptr ? opened->second + entry->offset : nullptr).first;
  }
  if (it->second == nullptr) return nullptr;
  const Registration* entry = registration_of(peer, index);
  if (target->offset > entry->bytes || block > entry->bytes - target->offset) {
    throw CommError(ErrorCode::kCommError, "rank " + std::to_string(peer) + " announced a receive block past the end of "
                                           "its registered buffer: its shared memory is corrupt", peer);
  }
  return it->second + target->offset + offset;
}

void CeTransport::fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset, uint64_t bytes) {
  if (bytes > arenas_[rank_].slot_bytes) throw Error(ErrorCode::kInternal, "chunk larger than a ce arena slot");
  CopyList copies;
  // Straight into the peer's registered buffer (one copy, on a copy engine), else via our arena.
  uint8_t* direct = bytes > 0 ? direct_target(peer, op, offset) : nullptr;
  copies.from_send_block(op, peer, offset, bytes,
                         direct != nullptr ? direct : arena_ptr_[rank_] + arenas_[rank_].slot_offset(peer, index));
  slot->flags = direct != nullptr ? kSlotDirect : 0;
  add_copies(lane_index(peer), op, copies.batch);
  Lane& lane = lane_of(peer);
  RingControl* ring = ring_of(rank_, peer);
  const uint64_t slots = arenas_[rank_].slots_per_ring;
  if (index >= slots && direct == nullptr) {  // the slot's previous chunk: landed by the peer first
    lane.await(&ring->tail, rank_, peer, index + 1 - slots);
  }
  lane.counters[&ring->head] = {rank_, index + 1};  // after the copy, at the flush
  lane.publish.emplace_back(&ring->head_enqueued, index + 1, peer);
  if (offset + bytes == op.layout.send_bytes[peer]) lane.closes_part = true;
}

bool CeTransport::sends_settled(const OpState& op) {
  // Every copy of the op on this rank ran (its reads of the caller's send buffer among them).
  auto it = op_flushes_.find(op.seq);
  if (it == op_flushes_.end()) return true;
  for (size_t l = 0; l < lanes_.size(); ++l) {
    if (it->second[l] > lanes_[l].retired) return false;
  }
  return true;
}

const uint8_t* CeTransport::slot_payload(int src, uint64_t index, SlotHeader*) const {
  return arena_ptr_[src] + arenas_[src].slot_offset(rank_, index);
}

void CeTransport::release_slot(int src, uint64_t index) {
  // land()'s copies wait for the sender's device to have written the chunk (its head), and the
  // tail follows them, at the flush.
  Lane& lane = lane_of(src);
  RingControl* ring = ring_of(src, rank_);
  lane.await(&ring->head, src, src, index + 1);
  lane.counters[&ring->tail] = {src, index + 1};
  lane.publish.emplace_back(&ring->tail_enqueued, index + 1, src);
}

void CeTransport::land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) {
  CopyList copies;
  // A direct chunk is in our buffer once the sender's head passed it (release_slot's wait); only
  // a block we described as registered can be one (else nothing would ever write it).
  if ((h.flags & kSlotDirect) == 0) {
    copies.to_recv_block(op, src, h.offset, h.bytes, payload);
  } else if (recv_target_of(rank_, op.seq, src)->registration_plus_1 == 0) {
    throw CommError(ErrorCode::kCommError, "rank " + std::to_string(src) + " says it wrote a chunk of op #" +
                                           std::to_string(op.seq) + " into a buffer of rank " + std::to_string(rank_) +
                                           " that is not registered: its shared memory is corrupt", src);
  }
  add_copies(lane_index(src), op, copies.batch);
  if (last) {
    lane_of(src).finishing.push_back(Part{op.seq, src});
    lane_of(src).closes_part = true;
  }
}

bool CeTransport::flush() {
  bool any = false;
  for (Lane& lane : lanes_) {
    if (lane.copies.empty() && lane.counters.empty() && lane.finishing.empty() && lane.publish.empty()) continue;
    if (!lane.closes_part && !lane.in_flight.empty() && lane.pending_bytes < flush_bytes_) continue;
    // Never a new event here: our lanes' waits may be running, and creation can block on them.
    std::optional<Event> flushed = gate_.try_take_event();
    if (!flushed) continue;  // every pooled event is on a flush or an op: this round waits for one
    try {
      for (const auto& [counter, wait] : lane.waits) {
        // Written already: the work before it ran (the device writes a counter after it).
        if (counter->load(std::memory_order_acquire) >= wait.value) continue;
        // The peer's host enqueued the device write this waits for before it told us (published):
        // a wait on work CUDA sees ordered before it (design.md §4).
        ops_.wait_value64(lane.stream, device_address(counter, wait.owner), wait.value, WaitCmp::kGeq);
        auto& [writer, most] = awaited_[counter];
        writer = wait.writer;
        most = std::max(most, wait.value);
      }
      if (!lane.copies.empty()) ops_.copy_batch(lane.stream, lane.copies);
      for (const auto& [counter, target] : lane.counters) {
        ops_.write_value64(lane.stream, device_address(counter, target.first), target.second);
      }
    } catch (...) {
      gate_.give_event(*flushed);
      throw;
    }
    Event ev = *flushed;
    lane.in_flight.push_back(Lane::Flush{ev, lane.pending_bytes, std::move(lane.finishing)});
    ops_.record_event(ev, lane.stream);  // owned by in_flight already: released if this throws
    lane.in_flight_bytes += lane.pending_bytes;
    ++lane.flushes;
    lane.copies = CopyBatch{};
    lane.counters.clear();
    lane.waits.clear();
    std::vector<int> woken;
    for (const auto& [word, value, peer] : lane.publish) {
      word->store(std::max(word->load(std::memory_order_relaxed), value), std::memory_order_release);
      if (std::find(woken.begin(), woken.end(), peer) == woken.end()) woken.push_back(peer);
    }
    for (int peer : woken) notify_peer(peer);
    lane.publish.clear();
    lane.finishing.clear();
    lane.pending_bytes = 0;
    lane.closes_part = false;
    any = true;
  }
  return any;
}

bool CeTransport::retire_flushes() {
  bool any = false;
  for (Lane& lane : lanes_) {
    while (!lane.in_flight.empty() && gate_.event_done(lane.in_flight.front().event, "a copy of the ce transport failed")) {
      Lane::Flush done = std::move(lane.in_flight.front());
      lane.in_flight.pop_front();
      lane.in_flight_bytes -= done.bytes;
      ++lane.retired;
      for (const Part& part : done.finishing) {
        if (std::shared_ptr<OpState> op = posted_op(part.first)) finish_recv(*op, part.second);  // else it failed meanwhile
      }
      any = true;
    }
  }
  return any;
}

bool CeTransport::poll() {
  ProgressScope scope(ops_, device_);
  bool moved = flush();  // the send round's chunks
  moved = retire_flushes() || moved;
  moved = post_ready_ops() || moved;
  moved = HostTransport::poll() || moved;
  moved = flush() || moved;  // the chunks landed this poll
  return mark_all_enqueued() || moved;
}

bool CeTransport::mark_all_enqueued() {
  const auto& posted = posted_ops();
  for (auto it = enqueued_.begin(); it != enqueued_.end();) {  // forget completed ops
    it = posted.count(*it) > 0 ? std::next(it) : enqueued_.erase(it);
  }
  for (auto it = op_flushes_.begin(); it != op_flushes_.end();) {
    it = posted.count(it->first) > 0 ? std::next(it) : op_flushes_.erase(it);
  }
  bool any = false;
  for (const auto& [seq, op] : posted) {
    if (enqueued_.count(seq) > 0) continue;
    bool all = true;
    for (int p = 0; p < world_ && all; ++p) {
      // Sent: every chunk handed to fill_slot (or delivered to ourselves). Received: every
      // byte accepted, so its landing copies are queued (none for an empty block).
      all = op->send_finished[p] && op->recv_done[p] == op->layout.recv_bytes[p];
    }
    if (!all) continue;
    // The join stream waits on the last flush of each lane holding the op's copies (an event
    // recorded before this call: a wait CUDA sees ordered after that work, design.md §4).
    auto last = op_flushes_.find(seq);
    for (size_t l = 0; last != op_flushes_.end() && l < lanes_.size() && all; ++l) {
      all = last->second[l] <= lanes_[l].flushes;  // (its copies are flushed, or held this round)
    }
    if (!all) continue;
    std::optional<Event> completion = gate_.try_take_event();  // (never created here: see flush())
    if (!completion) continue;
    try {
      for (size_t l = 0; last != op_flushes_.end() && l < lanes_.size(); ++l) {
        const Lane& lane = lanes_[l];
        if (last->second[l] <= lane.retired) continue;  // ran already (or none)
        ops_.wait_event(join_, lane.in_flight[last->second[l] - lane.retired - 1].event);
      }
    } catch (...) {
      gate_.give_event(*completion);
      throw;
    }
    Event ev = *completion;
    try {
      ops_.record_event(ev, join_);
    } catch (...) {
      gate_.give_event(ev);
      throw;
    }
    gate_.all_enqueued(*op, ev);
    enqueued_.insert(seq);
    any = true;
  }
  return any;
}

void CeTransport::check_peers() {
  ProgressScope scope(ops_, device_);
  ops_.stream_idle(lanes_[0].stream);  // throws Error(kSystem) once the context faulted
  HostTransport::check_peers();
}

void CeTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  // Heads and tails written by the device ring no doorbell: while copies are in flight, look often.
  bool busy = ops_pending() || gate_.waiting();
  HostTransport::wait_for_activity(epoch, busy ? std::min(timeout, kPollWhileBusy) : timeout);
}

}  // namespace

std::unique_ptr<Transport> make_ce_transport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops) {
  check_device(ops, config.cuda_device, "ce");
  return std::make_unique<CeTransport>(bootstrap, config, ops);
}

}  // namespace freescale

// The copy-engine transport. The control plane is the host transport's (rings of slot headers in
// a shared host segment, posted / received counters, doorbells, liveness); payloads move through
// each rank's device arena (CeArenaLayout, shared with peers by IPC handles), whose rings have
// exactly the host rings' number of slots, so the host flow control guards the device slots:
//
//   sender's comm stream:   copy input piece(s) -> own arena slot;  write head = index + 1
//   receiver (host) polls head, reads the header, then on its comm stream:
//                           copy peer's arena slot -> output piece(s);  write peer's tail = index + 1
//
// Copies go on copy engines (DeviceOps::copy_batch); head/tail are written by the device with
// stream memory operations into the host segments (registered, device-mapped), so no copy waits
// for a host round trip. An op is posted (its first copy may start, peers may send to it) once
// its submitter's stream passed its submission, and Work.wait() is a stream wait on its
// completion flag (both: SubmitGate). A receive part finishes when an event after its last copy
// completed.
#include "cuda/ce_transport.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cpp/ce_arena_layout.h"
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
  const std::string counters = "; ring counters by stream memory writes; the host drives every step";
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
  bool poll() override;
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  // Peers, and this device: an asynchronous fault (anywhere in the context) surfaces at the next
  // query of the comm stream, also when no event of ours is pending to report it.
  void check_peers() override;
  // The comm stream holds copies and counter writes only (no waits): it drains.
  void quiesce() override;

 protected:
  void fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset, uint64_t bytes) override;
  const uint8_t* slot_payload(int src, uint64_t index, SlotHeader* slot) const override;
  void release_slot(int src, uint64_t index) override;
  void land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) override;
  bool sends_settled(const OpState& op) override;

 private:
  // Collective over `bootstrap`: device resources, then the arenas' exchange. Throws (on every
  // rank alike) if any rank failed or refused.
  void setup(Bootstrap& bootstrap, const Config& config);
  // Frees what setup made (best effort, never throws); the comm stream drains first.
  void release() noexcept;
  struct Landing {  // a receive part whose last copy was queued
    uint64_t seq;
    int src;
    Event event;  // recorded after that copy
  };
  // Posts to the host control plane (in program order) the ops whose submitter's stream passed
  // their submission (SubmitGate).
  bool post_ready_ops();
  // Writes `value` to `counter` (in rank p's control segment) once the stream's copies so far landed.
  void write_value(int p, const std::atomic<uint64_t>* counter, uint64_t value);
  // Records, for each posted op whose every copy on this rank is now enqueued (every send
  // chunk filled, every receive chunk landing), an event after them for callers' streams to
  // wait on (SubmitGate::all_enqueued). True if any.
  bool mark_all_enqueued();

  DeviceOps& ops_;
  int device_;
  int driver_version_ = 0;  // cudaDriverGetVersion, read at setup
  Stream stream_ = 0;                  // the comm stream: every copy and counter write
  std::vector<CeArenaLayout> arenas_;  // [world] each rank's arena layout
  std::vector<uint8_t*> arena_ptr_;    // [world] mapped base of each rank's arena (ours: own)
  std::vector<void*> registered_;      // host segments registered with the device
  std::vector<DevicePtr> segment_device_;  // [world] device address of each control segment
  SubmitGate gate_;                    // callers' streams: start gate, events, completion flags
  std::vector<Landing> landing_;       // progress thread only
  // seq -> an event re-recorded after each of that op's send copies: the op's reads of the
  // caller's send buffer are over once it completed. Progress thread only.
  std::unordered_map<uint64_t, Event> send_fence_;
  std::unordered_set<uint64_t> enqueued_;  // posted ops whose copies are all enqueued. Progress thread only.
};

CeTransport::CeTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops)
    : HostTransport(bootstrap, config, /*inline_payload=*/false,
                    CeArenaLayout::plan(bootstrap.size(), bootstrap.rank(), config.chunk_bytes, config.arena_bytes)
                        .slots_per_ring),
      ops_(ops),
      device_(config.cuda_device),
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
  CeArenaLayout mine = CeArenaLayout::plan(world_, rank_, config.chunk_bytes, config.arena_bytes);
  std::optional<DeviceGuard> guard;  // the caller's device comes back when setup ends
  try {
    guard.emplace(ops_, device_);
    // What the data path needs, checked before anything is made: counters written by the device
    // with 64-bit stream memory operations into registered, mapped host segments.
    std::string missing = missing_capability(ops_, device_, "ce",
                                             {DeviceAttribute::kCanUse64BitStreamMemOps, DeviceAttribute::kCanMapHostMemory,
                                              DeviceAttribute::kHostRegisterSupported, DeviceAttribute::kUnifiedAddressing});
    if (!missing.empty()) throw Error(ErrorCode::kUnsupported, missing);
    driver_version_ = ops_.driver_version();
    stream_ = ops_.create_stream();
    if (mine.num_bytes() > 0) {
      arena_ptr_[rank_] = static_cast<uint8_t*>(ops_.device_alloc(mine.num_bytes()));
      handle = ops_.ipc_handle(arena_ptr_[rank_]);
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
    if (p == rank_ || f[3].empty() || !open_error.empty()) continue;
    try {
      arena_ptr_[p] = static_cast<uint8_t*>(ops_.ipc_open(f[3]));
    } catch (const std::exception& e) {
      open_error = "rank " + std::to_string(rank_) + " could not map rank " + std::to_string(p) + "'s arena: " + e.what();
    }
  }
  for (const auto& s : bootstrap.allgather(open_error)) {
    if (!s.empty()) throw CommError(ErrorCode::kSystem, "ce transport setup failed: " + s);
  }
}

CeTransport::~CeTransport() { release(); }

void CeTransport::release() noexcept {
  // Best effort, never throws. The comm stream holds copies and counter writes only (no waits),
  // so it drains; it must, before the segments and arenas its work touches go away.
  DeviceGuard guard(ops_, device_, std::nothrow);
  auto quietly = [](auto&& fn) {
    try {
      fn();
    } catch (...) {
    }
  };
  if (stream_ != 0) quietly([&] { ops_.synchronize(stream_); });
  for (const Landing& l : landing_) quietly([&] { ops_.destroy_event(l.event); });
  for (const auto& fence : send_fence_) quietly([&] { ops_.destroy_event(fence.second); });
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && arena_ptr_[p] != nullptr) quietly([&] { ops_.ipc_close(arena_ptr_[p]); });
  }
  if (arena_ptr_[rank_] != nullptr) quietly([&] { ops_.device_free(arena_ptr_[rank_]); });
  for (void* base : registered_) quietly([&] { ops_.host_unregister(base); });
  if (stream_ != 0) quietly([&] { ops_.destroy_stream(stream_); });
  landing_.clear();
  send_fence_.clear();
  std::fill(arena_ptr_.begin(), arena_ptr_.end(), nullptr);
  registered_.clear();
  stream_ = 0;
}

void CeTransport::quiesce() {
  DeviceGuard guard(ops_, device_, std::nothrow);
  try {
    if (stream_ != 0) ops_.synchronize(stream_);
  } catch (...) {
    // A failed stream runs nothing more.
  }
}

void CeTransport::post(const std::shared_ptr<OpState>& op) {
  ops_.prepare_progress_thread(device_);
  gate_.post(op);
  post_ready_ops();
}

bool CeTransport::post_ready_ops() {
  return gate_.start_ready([this](const std::shared_ptr<OpState>& op) { HostTransport::post(op); });
}

bool CeTransport::can_send(const Transfer& t) const { return gate_.started(*t.op) && HostTransport::can_send(t); }

void CeTransport::write_value(int p, const std::atomic<uint64_t>* counter, uint64_t value) {
  auto offset = reinterpret_cast<const char*>(counter) - static_cast<const char*>(segment_base(p));
  ops_.write_value64(stream_, segment_device_[p] + static_cast<DevicePtr>(offset), value);
}

void CeTransport::fill_slot(int peer, uint64_t index, SlotHeader*, const OpState& op, uint64_t offset, uint64_t bytes) {
  ops_.prepare_progress_thread(device_);
  if (bytes > arenas_[rank_].slot_bytes) throw Error(ErrorCode::kInternal, "chunk larger than a ce arena slot");
  CopyList copies;
  copies.from_send_block(op, peer, offset, bytes, arena_ptr_[rank_] + arenas_[rank_].slot_offset(peer, index));
  ops_.copy_batch(stream_, copies.batch);
  write_value(rank_, &ring_of(rank_, peer)->head, index + 1);
  auto fence = send_fence_.try_emplace(op.seq, Event{});
  if (fence.second) fence.first->second = gate_.take_event();
  ops_.record_event(fence.first->second, stream_);
}

bool CeTransport::sends_settled(const OpState& op) {
  auto it = send_fence_.find(op.seq);
  if (it == send_fence_.end()) return true;  // nothing sent to a peer (or settled earlier)
  if (!gate_.event_done(it->second, "a copy of the ce transport failed")) return false;  // done: back in the pool
  send_fence_.erase(it);
  return true;
}

const uint8_t* CeTransport::slot_payload(int src, uint64_t index, SlotHeader*) const {
  return arena_ptr_[src] + arenas_[src].slot_offset(rank_, index);
}

void CeTransport::release_slot(int src, uint64_t index) {
  write_value(src, &ring_of(src, rank_)->tail, index + 1);  // after land()'s copies, in stream order
}

void CeTransport::land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) {
  ops_.prepare_progress_thread(device_);
  CopyList copies;
  copies.to_recv_block(op, src, h.offset, h.bytes, payload);
  ops_.copy_batch(stream_, copies.batch);
  if (!last) return;
  Event ev = gate_.take_event();
  ops_.record_event(ev, stream_);
  landing_.push_back(Landing{op.seq, src, ev});
}

bool CeTransport::poll() {
  ops_.prepare_progress_thread(device_);
  bool moved = post_ready_ops();
  moved = HostTransport::poll() || moved;
  for (auto it = landing_.begin(); it != landing_.end();) {
    if (!gate_.event_done(it->event, "a copy of the ce transport failed")) {
      ++it;
      continue;
    }
    if (std::shared_ptr<OpState> op = posted_op(it->seq)) finish_recv(*op, it->src);  // else it failed meanwhile
    it = landing_.erase(it);
    moved = true;
  }
  return mark_all_enqueued() || moved;
}

bool CeTransport::mark_all_enqueued() {
  const auto& posted = posted_ops();
  for (auto it = enqueued_.begin(); it != enqueued_.end();) {  // forget completed ops
    it = posted.count(*it) > 0 ? std::next(it) : enqueued_.erase(it);
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
    Event ev = gate_.take_event();
    ops_.record_event(ev, stream_);  // after every copy of this op on the comm stream
    gate_.all_enqueued(*op, ev);
    enqueued_.insert(seq);
    any = true;
  }
  return any;
}

void CeTransport::check_peers() {
  ops_.prepare_progress_thread(device_);
  ops_.stream_idle(stream_);  // throws Error(kSystem) once the context faulted
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

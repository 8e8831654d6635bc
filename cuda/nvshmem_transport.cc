// The NVSHMEM transport (see cpp/nvshmem_layout.h for the arena and the lane rules). Every
// cross-rank dependency is a stream wait on an NVSHMEM signal; the host enqueues, checks local
// events and audits. Per chunk n of the pair-lane (me -> dst, lane):
//
//   send stream (dst, lane):  wait freed[dst][lane] >= n + 1 - S     (dst copied out chunk n - S)
//                             copy input piece(s) -> staging slot     (copy engines)
//                             putmem_signal staging -> dst's recv slot, ready[me][lane] = n + 1
//   after an op's last chunk: audit_out[dst][lane] = bytes; put it to dst's audit_bytes[me][seq],
//                             signal audit[me][seq] = seq + 1
//   recv stream (src, lane):  wait ready[src][lane] >= n + 1; copy slot -> output piece(s);
//                             signal freed[me][lane] = n + 1 at src
//   audit stream (src, lane): wait audit[src][seq] >= seq + 1; copy audit_bytes to the host, which
//                             compares them with its own count (kSizeMismatch otherwise)
//   receipt stream (lane):    once every part of op seq landed and matched: signal
//                             recvd[me][seq] = seq + 1 at every rank
//   confirm stream (lane):    wait recvd[p][seq] >= seq + 1 for every p -> op confirmed
//
// Every stream is fed from a host queue a bounded number of steps at a time (SteppedStream), so
// the progress thread never blocks on a full device queue whose head waits for work it has yet
// to enqueue (e.g. a receive waiting for our own send). Streams are per (peer, lane) so that a
// stream blocked on one pair never holds another pair's traffic. The staging copy makes every
// put's source symmetric memory (network peers need that). An op is started once its submitter's
// stream passed its submission (SubmitGate). A rank that fails or closes writes a notice into
// every peer's arena; peers read theirs with check_peers() (and watch same-host pids), so a
// failure anywhere fails every survivor promptly, naming the rank.
#include "cuda/nvshmem_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpp/host_layout.h"
#include "cpp/layout.h"
#include "cpp/nvshmem_layout.h"
#include "cpp/op_state.h"
#include "cpp/peer_liveness.h"
#include "cpp/root_cause.h"
#include "cpp/transfer.h"
#include "cuda/device_util.h"
#include "cuda/submit_gate.h"

namespace freescale {
namespace {

constexpr std::chrono::microseconds kPollWhileBusy{50};  // device progress rings no doorbell
constexpr std::chrono::seconds kDrainLimit{30};  // drain_streams gives up (and leaks) after this
// Steps queued on a stream beyond its completed ones. A step is at most ~6 stream operations,
// so a stream never holds more than ~12: far below a GPU's queue, and the emulated tests' 16.
constexpr size_t kStepsAhead = kNvshmemSlotsPerLane;
constexpr uint64_t kHeapMargin = 64ull << 20;  // symmetric heap beyond our arena

std::atomic<bool> g_nvshmem_taken{false};  // NVSHMEM is initialized once per process

uint64_t chunks_of(uint64_t bytes, uint64_t chunk) { return bytes == 0 ? 0 : (bytes + chunk - 1) / chunk; }

// A device stream fed from a host queue, at most kStepsAhead steps ahead of what completed.
struct SteppedStream {
  struct Step {
    std::function<void(Stream)> enqueue;  // queues the step's stream operations
    std::function<void()> done;           // progress thread, once they completed (may throw)
  };
  Stream stream = 0;
  std::deque<Step> pending;                                     // not queued yet
  std::deque<std::pair<Event, std::function<void()>>> in_flight;  // queued: event after each
  size_t queued() const { return pending.size() + in_flight.size(); }
  bool busy() const { return queued() > 0; }
};

class NvshmemTransport final : public Transport {
 public:
  NvshmemTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops, ShmemOps& shmem);
  ~NvshmemTransport() override;

  const char* name() const override { return "nvshmem"; }
  uintptr_t mark_submission(uintptr_t stream) override { return gate_.mark(stream); }
  void on_submit(OpState& op, uintptr_t mark) override { gate_.on_submit(op, mark); }
  void discard_submission(uintptr_t mark) override { gate_.give_event(mark); }
  bool stream_wait(const OpState& op, uintptr_t stream, std::chrono::microseconds timeout) override {
    return gate_.stream_wait(op, stream, timeout);
  }
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  void send_chunk(const Transfer& t, const Chunk& c) override;
  bool poll() override;
  uint64_t max_ops_in_flight() const override { return kOpWindow; }
  void check_peers() override;
  uint32_t activity_epoch() const override { return epoch_.load(std::memory_order_acquire); }
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  void wake() override;
  void abort(ErrorCode code, int culprit) override { notify_peers(nvshmem_abort_notice(code, culprit)); }
  void close() override { notify_peers(kNvshmemNoticeClosed); }
  void quiesce() override { drain_streams(); }

 private:
  struct RecvPart {  // (op, src): landed and matched, or not yet
    bool landed = false;
    bool audited = false;
  };

  int pair(int peer, int lane) const { return peer * kNvshmemLanes + lane; }
  uint64_t* word(uint64_t offset) const { return reinterpret_cast<uint64_t*>(arena_ + offset); }
  DevicePtr device_word(uint64_t offset) const { return reinterpret_cast<DevicePtr>(arena_ + offset); }
  // Queues what completed and tops the stream up; true if anything moved.
  bool pump(SteppedStream& s, const char* what);
  void start(const std::shared_ptr<OpState>& op);
  void push_receives(const std::shared_ptr<OpState>& op, int src, int lane);
  // Once op's data from `src` landed and its byte count matched, the receive part is finished;
  // once every part is, our receipt goes to every rank (as with the host transport, an op
  // completes only when every rank received all of it and found the byte counts right).
  void part_checked(const std::shared_ptr<OpState>& op, int src, int lane);
  void notify_peers(uint64_t notice);
  // Sets every signal word of our arena to the maximum, so every wait of ours (all GE, on our
  // own words) passes, until every stream ran out: a live peer's later SET can lower a word
  // again before a queued wait reads it, so the fill repeats (peers send a bounded amount
  // before they stop). Once it returns, no work of ours touches an op's buffers; the transport
  // is unusable. Returns false if a stream failed or did not run out within kDrainLimit (its
  // work may still hold the mirrors). Never throws.
  bool drain_streams();
  std::vector<SteppedStream*> all_streams();
  // Queues on `s` a copy of the notices peers wrote into our arena into notice_mirror_.
  void copy_notices(Stream s);
  bool any_busy() const;

  DeviceOps& ops_;
  ShmemOps& shmem_;
  int rank_, world_, device_;
  uint64_t chunk_bytes_;
  NvshmemArenaLayout layout_;
  uint8_t* arena_ = nullptr;  // symmetric: the same offsets address every rank's arena
  std::vector<ProcessId> procs_;  // [world] ranks on this host (pid -1 for others)
  bool took_ = false;         // this transport holds the process's NVSHMEM

  std::vector<SteppedStream> send_, recv_, audit_;  // [pair]
  std::vector<SteppedStream> confirm_;              // [lane]
  std::vector<SteppedStream> receipt_;              // [lane]: our receipts (never wait)
  SteppedStream health_;                            // reads the notices peers wrote us
  Stream notice_stream_ = 0;                        // our notices to peers (never waits)
  uint64_t* audit_mirror_ = nullptr;   // mapped host: [kOpWindow][world] byte counts peers sent
  DevicePtr audit_mirror_device_ = 0;
  uint64_t* notice_mirror_ = nullptr;  // mapped host: [world] notices copied from the arena
  DevicePtr notice_mirror_device_ = 0;
  std::atomic<bool> notified_{false};
  SubmitGate gate_;  // callers' streams: start gate, events, completion flags

  // Progress thread only.
  std::map<uint64_t, std::shared_ptr<OpState>> started_;
  std::map<std::pair<uint64_t, int>, RecvPart> recv_parts_;  // (seq, src)
  std::vector<std::deque<uint64_t>> send_fifo_;  // [pair] ops (seq) still to send, in start order
  std::vector<uint64_t> sent_chunks_;            // [pair] non-empty chunks put so far
  std::vector<uint64_t> recv_chunks_;            // [pair] non-empty chunks expected so far

  std::atomic<uint32_t> epoch_{0};
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
};

NvshmemTransport::NvshmemTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops, ShmemOps& shmem)
    : ops_(ops),
      shmem_(shmem),
      rank_(bootstrap.rank()),
      world_(bootstrap.size()),
      device_(config.cuda_device),
      chunk_bytes_(config.chunk_bytes),
      layout_(NvshmemArenaLayout::plan(world_, config.chunk_bytes, kOpWindow)),
      procs_(static_cast<size_t>(world_)),
      send_(static_cast<size_t>(world_ * kNvshmemLanes)),
      recv_(static_cast<size_t>(world_ * kNvshmemLanes)),
      audit_(static_cast<size_t>(world_ * kNvshmemLanes)),
      confirm_(kNvshmemLanes),
      receipt_(kNvshmemLanes),
      gate_(ops, device_),
      send_fifo_(static_cast<size_t>(world_ * kNvshmemLanes)),
      sent_chunks_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      recv_chunks_(static_cast<size_t>(world_ * kNvshmemLanes), 0) {
  // Each step's outcome is announced so that every rank fails together (with the failing rank's
  // code), and nobody enters NVSHMEM's collective init while a peer cannot.
  auto announce = [&](ErrorCode code, const std::string& error, const std::string& payload) {
    std::vector<std::string> all = bootstrap.allgather(std::to_string(static_cast<int>(code)) + "\n" + error + "\n" + payload);
    std::vector<std::string> payloads;
    for (int p = 0; p < world_; ++p) {
      size_t a = all[p].find('\n');
      size_t b = a == std::string::npos ? a : all[p].find('\n', a + 1);
      if (b == std::string::npos) throw CommError(ErrorCode::kCommError, "nvshmem transport setup: malformed announcement");
      std::string what = all[p].substr(a + 1, b - a - 1);
      if (!what.empty()) {
        if (took_ && arena_ == nullptr) g_nvshmem_taken.store(false);  // not started: a later try may have it
        throw Error(static_cast<ErrorCode>(std::stoi(all[p].substr(0, a))),
                    "nvshmem transport setup failed on rank " + std::to_string(p) + ": " + what);
      }
      payloads.push_back(all[p].substr(b + 1));
    }
    return payloads;
  };
  ErrorCode code = ErrorCode::kSystem;
  std::string error;
  std::optional<DeviceGuard> guard;
  try {
    took_ = !g_nvshmem_taken.exchange(true);
    if (!took_) {
      code = ErrorCode::kUnsupported;
      throw Error(code, "NVSHMEM already serves another communicator of this process (it is initialized once, over one "
                        "group); use FREESCALE_TRANSPORT=ce for this one or one NVSHMEM group per process");
    }
    guard.emplace(ops_, device_);
    audit_mirror_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(sizeof(uint64_t) * kOpWindow * world_, &audit_mirror_device_));
    notice_mirror_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(sizeof(uint64_t) * world_, &notice_mirror_device_));
    std::fill(notice_mirror_, notice_mirror_ + world_, 0);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Step 1: chunk sizes, placement and pids.
  std::vector<std::string> got =
      announce(code, error, std::to_string(chunk_bytes_) + "\n" + host_identity() + "\n" + this_process().encode());
  bool one_host = true;
  for (int p = 0; p < world_; ++p) {
    std::istringstream in(got[p]);
    std::string chunk, host, pid;
    if (!std::getline(in, chunk) || !std::getline(in, host) || !std::getline(in, pid)) {
      throw CommError(ErrorCode::kCommError, "nvshmem transport setup: malformed announcement from rank " + std::to_string(p));
    }
    if (chunk != std::to_string(chunk_bytes_)) {
      throw InvalidArgument("ranks use different chunk sizes (FREESCALE_CHUNK_BYTES): rank " + std::to_string(p) +
                            " has " + chunk + ", rank " + std::to_string(rank_) + " " + std::to_string(chunk_bytes_) +
                            "; set one value everywhere");
    }
    if (host == host_identity()) {
      procs_[p] = ProcessId::decode(pid);
    } else {
      one_host = false;
    }
  }
  // NVSHMEM reads its environment once, at the first call (rank 0: unique_id): set it before.
  if (one_host) setenv("NVSHMEM_REMOTE_TRANSPORT", "none", 0);  // one node: no network to probe
  if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr) {
    uint64_t heap = std::max<uint64_t>(1ull << 30, layout_.num_bytes() + kHeapMargin);
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap).c_str(), 0);
  }
  // Step 2: rank 0's unique id.
  std::string uid;
  error.clear();
  code = ErrorCode::kSystem;
  if (rank_ == 0) {
    try {
      uid = shmem_.unique_id();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  uid = announce(code, error, uid)[0];
  // Step 3: NVSHMEM's collective init (host library only: no NVSHMEM device code is launched).
  try {
    int status = shmem_.init(uid, rank_, world_);
    if (status != 0) {
      throw Error(code, "NVSHMEM's init returned " + std::to_string(status) + " (NVSHMEM_DEBUG=INFO tells why)");
    }
    if (!shmem_.fully_initialized()) {
      // NVSHMEM 3.8 reports success here with several PEs on one GPU and no (or an oversubscribed)
      // MPS, and then exit()s the process at the first stream signal wait: refuse instead.
      code = ErrorCode::kUnsupported;
      throw Error(code, "NVSHMEM started in a limited mode (" + shmem_.init_status_text() +
                            "): its stream signal waits would end the process. Several ranks on one GPU need MPS "
                            "(nvidia-cuda-mps-control -d, thread percentages summing to at most 100); or use "
                            "FREESCALE_TRANSPORT=ce within a node");
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  announce(code, error, "");
  // Step 4: the arena (collective), its signals zeroed before anyone signals into it.
  code = ErrorCode::kSystem;
  try {
    arena_ = static_cast<uint8_t*>(shmem_.malloc(layout_.num_bytes()));
    if (arena_ == nullptr) {
      throw Error(code, "nvshmem_malloc of " + std::to_string(layout_.num_bytes()) +
                            " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE)");
    }
    ops_.memset_sync(arena_ + layout_.signals_offset(), layout_.signal_bytes());
    notice_stream_ = ops_.create_stream();
  } catch (const std::exception& e) {
    error = e.what();
  }
  announce(code, error, "");
}

NvshmemTransport::~NvshmemTransport() {
  // Best effort, never throws. NVSHMEM's teardown and nvshmem_free are collective (a closing rank
  // cannot count on its peers): the arena and NVSHMEM stay for the life of the process. Steps
  // already queued may wait on signals a failed peer will never set: drain_streams() ends them.
  DeviceGuard guard(ops_, device_, std::nothrow);
  auto quietly = [](auto&& fn) {
    try {
      fn();
    } catch (...) {
    }
  };
  bool drained = drain_streams();
  for (SteppedStream* s : all_streams()) {
    if (s->stream != 0) quietly([&] { ops_.destroy_stream(s->stream); });
    for (auto& [ev, done] : s->in_flight) quietly([&, e = ev] { ops_.destroy_event(e); });
  }
  if (notice_stream_ != 0) quietly([&] { ops_.destroy_stream(notice_stream_); });
  if (drained) {
    if (audit_mirror_ != nullptr) quietly([&] { ops_.host_free(audit_mirror_); });
    if (notice_mirror_ != nullptr) quietly([&] { ops_.host_free(notice_mirror_); });
  } else {
    gate_.leak();  // a failed stream may still hold work that reads them
  }
}

std::vector<SteppedStream*> NvshmemTransport::all_streams() {
  std::vector<SteppedStream*> all = {&health_};
  for (auto* v : {&send_, &recv_, &audit_, &confirm_, &receipt_})
    for (auto& s : *v) all.push_back(&s);
  return all;
}

bool NvshmemTransport::drain_streams() {
  DeviceGuard guard(ops_, device_, std::nothrow);
  std::vector<SteppedStream*> all = all_streams();
  std::vector<bool> settled(all.size(), false);  // ran out, or failed (then drained = false)
  bool drained = true;
  const auto give_up = std::chrono::steady_clock::now() + kDrainLimit;
  while (true) {
    if (arena_ != nullptr && notice_stream_ != 0) {
      try {
        ops_.fill_async(notice_stream_, arena_ + layout_.signals_offset(), 0xff, layout_.signal_bytes());
        ops_.synchronize(notice_stream_);
      } catch (...) {
        // Waits on a word the fill did not reach may stay: the limit below ends this then.
      }
    }
    bool all_settled = true;
    for (size_t i = 0; i < all.size(); ++i) {
      if (settled[i] || all[i]->stream == 0) continue;
      try {
        settled[i] = ops_.stream_idle(all[i]->stream);
      } catch (...) {
        settled[i] = true;  // a failed stream runs nothing more
        drained = false;
      }
      all_settled = all_settled && settled[i];
    }
    if (all_settled) return drained;
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(kPollWhileBusy);
  }
}

bool NvshmemTransport::pump(SteppedStream& s, const char* what) {
  bool moved = false;
  while (!s.in_flight.empty() && gate_.event_done(s.in_flight.front().first, what)) {
    std::function<void()> done = std::move(s.in_flight.front().second);
    s.in_flight.pop_front();
    moved = true;
    if (done) done();
  }
  while (s.in_flight.size() < kStepsAhead && !s.pending.empty()) {
    if (s.stream == 0) s.stream = ops_.create_stream();
    SteppedStream::Step step = std::move(s.pending.front());
    s.pending.pop_front();
    step.enqueue(s.stream);
    Event ev = gate_.take_event();
    ops_.record_event(ev, s.stream);
    s.in_flight.emplace_back(ev, std::move(step.done));
    moved = true;
  }
  return moved;
}

void NvshmemTransport::post(const std::shared_ptr<OpState>& op) {
  ops_.prepare_progress_thread(device_);
  gate_.post(op);
  gate_.start_ready([this](const std::shared_ptr<OpState>& ready) { start(ready); });
}

void NvshmemTransport::start(const std::shared_ptr<OpState>& op) {
  started_[op->seq] = op;
  const int lane = nvshmem_lane(op->priority);
  for (int p = 0; p < world_; ++p) {
    send_fifo_[static_cast<size_t>(pair(p, lane))].push_back(op->seq);
    push_receives(op, p, lane);
  }
  confirm_[static_cast<size_t>(lane)].pending.push_back(SteppedStream::Step{
      [this, seq = op->seq](Stream s) {
        for (int p = 0; p < world_; ++p) shmem_.signal_wait_geq_on_stream(word(layout_.recvd(p, seq)), seq + 1, s);
      },
      [op] {
        if (op->is_completed()) return;  // failed meanwhile
        op->confirmed = true;
        op->part_done();
      }});
}

void NvshmemTransport::push_receives(const std::shared_ptr<OpState>& op, int src, int lane) {
  const auto index = static_cast<size_t>(pair(src, lane));
  const uint64_t bytes = op->layout.recv_bytes[src];
  const uint64_t first = recv_chunks_[index];
  const uint64_t chunks = chunks_of(bytes, chunk_bytes_);
  recv_chunks_[index] = first + chunks;
  recv_parts_[{op->seq, src}] = RecvPart{};
  for (uint64_t k = 0; k < chunks; ++k) {
    const uint64_t n = first + k;
    const uint64_t offset = k * chunk_bytes_;
    const uint64_t len = std::min(chunk_bytes_, bytes - offset);
    recv_[index].pending.push_back(SteppedStream::Step{[this, op, src, lane, n, offset, len](Stream s) {
                                                          shmem_.signal_wait_geq_on_stream(word(layout_.ready(src, lane)), n + 1, s);
                                                          CopyList copies;
                                                          copies.to_recv_block(*op, src, offset, len, arena_ + layout_.recv_slot(src, lane, n));
                                                          ops_.copy_batch(s, copies.batch);
                                                          shmem_.signal_op_on_stream(word(layout_.freed(rank_, lane)), n + 1, ShmemSignalOp::kSet, src, s);
                                                        },
                                                        nullptr});
  }
  // The last chunk step's completion (or, for an empty block, nothing) means the data landed.
  auto landed = [this, op, src, lane] {
    recv_parts_[{op->seq, src}].landed = true;
    part_checked(op, src, lane);
  };
  if (chunks == 0) {
    recv_parts_[{op->seq, src}].landed = true;
  } else {
    recv_[index].pending.back().done = landed;
  }
  // The sender's byte count, to the host, which compares it with ours.
  const uint64_t slot = (op->seq % kOpWindow) * world_ + static_cast<uint64_t>(src);
  audit_[index].pending.push_back(SteppedStream::Step{
      [this, seq = op->seq, src, slot](Stream s) {
        shmem_.signal_wait_geq_on_stream(word(layout_.audit(src, seq)), seq + 1, s);
        CopyBatch batch;
        batch.add(audit_mirror_ + slot, word(layout_.audit_bytes(src, seq)), sizeof(uint64_t));
        ops_.copy_batch(s, batch);
      },
      [this, op, src, lane, slot, bytes] {
        const uint64_t announced = read_mapped_word(audit_mirror_ + slot);
        if (announced != bytes) {
          throw CommError(ErrorCode::kSizeMismatch,
                          "all_to_all op #" + std::to_string(op->seq) + ": rank " + std::to_string(rank_) + " expected " +
                              std::to_string(bytes) + " bytes from rank " + std::to_string(src) + ", which sends " +
                              std::to_string(announced) + " bytes: the ranks' split sizes disagree",
                          src);
        }
        recv_parts_[{op->seq, src}].audited = true;
        part_checked(op, src, lane);
      }});
}

void NvshmemTransport::part_checked(const std::shared_ptr<OpState>& op, int src, int lane) {
  auto it = recv_parts_.find({op->seq, src});
  if (it == recv_parts_.end() || !it->second.landed || !it->second.audited) return;
  recv_parts_.erase(it);
  if (op->is_completed()) return;  // failed meanwhile
  op->recv_finished[src] = 1;
  op->part_done();
  if (--op->recv_parts_left > 0) return;
  receipt_[static_cast<size_t>(lane)].pending.push_back(SteppedStream::Step{
      [this, seq = op->seq](Stream s) {
        for (int p = 0; p < world_; ++p) {
          shmem_.signal_op_on_stream(word(layout_.recvd(rank_, seq)), seq + 1, ShmemSignalOp::kSet, p, s);
        }
      },
      nullptr});
}

bool NvshmemTransport::can_send(const Transfer& t) const {
  if (!gate_.started(*t.op)) return false;  // its submitter's stream has not got there yet
  const auto index = static_cast<size_t>(pair(t.peer, nvshmem_lane(t.op->priority)));
  // FIFO within a pair-lane (the receiver counts on it), and a bounded queue on its stream.
  return !send_fifo_[index].empty() && send_fifo_[index].front() == t.op->seq && send_[index].queued() < kStepsAhead;
}

void NvshmemTransport::send_chunk(const Transfer& t, const Chunk& c) {
  ops_.prepare_progress_thread(device_);
  const std::shared_ptr<OpState> op = t.op;
  const int lane = nvshmem_lane(op->priority);
  const int dst = t.peer;
  const auto index = static_cast<size_t>(pair(dst, lane));
  if (c.bytes > chunk_bytes_) throw Error(ErrorCode::kInternal, "chunk larger than an nvshmem slot");
  const bool last = c.offset + c.bytes == t.bytes;  // the transfer's last chunk (or its one empty chunk)
  const uint64_t n = c.bytes > 0 ? sent_chunks_[index]++ : 0;
  send_[index].pending.push_back(SteppedStream::Step{
      [this, op, dst, lane, n, c, last, total = t.bytes](Stream s) {
        if (c.bytes > 0) {
          if (n >= kNvshmemSlotsPerLane) {  // the receiver copied out the slot's previous chunk
            shmem_.signal_wait_geq_on_stream(word(layout_.freed(dst, lane)), n + 1 - kNvshmemSlotsPerLane, s);
          }
          uint8_t* staging = arena_ + layout_.staging_slot(dst, lane, n);
          CopyList copies;
          copies.from_send_block(*op, dst, c.offset, c.bytes, staging);
          ops_.copy_batch(s, copies.batch);
          shmem_.put_signal_on_stream(arena_ + layout_.recv_slot(rank_, lane, n), staging, c.bytes,
                                      word(layout_.ready(rank_, lane)), n + 1, ShmemSignalOp::kSet, dst, s);
        }
        if (last) {  // our byte count for this op, then its signal
          ops_.write_value64(s, device_word(layout_.audit_out(dst, lane)), total);
          shmem_.put_signal_on_stream(word(layout_.audit_bytes(rank_, op->seq)), word(layout_.audit_out(dst, lane)),
                                      sizeof(uint64_t), word(layout_.audit(rank_, op->seq)), op->seq + 1,
                                      ShmemSignalOp::kSet, dst, s);
        }
      },
      nullptr});
  if (last) send_fifo_[index].pop_front();
  pump(send_[index], "an NVSHMEM put failed");
}

bool NvshmemTransport::poll() {
  ops_.prepare_progress_thread(device_);
  bool moved = gate_.start_ready([this](const std::shared_ptr<OpState>& op) { start(op); });
  for (auto& s : send_) moved = pump(s, "an NVSHMEM put failed") || moved;
  for (auto& s : recv_) moved = pump(s, "a receive of the nvshmem transport failed") || moved;
  for (auto& s : audit_) moved = pump(s, "an audit of the nvshmem transport failed") || moved;
  for (auto& s : confirm_) moved = pump(s, "waiting for the peers' receipts failed") || moved;
  for (auto& s : receipt_) moved = pump(s, "sending receipts failed") || moved;
  for (auto it = started_.begin(); it != started_.end();) it = it->second->is_completed() ? started_.erase(it) : std::next(it);
  return moved;
}

void NvshmemTransport::check_peers() {
  // Peers on this host that died; when one is needed by an op, its notice, if it left one,
  // names the root cause (e.g. it detected a split mismatch and exited): read the notices afresh.
  std::vector<bool> died(static_cast<size_t>(world_), false);
  int dead = -1;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || procs_[p].pid < 0 || process_alive(procs_[p])) continue;
    died[p] = true;
    for (const auto& [seq, op] : started_) {
      if (dead < 0 && !op->is_completed() && op->needs_peer(p)) dead = p;
    }
  }
  // The notices peers wrote into our arena: one asynchronous copy in flight at a time.
  if (!health_.busy()) health_.pending.push_back(SteppedStream::Step{[this](Stream s) { copy_notices(s); }, nullptr});
  pump(health_, "reading the peers' notices failed");
  if (dead >= 0) {
    // The copy in flight may have started before the dead peer's notice landed: read afresh.
    // Copies only: the health stream never waits on a peer.
    ops_.synchronize(health_.stream);
    copy_notices(health_.stream);
    ops_.synchronize(health_.stream);
  }
  // Liveness was read first, the notices now: a dead peer's notice is in view (root_cause.h).
  std::vector<PeerSight> sight(static_cast<size_t>(world_));
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const uint64_t notice = read_mapped_word(notice_mirror_ + p);
    sight[p].died = died[p];
    sight[p].closed = notice == kNvshmemNoticeClosed;
    sight[p].aborted = notice >= kNvshmemNoticeAbortBase;
    if (sight[p].aborted) {
      sight[p].code = nvshmem_notice_code(notice);
      sight[p].culprit = nvshmem_notice_culprit(notice);
    }
    for (const auto& [seq, op] : started_) sight[p].needed |= !op->is_completed() && op->needs_peer(p);
  }
  throw_root_cause(find_root_cause(sight, rank_), rank_, [this](int r) { return procs_[r].pid; });
}

void NvshmemTransport::copy_notices(Stream s) {
  CopyBatch batch;
  batch.add(notice_mirror_, word(layout_.notice(0)), sizeof(uint64_t) * world_);
  ops_.copy_batch(s, batch);
}

void NvshmemTransport::notify_peers(uint64_t notice) {
  if (notified_.exchange(true) || arena_ == nullptr) return;
  try {
    for (int p = 0; p < world_; ++p) {
      if (p != rank_) shmem_.signal_op_on_stream(word(layout_.notice(rank_)), notice, ShmemSignalOp::kSet, p, notice_stream_);
    }
    // Landed before we return: a failing process often exits right after, and a notice still
    // queued then is lost (peers would report our death, not its cause). Signal ops only.
    ops_.synchronize(notice_stream_);
  } catch (...) {
    // Best effort: peers that miss the notice fail by timeout.
  }
}

bool NvshmemTransport::any_busy() const {
  if (gate_.waiting()) return true;
  for (const auto* v : {&send_, &recv_, &audit_, &confirm_, &receipt_})
    for (const auto& s : *v)
      if (s.busy()) return true;
  return false;
}

void NvshmemTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  std::unique_lock<std::mutex> lock(wake_mu_);
  wake_cv_.wait_for(lock, any_busy() ? std::min(timeout, kPollWhileBusy) : timeout,
                    [&] { return epoch_.load(std::memory_order_acquire) != epoch; });
}

void NvshmemTransport::wake() {
  {
    std::lock_guard<std::mutex> lock(wake_mu_);
    epoch_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_cv_.notify_all();
}

}  // namespace

std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops,
                                                  ShmemOps& shmem) {
  check_device(ops, config.cuda_device, "nvshmem");  // NVSHMEM's init exits the process without a GPU
  return std::make_unique<NvshmemTransport>(bootstrap, config, ops, shmem);
}

}  // namespace freescale

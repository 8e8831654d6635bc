// The NVSHMEM transport (see cpp/nvshmem_layout.h for the arena and the lane rules). Every
// cross-rank dependency is a stream wait on an NVSHMEM signal; the host only enqueues, checks
// local events and audits. Per chunk n of the pair-lane (me -> dst, lane):
//
//   send stream (dst, lane):  wait freed[dst][lane] >= n + 1 - S     (dst copied out chunk n - S)
//                             copy input piece(s) -> staging slot     (copy engines)
//                             putmem_signal staging -> dst's recv slot, ready[me][lane] = n + 1 (SET)
//   after an op's last chunk: signal audit[me][seq] = ((seq + 1) << 32) | chunks so far, at dst
//
//   recv stream (src, lane):  wait ready[src][lane] >= n + 1; copy slot -> output piece(s);
//                             signal freed[me][lane] = n + 1 at src
//   after the op's chunks:    wait audit[src][seq]; copy it to the host; signal recvd[me][seq] at
//                             src; event -> the host compares the audit with its own count
//   confirm stream (lane):    wait recvd[p][seq] >= seq + 1 for every p; event -> op confirmed
//
// Streams are per (peer, lane) so that a stream blocked on one pair never holds another pair's
// traffic. The staging copy makes every put's source symmetric memory (network peers need that).
// An op is started once its submitter's stream passed its submission (SubmitGate, shared with the
// copy-engine transport); disagreeing split sizes or priorities fail the op with kSizeMismatch
// (audit) or kTimeout (a wait that never ends), never a silent wrong result.
#include "cuda/nvshmem_transport.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cpp/host_layout.h"
#include "cpp/layout.h"
#include "cpp/nvshmem_layout.h"
#include "cpp/op_state.h"
#include "cpp/peer_liveness.h"
#include "cpp/segment_map.h"
#include "cpp/transfer.h"
#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"
#include "cuda/nvshmem_api.h"
#include "cuda/submit_gate.h"

namespace freescale {
namespace {

constexpr std::chrono::microseconds kPollWhileBusy{50};   // GPU progress rings no doorbell
constexpr uint64_t kSendsAhead = kNvshmemSlotsPerLane + 1;  // chunks queued per send stream
constexpr uint64_t kHeapMargin = 64ull << 20;              // symmetric heap beyond our arena

std::atomic<bool> g_nvshmem_taken{false};  // NVSHMEM is initialized once per process

uint64_t chunks_of(uint64_t bytes, uint64_t chunk) { return bytes == 0 ? 0 : (bytes + chunk - 1) / chunk; }

class NvshmemTransport final : public Transport {
 public:
  NvshmemTransport(Bootstrap& bootstrap, const Config& config);
  ~NvshmemTransport() override;

  const char* name() const override { return "nvshmem"; }
  void on_submit(OpState& op) override;
  void stream_wait(const OpState& op, uintptr_t stream) override;
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  void send_chunk(const Transfer& t, const Chunk& c) override;
  bool poll() override;
  uint64_t max_ops_in_flight() const override { return kOpWindow; }
  void check_peers() override {}  // a silent peer shows as a timeout of the ops that need it
  uint32_t activity_epoch() const override { return epoch_.load(std::memory_order_acquire); }
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  void wake() override;
  void abort(ErrorCode) override { broken_ = true; }
  void close() override {}

 private:
  struct Landing {  // the receive part (op, src): its copies, audit and receipt are queued
    uint64_t seq;
    int src;
    cudaEvent_t event;
    uint64_t expected_audit;
  };
  struct Confirm {  // every peer's receipt of op `seq` is awaited on a confirm stream
    uint64_t seq;
    cudaEvent_t event;
  };

  int pair(int peer, int lane) const { return peer * kNvshmemLanes + lane; }
  uint64_t* signal(uint64_t offset) const { return reinterpret_cast<uint64_t*>(arena_ + offset); }
  cudaStream_t stream(std::vector<cudaStream_t>& streams, int index);
  // Queues and finishes the receive parts, the confirmation and the transfers of one op.
  void start(const std::shared_ptr<OpState>& op);
  void enqueue_receives(const OpState& op, int lane);
  void enqueue_confirm(const OpState& op, int lane);
  bool streams_idle();

  int rank_, world_, device_;
  uint64_t chunk_bytes_;
  const NvshmemApi* api_ = nullptr;
  NvshmemArenaLayout layout_;
  uint8_t* arena_ = nullptr;  // symmetric: the same offsets address every rank's arena
  bool batch_api_ = true;
  bool broken_ = false;

  std::vector<cudaStream_t> send_streams_;     // [world * lanes], created at first use
  std::vector<cudaStream_t> recv_streams_;     // [world * lanes]
  std::vector<cudaStream_t> confirm_streams_;  // [lanes]
  uint64_t* audit_mirror_ = nullptr;  // pinned: [kOpWindow][world] audits copied from the arena
  SubmitGate gate_;                   // callers' streams: start gate, events, completion flags

  // Progress thread only.
  std::map<uint64_t, std::shared_ptr<OpState>> started_;
  std::vector<std::deque<uint64_t>> send_fifo_;         // [pair] ops (seq) still to send, in order
  std::vector<uint64_t> sent_chunks_;                   // [pair] non-empty chunks put so far
  std::vector<uint64_t> recv_chunks_;                   // [pair] non-empty chunks expected so far
  std::vector<std::deque<cudaEvent_t>> sends_in_flight_;  // [pair] an event after each queued put
  std::vector<Landing> landings_;
  std::vector<Confirm> confirms_;

  std::atomic<uint32_t> epoch_{0};
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
};

NvshmemTransport::NvshmemTransport(Bootstrap& bootstrap, const Config& config)
    : rank_(bootstrap.rank()),
      world_(bootstrap.size()),
      device_(config.cuda_device),
      chunk_bytes_(config.chunk_bytes),
      layout_(NvshmemArenaLayout::plan(world_, config.chunk_bytes, kOpWindow)),
      send_streams_(static_cast<size_t>(world_ * kNvshmemLanes), nullptr),
      recv_streams_(static_cast<size_t>(world_ * kNvshmemLanes), nullptr),
      confirm_streams_(kNvshmemLanes, nullptr),
      send_fifo_(static_cast<size_t>(world_ * kNvshmemLanes)),
      sent_chunks_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      recv_chunks_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      gate_(device_),
      sends_in_flight_(static_cast<size_t>(world_ * kNvshmemLanes)) {
  // Local steps first; their outcome is announced so that every rank fails together, and
  // nobody enters NVSHMEM's collective init while a peer cannot.
  auto announce = [&](ErrorCode code, const std::string& error, const std::string& payload) {
    std::vector<std::string> all = bootstrap.allgather(std::to_string(static_cast<int>(code)) + "\n" + error + "\n" + payload);
    std::vector<std::string> payloads;
    for (int p = 0; p < world_; ++p) {
      size_t a = all[p].find('\n');
      size_t b = a == std::string::npos ? a : all[p].find('\n', a + 1);
      if (b == std::string::npos) throw CommError(ErrorCode::kCommError, "nvshmem transport setup: malformed announcement");
      std::string what = all[p].substr(a + 1, b - a - 1);
      if (!what.empty()) {
        throw Error(static_cast<ErrorCode>(std::stoi(all[p].substr(0, a))),
                    "nvshmem transport setup failed on rank " + std::to_string(p) + ": " + what);
      }
      payloads.push_back(all[p].substr(b + 1));
    }
    return payloads;
  };
  ErrorCode code = ErrorCode::kSystem;
  bool took = false;  // this transport holds the process's NVSHMEM
  std::string error, uid_hex;
  std::optional<DeviceGuard> guard;
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  try {
    took = !g_nvshmem_taken.exchange(true);
    if (!took) {
      code = ErrorCode::kUnsupported;
      throw Error(code, "NVSHMEM already serves another communicator of this process (it is initialized once, over one "
                        "group); use FREESCALE_TRANSPORT=ce for this one or one NVSHMEM group per process");
    }
    code = ErrorCode::kUnsupported;
    api_ = &NvshmemApi::get();
    code = ErrorCode::kSystem;
    guard.emplace(device_);
    gate_.allocate();
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&audit_mirror_), sizeof(uint64_t) * kOpWindow * world_,
                             cudaHostAllocDefault),
               "cudaHostAlloc (audit mirror)");
    if (rank_ == 0) {
      if (api_->get_uniqueid(&uid) != 0) throw Error(code, "nvshmemx_get_uniqueid failed");
      uid_hex = to_hex(&uid, sizeof(uid));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<std::string> got;
  try {
    got = announce(code, error, std::to_string(chunk_bytes_) + "\n" + host_identity() + "\n" + uid_hex);
  } catch (...) {
    if (took) g_nvshmem_taken.store(false);  // NVSHMEM was not started: a later try may have it
    throw;
  }
  // Each payload: chunk bytes, host identity, rank 0's unique id (others: empty).
  bool one_host = true;
  std::string uid_of_rank0;
  for (int p = 0; p < world_; ++p) {
    size_t a = got[p].find('\n');
    size_t b = a == std::string::npos ? a : got[p].find('\n', a + 1);
    if (b == std::string::npos) throw CommError(ErrorCode::kCommError, "nvshmem transport setup: malformed announcement");
    std::string chunk = got[p].substr(0, a);
    if (chunk != std::to_string(chunk_bytes_)) {
      throw InvalidArgument("ranks use different chunk sizes (FREESCALE_CHUNK_BYTES): rank " + std::to_string(p) +
                            " has " + chunk + ", rank " + std::to_string(rank_) + " " + std::to_string(chunk_bytes_) +
                            "; set one value everywhere");
    }
    one_host = one_host && got[p].substr(a + 1, b - a - 1) == host_identity();
    if (p == 0) uid_of_rank0 = got[p].substr(b + 1);
  }
  from_hex(uid_of_rank0, &uid, sizeof(uid));
  if (one_host && std::getenv("NVSHMEM_REMOTE_TRANSPORT") == nullptr) {
    setenv("NVSHMEM_REMOTE_TRANSPORT", "none", 0);  // one node: no network transport to probe for
  }

  // NVSHMEM's collective init (host library only: we launch no NVSHMEM device code), then the
  // arena. The heap must hold it: NVSHMEM_SYMMETRIC_SIZE is raised when the user did not set it.
  try {
    if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr) {
      uint64_t heap = std::max<uint64_t>(1ull << 30, layout_.num_bytes() + kHeapMargin);
      setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap).c_str(), 0);
    }
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (api_->set_attr_uniqueid_args(rank_, world_, &uid, &attr) != 0) throw Error(code, "nvshmemx_set_attr_uniqueid_args failed");
    int status = api_->hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
    if (status != 0) {
      throw Error(code, "nvshmemx_hostlib_init_attr returned " + std::to_string(status) +
                            " (NVSHMEM_DEBUG=INFO tells why; several ranks on one GPU need MPS for signal waits)");
    }
    error.clear();
  } catch (const std::exception& e) {
    error = e.what();
  }
  announce(code, error, "");
  try {
    arena_ = static_cast<uint8_t*>(api_->malloc(layout_.num_bytes()));  // collective
    if (arena_ == nullptr) throw Error(code, "nvshmem_malloc of " + std::to_string(layout_.num_bytes()) + " bytes failed");
    check_cuda(cudaMemset(arena_ + layout_.signals_offset(), 0, layout_.signal_bytes()), "cudaMemset (signals)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (signals zeroed)");
  } catch (const std::exception& e) {
    error = e.what();
  }
  announce(code, error, "");  // also: nobody signals into an arena not zeroed yet
}

NvshmemTransport::~NvshmemTransport() {
  // Best effort, never throws. NVSHMEM's teardown and nvshmem_free are collective (a closing rank
  // cannot count on its peers): the arena and NVSHMEM stay for the life of the process.
  DeviceGuard guard(device_, std::nothrow);
  bool idle = streams_idle();  // a stream blocked on a failed peer's signal never drains
  for (auto* streams : {&send_streams_, &recv_streams_, &confirm_streams_}) {
    for (cudaStream_t s : *streams) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }
  if (idle) {
    for (const Landing& l : landings_) cudaEventDestroy(l.event);
    for (const Confirm& c : confirms_) cudaEventDestroy(c.event);
    for (auto& q : sends_in_flight_) {
      for (cudaEvent_t ev : q) cudaEventDestroy(ev);
    }
    if (audit_mirror_ != nullptr) cudaFreeHost(audit_mirror_);
  } else {
    gate_.leak();  // pending GPU work may still write them: leaked on purpose
  }
  cudaGetLastError();
}

bool NvshmemTransport::streams_idle() {
  for (auto* streams : {&send_streams_, &recv_streams_, &confirm_streams_}) {
    for (cudaStream_t s : *streams) {
      if (s != nullptr && cudaStreamQuery(s) != cudaSuccess) return false;
    }
  }
  return true;
}

cudaStream_t NvshmemTransport::stream(std::vector<cudaStream_t>& streams, int index) {
  cudaStream_t& s = streams[static_cast<size_t>(index)];
  if (s == nullptr) check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

void NvshmemTransport::on_submit(OpState& op) { gate_.on_submit(op); }

void NvshmemTransport::stream_wait(const OpState& op, uintptr_t stream) { gate_.stream_wait(op, stream); }

void NvshmemTransport::post(const std::shared_ptr<OpState>& op) {
  use_device_on_progress_thread(device_);
  gate_.post(op);
  gate_.start_ready([this](const std::shared_ptr<OpState>& ready) { start(ready); });
}

void NvshmemTransport::start(const std::shared_ptr<OpState>& op) {
  started_[op->seq] = op;
  int lane = nvshmem_lane(op->priority);
  for (int p = 0; p < world_; ++p) send_fifo_[static_cast<size_t>(pair(p, lane))].push_back(op->seq);
  enqueue_receives(*op, lane);
  enqueue_confirm(*op, lane);
}

void NvshmemTransport::enqueue_receives(const OpState& op, int lane) {
  for (int src = 0; src < world_; ++src) {
    const auto index = static_cast<size_t>(pair(src, lane));
    cudaStream_t s = stream(recv_streams_, pair(src, lane));
    const uint64_t bytes = op.layout.recv_bytes[src];
    const uint64_t first = recv_chunks_[index];
    const uint64_t chunks = chunks_of(bytes, chunk_bytes_);
    for (uint64_t k = 0; k < chunks; ++k) {
      const uint64_t n = first + k;
      const uint64_t offset = k * chunk_bytes_;
      const uint64_t len = std::min(chunk_bytes_, bytes - offset);
      api_->signal_wait_until_on_stream(signal(layout_.ready(src, lane)), NVSHMEM_CMP_GE, n + 1, s);
      CopyList copies;
      copies.to_recv_block(op, src, offset, len, arena_ + layout_.recv_slot(src, lane, n));
      copies.enqueue(s, &batch_api_);
      api_->signal_op_on_stream(signal(layout_.freed(rank_, lane)), n + 1, NVSHMEM_SIGNAL_SET, src, s);
    }
    recv_chunks_[index] = first + chunks;
    // The sender's audit of this op (set after its last chunk), to the host; then our receipt.
    uint64_t* audit = signal(layout_.audit(src, op.seq));
    api_->signal_wait_until_on_stream(audit, NVSHMEM_CMP_GE, nvshmem_audit_value(op.seq, 0), s);
    check_cuda(cudaMemcpyAsync(audit_mirror_ + (op.seq % kOpWindow) * world_ + src, audit, sizeof(uint64_t),
                               cudaMemcpyDeviceToHost, s),
               "cudaMemcpyAsync (audit)");
    api_->signal_op_on_stream(signal(layout_.recvd(rank_, op.seq)), op.seq + 1, NVSHMEM_SIGNAL_SET, src, s);
    cudaEvent_t ev = gate_.take_event();
    check_cuda(cudaEventRecord(ev, s), "cudaEventRecord (receive part)");
    landings_.push_back(Landing{op.seq, src, ev, nvshmem_audit_value(op.seq, recv_chunks_[index])});
  }
}

void NvshmemTransport::enqueue_confirm(const OpState& op, int lane) {
  cudaStream_t s = stream(confirm_streams_, lane);
  for (int p = 0; p < world_; ++p) {
    api_->signal_wait_until_on_stream(signal(layout_.recvd(p, op.seq)), NVSHMEM_CMP_GE, op.seq + 1, s);
  }
  cudaEvent_t ev = gate_.take_event();
  check_cuda(cudaEventRecord(ev, s), "cudaEventRecord (confirmation)");
  confirms_.push_back(Confirm{op.seq, ev});
}

bool NvshmemTransport::can_send(const Transfer& t) const {
  if (!gate_.started(*t.op)) return false;  // its submitter's stream has not got there yet
  const auto index = static_cast<size_t>(pair(t.peer, nvshmem_lane(t.op->priority)));
  // FIFO within a pair-lane (the receiver counts on it), and a bounded queue on its stream.
  return !send_fifo_[index].empty() && send_fifo_[index].front() == t.op->seq && sends_in_flight_[index].size() < kSendsAhead;
}

void NvshmemTransport::send_chunk(const Transfer& t, const Chunk& c) {
  use_device_on_progress_thread(device_);
  const OpState& op = *t.op;
  const int lane = nvshmem_lane(op.priority);
  const auto index = static_cast<size_t>(pair(t.peer, lane));
  cudaStream_t s = stream(send_streams_, pair(t.peer, lane));
  if (c.bytes > chunk_bytes_) throw Error(ErrorCode::kInternal, "chunk larger than an nvshmem slot");
  if (c.bytes > 0) {
    const uint64_t n = sent_chunks_[index]++;
    if (n >= kNvshmemSlotsPerLane) {  // the receiver copied out the slot's previous chunk
      api_->signal_wait_until_on_stream(signal(layout_.freed(t.peer, lane)), NVSHMEM_CMP_GE, n + 1 - kNvshmemSlotsPerLane, s);
    }
    uint8_t* staging = arena_ + layout_.staging_slot(t.peer, lane, n);
    CopyList copies;
    copies.from_send_block(op, t.peer, c.offset, c.bytes, staging);
    copies.enqueue(s, &batch_api_);
    api_->putmem_signal_on_stream(arena_ + layout_.recv_slot(rank_, lane, n), staging, c.bytes,
                                  signal(layout_.ready(rank_, lane)), n + 1, NVSHMEM_SIGNAL_SET, t.peer, s);
    cudaEvent_t ev = gate_.take_event();
    check_cuda(cudaEventRecord(ev, s), "cudaEventRecord (put)");
    sends_in_flight_[index].push_back(ev);
  }
  if (c.offset + c.bytes == t.bytes) {  // the transfer's last chunk (or the one empty chunk)
    api_->signal_op_on_stream(signal(layout_.audit(rank_, op.seq)), nvshmem_audit_value(op.seq, sent_chunks_[index]),
                              NVSHMEM_SIGNAL_SET, t.peer, s);
    send_fifo_[index].pop_front();
  }
}

bool NvshmemTransport::poll() {
  use_device_on_progress_thread(device_);
  bool moved = gate_.start_ready([this](const std::shared_ptr<OpState>& op) { start(op); });
  for (auto& q : sends_in_flight_) {
    while (!q.empty() && gate_.event_done(q.front(), "an NVSHMEM put failed")) {
      q.pop_front();
      moved = true;
    }
  }
  for (auto it = landings_.begin(); it != landings_.end();) {
    if (!gate_.event_done(it->event, "a receive of the nvshmem transport failed")) {
      ++it;
      continue;
    }
    const uint64_t audit = audit_mirror_[(it->seq % kOpWindow) * world_ + it->src];
    auto op = started_.find(it->seq);
    if (audit != it->expected_audit) {
      throw CommError(ErrorCode::kSizeMismatch,
                      "all_to_all op #" + std::to_string(it->seq) + ": rank " + std::to_string(rank_) + " expected " +
                          std::to_string(it->expected_audit & 0xffffffffull) + " chunks so far from rank " +
                          std::to_string(it->src) + ", which sent " + std::to_string(audit & 0xffffffffull) +
                          ": the ranks' split sizes (or priorities) disagree");
    }
    if (op != started_.end() && !op->second->is_completed()) {
      op->second->recv_finished[it->src] = 1;
      --op->second->recv_parts_left;
      op->second->part_done();
    }
    it = landings_.erase(it);
    moved = true;
  }
  for (auto it = confirms_.begin(); it != confirms_.end();) {
    if (!gate_.event_done(it->event, "waiting for the peers' receipts failed")) {
      ++it;
      continue;
    }
    auto op = started_.find(it->seq);
    if (op != started_.end() && !op->second->is_completed()) {
      op->second->confirmed = true;
      op->second->part_done();
    }
    it = confirms_.erase(it);
    moved = true;
  }
  for (auto it = started_.begin(); it != started_.end();) it = it->second->is_completed() ? started_.erase(it) : std::next(it);
  return moved;
}

void NvshmemTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  bool busy = gate_.waiting() || !landings_.empty() || !confirms_.empty();
  for (const auto& q : sends_in_flight_) busy = busy || !q.empty();
  std::unique_lock<std::mutex> lock(wake_mu_);
  wake_cv_.wait_for(lock, busy ? std::min(timeout, kPollWhileBusy) : timeout,
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

std::string nvshmem_library_path() { return NvshmemApi::get().path; }

std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap, const Config& config) {
  check_cuda_device(config.cuda_device, "nvshmem");  // nvshmem_init exits the process without a GPU
  return std::make_unique<NvshmemTransport>(bootstrap, config);
}

}  // namespace freescale

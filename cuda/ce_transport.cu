// The copy-engine transport. The control plane is the host transport's (rings of slot headers in
// a shared host segment, posted / received counters, doorbells, liveness); payloads move through
// each rank's device arena (CeArenaLayout, shared with peers by CUDA IPC):
//
//   sender's comm stream:   copy input piece(s) -> own arena slot;  write head = index + 1
//   receiver (host) polls head, reads the header, then on its comm stream:
//                           copy peer's arena slot -> output piece(s);  write peer's tail = index + 1
//
// Copies go through cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute (copy
// engines, also between processes on one GPU); head/tail are written by the GPU with
// cuStreamWriteValue64 into the host segments (registered, device-mapped), so no copy waits for a
// host round trip. An op is posted (its first copy may start, peers may send to it) once its
// submitter's stream passed its submission, and Work.wait() is a stream wait on its completion
// flag (both: SubmitGate). A receive part finishes when an event after its last copy completed.
#include "cuda/ce_transport.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "cpp/ce_arena_layout.h"
#include "cpp/host_transport.h"
#include "cpp/segment_map.h"
#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"
#include "cuda/submit_gate.h"

namespace freescale {
namespace {

constexpr std::chrono::microseconds kPollWhileBusy{50};  // GPU writes ring no doorbell: poll

class CeTransport final : public HostTransport {
 public:
  CeTransport(Bootstrap& bootstrap, const Config& config);
  ~CeTransport() override;

  const char* name() const override { return "ce"; }
  void on_submit(OpState& op) override;
  void stream_wait(const OpState& op, uintptr_t stream) override;
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  bool poll() override;
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;

 protected:
  void fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset, uint64_t bytes) override;
  const uint8_t* slot_payload(int src, uint64_t index, SlotHeader* slot) const override;
  void release_slot(int src, uint64_t index) override;
  void land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) override;

 private:
  struct Landing {  // a receive part whose last copy was queued
    uint64_t seq;
    int src;
    cudaEvent_t event;  // recorded after that copy
  };
  // The progress thread's device (set once per thread). Callers' threads use DeviceGuard.
  void use_device() const;
  // Posts to the host control plane (in program order) the ops whose submitter's stream passed
  // their submission (SubmitGate).
  bool post_ready_ops();
  // Writes `value` to `counter` (in rank p's control segment) once the stream's copies so far landed.
  void write_value(int p, const std::atomic<uint64_t>* counter, uint64_t value);

  int device_;
  const DriverApi& driver_;
  cudaStream_t stream_ = nullptr;  // the comm stream: every copy and counter write
  std::vector<CeArenaLayout> arenas_;  // [world] each rank's arena layout
  std::vector<uint8_t*> arena_ptr_;    // [world] mapped base of each rank's arena (ours: own)
  std::vector<void*> registered_;      // host segments registered with CUDA
  std::vector<CUdeviceptr> segment_device_;  // [world] device address of each control segment
  bool batch_api_ = true;              // cudaMemcpyBatchAsync works here (else per-copy)
  SubmitGate gate_;                    // callers' streams: start gate, events, completion flags
  std::vector<Landing> landing_;       // progress thread only
};

CeTransport::CeTransport(Bootstrap& bootstrap, const Config& config)
    : HostTransport(bootstrap, config, /*inline_payload=*/false),
      device_(config.cuda_device),
      driver_(DriverApi::get()),
      arenas_(static_cast<size_t>(world_)),
      arena_ptr_(static_cast<size_t>(world_), nullptr),
      gate_(device_) {
  // Local setup; a failure is announced so that every rank fails together instead of hanging.
  std::string error, handle_hex;
  CeArenaLayout mine = CeArenaLayout::plan(world_, rank_, config.chunk_bytes, config.arena_bytes);
  std::optional<DeviceGuard> guard;  // the caller's device comes back when setup ends
  try {
    guard.emplace(device_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    gate_.allocate();
    if (mine.num_bytes() > 0) {
      check_cuda(cudaMalloc(reinterpret_cast<void**>(&arena_ptr_[rank_]), mine.num_bytes()), "cudaMalloc (ce arena)");
      cudaIpcMemHandle_t handle;
      check_cuda(cudaIpcGetMemHandle(&handle, arena_ptr_[rank_]), "cudaIpcGetMemHandle");
      handle_hex = to_hex(&handle, sizeof(handle));
    }
    for (int p = 0; p < world_; ++p) {  // counters the GPU writes: our heads, peers' tails
      check_cuda(cudaHostRegister(segment_base(p), segment_bytes(p), cudaHostRegisterMapped | cudaHostRegisterPortable),
                 "cudaHostRegister (control segment)");
      registered_.push_back(segment_base(p));
      void* device = nullptr;
      check_cuda(cudaHostGetDevicePointer(&device, segment_base(p), 0), "cudaHostGetDevicePointer (control segment)");
      segment_device_.push_back(reinterpret_cast<CUdeviceptr>(device));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::string blob = error + "\n" + std::to_string(mine.slots_per_ring) + "\n" + std::to_string(mine.slot_bytes) + "\n" + handle_hex;
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
    if (!f[0].empty()) throw CommError(ErrorCode::kSystem, "ce transport setup failed on rank " + std::to_string(p) + ": " + f[0]);
    arenas_[p] = CeArenaLayout{world_, p, std::stoull(f[1]), std::stoull(f[2])};
    if (p == rank_ || f[3].empty() || !open_error.empty()) continue;
    try {
      cudaIpcMemHandle_t handle;
      from_hex(f[3], &handle, sizeof(handle));
      void* mapped = nullptr;
      check_cuda(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
      arena_ptr_[p] = static_cast<uint8_t*>(mapped);
    } catch (const std::exception& e) {
      open_error = "rank " + std::to_string(rank_) + " could not map rank " + std::to_string(p) + "'s arena: " + e.what();
    }
  }
  for (const auto& s : bootstrap.allgather(open_error)) {
    if (!s.empty()) throw CommError(ErrorCode::kSystem, "ce transport setup failed: " + s);
  }
}

CeTransport::~CeTransport() {
  // Best effort, never throws: the stream may hold work of failed ops.
  DeviceGuard guard(device_, std::nothrow);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (const Landing& l : landing_) cudaEventDestroy(l.event);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && arena_ptr_[p] != nullptr) cudaIpcCloseMemHandle(arena_ptr_[p]);
  }
  if (arena_ptr_[rank_] != nullptr) cudaFree(arena_ptr_[rank_]);
  for (void* base : registered_) cudaHostUnregister(base);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

void CeTransport::use_device() const { use_device_on_progress_thread(device_); }

void CeTransport::on_submit(OpState& op) { gate_.on_submit(op); }

void CeTransport::stream_wait(const OpState& op, uintptr_t stream) { gate_.stream_wait(op, stream); }

void CeTransport::post(const std::shared_ptr<OpState>& op) {
  use_device();
  gate_.post(op);
  post_ready_ops();
}

bool CeTransport::post_ready_ops() {
  return gate_.start_ready([this](const std::shared_ptr<OpState>& op) { HostTransport::post(op); });
}

bool CeTransport::can_send(const Transfer& t) const { return gate_.started(*t.op) && HostTransport::can_send(t); }

void CeTransport::write_value(int p, const std::atomic<uint64_t>* counter, uint64_t value) {
  auto offset = reinterpret_cast<const char*>(counter) - static_cast<const char*>(segment_base(p));
  // The default flags order the write after the stream's earlier copies (memory barrier).
  check_cu(driver_.stream_write_value64(reinterpret_cast<CUstream>(stream_), segment_device_[p] + offset, value,
                                        CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue64");
}

void CeTransport::fill_slot(int peer, uint64_t index, SlotHeader*, const OpState& op, uint64_t offset, uint64_t bytes) {
  use_device();
  if (bytes > arenas_[rank_].slot_bytes) throw Error(ErrorCode::kInternal, "chunk larger than a ce arena slot");
  CopyList copies;
  copies.from_send_block(op, peer, offset, bytes, arena_ptr_[rank_] + arenas_[rank_].slot_offset(peer, index));
  copies.enqueue(stream_, &batch_api_);
  write_value(rank_, &ring_of(rank_, peer)->head, index + 1);
}

const uint8_t* CeTransport::slot_payload(int src, uint64_t index, SlotHeader*) const {
  return arena_ptr_[src] + arenas_[src].slot_offset(rank_, index);
}

void CeTransport::release_slot(int src, uint64_t index) {
  write_value(src, &ring_of(src, rank_)->tail, index + 1);  // after land()'s copies, in stream order
}

void CeTransport::land(int src, OpState& op, const SlotHeader& h, const uint8_t* payload, bool last) {
  use_device();
  CopyList copies;
  copies.to_recv_block(op, src, h.offset, h.bytes, payload);
  copies.enqueue(stream_, &batch_api_);
  if (!last) return;
  cudaEvent_t ev = gate_.take_event();
  check_cuda(cudaEventRecord(ev, stream_), "cudaEventRecord (receive part)");
  landing_.push_back(Landing{op.seq, src, ev});
}

bool CeTransport::poll() {
  use_device();
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
  return moved;
}

void CeTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  // Heads and tails written by GPUs ring no doorbell: while copies are in flight, look often.
  bool busy = ops_pending() || gate_.waiting();
  HostTransport::wait_for_activity(epoch, busy ? std::min(timeout, kPollWhileBusy) : timeout);
}

}  // namespace

std::unique_ptr<Transport> make_ce_transport(Bootstrap& bootstrap, const Config& config) {
  check_cuda_device(config.cuda_device, "ce");
  return std::make_unique<CeTransport>(bootstrap, config);
}

}  // namespace freescale

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
// host round trip. An op is posted (its first copy may start, peers may send to it) once the event
// recorded on its submitter's stream at submission completed: the host checks, so the shared comm
// stream never waits on a caller. A receive part finishes when an event after its last copy
// completed. Every op sets its completion flag (pinned, device-mapped: done[seq % kOpWindow] =
// seq + 1, ever increasing) when it completes or fails; stream_wait() is a cuStreamWaitValue64
// (GEQ) on it.
#include "cuda/ce_transport.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpp/ce_arena_layout.h"
#include "cpp/host_transport.h"
#include "cpp/segment_map.h"
#include "cuda/cuda_util.h"
#include "cuda/driver_api.h"

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
  // Posts (in program order) the ops whose submitter's stream passed their submission: their
  // input is written and their output free. The host waits, not the comm stream: a caller whose
  // stream waits for op N before submitting op N+1 would otherwise block op N's later copies
  // behind that wait on the shared comm stream (a deadlock).
  bool post_ready_ops();
  void copy(std::vector<void*>& dsts, std::vector<const void*>& srcs, std::vector<size_t>& sizes);
  // Writes `value` to `counter` (in rank p's control segment) once the stream's copies so far landed.
  void write_value(int p, const std::atomic<uint64_t>* counter, uint64_t value);
  cudaEvent_t take_event();

  int device_;
  const DriverApi& driver_;
  cudaStream_t stream_ = nullptr;  // the comm stream: every copy and counter write
  std::vector<CeArenaLayout> arenas_;  // [world] each rank's arena layout
  std::vector<uint8_t*> arena_ptr_;    // [world] mapped base of each rank's arena (ours: own)
  std::vector<void*> registered_;      // host segments registered with CUDA
  std::vector<CUdeviceptr> segment_device_;  // [world] device address of each control segment
  uint64_t* done_ = nullptr;           // pinned, mapped: [kOpWindow] completion flags
  CUdeviceptr done_device_ = 0;
  bool batch_api_ = true;              // cudaMemcpyBatchAsync works here (else per-copy)

  std::mutex submit_mu_;                                 // guards submitted_ and spare_events_
  std::unordered_map<const OpState*, cudaEvent_t> submitted_;  // op -> event on op.stream
  std::vector<cudaEvent_t> spare_events_;
  std::vector<Landing> landing_;                         // progress thread only
  std::deque<std::shared_ptr<OpState>> unready_;         // posted by the core, awaiting their event
  uint64_t ready_below_ = 0;                             // ops with seq < this are posted here
};

CeTransport::CeTransport(Bootstrap& bootstrap, const Config& config)
    : HostTransport(bootstrap, config, /*inline_payload=*/false),
      device_(config.cuda_device),
      driver_(DriverApi::get()),
      arenas_(static_cast<size_t>(world_)),
      arena_ptr_(static_cast<size_t>(world_), nullptr) {
  // Local setup; a failure is announced so that every rank fails together instead of hanging.
  std::string error, handle_hex;
  CeArenaLayout mine = CeArenaLayout::plan(world_, rank_, config.chunk_bytes, config.arena_bytes);
  std::optional<DeviceGuard> guard;  // the caller's device comes back when setup ends
  try {
    guard.emplace(device_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&done_), sizeof(uint64_t) * kOpWindow, cudaHostAllocMapped),
               "cudaHostAlloc (completion flags)");
    std::memset(done_, 0, sizeof(uint64_t) * kOpWindow);
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&done_device_), done_, 0), "cudaHostGetDevicePointer");
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
  for (auto& [op, ev] : submitted_) cudaEventDestroy(ev);
  for (cudaEvent_t ev : spare_events_) cudaEventDestroy(ev);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && arena_ptr_[p] != nullptr) cudaIpcCloseMemHandle(arena_ptr_[p]);
  }
  if (arena_ptr_[rank_] != nullptr) cudaFree(arena_ptr_[rank_]);
  for (void* base : registered_) cudaHostUnregister(base);
  if (done_ != nullptr) cudaFreeHost(done_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

void CeTransport::use_device() const { use_device_on_progress_thread(device_); }

cudaEvent_t CeTransport::take_event() {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (!spare_events_.empty()) {
      cudaEvent_t ev = spare_events_.back();
      spare_events_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev;
  check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  return ev;
}

void CeTransport::on_submit(OpState& op) {
  DeviceGuard guard(device_);
  cudaEvent_t ev = take_event();
  check_cuda(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(op.stream)), "cudaEventRecord (submitter's stream)");
  std::lock_guard<std::mutex> lock(submit_mu_);
  submitted_[&op] = ev;
}

bool CeTransport::post_ready_ops() {
  bool moved = false;
  while (!unready_.empty()) {
    std::shared_ptr<OpState> op = unready_.front();
    {
      std::lock_guard<std::mutex> lock(submit_mu_);
      auto it = submitted_.find(op.get());
      if (it != submitted_.end()) {  // else on_submit did not record one: nothing to wait for
        cudaError_t err = cudaEventQuery(it->second);
        if (err == cudaErrorNotReady) return moved;
        check_cuda(err, "the submitter's stream failed before an all_to_all");
        spare_events_.push_back(it->second);
        submitted_.erase(it);
      }
    }
    unready_.pop_front();
    ready_below_ = op->seq + 1;
    HostTransport::post(op);
    moved = true;
  }
  return moved;
}

bool CeTransport::can_send(const Transfer& t) const {
  return t.op->seq < ready_below_ && HostTransport::can_send(t);
}

void CeTransport::stream_wait(const OpState& op, uintptr_t stream) {
  DeviceGuard guard(device_);
  check_cu(driver_.stream_wait_value64(reinterpret_cast<CUstream>(stream), done_device_ + sizeof(uint64_t) * (op.seq % kOpWindow),
                                       op.seq + 1, CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue64 (op completion)");
}

void CeTransport::post(const std::shared_ptr<OpState>& op) {
  use_device();
  uint64_t* flag = done_ + op->seq % kOpWindow;
  uint64_t value = op->seq + 1;
  // Completed or failed, the flag moves: a stream waiting on a failed op must not hang (the
  // failure itself surfaces on the host).
  op->add_done_callback([flag, value] { reinterpret_cast<std::atomic<uint64_t>*>(flag)->store(value, std::memory_order_release); });
  unready_.push_back(op);
  post_ready_ops();
}

void CeTransport::copy(std::vector<void*>& dsts, std::vector<const void*>& srcs, std::vector<size_t>& sizes) {
  copy_on_copy_engines(stream_, dsts, srcs, sizes, &batch_api_);
}

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
  uint8_t* slot = arena_ptr_[rank_] + arenas_[rank_].slot_offset(peer, index);
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  uint64_t at = 0;
  for_each_piece(op.send, op.layout.send_offsets[peer], op.layout.send_segments, peer, offset, bytes,
                 [&](const uint8_t* piece, uint64_t n) {
                   dsts.push_back(slot + at);
                   srcs.push_back(piece);
                   sizes.push_back(n);
                   at += n;
                 });
  copy(dsts, srcs, sizes);
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
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  uint64_t at = 0;
  for_each_piece(op.recv, op.layout.recv_offsets[src], op.layout.recv_segments, src, h.offset, h.bytes,
                 [&](uint8_t* piece, uint64_t n) {
                   dsts.push_back(piece);
                   srcs.push_back(payload + at);
                   sizes.push_back(n);
                   at += n;
                 });
  copy(dsts, srcs, sizes);
  if (!last) return;
  cudaEvent_t ev = take_event();
  check_cuda(cudaEventRecord(ev, stream_), "cudaEventRecord (receive part)");
  landing_.push_back(Landing{op.seq, src, ev});
}

bool CeTransport::poll() {
  use_device();
  bool moved = post_ready_ops();
  moved = HostTransport::poll() || moved;
  for (auto it = landing_.begin(); it != landing_.end();) {
    cudaError_t err = cudaEventQuery(it->event);
    if (err == cudaErrorNotReady) {
      ++it;
      continue;
    }
    check_cuda(err, "a copy of the ce transport failed");
    {
      std::lock_guard<std::mutex> lock(submit_mu_);
      spare_events_.push_back(it->event);
    }
    if (std::shared_ptr<OpState> op = posted_op(it->seq)) finish_recv(*op, it->src);  // else it failed meanwhile
    it = landing_.erase(it);
    moved = true;
  }
  return moved;
}

void CeTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  // Heads and tails written by GPUs ring no doorbell: while copies are in flight, look often.
  bool busy = ops_pending() || !unready_.empty();
  HostTransport::wait_for_activity(epoch, busy ? std::min(timeout, kPollWhileBusy) : timeout);
}

}  // namespace

std::unique_ptr<Transport> make_ce_transport(Bootstrap& bootstrap, const Config& config) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    throw Error(ErrorCode::kUnsupported, "the ce transport needs a CUDA GPU and driver; none is visible here");
  }
  if (config.cuda_device < 0 || config.cuda_device >= count) {
    throw InvalidArgument("cuda_device " + std::to_string(config.cuda_device) + " is not one of the " +
                          std::to_string(count) + " visible GPUs");
  }
  return std::make_unique<CeTransport>(bootstrap, config);
}

}  // namespace freescale

#include "cuda/submit_gate.h"

#include <algorithm>
#include <atomic>

#include "cpp/host_layout.h"
#include "cuda/cuda_util.h"

namespace freescale {

SubmitGate::SubmitGate(int device) : device_(device), driver_(DriverApi::get()) {}

SubmitGate::~SubmitGate() {
  if (leaked_) return;
  DeviceGuard guard(device_, std::nothrow);
  for (auto& [op, ev] : submitted_) cudaEventDestroy(ev);
  for (cudaEvent_t ev : spare_) cudaEventDestroy(ev);
  if (done_ != nullptr) cudaFreeHost(done_);
  cudaGetLastError();
}

void SubmitGate::allocate() {
  check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&done_), sizeof(uint64_t) * kOpWindow, cudaHostAllocMapped),
             "cudaHostAlloc (completion flags)");
  std::fill(done_, done_ + kOpWindow, 0);
  check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&done_device_), done_, 0), "cudaHostGetDevicePointer");
}

cudaEvent_t SubmitGate::take_event() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spare_.empty()) {
      cudaEvent_t ev = spare_.back();
      spare_.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev;
  check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  return ev;
}

void SubmitGate::give_event(cudaEvent_t ev) {
  std::lock_guard<std::mutex> lock(mu_);
  spare_.push_back(ev);
}

bool SubmitGate::event_done(cudaEvent_t ev, const char* what) {
  cudaError_t err = cudaEventQuery(ev);
  if (err == cudaErrorNotReady) return false;
  check_cuda(err, what);
  give_event(ev);
  return true;
}

void SubmitGate::on_submit(OpState& op) {
  DeviceGuard guard(device_);
  cudaEvent_t ev = take_event();
  check_cuda(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(op.stream)), "cudaEventRecord (submitter's stream)");
  std::lock_guard<std::mutex> lock(mu_);
  submitted_[&op] = ev;
}

void SubmitGate::stream_wait(const OpState& op, uintptr_t stream) {
  DeviceGuard guard(device_);
  check_cu(driver_.stream_wait_value64(reinterpret_cast<CUstream>(stream), done_device_ + sizeof(uint64_t) * (op.seq % kOpWindow),
                                       op.seq + 1, CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue64 (op completion)");
}

void SubmitGate::post(const std::shared_ptr<OpState>& op) {
  uint64_t* flag = done_ + op->seq % kOpWindow;
  uint64_t value = op->seq + 1;
  // Completed or failed, the flag moves: a stream waiting on a failed op must not hang (the
  // failure itself surfaces on the host).
  op->add_done_callback([flag, value] { reinterpret_cast<std::atomic<uint64_t>*>(flag)->store(value, std::memory_order_release); });
  unready_.push_back(op);
}

bool SubmitGate::submitter_passed(const OpState& op) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = submitted_.find(&op);
  if (it == submitted_.end()) return true;  // on_submit recorded nothing: nothing to wait for
  cudaError_t err = cudaEventQuery(it->second);
  if (err == cudaErrorNotReady) return false;
  check_cuda(err, "the submitter's stream failed before an all_to_all");
  spare_.push_back(it->second);
  submitted_.erase(it);
  return true;
}

}  // namespace freescale

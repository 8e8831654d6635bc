// Helpers the CUDA transports share. Include from .cu sources only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <new>
#include <string>
#include <vector>

namespace freescale {

class OpState;

// Throws Error(kUnsupported) when no GPU and driver are visible, InvalidArgument when `device` is
// not one of them. `transport` names the caller in the message.
void check_cuda_device(int device, const char* transport);

// Makes `device` current for a scope on a caller's thread, then restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  DeviceGuard(int device, std::nothrow_t);  // best effort, for destructors: never throws
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Sets the calling thread's device once, and its stream-capture mode to relaxed so that its
// calls stay legal while a user's thread captures a CUDA graph in global mode (torch's default).
// For the transports' progress threads only: callers' threads use DeviceGuard.
void use_device_on_progress_thread(int device);

// Enqueues the copies dsts[i] <- srcs[i] (sizes[i] bytes, device or mapped memory) on `stream`
// on copy engines: cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute, or one
// cudaMemcpyAsync each where the batch API is not supported (*batch_api turns false then).
void copy_on_copy_engines(cudaStream_t stream, std::vector<void*>& dsts, std::vector<const void*>& srcs,
                          std::vector<size_t>& sizes, bool* batch_api);

// The copies of one chunk between an op's (possibly scattered) buffer and a contiguous slot.
struct CopyList {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  // Bytes [offset, offset + bytes) of op's send block for `peer` -> `to`, back to back.
  void from_send_block(const OpState& op, int peer, uint64_t offset, uint64_t bytes, uint8_t* to);
  // `from`, back to back -> bytes [offset, offset + bytes) of op's receive block from `src`.
  void to_recv_block(const OpState& op, int src, uint64_t offset, uint64_t bytes, const uint8_t* from);
  // Enqueues them with copy_on_copy_engines.
  void enqueue(cudaStream_t stream, bool* batch_api) { copy_on_copy_engines(stream, dsts, srcs, sizes, batch_api); }
};

// Byte blobs (IPC handles, unique ids) as text for the bootstrap's allgather. from_hex throws
// CommError when `hex` does not hold exactly n bytes.
std::string to_hex(const void* data, size_t n);
void from_hex(const std::string& hex, void* data, size_t n);

}  // namespace freescale

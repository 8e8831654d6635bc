// Helpers the CUDA transports share, over the DeviceOps seam (plain C++, no CUDA headers).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "cuda/device_ops.h"

namespace freescale {

class OpState;

// Throws Error(kUnsupported) when `ops` sees no device, InvalidArgument when `device` is not one
// of them. `transport` names the caller in the message.
void check_device(DeviceOps& ops, int device, const char* transport);
// Error(kUnsupported) naming the first of `attrs` that `device` lacks, "" message if none.
// Returns that message (empty if every attribute is supported): callers announce it to every
// rank, so that all refuse together (and the backend falls back to NCCL) instead of hanging.
// Polls until each of `streams` ran out or failed (a faulted context runs nothing more), at most
// until `deadline`; `while_busy` runs before each wait for the ones still running. Returns those
// still running at the deadline; *failed: whether one failed. Throws only what while_busy throws.
std::vector<Stream> drain_streams(DeviceOps& ops, std::vector<Stream> streams,
                                  std::chrono::steady_clock::time_point deadline, bool* failed = nullptr,
                                  const std::function<void()>& while_busy = nullptr);

// Whether `device` can allocate memory that outlives its owner for peers (DeviceOps::shareable_alloc).
bool shareable_memory_supported(DeviceOps& ops, int device);

std::string missing_capability(DeviceOps& ops, int device, const char* transport,
                               std::initializer_list<DeviceAttribute> attrs);

// Makes `device` current for a scope on a caller's thread, then restores the caller's context
// (DeviceOps::current_context: a thread that had none is left with none, not given GPU 0's).
class DeviceGuard {
 public:
  DeviceGuard(DeviceOps& ops, int device);
  DeviceGuard(DeviceOps& ops, int device, std::nothrow_t);  // best effort, for destructors
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void enter(int device);

  DeviceOps& ops_;
  void* previous_ = nullptr;  // the caller's context
  bool restore_ = false;
};

// Around transport work on any thread: `device` current and the stream capture mode relaxed. On a
// user's thread (posting an op, driving a wait) its own context and mode come back after (it kept
// ours for good before); our own progress thread (cpp/thread_role.h) is bound once and stays.
class ProgressScope {
 public:
  ProgressScope(DeviceOps& ops, int device);
  ProgressScope(DeviceOps& ops, int device, std::nothrow_t);  // best effort, for teardown
  ~ProgressScope();
  ProgressScope(const ProgressScope&) = delete;
  ProgressScope& operator=(const ProgressScope&) = delete;

 private:
  DeviceOps& ops_;
  std::optional<DeviceGuard> device_;
  int capture_mode_ = -1;  // the caller's; -1: not changed
};

// A word of mapped host memory that a device writes asynchronously (cudaHostAlloc'd mirrors):
// read whole and afresh every time (acquire): never torn, kept in a register or hoisted out of
// a polling loop, as a plain read may be.
inline uint64_t read_mapped_word(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

// The copies of one chunk between an op's (possibly scattered) buffer and a contiguous slot.
struct CopyList {
  CopyBatch batch;

  // Bytes [offset, offset + bytes) of op's send block for `peer` -> `to`, back to back.
  void from_send_block(const OpState& op, int peer, uint64_t offset, uint64_t bytes, uint8_t* to);
  // `from`, back to back -> bytes [offset, offset + bytes) of op's receive block from `src`.
  void to_recv_block(const OpState& op, int src, uint64_t offset, uint64_t bytes, const uint8_t* from);
};

// Byte blobs (unique ids) as text for the bootstrap's allgather. from_hex throws CommError when
// `hex` does not hold exactly n bytes.
std::string to_hex(const void* data, size_t n);
void from_hex(const std::string& hex, void* data, size_t n);

}  // namespace freescale

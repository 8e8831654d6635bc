#include "cuda/device_util.h"

#include <new>
#include <thread>
#include <string>

#include "cpp/errors.h"
#include "cpp/op_state.h"
#include "cpp/thread_role.h"
#include "cpp/segment_map.h"

namespace freescale {

void check_device(DeviceOps& ops, int device, const char* transport) {
  int count = ops.device_count();
  if (count == 0) {
    throw Error(ErrorCode::kUnsupported,
                std::string("the ") + transport + " transport needs a CUDA GPU and driver; none is visible here");
  }
  if (device < 0 || device >= count) {
    throw InvalidArgument("cuda_device " + std::to_string(device) + " is not one of the " + std::to_string(count) +
                          " visible GPUs");
  }
}

const char* device_attribute_name(DeviceAttribute attr) {
  switch (attr) {
    case DeviceAttribute::kCanUse64BitStreamMemOps:
      return "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS";
    case DeviceAttribute::kCanMapHostMemory:
      return "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY";
    case DeviceAttribute::kHostRegisterSupported:
      return "CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED";
    case DeviceAttribute::kUnifiedAddressing:
      return "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING";
    case DeviceAttribute::kCanFlushRemoteWrites:
      return "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES";
    case DeviceAttribute::kVirtualMemoryManagement:
      return "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED";
    case DeviceAttribute::kPosixFdHandles:
      return "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED";
    case DeviceAttribute::kGpuDirectRdmaFlushWritesOptions:
      return "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS";
    case DeviceAttribute::kGpuDirectRdmaWritesOrdering:
      return "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING";
  }
  return "CU_DEVICE_ATTRIBUTE_?";
}

std::string missing_capability(DeviceOps& ops, int device, const char* transport,
                               std::initializer_list<DeviceAttribute> attrs) {
  for (DeviceAttribute attr : attrs) {
    if (ops.attribute(device, attr) != 0) continue;
    return std::string("the ") + transport + " transport needs " + device_attribute_name(attr) + ", which GPU " +
           std::to_string(device) + " does not support";
  }
  return "";
}

std::vector<Stream> drain_streams(DeviceOps& ops, std::vector<Stream> streams,
                                  std::chrono::steady_clock::time_point deadline, bool* failed,
                                  const std::function<void()>& while_busy) {
  while (true) {
    for (auto it = streams.begin(); it != streams.end();) {
      bool idle = true;
      try {
        idle = *it == 0 || ops.stream_idle(*it);
      } catch (...) {
        if (failed != nullptr) *failed = true;  // a failed stream runs nothing more
      }
      it = idle ? streams.erase(it) : std::next(it);
    }
    if (streams.empty()) return streams;
    if (while_busy) while_busy();
    if (std::chrono::steady_clock::now() >= deadline) return streams;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

bool shareable_memory_supported(DeviceOps& ops, int device) {
  return ops.attribute(device, DeviceAttribute::kVirtualMemoryManagement) != 0 &&
         ops.attribute(device, DeviceAttribute::kPosixFdHandles) != 0;
}

DeviceGuard::DeviceGuard(DeviceOps& ops, int device) : ops_(ops) { enter(device); }

DeviceGuard::DeviceGuard(DeviceOps& ops, int device, std::nothrow_t) : ops_(ops) {
  try {
    enter(device);
  } catch (...) {
    restore_ = false;  // best effort: the caller's next CUDA call sees the device it finds
  }
}

void DeviceGuard::enter(int device) {
  void* context = ops_.current_context();
  if (context != nullptr && ops_.current_device() == device) return;  // there already
  ops_.set_device(device);
  previous_ = context;
  restore_ = true;
}

DeviceGuard::~DeviceGuard() {
  if (!restore_) return;
  try {
    ops_.set_current_context(previous_);  // nullptr: the thread had none, and has none again
  } catch (...) {
    // Destructors never throw; the caller's next CUDA call sees the device it finds.
  }
}

namespace {
thread_local int t_bound_device = -1;  // our own progress thread's device, once bound

// Our own progress thread: bound to `device` (and relaxed) once, for good. False elsewhere.
bool bind_own_thread(DeviceOps& ops, int device) {
  if (!on_own_progress_thread()) return false;
  if (t_bound_device == device) return true;
  ops.set_device(device);
  if (t_bound_device < 0) ops.relax_capture_mode();
  t_bound_device = device;
  return true;
}
}  // namespace

ProgressScope::ProgressScope(DeviceOps& ops, int device) : ops_(ops) {
  if (bind_own_thread(ops, device)) return;
  device_.emplace(ops, device);
  capture_mode_ = ops.relax_capture_mode();
}

ProgressScope::ProgressScope(DeviceOps& ops, int device, std::nothrow_t) : ops_(ops) {
  try {
    if (bind_own_thread(ops, device)) return;
  } catch (...) {
    return;  // best effort
  }
  device_.emplace(ops, device, std::nothrow);
  try {
    capture_mode_ = ops_.relax_capture_mode();
  } catch (...) {
    capture_mode_ = -1;
  }
}

ProgressScope::~ProgressScope() {
  if (capture_mode_ < 0) return;
  try {
    ops_.restore_capture_mode(capture_mode_);
  } catch (...) {
  }
}

void CopyList::from_send_block(const OpState& op, int peer, uint64_t offset, uint64_t bytes, uint8_t* to) {
  for_each_piece(op.send, op.layout.send_offsets[peer], op.layout.send_segments, peer, offset, bytes,
                 [&](const uint8_t* piece, uint64_t n) {
                   batch.add(to, piece, n);
                   to += n;
                 });
}

void CopyList::to_recv_block(const OpState& op, int src, uint64_t offset, uint64_t bytes, const uint8_t* from) {
  for_each_piece(op.recv, op.layout.recv_offsets[src], op.layout.recv_segments, src, offset, bytes,
                 [&](uint8_t* piece, uint64_t n) {
                   batch.add(piece, from, n);
                   from += n;
                 });
}

std::string to_hex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

void from_hex(const std::string& hex, void* data, size_t n) {
  if (hex.size() != 2 * n) throw CommError(ErrorCode::kCommError, "transport setup: a malformed handle from a peer");
  auto* p = static_cast<unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
}

}  // namespace freescale

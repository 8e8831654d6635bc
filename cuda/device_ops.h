// The one seam through which the CUDA transports' host logic touches a device: CUDA runtime and
// driver calls (streams, events, copies, stream memory operations, host-registered memory, IPC)
// and NVSHMEM's host calls. Plain C++: the transports compile without nvcc and run in CI on the
// emulated device (testing/emulated_device.h); cuda/device_ops_cuda.cu and cuda/shmem_ops_nvshmem.cu
// are the thin real implementations.
//
// Handles are opaque integers: a Stream is a cudaStream_t (0 = the legacy default stream), an
// Event a cudaEvent_t, a DevicePtr a device address (CUdeviceptr). Every method throws
// Error(kSystem) naming the call on a device failure; none ever exits the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace freescale {

using Stream = uintptr_t;
using Event = uintptr_t;
using DevicePtr = uintptr_t;

// Stream waits on a 32/64-bit word: GEQ (wraparound-free compare), EQ, AND (any common bit).
enum class WaitCmp { kGeq, kEq, kAnd };

// A batch of copies (dsts[i] <- srcs[i], sizes[i] bytes) between device, peer-mapped device or
// mapped host memory.
struct CopyBatch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  void add(void* dst, const void* src, size_t n) {
    dsts.push_back(dst);
    srcs.push_back(src);
    sizes.push_back(n);
  }
  bool empty() const { return dsts.empty(); }
};

// Device capabilities a transport needs (cuDeviceGetAttribute), checked at setup: where one is
// missing, the first operation using it would fail instead. Values are the driver's
// CUdevice_attribute numbers (cuda.h 13.0; device_ops_cuda.cu static_asserts them).
enum class DeviceAttribute {
  kCanMapHostMemory = 19,          // CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: mapped pinned memory
  kUnifiedAddressing = 41,         // CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: one address space with the host
  // CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: a stream wait's flush flag and the flush memop
  // (NVSHMEM's own wait path); the same fact as bit kFlushWritesOptionMemops of 117.
  kCanFlushRemoteWrites = 98,
  kHostRegisterSupported = 99,     // CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: cudaHostRegister
  kVirtualMemoryManagement = 102,  // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: cuMemCreate/Map
  kPosixFdHandles = 103,           // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: a bitmask of kFlushWritesOption*;
  // the host option governs cudaDeviceFlushGPUDirectRDMAWrites (flush_remote_writes).
  kGpuDirectRdmaFlushWritesOptions = 117,
  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: the scope within which the device orders
  // network (GPUDirect RDMA) writes natively: 0 none, kRdmaWritesOrderingOwner, 200 all devices.
  kGpuDirectRdmaWritesOrdering = 118,
  kCanUse64BitStreamMemOps = 122,  // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: cuStreamWrite/WaitValue64
};
// Bits of kGpuDirectRdmaFlushWritesOptions (CUflushGPUDirectRDMAWritesOptions).
inline constexpr int kFlushWritesOptionHost = 1 << 0;    // cudaDeviceFlushGPUDirectRDMAWrites works
inline constexpr int kFlushWritesOptionMemops = 1 << 1;  // the flush flag / memop works (= attribute 98)
// kGpuDirectRdmaWritesOrdering at or above this: flushing to the owner is a no-op (cuda.h).
inline constexpr int kRdmaWritesOrderingOwner = 100;
// "CU_DEVICE_ATTRIBUTE_..." for messages.
const char* device_attribute_name(DeviceAttribute attr);

// Who executes a copy within one device (design.md §4): a copy engine only when the batch API
// carries cudaMemcpyFlagPreferOverlapWithCompute to a driver that honors it there (13.1, 13010,
// per NCCL's ce_coll.cc); an SM kernel otherwise. The transports' data paths and the emulated
// device both decide by this.
inline constexpr int kDriverWithCopyEnginesWithinADevice = 13010;
inline bool copies_within_a_device_on_copy_engines(int driver_version, bool batch_copies) {
  return batch_copies && driver_version >= kDriverWithCopyEnginesWithinADevice;
}
// "13.1" for cudaDriverGetVersion's 13010.
inline std::string driver_version_text(int driver_version) {
  return std::to_string(driver_version / 1000) + "." + std::to_string(driver_version % 1000 / 10);
}

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual const char* name() const = 0;  // "cuda" or "emulated"

  // --- the driver: who executes a copy depends on it (design.md §4) ---
  // The CUDA driver's version as cudaDriverGetVersion gives it (13010 = 13.1).
  virtual int driver_version() = 0;
  // True while copy_batch goes through cudaMemcpyBatchAsync with
  // cudaMemcpyFlagPreferOverlapWithCompute; false once the driver refused the batch API
  // (cudaErrorNotSupported) and copies went per copy through cudaMemcpyAsync (SM kernels for
  // intra-device copies, whatever the driver).
  virtual bool batch_copies() const = 0;

  // --- devices ---
  // Visible devices; 0 without a driver or a device (never throws).
  virtual int device_count() = 0;
  virtual int current_device() = 0;
  virtual void set_device(int device) = 0;
  // The value of `attr` on `device` (0: unsupported). Throws Error(kSystem) if it cannot be read.
  virtual int attribute(int device, DeviceAttribute attr) = 0;
  // The calling thread's current context (nullptr: none) and setting it back. A scope of ours
  // restores the caller's context this way, never with set_device: cudaSetDevice creates a primary
  // context, so a thread that had none would get one (on GPU 0, ~500 MB, in every rank).
  virtual void* current_context() = 0;
  virtual void set_current_context(void* context) = 0;
  // Sets this thread's stream capture mode relaxed (a user's global-mode graph capture elsewhere
  // must not make our calls illegal) and returns the mode it had, for restore_capture_mode.
  virtual int relax_capture_mode() = 0;
  virtual void restore_capture_mode(int mode) = 0;
  // True while `stream` is being captured into a CUDA graph.
  virtual bool is_capturing(Stream stream) = 0;

  // --- streams and events ---
  virtual Stream create_stream() = 0;  // non-blocking
  virtual void destroy_stream(Stream stream) = 0;
  // True once everything queued on `stream` ran; throws if it failed.
  virtual bool stream_idle(Stream stream) = 0;
  virtual void synchronize(Stream stream) = 0;
  virtual Event create_event() = 0;  // timing disabled
  virtual void destroy_event(Event event) = 0;
  virtual void record_event(Event event, Stream stream) = 0;
  // True once `event` completed (a never-recorded event counts as completed); false while
  // pending; throws Error(kSystem) with `what` if the work before it failed.
  virtual bool event_done(Event event, const char* what) = 0;
  // `stream` waits (without blocking the CPU) for the work before `event`'s latest record made
  // before this call (cudaStreamWaitEvent); a never-recorded event: no wait. The event may be
  // recorded again at once.
  virtual void wait_event(Stream stream, Event event) = 0;

  // --- copies (copy engines: never SM kernels) ---
  // Enqueues `batch` on `stream`, preferring overlap with compute (cudaMemcpyBatchAsync +
  // cudaMemcpyFlagPreferOverlapWithCompute, else one cudaMemcpyAsync per copy).
  virtual void copy_batch(Stream stream, const CopyBatch& batch) = 0;

  // --- stream memory operations on device-visible words ---
  // Writes `value` once the stream's earlier work landed (a memory barrier orders it after them).
  virtual void write_value32(Stream stream, DevicePtr addr, uint32_t value) = 0;
  virtual void write_value64(Stream stream, DevicePtr addr, uint64_t value) = 0;
  // Blocks only `stream` until the word satisfies `cmp` against `value`.
  virtual void wait_value32(Stream stream, DevicePtr addr, uint32_t value, WaitCmp cmp) = 0;
  virtual void wait_value64(Stream stream, DevicePtr addr, uint64_t value, WaitCmp cmp) = 0;

  // --- memory ---
  virtual void* device_alloc(size_t bytes) = 0;
  virtual void device_free(void* ptr) = 0;
  // Pinned host memory mapped into the device; *device gets its device address.
  virtual void* host_alloc_mapped(size_t bytes, DevicePtr* device) = 0;
  virtual void host_free(void* ptr) = 0;
  // Pins and maps existing host memory (e.g. a shared control segment); returns its device address.
  virtual DevicePtr host_register(void* ptr, size_t bytes) = 0;
  virtual void host_unregister(void* ptr) = 0;
  // Enqueues on `stream` the zeroing of `bytes` of device memory (cudaMemsetAsync). Never a
  // device-wide synchronization: cudaMemset + cudaDeviceSynchronize would wait for every stream of
  // the device, a user's too (one blocked on a wait would hang our setup).
  virtual void memset_async(Stream stream, void* ptr, size_t bytes) = 0;
  // Makes remote writes that reached this device over the network (GPUDirect RDMA: NVSHMEM puts
  // from peers without P2P) visible to work enqueued after this call, as NVSHMEM's own stream
  // wait does with its flush flag (cudaDeviceFlushGPUDirectRDMAWrites to the owner; a no-op where
  // the device orders them natively). A host call: no kernel.
  virtual void flush_remote_writes() = 0;

  // --- device memory that outlives its owner for peers (same node) ---
  // Allocates `bytes` (rounded up to the allocation granularity) of device memory exported as a
  // POSIX file descriptor (cuMemCreate + cuMemExportToShareableHandle; *fd is the caller's to
  // pass to peers and close). Its physical pages live until the owner and every importer released
  // them: a peer's copies from it stay valid after the owner freed it or died, unlike legacy IPC
  // memory (ipc_handle), which goes away for every importer with its owner. Needs
  // kVirtualMemoryManagement and kPosixFdHandles (shareable_memory_supported()).
  virtual void* shareable_alloc(size_t bytes, int* fd) = 0;
  // Maps a peer's shareable allocation of `bytes` from its descriptor (closed by the caller).
  virtual void* shareable_import(int fd, size_t bytes) = 0;
  // Unmaps and releases this process's reference (the owner's or an importer's).
  virtual void shareable_release(void* ptr) = 0;

  // --- inter-process handles of device allocations (same node) ---
  // A printable handle of `ptr` (from device_alloc) that ipc_open maps in a peer process.
  virtual std::string ipc_handle(void* ptr) = 0;
  virtual void* ipc_open(const std::string& handle) = 0;
  virtual void ipc_close(void* ptr) = 0;
  // The device allocation holding `ptr` (e.g. inside a caching allocator's block): its start,
  // which ipc_handle takes, and *bytes its size (cuMemGetAddressRange). Throws if none holds it.
  virtual void* allocation_base(const void* ptr, size_t* bytes) = 0;

  // --- inter-process events (same node) ---
  // An event a peer process can open (cudaEventInterprocess | cudaEventDisableTiming). Its
  // records, ours or a peer's through the opened handle, and its waits are as for any event: a
  // wait binds to the latest record made, by any process, before the wait call (cudaStreamWaitEvent),
  // so a cross-rank wait is exact only once the host has seen the peer make that record.
  virtual Event create_ipc_event() = 0;
  virtual std::string ipc_event_handle(Event event) = 0;          // cudaIpcGetEventHandle
  virtual Event ipc_open_event(const std::string& handle) = 0;    // cudaIpcOpenEventHandle; destroy_event closes it
};

// NVSHMEM's host API as the transport uses it: host-initiated, on-stream puts and signals. To a
// peer without P2P they go through NVSHMEM's proxy, posted from a one-thread kernel per call. To a
// P2P-mapped peer NVSHMEM issues a SET as cudaMemcpyAsync from a stack variable (pageable memory:
// the call may synchronize with the stream, blocking the calling thread behind earlier copies), so
// the transport reaches mapped peers itself (peer_pointer: copy_batch, write_value64). No waits.
enum class ShmemSignalOp { kSet, kAdd };

class ShmemOps {
 public:
  virtual ~ShmemOps() = default;
  virtual const char* name() const = 0;  // "nvshmem" or "emulated"
  // Where the library came from (real: the path of libnvshmem_host) and its version ("3.4.5").
  virtual std::string library() const = 0;
  virtual std::string version() const = 0;
  // Other copies of libnvshmem_host loaded in this process (another file than library(): e.g.
  // torch's or nvshmem4py's): each would be a second NVSHMEM runtime on the same GPU.
  virtual std::vector<std::string> other_copies() const = 0;

  // Rank 0: a unique id for init, as a printable blob passed to every PE through our bootstrap.
  virtual std::string unique_id() = 0;
  // True if NVSHMEM already runs in this process (nvshmemx_init_status() past NOT_INITIALIZED):
  // another user (torch's symmetric memory, nvshmem4py) started it, with its own PE numbering
  // and heap. Then init() only counts a reference and ignores its unique id, rank and world.
  virtual bool running() = 0;
  // While running(): this process's PE and the runtime's PE count (nvshmem_my_pe, nvshmem_n_pes).
  virtual int my_pe() = 0;
  virtual int n_pes() = 0;
  // While running(): takes a reference on the running runtime (a second init, which NVSHMEM only
  // counts), so another user's finalize cannot tear it down under us. Returns 0 or its status.
  virtual int add_reference(int rank, int world) = 0;
  // Gives back one reference (nvshmemx_hostlib_finalize): local while others hold one; the last
  // one tears the runtime down, collectively (every PE must call it then).
  virtual void finalize() = 0;
  // Collective: starts the library as PE `rank` of `world`. Returns 0 or the library's status.
  // NVSHMEM reads its environment (NVSHMEM_*) at the first of unique_id()/init(): set it before.
  virtual int init(const std::string& unique_id, int rank, int world) = 0;
  // After a successful init: true only if the library is fully usable here. NVSHMEM 3.8's init may
  // return 0 in a "limited MPG" run (several PEs on one GPU without MPS), where its stream signal
  // waits exit() the process: callers must refuse to run then.
  virtual bool fully_initialized() = 0;
  // When fully_initialized() is false: true for a limited MPG run; false when NVSHMEM got no
  // further than its bootstrap (its hostlib init returns 0 even when its main stage failed, logging
  // "nvshmemi_common_init failed, continuing"; the process's next NVSHMEM call then exit()s).
  virtual bool limited_mpg() = 0;
  // Why fully_initialized() is false, for the error message.
  virtual std::string init_status_text() = 0;

  // Collective symmetric allocation (same offset on every PE); nullptr on failure.
  virtual void* malloc(size_t bytes) = 0;
  // True if PE `pe`'s copy of `symmetric` is mapped here (P2P: nvshmem_ptr is not null).
  virtual bool is_mapped(const void* symmetric, int pe) = 0;
  // PE `pe`'s copy of `symmetric` as this device addresses it (nvshmem_ptr): peer-mapped device
  // memory that copy_batch copies into on copy engines and write_value64 writes; nullptr for a
  // PE reached over the network.
  virtual void* peer_pointer(const void* symmetric, int pe) = 0;

  // On `stream`: copies `bytes` from local `src` to `dest` on PE `pe`, then applies `op` with
  // `value` to the 64-bit `signal` word on PE `pe` (after the data is visible there).
  virtual void put_signal_on_stream(void* dest, const void* src, size_t bytes, uint64_t* signal, uint64_t value,
                                    ShmemSignalOp op, int pe, Stream stream) = 0;
  virtual void signal_op_on_stream(uint64_t* signal, uint64_t value, ShmemSignalOp op, int pe, Stream stream) = 0;
  // On `stream`: completes every put and signal this PE issued before (they are visible at their
  // targets once the stream passes it). Signals are ordered only across it (nvshmemx_quiet_on_stream).
  virtual void quiet_on_stream(Stream stream) = 0;
};

// The real implementations, in CUDA builds (Error(kUnsupported) otherwise). Process singletons.
DeviceOps& cuda_device_ops();
// Loads libnvshmem_host on first use; throws Error(kUnsupported) naming the fix if it cannot.
ShmemOps& nvshmem_ops();

}  // namespace freescale

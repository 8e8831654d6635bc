// An emulated device for tests: runs the CUDA transports' host logic on a CPU, with CUDA's
// semantics where that logic depends on them. It proves ordering, flow control and failure
// paths; it says nothing about drivers or bandwidth (GPU results live in docs/benchmarks.md).
//
//  - streams run on `hardware_queues` in-order hardware queues (a GPU's CUDA_DEVICE_MAX_CONNECTIONS,
//    default 8; FREESCALE_EMULATED_HW_QUEUES overrides the default for a whole test run), assigned
//    round robin as streams are created; each queue runs its streams' operations one at a time in
//    enqueue order, on its own thread, asynchronously to the caller. So a stream wait (on a word
//    or an event) at a queue's head stalls every stream behind it on that queue, as on a GPU
//    (cuda.h's warning on stream memory operations). 0 queues: one per stream (no false sharing);
//  - a stream holds at most `queue_depth` pending operations; enqueuing blocks while it is full
//    (as a GPU's command queue does);
//  - events complete when their stream reaches them; a never-recorded event counts as complete;
//    a stream wait on an event waits for the record made before the call (cudaStreamWaitEvent);
//  - stream waits on 32/64-bit words: GEQ compares cyclically ((int64_t)(*addr - value) >= 0, as
//    cuStreamWaitValue does), EQ, AND;
//  - copies really copy (memcpy on the queue's thread);
//  - "device" allocations are memfd shared memory: IPC handles open in forked peer processes
//    (through /proc/<pid>/fd), and nothing appears in /dev/shm, crash or not. An IPC mapping is
//    legacy CUDA IPC (cudaIpcOpenMemHandle): once its owner frees the allocation or exits, its
//    memory is gone for the importer too, and a copy that touches it faults the importer's
//    context (an MMU fault: cudaErrorIllegalAddress, sticky). Shareable allocations
//    (shareable_alloc: cuMem with POSIX handles) keep their pages while any process maps them;
//  - an asynchronous fault (a task that fails: fail_next_task) poisons the whole context, as on a
//    GPU: nothing queued on any stream runs after it, and every later call of the device (stream
//    and event queries, synchronization, enqueues, creation, and releases: cudaFree,
//    cudaFreeHost, cudaHostUnregister, cudaIpcCloseMemHandle, stream and event destruction)
//    throws it, sticky (the context is lost: only the process's exit frees it);
//  - cudaFree and cudaFreeHost synchronize the whole device (every stream, a user's
//    included), as their implicit synchronization does, and so do cudaIpcCloseMemHandle (seen
//    to, tensorpipe#321) and cudaIpcOpenMemHandle (the harsher reading where CUDA's documentation
//    is silent): one that would hang throws after hang_report_after;
//  - who executes each copy (executor(): copy engine or SM kernel, by where its ends live, the
//    driver version and whether the batch API is there), counted with the driver calls;
//  - a user's compute kernel that holds every SM (occupy_every_sm): a batch holding an SM copy
//    cannot start until it ends (and blocks its hardware queue meanwhile); copy engines go on;
// Not modelled: timing and bandwidth, concurrency within a queue (a queue runs one operation at a
// time, which is harsher than a GPU), the legacy default stream's implicit synchronization,
// graph capture, peer access rules. Device attributes read 1 unless listed in
// EmulatedDeviceOptions::unsupported (117 and 118 per option). Stream and event creation block
// while a stream wait runs. EmulatedShmem adds NVSHMEM's host API: one symmetric heap per PE,
// shared by every PE, with put-with-signal and signal ops on emulated streams, init status,
// optional out-of-order signal delivery (reorder_signals: NVSHMEM orders signals only across a
// fence), network PEs (no P2P mapping: NVSHMEM's proxy kernels, counted; links that stall; the
// proxy's exit when a quiet meets a dead PE), SETs to mapped PEs as copies from pageable memory
// (they wait for their stream), and the limited-MPG mode's process exit.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device_ops.h"

namespace freescale {

// EmulatedDeviceOptions::hardware_queues: FREESCALE_EMULATED_HW_QUEUES if set, else 8.
inline constexpr int kHardwareQueuesFromEnvironment = -1;

struct EmulatedDeviceOptions {
  int devices = 1;          // device_count()
  size_t queue_depth = 64;  // pending operations per stream before enqueue blocks
  // Each copy / value write / wait starts this long after its stream reaches it: a slow (or
  // loaded) device, to expose host code that assumes device work lands promptly.
  std::chrono::microseconds op_latency{0};
  // In-order hardware queues the streams share (0: one per stream).
  int hardware_queues = kHardwareQueuesFromEnvironment;
  // Attributes the device reports as 0 (unsupported); every other one reads 1, but for 117 and
  // 118 (below) and 98 (the memops bit of 117). Calls that need a capability the device lacks
  // fail as on a GPU: 64-bit stream memory operations (122), cudaDeviceFlushGPUDirectRDMAWrites
  // (117's host option).
  std::vector<DeviceAttribute> unsupported;
  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS (kFlushWritesOption* bits).
  int flush_writes_options = kFlushWritesOptionHost | kFlushWritesOptionMemops;
  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: 0, none (network writes need a flush).
  int rdma_writes_ordering = 0;
  // Stream and event creation block while a stream wait is running (waiting) on the device, as
  // they may on a GPU: a transport that creates them lazily can deadlock on its own waits.
  bool creation_blocks_while_waiting = true;
  // The driver (cudaDriverGetVersion's number). Before 13.1 (13010) the driver ignores
  // cudaMemcpyFlagPreferOverlapWithCompute for intra-device copies: they run as SM kernels.
  int driver_version = 13000;
  // False: the driver refuses cudaMemcpyBatchAsync, so copies go per copy (cudaMemcpyAsync) and
  // every intra-device one runs on SMs.
  bool batch_api = true;
  // A call with an implicit device synchronization (cudaFree, cudaFreeHost) waits for
  // every stream of the device, a user's included; one still busy after this long would hang a
  // GPU: the call throws kInternal saying so.
  std::chrono::milliseconds hang_report_after{5000};
  // Events alive at once (inter-process ones too); creating one more fails as cudaEventCreate
  // does when the device runs out (cudaErrorMemoryAllocation): for error paths that must give
  // back what they made.
  size_t max_events = SIZE_MAX;
};

// Who executes a copy (design.md §4): a copy engine, or an SM copy kernel.
enum class CopyExecutor { kCopyEngine, kSm };

// Copies the device was given, by executor, counted when they are enqueued.
struct CopyCounts {
  size_t ce_copies = 0, sm_copies = 0;
  size_t ce_bytes = 0, sm_bytes = 0;
  // Counted as they run: bytes copied so far, and SM copies that found every SM held by a
  // user's kernel when their stream reached them (occupy_every_sm) and had to wait for it.
  size_t executed_bytes = 0;
  size_t sm_copies_delayed = 0;
};

// Driver calls made on the device, by kind (a batch counts once, whatever its copies).
struct DriverCalls {
  size_t copy_batches = 0;   // cudaMemcpyBatchAsync (or, without the batch API, ...)
  size_t copies = 0;         // ... cudaMemcpyAsync, one per copy
  size_t value_writes = 0;   // cuStreamWriteValue32/64
  size_t value_waits = 0;    // cuStreamWaitValue32/64
  size_t event_records = 0;  // cudaEventRecord
  size_t event_waits = 0;    // cudaStreamWaitEvent
  size_t total() const { return copy_batches + copies + value_writes + value_waits + event_records + event_waits; }
};

class EmulatedDevice final : public DeviceOps {
 public:
  explicit EmulatedDevice(EmulatedDeviceOptions options = {});
  // Abandons work still queued (waits that will never be satisfied end), joins every stream
  // thread, unmaps what is left.
  ~EmulatedDevice() override;
  EmulatedDevice(const EmulatedDevice&) = delete;
  EmulatedDevice& operator=(const EmulatedDevice&) = delete;

  const char* name() const override { return "emulated"; }
  int driver_version() override { return options_.driver_version; }
  bool batch_copies() const override { return options_.batch_api; }
  int device_count() override { return options_.devices; }
  int current_device() override;
  // Creates the primary context, as cudaSetDevice does since CUDA 12.0.
  void set_device(int device) override;
  // Whether this process has a CUDA context: made by set_device or by the first call that reaches
  // the device (as the CUDA runtime makes one then). NVSHMEM's init needs one (pytorch#161232).
  bool has_context() const { return context_.load(std::memory_order_acquire); }
  int attribute(int device, DeviceAttribute attr) override;
  // A thread's context is a token per device (nullptr: none), as cuCtxGetCurrent's primary one.
  void* current_context() override;
  void set_current_context(void* context) override;
  int relax_capture_mode() override;
  void restore_capture_mode(int mode) override;
  // Whether `device`'s primary context was made in this process (by set_device, or by a runtime
  // call on a thread with no context: CUDA's runtime makes its current device's then).
  bool made_context(int device) const;
  bool is_capturing(Stream) override { return false; }

  Stream create_stream() override;
  void destroy_stream(Stream stream) override;
  bool stream_idle(Stream stream) override;
  void synchronize(Stream stream) override;
  Event create_event() override;
  void destroy_event(Event event) override;
  void record_event(Event event, Stream stream) override;
  bool event_done(Event event, const char* what) override;
  void wait_event(Stream stream, Event event) override;

  void copy_batch(Stream stream, const CopyBatch& batch) override;
  void write_value32(Stream stream, DevicePtr addr, uint32_t value) override;
  void write_value64(Stream stream, DevicePtr addr, uint64_t value) override;
  void wait_value32(Stream stream, DevicePtr addr, uint32_t value, WaitCmp cmp) override;
  void wait_value64(Stream stream, DevicePtr addr, uint64_t value, WaitCmp cmp) override;

  void* device_alloc(size_t bytes) override;
  void device_free(void* ptr) override;
  void* host_alloc_mapped(size_t bytes, DevicePtr* device) override;
  void host_free(void* ptr) override;
  DevicePtr host_register(void* ptr, size_t bytes) override;
  void host_unregister(void* ptr) override;
  void memset_async(Stream stream, void* ptr, size_t bytes) override;
  // Counts (every write here is visible at once); fails as cudaErrorNotSupported where
  // flush_writes_options lacks the host option.
  void flush_remote_writes() override;

  // Shareable allocations: memfds whose pages live while any process maps them (so an importer's
  // copies stay valid after the owner released them or exited, as with cuMem's POSIX handles).
  void* shareable_alloc(size_t bytes, int* fd) override;
  void* shareable_import(int fd, size_t bytes) override;
  void shareable_release(void* ptr) override;

  std::string ipc_handle(void* ptr) override;
  void* ipc_open(const std::string& handle) override;
  void ipc_close(void* ptr) override;
  void* allocation_base(const void* ptr, size_t* bytes) override;
  // Inter-process events: two words (records made, records reached) in a memfd page that peers
  // map, so a wait in one process binds to the latest record any process made before the call.
  Event create_ipc_event() override;
  std::string ipc_event_handle(Event event) override;
  Event ipc_open_event(const std::string& handle) override;

  // Abandons queued work and joins every stream thread (idempotent; the destructor calls it).
  // Memory the streams touch may be unmapped only after this.
  void shutdown();

  // --- for tests and EmulatedShmem ---
  // Queues `task` on `stream` (blocks while the queue is full). `task` runs on its hardware
  // queue's thread; an exception it throws faults the device (context-wide, sticky).
  struct StreamState;
  void enqueue(Stream stream, std::function<void()> task);
  // Blocks the calling stream's thread until `ready()` or the device is torn down. A stream wait
  // (is_stream_wait: stream and event creation block meanwhile) or a kernel that runs long.
  void spin_until(const std::function<bool()>& ready, bool is_stream_wait = true);
  // The next task queued on `stream` fails with `message` instead of running.
  void fail_next_task(Stream stream, const std::string& message);
  // Streams created and not destroyed; events likewise; device allocations, mapped host blocks
  // and registrations alive; IPC mappings open.
  size_t live_streams() const;
  size_t live_events() const;
  size_t live_allocations() const;
  // Pending operations on `stream` (not counting the running one).
  size_t queued(Stream stream);
  // Stream waits running (spinning) on the device now.
  int waits_running() const { return waits_running_.load(); }
  // The hardware queues in use (after any override).
  int hardware_queues() const { return options_.hardware_queues; }
  // flush_remote_writes() calls so far.
  size_t remote_write_flushes() const { return flushes_.load(); }
  // Who executes a copy from `src` to `dst`: a copy engine when one side is another device's
  // memory (an IPC mapping) or the host's (mapped or registered); both on this device (its
  // allocations, and any other address: the callers' tensors stand for this device's memory),
  // a copy engine only through the batch API on a 13.1+ driver, else an SM kernel.
  CopyExecutor executor(const void* dst, const void* src) const;
  CopyCounts copy_counts() const;
  DriverCalls driver_calls() const;
  // true: a user's compute kernel holds every SM from now until occupy_every_sm(false), so an SM
  // copy kernel cannot start meanwhile (copy engines are not SMs: their copies go on). A kernel
  // as HSTU's attention runs it: all SMs, for as long as the step computes.
  void occupy_every_sm(bool occupied) { sms_occupied_.store(occupied); }
  // Every implicit device synchronization that would have hung on a GPU (each also threw, and a
  // caller may have caught it: this keeps it visible to tests).
  std::vector<std::string> hangs() const;
  // The context's fault ("" while healthy).
  std::string fault() const;
  // Another device's memory mapped here by peer access (EmulatedShmem: P2P-mapped PEs' heaps):
  // copies to or from it run on copy engines (executor()).
  void add_peer_mapping(const void* ptr, size_t bytes);
  void remove_peer_mapping(const void* ptr);

 private:
  struct EventState;
  struct Task;
  struct HwQueue;
  void run_queue(HwQueue& q);
  void raise_fault(const std::string& what);
  // Every runtime call that reaches the device: makes the context; throws if a fault poisoned it.
  void check_no_fault(const char* call) const;
  mutable std::atomic<bool> context_{false};
  mutable std::mutex contexts_mu_;
  mutable std::mutex hangs_mu_;
  std::vector<std::string> hangs_;  // hangs()
  mutable std::set<int> contexts_made_;  // devices whose primary context exists
  // `device`'s primary context, made if it was not, becomes this thread's current one.
  void make_current(int device) const;
  void block_creation_while_waiting();
  void count_call(size_t DriverCalls::*kind);
  // cudaDeviceSynchronize as cudaFree, cudaFreeHost and the IPC open / close imply it: waits until
  // every stream (destroyed ones still running included) ran out; throws kInternal after
  // hang_report_after (a GPU would hang) and the context's fault if it has one.
  void synchronize_device(const char* call);
  // Throws as the driver does where the device lacks 64-bit stream memory operations.
  void require_64_bit_memops(const char* call);
  // Throws CUDA_ERROR_INVALID_CONTEXT where a driver call acting in the current context (no
  // stream, or the legacy stream 0) runs on a thread that has none.
  void require_current_context(const char* call, Stream stream) const;
  // A queue's thread, before an SM copy: waits while a user's kernel holds every SM (true if it
  // had to). Throws Abandoned on teardown or a fault.
  bool wait_for_free_sms();
  // Appends `task` to its stream's hardware queue, waiting for room in the stream.
  void push(const std::shared_ptr<StreamState>& s, Task task, const char* call);
  std::shared_ptr<StreamState> new_stream_locked();  // holder of mu_
  std::shared_ptr<StreamState> stream_of(Stream stream);
  std::shared_ptr<EventState> event_of(Event event);

  EmulatedDeviceOptions options_;
  std::atomic<bool> torn_down_{false};
  std::atomic<bool> faulted_{false};
  std::atomic<int> waits_running_{0};  // stream waits spinning now
  std::atomic<size_t> flushes_{0};
  std::atomic<bool> sms_occupied_{false};  // occupy_every_sm
  mutable std::mutex counts_mu_;  // guards copies_ and calls_
  CopyCounts copies_;
  DriverCalls calls_;
  mutable std::mutex fault_mu_;  // guards fault_
  std::string fault_;
  mutable std::mutex mu_;  // guards the maps and queues below
  uintptr_t next_handle_ = 1;
  std::vector<std::unique_ptr<HwQueue>> queues_;  // threads joined at teardown
  size_t next_queue_ = 0;                          // round robin over queues_
  std::map<Stream, std::shared_ptr<StreamState>> streams_;
  std::shared_ptr<StreamState> default_stream_;
  std::map<Event, std::shared_ptr<EventState>> events_;
  struct Mapping {
    size_t bytes;
    int fd;  // memfd of a device allocation; -1 for an IPC mapping
    // The allocation's owner state (a word in a page after its bytes, shared by every process
    // that maps it: 1 while allocated, 0 once its owner freed it) and the owner's pid.
    std::atomic<uint64_t>* owned = nullptr;
    pid_t owner = 0;
  };
  // A piece of a copy that touches an IPC mapping: checked when the copy runs.
  struct Imported {
    std::atomic<uint64_t>* owned;
    pid_t owner;
  };
  // The IPC mappings [p, p + bytes) touches (holder of mu_).
  void imported_locked(const void* p, std::vector<Imported>* out) const;
  std::map<void*, Mapping> allocations_;  // device allocations (fd >= 0) and IPC mappings (fd < 0)
  std::map<void*, size_t> host_blocks_;   // host_alloc_mapped
  std::map<void*, size_t> registered_;    // host_register
  std::map<void*, size_t> peer_mapped_;   // add_peer_mapping
  struct Shared {
    size_t bytes;
    bool imported;  // a peer's (copies to or from it: copy engines)
  };
  std::map<void*, Shared> shareables_;  // shareable_alloc / shareable_import
};

struct EmulatedShmemOptions {
  // Each PE's symmetric heap when NVSHMEM_SYMMETRIC_SIZE (bytes) is unset at the first call.
  size_t heap_bytes = 64ull << 20;
  // Emulates NVSHMEM 3.8's "limited MPG" run: init returns 0, init status says it is not fully
  // initialized, and an on-stream call terminates the process (as its stream waits do).
  bool limited_mpg = false;
  // Emulates an NVSHMEM whose main init stage failed past its bootstrap: init returns 0 anyway
  // (nvshmemx_hostlib_init_attr: "nvshmemi_common_init failed, continuing"), the status says
  // NVSHMEM_STATUS_IS_BOOTSTRAPPED, and any further call terminates the process.
  bool bootstrapped_only = false;
  // PEs reached over the network (no P2P mapping): is_mapped() is false for them, and each put or
  // signal to them counts as a kernel (NVSHMEM's proxy launch). Their bytes still move.
  std::vector<int> network_pes;
  // Network PEs whose link stalls: a put or signal to one never completes (its stream stays
  // blocked on it, and on what follows, until the device is torn down), as a proxy operation to a
  // peer that stopped answering does. A stream holding one never runs out.
  std::vector<int> stalled_pes;
  // Network PEs whose operations fail on the device (as a GPU-initiated transport's do): the
  // first put or signal to one that its stream reaches faults this context (sticky), naming it.
  std::vector<int> failing_pes;
  // NVSHMEM's proxy ends the process (exit(-1): "aborting due to error in progress_quiet") when a
  // quiet finds an operation to a network PE that failed, as one to a dead PE does. Emulated: a
  // put or signal to a network PE that runs once the PE's process is gone fails (it lands
  // nothing), and the next quiet this process reaches exits it (code 255).
  int init_status = 0;  // what init() returns, after joining the others (non-zero: a failed init)
  // Other copies of libnvshmem_host "loaded" in the process (torch's, nvshmem4py's).
  std::vector<std::string> other_copies;
  // Out-of-order signals, as NVSHMEM allows: it orders delivery to a PE only across a fence, and
  // on-stream puts over proxy (network) transports complete locally. When set, a signal to a word
  // that has none held back is held back until the next signal to the same word arrives (that
  // one lands first, then the held one) or for at most this long. 0: signals land in order.
  std::chrono::microseconds reorder_signals{0};
  // NVSHMEM's last finalize waits for every PE's; a PE whose peers do not come within this long
  // (a GPU run would hang there) ends its process with kFinalizeHangExit.
  std::chrono::milliseconds finalize_hang_after{5000};
};

// Exit code of an emulated process whose last NVSHMEM finalize would hang (its peers never came).
constexpr int kFinalizeHangExit = 86;
// What the emulated NVSHMEM's init returns in a process with no CUDA context yet.
constexpr int kNoContextInit = 9;

class EmulatedShmem final : public ShmemOps {
 public:
  EmulatedShmem(EmulatedDevice& device, EmulatedShmemOptions options = {});
  ~EmulatedShmem() override;
  const char* name() const override { return "emulated"; }
  std::string library() const override { return "emulated"; }
  std::string version() const override { return "emulated"; }
  std::vector<std::string> other_copies() const override { return options_.other_copies; }

  std::string unique_id() override;
  // A second init (by us or "another user") only counts a reference and returns 0, ignoring its
  // arguments, as NVSHMEM's does: the runtime keeps the first caller's PE numbering and heap.
  int init(const std::string& unique_id, int rank, int world) override;
  bool running() override { return started_; }
  int add_reference(int, int) override {
    exit_if_half_started();
    return started_ ? init("", 0, 0) : 1;
  }
  // One reference less; the last one tears the runtime down, collectively (it waits for every
  // PE's last finalize): later puts, signals and quiets fault the context (its heaps are gone).
  void finalize() override;
  int my_pe() override {
    exit_if_half_started();
    return rank_;
  }
  int n_pes() override { return static_cast<int>(heaps_.size()); }
  // init() calls so far that found the runtime running (NVSHMEM's reference count, less one).
  int extra_inits() const { return extra_inits_; }
  bool fully_initialized() override { return !options_.limited_mpg && !options_.bootstrapped_only; }
  bool limited_mpg() override { return options_.limited_mpg; }
  std::string init_status_text() override;
  void* malloc(size_t bytes) override;
  void put_signal_on_stream(void* dest, const void* src, size_t bytes, uint64_t* signal, uint64_t value,
                            ShmemSignalOp op, int pe, Stream stream) override;
  void signal_op_on_stream(uint64_t* signal, uint64_t value, ShmemSignalOp op, int pe, Stream stream) override;
  // Lands every signal the reordering hold still keeps once the stream gets there.
  void quiet_on_stream(Stream stream) override;
  bool is_mapped(const void* symmetric, int pe) override;
  void* peer_pointer(const void* symmetric, int pe) override;

  // SETs to a P2P-mapped PE (itself included) through NVSHMEM's calls: NVSHMEM issues them as
  // cudaMemcpyAsync from a stack variable, a copy from pageable memory that may synchronize with
  // the stream; the emulation does (the calling thread waits for the stream's earlier work), and
  // counts them here.
  size_t signals_from_pageable_memory() const { return pageable_signals_.load(); }

  // SM kernels NVSHMEM would have launched for this process's calls: one per put or signal to a
  // PE of EmulatedShmemOptions::network_pes (its proxy), one per ADD signal.
  size_t kernels_launched() const { return kernels_.load(); }
  // Signals that landed after a later one to the same word (reorder_signals).
  size_t signals_reordered() const { return reordered_.load(); }
  // Signals the reordering hold keeps now (issued and run on their stream, not landed yet).
  size_t signals_held();
  // NVSHMEM_REMOTE_TRANSPORT as the library read it: once, at the first unique_id() or init(),
  // as NVSHMEM reads its environment ("<unset>" if it was not set then).
  const std::string& remote_transport_seen() const { return remote_transport_seen_; }
  size_t heap_bytes() const { return heap_bytes_; }

 private:
  void read_environment_once();
  // How a put or signal to `pe` fares on its way (network PEs of stalled_pes / failing_pes).
  struct Link {
    bool stalls = false, fails = false;
  };
  Link link_to(int pe);  // at issue (notes a put to a stalled PE, which quiets then wait for)
  // On the stream, as `what` ("a put", "a signal") to `pe` runs: throws if it fails or the runtime
  // was finalized, never returns if it stalls; false if `pe` is dead (reached()).
  bool arrives(const char* what, int pe, Link link);
  // A put or signal to network PE `pe` ran: false (and the next quiet exits) if its process is gone.
  bool reached(int pe);
  bool is_mapped_pe(int pe) const;
  // NVSHMEM's SET to a mapped PE: counts it and waits for `stream` (signals_from_pageable_memory).
  void set_from_pageable_memory(Stream stream);
  // options_.bootstrapped_only: ends the process as NVSHMEM's next call does after such an init.
  void exit_if_half_started() const;
  void exit_if_context_faulted() const;  // as NVSHMEM's on-stream calls do (exit(-1))
  uint8_t* remote(const void* local, int pe) const;
  // Applies a signal that reached its word, through the reordering hold when it is on.
  void deliver(std::atomic<uint64_t>* word, uint64_t value, ShmemSignalOp op);
  void deliver_held_signals();  // the hold's thread: lands signals whose time ran out

  struct HeldSignal {
    uint64_t value;
    ShmemSignalOp op;
    std::chrono::steady_clock::time_point until;
  };

  EmulatedDevice& device_;
  EmulatedShmemOptions options_;
  int rank_ = -1;
  int rendezvous_fd_ = -1;    // rank 0: the memfd PEs meet in
  void* rendezvous_ = nullptr;
  int heap_fd_ = -1;
  std::vector<uint8_t*> heaps_;  // [world] every PE's heap mapped here (ours: own)
  std::vector<pid_t> pids_;      // [world] every PE's process
  bool started_ = false;         // init() succeeded once, and no last finalize() since
  std::atomic<bool> finalized_{false};  // the last reference was given back (streams read it)
  int extra_inits_ = 0;
  int references_ = 0;           // init() calls not yet finalized
  size_t used_ = 0;              // bump allocator: the same sequence of malloc on every PE
  std::atomic<size_t> kernels_{0};
  std::atomic<size_t> reordered_{0};
  std::atomic<size_t> pageable_signals_{0};
  std::atomic<bool> issued_to_stalled_{false};  // a put or signal to a stalled PE was issued
  std::atomic<bool> failed_completion_{false};  // a put or signal to a dead network PE ran
  std::mutex held_mu_;  // guards held_ and stopping_; signals land under it (one at a time)
  std::condition_variable held_cv_;
  std::map<std::atomic<uint64_t>*, HeldSignal> held_;
  bool stopping_ = false;
  std::thread holder_;  // runs deliver_held_signals() while reorder_signals is on
  bool environment_read_ = false;
  std::string remote_transport_seen_;
  size_t heap_bytes_ = 0;
};

}  // namespace freescale

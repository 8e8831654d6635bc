#include "testing/emulated_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <sstream>
#include <thread>

#include "cpp/errors.h"
#include "cpp/peer_liveness.h"

namespace freescale {
namespace {

thread_local int t_device = 0;         // cudaGetDevice: 0 until set (with or without a context)
thread_local void* t_context = nullptr;  // cuCtxGetCurrent: a device's token, or none
thread_local int t_capture_mode = 0;     // cudaStreamCaptureModeGlobal

void* context_token(int device) { return reinterpret_cast<void*>(static_cast<uintptr_t>(device) + 1); }

// Thrown inside a stream task when the device is torn down while the task waits.
struct Abandoned {};

void* map_fd(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw SystemError("mmap (emulated device memory)", errno);
  return p;
}

// map_fd, closing `fd` if the mapping fails.
void* map_fd_or_close(int fd, size_t bytes) {
  try {
    return map_fd(fd, bytes);
  } catch (...) {
    close(fd);
    throw;
  }
}

int new_memfd(size_t bytes, const char* what) {
  int fd = memfd_create(what, MFD_CLOEXEC);
  if (fd < 0) throw SystemError("memfd_create (emulated device memory)", errno);
  if (ftruncate(fd, static_cast<off_t>(bytes == 0 ? 1 : bytes)) != 0) {
    int e = errno;
    close(fd);
    throw SystemError("ftruncate (emulated device memory)", e);
  }
  return fd;
}

// A device allocation of `bytes` is mapped with one page after them (rounded up to a page) for
// the word saying whether its owner still holds it (EmulatedDevice::Mapping::owned).
constexpr size_t kPage = 4096;
size_t mapped_bytes(size_t bytes) { return (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage + kPage; }
std::atomic<uint64_t>* owner_word(void* base, size_t bytes) {
  return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<uint8_t*>(base) + mapped_bytes(bytes) - kPage);
}

// This process's memfd `fd` of `bytes` as a handle a peer opens with open_peer_fd: "pid:fd:bytes".
std::string peer_fd_handle(int fd, size_t bytes) {
  return std::to_string(getpid()) + ":" + std::to_string(fd) + ":" + std::to_string(bytes);
}

// "pid:fd:bytes" -> the peer's memfd opened here.
int open_peer_fd(const std::string& handle, size_t* bytes) {
  long pid = 0, fd = 0;
  unsigned long long n = 0;
  if (std::sscanf(handle.c_str(), "%ld:%ld:%llu", &pid, &fd, &n) != 3) {
    throw Error(ErrorCode::kCommError, "emulated device: malformed IPC handle '" + handle + "'");
  }
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) throw SystemError("open " + path + " (emulated IPC handle)", errno);
  *bytes = n;
  return local;
}

// Moves bytes as a DMA engine does: aligned 8-byte words whole, as atomic accesses, so a host
// thread polling mapped memory and concurrent device writes (a peer's put) see whole words, as on
// the hardware, and TSan sees intended concurrency, not races. Word loads acquire and stores
// release: a copy that read a signal word carries what landed before that signal to whoever reads
// the copy (the host reading a mirror of signal words, then enqueuing a copy of the data), as a
// GPU's copy does. Other ordering comes from the stream (events, value writes with release).
// Where source and destination are not equally aligned (bulk data at byte offsets, which nobody
// polls), a plain copy.
void dma_copy(void* to, const void* from, size_t bytes) {
  auto* dst = static_cast<uint8_t*>(to);
  const auto* src = static_cast<const uint8_t*>(from);
  if ((reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src)) & 7) {
    std::memcpy(dst, src, bytes);
    return;
  }
  size_t i = 0;
  for (; i < bytes && (reinterpret_cast<uintptr_t>(dst + i) & 7) != 0; ++i) {
    __atomic_store_n(dst + i, __atomic_load_n(src + i, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
  }
  for (; i + 8 <= bytes; i += 8) {
    __atomic_store_n(reinterpret_cast<uint64_t*>(dst + i),
                     __atomic_load_n(reinterpret_cast<const uint64_t*>(src + i), __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  }
  for (; i < bytes; ++i) __atomic_store_n(dst + i, __atomic_load_n(src + i, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}

// Zeroes `bytes` at `to` as the device does: aligned words whole (see dma_copy).
void dma_copy_zero(void* to, size_t bytes) {
  auto* dst = static_cast<uint8_t*>(to);
  size_t i = 0;
  for (; i < bytes && (reinterpret_cast<uintptr_t>(dst + i) & 7) != 0; ++i) __atomic_store_n(dst + i, 0, __ATOMIC_RELAXED);
  for (; i + 8 <= bytes; i += 8) __atomic_store_n(reinterpret_cast<uint64_t*>(dst + i), uint64_t{0}, __ATOMIC_RELEASE);
  for (; i < bytes; ++i) __atomic_store_n(dst + i, 0, __ATOMIC_RELAXED);
}

template <class T>
bool compare(const std::atomic<T>* word, T value, WaitCmp cmp) {
  T now = word->load(std::memory_order_acquire);
  switch (cmp) {
    case WaitCmp::kGeq:
      return static_cast<std::make_signed_t<T>>(now - value) >= 0;  // cuStreamWaitValue's GEQ
    case WaitCmp::kEq:
      return now == value;
    case WaitCmp::kAnd:
      return (now & value) != 0;
  }
  return false;
}

}  // namespace

struct EmulatedDevice::EventState {
  // [0] records enqueued, [1] records their stream reached: here, or for an inter-process event in
  // a memfd page every process that opened it maps (records in any of them count).
  std::atomic<uint64_t> own[2]{{0}, {0}};
  std::atomic<uint64_t>* words = own;
  int fd = -1;  // an inter-process event's memfd (its creator's; -1 where opened or local)
  std::atomic<uint64_t>& recorded() { return words[0]; }
  std::atomic<uint64_t>& completed() { return words[1]; }
  EventState() = default;
  EventState(const EventState&) = delete;
  EventState& operator=(const EventState&) = delete;
  ~EventState() {
    if (words != own) munmap(words, kIpcEventBytes);
    if (fd >= 0) close(fd);
  }
  static constexpr size_t kIpcEventBytes = 2 * sizeof(uint64_t);
  std::mutex mu;
  std::string error;  // the device's fault, if a record was reached after it
};

struct EmulatedDevice::StreamState {
  HwQueue* hw = nullptr;  // the hardware queue it runs on (owned by the device)
  // Guarded by hw->mu:
  size_t queued = 0;      // its tasks in hw->fifo, not running yet
  bool running = false;
  std::string fail_next;
  size_t depth = 0;                      // EmulatedDeviceOptions::queue_depth
  std::chrono::microseconds latency{0};  // EmulatedDeviceOptions::op_latency
};

struct EmulatedDevice::Task {
  std::shared_ptr<StreamState> stream;
  std::function<void()> run;
  std::shared_ptr<EventState> event;  // record tasks: the event and its generation
  uint64_t generation = 0;
};

struct EmulatedDevice::HwQueue {
  std::mutex mu;
  std::condition_variable pushed;  // a task was queued, or the queue retired / the device tore down
  std::condition_variable popped;  // a task was taken or finished
  std::deque<Task> fifo;           // every task of its streams, in enqueue order
  bool running = false;            // a task of it runs now
  bool dedicated = false;          // one stream's own (hardware_queues == 0)
  bool retired = false;            // dedicated, and its stream destroyed: ends once drained
  std::thread thread;
};

namespace {

// FREESCALE_EMULATED_HW_QUEUES, else 8 (a GPU's CUDA_DEVICE_MAX_CONNECTIONS default).
int hardware_queues_from_environment() {
  const char* env = std::getenv("FREESCALE_EMULATED_HW_QUEUES");
  if (env == nullptr || *env == '\0') return 8;
  char* end = nullptr;
  long n = std::strtol(env, &end, 10);
  if (*end != '\0' || n < 0 || n > 1024) {
    throw InvalidArgument(std::string("FREESCALE_EMULATED_HW_QUEUES must be an integer from 0 (one queue per stream) "
                                      "to 1024, got '") + env + "'");
  }
  return static_cast<int>(n);
}

}  // namespace

void EmulatedDevice::run_queue(HwQueue& q) {
  std::unique_lock<std::mutex> lock(q.mu);
  while (true) {
    q.pushed.wait(lock, [&] { return !q.fifo.empty() || q.retired || torn_down_.load(); });
    if (torn_down_.load() || q.fifo.empty()) break;
    Task task = std::move(q.fifo.front());
    q.fifo.pop_front();
    StreamState& s = *task.stream;
    --s.queued;
    s.running = true;
    q.running = true;
    const std::chrono::microseconds latency = s.latency;
    q.popped.notify_all();
    lock.unlock();
    std::string failed = fault();
    if (task.event) {
      if (!failed.empty()) {
        std::lock_guard<std::mutex> ev(task.event->mu);
        task.event->error = failed;
      }
      uint64_t done = task.event->completed().load();
      while (done < task.generation && !task.event->completed().compare_exchange_weak(done, task.generation)) {
      }
    } else if (failed.empty()) {
      if (latency.count() > 0) std::this_thread::sleep_for(latency);
      try {
        task.run();
      } catch (const Abandoned&) {
        // Torn down while it waited: nothing runs any more.
      } catch (const std::exception& e) {
        raise_fault(e.what());
      }
    }
    lock.lock();
    s.running = false;
    q.running = false;
    q.popped.notify_all();
  }
}

std::vector<std::string> EmulatedDevice::hangs() const {
  std::lock_guard<std::mutex> lock(hangs_mu_);
  return hangs_;
}

std::string EmulatedDevice::fault() const {
  if (!faulted_.load(std::memory_order_acquire)) return "";
  std::lock_guard<std::mutex> lock(fault_mu_);
  return fault_;
}

void EmulatedDevice::raise_fault(const std::string& what) {
  std::lock_guard<std::mutex> lock(fault_mu_);
  if (!faulted_.load()) fault_ = what;
  faulted_.store(true, std::memory_order_release);
}

void EmulatedDevice::check_no_fault(const char* call) const {
  if (t_context == nullptr) make_current(t_device);  // as the runtime does with its current device's
  context_.store(true, std::memory_order_release);
  if (!faulted_.load(std::memory_order_acquire)) return;
  throw Error(ErrorCode::kSystem, std::string("emulated ") + call + ": an earlier asynchronous error poisoned the context "
                                      "(sticky, every stream of the device): " + fault());
}

EmulatedDevice::EmulatedDevice(EmulatedDeviceOptions options) : options_(options) {
  if (options_.queue_depth == 0) throw InvalidArgument("EmulatedDeviceOptions.queue_depth must be at least 1");
  if (options_.hardware_queues == kHardwareQueuesFromEnvironment) options_.hardware_queues = hardware_queues_from_environment();
  if (options_.hardware_queues < 0) throw InvalidArgument("EmulatedDeviceOptions.hardware_queues must be >= 0");
}

EmulatedDevice::~EmulatedDevice() {
  shutdown();
  for (auto& [p, m] : allocations_) {
    munmap(p, mapped_bytes(m.bytes));
    if (m.fd >= 0) close(m.fd);
  }
  for (auto& [p, n] : host_blocks_) std::free(p);
  for (auto& [p, s] : shareables_) munmap(p, std::max<size_t>(s.bytes, 1));
}

void EmulatedDevice::shutdown() {
  torn_down_.store(true);
  std::vector<HwQueue*> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& q : queues_) all.push_back(q.get());
  }
  for (HwQueue* q : all) {
    {
      std::lock_guard<std::mutex> lock(q->mu);  // no wake-up lost between a predicate and its wait
    }
    q->pushed.notify_all();
    q->popped.notify_all();
  }
  for (HwQueue* q : all) {
    if (q->thread.joinable()) q->thread.join();
    std::lock_guard<std::mutex> lock(q->mu);
    q->fifo.clear();  // abandoned
  }
}

int EmulatedDevice::current_device() { return t_device; }

void EmulatedDevice::set_device(int device) {
  if (device < 0 || device >= options_.devices) {
    throw Error(ErrorCode::kSystem, "emulated cudaSetDevice(" + std::to_string(device) + "): invalid device ordinal");
  }
  t_device = device;
  make_current(device);
  context_.store(true, std::memory_order_release);
}

void EmulatedDevice::make_current(int device) const {
  t_context = context_token(device);
  std::lock_guard<std::mutex> lock(contexts_mu_);
  contexts_made_.insert(device);
}

bool EmulatedDevice::made_context(int device) const {
  std::lock_guard<std::mutex> lock(contexts_mu_);
  return contexts_made_.count(device) != 0;
}

void* EmulatedDevice::current_context() { return t_context; }

void EmulatedDevice::set_current_context(void* context) {
  t_context = context;
  if (context != nullptr) t_device = static_cast<int>(reinterpret_cast<uintptr_t>(context) - 1);
}

int EmulatedDevice::relax_capture_mode() {
  const int previous = t_capture_mode;
  t_capture_mode = 2;  // cudaStreamCaptureModeRelaxed
  return previous;
}

void EmulatedDevice::restore_capture_mode(int mode) { t_capture_mode = mode; }

int EmulatedDevice::attribute(int device, DeviceAttribute attr) {
  if (device < 0 || device >= options_.devices) {
    throw Error(ErrorCode::kSystem, "emulated cuDeviceGetAttribute(" + std::to_string(device) + "): invalid device");
  }
  const auto& off = options_.unsupported;
  if (std::find(off.begin(), off.end(), attr) != off.end()) return 0;
  switch (attr) {
    case DeviceAttribute::kGpuDirectRdmaFlushWritesOptions:
      return options_.flush_writes_options;
    case DeviceAttribute::kGpuDirectRdmaWritesOrdering:
      return options_.rdma_writes_ordering;
    case DeviceAttribute::kCanFlushRemoteWrites:
      return (options_.flush_writes_options & kFlushWritesOptionMemops) != 0 ? 1 : 0;
    default:
      return 1;
  }
}

std::shared_ptr<EmulatedDevice::StreamState> EmulatedDevice::new_stream_locked() {
  auto s = std::make_shared<StreamState>();
  s->depth = options_.queue_depth;
  s->latency = options_.op_latency;
  HwQueue* q = nullptr;
  if (options_.hardware_queues == 0 || static_cast<int>(queues_.size()) < options_.hardware_queues) {
    queues_.push_back(std::make_unique<HwQueue>());
    q = queues_.back().get();
    q->dedicated = options_.hardware_queues == 0;
    q->thread = std::thread([this, q] { run_queue(*q); });
  } else {
    q = queues_[next_queue_ % queues_.size()].get();  // round robin, as CUDA assigns connections
  }
  ++next_queue_;
  s->hw = q;
  return s;
}

void EmulatedDevice::block_creation_while_waiting() {
  if (!options_.creation_blocks_while_waiting) return;
  while (waits_running_.load() > 0 && !torn_down_.load()) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

Stream EmulatedDevice::create_stream() {
  check_no_fault("cudaStreamCreate");
  block_creation_while_waiting();
  std::lock_guard<std::mutex> lock(mu_);
  Stream h = next_handle_++;
  streams_[h] = new_stream_locked();
  return h;
}

void EmulatedDevice::destroy_stream(Stream stream) {
  check_no_fault("cudaStreamDestroy");
  std::shared_ptr<StreamState> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(stream);
    if (it == streams_.end()) throw Error(ErrorCode::kSystem, "emulated cudaStreamDestroy: invalid resource handle");
    s = it->second;
    streams_.erase(it);  // like CUDA: returns now, its work still runs
  }
  HwQueue& q = *s->hw;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.dedicated) q.retired = true;
  }
  q.pushed.notify_all();
}

std::shared_ptr<EmulatedDevice::StreamState> EmulatedDevice::stream_of(Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stream == 0) {
    if (!default_stream_) default_stream_ = new_stream_locked();
    return default_stream_;
  }
  auto it = streams_.find(stream);
  if (it == streams_.end()) throw Error(ErrorCode::kSystem, "emulated device: invalid stream handle " + std::to_string(stream));
  return it->second;
}

std::shared_ptr<EmulatedDevice::EventState> EmulatedDevice::event_of(Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = events_.find(event);
  if (it == events_.end()) throw Error(ErrorCode::kSystem, "emulated device: invalid event handle " + std::to_string(event));
  return it->second;
}

void EmulatedDevice::push(const std::shared_ptr<StreamState>& s, Task task, const char* call) {
  check_no_fault(call);
  HwQueue& q = *s->hw;
  std::unique_lock<std::mutex> lock(q.mu);
  q.popped.wait(lock, [&] { return s->queued < s->depth || torn_down_.load(); });
  if (task.run && !s->fail_next.empty()) {
    std::string message = s->fail_next;
    s->fail_next.clear();
    task.run = [message] { throw Error(ErrorCode::kSystem, "emulated failure: " + message); };
  }
  task.stream = s;
  ++s->queued;
  q.fifo.push_back(std::move(task));
  q.pushed.notify_all();
}

void EmulatedDevice::enqueue(Stream stream, std::function<void()> task) {
  push(stream_of(stream), Task{nullptr, std::move(task), nullptr, 0}, "stream operation");
}

void EmulatedDevice::spin_until(const std::function<bool()>& ready, bool is_stream_wait) {
  if (ready()) return;
  const int counted = is_stream_wait ? 1 : 0;
  waits_running_.fetch_add(counted);
  struct Done {
    std::atomic<int>& n;
    int counted;
    ~Done() { n.fetch_sub(counted); }
  } done{waits_running_, counted};
  for (int i = 0; !ready(); ++i) {
    if (torn_down_.load() || faulted_.load()) throw Abandoned{};  // a dead context runs nothing
    if (i < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

void EmulatedDevice::fail_next_task(Stream stream, const std::string& message) {
  std::shared_ptr<StreamState> s = stream_of(stream);
  std::lock_guard<std::mutex> lock(s->hw->mu);
  s->fail_next = message;
}

size_t EmulatedDevice::live_streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return streams_.size();
}

size_t EmulatedDevice::live_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

size_t EmulatedDevice::live_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_.size() + host_blocks_.size() + registered_.size() + shareables_.size();
}

size_t EmulatedDevice::queued(Stream stream) {
  std::shared_ptr<StreamState> s = stream_of(stream);
  std::lock_guard<std::mutex> lock(s->hw->mu);
  return s->queued;
}

bool EmulatedDevice::stream_idle(Stream stream) {
  std::shared_ptr<StreamState> s = stream_of(stream);
  check_no_fault("cudaStreamQuery");
  std::lock_guard<std::mutex> lock(s->hw->mu);
  return s->queued == 0 && !s->running;
}

void EmulatedDevice::synchronize_device(const char* call) {
  std::vector<HwQueue*> queues;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& q : queues_) queues.push_back(q.get());
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.hang_report_after;
  for (HwQueue* q : queues) {
    std::unique_lock<std::mutex> lock(q->mu);
    if (!q->popped.wait_until(lock, deadline, [&] {
          return (q->fifo.empty() && !q->running) || torn_down_.load() || faulted_.load();
        })) {
      const std::string what =
          std::string("emulated ") + call + ": its implicit device synchronization would hang on a GPU: a stream "
          "(ours or a user's) still holds work after " + std::to_string(options_.hang_report_after.count()) +
          " ms (a wait nothing will satisfy?)";
      {
        std::lock_guard<std::mutex> hangs_lock(hangs_mu_);
        hangs_.push_back(what);
      }
      throw Error(ErrorCode::kInternal, what);
    }
  }
  check_no_fault(call);
}

void EmulatedDevice::synchronize(Stream stream) {
  std::shared_ptr<StreamState> s = stream_of(stream);
  {
    std::unique_lock<std::mutex> lock(s->hw->mu);
    s->hw->popped.wait(lock, [&] { return (s->queued == 0 && !s->running) || torn_down_.load(); });
  }
  check_no_fault("cudaStreamSynchronize");
}

Event EmulatedDevice::create_event() {
  check_no_fault("cudaEventCreate");
  block_creation_while_waiting();
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= options_.max_events) throw Error(ErrorCode::kSystem, "emulated cudaEventCreate: cudaErrorMemoryAllocation");
  Event h = next_handle_++;
  events_[h] = std::make_shared<EventState>();
  return h;
}

Event EmulatedDevice::create_ipc_event() {
  check_no_fault("cudaEventCreateWithFlags(cudaEventInterprocess)");
  block_creation_while_waiting();
  auto state = std::make_shared<EventState>();
  state->fd = new_memfd(EventState::kIpcEventBytes, "freescale-emulated-ipc-event");
  state->words = static_cast<std::atomic<uint64_t>*>(map_fd_or_close(state->fd, EventState::kIpcEventBytes));
  std::lock_guard<std::mutex> lock(mu_);
  Event h = next_handle_++;
  events_[h] = std::move(state);
  return h;
}

std::string EmulatedDevice::ipc_event_handle(Event event) {
  std::shared_ptr<EventState> ev = event_of(event);
  if (ev->fd < 0) throw Error(ErrorCode::kSystem, "emulated cudaIpcGetEventHandle: not an inter-process event");
  return peer_fd_handle(ev->fd, EventState::kIpcEventBytes);
}

Event EmulatedDevice::ipc_open_event(const std::string& handle) {
  check_no_fault("cudaIpcOpenEventHandle");
  size_t bytes = 0;
  int fd = open_peer_fd(handle, &bytes);
  if (bytes != EventState::kIpcEventBytes) {
    close(fd);
    throw Error(ErrorCode::kCommError, "emulated cudaIpcOpenEventHandle: not an event handle '" + handle + "'");
  }
  auto state = std::make_shared<EventState>();
  state->words = static_cast<std::atomic<uint64_t>*>(map_fd_or_close(fd, bytes));
  close(fd);
  std::lock_guard<std::mutex> lock(mu_);
  Event h = next_handle_++;
  events_[h] = std::move(state);
  return h;
}

void EmulatedDevice::destroy_event(Event event) {
  check_no_fault("cudaEventDestroy");
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.erase(event) == 0) throw Error(ErrorCode::kSystem, "emulated cudaEventDestroy: invalid resource handle");
}

void EmulatedDevice::record_event(Event event, Stream stream) {
  count_call(&DriverCalls::event_records);
  std::shared_ptr<EventState> ev = event_of(event);
  std::shared_ptr<StreamState> s = stream_of(stream);
  check_no_fault("cudaEventRecord");
  {
    std::lock_guard<std::mutex> e(ev->mu);
    ev->error.clear();
  }
  const uint64_t generation = ev->recorded().fetch_add(1) + 1;  // pending from now on
  push(s, Task{nullptr, nullptr, ev, generation}, "cudaEventRecord");
}

bool EmulatedDevice::event_done(Event event, const char* what) {
  std::shared_ptr<EventState> ev = event_of(event);
  if (std::string f = fault(); !f.empty()) throw Error(ErrorCode::kSystem, std::string(what) + ": " + f);
  if (ev->completed().load() < ev->recorded().load()) return false;
  std::lock_guard<std::mutex> lock(ev->mu);
  if (!ev->error.empty()) throw Error(ErrorCode::kSystem, std::string(what) + ": " + ev->error);
  return true;
}

void EmulatedDevice::wait_event(Stream stream, Event event) {
  count_call(&DriverCalls::event_waits);
  std::shared_ptr<EventState> ev = event_of(event);
  const uint64_t generation = ev->recorded().load();  // the record at the time of the call, as CUDA
  if (generation == 0) return;                      // never recorded: nothing to wait for
  push(stream_of(stream), Task{nullptr, [this, ev, generation] {
         spin_until([&] { return ev->completed().load() >= generation; });
       }, nullptr, 0}, "cudaStreamWaitEvent");
}

namespace {

// The block of `blocks` (start -> what, bytes_of(what) bytes; a 0-byte block holds its start)
// that holds `p`, or nullptr.
template <typename T, typename BytesOf>
const T* block_holding(const std::map<void*, T>& blocks, const void* p, BytesOf bytes_of) {
  auto it = blocks.upper_bound(const_cast<void*>(p));
  if (it == blocks.begin()) return nullptr;
  --it;
  const auto* start = static_cast<const uint8_t*>(it->first);
  return static_cast<const uint8_t*>(p) < start + std::max<size_t>(bytes_of(it->second), 1) ? &it->second : nullptr;
}

}  // namespace

CopyExecutor EmulatedDevice::executor(const void* dst, const void* src) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto imported_shareable = [this](const void* p) {
    const Shared* s = block_holding(shareables_, p, [](const Shared& x) { return x.bytes; });
    return s != nullptr && s->imported;
  };
  auto elsewhere = [this, &imported_shareable](const void* p) {  // another device's memory, or the host's
    auto n = [](size_t bytes) { return bytes; };
    const Mapping* m = block_holding(allocations_, p, [](const Mapping& x) { return x.bytes; });
    return (m != nullptr && m->fd < 0) || block_holding(host_blocks_, p, n) || block_holding(registered_, p, n) ||
           block_holding(peer_mapped_, p, n) || imported_shareable(p);
  };
  if (elsewhere(dst) || elsewhere(src)) return CopyExecutor::kCopyEngine;
  return copies_within_a_device_on_copy_engines(options_.driver_version, options_.batch_api) ? CopyExecutor::kCopyEngine
                                                                                              : CopyExecutor::kSm;
}

void EmulatedDevice::imported_locked(const void* p, std::vector<Imported>* out) const {
  const Mapping* m = block_holding(allocations_, p, [](const Mapping& x) { return x.bytes; });
  if (m == nullptr || m->fd >= 0) return;
  for (const Imported& seen : *out)
    if (seen.owned == m->owned) return;
  out->push_back(Imported{m->owned, m->owner});
}

void EmulatedDevice::add_peer_mapping(const void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  peer_mapped_[const_cast<void*>(ptr)] = bytes;
}

void EmulatedDevice::remove_peer_mapping(const void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  peer_mapped_.erase(const_cast<void*>(ptr));
}

CopyCounts EmulatedDevice::copy_counts() const {
  std::lock_guard<std::mutex> lock(counts_mu_);
  return copies_;
}

DriverCalls EmulatedDevice::driver_calls() const {
  std::lock_guard<std::mutex> lock(counts_mu_);
  return calls_;
}

void EmulatedDevice::copy_batch(Stream stream, const CopyBatch& batch) {
  if (batch.empty()) return;
  if (options_.batch_api && stream == 0) {  // cuda_runtime_api.h: "Must not be legacy NULL stream."
    throw Error(ErrorCode::kSystem, "emulated cudaMemcpyBatchAsync: cudaErrorInvalidValue (the legacy NULL stream)");
  }
  size_t sm_copies = 0;
  {
    CopyCounts counted;
    for (size_t i = 0; i < batch.dsts.size(); ++i) {
      bool sm = executor(batch.dsts[i], batch.srcs[i]) == CopyExecutor::kSm;
      (sm ? counted.sm_copies : counted.ce_copies) += 1;
      (sm ? counted.sm_bytes : counted.ce_bytes) += batch.sizes[i];
    }
    std::lock_guard<std::mutex> lock(counts_mu_);
    copies_.ce_copies += counted.ce_copies;
    copies_.sm_copies += counted.sm_copies;
    copies_.ce_bytes += counted.ce_bytes;
    copies_.sm_bytes += counted.sm_bytes;
    sm_copies = counted.sm_copies;
    (options_.batch_api ? calls_.copy_batches : calls_.copies) += options_.batch_api ? 1 : batch.dsts.size();
  }
  std::vector<Imported> imported;  // the IPC mappings the batch touches: gone with their owner
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < batch.dsts.size(); ++i) {
      imported_locked(batch.dsts[i], &imported);
      imported_locked(batch.srcs[i], &imported);
    }
  }
  enqueue(stream, [this, batch, sm_copies, imported] {
    for (const Imported& m : imported) {
      const bool freed = m.owned->load(std::memory_order_acquire) == 0;
      if (freed || !process_alive(ProcessId{m.owner, 0})) {
        throw Error(ErrorCode::kSystem, "emulated illegal address (an MMU fault, sticky): a copy touched an IPC mapping of "
                                        "an allocation whose owner (pid " + std::to_string(m.owner) + ") " +
                                        (freed ? "freed it" : "exited"));
      }
    }
    // One batch runs as one unit: its SM copies start once a user's kernel leaves the SMs.
    bool delayed = sm_copies > 0 && wait_for_free_sms();
    size_t bytes = 0;
    for (size_t i = 0; i < batch.dsts.size(); ++i) {
      dma_copy(batch.dsts[i], batch.srcs[i], batch.sizes[i]);
      bytes += batch.sizes[i];
    }
    std::lock_guard<std::mutex> lock(counts_mu_);
    copies_.executed_bytes += bytes;
    if (delayed) copies_.sm_copies_delayed += sm_copies;
  });
}

bool EmulatedDevice::wait_for_free_sms() {
  bool waited = false;
  while (sms_occupied_.load()) {
    if (torn_down_.load() || faulted_.load()) throw Abandoned{};
    waited = true;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return waited;
}

void EmulatedDevice::count_call(size_t DriverCalls::*kind) {
  std::lock_guard<std::mutex> lock(counts_mu_);
  calls_.*kind += 1;
}

void EmulatedDevice::require_current_context(const char* call, Stream stream) const {
  // A driver call with no stream of its own (or the legacy stream 0, which is the current
  // context's) acts in the thread's current context; with none, the driver returns
  // CUDA_ERROR_INVALID_CONTEXT (runtime calls would make one instead: make_current).
  if (stream == 0 && t_context == nullptr) {
    throw Error(ErrorCode::kSystem, std::string("emulated ") + call +
                                        ": CUDA_ERROR_INVALID_CONTEXT (no current context on this thread)");
  }
}

void EmulatedDevice::write_value32(Stream stream, DevicePtr addr, uint32_t value) {
  require_current_context("cuStreamWriteValue32", stream);
  count_call(&DriverCalls::value_writes);
  enqueue(stream, [addr, value] { reinterpret_cast<std::atomic<uint32_t>*>(addr)->store(value, std::memory_order_release); });
}

void EmulatedDevice::require_64_bit_memops(const char* call) {
  if (attribute(current_device(), DeviceAttribute::kCanUse64BitStreamMemOps) == 0) {
    throw Error(ErrorCode::kSystem, std::string("emulated ") + call +
                                        ": CUDA_ERROR_NOT_SUPPORTED (no CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)");
  }
}

void EmulatedDevice::write_value64(Stream stream, DevicePtr addr, uint64_t value) {
  require_current_context("cuStreamWriteValue64", stream);
  require_64_bit_memops("cuStreamWriteValue64");
  count_call(&DriverCalls::value_writes);
  enqueue(stream, [addr, value] { reinterpret_cast<std::atomic<uint64_t>*>(addr)->store(value, std::memory_order_release); });
}

void EmulatedDevice::wait_value32(Stream stream, DevicePtr addr, uint32_t value, WaitCmp cmp) {
  require_current_context("cuStreamWaitValue32", stream);
  count_call(&DriverCalls::value_waits);
  enqueue(stream, [this, addr, value, cmp] {
    spin_until([&] { return compare(reinterpret_cast<const std::atomic<uint32_t>*>(addr), value, cmp); });
  });
}

void EmulatedDevice::wait_value64(Stream stream, DevicePtr addr, uint64_t value, WaitCmp cmp) {
  require_current_context("cuStreamWaitValue64", stream);
  require_64_bit_memops("cuStreamWaitValue64");
  count_call(&DriverCalls::value_waits);
  enqueue(stream, [this, addr, value, cmp] {
    spin_until([&] { return compare(reinterpret_cast<const std::atomic<uint64_t>*>(addr), value, cmp); });
  });
}

void* EmulatedDevice::device_alloc(size_t bytes) {
  check_no_fault("cudaMalloc");
  int fd = new_memfd(mapped_bytes(bytes), "freescale-emulated-device");
  void* p = map_fd_or_close(fd, mapped_bytes(bytes));
  auto* owned = owner_word(p, bytes);
  owned->store(1, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  allocations_[p] = Mapping{bytes, fd, owned, getpid()};
  return p;
}

void EmulatedDevice::device_free(void* ptr) {
  check_no_fault("cudaFree");
  synchronize_device("cudaFree");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(ptr);
  if (it == allocations_.end() || it->second.fd < 0) throw Error(ErrorCode::kSystem, "emulated cudaFree: not a device allocation");
  it->second.owned->store(0, std::memory_order_release);  // importers' copies fault from now on
  munmap(ptr, mapped_bytes(it->second.bytes));
  close(it->second.fd);
  allocations_.erase(it);
}

void* EmulatedDevice::host_alloc_mapped(size_t bytes, DevicePtr* device) {
  check_no_fault("cudaHostAlloc");
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw Error(ErrorCode::kSystem, "emulated cudaHostAlloc: out of memory");
  std::lock_guard<std::mutex> lock(mu_);
  host_blocks_[p] = bytes;
  *device = reinterpret_cast<DevicePtr>(p);  // one address space: the device address is the host's
  return p;
}

void EmulatedDevice::host_free(void* ptr) {
  check_no_fault("cudaFreeHost");
  synchronize_device("cudaFreeHost");
  std::lock_guard<std::mutex> lock(mu_);
  if (host_blocks_.erase(ptr) == 0) throw Error(ErrorCode::kSystem, "emulated cudaFreeHost: not a mapped host block");
  std::free(ptr);
}

DevicePtr EmulatedDevice::host_register(void* ptr, size_t bytes) {
  check_no_fault("cudaHostRegister");
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_.emplace(ptr, bytes).second) {
    throw Error(ErrorCode::kSystem, "emulated cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered");
  }
  return reinterpret_cast<DevicePtr>(ptr);
}

void EmulatedDevice::host_unregister(void* ptr) {
  check_no_fault("cudaHostUnregister");
  std::lock_guard<std::mutex> lock(mu_);
  if (registered_.erase(ptr) == 0) throw Error(ErrorCode::kSystem, "emulated cudaHostUnregister: not registered");
}

void EmulatedDevice::memset_async(Stream stream, void* ptr, size_t bytes) {
  enqueue(stream, [ptr, bytes] { dma_copy_zero(ptr, bytes); });
}

void EmulatedDevice::flush_remote_writes() {
  check_no_fault("cudaDeviceFlushGPUDirectRDMAWrites");
  if ((attribute(current_device(), DeviceAttribute::kGpuDirectRdmaFlushWritesOptions) & kFlushWritesOptionHost) == 0) {
    throw Error(ErrorCode::kSystem, "emulated cudaDeviceFlushGPUDirectRDMAWrites: cudaErrorNotSupported (no host option in "
                                    "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)");
  }
  flushes_.fetch_add(1);
}

void* EmulatedDevice::shareable_alloc(size_t bytes, int* fd) {
  check_no_fault("cuMemCreate");
  int memfd = new_memfd(bytes, "freescale-emulated-shareable");
  void* p = map_fd_or_close(memfd, bytes);
  *fd = memfd;  // the caller's (cuMemExportToShareableHandle); the mapping holds the pages
  std::lock_guard<std::mutex> lock(mu_);
  shareables_[p] = Shared{bytes, false};
  return p;
}

void* EmulatedDevice::shareable_import(int fd, size_t bytes) {
  check_no_fault("cuMemImportFromShareableHandle");
  void* p = map_fd(fd, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  shareables_[p] = Shared{bytes, true};
  return p;
}

void EmulatedDevice::shareable_release(void* ptr) {
  check_no_fault("cuMemUnmap");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = shareables_.find(ptr);
  if (it == shareables_.end()) throw Error(ErrorCode::kSystem, "emulated cuMemUnmap: not a shareable mapping");
  munmap(ptr, std::max<size_t>(it->second.bytes, 1));
  shareables_.erase(it);
}

std::string EmulatedDevice::ipc_handle(void* ptr) {
  check_no_fault("cudaIpcGetMemHandle");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(ptr);
  if (it == allocations_.end() || it->second.fd < 0) {
    throw Error(ErrorCode::kSystem, "emulated cudaIpcGetMemHandle: not a device allocation");
  }
  return peer_fd_handle(it->second.fd, it->second.bytes);
}

void* EmulatedDevice::ipc_open(const std::string& handle) {
  check_no_fault("cudaIpcOpenMemHandle");
  synchronize_device("cudaIpcOpenMemHandle");  // (see the header: modelled as synchronizing)
  size_t bytes = 0;
  int fd = open_peer_fd(handle, &bytes);
  void* p = map_fd_or_close(fd, mapped_bytes(bytes));
  close(fd);
  std::lock_guard<std::mutex> lock(mu_);
  allocations_[p] = Mapping{bytes, -1, owner_word(p, bytes), static_cast<pid_t>(std::stol(handle))};
  return p;
}

void* EmulatedDevice::allocation_base(const void* ptr, size_t* bytes) {
  require_current_context("cuMemGetAddressRange", 0);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.upper_bound(const_cast<void*>(ptr));
  if (it != allocations_.begin()) {
    --it;
    const auto* start = static_cast<const uint8_t*>(it->first);
    if (it->second.fd >= 0 && static_cast<const uint8_t*>(ptr) < start + std::max<size_t>(it->second.bytes, 1)) {
      *bytes = it->second.bytes;
      return it->first;
    }
  }
  throw Error(ErrorCode::kSystem, "emulated cuMemGetAddressRange: not in a device allocation of this device");
}

void EmulatedDevice::ipc_close(void* ptr) {
  check_no_fault("cudaIpcCloseMemHandle");
  synchronize_device("cudaIpcCloseMemHandle");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.find(ptr);
  if (it == allocations_.end() || it->second.fd >= 0) throw Error(ErrorCode::kSystem, "emulated cudaIpcCloseMemHandle: not an IPC mapping");
  munmap(ptr, mapped_bytes(it->second.bytes));
  allocations_.erase(it);
}

// --- EmulatedShmem -----------------------------------------------------------------------------
namespace {

constexpr int kMaxPes = 64;
constexpr size_t kHandleChars = 64;
constexpr size_t kHeapAlign = 512;

void apply_signal(std::atomic<uint64_t>* word, uint64_t value, ShmemSignalOp op) {
  if (op == ShmemSignalOp::kSet) {
    word->store(value, std::memory_order_release);
  } else {
    word->fetch_add(value, std::memory_order_acq_rel);
  }
}

// A collective step among the PEs that share a Rendezvous: counts this PE in `arrived`, then waits
// until all `pes` are, at most `limit`. False if some never came.
bool everyone_arrives(std::atomic<uint32_t>& arrived, uint32_t pes, std::chrono::milliseconds limit) {
  arrived.fetch_add(1);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (arrived.load() < pes) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

struct Rendezvous {
  std::atomic<uint32_t> joined;
  std::atomic<uint32_t> finalized;  // PEs that gave back their last reference (teardown is collective)
  char handles[kMaxPes][kHandleChars];
};

}  // namespace

EmulatedShmem::EmulatedShmem(EmulatedDevice& device, EmulatedShmemOptions options) : device_(device), options_(options) {
  if (options_.reorder_signals.count() > 0) holder_ = std::thread([this] { deliver_held_signals(); });
}

EmulatedShmem::~EmulatedShmem() {
  device_.shutdown();  // stream work may still touch the heaps
  if (holder_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(held_mu_);
      stopping_ = true;
    }
    held_cv_.notify_all();
    holder_.join();  // it lands what it still holds first
  }
  for (size_t p = 0; p < heaps_.size(); ++p) {
    if (heaps_[p] == nullptr) continue;
    device_.remove_peer_mapping(heaps_[p]);
    munmap(heaps_[p], heap_bytes_);
  }
  if (heap_fd_ >= 0) close(heap_fd_);
  if (rendezvous_ != nullptr) munmap(rendezvous_, sizeof(Rendezvous));
  if (rendezvous_fd_ >= 0) close(rendezvous_fd_);
}

void EmulatedShmem::read_environment_once() {
  if (environment_read_) return;
  environment_read_ = true;
  const char* remote = std::getenv("NVSHMEM_REMOTE_TRANSPORT");
  remote_transport_seen_ = remote != nullptr ? remote : "<unset>";
  const char* size = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  heap_bytes_ = size != nullptr ? std::strtoull(size, nullptr, 10) : options_.heap_bytes;
}

std::string EmulatedShmem::unique_id() {
  read_environment_once();
  if (rendezvous_fd_ < 0) {
    rendezvous_fd_ = new_memfd(sizeof(Rendezvous), "freescale-emulated-uid");
    rendezvous_ = map_fd(rendezvous_fd_, sizeof(Rendezvous));
    new (rendezvous_) Rendezvous{};
  }
  return peer_fd_handle(rendezvous_fd_, sizeof(Rendezvous));
}

int EmulatedShmem::init(const std::string& unique_id, int rank, int world) {
  if (started_) {  // NVSHMEM's "multi-init": a reference more, the arguments ignored
    ++extra_inits_;
    ++references_;
    return 0;
  }
  if (!device_.has_context()) return kNoContextInit;  // NVSHMEM's init fails without one (pytorch#161232)
  read_environment_once();
  if (world > kMaxPes || rank < 0 || rank >= world) return 1;
  if (rendezvous_ == nullptr) {
    size_t bytes = 0;
    int fd = open_peer_fd(unique_id, &bytes);
    rendezvous_ = map_fd_or_close(fd, sizeof(Rendezvous));
    close(fd);
  }
  auto* meet = static_cast<Rendezvous*>(rendezvous_);
  rank_ = rank;
  heap_fd_ = new_memfd(heap_bytes_, "freescale-emulated-heap");
  heaps_.assign(static_cast<size_t>(world), nullptr);
  heaps_[rank] = static_cast<uint8_t*>(map_fd(heap_fd_, heap_bytes_));
  std::snprintf(meet->handles[rank], kHandleChars, "%d:%d:%zu", static_cast<int>(getpid()), heap_fd_, heap_bytes_);
  if (!everyone_arrives(meet->joined, static_cast<uint32_t>(world), std::chrono::seconds(30))) return 2;  // collective
  if (options_.init_status != 0) return options_.init_status;  // failed after the collective part
  pids_.assign(static_cast<size_t>(world), 0);
  for (int p = 0; p < world; ++p) {
    pids_[p] = static_cast<pid_t>(std::atol(meet->handles[p]));
    if (p == rank) continue;
    size_t bytes = 0;
    int fd = open_peer_fd(meet->handles[p], &bytes);
    heaps_[p] = static_cast<uint8_t*>(map_fd_or_close(fd, bytes));
    close(fd);
    if (is_mapped(nullptr, p)) device_.add_peer_mapping(heaps_[p], heap_bytes_);
  }
  started_ = true;
  references_ = 1;
  return 0;
}

std::string EmulatedShmem::init_status_text() {
  if (options_.bootstrapped_only) return "NVSHMEM_STATUS_IS_BOOTSTRAPPED (emulated: init failed past its bootstrap)";
  return options_.limited_mpg ? "NVSHMEM_STATUS_LIMITED_MPG (emulated: several PEs on one GPU without MPS)"
                              : "NVSHMEM_STATUS_IS_INITIALIZED";
}

void EmulatedShmem::exit_if_half_started() const {
  if (!options_.bootstrapped_only) return;
  std::fputs("emulated nvshmem: nvshmem initialization failed, exiting\n", stderr);  // NVSHMEMI_ERROR_EXIT
  std::_Exit(87);
}

void EmulatedShmem::exit_if_context_faulted() const {
  if (device_.fault().empty()) return;
  // NVSHMEM's on-stream calls check the launch or copy they make (CUDA_RUNTIME_CHECK,
  // NVSHMEMI_NZ_EXIT: exit(-1)), and a faulted context fails every one (sticky)
  std::fputs("emulated nvshmem: a CUDA call failed on a faulted context, exiting\n", stderr);
  std::_Exit(255);
}

void* EmulatedShmem::malloc(size_t bytes) {
  exit_if_half_started();
  size_t start = (used_ + kHeapAlign - 1) / kHeapAlign * kHeapAlign;
  if (heaps_.empty() || start + bytes > heap_bytes_) return nullptr;
  used_ = start + bytes;
  return heaps_[rank_] + start;
}

uint8_t* EmulatedShmem::remote(const void* local, int pe) const {
  auto offset = static_cast<const uint8_t*>(local) - heaps_[rank_];
  if (offset < 0 || static_cast<size_t>(offset) >= heap_bytes_ || pe < 0 || pe >= static_cast<int>(heaps_.size())) {
    throw Error(ErrorCode::kSystem, "emulated nvshmem: address outside the symmetric heap or bad PE");
  }
  return heaps_[pe] + offset;
}

void EmulatedShmem::put_signal_on_stream(void* dest, const void* src, size_t bytes, uint64_t* signal, uint64_t value,
                                         ShmemSignalOp op, int pe, Stream stream) {
  uint8_t* to = remote(dest, pe);
  auto* word = reinterpret_cast<std::atomic<uint64_t>*>(remote(signal, pe));
  exit_if_half_started();
  exit_if_context_faulted();
  if (options_.limited_mpg) std::_Exit(86);  // what NVSHMEM 3.8 may do (ShmemOps::fully_initialized)
  if (op == ShmemSignalOp::kAdd || !is_mapped(dest, pe)) kernels_.fetch_add(1);  // NVSHMEM's kernels
  if (op == ShmemSignalOp::kSet && is_mapped(signal, pe)) set_from_pageable_memory(stream);
  const Link link = link_to(pe);
  device_.enqueue(stream, [this, to, src, bytes, word, value, op, link, pe] {
    if (!arrives("a put", pe, link)) return;
    dma_copy(to, src, bytes);
    deliver(word, value, op);
  });
}

void EmulatedShmem::signal_op_on_stream(uint64_t* signal, uint64_t value, ShmemSignalOp op, int pe, Stream stream) {
  auto* word = reinterpret_cast<std::atomic<uint64_t>*>(remote(signal, pe));
  exit_if_half_started();
  exit_if_context_faulted();
  if (options_.limited_mpg) std::_Exit(86);
  if (op == ShmemSignalOp::kAdd || !is_mapped(signal, pe)) kernels_.fetch_add(1);
  if (op == ShmemSignalOp::kSet && is_mapped(signal, pe)) set_from_pageable_memory(stream);
  const Link link = link_to(pe);
  device_.enqueue(stream, [this, word, value, op, link, pe] {
    if (!arrives("a signal", pe, link)) return;
    deliver(word, value, op);
  });
}

void EmulatedShmem::set_from_pageable_memory(Stream stream) {
  pageable_signals_.fetch_add(1);
  device_.synchronize(stream);  // a pageable copy may wait for the stream's earlier work
}

void* EmulatedShmem::peer_pointer(const void* symmetric, int pe) {
  return is_mapped(symmetric, pe) ? remote(symmetric, pe) : nullptr;
}

size_t EmulatedShmem::signals_held() {
  std::lock_guard<std::mutex> lock(held_mu_);
  return held_.size();
}

void EmulatedShmem::quiet_on_stream(Stream stream) {
  exit_if_half_started();
  exit_if_context_faulted();
  if (options_.limited_mpg) std::_Exit(86);
  const bool stalls = issued_to_stalled_.load();  // it completes those puts too: never
  device_.enqueue(stream, [this, stalls] {
    if (failed_completion_.load()) {  // NVSHMEM's proxy: exit(-1) from progress_quiet
      std::fputs("emulated nvshmem proxy: aborting due to error in progress_quiet\n", stderr);
      std::_Exit(255);
    }
    if (stalls) device_.spin_until([] { return false; }, /*is_stream_wait=*/false);
    std::lock_guard<std::mutex> lock(held_mu_);
    for (auto& [word, held] : held_) apply_signal(word, held.value, held.op);
    held_.clear();
  });
}

EmulatedShmem::Link EmulatedShmem::link_to(int pe) {
  auto network_pe_in = [&](const std::vector<int>& list) {
    return !is_mapped_pe(pe) && std::find(list.begin(), list.end(), pe) != list.end();
  };
  Link link{network_pe_in(options_.stalled_pes), network_pe_in(options_.failing_pes)};
  if (link.stalls) issued_to_stalled_.store(true);
  return link;
}

bool EmulatedShmem::arrives(const char* what, int pe, Link link) {
  if (link.fails) throw Error(ErrorCode::kSystem, std::string("emulated nvshmem: ") + what + " to PE " + std::to_string(pe) + " failed on the network");
  if (finalized_) throw Error(ErrorCode::kSystem, std::string("emulated nvshmem: ") + what + " after the runtime was finalized (its heap is gone)");
  if (link.stalls) device_.spin_until([] { return false; }, /*is_stream_wait=*/false);  // never completes
  return reached(pe);
}

void EmulatedShmem::finalize() {
  exit_if_half_started();
  if (references_ == 0) return;
  if (--references_ > 0) return;
  started_ = false;
  finalized_ = true;
  // NVSHMEM's teardown (the last reference) is collective: it returns once every PE is in it, and
  // hangs where one never comes. Emulated: a PE still waiting after options_.finalize_hang_after
  // ends its process (kFinalizeHangExit), naming the wait a GPU run would never leave.
  auto* meet = static_cast<Rendezvous*>(rendezvous_);
  const auto pes = static_cast<uint32_t>(heaps_.size());
  if (!everyone_arrives(meet->finalized, pes, options_.finalize_hang_after)) {
    std::fprintf(stderr, "emulated NVSHMEM: PE %d's last finalize waits for %u of %u PEs (NVSHMEM hangs here)\n", rank_,
                 pes - meet->finalized.load(), pes);
    std::_Exit(kFinalizeHangExit);
  }
}

bool EmulatedShmem::reached(int pe) {
  if (is_mapped_pe(pe) || pe == rank_ || pe < 0 || pe >= static_cast<int>(pids_.size()) || process_alive(ProcessId{pids_[pe], 0})) {
    return true;
  }
  failed_completion_.store(true);  // the work request fails; the proxy reports it at the next quiet
  return false;
}

bool EmulatedShmem::is_mapped_pe(int pe) const {
  return std::find(options_.network_pes.begin(), options_.network_pes.end(), pe) == options_.network_pes.end();
}

bool EmulatedShmem::is_mapped(const void*, int pe) { return is_mapped_pe(pe); }

void EmulatedShmem::deliver(std::atomic<uint64_t>* word, uint64_t value, ShmemSignalOp op) {
  if (options_.reorder_signals.count() == 0) {
    apply_signal(word, value, op);
    return;
  }
  std::lock_guard<std::mutex> lock(held_mu_);
  auto it = held_.find(word);
  if (it == held_.end()) {
    held_[word] = HeldSignal{value, op, std::chrono::steady_clock::now() + options_.reorder_signals};
    held_cv_.notify_all();
    return;
  }
  apply_signal(word, value, op);  // the later signal overtakes the held one
  apply_signal(word, it->second.value, it->second.op);
  held_.erase(it);
  reordered_.fetch_add(1);
}

void EmulatedShmem::deliver_held_signals() {
  std::unique_lock<std::mutex> lock(held_mu_);
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    auto next = std::chrono::steady_clock::time_point::max();
    for (auto it = held_.begin(); it != held_.end();) {
      if (stopping_ || it->second.until <= now) {
        apply_signal(it->first, it->second.value, it->second.op);
        it = held_.erase(it);
      } else {
        next = std::min(next, it->second.until);
        ++it;
      }
    }
    if (stopping_) return;
    if (next == std::chrono::steady_clock::time_point::max()) {
      held_cv_.wait(lock);
    } else {
      held_cv_.wait_until(lock, next);
    }
  }
}

}  // namespace freescale

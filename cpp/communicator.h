// A communicator = bootstrap + scheduler + transport + one progress thread. Ops are matched
// across ranks by sequence number (program order); priorities only reorder execution.
//
// Progress runs on whichever thread holds progress_mu_: a thread blocked in wait(), which drives
// rounds itself (no hand-off between threads per op), or else the progress thread, which sleeps
// until kicked: by an op submitted without a waiter, or by a waiter leaving work behind. Only the
// holder touches the scheduler, the transport's progress methods and waiting_/active_, and only
// the holder sleeps on the transport's doorbell.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/layout.h"
#include "cpp/op_state.h"
#include "cpp/progress_lock.h"
#include "cpp/scheduler.h"
#include "cpp/transport.h"

namespace freescale {

class Communicator {
 public:
  // Collective over `bootstrap` (used during construction only). config.timeout_ms == 0 means
  // the default of 30 minutes (torch's default group timeout).
  Communicator(Bootstrap& bootstrap, Config config);
  // Same, over the transport `make` builds (collective over the bootstrap it is given): tests run
  // the CUDA transports on the emulated device this way.
  using TransportFactory = std::function<std::unique_ptr<Transport>(Bootstrap&, const Config&)>;
  Communicator(Bootstrap& bootstrap, Config config, const TransportFactory& make);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return world_; }
  const Config& config() const { return config_; }
  const char* transport_name() const { return transport_->name(); }
  std::string data_path() const { return transport_->data_path(); }

  // AllToAllv of raw bytes. send/recv: base pointers the layout's offsets are relative to; they
  // must stay valid until the op completes. Validates the layout (InvalidArgument) and throws
  // CommError if the communicator is broken, before queuing anything. Never blocks on peers.
  // caller_waits: the caller calls wait() on it next, so the progress thread is not woken for it.
  // stream: for CUDA buffers, the caller's stream: the transfer starts after what it holds now.
  // kind: what the caller runs; a peer running a kind this one cannot meet fails the op (OpKind).
  std::shared_ptr<OpState> all_to_all(const uint8_t* send, uint8_t* recv, AllToAllLayout layout, int priority,
                                      bool caller_waits = false, uintptr_t stream = 0,
                                      OpKind kind = OpKind::kAllToAllSingle);
  // Lets peers write this rank's receive blocks that lie in [ptr, ptr + bytes), a device buffer
  // (ce transport), directly: no staging copy, and none within this GPU. Local (no peer takes
  // part); the buffer must outlive the communicator. Returns its index. kUnsupported elsewhere.
  int register_buffer(void* ptr, uint64_t bytes) { return transport_->register_buffer(ptr, bytes); }
  // Makes CUDA `stream` wait for `op`'s device work (transports with stream completion: ce,
  // nvshmem; Unsupported otherwise): blocks the CPU until that work is enqueued, at most
  // `timeout` (negative: none; false if it passed). InvalidUsage on the progress thread (from a
  // done-callback) for an op not completed: nothing would enqueue its work while it blocks.
  bool stream_wait(const std::shared_ptr<OpState>& op, uintptr_t stream,
                   std::chrono::microseconds timeout = std::chrono::microseconds(-1));

  // Blocks until `op` (from this communicator) is done, driving progress on the calling thread;
  // false if `timeout` (negative = no limit) passed first. Throws the op's CommError if it failed.
  bool wait(const std::shared_ptr<OpState>& op, std::chrono::microseconds timeout);

  // Explains a failure of a collective run outside this communicator (one the backend delegates to
  // gloo) among the same ranks: if a rank in `needed` died or closed its communicator, throws the
  // CommError naming it (PEER_DIED / COMM_ERROR, the lowest such rank); else returns. This
  // communicator's own failures and peers' notices about theirs explain nothing of another
  // group's collective and are not read. Any thread; takes no lock; never blocks on peers.
  void raise_peer_failure(const std::vector<int>& needed) const;
  // Collectives run outside this communicator among its ranks (delegated to gloo): this rank
  // publishes each call's `text` (what must agree across ranks) before making it, so that one
  // whose call failed can compare every rank's (Transport::note_delegated_call). Any thread.
  uint64_t note_delegated_call(const std::string& text) { return transport_->note_delegated_call(text); }
  std::vector<std::string> delegated_calls(uint64_t n) const { return transport_->delegated_calls(n); }
  // A collective run outside this communicator among its ranks (delegated to gloo) failed for
  // `code`, because of rank `culprit` (as raise_peer_failure named it): this communicator fails
  // too (pending ops fail; later ones raise it), and its abort notice tells peers, so a survivor
  // that sees this rank gone next follows the notice to `culprit` instead of naming this rank.
  // No-op once closed or broken. Any thread but one holding locks the progress thread needs.
  void fail_from_outside(ErrorCode code, const std::string& message, int culprit);

  // Stops the progress thread; pending ops fail with CommError; peers learn this rank left.
  // Idempotent. Call without holding locks the progress thread's callbacks need (the GIL).
  void close();
  bool closed() const;
  // True once a failure or close() gave up on device work of this communicator (a copy stuck
  // behind work it cannot see end): the buffers of ops failed since may still be read or written
  // by the device and must never be freed or reused. Any thread.
  bool device_work_abandoned() const { return transport_->device_work_abandoned(); }
  // True on this communicator's own progress thread (where it must not be destroyed: the
  // destructor joins that thread).
  bool on_progress_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void progress_loop();
  // One round of progress: admit, receive, send, health. True if anything moved. Holder of
  // progress_mu_ only; never throws (a failure fails every op).
  bool progress_round();
  // Sleeps on the doorbell until activity after `epoch`, or `limit`. Holder of progress_mu_ only.
  void sleep_after(uint32_t epoch, std::chrono::microseconds limit);
  // True if some op is pending. Holder of progress_mu_ only.
  bool work_pending() const;
  void kick_progress_thread();
  void admit();
  bool send_round();
  void check_health(Clock::time_point now);
  void fail_all(ErrorCode code, const std::string& message, int culprit);
  // What a failed op's message adds when device work was abandoned (device_work_abandoned), else "".
  std::string abandoned_note() const;

  int rank_;
  int world_;
  Config config_;
  std::unique_ptr<Transport> transport_;
  Scheduler scheduler_;

  mutable std::mutex mu_;  // guards the fields below
  std::deque<std::shared_ptr<OpState>> submissions_;
  uint64_t next_seq_ = 0;
  bool closed_ = false;
  bool broken_ = false;
  ErrorCode broken_code_ = ErrorCode::kCommError;
  std::string broken_message_;
  int broken_culprit_ = -1;

  ProgressLock progress_mu_;          // held by the thread running progress rounds
  std::atomic<int> drivers_{0};       // threads in wait() that want progress_mu_
  std::atomic<int64_t> unfinished_{0}; // ops submitted and not completed
  std::mutex kick_mu_;           // guards kicked_
  std::condition_variable kick_cv_;
  bool kicked_ = false;          // the progress thread has work no waiter drives

  // Holder of progress_mu_ only:
  std::deque<std::shared_ptr<OpState>> waiting_;  // submitted, not posted yet (window full)
  std::vector<std::shared_ptr<OpState>> active_;  // posted, not complete
  Clock::time_point next_health_{};
  std::thread thread_;
};

}  // namespace freescale

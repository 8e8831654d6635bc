// The one interface every transport implements (host shared memory, copy engines, NVSHMEM).
// A transport moves chunks and reports arrivals; it knows nothing of priorities. All methods but
// wake() are called from the communicator's progress thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpp/errors.h"
#include "cpp/layout.h"
#include "cpp/op_state.h"
#include "cpp/root_cause.h"
#include "cpp/transfer.h"

namespace freescale {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // How this transport moves bytes on this machine, and whether that takes SM kernels (and why),
  // for users deciding what overlaps their compute. Known once it is set up.
  virtual std::string data_path() const = 0;

  // On the submitting thread, before the op exists and outside every lock (it may block, e.g.
  // while a CUDA stream's queue is full): marks the point of `stream` the transfer must wait for.
  // Returns an opaque mark for on_submit, or for discard_submission if the op is then refused.
  // Throws to refuse the op.
  virtual uintptr_t mark_submission(uintptr_t /*stream*/) { return 0; }
  // On the submitting thread, as `op` gets its seq (under the communicator's lock: quick, no
  // blocking call): ties `mark` to the op. Never throws.
  virtual void on_submit(OpState& /*op*/, uintptr_t /*mark*/) {}
  // The op marked by `mark` was refused before it got a seq.
  virtual void discard_submission(uintptr_t /*mark*/) {}
  // On any thread but the progress thread: makes CUDA `stream` wait for op's device work on
  // this rank, on a wait CUDA sees ordered after that work (design.md §4): blocks the CPU until
  // the op's last device operation is enqueued (or the op completed or failed), not until it
  // lands. False if `timeout` (negative: none) passed first. Transports whose ops complete on
  // the host only (host) refuse with kUnsupported.
  virtual bool stream_wait(const OpState& /*op*/, uintptr_t /*stream*/, std::chrono::microseconds /*timeout*/) {
    throw Error(ErrorCode::kUnsupported, std::string("the ") + name() + " transport has no stream completion: call wait()");
  }
  // Local (any thread): lets peers write this rank's receive blocks that lie inside
  // [ptr, ptr + bytes) directly (a device buffer). Returns its index. Transports that always move
  // bytes through their own staging refuse with kUnsupported.
  virtual int register_buffer(void* /*ptr*/, uint64_t /*bytes*/) {
    throw Error(ErrorCode::kUnsupported, std::string("the ") + name() + " transport has no registered buffers");
  }
  // Registers op's receive side and lets peers send to it. Called once per op, in seq order.
  virtual void post(const std::shared_ptr<OpState>& op) = 0;
  // True if one chunk of `t` can be handed over now without blocking (peer posted the op and
  // there is room).
  virtual bool can_send(const Transfer& t) const = 0;
  // Moves chunk `c` of `t`; the receiver learns t.bytes with it. Precondition: can_send(t).
  // The communicator calls poll() after every round of sends: a transport may batch the device
  // work of a round's chunks until then.
  virtual void send_chunk(const Transfer& t, const Chunk& c) = 0;
  // Chunks one send round may hand over before the receive side is drained again (a transport
  // that only queues device work per chunk can take a whole window at once).
  virtual int chunks_per_send_round() const { return 8; }
  // Receive-side progress: consumes what arrived, finishing receive parts (op->part_done()),
  // and finishes an op's last part once every rank has received its share of it.
  // Returns true if anything moved. Throws CommError on a byte-count mismatch.
  virtual bool poll() = 0;
  // Op s may be posted only once op s - max_ops_in_flight() has completed.
  virtual uint64_t max_ops_in_flight() const = 0;
  // Throws CommError if a peer aborted, or died / left while a posted op still needs it.
  virtual void check_peers() = 0;
  // Any thread, read only: what this rank sees of its peers now ([world]: died, closed, aborted
  // with code and culprit; `needed` false), to explain a failure outside this transport's own ops
  // (a collective the backend delegates to gloo). Empty: this transport sees nothing.
  virtual std::vector<PeerSight> peer_sight() const { return {}; }
  // A peer's pid for messages, -1 if unknown. Any thread.
  virtual int peer_pid(int /*rank*/) const { return -1; }
  // Collectives delegated outside this transport (the backend's gloo ones), as `text` saying
  // what must agree across ranks: publishes this rank's next call, returning its index n (this
  // rank's calls so far). delegated_calls(n): every rank's text of its call n ([world]; "" where
  // not seen: not made yet, rewritten since, or a transport that shares nothing). Any thread.
  virtual uint64_t note_delegated_call(const std::string& /*text*/) { return 0; }
  virtual std::vector<std::string> delegated_calls(uint64_t /*n*/) const { return {}; }

  // Progress-thread sleep: read the epoch before a round of work, then wait on it only if that
  // round moved nothing; returns early when anything this rank waits on changes.
  virtual uint32_t activity_epoch() const = 0;
  virtual void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) = 0;
  // Wakes this rank's progress thread. Any thread.
  virtual void wake() = 0;

  // Tells peers this rank failed with `code` because of rank `culprit` (-1: unknown) / left
  // cleanly. Peers raise the root cause: kPeerDied naming the culprit if it died, else
  // kPeerAborted naming this rank, the code and the culprit, and `why` (this rank's own message)
  // where the transport can carry text. The first abort's notice stays.
  virtual void abort(ErrorCode code, int culprit, const std::string& why) = 0;
  // True once quiesce() gave up on device work (a stream that did not run out within its limit,
  // a peer's copies into our buffers still pending): an op failed since may still have its
  // buffers read or written, so they must never be freed or reused. Any thread after quiesce().
  virtual bool device_work_abandoned() const { return false; }
  virtual void close() = 0;
  // close() of a communicator that had failed (its abort notice stands; close() is not called):
  // peers' peer_sight() shows this rank as `left`, so a collective delegated to gloo that fails as
  // it leaves is explained at once, not only once its process is seen gone.
  virtual void leave() {}
  // Called before pending ops fail (a failure, or close() with ops pending): returns once no
  // work this transport queued can still read or write a caller's buffer, so a failed op's
  // buffers are the caller's again once it reports the failure (and a CUDA stream waiting on it
  // is released only then). Device transports drain their streams, ending any wait they cannot
  // satisfy; the transport moves nothing more afterwards. Never throws.
  virtual void quiesce() {}
};

}  // namespace freescale

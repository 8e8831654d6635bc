// The NVSHMEM transport (see cpp/nvshmem_layout.h for the arena, the lanes and the signal words).
// Host driven: no device-side wait anywhere. The device moves bytes (copy engines, NVSHMEM puts)
// and sets signal words; a watch stream that never waits copies our arena's signal words into
// pinned host memory (the mirror), and the host enqueues each step once the mirror shows what it
// depends on. So no hardware queue, shared or not, can hold a step behind a wait that only a
// later step (ours or a peer's) would satisfy (design.md §4). Per chunk n of a pair-lane, slot
// k = n % S:
//
//   sender, before an op's first chunk to dst, on the send stream (dst, lane): our sizes for the
//   op (what we send to and expect from every rank) -> sizes_out[dst][lane]; put them to dst's
//   posted_sizes[seq][me], SET sized[me][seq] = seq + 1. Once freed[dst][lane][k] >= n + 1 - S
//   (dst copied chunk n - S out), same stream: copy input piece(s) -> staging slot (copy
//   engines); putmem_signal staging -> dst's recv slot k, SET ready[me][lane][k] = n + 1. After
//   an op's last chunk, same stream: audit_out[dst][lane] = bytes; put it to dst's
//   audit_bytes[me][seq], SET audit[me][seq] = seq + 1.
//   receiver, once ready[src][lane][k] >= n + 1, on the recv stream (src, lane): copy slot ->
//   output piece(s); SET freed[me][lane][k] = n + 1 at src. Once audit[src][seq] and
//   sized[src][seq] >= seq + 1 (and a later mirror copy, which sees the bytes that landed before
//   that signal): compare audit_bytes with our own count. If they differ, kSizeMismatch naming the
//   odd rank out among those whose sizes landed (cpp/size_blame.h: a copy of posted_sizes started
//   after the mirror showed their sized words), waiting for the rest while that names none.
//   receipts, once every receive part of op seq landed (an event after its last copy) and
//   matched: SET recvd[me][seq] = seq + 1 at every rank; the op is confirmed once the mirror
//   shows recvd[p][seq] >= seq + 1 for every p.
//
// To a P2P-mapped rank, staging and NVSHMEM's calls are skipped: input piece(s) are copied straight
// into its recv slot (copy engines) and every SET above is our own stream memory write to its
// mapped word (set_signal); NVSHMEM's SET there is a copy from pageable memory that may block the
// progress thread until the stream drains. Network ranks get NVSHMEM's puts and signals.
//
// Cost: each slot refill takes a host round trip on both ranks (see the README). Remote writes
// from a network peer are flushed (DeviceOps::flush_remote_writes) before the copies that read
// them are enqueued, as NVSHMEM's own stream wait does. An op starts once its submitter's stream
// passed its submission (SubmitGate). A rank that fails or closes writes a notice into every
// peer's arena; peers read theirs with check_peers() (and watch same-host pids), so a failure
// anywhere fails every survivor promptly, naming the rank.
#include "cuda/nvshmem_transport.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpp/host_layout.h"
#include "cpp/layout.h"
#include "cpp/nvshmem_layout.h"
#include "cpp/op_state.h"
#include "cpp/peer_liveness.h"
#include "cpp/root_cause.h"
#include "cpp/size_blame.h"
#include "cpp/transfer.h"
#include "cuda/device_util.h"
#include "cuda/submit_gate.h"

namespace freescale {
namespace {

constexpr std::chrono::microseconds kPollWhileBusy{50};  // device progress rings no doorbell
constexpr uint64_t kHeapMargin = 64ull << 20;  // symmetric heap beyond our arena
constexpr uint64_t S = kNvshmemSlotsPerLane;
// Waits for our streams to run out last at most this long (or the op timeout, if shorter): a put
// or signal to a network peer that stopped answering never completes.
constexpr std::chrono::milliseconds kSettleAtMost{10000};

std::atomic<bool> g_nvshmem_taken{false};  // NVSHMEM is initialized once per process
// An init that failed past NVSHMEM's bootstrap leaves it half-started for good: any later NVSHMEM
// call in the process exit()s it, so no later communicator may make one.
std::atomic<bool> g_nvshmem_half_started{false};

uint64_t chunks_of(uint64_t bytes, uint64_t chunk) { return bytes == 0 ? 0 : (bytes + chunk - 1) / chunk; }

class NvshmemTransport final : public Transport {
 public:
  NvshmemTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops, ShmemOps& shmem);
  ~NvshmemTransport() override;

  const char* name() const override { return "nvshmem"; }
  std::string data_path() const override { return data_path_; }
  uintptr_t mark_submission(uintptr_t stream) override { return gate_.mark(stream); }
  void on_submit(OpState& op, uintptr_t mark) override { gate_.on_submit(op, mark); }
  void discard_submission(uintptr_t mark) override { gate_.give_event(mark); }
  bool stream_wait(const OpState& op, uintptr_t stream, std::chrono::microseconds timeout) override {
    return gate_.stream_wait(op, stream, timeout);
  }
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  void send_chunk(const Transfer& t, const Chunk& c) override;
  bool poll() override;
  uint64_t max_ops_in_flight() const override { return kOpWindow; }
  void check_peers() override;
  // Same-host liveness and the notices as last copied into the mirror by check_peers (the
  // progress thread): a notice newer than that copy is not seen here.
  std::vector<PeerSight> peer_sight() const override;
  // The notices as in the mirror now, beside `died` (by rank: read before the notices, so a dead
  // peer's last notice is in view).
  std::vector<PeerSight> sight_with(const std::vector<bool>& died) const;
  // NVSHMEM's on-stream calls end the process on a faulted context (their checks exit): a call of
  // ours just before each throws the fault instead (a fault between the two is not caught).
  void throw_if_context_faulted(Stream s);
  int peer_pid(int rank) const override { return rank >= 0 && rank < world_ ? procs_[rank].pid : -1; }
  uint32_t activity_epoch() const override { return epoch_.load(std::memory_order_acquire); }
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  void wake() override;
  // The notice is one symmetric word (code and culprit): `why` stays with this rank's own error.
  void abort(ErrorCode code, int culprit, const std::string& /*why*/) override {
    notify_peers(nvshmem_abort_notice(code, culprit));
  }
  // Our streams run out and our signals land before the notice: a peer that sees us closed and
  // reads its signal words afresh finds everything we sent (check_peers).
  void close() override;
  // Nothing more is enqueued; every stream of ours holds copies, puts and SETs only, so it runs out.
  void quiesce() override { settle_streams(); }
  bool device_work_abandoned() const override { return stuck_; }

 private:
  struct RecvChunk {  // a chunk expected on a pair-lane, in FIFO order
    std::shared_ptr<OpState> op;
    uint64_t n, offset, len;
    bool last;  // the op's last chunk from this source
  };
  struct Audit {  // an op's byte count from `src`, awaited
    std::shared_ptr<OpState> op;
    int src;
    uint64_t seen_in = 0;  // the mirror copy that first showed the audit signal (0: not yet)
  };
  struct Landing {  // a receive part whose last copy was enqueued
    std::shared_ptr<OpState> op;
    int src;
    Event event;  // recorded after that copy
  };
  struct RecvPart {  // (op, src): landed and matched, or not yet
    bool landed = false;
    bool audited = false;
  };

  int pair(int peer, int lane) const { return peer * kNvshmemLanes + lane; }
  uint64_t* word(uint64_t offset) const { return reinterpret_cast<uint64_t*>(arena_ + offset); }
  // On `s`, after its earlier work: SET the signal word at `offset` of rank `pe`'s arena to
  // `value`. A mapped rank's word by our own stream memory write: NVSHMEM's SET to a mapped PE is
  // a copy from pageable memory that may block this thread until the stream drains.
  void set_signal(uint64_t offset, uint64_t value, int pe, Stream s);
  DevicePtr device_word(uint64_t offset) const { return reinterpret_cast<DevicePtr>(arena_ + offset); }
  // A signal word of our arena as the last completed mirror copy saw it.
  uint64_t seen(uint64_t offset) const {
    return read_mapped_word(signal_mirror_ + (offset - layout_.signals_offset()) / sizeof(uint64_t));
  }
  Stream stream_of(std::vector<Stream>& streams, size_t index);
  void start(const std::shared_ptr<OpState>& op);
  // Acts on a completed mirror copy, then starts the next one while anything awaits a signal.
  bool watch();
  bool act_on_signals();
  // Once op's data from `src` landed and its byte count matched, the receive part is finished;
  // once every part is, our receipt goes to every rank (as with the host transport, an op
  // completes only when every rank received all of it and found the byte counts right).
  void part_checked(const std::shared_ptr<OpState>& op, int src);
  // On `s` before op's first chunk to `dst`: our sizes for op into dst's posted_sizes, then its
  // sized word.
  void publish_sizes(const OpState& op, int dst, int lane, Stream s);
  // Op's sizes disagree with a peer's: the odd rank out among ours and the peers' whose sizes the
  // mirror shows landed; *all_landed: every peer's had.
  OddSizeRank odd_size_rank_among_landed(const OpState& op, bool* all_landed);
  // closing: a clean close, whose signals all land before and with the notice.
  void notify_peers(uint64_t notice, bool closing = false);
  // Before a closed peer that an op still needs is blamed: runs our streams out and acts on fresh
  // signal words, then recounts `sight[p].needed`.
  void settle_for_closed_peers(std::vector<PeerSight>& sight);
  // Whether pending `op` still needs closed rank `p`: its data to us, or its receipt (which says
  // it received all of the op). An op that awaits only other ranks' receipts does not need it.
  bool still_needs(const OpState& op, int p) const;
  // Waits until every stream of ours ran out (none waits on the device, but a proxy put to a
  // network peer that stopped answering never completes: at most settle_limit_), and enqueues
  // nothing more. False if a stream failed or still runs (its work may still hold the mirrors).
  // Never throws.
  bool settle_streams();
  std::chrono::steady_clock::time_point settle_deadline() const {
    return std::chrono::steady_clock::now() + (stuck_ ? std::chrono::milliseconds(0) : settle_limit_);
  }
  std::vector<Stream> all_streams() const;
  // How the group's close stands, from the peers' notices in our arena (read afresh).
  enum class GroupClose { kPending, kAllClosed, kNotAll };  // kNotAll: a peer kept, aborted or died
  GroupClose group_close_state();
  // Gives our reference (reference_held_) back in step with the group, or keeps it (close()).
  void give_back_reference() noexcept;
  // Signals `value` into word `offset` of every peer's arena (each word has one such signal),
  // landed before it returns (bounded). False if it may not have landed. Never throws.
  bool send_notice(uint64_t offset, uint64_t value, bool closing);
  // Keeps our reference for good and sets our kept word in every peer's arena (once).
  void keep_reference() noexcept;
  // A failed setup: frees what it made but NVSHMEM and the arena (collective to free, as in the
  // destructor), and gives back a reference it took on a running NVSHMEM. Nothing was enqueued
  // yet. Never throws.
  void release_setup() noexcept;
  // Queues on `s` a copy of the notices and kept words peers wrote into our arena into
  // notice_mirror_.
  void copy_notices(Stream s);
  bool any_busy() const;
  // A peer on this host whose process is gone (peers on other hosts cannot be seen dead here).
  bool any_peer_dead() const;
  // Which peers NVSHMEM reaches by P2P mapping (no kernels) and which through its proxy (a kernel
  // launch per put and per signal): sets data_path_ and network_peer_.
  void describe_data_path();
  // `runs[p]`: "<PE> <PEs>" where NVSHMEM already ran in rank p's process, "-" where not. True if
  // every rank runs it with PE = group rank over exactly this group (we adopt it); false if none
  // does. Otherwise throws InvalidArgument on every rank (they all see `runs`), naming the
  // numbering: the puts of a group whose ranks are not the runtime's PEs would reach the wrong
  // processes, and our collective allocations would wait for PEs outside the group.
  bool adopt_running_nvshmem(const std::vector<std::string>& runs) const;
  // Network peers' puts are read only after cudaDeviceFlushGPUDirectRDMAWrites, unless the device
  // orders network writes natively (attribute 118): sets flush_network_writes_; refuses with
  // kUnsupported where a flush is needed and the device lacks the host option of attribute 117
  // (otherwise every op would fail mid-run).
  void check_network_flush();

  DeviceOps& ops_;
  ShmemOps& shmem_;
  int rank_, world_, device_;
  uint64_t chunk_bytes_;
  NvshmemArenaLayout layout_;
  uint8_t* arena_ = nullptr;  // symmetric: the same offsets address every rank's arena
  // [world] each rank's arena as our device addresses it (P2P: nvshmem_ptr; ours: arena_);
  // nullptr for a rank reached over the network (NVSHMEM's proxy).
  std::vector<uint8_t*> mapped_arena_;
  std::vector<ProcessId> procs_;  // [world] ranks on this host (pid -1 for others)
  bool network_peer_ = false;  // some peer is not P2P-mapped (NVSHMEM's proxy)
  bool flush_network_writes_ = false;  // ... and its puts need a flush before they are read
  std::string data_path_;
  bool took_ = false;         // this transport holds the process's NVSHMEM
  bool adopted_ = false;      // NVSHMEM ran already (another user started it): we joined it
  // A reference of ours that close() gives back in step with the group: the one we took on a
  // runtime we joined, or the one of a runtime we started where some rank proxies to a network
  // peer (its network transport's atexit handler faults unless NVSHMEM was finalized first,
  // pytorch#194146). One we started within a host stays for the life of the process, as torch's.
  bool reference_held_ = false;

  std::vector<Stream> send_, recv_;  // [pair], created on first use
  Stream receipt_stream_ = 0;        // our receipts (SETs)
  Stream watch_stream_ = 0;          // the mirror copies
  Stream health_stream_ = 0;         // the notice copies
  Stream notice_stream_ = 0;         // our notices to peers
  uint64_t* signal_mirror_ = nullptr;  // mapped host: our arena's signal words (layout_.signal_bytes())
  uint64_t* notice_mirror_ = nullptr;  // mapped host: [2][world] notices, then kept words, from the arena
  // Mapped host: [window][send x world][recv x world], our sizes for op seq in entry seq % window
  // (written at its start, read by its publish_sizes copies: reused only after it completed).
  uint64_t* sizes_out_host_ = nullptr;
  uint64_t* sizes_seen_ = nullptr;  // mapped host: one op's posted_sizes, read back on a size mismatch
  DevicePtr mirror_device_ = 0, notice_mirror_device_ = 0;
  std::atomic<bool> notified_{false};
  bool closed_cleanly_ = false;  // close() sent our closed notice (no abort before)
  bool notice_landed_ = false;   // ... and it landed in every peer's arena
  bool keeping_ = false;         // we keep our reference for good (our kept word was sent)
  SubmitGate gate_;  // callers' streams: start gate, events

  // Progress thread only.
  bool settled_ = false;           // quiesced: nothing more is enqueued
  // A stream did not run out within settle_limit_ (later settles do not wait). Read anywhere.
  std::atomic<bool> stuck_{false};
  std::chrono::milliseconds settle_limit_{kSettleAtMost};
  std::optional<Event> watching_;  // the mirror copy in flight
  uint64_t mirror_copies_ = 0;     // completed mirror copies (the mirror shows copy #mirror_copies_)
  bool flush_before_copy_ = false;  // a network peer's byte count is read by the next mirror copy
  std::optional<Event> health_;    // the notice copy in flight
  std::map<uint64_t, std::shared_ptr<OpState>> started_;  // not confirmed yet
  std::map<std::pair<uint64_t, int>, RecvPart> recv_parts_;  // (seq, src)
  std::vector<std::deque<uint64_t>> send_fifo_;   // [pair] ops (seq) still to send, in start order
  std::vector<uint64_t> sent_chunks_;             // [pair] non-empty chunks enqueued so far
  std::vector<uint64_t> recv_chunks_;             // [pair] non-empty chunks expected so far
  std::vector<std::deque<RecvChunk>> expected_;   // [pair] chunks not landed yet, in order
  std::deque<Audit> audits_;
  std::vector<Landing> landing_;

  std::atomic<uint32_t> epoch_{0};
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
};

NvshmemTransport::NvshmemTransport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops, ShmemOps& shmem)
    : ops_(ops),
      shmem_(shmem),
      rank_(bootstrap.rank()),
      world_(bootstrap.size()),
      device_(config.cuda_device),
      chunk_bytes_(config.chunk_bytes),
      layout_(NvshmemArenaLayout::plan(world_, config.chunk_bytes, kOpWindow)),
      procs_(static_cast<size_t>(world_)),
      send_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      recv_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      gate_(ops, device_),
      send_fifo_(static_cast<size_t>(world_ * kNvshmemLanes)),
      sent_chunks_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      recv_chunks_(static_cast<size_t>(world_ * kNvshmemLanes), 0),
      expected_(static_cast<size_t>(world_ * kNvshmemLanes)) {
  mapped_arena_.assign(static_cast<size_t>(world_), nullptr);
  settle_limit_ = config.timeout_ms > 0
                      ? std::min(kSettleAtMost, std::chrono::milliseconds(static_cast<int64_t>(config.timeout_ms)))
                      : kSettleAtMost;
  // Each step's outcome is announced so that every rank fails together (with the failing rank's
  // code), and nobody enters NVSHMEM's collective init while a peer cannot.
  auto announce = [&](ErrorCode code, const std::string& error, const std::string& payload) {
    std::vector<std::string> all = bootstrap.allgather(std::to_string(static_cast<int>(code)) + "\n" + error + "\n" + payload);
    std::vector<std::string> payloads;
    for (int p = 0; p < world_; ++p) {
      size_t a = all[p].find('\n');
      size_t b = a == std::string::npos ? a : all[p].find('\n', a + 1);
      if (b == std::string::npos) throw CommError(ErrorCode::kCommError, "nvshmem transport setup: malformed announcement");
      std::string what = all[p].substr(a + 1, b - a - 1);
      if (!what.empty()) {
        if (took_ && arena_ == nullptr) g_nvshmem_taken.store(false);  // not started: a later try may have it
        release_setup();  // the destructor does not run for a constructor that throws
        throw Error(static_cast<ErrorCode>(std::stoi(all[p].substr(0, a))),
                    "nvshmem transport setup failed on rank " + std::to_string(p) + ": " + what);
      }
      payloads.push_back(all[p].substr(b + 1));
    }
    return payloads;
  };
  ErrorCode code = ErrorCode::kSystem;
  std::string error;
  std::string running = "-";  // "<my PE> <PEs>" where NVSHMEM already runs in this process
  std::optional<ProgressScope> guard;
  try {
    if (g_nvshmem_half_started.load()) {
      throw Error(code, "NVSHMEM's init failed earlier in this process and left it half-started: no NVSHMEM call can "
                        "be made here again (each would end the process); use FREESCALE_TRANSPORT=ce");
    }
    took_ = !g_nvshmem_taken.exchange(true);
    if (!took_) {
      code = ErrorCode::kUnsupported;
      throw Error(code, "NVSHMEM already serves another communicator of this process (it is initialized once, over one "
                        "group); use FREESCALE_TRANSPORT=ce for this one or one NVSHMEM group per process");
    }
    // A second copy of libnvshmem_host in the process would be a second NVSHMEM runtime on this GPU.
    if (const std::vector<std::string> others = shmem_.other_copies(); !others.empty()) {
      code = ErrorCode::kUnsupported;
      std::string list;
      for (const std::string& o : others) list += (list.empty() ? "" : ", ") + o;
      throw Error(code, "two copies of NVSHMEM's host library are loaded in this process: ours (" + shmem_.library() +
                            ") and " + list + " (another user's: torch, nvshmem4py), which would be two NVSHMEM runtimes "
                            "on one GPU; unset FREESCALE_NVSHMEM_LIB (freescale_comm then uses the copy already loaded) "
                            "or point it at that copy");
    }
    guard.emplace(ops_, device_);
    // What the data path needs, checked before NVSHMEM starts: 64-bit stream memory writes (our
    // byte counts), mapped pinned memory (the mirrors) in one address space with the host.
    std::string missing = missing_capability(ops_, device_, "nvshmem",
                                             {DeviceAttribute::kCanUse64BitStreamMemOps, DeviceAttribute::kCanMapHostMemory,
                                              DeviceAttribute::kUnifiedAddressing});
    if (!missing.empty()) {
      code = ErrorCode::kUnsupported;
      throw Error(code, missing);
    }
    // NVSHMEM may run already (torch's symmetric memory, nvshmem4py): its PE numbering then rules.
    if (shmem_.running()) running = std::to_string(shmem_.my_pe()) + " " + std::to_string(shmem_.n_pes());
    signal_mirror_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(layout_.signal_bytes(), &mirror_device_));
    std::fill(signal_mirror_, signal_mirror_ + layout_.signal_bytes() / sizeof(uint64_t), 0);
    notice_mirror_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(sizeof(uint64_t) * 2 * world_, &notice_mirror_device_));
    std::fill(notice_mirror_, notice_mirror_ + 2 * world_, 0);
    DevicePtr unused = 0;  // copies address mapped host memory by its host pointer (unified addressing)
    sizes_out_host_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(layout_.sizes_bytes() * layout_.window, &unused));
    sizes_seen_ = static_cast<uint64_t*>(ops_.host_alloc_mapped(layout_.sizes_bytes() * world_, &unused));
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Step 1: chunk sizes, placement and pids.
  std::vector<std::string> got = announce(
      code, error, std::to_string(chunk_bytes_) + "\n" + host_identity() + "\n" + this_process().encode() + "\n" + running);
  bool one_host = true;
  std::vector<std::string> runs(static_cast<size_t>(world_));
  for (int p = 0; p < world_; ++p) {
    std::istringstream in(got[p]);
    std::string chunk, host, pid;
    if (!std::getline(in, chunk) || !std::getline(in, host) || !std::getline(in, pid) || !std::getline(in, runs[p])) {
      throw CommError(ErrorCode::kCommError, "nvshmem transport setup: malformed announcement from rank " + std::to_string(p));
    }
    if (chunk != std::to_string(chunk_bytes_)) {
      throw InvalidArgument("ranks use different chunk sizes (FREESCALE_CHUNK_BYTES): rank " + std::to_string(p) +
                            " has " + chunk + ", rank " + std::to_string(rank_) + " " + std::to_string(chunk_bytes_) +
                            "; set one value everywhere");
    }
    if (host == host_identity()) {
      procs_[p] = ProcessId::decode(pid);
    } else {
      one_host = false;
    }
  }
  try {
    adopted_ = adopt_running_nvshmem(runs);  // throws on every rank alike where it cannot
  } catch (...) {
    if (took_) g_nvshmem_taken.store(false);
    release_setup();  // the destructor does not run for a constructor that throws
    throw;
  }
  // NVSHMEM reads its environment once, at the first call (rank 0: unique_id): set it before.
  // An adopted runtime read its environment already: it is the other user's (data_path says so).
  if (!adopted_ && one_host) setenv("NVSHMEM_REMOTE_TRANSPORT", "none", 0);  // one node: no network to probe
  // No NVSHMEM collective is ours: its init would build NCCL communicators for its teams, and an
  // NCCL error there exit()s the process. A user's own setting stands.
  if (!adopted_) setenv("NVSHMEM_DISABLE_NCCL", "1", 0);
  if (!adopted_ && std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr) {
    uint64_t heap = std::max<uint64_t>(1ull << 30, layout_.num_bytes() + kHeapMargin);
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap).c_str(), 0);
  }
  // Step 2: rank 0's unique id (an adopted runtime has one: init only counts a reference then).
  std::string uid;
  error.clear();
  code = ErrorCode::kSystem;
  if (rank_ == 0 && !adopted_) {
    try {
      uid = shmem_.unique_id();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  uid = announce(code, error, uid)[0];
  // Step 3: NVSHMEM's collective init (host library only: no NVSHMEM device code is launched).
  try {
    // Adopted: a reference of ours (a second init only counts one), so the other user's
    // finalize cannot tear the runtime down under this communicator.
    ops_.set_device(device_);  // the primary context before NVSHMEM's init (pytorch#161232)
    int status = adopted_ ? shmem_.add_reference(rank_, world_) : shmem_.init(uid, rank_, world_);
    reference_held_ = adopted_ && status == 0;
    if (status != 0) {
      throw Error(code, "NVSHMEM's init returned " + std::to_string(status) + " (NVSHMEM_DEBUG=INFO tells why)");
    }
    if (!shmem_.fully_initialized() && shmem_.limited_mpg()) {
      // NVSHMEM 3.8 reports success here with several PEs on one GPU and no (or an oversubscribed)
      // MPS, and its on-stream calls exit() the process in that mode: refuse instead.
      code = ErrorCode::kUnsupported;
      throw Error(code, "NVSHMEM started in a limited mode (" + shmem_.init_status_text() +
                            "): its on-stream calls would end the process. Several ranks on one GPU need MPS "
                            "(nvidia-cuda-mps-control -d) with thread percentages summing to at most 100 "
                            "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per rank, or "
                            "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1); or use FREESCALE_TRANSPORT=ce "
                            "within a node");
    }
    if (!shmem_.fully_initialized()) {  // its init returned 0 after a failure past the bootstrap
      g_nvshmem_half_started.store(true);
      throw Error(code, "NVSHMEM's init failed after its bootstrap (" + shmem_.init_status_text() +
                            ", though it returned 0; NVSHMEM_DEBUG=INFO tells why). NVSHMEM is left "
                            "half-started in this process: any further NVSHMEM call would end it");
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  announce(code, error, "");
  // Step 4: the arena (collective), its signals zeroed before anyone signals into it.
  code = ErrorCode::kSystem;
  try {
    arena_ = static_cast<uint8_t*>(shmem_.malloc(layout_.num_bytes()));
    if (arena_ == nullptr) {
      // An adopted runtime read NVSHMEM_SYMMETRIC_SIZE when its user started it: raising it now
      // changes nothing.
      const std::string bytes = std::to_string(layout_.num_bytes());
      throw Error(code, "nvshmem_malloc of our arena (" + bytes + " bytes) failed: " +
                            (adopted_ ? "NVSHMEM was started by another user (torch's symmetric memory, nvshmem4py), "
                                        "whose heap size rules and whose allocations share that heap; set "
                                        "NVSHMEM_SYMMETRIC_SIZE to what both need (" + bytes + " bytes more for ours) "
                                        "before it starts NVSHMEM, or use a smaller FREESCALE_CHUNK_BYTES"
                                      : "raise NVSHMEM_SYMMETRIC_SIZE (set before the first communicator), or use a "
                                        "smaller FREESCALE_CHUNK_BYTES"));
    }
    notice_stream_ = ops_.create_stream();
    receipt_stream_ = ops_.create_stream();
    watch_stream_ = ops_.create_stream();
    health_stream_ = ops_.create_stream();
    // On our stream, not the device (a user's stream may wait on anything meanwhile).
    ops_.memset_async(notice_stream_, arena_ + layout_.signals_offset(), layout_.signal_bytes());
    ops_.synchronize(notice_stream_);
    for (int p = 0; p < world_; ++p) mapped_arena_[p] = static_cast<uint8_t*>(shmem_.peer_pointer(arena_, p));
    describe_data_path();
    check_network_flush();  // may refuse (kUnsupported): the backend then falls back to NCCL
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnsupported) code = e.code();
    error = e.message();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::vector<std::string> proxies = announce(code, error, network_peer_ ? "1" : "0");
  // A runtime we started is finalized at close where any rank proxies to a network peer (a
  // decision every rank takes alike: the last finalize is collective).
  if (!adopted_) reference_held_ = std::find(proxies.begin(), proxies.end(), "1") != proxies.end();
}

NvshmemTransport::~NvshmemTransport() {
  // Best effort, never throws. nvshmem_free is collective (a closing rank cannot count on its
  // peers): the arena stays while NVSHMEM runs; close() gave our reference back or kept it.
  ProgressScope guard(ops_, device_, std::nothrow);
  auto quietly = [](auto&& fn) {
    try {
      fn();
    } catch (...) {
    }
  };
  bool settled = settle_streams();
  // A reference still held here (no clean close of the whole group) is kept: the runtime then
  // outlives us, as one we started does (NVSHMEM's last finalize is collective).
  for (Stream s : all_streams()) quietly([&] { ops_.destroy_stream(s); });
  for (Landing& l : landing_) quietly([&] { ops_.destroy_event(l.event); });
  if (watching_) quietly([&] { ops_.destroy_event(*watching_); });
  if (health_) quietly([&] { ops_.destroy_event(*health_); });
  if (settled) {
    for (uint64_t* mapped : {signal_mirror_, notice_mirror_, sizes_out_host_, sizes_seen_})
      if (mapped != nullptr) quietly([&] { ops_.host_free(mapped); });
  } else {
    gate_.leak();  // a failed stream may still hold work that reads them
  }
}

NvshmemTransport::GroupClose NvshmemTransport::group_close_state() {
  if (health_stream_ == 0 || any_peer_dead()) return GroupClose::kNotAll;
  try {
    copy_notices(health_stream_);
    bool failed = false;  // a failed copy leaves the mirror as it was: stale
    if (!drain_streams(ops_, {health_stream_}, settle_deadline(), &failed).empty() || failed) return GroupClose::kNotAll;
  } catch (...) {
    return GroupClose::kNotAll;
  }
  GroupClose state = GroupClose::kAllClosed;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const uint64_t notice = read_mapped_word(notice_mirror_ + p);
    if (read_mapped_word(notice_mirror_ + world_ + p) != 0) return GroupClose::kNotAll;  // p kept its reference
    if (notice == 0) {
      state = GroupClose::kPending;
    } else if (notice != kNvshmemNoticeClosed) {
      return GroupClose::kNotAll;
    }
  }
  return state;
}

// NVSHMEM's last finalize tears it down collectively: every PE must call it, or those that did
// hang. So our reference (reference_held_) goes back only where every rank gives its own back:
// each waits (at most settle_limit_) for every peer's closed notice; one that stops waiting keeps
// its reference and says so (its kept word), and a rank that sees that keeps its own. Left open:
// a rank that reads a peer's closed notice just as that peer stops waiting (it finalizes alone).
void NvshmemTransport::give_back_reference() noexcept {
  if (!reference_held_ || keeping_ || !closed_cleanly_) return;
  if (!notice_landed_) {  // a peer may never see us closed: it would keep, and we would finalize alone
    keep_reference();
    return;
  }
  ProgressScope guard(ops_, device_, std::nothrow);
  const auto deadline = std::chrono::steady_clock::now() + settle_limit_;
  GroupClose state = group_close_state();
  while (state == GroupClose::kPending && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    state = group_close_state();
  }
  if (state != GroupClose::kAllClosed) {
    keep_reference();
    return;
  }
  reference_held_ = false;
  try {
    shmem_.finalize();
  } catch (...) {
    // Best effort: the runtime then stays for the life of the process.
  }
}

void NvshmemTransport::keep_reference() noexcept {
  if (keeping_) return;
  keeping_ = true;
  send_notice(layout_.kept(rank_), 1, false);
}

void NvshmemTransport::release_setup() noexcept {
  ProgressScope guard(ops_, device_, std::nothrow);
  if (reference_held_) {  // a failed step fails every rank alike: our references go back together
    reference_held_ = false;
    try {
      shmem_.finalize();
    } catch (...) {
    }
  }
  for (Stream s : all_streams()) {
    try {
      ops_.destroy_stream(s);
    } catch (...) {
    }
  }
  for (uint64_t** mirror : {&signal_mirror_, &notice_mirror_, &sizes_out_host_, &sizes_seen_}) {
    if (*mirror == nullptr) continue;
    try {
      ops_.host_free(*mirror);
    } catch (...) {
    }
    *mirror = nullptr;
  }
}

std::vector<Stream> NvshmemTransport::all_streams() const {
  std::vector<Stream> all;
  for (Stream s : {notice_stream_, receipt_stream_, watch_stream_, health_stream_})
    if (s != 0) all.push_back(s);
  for (const auto* v : {&send_, &recv_})
    for (Stream s : *v)
      if (s != 0) all.push_back(s);
  return all;
}

bool NvshmemTransport::settle_streams() {
  settled_ = true;
  ProgressScope guard(ops_, device_, std::nothrow);
  bool failed = false;
  const bool ran_out = drain_streams(ops_, all_streams(), settle_deadline(), &failed).empty();
  if (!ran_out) stuck_ = true;
  return ran_out && !failed;
}

Stream NvshmemTransport::stream_of(std::vector<Stream>& streams, size_t index) {
  if (streams[index] == 0) streams[index] = ops_.create_stream();
  return streams[index];
}

void NvshmemTransport::post(const std::shared_ptr<OpState>& op) {
  ProgressScope scope(ops_, device_);
  gate_.post(op);
  gate_.start_ready([this](const std::shared_ptr<OpState>& ready) { start(ready); });
}

void NvshmemTransport::start(const std::shared_ptr<OpState>& op) {
  started_[op->seq] = op;
  uint64_t* sizes = sizes_out_host_ + (op->seq % layout_.window) * 2 * world_;
  std::copy(op->layout.send_bytes.begin(), op->layout.send_bytes.end(), sizes);
  std::copy(op->layout.recv_bytes.begin(), op->layout.recv_bytes.end(), sizes + world_);
  const int lane = nvshmem_lane(op->priority);
  for (int src = 0; src < world_; ++src) {
    const auto index = static_cast<size_t>(pair(src, lane));
    send_fifo_[index].push_back(op->seq);
    const uint64_t bytes = op->layout.recv_bytes[src];
    const uint64_t first = recv_chunks_[index];
    const uint64_t chunks = chunks_of(bytes, chunk_bytes_);
    recv_chunks_[index] = first + chunks;
    recv_parts_[{op->seq, src}] = RecvPart{chunks == 0, false};
    for (uint64_t k = 0; k < chunks; ++k) {
      const uint64_t offset = k * chunk_bytes_;
      expected_[index].push_back(RecvChunk{op, first + k, offset, std::min(chunk_bytes_, bytes - offset), k + 1 == chunks});
    }
    audits_.push_back(Audit{op, src});
  }
}

bool NvshmemTransport::can_send(const Transfer& t) const {
  if (settled_ || !gate_.started(*t.op)) return false;  // its submitter's stream has not got there yet
  const int lane = nvshmem_lane(t.op->priority);
  const auto index = static_cast<size_t>(pair(t.peer, lane));
  // FIFO within a pair-lane (the receiver counts on it).
  if (send_fifo_[index].empty() || send_fifo_[index].front() != t.op->seq) return false;
  if (t.bytes == 0) return true;  // its one empty chunk carries the audit only
  // The slot of our next chunk n is free once the peer copied chunk n - S out of it.
  const uint64_t n = sent_chunks_[index];
  return n < S || seen(layout_.freed(t.peer, lane, n)) >= n + 1 - S;
}

void NvshmemTransport::send_chunk(const Transfer& t, const Chunk& c) {
  ProgressScope scope(ops_, device_);
  const std::shared_ptr<OpState>& op = t.op;
  const int lane = nvshmem_lane(op->priority);
  const int dst = t.peer;
  const auto index = static_cast<size_t>(pair(dst, lane));
  if (c.bytes > chunk_bytes_) throw Error(ErrorCode::kInternal, "chunk larger than an nvshmem slot");
  const Stream s = stream_of(send_, index);
  uint8_t* mapped = mapped_arena_[dst];
  if (c.offset == 0 && dst != rank_) publish_sizes(*op, dst, lane, s);  // the transfer's first chunk
  if (c.bytes > 0) {
    const uint64_t n = sent_chunks_[index]++;
    CopyList copies;
    if (mapped != nullptr) {  // straight into dst's slot (copy engines), then its ready word
      copies.from_send_block(*op, dst, c.offset, c.bytes, mapped + layout_.recv_slot(rank_, lane, n));
      ops_.copy_batch(s, copies.batch);
      set_signal(layout_.ready(rank_, lane, n), n + 1, dst, s);
    } else {  // staged in our heap, put by NVSHMEM's proxy with its signal
      uint8_t* staging = arena_ + layout_.staging_slot(dst, lane, n);
      copies.from_send_block(*op, dst, c.offset, c.bytes, staging);
      ops_.copy_batch(s, copies.batch);
      throw_if_context_faulted(s);
      shmem_.put_signal_on_stream(arena_ + layout_.recv_slot(rank_, lane, n), staging, c.bytes,
                                  word(layout_.ready(rank_, lane, n)), n + 1, ShmemSignalOp::kSet, dst, s);
    }
  }
  if (c.offset + c.bytes == t.bytes) {  // the transfer's last chunk (or its one empty chunk): our byte count
    if (mapped != nullptr) {  // stream memory writes land in stream order: the count before its signal
      ops_.write_value64(s, reinterpret_cast<DevicePtr>(mapped + layout_.audit_bytes(rank_, op->seq)), t.bytes);
      set_signal(layout_.audit(rank_, op->seq), op->seq + 1, dst, s);
    } else {
      ops_.write_value64(s, device_word(layout_.audit_out(dst, lane)), t.bytes);
      throw_if_context_faulted(s);
      shmem_.put_signal_on_stream(word(layout_.audit_bytes(rank_, op->seq)), word(layout_.audit_out(dst, lane)),
                                  sizeof(uint64_t), word(layout_.audit(rank_, op->seq)), op->seq + 1,
                                  ShmemSignalOp::kSet, dst, s);
    }
    send_fifo_[index].pop_front();
  }
}

bool NvshmemTransport::poll() {
  ProgressScope scope(ops_, device_);
  if (settled_) return false;
  bool moved = gate_.start_ready([this](const std::shared_ptr<OpState>& op) { start(op); });
  for (auto it = landing_.begin(); it != landing_.end();) {
    if (!gate_.event_done(it->event, "a receive copy of the nvshmem transport failed")) {
      ++it;
      continue;
    }
    Landing l = std::move(*it);
    it = landing_.erase(it);
    recv_parts_[{l.op->seq, l.src}].landed = true;
    part_checked(l.op, l.src);
    moved = true;
  }
  moved = watch() || moved;
  for (auto it = started_.begin(); it != started_.end();) it = it->second->is_completed() ? started_.erase(it) : std::next(it);
  return moved;
}

bool NvshmemTransport::watch() {
  bool moved = false;
  if (watching_) {
    if (!gate_.event_done(*watching_, "copying the nvshmem signal words to the host failed")) return false;
    watching_.reset();
    ++mirror_copies_;
    moved = act_on_signals();
  }
  // Every started op awaits a signal (at least the receipts that confirm it).
  if (!started_.empty() && !settled_) {
    if (flush_before_copy_) ops_.flush_remote_writes();
    flush_before_copy_ = false;
    CopyBatch batch;
    batch.add(signal_mirror_, arena_ + layout_.signals_offset(), layout_.signal_bytes());
    ops_.copy_batch(watch_stream_, batch);
    watching_ = gate_.take_event();
    ops_.record_event(*watching_, watch_stream_);
  }
  return moved;
}

bool NvshmemTransport::act_on_signals() {
  bool moved = false;
  // Chunks that landed: copy each out, then free its slot for the sender (stream order).
  bool flushed = !flush_network_writes_;
  for (int src = 0; src < world_; ++src) {
    for (int lane = 0; lane < kNvshmemLanes; ++lane) {
      const auto index = static_cast<size_t>(pair(src, lane));
      auto& queue = expected_[index];
      while (!queue.empty() && seen(layout_.ready(src, lane, queue.front().n)) >= queue.front().n + 1) {
        if (!flushed) {
          ops_.flush_remote_writes();  // a network peer's puts, visible to the copies below
          flushed = true;
        }
        const RecvChunk c = std::move(queue.front());
        queue.pop_front();
        const Stream s = stream_of(recv_, index);
        CopyList copies;
        copies.to_recv_block(*c.op, src, c.offset, c.len, arena_ + layout_.recv_slot(src, lane, c.n));
        ops_.copy_batch(s, copies.batch);
        set_signal(layout_.freed(rank_, lane, c.n), c.n + 1, src, s);
        if (c.last) {
          Event ev = gate_.take_event();
          ops_.record_event(ev, s);
          landing_.push_back(Landing{c.op, src, ev});
        }
        moved = true;
      }
    }
  }
  // Byte counts: the signal lands after its word, but one mirror copy may read them in either
  // order; a copy started after the host saw the signal sees the word.
  for (auto it = audits_.begin(); it != audits_.end();) {
    const uint64_t seq = it->op->seq;
    if (it->seen_in == 0) {
      const bool sized = it->src == rank_ || seen(layout_.sized(it->src, seq)) >= seq + 1;
      if (sized && seen(layout_.audit(it->src, seq)) >= seq + 1) {
        it->seen_in = mirror_copies_;
        flush_before_copy_ = flush_before_copy_ || flush_network_writes_;
      }
      ++it;
      continue;
    }
    if (mirror_copies_ == it->seen_in) {
      ++it;
      continue;
    }
    const OpState& op = *it->op;
    const uint64_t bytes = op.layout.recv_bytes[it->src];
    const uint64_t announced = seen(layout_.audit_bytes(it->src, seq));
    if (!op.is_completed() && announced != bytes) {  // (an op that failed meanwhile is dropped below)
      bool all_landed = false;
      const OddSizeRank odd = odd_size_rank_among_landed(op, &all_landed);
      if (odd.rank < 0 && world_ > 2 && !all_landed && Clock::now() < op.deadline) {  // their sizes will tell
        ++it;
        continue;
      }
      throw CommError(ErrorCode::kSizeMismatch,
                      "all_to_all op #" + std::to_string(seq) + ": rank " + std::to_string(rank_) + " expected " +
                          std::to_string(bytes) + " bytes from rank " + std::to_string(it->src) + ", which sends " +
                          std::to_string(announced) + " bytes" + odd_size_rank_words(odd, it->src) + ": " +
                          kSizesDisagree,
                      odd.rank >= 0 ? odd.rank : it->src);
    }
    Audit a = std::move(*it);
    it = audits_.erase(it);
    moved = true;
    if (a.op->is_completed()) continue;  // failed meanwhile
    recv_parts_[{seq, a.src}].audited = true;
    part_checked(a.op, a.src);
  }
  // Receipts: an op every rank received is confirmed.
  for (auto& [seq, op] : started_) {
    if (op->confirmed || op->is_completed()) continue;
    bool all = true;
    for (int p = 0; p < world_ && all; ++p) all = seen(layout_.recvd(p, seq)) >= seq + 1;
    if (!all) continue;
    op->confirmed = true;
    op->part_done();
    moved = true;
  }
  return moved;
}

void NvshmemTransport::part_checked(const std::shared_ptr<OpState>& op, int src) {
  auto it = recv_parts_.find({op->seq, src});
  if (it == recv_parts_.end() || !it->second.landed || !it->second.audited) return;
  recv_parts_.erase(it);
  if (op->is_completed()) return;  // failed meanwhile
  op->recv_finished[src] = 1;
  op->part_done();
  if (--op->recv_parts_left > 0) return;
  for (int p = 0; p < world_; ++p) {
    set_signal(layout_.recvd(rank_, op->seq), op->seq + 1, p, receipt_stream_);
  }
}

void NvshmemTransport::publish_sizes(const OpState& op, int dst, int lane, Stream s) {
  const uint64_t* ours = sizes_out_host_ + (op.seq % layout_.window) * 2 * world_;
  const uint64_t record = layout_.posted_sizes(rank_, op.seq);
  CopyBatch copy;
  if (uint8_t* mapped = mapped_arena_[dst]; mapped != nullptr) {  // straight into dst's record, then its word
    copy.add(mapped + record, ours, layout_.sizes_bytes());
    ops_.copy_batch(s, copy);
    set_signal(layout_.sized(rank_, op.seq), op.seq + 1, dst, s);
    return;
  }
  uint8_t* staging = arena_ + layout_.sizes_out(dst, lane);
  copy.add(staging, ours, layout_.sizes_bytes());
  ops_.copy_batch(s, copy);
  throw_if_context_faulted(s);
  shmem_.put_signal_on_stream(arena_ + record, staging, layout_.sizes_bytes(), word(layout_.sized(rank_, op.seq)),
                              op.seq + 1, ShmemSignalOp::kSet, dst, s);
}

OddSizeRank NvshmemTransport::odd_size_rank_among_landed(const OpState& op, bool* all_landed) {
  std::vector<std::vector<uint64_t>> send(static_cast<size_t>(world_)), recv(static_cast<size_t>(world_));
  send[rank_] = op.layout.send_bytes;
  recv[rank_] = op.layout.recv_bytes;
  // The peers whose sizes the last mirror copy shows landed; a copy started after it sees them
  // (a network peer's once flushed). Health stream: copies of our own arena only, so it runs out.
  std::vector<int> landed;
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && seen(layout_.sized(p, op.seq)) >= op.seq + 1) landed.push_back(p);
  }
  *all_landed = static_cast<int>(landed.size()) == world_ - 1;
  if (!landed.empty()) {
    if (flush_network_writes_) ops_.flush_remote_writes();
    CopyBatch copy;
    copy.add(sizes_seen_, arena_ + layout_.posted_sizes(0, op.seq), layout_.sizes_bytes() * world_);
    ops_.copy_batch(health_stream_, copy);
    bool failed = false;
    if (!drain_streams(ops_, {health_stream_}, settle_deadline(), &failed).empty() || failed) {
      *all_landed = false;
      landed.clear();  // not read: as if none had landed
    }
  }
  for (int p : landed) {
    const uint64_t* theirs = sizes_seen_ + static_cast<uint64_t>(p) * 2 * world_;
    for (int q = 0; q < world_; ++q) {
      send[p].push_back(read_mapped_word(theirs + q));
      recv[p].push_back(read_mapped_word(theirs + world_ + q));
    }
  }
  return odd_size_rank(send, recv);
}

std::vector<PeerSight> NvshmemTransport::sight_with(const std::vector<bool>& died) const {
  std::vector<PeerSight> sight(static_cast<size_t>(world_));
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const uint64_t notice = read_mapped_word(notice_mirror_ + p);
    sight[p].died = died[p];
    sight[p].closed = notice == kNvshmemNoticeClosed;
    sight[p].aborted = notice >= kNvshmemNoticeAbortBase;
    if (sight[p].aborted) {
      sight[p].code = nvshmem_notice_code(notice);
      sight[p].culprit = nvshmem_notice_culprit(notice);
    }
  }
  return sight;
}

std::vector<PeerSight> NvshmemTransport::peer_sight() const {
  std::vector<bool> died(static_cast<size_t>(world_), false);
  for (int p = 0; p < world_; ++p) died[p] = p != rank_ && procs_[p].pid >= 0 && !process_alive(procs_[p]);
  return sight_with(died);
}

void NvshmemTransport::check_peers() {
  ProgressScope scope(ops_, device_);
  // Peers on this host that died; when one is needed by an op, its notice, if it left one,
  // names the root cause (e.g. it detected a split mismatch and exited): read the notices afresh.
  std::vector<bool> died(static_cast<size_t>(world_), false);
  int dead = -1;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || procs_[p].pid < 0 || process_alive(procs_[p])) continue;
    died[p] = true;
    for (const auto& [seq, op] : started_) {
      if (dead < 0 && !op->is_completed() && op->needs_peer(p)) dead = p;
    }
  }
  // The notices peers wrote into our arena: one asynchronous copy in flight at a time (the
  // health stream holds copies only: it never waits on a peer).
  if (health_ && gate_.event_done(*health_, "reading the peers' notices failed")) health_.reset();
  if (!health_) {
    copy_notices(health_stream_);
    health_ = gate_.take_event();
    ops_.record_event(*health_, health_stream_);
  }
  if (dead >= 0) {
    // The copy in flight may have started before the dead peer's notice landed: read afresh
    // (copies of our own arena: they run out; bounded all the same).
    if (drain_streams(ops_, {health_stream_}, settle_deadline()).empty()) {
      copy_notices(health_stream_);
      drain_streams(ops_, {health_stream_}, settle_deadline());
    }
  }
  // Liveness was read first, the notices now: a dead peer's notice is in view (root_cause.h).
  std::vector<PeerSight> sight = sight_with(died);
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    for (const auto& [seq, op] : started_) sight[p].needed |= !op->is_completed() && op->needs_peer(p);
  }
  settle_for_closed_peers(sight);
  throw_root_cause(find_root_cause(sight, rank_), rank_, [this](int r) { return procs_[r].pid; });
}

void NvshmemTransport::close() {
  ProgressScope scope(ops_, device_, std::nothrow);
  const bool settled = arena_ != nullptr && settle_streams();
  closed_cleanly_ = !notified_.load();  // not after an abort's notice
  // Reasons of our own to keep the reference are said before the closed notice: a peer that read
  // that notice with no kept word beside it could finalize without us.
  if (reference_held_ && closed_cleanly_ && (!settled || any_peer_dead())) keep_reference();
  notify_peers(kNvshmemNoticeClosed, true);
  give_back_reference();
}

void NvshmemTransport::settle_for_closed_peers(std::vector<PeerSight>& sight) {
  auto blames = [&] {
    bool any = false;
    for (int p = 0; p < world_; ++p) {
      if (!sight[p].closed) continue;
      sight[p].needed = false;
      for (const auto& [seq, op] : started_) sight[p].needed |= still_needs(*op, p);
      any |= sight[p].needed;
    }
    return any;
  };
  // A closed peer's signals all landed before its notice (close()), so a mirror copied from now on
  // shows them. Our streams never wait on a peer: they run out. Rounds: the stale mirror copy,
  // a fresh one, the copies out it allows, our receipts to ourselves.
  for (int round = 0; round < 5 && !settled_ && blames(); ++round) {
    if (!drain_streams(ops_, all_streams(), settle_deadline()).empty()) break;  // a stalled network peer: blame it
    poll();
  }
}

bool NvshmemTransport::still_needs(const OpState& op, int p) const {
  if (op.is_completed()) return false;
  return !op.recv_finished[p] || seen(layout_.recvd(p, op.seq)) < op.seq + 1;
}

void NvshmemTransport::copy_notices(Stream s) {
  CopyBatch batch;
  batch.add(notice_mirror_, word(layout_.notice(0)), sizeof(uint64_t) * 2 * world_);  // notices, kept words
  ops_.copy_batch(s, batch);
}

void NvshmemTransport::notify_peers(uint64_t notice, bool closing) {
  if (notified_.exchange(true) || arena_ == nullptr) return;
  notice_landed_ = send_notice(layout_.notice(rank_), notice, closing);
}

bool NvshmemTransport::send_notice(uint64_t offset, uint64_t value, bool closing) {
  if (arena_ == nullptr) return false;
  ProgressScope scope(ops_, device_, std::nothrow);  // also from abort(), on any thread
  try {
    // Mapped peers first: our own stream writes, which cannot stall behind a network peer (and on
    // close our streams ran out before, so what we wrote them landed before the notice).
    for (int p = 0; p < world_; ++p) {
      if (p != rank_ && mapped_arena_[p] != nullptr) set_signal(offset, value, p, notice_stream_);
    }
    if (network_peer_) {
      // What we signalled before lands first. NVSHMEM's proxy exits the process when a quiet meets
      // an operation to a dead PE, so no quiet on abort, none once a peer is known dead (the notice
      // may then overtake earlier signals: the group failed), and none after the notices: a peer
      // that closed and exited meanwhile fails its notice, and a quiet then would end this process.
      if (closing && !any_peer_dead()) {
        throw_if_context_faulted(notice_stream_);
        shmem_.quiet_on_stream(notice_stream_);
      }
      for (int p = 0; p < world_; ++p) {
        if (p != rank_ && mapped_arena_[p] == nullptr) set_signal(offset, value, p, notice_stream_);
      }
    }
    // Landed before we return: a failing process often exits right after, and a notice still
    // queued then is lost (peers would report our death, not its cause). Bounded: a network peer
    // that stopped answering never completes its signal (the mapped ones were first).
    bool failed = false;
    return drain_streams(ops_, {notice_stream_}, settle_deadline(), &failed).empty() && !failed;
  } catch (...) {
    return false;  // best effort: peers that miss the notice fail by timeout
  }
}

void NvshmemTransport::describe_data_path() {
  std::string proxied;
  int count = 0;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || shmem_.is_mapped(arena_, p)) continue;
    proxied += (count++ > 0 ? ", " : "") + std::to_string(p);
  }
  network_peer_ = count > 0;
  // Staging a chunk into this rank's heap and copying one out of it are copies within a device:
  // SM kernels unless the batch API carries the overlap flag to a 13.1+ driver (design.md §4).
  const int version = ops_.driver_version();
  const bool batch = ops_.batch_copies();
  const bool engines_within = copies_within_a_device_on_copy_engines(version, batch);
  const std::string driver = "nvshmem (driver " + driver_version_text(version) + "): ";
  const std::string staging =
      engines_within ? "chunks are copied out of this rank's heap (and staged into it for network peers) on copy "
                       "engines (cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute, honored within a "
                       "device from 13.1)"
                     : std::string("chunks are copied out of (and, for network peers, staged into) this rank's "
                                   "symmetric heap by SM kernels (copies within a device: ") +
                           (batch ? "drivers before 13.1 ignore cudaMemcpyFlagPreferOverlapWithCompute for them)"
                                  : "the driver refused cudaMemcpyBatchAsync, so copies go one by one)");
  const std::string common =
      staging + "; the host drives every step from a copy of the signal words (no signal waits, so no NVSHMEM wait "
                "kernels); Work.wait() returns to the CPU once the op completed (every rank's receipt seen)";
  const std::string puts = "every peer is P2P-mapped: chunks go straight into its receive slots by copy-engine "
                           "copies and signal words by stream memory writes (ours: NVSHMEM's SET to a mapped peer is a "
                           "copy from pageable memory that may block the thread); ";
  if (count == 0) {
    data_path_ = driver + (engines_within ? "no SM kernels: " : "SM kernels for copies within this GPU only: ") + puts +
                 common;
  } else {
    data_path_ = driver + "SM kernels for " + std::to_string(count) + " of " + std::to_string(world_ - 1) +
                 " peers (ranks " + proxied + "): NVSHMEM posts puts and signals to peers without P2P through its "
                 "proxy, from a one-thread kernel per call; " + common;
  }
  data_path_ += "; NVSHMEM " + shmem_.version() + " from " + shmem_.library() + "; our arena: " +
                std::to_string((layout_.num_bytes() + (1 << 20) - 1) >> 20) +
                " MiB of the symmetric heap, allocated collectively when the communicator is built (other users' "
                "symmetric allocations must be ordered around it alike on every rank)";
  if (adopted_) {
    data_path_ += "; NVSHMEM was already running in this process (started by another user): this transport joined it, "
                  "with its PE numbering (PE = group rank, checked), its symmetric heap and its environment "
                  "(NVSHMEM_SYMMETRIC_SIZE and NVSHMEM_REMOTE_TRANSPORT were not set by freescale_comm)";
  }
}

void NvshmemTransport::set_signal(uint64_t offset, uint64_t value, int pe, Stream s) {
  if (uint8_t* mapped = mapped_arena_[pe]; mapped != nullptr) {
    ops_.write_value64(s, reinterpret_cast<DevicePtr>(mapped + offset), value);
  } else {
    throw_if_context_faulted(s);
    shmem_.signal_op_on_stream(word(offset), value, ShmemSignalOp::kSet, pe, s);
  }
}

void NvshmemTransport::throw_if_context_faulted(Stream s) {
  (void)ops_.stream_idle(s);  // cudaStreamQuery: throws a sticky fault (not-ready is no error)
}

bool NvshmemTransport::adopt_running_nvshmem(const std::vector<std::string>& runs) const {
  int running = 0;
  bool identity = true;
  std::string numbering;  // "group rank -> PE of n" for every rank
  for (int p = 0; p < world_; ++p) {
    numbering += (p > 0 ? ", " : "") + std::to_string(p) + "->";
    if (runs[p] == "-") {
      numbering += "not started";
      identity = false;
      continue;
    }
    ++running;
    int pe = -1, n = -1;
    std::istringstream(runs[p]) >> pe >> n;
    numbering += std::to_string(pe) + " of " + std::to_string(n);
    identity = identity && pe == p && n == world_;
  }
  if (running == 0) return false;
  if (identity) return true;
  throw InvalidArgument(
      "NVSHMEM already runs in " + std::string(running == world_ ? "every" : "some") + " process of this group, started by "
      "another user (torch's symmetric memory, nvshmem4py) over its own PE numbering: group rank -> NVSHMEM PE is [" +
      numbering + "]. The nvshmem transport needs PE = group rank over exactly this group (NVSHMEM keeps the first "
      "caller's numbering, and its allocations are collective over all its PEs): create this communicator over the group "
      "NVSHMEM was started with, in the same rank order, or start ours first; or use FREESCALE_TRANSPORT=ce within a node");
}

void NvshmemTransport::check_network_flush() {
  if (!network_peer_) return;
  const int ordering = ops_.attribute(device_, DeviceAttribute::kGpuDirectRdmaWritesOrdering);
  flush_network_writes_ = ordering < kRdmaWritesOrderingOwner;
  if (!flush_network_writes_) return;  // flushing to the owner would be a no-op (cuda.h)
  const int options = ops_.attribute(device_, DeviceAttribute::kGpuDirectRdmaFlushWritesOptions);
  if ((options & kFlushWritesOptionHost) != 0) return;
  throw Error(ErrorCode::kUnsupported,
              "the nvshmem transport reads network peers' puts only after cudaDeviceFlushGPUDirectRDMAWrites (GPU " +
                  std::to_string(device_) + " does not order them natively: " +
                  device_attribute_name(DeviceAttribute::kGpuDirectRdmaWritesOrdering) + " = " + std::to_string(ordering) +
                  "), which GPU " + std::to_string(device_) + " does not support (" +
                  device_attribute_name(DeviceAttribute::kGpuDirectRdmaFlushWritesOptions) + " = " +
                  std::to_string(options) + ", no host option); use NCCL for this group");
}

bool NvshmemTransport::any_peer_dead() const {
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && procs_[p].pid >= 0 && !process_alive(procs_[p])) return true;
  }
  return false;
}

bool NvshmemTransport::any_busy() const { return gate_.waiting() || !started_.empty(); }

void NvshmemTransport::wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) {
  std::unique_lock<std::mutex> lock(wake_mu_);
  wake_cv_.wait_for(lock, any_busy() ? std::min(timeout, kPollWhileBusy) : timeout,
                    [&] { return epoch_.load(std::memory_order_acquire) != epoch; });
}

void NvshmemTransport::wake() {
  {
    std::lock_guard<std::mutex> lock(wake_mu_);
    epoch_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_cv_.notify_all();
}

}  // namespace

std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap, const Config& config, DeviceOps& ops,
                                                  ShmemOps& shmem) {
  check_device(ops, config.cuda_device, "nvshmem");  // NVSHMEM's init exits the process without a GPU
  return std::make_unique<NvshmemTransport>(bootstrap, config, ops, shmem);
}

}  // namespace freescale

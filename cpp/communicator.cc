#include "cpp/communicator.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "cpp/device_transports.h"
#include "cpp/host_transport.h"
#include "cpp/peer_liveness.h"
#include "cpp/root_cause.h"
#include "cpp/thread_role.h"
#include "cpp/timeouts.h"
#include "cpp/transport_select.h"

namespace freescale {
namespace {

thread_local bool t_own_progress_thread = false;

constexpr std::chrono::milliseconds kHealthPeriod{10};  // peer / deadline checks while busy
constexpr std::chrono::microseconds kDriverRetry{200};  // a waiter re-tries to drive this often
constexpr uint64_t kDefaultTimeoutMs = 30ull * 60 * 1000;

std::unique_ptr<Transport> make_transport(Bootstrap& bootstrap, const Config& config) {
  TransportNeeds needs;
  needs.requested = config.transport;
  needs.cuda_tensors = config.cuda_device >= 0;
  needs.same_host = true;  // CPU: the host transport's setup finds out otherwise (kUnsupported)
  needs.ce_built = device_transport_built(TransportKind::kCe);
  needs.nvshmem_built = device_transport_built(TransportKind::kNvshmem);
  if (needs.cuda_tensors) {
    // Collective (every rank builds its CUDA core at the same op): auto picks by placement.
    std::vector<std::string> hosts = bootstrap.allgather(host_identity());
    needs.same_host = std::all_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h == hosts[0]; });
  }
  TransportChoice choice = select_transport(needs);
  switch (choice.kind) {
    case TransportKind::kHost:
      return std::make_unique<HostTransport>(bootstrap, config);
    case TransportKind::kCe:
    case TransportKind::kNvshmem:
      return make_device_transport(choice.kind, bootstrap, config);
    default:
      throw Error(ErrorCode::kUnsupported, std::string("no transport of this build serves these tensors (") +
                                               transport_kind_name(choice.kind) + "): " + choice.warning);
  }
}

Config with_default_timeout(Config c) {
  c.validate();
  if (c.timeout_ms == 0) c.timeout_ms = kDefaultTimeoutMs;
  return c;
}

}  // namespace

Communicator::Communicator(Bootstrap& bootstrap, Config config) : Communicator(bootstrap, std::move(config), make_transport) {}

Communicator::Communicator(Bootstrap& bootstrap, Config config, const TransportFactory& make)
    : rank_(bootstrap.rank()),
      world_(bootstrap.size()),
      config_(with_default_timeout(std::move(config))),
      transport_(make(bootstrap, config_)),
      scheduler_(config_.chunk_bytes, std::chrono::microseconds(config_.aging_us)) {
  thread_ = std::thread([this] { progress_loop(); });
}

Communicator::~Communicator() {
  try {
    close();
  } catch (...) {
    // Destructors never throw; close() already failed every pending op.
  }
  // A close() that threw before its join left the thread joinable: destroying it would end the
  // process (std::terminate). With closed_ set the loop leaves once woken.
  if (thread_.joinable() && !on_progress_thread()) {
    try {
      {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
      }
      kick_progress_thread();
      thread_.join();
    } catch (...) {
    }
  }
}

std::shared_ptr<OpState> Communicator::all_to_all(const uint8_t* send, uint8_t* recv, AllToAllLayout layout,
                                                  int priority, bool caller_waits, uintptr_t stream, OpKind kind) {
  validate_alltoallv(layout, world_);
  // Outside the lock: marking a CUDA stream can block while its queue is full, and what drains
  // that queue may need the progress thread, which takes mu_.
  uintptr_t mark = 0;
  try {
    mark = transport_->mark_submission(stream);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kSystem) throw;  // a refusal of this op: the communicator is fine
    // A device call failed (e.g. a sticky fault of the CUDA context): nothing more can run here.
    // Fail the communicator so that peers learn it now, naming this rank and the cause, instead of
    // waiting for its ops until their timeout.
    if (closed()) throw Error(ErrorCode::kInvalidUsage, "all_to_all on a closed communicator");
    const std::string why = "submitting an op on rank " + std::to_string(rank_) + " failed: " + e.message();
    if (progress_mu_.held_by_this_thread()) {  // a done-callback submitting: we run the rounds
      fail_all(ErrorCode::kSystem, why, rank_);
    } else {
      std::lock_guard<ProgressLock> hold(progress_mu_);
      fail_all(ErrorCode::kSystem, why, rank_);
    }
    throw CommError(ErrorCode::kSystem, why, rank_);
  }
  std::shared_ptr<OpState> op;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_ || broken_) {
      bool closed = closed_;
      ErrorCode code = broken_code_;
      std::string why = broken_message_;
      int culprit = broken_culprit_;
      lock.unlock();
      transport_->discard_submission(mark);
      if (closed) throw Error(ErrorCode::kInvalidUsage, "all_to_all on a closed communicator");
      throw CommError(code, "the communicator failed earlier and cannot run more ops: " + why, culprit);
    }
    auto deadline = Clock::now() + capped_timeout_ms(config_.timeout_ms);
    op = std::make_shared<OpState>(next_seq_, priority, send, recv, std::move(layout), deadline, kind);
    op->stream = stream;
    transport_->on_submit(*op, mark);
    ++next_seq_;
    unfinished_.fetch_add(1);
    op->add_done_callback([this] { unfinished_.fetch_sub(1); });  // close() completes every op
    submissions_.push_back(op);
  }
  transport_->wake();  // a driving waiter picks it up in its next round
  if (!caller_waits) kick_progress_thread();
  return op;
}

bool Communicator::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void Communicator::raise_peer_failure(const std::vector<int>& needed) const {
  // No lock: the sight is atomics in shared memory and /proc, valid until destruction (also after
  // close(), and in a forked child whose parent held a lock at fork).
  std::vector<PeerSight> sight = transport_->peer_sight();
  if (sight.size() != static_cast<size_t>(world_)) return;
  bool lost = false;  // a rank the collective needs is gone: only that explains its failure
  for (int p : needed) {
    if (p < 0 || p >= world_ || p == rank_) continue;
    sight[p].needed = true;
    sight[p].closed |= sight[p].left;  // aborted (its own op failed), then closed: gone from every collective
    lost |= sight[p].died || sight[p].closed;
  }
  if (!lost) return;
  // Notices are this communicator's own failures, perhaps long reported: one would outrank the
  // death that broke the other group's collective (root_cause.h) and name a rank uninvolved in it.
  // The cause's own notice still says why it left: its op had failed first (e.g. timed out in an
  // all_to_all while this rank ran a delegated collective: programs out of step), not a crash.
  // Kept: a notice that a needed rank died (a survivor of it that explained its own delegated op
  // so, then left): it names who died first, where the deaths alone would name the lowest rank.
  const std::vector<PeerSight> noticed = sight;
  for (PeerSight& s : sight) {
    const bool death_seen = s.code == ErrorCode::kPeerDied && s.culprit >= 0 && s.culprit < world_ &&
                            sight[s.culprit].needed && sight[s.culprit].died;
    s.aborted = s.aborted && death_seen;
  }
  const RootCause cause = find_root_cause(sight, rank_);
  try {
    throw_root_cause(cause, rank_, [this](int r) { return transport_->peer_pid(r); });
  } catch (const CommError& e) {
    if (cause.rank < 0 || !noticed[static_cast<size_t>(cause.rank)].aborted) throw;
    const PeerSight& own = noticed[static_cast<size_t>(cause.rank)];
    const std::string by = own.culprit >= 0 ? ", caused by rank " + std::to_string(own.culprit) : "";
    const std::string said = own.why.empty() ? "" : "; it said: " + own.why;
    throw CommError(e.code(),
                    e.message() + "; before it left, an op of its own had failed (" + error_code_name(own.code) + by +
                        "): ranks that call different collectives fail so" + said,
                    e.culprit());
  }
}

void Communicator::fail_from_outside(ErrorCode code, const std::string& message, int culprit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || broken_) return;
  }
  if (progress_mu_.held_by_this_thread()) {  // a done-callback: this thread runs the rounds
    fail_all(code, message, culprit);
    return;
  }
  std::lock_guard<ProgressLock> hold(progress_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;  // closed while this thread waited for the lock
  }
  fail_all(code, message, culprit);
}

void Communicator::close() {
  // A done-callback runs on the thread driving progress: the progress thread (it cannot join
  // itself; closed_ set first left it joinable: std::terminate) or a waiter holding progress_mu_
  // (close() below takes it again: a hang). Both refuse, before anything changes.
  if (on_progress_thread() || progress_mu_.held_by_this_thread()) {
    throw Error(ErrorCode::kInvalidUsage,
                "close() from a done-callback of the same communicator: callbacks run on the thread that drives its "
                "progress, which cannot stop itself; close from another thread");
  }
  bool was_broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    was_broken = broken_;
  }
  transport_->wake();
  kick_progress_thread();
  if (thread_.joinable()) thread_.join();
  // A driving waiter lets go once it sees closed_; then this thread owns the progress state.
  std::lock_guard<ProgressLock> hold(progress_mu_);
  std::deque<std::shared_ptr<OpState>> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    leftover.swap(submissions_);
  }
  for (auto& op : waiting_) active_.push_back(op);
  for (auto& op : leftover) active_.push_back(op);
  waiting_.clear();
  if (!active_.empty() && !was_broken) transport_->quiesce();  // (fail_all quiesced a broken one)
  // Peers learn this rank closed before its callers see their ops fail: a process that exits
  // right after that error is then named as having closed, not as dead (root_cause.h).
  if (!was_broken) transport_->close();
  else transport_->leave();
  const std::string abandoned = abandoned_note();
  for (auto& op : active_) {
    op->fail(ErrorCode::kCommError,
             "the communicator was closed while op #" + std::to_string(op->seq) + " was pending" + abandoned);
  }
  active_.clear();
  scheduler_.drain();
}

bool Communicator::stream_wait(const std::shared_ptr<OpState>& op, uintptr_t stream, std::chrono::microseconds timeout) {
  if (!op->is_completed() && progress_mu_.held_by_this_thread()) {
    throw Error(ErrorCode::kInvalidUsage,
                "a stream wait on pending op #" + std::to_string(op->seq) +
                    " from a done-callback of the same communicator: callbacks run on the thread that drives its "
                    "progress, which cannot block; chain the work with then() or wait on another thread");
  }
  return transport_->stream_wait(*op, stream, timeout);
}

bool Communicator::wait(const std::shared_ptr<OpState>& op, std::chrono::microseconds timeout) {
  using std::chrono::microseconds;
  if (!op->is_completed() && progress_mu_.held_by_this_thread()) {
    // A done-callback (run by the thread driving progress) blocking on a pending op: nothing
    // would drive that op while this thread waits.
    throw Error(ErrorCode::kInvalidUsage,
                "wait() on pending op #" + std::to_string(op->seq) +
                    " from a done-callback of the same communicator: callbacks run on the thread that drives "
                    "its progress, which cannot block; chain the work with then() or wait on another thread");
  }
  const bool bounded = timeout.count() >= 0 && timeout < kForeverTimeout;
  const auto until = Clock::now() + (bounded ? timeout : microseconds(0));
  auto left = [&] { return std::max(microseconds(0), std::chrono::duration_cast<microseconds>(until - Clock::now())); };
  auto keep_going = [&] { return !op->is_completed() && !closed() && (!bounded || Clock::now() < until); };
  if (keep_going()) {
    drivers_.fetch_add(1);
    transport_->wake();  // the progress thread, if it sleeps in a round, lets go
    while (keep_going()) {
      // The progress thread lets go within a round; another waiter may hold on longer while it
      // drives (completing our op too): look at ours again every kDriverRetry.
      std::unique_lock<ProgressLock> hold(progress_mu_, std::defer_lock);
      if (!hold.try_lock_for(kDriverRetry)) continue;
      while (keep_going()) {
        uint32_t epoch = transport_->activity_epoch();
        if (progress_round() || op->is_completed()) continue;
        sleep_after(epoch, bounded ? std::min<microseconds>(kHealthPeriod, left()) : microseconds(kHealthPeriod));
      }
    }
    // The last waiter out hands ops still pending (async ones) back to the progress thread.
    if (drivers_.fetch_sub(1) == 1 && unfinished_.load() > 0) kick_progress_thread();
  }
  // Done: returns once its callbacks ran. Closed: close() fails it shortly. Else: timed out.
  return op->wait(bounded ? left() : microseconds(-1));
}

bool Communicator::work_pending() const {
  if (!active_.empty() || !waiting_.empty()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return !submissions_.empty();
}

void Communicator::kick_progress_thread() {
  {
    std::lock_guard<std::mutex> lock(kick_mu_);
    kicked_ = true;
  }
  kick_cv_.notify_one();
}

void Communicator::admit() {
  while (!waiting_.empty()) {
    std::shared_ptr<OpState> op = waiting_.front();
    uint64_t oldest_active = op->seq;
    for (const auto& a : active_) oldest_active = std::min(oldest_active, a->seq);
    if (op->seq >= oldest_active + transport_->max_ops_in_flight()) return;  // window full
    waiting_.pop_front();
    active_.push_back(op);  // first: if post() throws (a device fault), fail_all still fails it
    transport_->post(op);
    for (int p = 0; p < world_; ++p) {
      Transfer t;
      t.op = op;
      t.peer = p;
      t.bytes = op->layout.send_bytes[p];
      t.priority = op->priority;
      t.submitted = op->submitted;
      scheduler_.submit(std::move(t));
    }
  }
}

bool Communicator::send_round() {
  bool moved = false;
  auto ready = [this](const Transfer& t) { return transport_->can_send(t); };
  for (int i = 0, n = transport_->chunks_per_send_round(); i < n; ++i) {
    Transfer* t = scheduler_.pick(Clock::now(), ready);
    if (t == nullptr) break;
    Chunk c = scheduler_.next_chunk(*t);
    transport_->send_chunk(*t, c);
    moved = true;
    std::shared_ptr<OpState> op = t->op;  // `t` is freed once its last chunk is recorded
    int peer = t->peer;
    if (scheduler_.chunk_sent(t, c)) {
      op->send_finished[peer] = 1;
      op->part_done();
    }
  }
  return moved;
}

void Communicator::check_health(Clock::time_point now) {
  // Peers first: a notice already in view (a peer that died, or aborted naming its root cause) is
  // the cause, not this rank's own deadline (a rank frozen past it, then resumed, blamed the
  // healthy peers it had kept waiting).
  transport_->check_peers();
  for (const auto& op : active_) {
    if (op->is_completed() || now < op->deadline) continue;
    // Ranks whose bytes are not through yet; when there are none, only other ranks' receipts are missing.
    std::ostringstream waiting;
    int behind = 0, culprit = -1;  // the root cause, when exactly one other rank is still behind
    for (int p = 0; p < world_; ++p) {
      if (!op->recv_finished[p] || !op->send_finished[p]) {
        waiting << (waiting.tellp() > 0 ? ", " : "") << p;
        if (p != rank_) culprit = ++behind == 1 ? p : -1;
      }
    }
    std::string what = waiting.tellp() > 0 ? "still waiting on rank(s) [" + waiting.str() + "]"
                                           : "every byte moved, but some rank has not confirmed receiving its share";
    throw CommError(ErrorCode::kTimeout, op_kind_name(static_cast<uint32_t>(op->kind)) + " op #" + std::to_string(op->seq) + " on rank " + std::to_string(rank_) +
                                             " Timed out after " + std::to_string(config_.timeout_ms / 1000.0) + " s, " +
                                             what + " (set the group timeout or FREESCALE_TIMEOUT_S)", culprit);
  }
}

std::string Communicator::abandoned_note() const {
  if (!transport_->device_work_abandoned()) return "";
  return " (device copies queued for it did not run out within the timeout and cannot be cancelled: they may "
         "still read or write its buffers, which must never be freed; the Python layer keeps them alive)";
}

void Communicator::fail_all(ErrorCode code, const std::string& message, int culprit) {
  std::deque<std::shared_ptr<OpState>> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_code_ = code;
      broken_message_ = message;
      broken_culprit_ = culprit;
    }
    leftover.swap(submissions_);
  }
  transport_->abort(code, culprit, message);
  transport_->quiesce();  // before the ops fail: their buffers are the callers' once they do
  scheduler_.drain();
  for (auto& op : waiting_) active_.push_back(op);
  for (auto& op : leftover) active_.push_back(op);
  waiting_.clear();
  const std::string abandoned = abandoned_note();
  for (auto& op : active_) op->fail(code, message + abandoned, culprit);
  active_.clear();
}

void mark_own_progress_thread() { t_own_progress_thread = true; }
bool on_own_progress_thread() { return t_own_progress_thread; }

void Communicator::progress_loop() {
  mark_own_progress_thread();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(kick_mu_);
      kick_cv_.wait(lock, [this] { return kicked_; });
      kicked_ = false;
    }
    std::lock_guard<ProgressLock> hold(progress_mu_);
    if (closed()) return;
    // Drive until a waiter takes over or nothing is left; then sleep until kicked again.
    while (drivers_.load() == 0 && !closed()) {
      uint32_t epoch = transport_->activity_epoch();
      if (progress_round()) continue;
      if (!work_pending()) break;
      sleep_after(epoch, kHealthPeriod);
    }
  }
}

bool Communicator::progress_round() {
  std::deque<std::shared_ptr<OpState>> fresh;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return false;  // every op failed already; nothing to move until close()
    fresh.swap(submissions_);
  }
  for (auto& op : fresh) waiting_.push_back(std::move(op));
  auto forget_completed = [this] {
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& op) { return op->is_completed(); }),
                  active_.end());
  };
  try {
    forget_completed();
    admit();
    bool moved = transport_->poll();
    moved |= send_round();
    moved |= transport_->poll();
    forget_completed();
    auto now = Clock::now();
    if ((!active_.empty() || !waiting_.empty()) && (!moved || now >= next_health_)) {
      check_health(now);
      next_health_ = now + kHealthPeriod;
    }
    return moved;
  } catch (const Error& e) {
    fail_all(e.code(), e.message(), e.culprit());
  } catch (const std::exception& e) {
    fail_all(ErrorCode::kInternal, e.what(), -1);
  }
  return true;
}

void Communicator::sleep_after(uint32_t epoch, std::chrono::microseconds limit) {
  transport_->wait_for_activity(epoch, limit);
}

}  // namespace freescale

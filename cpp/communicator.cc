#include "cpp/communicator.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "cpp/host_transport.h"

namespace freescale {
namespace {

constexpr std::chrono::milliseconds kHealthPeriod{10};  // peer / deadline checks while busy
constexpr std::chrono::milliseconds kIdleSleep{200};    // sleep with nothing pending (woken on submit)
constexpr int kChunksPerRound = 8;                      // sends between two receive drains
constexpr uint64_t kDefaultTimeoutMs = 30ull * 60 * 1000;

std::unique_ptr<Transport> make_transport(Bootstrap& bootstrap, const Config& config) {
  if (config.transport == "auto" || config.transport == "host") {
    return std::make_unique<HostTransport>(bootstrap, config);
  }
  throw Error(ErrorCode::kUnsupported, "FREESCALE_TRANSPORT=" + config.transport +
                                           " is not built into this core yet; use auto or host");
}

Config with_default_timeout(Config c) {
  c.validate();
  if (c.timeout_ms == 0) c.timeout_ms = kDefaultTimeoutMs;
  return c;
}

}  // namespace

Communicator::Communicator(Bootstrap& bootstrap, Config config)
    : rank_(bootstrap.rank()),
      world_(bootstrap.size()),
      config_(with_default_timeout(std::move(config))),
      transport_(make_transport(bootstrap, config_)),
      scheduler_(config_.chunk_bytes, std::chrono::microseconds(config_.aging_us)) {
  thread_ = std::thread([this] { progress_loop(); });
}

Communicator::~Communicator() {
  try {
    close();
  } catch (...) {
    // Destructors never throw; close() already failed every pending op.
  }
}

std::shared_ptr<OpState> Communicator::all_to_all(const uint8_t* send, uint8_t* recv, AllToAllLayout layout,
                                                  int priority) {
  validate_alltoallv(layout, world_);
  std::shared_ptr<OpState> op;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw Error(ErrorCode::kInvalidUsage, "all_to_all on a closed communicator");
    if (broken_) {
      throw CommError(broken_code_, "the communicator failed earlier and cannot run more ops: " + broken_message_);
    }
    auto deadline = Clock::now() + std::chrono::milliseconds(config_.timeout_ms);
    op = std::make_shared<OpState>(next_seq_++, priority, send, recv, std::move(layout), deadline);
    submissions_.push_back(op);
  }
  transport_->wake();
  return op;
}

bool Communicator::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void Communicator::close() {
  bool was_broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    was_broken = broken_;
  }
  transport_->wake();
  if (thread_.joinable()) thread_.join();
  // The progress thread is gone: this thread owns its state now.
  std::deque<std::shared_ptr<OpState>> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    leftover.swap(submissions_);
  }
  for (auto& op : waiting_) active_.push_back(op);
  for (auto& op : leftover) active_.push_back(op);
  waiting_.clear();
  for (auto& op : active_) op->fail(ErrorCode::kCommError, "the communicator was closed while op #" + std::to_string(op->seq) + " was pending");
  active_.clear();
  scheduler_.drain();
  if (!was_broken) transport_->close();
}

void Communicator::admit() {
  while (!waiting_.empty()) {
    std::shared_ptr<OpState> op = waiting_.front();
    uint64_t oldest_active = op->seq;
    for (const auto& a : active_) oldest_active = std::min(oldest_active, a->seq);
    if (op->seq >= oldest_active + transport_->max_ops_in_flight()) return;  // window full
    waiting_.pop_front();
    transport_->post(op);
    active_.push_back(op);
    for (int p = 0; p < world_; ++p) {
      Transfer t;
      t.op = op;
      t.peer = p;
      t.src = op->send + op->layout.send_offsets[p];
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
  for (int i = 0; i < kChunksPerRound; ++i) {
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
  for (const auto& op : active_) {
    if (op->is_completed() || now < op->deadline) continue;
    std::ostringstream waiting;
    for (int p = 0; p < world_; ++p) {
      if (op->needs_peer(p)) waiting << (waiting.tellp() > 0 ? ", " : "") << p;
    }
    throw CommError(ErrorCode::kTimeout, "all_to_all op #" + std::to_string(op->seq) + " on rank " + std::to_string(rank_) +
                                             " Timed out after " + std::to_string(config_.timeout_ms / 1000.0) +
                                             " s, still waiting on rank(s) [" + waiting.str() +
                                             "] (set the group timeout or FREESCALE_TIMEOUT_S)");
  }
  transport_->check_peers();
}

void Communicator::fail_all(ErrorCode code, const std::string& message) {
  std::deque<std::shared_ptr<OpState>> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_code_ = code;
      broken_message_ = message;
    }
    leftover.swap(submissions_);
  }
  transport_->abort(code);
  scheduler_.drain();
  for (auto& op : waiting_) active_.push_back(op);
  for (auto& op : leftover) active_.push_back(op);
  waiting_.clear();
  for (auto& op : active_) op->fail(code, message);
  active_.clear();
}

void Communicator::progress_loop() {
  auto next_health = Clock::now();
  while (true) {
    uint32_t epoch = transport_->activity_epoch();
    std::deque<std::shared_ptr<OpState>> fresh;
    bool broken;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      fresh.swap(submissions_);
      broken = broken_;
    }
    if (broken) {  // nothing more to do but wait for close()
      transport_->wait_for_activity(epoch, kIdleSleep);
      continue;
    }
    for (auto& op : fresh) waiting_.push_back(std::move(op));
    try {
      active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& op) { return op->is_completed(); }),
                    active_.end());
      admit();
      bool moved = transport_->poll();
      moved |= send_round();
      moved |= transport_->poll();
      active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& op) { return op->is_completed(); }),
                    active_.end());
      auto now = Clock::now();
      if ((!active_.empty() || !waiting_.empty()) && (!moved || now >= next_health)) {
        check_health(now);
        next_health = now + kHealthPeriod;
      }
      if (!moved) {
        transport_->wait_for_activity(epoch, active_.empty() ? std::chrono::microseconds(kIdleSleep)
                                                             : std::chrono::microseconds(kHealthPeriod));
      }
    } catch (const Error& e) {
      fail_all(e.code(), e.message());
    } catch (const std::exception& e) {
      fail_all(ErrorCode::kInternal, e.what());
    }
  }
}

}  // namespace freescale

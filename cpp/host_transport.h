// Host transport: CPU buffers, ranks on one host. Each rank owns one shared segment holding a
// bounded ring of chunk slots towards every peer (two copies: sender -> slot -> receiver), with
// flow control through monotone head/tail counters and futex doorbells. A sender writes op `seq`
// to a peer once that peer has posted `seq`, or before, if all its earlier ops' bytes for that
// peer are out: a ring then holds posted ops, followed by ops in the order the peer posts next,
// so it always drains.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <vector>

#include "cpp/bootstrap.h"
#include "cpp/config.h"
#include "cpp/host_layout.h"
#include "cpp/shm_segment.h"
#include "cpp/transport.h"

namespace freescale {

class HostTransport : public Transport {
 public:
  // Collective over `bootstrap`. Throws kUnsupported if the ranks are not on one host.
  HostTransport(Bootstrap& bootstrap, const Config& config);
  ~HostTransport() override;

  const char* name() const override { return "host"; }
  void post(const std::shared_ptr<OpState>& op) override;
  bool can_send(const Transfer& t) const override;
  void send_chunk(const Transfer& t, const Chunk& c) override;
  bool poll() override;
  uint64_t max_ops_in_flight() const override { return kOpWindow; }
  void check_peers() override;
  uint32_t activity_epoch() const override;
  void wait_for_activity(uint32_t epoch, std::chrono::microseconds timeout) override;
  void wake() override;
  void abort(ErrorCode code) override;
  void close() override;

 private:
  struct Peer {
    ShmSegment segment;        // the peer's segment (ours for self)
    HostSegmentLayout layout;  // its layout
    int pid = 0;
    RankControl* control() const { return layout.control(segment.data()); }
    bool received(uint64_t seq) const {
      return layout.received(segment.data())->received[seq % kOpWindow].load(std::memory_order_acquire) >= seq + 1;
    }
  };
  // Copies one arrived chunk from `src` into its op; finishes the receive part when complete.
  void deliver(int src, const SlotHeader& header, const uint8_t* payload);
  bool drain_from(int src);
  void ring_peer(int peer) { peers_[peer].control()->doorbell.ring(); }
  void ring_all();
  void forget_completed();
  // Confirms posted ops that every rank has received (the op's last part). True if any.
  bool confirm_received();

  int rank_;
  int world_;
  std::vector<Peer> peers_;                             // [world]; peers_[rank_] is our own
  std::map<uint64_t, std::shared_ptr<OpState>> posted_; // seq -> posted, not yet complete
};

}  // namespace freescale

// Issue 22 item 4: a receiver must not trust what a peer wrote into shared memory. A peer whose
// slot headers lie about their payload size gets CommError on the receiver, never a read past
// the slot (a SIGSEGV) or the next slot's bytes copied into the user's output.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "cpp/communicator.h"
#include "cpp/host_transport.h"
#include "cpp_tests/exchange.h"
#include "cpp_tests/fork_ranks.h"

namespace freescale {
namespace {

using testing::Exchange;
using testing::run_forked_ranks;
using testing::small_config;
using testing::uniform_counts;

// The host transport, except that every slot header it writes claims `claim` payload bytes.
class LyingHostTransport : public HostTransport {
 public:
  LyingHostTransport(Bootstrap& bootstrap, const Config& config, uint64_t claim)
      : HostTransport(bootstrap, config, true, 0), claim_(claim) {}

 protected:
  void fill_slot(int peer, uint64_t index, SlotHeader* slot, const OpState& op, uint64_t offset,
                 uint64_t bytes) override {
    slot->bytes = claim_;
    HostTransport::fill_slot(peer, index, slot, op, offset, bytes);
  }

 private:
  uint64_t claim_;
};

// Rank 1 lies (claiming `claim` bytes per chunk of a `per_peer`-byte transfer); rank 0 must fail
// with CommError naming rank 1 and the slot, not crash.
void expect_receiver_refuses_a_header_claiming(uint64_t claim, uint64_t per_peer) {
  auto outcomes = run_forked_ranks(2, [claim, per_peer](int rank, Bootstrap& bootstrap) -> std::string {
    Config config = small_config(/*timeout_ms=*/5000);
    config.chunk_bytes = 256 << 10;
    config.arena_bytes = 4 << 20;
    Exchange x(uniform_counts(2, per_peer), rank);
    Communicator comm(bootstrap, config, [rank, claim](Bootstrap& b, const Config& c) -> std::unique_ptr<Transport> {
      if (rank == 1) return std::make_unique<LyingHostTransport>(b, c, claim);
      return std::make_unique<HostTransport>(b, c);
    });
    try {
      comm.wait(comm.all_to_all(x.send.data(), x.recv.data(), x.layout, 0), std::chrono::microseconds(-1));
    } catch (const CommError& e) {
      if (rank == 1) return "";
      std::string what = e.what();
      return what.find("rank 1") != std::string::npos && what.find("slot") != std::string::npos
                 ? ""
                 : "CommError without the culprit and the slot: " + what;
    }
    return rank == 0 ? "no CommError: the lying header was believed" : "";
  }, std::chrono::seconds(30));
  EXPECT_EQ(outcomes[0].signal, 0) << "the receiver crashed (signal " << outcomes[0].signal << ")";
  EXPECT_EQ(outcomes[0].exit_code, 0) << outcomes[0].message;
}

TEST(HostilePeer, AHeaderClaimingMoreThanTheSlotHoldsIsACommErrorNotACrash) {
  expect_receiver_refuses_a_header_claiming(64ull << 20, 96ull << 20);  // within the transfer: no other check stops it
}

TEST(HostilePeer, AHeaderClaimingTwoSlotsIsACommErrorNotTheNextSlotsBytes) {
  expect_receiver_refuses_a_header_claiming(512ull << 10, 2ull << 20);  // the next slot holds the next chunk
}

}  // namespace
}  // namespace freescale

// Choosing the root cause from what a survivor sees (pure logic; the forked races are in
// test_host_transport.cc, HostTransportRootCause).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpp/root_cause.h"
#include "cpp/size_blame.h"

namespace freescale {
namespace {

using Kind = RootCause::Kind;

PeerSight notice(ErrorCode code, int culprit, bool died = false) {
  PeerSight s;
  s.aborted = true;
  s.code = code;
  s.culprit = culprit;
  s.died = died;
  return s;
}

PeerSight dead(bool needed = true) {
  PeerSight s;
  s.died = true;
  s.needed = needed;
  return s;
}

std::string message_of(const RootCause& cause, int me) {
  try {
    throw_root_cause(cause, me, [](int r) { return 1000 + r; });
  } catch (const CommError& e) {
    return std::string(error_code_name(e.code())) + " culprit " + std::to_string(e.culprit()) + ": " + e.message();
  }
  return "nothing thrown";
}

TEST(RootCause, NothingWrongIsNoCause) {
  std::vector<PeerSight> peers(4);
  peers[2].needed = true;
  EXPECT_EQ(find_root_cause(peers, 0).kind, Kind::kNone);
  // No pid is looked up for no cause (rank -1 would index out of bounds: ASan caught it).
  bool looked_up = false;
  throw_root_cause(find_root_cause(peers, 0), 0, [&](int) { looked_up = true; return 0; });
  EXPECT_FALSE(looked_up);
}

TEST(RootCause, ADeadPeersOwnNoticeWinsOverItsDeath) {
  // Rank 1 saw rank 0 send too many bytes, told every rank, and exited.
  std::vector<PeerSight> peers(4);
  peers[1] = notice(ErrorCode::kSizeMismatch, 0, /*died=*/true);
  peers[1].needed = true;
  RootCause c = find_root_cause(peers, 3);
  EXPECT_EQ(c.kind, Kind::kNotice);
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(message_of(c, 3),
            "PEER_ABORTED culprit 0: rank 1 aborted the communicator (SIZE_MISMATCH, caused by rank 0), so rank 3 fails too");
}

TEST(RootCause, ANoticeOfADeathIsFollowedToTheRankThatDied) {
  // Rank 3 was killed; rank 1 saw it, told every rank, and exited.
  std::vector<PeerSight> peers(4);
  peers[1] = notice(ErrorCode::kPeerDied, 3, /*died=*/true);
  peers[3] = dead(/*needed=*/false);
  RootCause c = find_root_cause(peers, 0);
  EXPECT_EQ(c.kind, Kind::kDeath);
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(message_of(c, 0), "PEER_DIED culprit 3: rank 3 (pid 1003) died while an op that needs it was pending "
                              "(rank 1 saw it first)");
  // Also when the survivor cannot watch rank 3 (another host): the notice is trusted.
  peers[3] = PeerSight{};
  EXPECT_EQ(find_root_cause(peers, 0).rank, 3);
}

TEST(RootCause, ChainsOfNoticesEndAtTheFirstCause) {
  // Rank 2 blamed rank 1's death, but rank 1 had aborted on a mismatch from rank 0 first.
  std::vector<PeerSight> peers(4);
  peers[2] = notice(ErrorCode::kPeerDied, 1, /*died=*/true);
  peers[1] = notice(ErrorCode::kSizeMismatch, 0, /*died=*/true);
  RootCause c = find_root_cause(peers, 3);
  EXPECT_EQ(c.kind, Kind::kNotice);
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(c.code, ErrorCode::kSizeMismatch);
  // A PEER_ABORTED notice naming a rank with its own notice leads there too.
  peers[2] = notice(ErrorCode::kPeerAborted, 1);
  EXPECT_EQ(find_root_cause(peers, 3).rank, 1);
}

TEST(RootCause, TheAbortersOwnWordsAtTheEndOfAChainReachEverySurvivor) {
  // Rank 1 saw the mismatch and said how; rank 2 only relayed it. A survivor reads rank 1's words
  // (before: only the code and the culprit, so it could not tell which sizes disagreed).
  std::vector<PeerSight> peers(4);
  peers[1] = notice(ErrorCode::kSizeMismatch, 0, /*died=*/true);
  peers[1].why = "rank 1 expected 300 bytes from rank 0, which sends 200";
  peers[2] = notice(ErrorCode::kPeerAborted, 1);
  peers[2].why = "rank 1 aborted the communicator";
  EXPECT_EQ(message_of(find_root_cause(peers, 3), 3),
            "PEER_ABORTED culprit 0: rank 1 aborted the communicator (SIZE_MISMATCH, caused by rank 0), so rank 3 "
            "fails too; rank 1 said: rank 1 expected 300 bytes from rank 0, which sends 200");
}

TEST(RootCause, ATimeoutNoticeNamingNoOneBlamesNoOneNotTheRankThatWaited) {
  // Ranks 2 and 3 came late: rank 0 timed out waiting on both (no single culprit). Rank 2, calling
  // at last, was told rank 0 caused it (before: culprit 0, the rank that only waited).
  std::vector<PeerSight> peers(4);
  peers[0] = notice(ErrorCode::kTimeout, -1);
  EXPECT_EQ(message_of(find_root_cause(peers, 2), 2),
            "PEER_ABORTED culprit -1: rank 0 aborted the communicator (TIMEOUT), so rank 2 fails too");
  peers[0] = notice(ErrorCode::kCommError, -1);  // a failure of the aborter's own: it is the cause
  EXPECT_EQ(message_of(find_root_cause(peers, 2), 2).rfind("PEER_ABORTED culprit 0:", 0), 0u);
}

TEST(RootCause, CyclesOfNoticesEnd) {
  std::vector<PeerSight> peers(3);
  peers[1] = notice(ErrorCode::kPeerDied, 2, true);
  peers[2] = notice(ErrorCode::kPeerDied, 1, true);
  RootCause c = find_root_cause(peers, 0);
  EXPECT_NE(c.kind, Kind::kNone);
  EXPECT_NE(message_of(c, 0), "nothing thrown");
}

TEST(RootCause, ADisagreementOrDeathWinsOverATimeoutOverAnUnfollowableNoticeOverAClose) {
  std::vector<PeerSight> peers(5);
  peers[1].closed = peers[1].needed = true;
  EXPECT_EQ(find_root_cause(peers, 0).kind, Kind::kClosed);
  peers[2] = notice(ErrorCode::kPeerAborted, 0);  // names this rank: nothing to follow
  EXPECT_EQ(find_root_cause(peers, 0).rank, 2);
  peers[3] = notice(ErrorCode::kTimeout, -1);
  EXPECT_EQ(find_root_cause(peers, 0).rank, 3);
  peers[4] = dead(/*needed=*/false);  // not needed, but a notice exists: a death explains timeouts
  RootCause c = find_root_cause(peers, 0);
  EXPECT_EQ(c.kind, Kind::kDeath);
  EXPECT_EQ(c.rank, 4);
  peers[2] = notice(ErrorCode::kSizeMismatch, 1);  // ties with the death: the lower rank
  EXPECT_EQ(find_root_cause(peers, 0).rank, 2);
}

TEST(RootCause, APeerThatLeftIsACauseOnlyIfAnOpNeedsIt) {
  std::vector<PeerSight> peers(3);
  peers[1] = dead(/*needed=*/false);
  peers[2].closed = true;
  EXPECT_EQ(find_root_cause(peers, 0).kind, Kind::kNone);
  peers[2].needed = true;
  EXPECT_EQ(message_of(find_root_cause(peers, 0), 0),
            "COMM_ERROR culprit 2: rank 2 (pid 1002) closed its communicator while an op that needs it was pending");
  peers[2].died = true;  // closed, then exited: its close is the cause
  EXPECT_EQ(find_root_cause(peers, 0).kind, Kind::kClosed);
}

TEST(RootCause, ThisRanksOwnEntryAndOutOfRangeCulpritsAreIgnored) {
  std::vector<PeerSight> peers(3);
  peers[0] = notice(ErrorCode::kSizeMismatch, 1);  // our own
  EXPECT_EQ(find_root_cause(peers, 0).kind, Kind::kNone);
  peers[1] = notice(ErrorCode::kPeerDied, 77);
  RootCause c = find_root_cause(peers, 0);
  EXPECT_EQ(c.kind, Kind::kNotice);
  EXPECT_EQ(c.rank, 1);
}

// The size rule the transports share (their forked tests: HostTransportRootCause, NvshmemEmulatedFailures).
TEST(OddSizeRank, TheRankAloneInTheMostDisagreeingPairsAndInTwoOrMoreElseNone) {
  using Sizes = std::vector<std::vector<uint64_t>>;
  Sizes send{{0, 16, 16}, {16, 0, 16}, {16, 16, 0}};
  Sizes recv = send;
  recv[1] = {32, 0, 32};  // rank 1 expects 32 from each peer: in both disagreeing pairs
  OddSizeRank odd = odd_size_rank(send, recv);
  EXPECT_EQ(odd.rank, 1);
  EXPECT_EQ(odd.disagreeing, 2);
  EXPECT_EQ(odd.pairs_of_rank, 2);
  EXPECT_EQ(odd_size_rank_words(odd, 0),
            "; rank 1 is the odd one out: it is in 2 of the 2 (sender, receiver) pairs whose sizes disagree");
  EXPECT_EQ(odd_size_rank_words(odd, 1), "");  // the sender: named by the message already
  Sizes unknown_send = send, unknown_recv = recv;
  unknown_send[2].clear();  // rank 2's sizes not known: its pairs are not counted, one is left
  unknown_recv[2].clear();
  EXPECT_EQ(odd_size_rank(unknown_send, unknown_recv).rank, -1);
  recv[1] = {32, 0, 16};  // one wrong input split: a tie
  odd = odd_size_rank(send, recv);
  EXPECT_EQ(odd.rank, -1);
  EXPECT_EQ(odd_size_rank_words(odd, 0), "");
}

}  // namespace
}  // namespace freescale

// Which rank's sizes are the odd ones out when a receiver's expected byte count disagrees with
// its sender's: shared by the transports, from the sizes every rank posted for the op.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace freescale {

struct OddSizeRank {
  int rank = -1;         // the odd one out, -1 if none can be told
  int disagreeing = 0;   // (sender, receiver) pairs whose sizes disagree
  int pairs_of_rank = 0; // how many of them the rank in the most is in
};

// send[p][q]: the bytes rank p sends rank q; recv[p][q]: the bytes p expects from q; a rank's
// row is empty where its sizes are not known (its pairs are not counted). The odd one is the
// rank in the most disagreeing pairs if it is alone there and in at least two (a rank with wrong
// output splits or dtype disagrees with every peer; a sender with one wrong input split with
// one); two ranks always tie.
OddSizeRank odd_size_rank(const std::vector<std::vector<uint64_t>>& send,
                          const std::vector<std::vector<uint64_t>>& recv);

// What a size mismatch between `src`'s count and ours adds about the odd one:
// "; rank X is the odd one out: it is in K of the N (sender, receiver) pairs whose sizes
// disagree", or "" where it names none or `src` (the message names the sender already).
std::string odd_size_rank_words(const OddSizeRank& odd, int src);

}  // namespace freescale

#include "cpp/size_blame.h"

#include <algorithm>

namespace freescale {

OddSizeRank odd_size_rank(const std::vector<std::vector<uint64_t>>& send,
                          const std::vector<std::vector<uint64_t>>& recv) {
  const int world = static_cast<int>(send.size());
  std::vector<int> in_pairs(static_cast<size_t>(world), 0);
  OddSizeRank odd;
  for (int s = 0; s < world; ++s) {
    for (int r = 0; r < world; ++r) {
      if (s == r || send[s].empty() || recv[r].empty() || send[s][r] == recv[r][s]) continue;
      ++in_pairs[s];
      ++in_pairs[r];
      ++odd.disagreeing;
    }
  }
  if (world == 0) return odd;
  const int most = static_cast<int>(std::max_element(in_pairs.begin(), in_pairs.end()) - in_pairs.begin());
  const bool alone = std::count(in_pairs.begin(), in_pairs.end(), in_pairs[most]) == 1;
  odd.pairs_of_rank = in_pairs[most];
  if (alone && in_pairs[most] >= 2) odd.rank = most;
  return odd;
}

std::string odd_size_rank_words(const OddSizeRank& odd, int src) {
  if (odd.rank < 0 || odd.rank == src) return "";
  return "; rank " + std::to_string(odd.rank) + " is the odd one out: it is in " + std::to_string(odd.pairs_of_rank) +
         " of the " + std::to_string(odd.disagreeing) + " (sender, receiver) pairs whose sizes disagree";
}

}  // namespace freescale

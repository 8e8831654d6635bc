// Key-centric micro-batch clustering's greedy pass (freescale_comm.microbatch states the method:
// a uniformly random split derandomized by conditional expectations). The Python layer prepares
// the inputs (each sample's distinct keys, the visiting order) with NumPy; this loop is the
// sequential part, O(sum over samples of distinct keys x micro-batches).
#pragma once

#include <cstdint>
#include <vector>

namespace freescale {

struct ClusterPlan {
  std::vector<int64_t> micro_batch;  // [samples]: the micro-batch of each sample
  std::vector<double> loads;         // [micro_batches]: summed sample costs
  int64_t distinct_ids = 0;          // (micro-batch, key) pairs held, summed over micro-batches
  bool cap_bound = false;            // the cost cap changed a choice
};

struct ClusterInput {
  int64_t samples = 0;
  int64_t num_keys = 0;
  const int64_t* key_offsets = nullptr;  // [samples + 1]: sample i's keys are keys[key_offsets[i]:key_offsets[i+1]]
  const int64_t* keys = nullptr;         // dense key indices in [0, num_keys), strictly ascending per sample
  const double* cost = nullptr;          // [samples], finite, >= 0
  const int64_t* visit = nullptr;        // [samples]: a permutation, the order samples are placed in
  int micro_batches = 1;
  double mean = 0.0;               // summed cost / micro_batches (the caller's sum, so caps match its)
  double balance_tolerance = 0.1;  // >= 0
};

// Places each sample, in `visit` order, in the micro-batch with the largest gain (the sum over
// its keys, in the order given, of q^(r - 1) where the micro-batch holds the key; q = 1 - 1/M,
// r = the samples not yet placed that hold it, this one included), among those whose load stays
// within the cap max(mean (1 + tolerance), mean + cost (1 - 1/M)); ties: least loaded, then
// lowest index; none within the cap: the least loaded. Then each micro-batch left empty takes a
// sample that moves without adding a distinct id (one whose keys no other sample of its micro-batch
// holds; from the micro-batch holding the most samples, the cheapest), where there is one: a
// micro-batch stays empty only with fewer samples than micro-batches, or where every sample shares
// an id with its micro-batch. Throws InvalidArgument naming the bad field
// first: offsets not starting at 0 or decreasing, a key out of range or not ascending within its
// sample, visit not a permutation, micro_batches < 1.
ClusterPlan cluster_greedy(const ClusterInput& in);

}  // namespace freescale

#include "cpp/microbatch_cluster.h"

#include <algorithm>
#include <string>

#include "cpp/errors.h"

namespace freescale {
namespace {

void check(const ClusterInput& in) {
  if (in.micro_batches < 1) throw InvalidArgument("micro_batches must be >= 1, got " + std::to_string(in.micro_batches));
  if (in.samples < 0 || in.num_keys < 0) throw InvalidArgument("samples and num_keys must be >= 0");
  if (in.key_offsets[0] != 0) throw InvalidArgument("key_offsets[0] must be 0");
  for (int64_t i = 0; i < in.samples; ++i) {
    if (in.key_offsets[i + 1] < in.key_offsets[i])
      throw InvalidArgument("key_offsets must not decrease (sample " + std::to_string(i) + ")");
  }
  const int64_t nnz = in.key_offsets[in.samples];
  for (int64_t j = 0; j < nnz; ++j) {
    if (in.keys[j] < 0 || in.keys[j] >= in.num_keys)
      throw InvalidArgument("keys[" + std::to_string(j) + "] = " + std::to_string(in.keys[j]) + " is outside [0, num_keys)");
  }
  for (int64_t k = 0; k < in.num_keys; ++k) {
    if (in.holders[k] < 0 || in.holders[k] > in.weights)
      throw InvalidArgument("holders[" + std::to_string(k) + "] = " + std::to_string(in.holders[k]) +
                            " is outside [0, weights]: pass a weight per holder count");
  }
  std::vector<char> seen(static_cast<size_t>(in.samples), 0);
  for (int64_t v = 0; v < in.samples; ++v) {
    const int64_t i = in.visit[v];
    if (i < 0 || i >= in.samples || seen[static_cast<size_t>(i)])
      throw InvalidArgument("visit must be a permutation of the samples (entry " + std::to_string(v) + ")");
    seen[static_cast<size_t>(i)] = 1;
  }
}

}  // namespace

ClusterPlan cluster_greedy(const ClusterInput& in) {
  check(in);
  const int m = in.micro_batches;
  const size_t mm = static_cast<size_t>(m);
  ClusterPlan plan;
  plan.micro_batch.assign(static_cast<size_t>(in.samples), 0);
  plan.loads.assign(mm, 0.0);
  std::vector<int64_t> holders(in.holders, in.holders + in.num_keys);
  std::vector<char> held(static_cast<size_t>(in.num_keys) * mm, 0);  // [key][micro-batch]
  std::vector<double> gain(mm);
  const double spread = 1.0 - 1.0 / m;
  // better(a, b): a ranks before b (gain descending, then load ascending, then index ascending)
  auto better = [&](int a, int b) {
    if (gain[a] != gain[b]) return gain[a] > gain[b];
    if (plan.loads[a] != plan.loads[b]) return plan.loads[a] < plan.loads[b];
    return a < b;
  };
  for (int64_t v = 0; v < in.samples; ++v) {
    const int64_t i = in.visit[v];
    const int64_t* first = in.keys + in.key_offsets[i];
    const int64_t* last = in.keys + in.key_offsets[i + 1];
    std::fill(gain.begin(), gain.end(), 0.0);
    for (const int64_t* k = first; k != last; ++k) {
      const double w = in.weight[holders[static_cast<size_t>(*k)] - 1];
      const char* row = held.data() + static_cast<size_t>(*k) * mm;
      for (int b = 0; b < m; ++b) {
        if (row[b]) gain[b] += w;
      }
    }
    const double c = in.cost[i];
    const double cap = std::max(in.mean * (1 + in.balance_tolerance), in.mean + c * spread);
    int best = 0, choice = -1;
    for (int b = 0; b < m; ++b) {
      if (better(b, best)) best = b;
      if (plan.loads[b] + c <= cap * (1 + 1e-12) && (choice < 0 || better(b, choice))) choice = b;
    }
    if (choice < 0) choice = static_cast<int>(std::min_element(plan.loads.begin(), plan.loads.end()) - plan.loads.begin());
    plan.cap_bound |= gain[choice] < gain[best];
    plan.micro_batch[static_cast<size_t>(i)] = choice;
    for (const int64_t* k = first; k != last; ++k) {
      char& h = held[static_cast<size_t>(*k) * mm + choice];
      plan.distinct_ids += h ? 0 : 1;
      h = 1;
      --holders[static_cast<size_t>(*k)];
    }
    plan.loads[choice] += c;
  }
  return plan;
}

}  // namespace freescale

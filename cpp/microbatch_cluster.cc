#include "cpp/microbatch_cluster.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cpp/errors.h"

namespace freescale {
namespace {

void check(const ClusterInput& in) {
  if (in.micro_batches < 1) throw InvalidArgument("micro_batches must be >= 1, got " + std::to_string(in.micro_batches));
  if (in.samples < 0 || in.num_keys < 0) throw InvalidArgument("samples and num_keys must be >= 0");
  if (in.key_offsets == nullptr || (in.samples > 0 && (in.cost == nullptr || in.visit == nullptr)))
    throw InvalidArgument("key_offsets, cost and visit must be given");
  if (in.key_offsets[0] != 0) throw InvalidArgument("key_offsets[0] must be 0");
  for (int64_t i = 0; i < in.samples; ++i) {
    const int64_t a = in.key_offsets[i], b = in.key_offsets[i + 1];
    if (b < a) throw InvalidArgument("key_offsets must not decrease (sample " + std::to_string(i) + ")");
    for (int64_t j = a; j < b; ++j) {
      if (in.keys[j] < 0 || in.keys[j] >= in.num_keys)
        throw InvalidArgument("keys[" + std::to_string(j) + "] = " + std::to_string(in.keys[j]) +
                              " is outside [0, num_keys)");
      if (j > a && in.keys[j] <= in.keys[j - 1])
        throw InvalidArgument("keys must be strictly ascending within a sample (keys[" + std::to_string(j) + "])");
    }
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
  const int64_t pairs = in.key_offsets[in.samples];
  // per key, the samples not yet placed that hold it (each sample holds a key at most once)
  std::vector<int64_t> holders(static_cast<size_t>(in.num_keys), 0);
  for (int64_t j = 0; j < pairs; ++j) ++holders[static_cast<size_t>(in.keys[j])];
  const int64_t most = holders.empty() ? 0 : *std::max_element(holders.begin(), holders.end());
  const double q = 1.0 - 1.0 / m;
  std::vector<double> weight(static_cast<size_t>(std::max<int64_t>(most, 1)));  // weight[r - 1] = q^(r - 1)
  for (size_t r = 0; r < weight.size(); ++r) weight[r] = std::pow(q, static_cast<double>(r));

  ClusterPlan plan;
  plan.micro_batch.assign(static_cast<size_t>(in.samples), 0);
  plan.loads.assign(mm, 0.0);
  std::vector<char> held(static_cast<size_t>(in.num_keys) * mm, 0);  // [key][micro-batch]
  std::vector<double> gain(mm);
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
      const double w = weight[static_cast<size_t>(holders[static_cast<size_t>(*k)] - 1)];  // holders >= 1 here
      const char* row = held.data() + static_cast<size_t>(*k) * mm;
      for (int b = 0; b < m; ++b) {
        if (row[b]) gain[b] += w;
      }
    }
    const double c = in.cost[i];
    const double cap = std::max(in.mean * (1 + in.balance_tolerance), in.mean + c * (1 - 1.0 / m));
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

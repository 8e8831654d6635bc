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

// Each empty micro-batch takes a sample of the micro-batch holding the most samples (two at least)
// that moves without adding a distinct id: one whose every key no other sample there holds (its ids
// leave with it), samples without ids included; the cheapest such, then the lowest index. A pass
// over nothing costs as much as one over a sample, and a model's mean loss over no samples is NaN.
// Runs only where a micro-batch came out empty; counts a source's keys when it is tried.
void fill_empty(const ClusterInput& in, ClusterPlan& plan) {
  const int m = in.micro_batches;
  std::vector<int64_t> count(static_cast<size_t>(m), 0);
  for (int64_t mb : plan.micro_batch) ++count[static_cast<size_t>(mb)];
  if (std::find(count.begin(), count.end(), 0) == count.end()) return;
  std::vector<int32_t> holding(static_cast<size_t>(in.num_keys), 0);  // [key]: samples of the source holding it
  for (int dst = 0; dst < m; ++dst) {
    if (count[static_cast<size_t>(dst)] > 0) continue;
    std::vector<int> sources;  // by samples held, most first (ties: lowest index)
    for (int b = 0; b < m; ++b) {
      if (count[static_cast<size_t>(b)] >= 2) sources.push_back(b);
    }
    std::stable_sort(sources.begin(), sources.end(), [&](int a, int b) { return count[a] > count[b]; });
    int64_t moved = -1;
    int source = -1;
    for (int src : sources) {
      std::fill(holding.begin(), holding.end(), 0);
      for (int64_t i = 0; i < in.samples; ++i) {
        if (plan.micro_batch[static_cast<size_t>(i)] != src) continue;
        for (int64_t j = in.key_offsets[i]; j < in.key_offsets[i + 1]; ++j) ++holding[static_cast<size_t>(in.keys[j])];
      }
      for (int64_t i = 0; i < in.samples; ++i) {
        if (plan.micro_batch[static_cast<size_t>(i)] != src) continue;
        bool alone = true;  // no other sample in src holds any of i's keys
        for (int64_t j = in.key_offsets[i]; alone && j < in.key_offsets[i + 1]; ++j)
          alone = holding[static_cast<size_t>(in.keys[j])] == 1;
        if (alone && (moved < 0 || in.cost[i] < in.cost[moved])) moved = i;
      }
      if (moved >= 0) {
        source = src;
        break;
      }
    }
    if (moved < 0) continue;  // stays empty: no sample moves without adding an id
    plan.micro_batch[static_cast<size_t>(moved)] = dst;  // distinct ids unchanged: its pairs left src, came to dst
    plan.loads[static_cast<size_t>(source)] -= in.cost[moved];
    plan.loads[static_cast<size_t>(dst)] += in.cost[moved];
    --count[static_cast<size_t>(source)];
    ++count[static_cast<size_t>(dst)];
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
  fill_empty(in, plan);
  return plan;
}

}  // namespace freescale

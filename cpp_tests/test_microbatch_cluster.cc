// Key-centric clustering's greedy pass: shared keys pull samples together, the cap balances them,
// bad inputs are refused naming the field.
#include <gtest/gtest.h>

#include <vector>

#include "cpp/errors.h"
#include "cpp/microbatch_cluster.h"

namespace freescale {
namespace {

struct Batch {
  std::vector<int64_t> offsets, keys, visit;
  int64_t num_keys;
  std::vector<double> cost;
  ClusterInput input(int micro_batches) const {
    ClusterInput in;
    in.samples = static_cast<int64_t>(cost.size());
    in.num_keys = num_keys;
    in.key_offsets = offsets.data();
    in.keys = keys.data();
    in.cost = cost.data();
    in.visit = visit.data();
    in.micro_batches = micro_batches;
    double sum = 0;
    for (double c : cost) sum += c;
    in.mean = sum / micro_batches;
    return in;
  }
};

// Samples 0 and 2 read key 0, samples 1 and 3 key 1; all cost 1, two micro-batches.
Batch two_pairs() {
  return Batch{{0, 1, 2, 3, 4}, {0, 1, 0, 1}, {0, 1, 2, 3}, 2, {1, 1, 1, 1}};
}

TEST(ClusterGreedy, SamplesSharingAKeyShareAMicroBatch) {
  const Batch b = two_pairs();
  const ClusterPlan plan = cluster_greedy(b.input(2));
  // 0 -> mb 0 (all equal: lowest index); 1 -> mb 1 (no gain: least loaded); 2 follows 0, 3 follows 1
  EXPECT_EQ(plan.micro_batch, (std::vector<int64_t>{0, 1, 0, 1}));
  EXPECT_EQ(plan.loads, (std::vector<double>{2, 2}));
  EXPECT_EQ(plan.distinct_ids, 2);
  EXPECT_FALSE(plan.cap_bound);
}

TEST(ClusterGreedy, TheCapKeepsLoadsBalancedAndSaysItBound) {
  // four samples all reading key 0: gain pulls every one to micro-batch 0; the cap, max(mean 2 x
  // 1.1, mean 2 + cost 1 x 1/2) = 2.5, stops the third (a load of 3)
  Batch b{{0, 1, 2, 3, 4}, {0, 0, 0, 0}, {0, 1, 2, 3}, 1, {1, 1, 1, 1}};
  const ClusterPlan plan = cluster_greedy(b.input(2));
  EXPECT_EQ(plan.micro_batch, (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(plan.distinct_ids, 2);
  EXPECT_TRUE(plan.cap_bound);
}

TEST(ClusterGreedy, AnEmptyMicroBatchTakesASampleThatAddsNoId) {
  // four samples without ids (cost 0): the greedy pass puts all in micro-batch 0 (no gain, no load);
  // each empty one then takes the lowest-index sample left there
  Batch none{{0, 0, 0, 0, 0}, {}, {0, 1, 2, 3}, 0, {0, 0, 0, 0}};
  EXPECT_EQ(cluster_greedy(none.input(4)).micro_batch, (std::vector<int64_t>{1, 2, 3, 0}));
  // sample 0 (key 0, dear) alone; samples 1-3 share key 1: none of them moves without adding an id
  Batch shared{{0, 1, 2, 3, 4}, {0, 1, 1, 1}, {0, 1, 2, 3}, 2, {100, 1, 1, 1}};
  const ClusterPlan plan = cluster_greedy(shared.input(4));
  EXPECT_EQ(plan.micro_batch, (std::vector<int64_t>{0, 1, 1, 1}));
  EXPECT_EQ(plan.distinct_ids, 2);
}

TEST(ClusterGreedy, RefusesInputsNamingTheField) {
  Batch b = two_pairs();
  b.visit = {0, 0, 2, 3};
  EXPECT_THROW(cluster_greedy(b.input(2)), InvalidArgument);
  b = two_pairs();
  b.keys[1] = 7;
  try {
    cluster_greedy(b.input(2));
    FAIL() << "a key out of range was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("keys[1] = 7"), std::string::npos) << e.what();
  }
  b = two_pairs();
  b.offsets = {0, 2, 2, 3, 4};  // sample 0 lists key 0 twice
  b.keys = {0, 0, 0, 1};
  EXPECT_THROW(cluster_greedy(b.input(2)), InvalidArgument);
  EXPECT_THROW(cluster_greedy(two_pairs().input(0)), InvalidArgument);
}

}  // namespace
}  // namespace freescale

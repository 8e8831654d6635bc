// Binds the greedy pass of key-centric micro-batch clustering (freescale_comm.microbatch prepares
// its inputs with NumPy and documents the method).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "cpp/bindings/bindings.h"
#include "cpp/bindings/without_gil.h"
#include "cpp/errors.h"
#include "cpp/microbatch_cluster.h"

namespace py = pybind11;

namespace freescale {
namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

// A copy of a 1-D array of `want` entries (taken under the GIL: the pass then checks and runs
// without it, on memory no other thread can change).
template <typename T>
std::vector<T> copy_of(const CArray<T>& a, int64_t want, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != want)
    throw InvalidArgument(std::string(name) + " must be 1-D with " + std::to_string(want) + " entries");
  return std::vector<T>(a.data(), a.data() + want);
}

}  // namespace

void register_microbatch(py::module_& m) {
  m.def(
      "cluster_greedy",
      [](const CArray<int64_t>& key_offsets, const CArray<int64_t>& keys, int64_t num_keys, const CArray<double>& cost,
         const CArray<int64_t>& visit, int micro_batches, double mean, double balance_tolerance) {
        if (cost.ndim() != 1) throw InvalidArgument("cost must be 1-D (one entry per sample)");
        const int64_t samples = cost.shape(0);
        const std::vector<int64_t> offsets = copy_of(key_offsets, samples + 1, "key_offsets");
        const std::vector<int64_t> key_list = copy_of(keys, offsets.back(), "keys");
        const std::vector<double> costs = copy_of(cost, samples, "cost");
        const std::vector<int64_t> order = copy_of(visit, samples, "visit");
        ClusterInput in;
        in.samples = samples;
        in.num_keys = num_keys;
        in.key_offsets = offsets.data();
        in.keys = key_list.data();
        in.cost = costs.data();
        in.visit = order.data();
        in.micro_batches = micro_batches;
        in.mean = mean;
        in.balance_tolerance = balance_tolerance;
        // the pipeline's worker plans while the caller computes (checks its input: ValueError once
        // the GIL is back)
        ClusterPlan plan = without_gil([&] { return cluster_greedy(in); });
        return py::make_tuple(py::array_t<int64_t>(plan.micro_batch.size(), plan.micro_batch.data()),
                              py::array_t<double>(plan.loads.size(), plan.loads.data()), plan.distinct_ids,
                              plan.cap_bound);
      },
      py::arg("key_offsets"), py::arg("keys"), py::arg("num_keys"), py::arg("cost"), py::arg("visit"),
      py::arg("micro_batches"), py::arg("mean"), py::arg("balance_tolerance"),
      "Key-centric clustering's greedy pass: (micro_batch [samples], loads [M], distinct ids, cap bound). "
      "See freescale_comm.microbatch.");
}

}  // namespace freescale

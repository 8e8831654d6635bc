// Binds the greedy pass of key-centric micro-batch clustering (freescale_comm.microbatch prepares
// its inputs with NumPy and documents the method).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "cpp/bindings/bindings.h"
#include "cpp/errors.h"
#include "cpp/microbatch_cluster.h"

namespace py = pybind11;

namespace freescale {
namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
const T* data_of(const CArray<T>& a, int64_t want, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != want)
    throw InvalidArgument(std::string(name) + " must be 1-D with " + std::to_string(want) + " entries");
  return a.data();
}

}  // namespace

void register_microbatch(py::module_& m) {
  m.def(
      "cluster_greedy",
      [](const CArray<int64_t>& key_offsets, const CArray<int64_t>& keys, const CArray<int64_t>& holders,
         const CArray<double>& cost, const CArray<int64_t>& visit, const CArray<double>& weight, int micro_batches,
         double mean, double balance_tolerance) {
        ClusterInput in;
        in.samples = cost.ndim() == 1 ? cost.shape(0) : -1;
        if (in.samples < 0) throw InvalidArgument("cost must be 1-D (one entry per sample)");
        in.key_offsets = data_of(key_offsets, in.samples + 1, "key_offsets");
        in.keys = data_of(keys, in.key_offsets[in.samples], "keys");
        in.num_keys = holders.ndim() == 1 ? holders.shape(0) : 0;
        in.holders = data_of(holders, in.num_keys, "holders");
        in.cost = cost.data();
        in.visit = data_of(visit, in.samples, "visit");
        in.weights = weight.ndim() == 1 ? weight.shape(0) : 0;
        in.weight = data_of(weight, in.weights, "weight");
        in.micro_batches = micro_batches;
        in.mean = mean;
        in.balance_tolerance = balance_tolerance;
        ClusterPlan plan;
        {
          py::gil_scoped_release release;  // the pipeline's worker plans while the caller computes
          plan = cluster_greedy(in);
        }
        return py::make_tuple(py::array_t<int64_t>(plan.micro_batch.size(), plan.micro_batch.data()),
                              py::array_t<double>(plan.loads.size(), plan.loads.data()), plan.distinct_ids,
                              plan.cap_bound);
      },
      py::arg("key_offsets"), py::arg("keys"), py::arg("holders"), py::arg("cost"), py::arg("visit"),
      py::arg("weight"), py::arg("micro_batches"), py::arg("mean"), py::arg("balance_tolerance"),
      "Key-centric clustering's greedy pass: (micro_batch [samples], loads [M], distinct ids, cap bound). "
      "See freescale_comm.microbatch.");
}

}  // namespace freescale

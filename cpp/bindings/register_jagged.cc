// Binds the CPU layout work of dispatch/combine: JaggedPlan and the sample gather/scatter.
// Pointers cross as integers; the copies run with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>

#include "cpp/bindings/bindings.h"
#include "cpp/jagged_layout.h"

namespace py = pybind11;

namespace freescale {
namespace {

py::array_t<int64_t> as_array(const std::vector<int64_t>& v) { return py::array_t<int64_t>(v.size(), v.data()); }

}  // namespace

void register_jagged(py::module_& m) {
  py::class_<JaggedPlan, std::shared_ptr<JaggedPlan>>(m, "JaggedPlan", "Samples in destination order, and back.")
      .def_readonly("world", &JaggedPlan::world)
      .def_readonly("rows", &JaggedPlan::rows)
      .def_property_readonly("samples", [](const JaggedPlan& p) { return p.order.size(); })
      .def_property_readonly("order", [](const JaggedPlan& p) { return as_array(p.order); })
      .def_property_readonly("sent_lengths", [](const JaggedPlan& p) { return as_array(p.sent_lengths); })
      .def_property_readonly("sample_counts", [](const JaggedPlan& p) { return as_array(p.sample_counts); })
      .def_property_readonly("row_counts", [](const JaggedPlan& p) { return as_array(p.row_counts); });

  m.def(
      "plan_jagged_dispatch",
      [](uintptr_t lengths_ptr, uintptr_t dest_ptr, int64_t samples, int world) {
        py::gil_scoped_release release;
        return std::make_shared<JaggedPlan>(plan_jagged_dispatch(reinterpret_cast<const int64_t*>(lengths_ptr),
                                                                 reinterpret_cast<const int64_t*>(dest_ptr), samples, world));
      },
      py::arg("lengths_ptr"), py::arg("dest_ptr"), py::arg("samples"), py::arg("world"),
      "Plans sending sample i to rank dest[i] (int64 arrays of `samples` entries). ValueError names a bad entry.");
  m.def(
      "gather_jagged",
      [](const JaggedPlan& plan, uintptr_t src, uintptr_t dst, uint64_t row_bytes) {
        gather_jagged(plan, reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst), row_bytes);
      },
      py::arg("plan"), py::arg("src_ptr"), py::arg("dst_ptr"), py::arg("row_bytes"), py::call_guard<py::gil_scoped_release>(),
      "Copies samples from original order (src) to send order (dst).");
  m.def(
      "scatter_jagged",
      [](const JaggedPlan& plan, uintptr_t src, uintptr_t dst, uint64_t row_bytes) {
        scatter_jagged(plan, reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst), row_bytes);
      },
      py::arg("plan"), py::arg("src_ptr"), py::arg("dst_ptr"), py::arg("row_bytes"), py::call_guard<py::gil_scoped_release>(),
      "Copies samples from send order (src) back to original order (dst).");
}

}  // namespace freescale

// Binds the layout work of dispatch/combine: on CPU, JaggedPlan and the scatter/gather layouts
// that move samples with no staging copy; in CUDA builds, the layout kernels. Pointers and
// streams cross as integers.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "cpp/bindings/bindings.h"
#include "cpp/bindings/without_gil.h"
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
        return without_gil([&] {
          return std::make_shared<JaggedPlan>(plan_jagged_dispatch(reinterpret_cast<const int64_t*>(lengths_ptr),
                                                                   reinterpret_cast<const int64_t*>(dest_ptr), samples, world));
        });
      },
      py::arg("lengths_ptr"), py::arg("dest_ptr"), py::arg("samples"), py::arg("world"),
      "Plans sending sample i to rank dest[i] (int64 arrays of `samples` entries). ValueError names a bad entry.");
  m.def("dispatch_layout", &dispatch_layout, py::arg("plan"), py::arg("row_bytes"), py::arg("recv_rows"),
        "AllToAllLayout sending the plan's samples straight from their home rows, received packed by source.");
  m.def("combine_layout", &combine_layout, py::arg("plan"), py::arg("row_bytes"), py::arg("recv_rows"),
        "AllToAllLayout sending received rows back packed, landing straight in their home rows.");
}

}  // namespace freescale

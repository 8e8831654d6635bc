// _core._emulated: the emulated device (testing/emulated_device.h) and a ce-transport communicator
// on it, for Python tests of the bindings' CUDA paths (GIL handling around a full stream queue)
// on machines without a GPU. Test equipment: compiled into _core only by FREESCALE_TEST_SUPPORT=ON
// builds (scripts/setup.sh), never into a wheel users install.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "cpp/bindings/bindings.h"
#include "cpp/bootstrap.h"
#include "cpp/communicator.h"
#include "cpp/config.h"
#include "cuda/ce_transport.h"
#include "testing/emulated_device.h"

namespace py = pybind11;

namespace freescale {

void register_test_support(py::module_& m) {
  py::module_ e = m.def_submodule("_emulated", "Tests only: the emulated device and a ce communicator on it.");
  py::class_<EmulatedDevice, std::shared_ptr<EmulatedDevice>>(e, "EmulatedDevice")
      .def(py::init([](size_t queue_depth, bool creation_blocks_while_waiting) {
             EmulatedDeviceOptions options;
             options.queue_depth = queue_depth;
             options.hardware_queues = 0;  // a queue per stream: only the stream's own depth blocks
             options.creation_blocks_while_waiting = creation_blocks_while_waiting;
             return std::make_shared<EmulatedDevice>(options);
           }),
           py::arg("queue_depth") = 64, py::arg("creation_blocks_while_waiting") = true)
      .def("create_stream", &EmulatedDevice::create_stream)
      .def("queued", &EmulatedDevice::queued, py::arg("stream"), "Operations pending on `stream`, not the running one.")
      .def(
          "wait_geq",
          [](EmulatedDevice& d, Stream stream, uintptr_t host_word, uint64_t value) {
            d.wait_value64(stream, static_cast<DevicePtr>(host_word), value, WaitCmp::kGeq);
          },
          py::arg("stream"), py::arg("host_word"), py::arg("value"),
          "`stream` waits until the int64 at address `host_word` (host memory: the emulated device "
          "reads it directly) is >= value. Blocks while the stream's queue is full.",
          py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &EmulatedDevice::synchronize, py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  e.def(
      "ce_communicator",
      [](Bootstrap& bootstrap, Config config, std::shared_ptr<EmulatedDevice> device) {
        config.cuda_device = 0;
        EmulatedDevice& ops = *device;
        py::gil_scoped_release release;  // collective setup over a Python bootstrap takes the GIL itself
        return owned_by_python(new Communicator(bootstrap, config,
                                                [&ops](Bootstrap& b, const Config& c) { return make_ce_transport(b, c, ops); }),
                               device);
      },
      py::arg("bootstrap"), py::arg("config"), py::arg("device"),
      "A Communicator whose transport is the ce transport on `device` (its buffers: host memory).");
}

}  // namespace freescale

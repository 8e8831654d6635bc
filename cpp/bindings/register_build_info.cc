#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpp/bindings/bindings.h"
#include "cpp/bindings/without_gil.h"
#include "cpp/build_info.h"
#include "cpp/device_transports.h"

namespace py = pybind11;

namespace freescale {

void register_build_info(py::module_& m) {
  m.def("build_info", [] {
    BuildInfo info = build_info();
    py::dict d;
    d["version"] = info.version;
    d["cuda"] = info.cuda;
    d["nvshmem"] = info.nvshmem;
    d["nvshmem_detail"] = info.nvshmem_detail;
    d["cuda_archs"] = info.cuda_archs;
    d["transports"] = info.transports;
    return d;
  });
#ifdef FREESCALE_WITH_NVSHMEM
  m.def("nvshmem_library", [] { return without_gil(nvshmem_library_path); },
        "Loads NVSHMEM's host library (no GPU needed) and returns its path; UnsupportedError says why not.");
#endif
  m.def("cuda_device_count", [] { return without_gil(cuda_device_count); },
        "CUDA devices visible to this process (0 without CUDA support, driver or GPU).");
}

}  // namespace freescale

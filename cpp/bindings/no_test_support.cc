// Builds without FREESCALE_TEST_SUPPORT (every wheel users install): no test equipment in _core.
#include "cpp/bindings/bindings.h"

namespace freescale {

void register_test_support(pybind11::module_& /*m*/) {}

}  // namespace freescale

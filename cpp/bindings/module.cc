#include "cpp/bindings/bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "freescale_comm compiled core (use the freescale_comm package, not this module)";
  freescale::register_errors(m);
  freescale::register_build_info(m);
  freescale::register_communicator(m);
  freescale::register_jagged(m);
  freescale::register_microbatch(m);
  freescale::register_test_support(m);
}

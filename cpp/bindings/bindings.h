// One register_<area>() per area; module.cc only calls them.
#pragma once

#include <pybind11/pybind11.h>

namespace freescale {

void register_errors(pybind11::module_& m);
void register_build_info(pybind11::module_& m);
void register_communicator(pybind11::module_& m);
void register_jagged(pybind11::module_& m);

}  // namespace freescale

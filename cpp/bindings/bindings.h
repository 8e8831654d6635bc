// One register_<area>() per area; module.cc only calls them.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace freescale {

class Communicator;

// A communicator for Python: destroyed without the GIL and never on its own progress thread;
// `keep` (what its transport uses, e.g. an emulated device) is released after it.
std::shared_ptr<Communicator> owned_by_python(Communicator* comm, std::shared_ptr<void> keep = nullptr);

void register_errors(pybind11::module_& m);
void register_build_info(pybind11::module_& m);
void register_communicator(pybind11::module_& m);
void register_jagged(pybind11::module_& m);
void register_microbatch(pybind11::module_& m);
// Test equipment (FREESCALE_TEST_SUPPORT builds: testing/register_emulated.cc adds
// _core._emulated); a no-op in every other build (no_test_support.cc).
void register_test_support(pybind11::module_& m);

}  // namespace freescale

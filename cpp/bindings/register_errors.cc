// Maps the C++ error hierarchy to Python: InvalidArgument -> ValueError; collective failures ->
// CommError(RuntimeError); misuse / unsupported / internal -> their own RuntimeError subclasses.
// Every raised exception carries `.code`, the ErrorCode name (e.g. "PEER_DIED"), and `.culprit`,
// the rank at the root of a collective failure (the one that died or disagreed), or None.
#include <pybind11/pybind11.h>

#include "cpp/bindings/bindings.h"
#include "cpp/errors.h"

namespace py = pybind11;

namespace freescale {
namespace {

// Classes live as long as the interpreter (never decref'd: translators may run at exit).
PyObject* g_comm_error = nullptr;
PyObject* g_invalid_usage = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_internal = nullptr;

PyObject* python_class_for(ErrorCode code) {
  if (code == ErrorCode::kInvalidArgument) return PyExc_ValueError;
  if (code == ErrorCode::kInvalidUsage) return g_invalid_usage;
  if (code == ErrorCode::kUnsupported) return g_unsupported;
  if (is_comm_code(code)) return g_comm_error;
  return g_internal;
}

void raise_with_code(PyObject* cls, const char* message, const char* code, int culprit) {
  py::object instance = py::reinterpret_borrow<py::object>(cls)(message);
  instance.attr("code") = code;
  instance.attr("culprit") = culprit >= 0 ? py::object(py::int_(culprit)) : py::none();
  PyErr_SetObject(cls, instance.ptr());
}

}  // namespace

void register_errors(py::module_& m) {
  g_comm_error = PyErr_NewExceptionWithDoc(
      "freescale_comm._core.CommError",
      "A collective failed: a peer died or aborted, ranks disagreed on sizes, or it timed out. "
      "Raised on every surviving rank. `.code` names the cause.",
      PyExc_RuntimeError, nullptr);
  g_invalid_usage = PyErr_NewExceptionWithDoc("freescale_comm._core.InvalidUsageError",
                                              "An API call in the wrong state (e.g. on a closed communicator).",
                                              PyExc_RuntimeError, nullptr);
  g_unsupported = PyErr_NewExceptionWithDoc("freescale_comm._core.UnsupportedError",
                                            "The requested transport cannot serve this group or these tensors.",
                                            PyExc_RuntimeError, nullptr);
  g_internal = PyErr_NewExceptionWithDoc("freescale_comm._core.InternalError",
                                         "A broken invariant inside freescale_comm: please report it.",
                                         PyExc_RuntimeError, nullptr);
  m.attr("CommError") = py::handle(g_comm_error);
  m.attr("InvalidUsageError") = py::handle(g_invalid_usage);
  m.attr("UnsupportedError") = py::handle(g_unsupported);
  m.attr("InternalError") = py::handle(g_internal);
  Py_INCREF(g_comm_error);
  Py_INCREF(g_invalid_usage);
  Py_INCREF(g_unsupported);
  Py_INCREF(g_internal);

  py::enum_<ErrorCode>(m, "ErrorCode")
      .value("INVALID_ARGUMENT", ErrorCode::kInvalidArgument)
      .value("INVALID_USAGE", ErrorCode::kInvalidUsage)
      .value("COMM_ERROR", ErrorCode::kCommError)
      .value("TIMEOUT", ErrorCode::kTimeout)
      .value("PEER_DIED", ErrorCode::kPeerDied)
      .value("PEER_ABORTED", ErrorCode::kPeerAborted)
      .value("SIZE_MISMATCH", ErrorCode::kSizeMismatch)
      .value("SYSTEM", ErrorCode::kSystem)
      .value("UNSUPPORTED", ErrorCode::kUnsupported)
      .value("INTERNAL", ErrorCode::kInternal);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_with_code(python_class_for(e.code()), e.what(), error_code_name(e.code()), e.culprit());
    }
  });

  // Raises the C++ exception for `code`: lets tests check the mapping end to end.
  m.def(
      "_raise_for_test",
      [](ErrorCode code, const std::string& message, int culprit) {
        if (code == ErrorCode::kInvalidArgument) throw InvalidArgument(message);
        if (is_comm_code(code)) throw CommError(code, message, culprit);
        throw Error(code, message, culprit);
      },
      py::arg("code"), py::arg("message"), py::arg("culprit") = -1);
}

}  // namespace freescale

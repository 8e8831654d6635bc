#pragma once
// Running C++ without the GIL, retaking it in plain code rather than in a destructor.
//
// A daemon thread that retakes the GIL while the interpreter finalizes is ended by CPython with
// pthread_exit, which unwinds the thread's stack. Unwinding out of a destructor (noexcept) ends
// the process: "terminate called without an active exception" (py::gil_scoped_release retakes
// the GIL in its destructor: pybind11#2215, pytorch#38228). Retaken in a plain frame, the unwind
// passes through pybind11's dispatcher (it rethrows abi::__forced_unwind) and only the thread ends.

#include <Python.h>

#include <optional>
#include <type_traits>
#include <utility>

namespace freescale {

// fn() with the GIL released; the caller holds the GIL. Returns fn's result; rethrows its errors
// with the GIL held again.
template <class Fn>
decltype(auto) without_gil(Fn&& fn) {
  using Result = std::invoke_result_t<Fn&>;
  PyThreadState* saved = PyEval_SaveThread();
  if constexpr (std::is_void_v<Result>) {
    try {
      fn();
    } catch (...) {
      PyEval_RestoreThread(saved);
      throw;
    }
    PyEval_RestoreThread(saved);  // outside the try: a thread ended here unwinds past no handler
  } else {
    std::optional<Result> out;
    try {
      out.emplace(fn());
    } catch (...) {
      PyEval_RestoreThread(saved);
      throw;
    }
    PyEval_RestoreThread(saved);
    return Result(std::move(*out));
  }
}

}  // namespace freescale

// Binds Config, AllToAllLayout, Bootstrap (subclassed in Python), Work (an op's state) and
// Communicator. Pointers cross as integers only here, never in the Python API.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <thread>

#include "cpp/bindings/bindings.h"
#include "cpp/bindings/without_gil.h"
#include "cpp/bootstrap.h"
#include "cpp/communicator.h"
#include "cpp/config.h"
#include "cpp/layout.h"
#include "cpp/op_state.h"
#include "cpp/timeouts.h"

namespace py = pybind11;

namespace freescale {

std::shared_ptr<Communicator> owned_by_python(Communicator* comm, std::shared_ptr<void> keep) {
  // Destroying a communicator joins its progress thread, which may need the GIL for a
  // done-callback: never join while holding it. `keep` goes after the communicator.
  return std::shared_ptr<Communicator>(comm, [keep = std::move(keep)](Communicator* c) mutable {
    if (c->on_progress_thread()) {
      // The last reference went away in a done-callback on the progress thread, which the
      // destructor joins: destroy it from another thread instead.
      std::thread([c, keep = std::move(keep)] { delete c; }).detach();
      return;
    }
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      delete c;
    } else {
      delete c;
    }
  });
}
namespace {

// Python subclasses implement rank(), size() and allgather(bytes) -> list[bytes].
class PyBootstrap : public Bootstrap {
 public:
  int rank() const override { PYBIND11_OVERRIDE_PURE(int, Bootstrap, rank, ); }
  int size() const override { PYBIND11_OVERRIDE_PURE(int, Bootstrap, size, ); }
  std::vector<std::string> allgather(const std::string& mine) override {
    py::gil_scoped_acquire gil;
    py::function fn = py::get_override(static_cast<const Bootstrap*>(this), "allgather");
    if (!fn) throw Error(ErrorCode::kInternal, "Bootstrap subclass must implement allgather(bytes) -> list[bytes]");
    py::object result = fn(py::bytes(mine));
    std::vector<std::string> out;
    for (py::handle item : result) out.push_back(item.cast<std::string>());
    if (out.size() != static_cast<size_t>(size())) {
      throw Error(ErrorCode::kInternal, "Bootstrap.allgather returned " + std::to_string(out.size()) +
                                            " blobs for a world of " + std::to_string(size()));
    }
    return out;
  }
  void barrier() override {
    py::gil_scoped_acquire gil;
    py::function fn = py::get_override(static_cast<const Bootstrap*>(this), "barrier");
    if (fn) {
      fn();
    } else {
      Bootstrap::barrier();
    }
  }
};

std::chrono::microseconds to_timeout(std::optional<double> seconds) {
  if (!seconds) return std::chrono::microseconds(-1);
  if (!std::isfinite(*seconds) || *seconds < 0) throw InvalidArgument("timeout must be a non-negative number of seconds");
  return timeout_from_seconds(*seconds);
}

// Blocks until `wait_for(slice)` returns true or `timeout` (-1: none) passed, in slices with the
// GIL released: between slices, a Python signal handler that raised (Ctrl-C: KeyboardInterrupt)
// ends the wait within kSignalSlice. The op itself goes on.
template <class WaitFor>
bool wait_honouring_signals(std::chrono::microseconds timeout, WaitFor&& wait_for) {
  constexpr std::chrono::microseconds kSignalSlice{200000};
  using Clock = std::chrono::steady_clock;
  const bool bounded = timeout.count() >= 0;
  const auto until = Clock::now() + (bounded ? timeout : std::chrono::microseconds(0));
  while (true) {
    auto slice = kSignalSlice;
    if (bounded) {
      slice = std::min(slice, std::max(std::chrono::microseconds(0),
                                       std::chrono::duration_cast<std::chrono::microseconds>(until - Clock::now())));
    }
    if (without_gil([&] { return wait_for(slice); })) return true;
    if (bounded && Clock::now() >= until) return false;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

}  // namespace

void register_communicator(py::module_& m) {
  py::class_<Config>(m, "Config")
      .def(py::init<>())
      .def_static("from_env", &Config::from_env, "Reads every FREESCALE_* variable (ValueError names a bad one).")
      .def_readwrite("chunk_bytes", &Config::chunk_bytes)
      .def_readwrite("arena_bytes", &Config::arena_bytes)
      .def_readwrite("timeout_ms", &Config::timeout_ms)
      .def_readwrite("aging_us", &Config::aging_us)
      .def_readwrite("transport", &Config::transport)
      .def_readwrite("cuda_device", &Config::cuda_device)
      .def("validate", &Config::validate);

  py::class_<AllToAllLayout>(m, "AllToAllLayout")
      .def_static("packed", &AllToAllLayout::packed, py::arg("send_bytes"), py::arg("recv_bytes"),
                  "Blocks back to back in rank order (dist.all_to_all_single's layout), in bytes.")
      .def_readonly("send_bytes", &AllToAllLayout::send_bytes)
      .def_readonly("send_offsets", &AllToAllLayout::send_offsets)
      .def_readonly("recv_bytes", &AllToAllLayout::recv_bytes)
      .def_readonly("recv_offsets", &AllToAllLayout::recv_offsets);

  py::class_<Bootstrap, PyBootstrap, std::shared_ptr<Bootstrap>>(m, "Bootstrap")
      .def(py::init<>())
      .def("rank", &Bootstrap::rank)
      .def("size", &Bootstrap::size)
      .def("allgather", &Bootstrap::allgather)
      .def("barrier", &Bootstrap::barrier);

  py::class_<OpState, std::shared_ptr<OpState>>(m, "Work", "The state of one submitted collective.")
      .def_readonly("seq", &OpState::seq)
      .def_readonly("priority", &OpState::priority)
      .def(
          "wait",
          [](OpState& op, std::optional<double> timeout_s) {
            return wait_honouring_signals(to_timeout(timeout_s), [&op](std::chrono::microseconds s) { return op.wait(s); });
          },
          py::arg("timeout_s") = py::none(),
          "Blocks (GIL released; Ctrl-C honoured) until done; False if timeout_s passed first; raises CommError if "
          "it failed.")
      .def("is_completed", &OpState::is_completed)
      .def("failed", &OpState::failed)
      .def("rethrow_if_failed", &OpState::rethrow_if_failed)
      .def(
          "add_done_callback",
          [](OpState& op, py::function fn) {
            // Owned on the heap and released under the GIL: the callback may run on the
            // progress thread, which holds no GIL of its own.
            auto* held = new py::object(std::move(fn));
            op.add_done_callback([held]() {
              py::gil_scoped_acquire gil;
              py::object f = std::move(*held);
              delete held;
              try {
                f();
              } catch (py::error_already_set& e) {
                e.discard_as_unraisable("freescale_comm Work done-callback");
              }
            });
          },
          py::arg("fn"),
          "Calls fn() once the op is done or failed: now, or on the thread that completes it (the "
          "progress thread or one blocked in Communicator.wait).");

  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init([](Bootstrap& bootstrap, const Config& config) {
             return owned_by_python(new Communicator(bootstrap, config));
           }),
           py::arg("bootstrap"), py::arg("config"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("transport", &Communicator::transport_name)
      .def_property_readonly("data_path", &Communicator::data_path)
      .def_property_readonly("device_work_abandoned", &Communicator::device_work_abandoned,
                             "True once a failure or close() gave up on device copies of this communicator that "
                             "could not be cancelled: buffers of ops failed since must never be freed")
      .def_property_readonly("config", &Communicator::config)
      .def(
          "register_buffer",
          [](Communicator& c, uintptr_t ptr, uint64_t bytes) { return c.register_buffer(reinterpret_cast<void*>(ptr), bytes); },
          py::arg("ptr"), py::arg("bytes"),
          "Lets peers write this rank's receive blocks in [ptr, ptr + bytes) (device memory) directly. Local; "
          "returns the registration's index.")
      .def(
          "all_to_all",
          [](Communicator& c, uintptr_t send_ptr, uintptr_t recv_ptr, AllToAllLayout layout, int priority,
             bool caller_waits, uintptr_t stream, const std::string& kind) {
            const OpKind op_kind = op_kind_from_name(kind);  // refused before anything is queued
            // Without the GIL: marking a CUDA stream blocks while its queue is full, and what
            // drains it may need the progress thread, which takes the GIL for done-callbacks.
            return without_gil([&] {
              return c.all_to_all(reinterpret_cast<const uint8_t*>(send_ptr), reinterpret_cast<uint8_t*>(recv_ptr),
                                  std::move(layout), priority, caller_waits, stream, op_kind);
            });
          },
          py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("layout"), py::arg("priority"),
          py::arg("caller_waits") = false, py::arg("stream") = 0, py::arg("kind") = "all_to_all_single",
          "Queues an AllToAllv of bytes; the buffers must outlive the returned Work. caller_waits: "
          "the caller calls wait() next, which drives it (the progress thread is not woken). stream: "
          "CUDA buffers' stream (cudaStream_t as int): the transfer starts after its current work. kind: "
          "what the caller runs (all_to_all_single, all_to_all, barrier, dispatch, combine); a peer that "
          "runs a barrier against any other kind fails the op on both, naming both.")
      .def(
          "stream_wait",
          [](Communicator& c, const std::shared_ptr<OpState>& op, uintptr_t stream, std::optional<double> timeout_s) {
            return wait_honouring_signals(to_timeout(timeout_s), [&](std::chrono::microseconds s) {
              return c.stream_wait(op, stream, s);
            });
          },
          py::arg("work"), py::arg("stream"), py::arg("timeout_s") = py::none(),
          "Makes CUDA `stream` wait for the op's device work (ce / nvshmem transports) on an event CUDA sees "
          "ordered after it: blocks the CPU (GIL released; Ctrl-C honoured) until that work is enqueued, not until "
          "it lands; False if timeout_s passed first.")
      .def(
          "wait",
          [](Communicator& c, const std::shared_ptr<OpState>& op, std::optional<double> timeout_s) {
            return wait_honouring_signals(to_timeout(timeout_s),
                                          [&c, &op](std::chrono::microseconds s) { return c.wait(op, s); });
          },
          py::arg("work"), py::arg("timeout_s") = py::none(),
          "Like Work.wait, but drives progress on the calling thread (GIL released; Ctrl-C honoured) while it waits.")
      .def(
          "raise_peer_failure",
          [](const Communicator& c, const std::vector<int>& needed) { without_gil([&] { c.raise_peer_failure(needed); }); },
          py::arg("needed"),
           "If a rank in `needed` died or closed its communicator, raises the CommError naming it; else returns. For "
           "collectives run outside the communicator (delegated to gloo); its own failures and peers' notices are not "
           "read. Takes no lock; never blocks on peers.")
      .def("note_delegated_call", &Communicator::note_delegated_call, py::arg("text"),
           "Publishes this rank's next delegated collective as `text` (what must agree across ranks) and returns its "
           "index n among this rank's delegated calls. Takes no lock.")
      .def("delegated_calls", &Communicator::delegated_calls, py::arg("n"),
           "Every rank's text of its delegated call n (one per rank; '' where not seen: not made yet, rewritten "
           "since, or a transport that shares nothing).")
      .def(
          "fail_from_outside",
          [](Communicator& c, const std::string& code, const std::string& message, std::optional<int> culprit) {
            ErrorCode parsed = ErrorCode::kCommError;
            bool known = false;
            for (int k = static_cast<int>(ErrorCode::kInvalidArgument); k <= static_cast<int>(ErrorCode::kInternal); ++k) {
              if (code == error_code_name(static_cast<ErrorCode>(k))) {
                parsed = static_cast<ErrorCode>(k);
                known = true;
              }
            }
            if (!known) throw InvalidArgument("code must be an error code name such as PEER_DIED, got '" + code + "'");
            without_gil([&] { c.fail_from_outside(parsed, message, culprit.value_or(-1)); });
          },
          py::arg("code"), py::arg("message"), py::arg("culprit") = py::none(),
          "A delegated collective among these ranks failed for `code` (an error code name), caused by rank "
          "`culprit`: this communicator fails too, and its abort notice names the cause to peers. No-op once "
          "closed or broken.")
      .def("close", [](Communicator& c) { without_gil([&] { c.close(); }); })
      .def(
          "abandon_after_fork",
          [](const std::shared_ptr<Communicator>& self) {
            // In a forked child: the parent's progress thread does not exist here and its locks
            // may be held, so this copy must never close, join or destruct. Kept alive for good.
            new std::shared_ptr<Communicator>(self);
          },
          "Forked child only: this copy of the parent's communicator is never closed or destroyed.")
      .def_property_readonly("closed", &Communicator::closed);
}

}  // namespace freescale

// Maps moecomm::Error kinds onto Python exceptions. Each moecomm exception also derives from the
// builtin a caller would naturally catch (TimeoutError, ConnectionError, FileNotFoundError).
// docs/errors.md lists every moecomm error.
#include <pybind11/pybind11.h>

#include "common/error.h"
#include "registry.h"

namespace py = pybind11;

namespace moecomm::bindings {
namespace {

py::object make_exception(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  py::dict ns;
  ns["__doc__"] = doc;
  ns["__module__"] = "moecomm";
  py::object cls = py::module_::import("builtins").attr("type")(name, bases, ns);
  m.attr(name) = cls;
  return cls;
}

}  // namespace

void register_errors(py::module_& m) {
  py::object builtins = py::module_::import("builtins");
  static py::handle base =
      make_exception(m, "MoecommError", py::make_tuple(builtins.attr("RuntimeError")),
                     "Base class of moecomm errors.")
          .release();
  // Not named TimeoutError: that would shadow the builtin in every module importing it.
  static py::handle timeout = make_exception(m, "DeadlineExceededError",
                                             py::make_tuple(base, builtins.attr("TimeoutError")),
                                             "A wait passed its deadline.")
                                  .release();
  static py::handle peer_lost =
      make_exception(m, "PeerLostError", py::make_tuple(base, builtins.attr("ConnectionError")),
                     "The process on the other side of a connection is gone.")
          .release();
  static py::handle not_found =
      make_exception(m, "SegmentNotFoundError",
                     py::make_tuple(base, builtins.attr("FileNotFoundError")),
                     "A named shared-memory segment does not exist.")
          .release();
  static py::handle protocol =
      make_exception(m, "ProtocolError", py::make_tuple(base), "A peer broke the slot protocol.")
          .release();
  static py::handle system =
      make_exception(m, "SystemCallError", py::make_tuple(base, builtins.attr("OSError")),
                     "An operating-system call failed.")
          .release();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = base.ptr();
      switch (e.kind()) {
        case ErrorKind::kInvalidArgument:
          type = PyExc_ValueError;
          break;
        case ErrorKind::kTimeout:
          type = timeout.ptr();
          break;
        case ErrorKind::kPeerLost:
          type = peer_lost.ptr();
          break;
        case ErrorKind::kNotFound:
          type = not_found.ptr();
          break;
        case ErrorKind::kSystem:
          type = system.ptr();
          break;
        case ErrorKind::kProtocol:
          type = protocol.ptr();
          break;
        case ErrorKind::kInternal:
          type = base.ptr();
          break;
      }
      PyErr_SetString(type, e.what());
    }
  });
}

}  // namespace moecomm::bindings

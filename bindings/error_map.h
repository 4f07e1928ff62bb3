// moecomm::Error → the Python exception of its kind, for the extension modules that are not
// moecomm._C (_cuda, _nvshmem). Each module links its own copy of the C++ error type, so _C's
// translator cannot catch their throws; they register this one, module-local, which raises the
// very classes _C defines (DeadlineExceededError, SystemCallError, ...), so callers catch one set
// of exceptions whichever module raised.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

#include "common/error.h"

namespace moecomm::bindings {

inline const char* python_error_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kTimeout:
      return "DeadlineExceededError";
    case ErrorKind::kPeerLost:
      return "PeerLostError";
    case ErrorKind::kNotFound:
      return "SegmentNotFoundError";
    case ErrorKind::kSystem:
      return "SystemCallError";
    case ErrorKind::kProtocol:
      return "ProtocolError";
    case ErrorKind::kInvalidArgument:
    case ErrorKind::kInternal:
      break;
  }
  return "MoecommError";
}

inline void register_local_error_translator() {
  pybind11::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kInvalidArgument) {
        PyErr_SetString(PyExc_ValueError, e.what());
        return;
      }
      pybind11::object cls =
          pybind11::module_::import("moecomm._C").attr(python_error_name(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
}

}  // namespace moecomm::bindings

// The one error header of moecomm. Host code throws; library code never exits or aborts.
// Every check carries file:line so that a failure reaching Python says where it came from.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moecomm {

// Categories map 1:1 onto Python exceptions in the bindings.
enum class ErrorKind {
  kInvalidArgument,  // caller passed something wrong (ValueError)
  kTimeout,          // a wait passed its deadline (TimeoutError)
  kPeerLost,         // the process on the other side is gone (ConnectionError)
  kNotFound,         // a named resource does not exist (FileNotFoundError)
  kSystem,           // an OS call failed (OSError)
  kProtocol,         // a peer wrote something that breaks the slot protocol
  kInternal,         // a broken invariant of ours
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {

[[noreturn]] inline void throw_error(ErrorKind kind, const char* file, int line,
                                     const std::string& msg) {
  std::ostringstream os;
  os << msg << " (" << file << ":" << line << ")";
  throw Error(kind, os.str());
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace detail
}  // namespace moecomm

// Throws moecomm::Error of the given kind when `cond` is false; the remaining arguments are
// streamed into the message.
#define MC_CHECK_KIND(cond, kind, ...)                                        \
  do {                                                                        \
    if (!(cond)) {                                                            \
      ::moecomm::detail::throw_error(kind, __FILE__, __LINE__,                \
                                     ::moecomm::detail::concat(__VA_ARGS__)); \
    }                                                                         \
  } while (0)

#define MC_CHECK(cond, ...) MC_CHECK_KIND(cond, ::moecomm::ErrorKind::kInvalidArgument, __VA_ARGS__)

#define MC_THROW(kind, ...) \
  ::moecomm::detail::throw_error(kind, __FILE__, __LINE__, ::moecomm::detail::concat(__VA_ARGS__))

// For OS calls that return -1 and set errno.
#define MC_SYSCALL_CHECK(expr, ...)                                                              \
  do {                                                                                           \
    if ((expr) == -1) {                                                                          \
      const int mc_errno_ = errno;                                                               \
      ::moecomm::detail::throw_error(                                                            \
          mc_errno_ == ENOENT ? ::moecomm::ErrorKind::kNotFound : ::moecomm::ErrorKind::kSystem, \
          __FILE__, __LINE__,                                                                    \
          ::moecomm::detail::concat(__VA_ARGS__, ": ", std::strerror(mc_errno_)));               \
    }                                                                                            \
  } while (0)

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define MC_CUDA_CHECK(expr)                                                                   \
  do {                                                                                        \
    const cudaError_t mc_err_ = (expr);                                                       \
    if (mc_err_ != cudaSuccess) {                                                             \
      MC_THROW(::moecomm::ErrorKind::kSystem, "CUDA error ", cudaGetErrorName(mc_err_), ": ", \
               cudaGetErrorString(mc_err_), " in ", #expr);                                   \
    }                                                                                         \
  } while (0)
#endif

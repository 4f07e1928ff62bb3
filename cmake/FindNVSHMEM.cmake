# Finds NVSHMEM's headers, device library (libnvshmem_device.a) and host library.
#   1. NVSHMEM_HOME (cache variable or environment): a toolkit-style install (include/, lib/).
#   2. The nvidia-nvshmem-cu12 / -cu13 wheel installed in the Python that runs the build: it
#      ships include/ and lib/ under site-packages/nvidia/nvshmem, with the host library only
#      as libnvshmem_host.so.3 (no unversioned name), so it is looked up by that name too.
# Defines NVSHMEM_FOUND, NVSHMEM_INCLUDE_DIR, NVSHMEM_LIB_DIR and the imported targets
# NVSHMEM::device and NVSHMEM::host.
set(NVSHMEM_HOME "$ENV{NVSHMEM_HOME}" CACHE PATH "NVSHMEM install prefix (include/, lib/)")

set(_nvshmem_hints "")
if(NVSHMEM_HOME)
  list(APPEND _nvshmem_hints "${NVSHMEM_HOME}")
endif()
if(Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import nvidia.nvshmem as n; print(list(n.__path__)[0])"
    OUTPUT_VARIABLE _nvshmem_wheel OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _nvshmem_rc ERROR_QUIET)
  if(_nvshmem_rc EQUAL 0 AND _nvshmem_wheel)
    list(APPEND _nvshmem_hints "${_nvshmem_wheel}")
  endif()
endif()

find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_nvshmem_hints} PATH_SUFFIXES include
  NO_DEFAULT_PATH)
find_library(NVSHMEM_DEVICE_LIB NAMES nvshmem_device libnvshmem_device.a
  HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
find_library(NVSHMEM_HOST_LIB NAMES nvshmem_host libnvshmem_host.so.3
  HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)

set(NVSHMEM_FOUND OFF)
if(NVSHMEM_INCLUDE_DIR AND NVSHMEM_DEVICE_LIB AND NVSHMEM_HOST_LIB)
  set(NVSHMEM_FOUND ON)
  get_filename_component(NVSHMEM_LIB_DIR "${NVSHMEM_HOST_LIB}" DIRECTORY)
  if(NOT TARGET NVSHMEM::device)
    add_library(NVSHMEM::device STATIC IMPORTED)
    set_target_properties(NVSHMEM::device PROPERTIES
      IMPORTED_LOCATION "${NVSHMEM_DEVICE_LIB}"
      INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
    add_library(NVSHMEM::host SHARED IMPORTED)
    set_target_properties(NVSHMEM::host PROPERTIES
      IMPORTED_LOCATION "${NVSHMEM_HOST_LIB}"
      IMPORTED_NO_SONAME OFF
      INTERFACE_INCLUDE_DIRECTORIES "${NVSHMEM_INCLUDE_DIR}")
  endif()
endif()

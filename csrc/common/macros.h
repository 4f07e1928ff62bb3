// Qualifiers shared by host and device code. Protocol headers use these so that one definition
// of the wire format compiles under g++ and nvcc alike.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MC_HOST_DEVICE __host__ __device__
#define MC_DEVICE __device__
#else
#define MC_HOST_DEVICE
#define MC_DEVICE
#endif

#define MC_FORCE_INLINE inline __attribute__((always_inline))

// pinpool's stand-in for CUDA's crt/host_defines.h, for a host-only C++ compile with GCC or
// Clang (no nvcc): the declaration qualifiers CUDA's runtime headers use, as a host compiler
// sees them. Qualifiers for device code expand to nothing; alignment and inlining to the
// compiler's attributes, so that types are laid out as CUDA's own headers lay them out.
#pragma once
#if defined(__CUDACC__) || !defined(__GNUC__)
#error "pinpool's stand-in crt/host_defines.h is for a GCC or Clang host compile only"
#endif
#define __no_return__ __attribute__((noreturn))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __inline_hint__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a) __attribute__((a))
#define __location__(a)
#define __specialization_static
#define __launch_bounds__(...)
#define __maxnreg__(n)
#define __local_maxnreg__(n)
#define __cluster_dims__(...)
#define __block_size__(...)
#define __grid_constant__
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __nv_pure__
#define __tile_global__
#define __tile__
#define __tile_builtin__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __CUDA_ARCH_HAS_FEATURE__(feature) 0
#define __CUDA_HAS_ARCH_FAMILY_SPECIFIC(n) 0
#define __CUDA_HAS_ARCH_SPECIFIC(n) 0

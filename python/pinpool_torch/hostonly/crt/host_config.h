// pinpool's stand-in for CUDA's crt/host_config.h, for a host-only C++ compile (no nvcc):
// the real header only checks and adjusts things for nvcc (all of it under __CUDACC__).
#pragma once

// A pluggable CUDA allocator over cudaMallocAsync / cudaFreeAsync on the stream PyTorch
// passes, with the default pool keeping everything it frees: the cost of PyTorch's
// pluggable-allocator hook itself, for scripts/torch-step-probe.py.
//
//   nvcc -shared -Xcompiler -fPIC -o /tmp/pluggable-async.so scripts/pluggable-async.cpp
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

static bool ready = false;

extern "C" void* async_alloc(size_t size, int device, cudaStream_t stream) {
  if (!ready) {
    cudaMemPool_t pool;
    cudaDeviceGetDefaultMemPool(&pool, device);
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    ready = true;
  }
  void* p = nullptr;
  if (size == 0 || cudaMallocAsync(&p, size, stream) != cudaSuccess) return nullptr;
  return p;
}

extern "C" void async_free(void* p, size_t, int, cudaStream_t stream) {
  if (p) cudaFreeAsync(p, stream);
}

// PyTorch's graph-pool hooks, as pinpool's C entry points take them.
//
// PyTorch calls its `beginAllocateToPool` hook with a `std::function` (the stream filter of
// the capture) and all three hooks with a `MempoolId_t` (a pair of integers) by value; the
// Rust library takes C types. This file is compiled on the user's machine (by pinpool_torch,
// with the C++ compiler that libstdc++ matches) and loaded with ctypes; it needs no headers
// of CUDA or PyTorch: the two types below are declared as CUDA and c10 declare them.

#include <cstdint>
#include <functional>
#include <utility>

typedef struct CUstream_st* cudaStream_t;          // as in CUDA's driver_types.h
typedef std::pair<unsigned long long, unsigned long long> MempoolId_t;  // as in c10
typedef std::function<bool(cudaStream_t)> Filter;

typedef int (*filter_fn)(void* ctx, void* stream);
typedef void (*drop_fn)(void* ctx);
typedef int (*begin_fn)(int, uint64_t, uint64_t, filter_fn, void*, drop_fn);
typedef int (*pool_fn)(int, uint64_t, uint64_t);

static begin_fn begin_impl = nullptr;
static pool_fn end_impl = nullptr;
static pool_fn release_impl = nullptr;

// PyTorch's filter asks the driver about the stream and may throw: an exception must not
// unwind through Rust, and a stream it cannot judge is not the capture's.
static int call_filter(void* ctx, void* stream) {
  try {
    return (*static_cast<Filter*>(ctx))(static_cast<cudaStream_t>(stream)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

static void drop_filter(void* ctx) { delete static_cast<Filter*>(ctx); }

static void begin_hook(int device, MempoolId_t id, Filter filter) {
  Filter* owned = new Filter(std::move(filter));
  // The library owns `owned` from here (it calls drop_filter, also on failure).
  begin_impl(device, id.first, id.second, call_filter, owned, drop_filter);
}

static void end_hook(int device, MempoolId_t id) { end_impl(device, id.first, id.second); }

static void release_hook(int device, MempoolId_t id) {
  release_impl(device, id.first, id.second);
}

extern "C" {
// Takes pinpool's three entry points; writes the addresses of the hooks to hand PyTorch.
void pinpool_hooks_install(void* begin, void* end, void* release, uint64_t* out) {
  begin_impl = reinterpret_cast<begin_fn>(begin);
  end_impl = reinterpret_cast<pool_fn>(end);
  release_impl = reinterpret_cast<pool_fn>(release);
  out[0] = reinterpret_cast<uint64_t>(&begin_hook);
  out[1] = reinterpret_cast<uint64_t>(&end_hook);
  out[2] = reinterpret_cast<uint64_t>(&release_hook);
}
}

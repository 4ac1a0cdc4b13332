// The few lines of C++ between PyTorch's pluggable-allocator interface and pinpool's C entry
// points, compiled on the user's machine by pinpool_torch (with the C++ compiler whose
// libstdc++ PyTorch uses) and loaded with ctypes.
//
// - alloc: pinpool answers NULL when it cannot allocate (out of memory, no such device);
//   PyTorch's own allocator throws instead, and PyTorch's callers (cuDNN's autotuner among
//   them) catch that exception. So a NULL for a non-empty request becomes the exception
//   here: c10::OutOfMemoryError when built against PyTorch's headers (-DPINPOOL_WITH_C10),
//   else std::runtime_error, which PyTorch's Python bindings raise as RuntimeError.
// - the graph-pool hooks: PyTorch calls `beginAllocateToPool` with a `std::function` (the
//   capture's stream filter) and all three with a `MempoolId_t` (a pair of integers) by
//   value; pinpool takes C types and answers 0 or -1. A refused begin or end throws, as
//   PyTorch's own allocator does (a second capture into a pool already capturing must not
//   go on with its allocations in the stream's ordinary pool); a refused release does not
//   (PyTorch releases pools from destructors).
//
// Without PINPOOL_WITH_C10 it needs no header of CUDA or PyTorch: the two types below are
// declared as CUDA and c10 declare them.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

#ifdef PINPOOL_WITH_C10
#include <c10/util/Exception.h>
#endif

typedef struct CUstream_st* cudaStream_t;                               // CUDA's driver_types.h
typedef std::pair<unsigned long long, unsigned long long> MempoolId_t;  // c10's MempoolId_t
typedef std::function<bool(cudaStream_t)> Filter;

typedef void* (*alloc_fn)(size_t, int, void*);
typedef void (*free_fn)(void*, size_t, int, void*);
typedef size_t (*last_error_fn)(char*, size_t);
typedef int (*filter_fn)(void* ctx, void* stream);
typedef void (*drop_fn)(void* ctx);
typedef int (*begin_fn)(int, uint64_t, uint64_t, filter_fn, void*, drop_fn);
typedef int (*pool_fn)(int, uint64_t, uint64_t);

static alloc_fn alloc_impl = nullptr;
static free_fn free_impl = nullptr;
static last_error_fn last_error_impl = nullptr;
static begin_fn begin_impl = nullptr;
static pool_fn end_impl = nullptr;
static pool_fn release_impl = nullptr;

static std::string last_error() {
  char buf[1024];
  size_t n = last_error_impl(buf, sizeof buf);
  return std::string(buf, n < sizeof buf ? n : sizeof buf - 1);
}

extern "C" void* pinpool_shim_alloc(size_t size, int device, cudaStream_t stream) {
  void* p = alloc_impl(size, device, stream);
  if (p == nullptr && size != 0) {
    // The message is put together without iostreams: c10's message builder (an
    // std::ostringstream compiled into this library) crashed in PyTorch's process.
    std::string msg = "CUDA out of memory: tried to allocate " + std::to_string(size) +
                      " bytes on device " + std::to_string(device) + " (" + last_error() + ")";
#ifdef PINPOOL_WITH_C10
    throw c10::OutOfMemoryError(
        c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
#else
    throw std::runtime_error(msg);
#endif
  }
  return p;
}

extern "C" void pinpool_shim_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  free_impl(ptr, size, device, stream);
}

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

// A graph-pool call pinpool refused, as PyTorch's own allocator reports one: c10::Error
// (RuntimeError in Python) when built against PyTorch's headers, else std::runtime_error.
[[noreturn]] static void refused(const char* what, int device, MempoolId_t id) {
  std::string msg = std::string(what) + " (device " + std::to_string(device) + ", pool (" +
                    std::to_string(id.first) + ", " + std::to_string(id.second) +
                    ")): " + last_error();
#ifdef PINPOOL_WITH_C10
  throw c10::Error(c10::SourceLocation{what, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
#else
  throw std::runtime_error(msg);
#endif
}

// A capture into a pool already capturing, or into the default pool, is refused: PyTorch's
// allocator raises ("already recording to mempool_id"), and so does this hook, before the
// capture begins (PyTorch calls it ahead of cudaStreamBeginCapture).
static void begin_hook(int device, MempoolId_t id, Filter filter) {
  Filter* owned = new Filter(std::move(filter));
  // pinpool owns `owned` from here (it calls drop_filter, also when the call fails).
  if (begin_impl(device, id.first, id.second, call_filter, owned, drop_filter) != 0) {
    refused("beginAllocateToPool", device, id);
  }
}

// Ending a pool that is not capturing raises, as in PyTorch ("not currently recording").
static void end_hook(int device, MempoolId_t id) {
  if (end_impl(device, id.first, id.second) != 0) {
    refused("endAllocateToPool", device, id);
  }
}

// PyTorch releases pools from destructors (a CUDAGraph's, a MemPool's), where an exception
// would end the process: a refusal is only reported (pinpool writes it to stderr, and
// pinpool_torch.last_error() has it).
static void release_hook(int device, MempoolId_t id) {
  (void)release_impl(device, id.first, id.second);
}

extern "C" {
// Takes pinpool's entry points (in[0..6]: alloc, free, last_error, begin, end, release);
// writes the addresses of the graph-pool hooks to hand PyTorch (out[0..3]); returns 1 when
// built against PyTorch's headers.
int pinpool_shim_install(void* const* in, uint64_t* out) {
  alloc_impl = reinterpret_cast<alloc_fn>(in[0]);
  free_impl = reinterpret_cast<free_fn>(in[1]);
  last_error_impl = reinterpret_cast<last_error_fn>(in[2]);
  begin_impl = reinterpret_cast<begin_fn>(in[3]);
  end_impl = reinterpret_cast<pool_fn>(in[4]);
  release_impl = reinterpret_cast<pool_fn>(in[5]);
  out[0] = reinterpret_cast<uint64_t>(&begin_hook);
  out[1] = reinterpret_cast<uint64_t>(&end_hook);
  out[2] = reinterpret_cast<uint64_t>(&release_hook);
#ifdef PINPOOL_WITH_C10
  return 1;
#else
  return 0;
#endif
}
}

// Probe: can host memory created through the CUDA virtual memory API (cuMemCreate with a host
// location) serve as pinned staging memory, so that a pool could grow one pinned range granule
// by granule and give back free granules in its middle (an expandable host segment)?
//
// It reserves one address range, maps 2 MiB host granules into it one by one, writes it from
// the CPU, copies across granule boundaries with cuMemcpyHtoDAsync (bandwidth, whether the
// enqueue is asynchronous, a round trip), unmaps a granule in the middle and maps it again,
// and times the same amount of cuMemHostAlloc. Once for CU_MEM_LOCATION_TYPE_HOST, once for
// CU_MEM_LOCATION_TYPE_HOST_NUMA.
//
//   nvcc -O2 -o /tmp/vmm-host-probe scripts/vmm-host-probe.cu -lcuda && /tmp/vmm-host-probe
//
// Needs CUDA 12.2 or later (host locations for cuMemCreate). Figures: BENCHMARKS.md.
#include <cuda.h>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <vector>
#include <csignal>
#include <csetjmp>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorString(r, &s); printf("FAIL %s -> %d %s\n", #x, (int)r, s); return 1; } } while (0)
static double now_us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static sigjmp_buf jb;
static void on_segv(int) { siglongjmp(jb, 1); }
static int try_loc(CUmemLocationType lt, int id, const char* name) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = lt;
  prop.location.id = id;
  size_t gran = 0;
  CUresult r = cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  printf("== location %s: granularity rc=%d min=%zu\n", name, (int)r, gran);
  if (r != CUDA_SUCCESS) return 1;
  size_t G = 2 << 20; if (gran > G) G = gran;
  const int N = 64;  // 128 MiB
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, N * G, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> h(N);
  double t0 = now_us();
  for (int i = 0; i < N; i++) {
    CK(cuMemCreate(&h[i], G, &prop, 0));
    CK(cuMemMap(va + i * G, G, 0, h[i], 0));
  }
  double t1 = now_us();
  CUmemAccessDesc acc[2] = {};
  acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE; acc[0].location.id = 0; acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  acc[1].location.type = lt; acc[1].location.id = id; acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = cuMemSetAccess(va, N * G, acc, 2);
  printf("setaccess device+host rc=%d\n", (int)r);
  const int nacc = r == CUDA_SUCCESS ? 2 : 1;
  if (nacc == 1) { CK(cuMemSetAccess(va, N * G, acc, 1)); printf("setaccess device only ok\n"); }
  double t2 = now_us();
  printf("create+map %d x %zu KiB: %.1f us per granule; setaccess %.1f us\n", N, G >> 10, (t1 - t0) / N, t2 - t1);
  signal(SIGSEGV, on_segv); signal(SIGBUS, on_segv);
  if (sigsetjmp(jb, 1) == 0) {
    double t3 = now_us();
    memset((void*)va, 0x5a, N * G);
    printf("cpu memset ok: %.1f us for %zu MiB\n", now_us() - t3, (N * G) >> 20);
  } else { printf("cpu access FAULTED\n"); return 1; }
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr d; CK(cuMemAlloc(&d, N * G));
  // A copy that spans granule boundaries (every granule).
  for (int rep = 0; rep < 2; rep++) {
    double t4 = now_us();
    CK(cuMemcpyHtoDAsync(d, (void*)va, N * G, s));
    CK(cuStreamSynchronize(s));
    double dt = now_us() - t4;
    printf("HtoD from vmm host %zu MiB: %.1f GB/s\n", (N * G) >> 20, (N * G) / dt / 1e3);
  }
  // async-ness: enqueue must return before the copy completes
  double t5 = now_us(); CK(cuMemcpyHtoDAsync(d, (void*)va, N * G, s)); double enq = now_us() - t5; CK(cuStreamSynchronize(s));
  printf("enqueue of a %zu MiB copy returned in %.1f us (async if << copy time)\n", (N * G) >> 20, enq);
  std::vector<unsigned char> back(N * G);
  memset((void*)(va + G - 100), 0x11, 200);  // straddles granule 0/1
  CK(cuMemcpyHtoDAsync(d, (void*)va, N * G, s)); CK(cuStreamSynchronize(s));
  CK(cuMemcpyDtoH(back.data(), d, N * G));
  printf("round trip equal: %d\n", memcmp(back.data(), (void*)va, N * G) == 0);
  // Unmap a granule in the middle; the rest stays usable.
  double t6 = now_us();
  CK(cuMemUnmap(va + 10 * G, G)); CK(cuMemRelease(h[10]));
  printf("unmap+release one granule: %.1f us\n", now_us() - t6);
  CK(cuMemcpyHtoDAsync(d, (void*)va, 10 * G, s)); CK(cuStreamSynchronize(s));
  CK(cuMemcpyHtoDAsync(d, (void*)(va + 11 * G), 10 * G, s)); CK(cuStreamSynchronize(s));
  printf("copies beside the hole ok\n");
  // Map it again (a fresh granule).
  CK(cuMemCreate(&h[10], G, &prop, 0)); CK(cuMemMap(va + 10 * G, G, 0, h[10], 0)); CK(cuMemSetAccess(va + 10 * G, G, acc, nacc));
  memset((void*)(va + 10 * G), 1, G);
  printf("remapped granule usable\n");
  // Pointer attributes: what the driver thinks this memory is.
  unsigned int mt = 0; r = cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va);
  printf("pointer memory type rc=%d type=%u (1 host, 2 device)\n", (int)r, mt);
  // Compare cuMemHostAlloc of the same total in 2 MiB pieces and in one piece.
  std::vector<void*> p(N);
  double t7 = now_us();
  for (int i = 0; i < N; i++) CK(cuMemHostAlloc(&p[i], G, 0));
  double t8 = now_us();
  printf("cuMemHostAlloc %d x %zu KiB: %.1f us each\n", N, G >> 10, (t8 - t7) / N);
  for (int i = 0; i < N; i++) cuMemFreeHost(p[i]);
  void* big; double t9 = now_us(); CK(cuMemHostAlloc(&big, N * G, 0));
  printf("cuMemHostAlloc one %zu MiB: %.1f us\n", (N * G) >> 20, now_us() - t9);
  double ta = now_us(); CK(cuMemcpyHtoDAsync(d, big, N * G, s)); CK(cuStreamSynchronize(s));
  printf("HtoD from cuMemHostAlloc: %.1f GB/s\n", (N * G) / (now_us() - ta) / 1e3);
  ta = now_us(); CK(cuMemcpyHtoDAsync(d, big, N * G, s)); CK(cuStreamSynchronize(s));
  printf("HtoD from cuMemHostAlloc (2nd): %.1f GB/s\n", (N * G) / (now_us() - ta) / 1e3);
  cuMemFreeHost(big);
  for (int i = 0; i < N; i++) { cuMemUnmap(va + i * G, G); cuMemRelease(h[i]); }
  cuMemAddressFree(va, N * G);
  return 0;
}
int main() {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  int drv; cuDriverGetVersion(&drv); printf("driver %d\n", drv);
  int numa = -1; cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev);
  printf("host numa id of device: %d\n", numa);
  try_loc(CU_MEM_LOCATION_TYPE_HOST, 0, "HOST");
  try_loc(CU_MEM_LOCATION_TYPE_HOST_NUMA, numa < 0 ? 0 : numa, "HOST_NUMA");
  return 0;
}

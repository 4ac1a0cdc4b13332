// The few lines of C++ between PyTorch's pluggable-allocator interface and pinpool's C entry
// points, compiled on the user's machine by pinpool_torch (with the C++ compiler whose
// libstdc++ PyTorch uses) and loaded with ctypes.
//
// - alloc: pinpool answers NULL when it cannot allocate (out of memory, no such device);
//   PyTorch's own allocator throws instead, and PyTorch's callers (cuDNN's autotuner among
//   them) catch that exception. So a NULL for a non-empty request becomes the exception
//   here: for want of memory, c10::OutOfMemoryError when built against PyTorch's headers
//   (-DPINPOOL_WITH_C10); for any other reason (no such device, a forked child), c10::Error;
//   without the headers, std::runtime_error, which PyTorch's Python bindings raise as
//   RuntimeError.
// - the graph-pool hooks: PyTorch calls `beginAllocateToPool` with a `std::function` (the
//   capture's stream filter) and all three with a `MempoolId_t` (a pair of integers) by
//   value; pinpool takes C types and answers 0 or -1. A refused begin or end throws, as
//   PyTorch's own allocator does (a second capture into a pool already capturing must not
//   go on with its allocations in the stream's ordinary pool); a refused release does not
//   (PyTorch releases pools from destructors).
//
// - the allocator front (PINPOOL_WITH_FRONT: built against PyTorch's and CUDA's headers and
//   linked with libtorch_cuda): PyTorch's pluggable allocator with the calls it leaves
//   unimplemented answered by pinpool — getDeviceStats (torch.cuda.memory_stats,
//   max_memory_allocated, memory_summary, ...), resetPeakStats, resetAccumulatedStats and
//   cacheInfo (cuDNN's algorithm search with torch.backends.cudnn.benchmark),
//   enablePeerAccess and memcpyAsync (copies between GPUs reach memory mapped before peer
//   access was enabled, and go through the driver's peer copy without it), and, from
//   PyTorch 2.11, snapshot and recordHistory (torch.cuda.memory._snapshot,
//   _record_memory_history, _dump_snapshot for pytorch.org/memory_viz) — installed as
//   PyTorch's CUDA allocator by pinpool_shim_enable.
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

#ifdef PINPOOL_WITH_FRONT
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

// The snapshot and history calls have the signatures the front overrides from this version.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
#define PINPOOL_FRONT_SNAPSHOT 1
#endif
typedef c10::cuda::MempoolId_t MempoolId_t;
#else
typedef struct CUstream_st* cudaStream_t;                               // CUDA's driver_types.h
typedef std::pair<unsigned long long, unsigned long long> MempoolId_t;  // c10's MempoolId_t
#endif
typedef std::function<bool(cudaStream_t)> Filter;

typedef void* (*alloc_fn)(size_t, int, void*);
typedef void (*free_fn)(void*, size_t, int, void*);
typedef size_t (*last_error_fn)(char*, size_t);
typedef int (*filter_fn)(void* ctx, void* stream);
typedef void (*drop_fn)(void* ctx);
typedef int (*begin_fn)(int, uint64_t, uint64_t, filter_fn, void*, drop_fn);
typedef int (*pool_fn)(int, uint64_t, uint64_t);
typedef void (*record_fn)(void*, void*);
typedef void (*reset_fn)();
typedef void (*fraction_fn)(double, int);
typedef int (*stats_fn)(int, const char* const*, size_t, int64_t*);
typedef int64_t (*device_fn)(int);
typedef int (*device_status_fn)(int);
typedef int (*flag_fn)();

// pinpool_snapshot's records (torch/src/snapshot.rs).
struct BlockRecord {
  uint64_t size, requested_size;
  int allocated, active;
};
struct SegmentRecord {
  int64_t device;
  uint64_t address, total_size, allocated_size, active_size, requested_size, stream;
  uint64_t pool[2];
  int is_large, is_expandable;
  const BlockRecord* blocks;
  size_t n_blocks;
};
struct TraceRecord {
  int64_t device;
  int action;
  uint64_t addr, size, stream;
  uint64_t pool[2];
  uint64_t age_us;
};
typedef void (*segment_cb)(void*, const SegmentRecord*);
typedef void (*trace_cb)(void*, const TraceRecord*);
typedef int (*snapshot_fn)(uint64_t, uint64_t, int, void*, segment_cb, trace_cb);
typedef int (*history_fn)(int, size_t, int, int, const char*);
typedef int (*peer_fn)(int, int);

static alloc_fn alloc_impl = nullptr;
static free_fn free_impl = nullptr;
static last_error_fn last_error_impl = nullptr;
static begin_fn begin_impl = nullptr;
static pool_fn end_impl = nullptr;
static pool_fn release_impl = nullptr;
static record_fn record_impl = nullptr;
static reset_fn empty_impl = nullptr;
static fraction_fn fraction_impl = nullptr;
static stats_fn stats_impl = nullptr;
static device_fn largest_impl = nullptr;
static device_status_fn reset_peak_impl = nullptr;
static device_status_fn reset_accumulated_impl = nullptr;
static flag_fn oom_impl = nullptr;
static snapshot_fn snapshot_impl = nullptr;
static history_fn history_impl = nullptr;
static peer_fn peer_impl = nullptr;

static std::string last_error() {
  char buf[1024];
  size_t n = last_error_impl(buf, sizeof buf);
  return std::string(buf, n < sizeof buf ? n : sizeof buf - 1);
}

// An error PyTorch reports as its own allocator does: c10::Error (RuntimeError in Python)
// when built against PyTorch's headers, else std::runtime_error.
[[noreturn]] static void raise_error(const char* where, const std::string& msg) {
#ifdef PINPOOL_WITH_C10
  throw c10::Error(c10::SourceLocation{where, __FILE__, static_cast<uint32_t>(__LINE__)}, msg);
#else
  (void)where;
  throw std::runtime_error(msg);
#endif
}

extern "C" void* pinpool_shim_alloc(size_t size, int device, cudaStream_t stream) {
  void* p = alloc_impl(size, device, stream);
  if (p == nullptr && size != 0) {
    // The message is put together without iostreams: c10's message builder (an
    // std::ostringstream compiled into this library) crashed in PyTorch's process.
    std::string what = "tried to allocate " + std::to_string(size) + " bytes on device " +
                       std::to_string(device) + " (" + last_error() + ")";
    if (!oom_impl()) {
      // Not for want of memory (no such device, a failed start, a forked child): an error
      // that code catching torch.OutOfMemoryError to retry smaller does not take for one.
      raise_error(__func__, "pinpool could not allocate: " + what);
    }
    std::string msg = "CUDA out of memory: " + what;
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

// A graph-pool call pinpool refused, as PyTorch's own allocator reports one.
[[noreturn]] static void refused(const char* what, int device, MempoolId_t id) {
  raise_error(what, std::string(what) + " (device " + std::to_string(device) + ", pool (" +
                        std::to_string(id.first) + ", " + std::to_string(id.second) +
                        ")): " + last_error());
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

#ifdef PINPOOL_WITH_FRONT
namespace {

using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

// The statistics PyTorch's DeviceStats holds, by their names in torch.cuda.memory_stats()
// (what pinpool_stats_values answers), in the order `Front::getDeviceStats` reads them.
const char* const kArrays[] = {"allocation",      "segment",        "active",
                               "inactive_split",  "allocated_bytes", "reserved_bytes",
                               "active_bytes",    "inactive_split_bytes", "requested_bytes"};
// c10's StatType order: AGGREGATE, SMALL_POOL, LARGE_POOL.
const char* const kPools[] = {"all", "small_pool", "large_pool"};
const char* const kFields[] = {"current", "peak", "allocated", "freed"};
const char* const kOversize[] = {"oversize_allocations", "oversize_segments"};
const char* const kCounts[] = {"num_alloc_retries", "num_ooms",        "num_sync_all_streams",
                               "num_device_alloc",  "num_device_free", "max_split_size"};

const std::vector<std::string>& stat_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const char* a : kArrays)
      for (const char* p : kPools)
        for (const char* f : kFields) k.push_back(std::string(a) + "." + p + "." + f);
    for (const char* o : kOversize)
      for (const char* f : kFields) k.push_back(std::string(o) + "." + f);
    for (const char* c : kCounts) k.push_back(c);
    return k;
  }();
  return keys;
}

[[noreturn]] void failed(const char* what, int device) {
  raise_error(what, std::string("pinpool: ") + what + " (device " + std::to_string(device) +
                        "): " + last_error());
}

#ifdef PINPOOL_FRONT_SNAPSHOT
using Context = std::shared_ptr<c10::GatheredContext>;

// Call sites of allocations while PyTorch's memory history records them (the context
// recorder _record_memory_history hands the front: Python and C++ frames). pinpool keeps the
// trace; the front keeps the contexts, by address in allocation order, and gives the
// snapshot's allocated blocks and trace entries theirs. An allocation outside history costs
// one atomic load.
struct CallSites {
  // Contexts by address, in the order noted, at most `keep` of them.
  struct Sites {
    std::unordered_map<uint64_t, std::deque<Context>> by_addr;
    std::deque<uint64_t> order;  // addresses, oldest first, to bound what is kept

    void add(uint64_t a, Context ctx, size_t keep) {
      by_addr[a].push_back(std::move(ctx));
      order.push_back(a);
      while (order.size() > keep) {
        auto it = by_addr.find(order.front());
        if (it != by_addr.end()) {
          it->second.pop_front();
          if (it->second.empty()) by_addr.erase(it);
        }
        order.pop_front();
      }
    }

    void clear() {
      by_addr.clear();
      order.clear();
    }

    // Gives the trace's entries of `action` their contexts: the last n entries at an
    // address are the last n noted there.
    void attach(std::vector<std::vector<c10::CachingDeviceAllocator::TraceEntry>>& traces,
                c10::CachingDeviceAllocator::TraceEntry::Action action) {
      std::unordered_map<uint64_t, size_t> seen;
      for (auto& trace : traces) {
        for (auto e = trace.rbegin(); e != trace.rend(); ++e) {
          if (e->action_ != action) continue;
          auto it = by_addr.find(e->addr_);
          if (it == by_addr.end()) continue;
          size_t k = seen[e->addr_]++;
          if (k < it->second.size()) e->context_ = it->second[it->second.size() - 1 - k];
        }
      }
    }
  };

  std::atomic<c10::CachingDeviceAllocator::CreateContextFn> recorder{nullptr};
  std::atomic<bool> for_trace{false};  // RecordContext ALLOC or ALL: trace entries get them
  std::atomic<bool> for_frees{false};  // RecordContext ALL: frees get them too
  std::mutex mu;
  Sites allocs, frees;
  size_t keep = 0;

  void note(void* p) {
    auto rec = recorder.load(std::memory_order_relaxed);
    if (rec == nullptr || p == nullptr) return;
    Context ctx = rec();
    std::lock_guard<std::mutex> g(mu);
    allocs.add(reinterpret_cast<uint64_t>(p), std::move(ctx), keep);
  }

  void note_free(void* p) {
    if (!for_frees.load(std::memory_order_relaxed) || p == nullptr) return;
    auto rec = recorder.load(std::memory_order_relaxed);
    if (rec == nullptr) return;
    Context ctx = rec();
    std::lock_guard<std::mutex> g(mu);
    frees.add(reinterpret_cast<uint64_t>(p), std::move(ctx), keep);
  }

  void set(c10::CachingDeviceAllocator::CreateContextFn rec,
           c10::CachingDeviceAllocator::RecordContext when, size_t max_entries) {
    using When = c10::CachingDeviceAllocator::RecordContext;
    std::lock_guard<std::mutex> g(mu);
    keep = max_entries;
    for_trace = when == When::ALLOC || when == When::ALL;
    for_frees = when == When::ALL;
    recorder = when == When::NEVER ? nullptr : rec;
    if (recorder.load() == nullptr) {
      allocs.clear();
      frees.clear();
    }
  }

  // The context of the allocation live at `addr` (the latest there), or none.
  Context latest(uint64_t addr) {
    auto it = allocs.by_addr.find(addr);
    return it == allocs.by_addr.end() ? nullptr : it->second.back();
  }

  // Gives the trace's allocation entries their contexts, and its free requests theirs
  // where frees are noted.
  void attach(std::vector<std::vector<c10::CachingDeviceAllocator::TraceEntry>>& traces) {
    using Entry = c10::CachingDeviceAllocator::TraceEntry;
    if (!for_trace) return;
    allocs.attach(traces, Entry::ALLOC);
    frees.attach(traces, Entry::FREE_REQUESTED);
  }
};

CallSites call_sites;
#endif

// PyTorch's pluggable allocator (alloc, free, record_stream, empty_cache, the memory
// fraction and graph pools through pinpool's hooks), with the calls it leaves unimplemented
// answered by pinpool.
struct Front : Base {
  using Base::Base;
  using Stats = decltype(std::declval<Base&>().getDeviceStats(c10::DeviceIndex{0}));
  using Array = decltype(Stats::allocation);
  using Stat = decltype(Stats::oversize_allocations);

  Stats getDeviceStats(c10::DeviceIndex device) override {
    const auto& keys = stat_keys();
    std::vector<const char*> names;
    for (const auto& k : keys) names.push_back(k.c_str());
    std::vector<int64_t> v(keys.size());
    if (stats_impl(device, names.data(), names.size(), v.data()) != 0) {
      failed("getDeviceStats", device);
    }
    Stats stats;
    size_t i = 0;
    auto read = [&](Stat& s) {
      s.current = v[i++];
      s.peak = v[i++];
      s.allocated = v[i++];
      s.freed = v[i++];
    };
    Array Stats::*arrays[] = {&Stats::allocation,      &Stats::segment,
                              &Stats::active,          &Stats::inactive_split,
                              &Stats::allocated_bytes, &Stats::reserved_bytes,
                              &Stats::active_bytes,    &Stats::inactive_split_bytes,
                              &Stats::requested_bytes};
    for (auto a : arrays)
      for (size_t p = 0; p < 3; p++) read((stats.*a)[p]);
    read(stats.oversize_allocations);
    read(stats.oversize_segments);
    stats.num_alloc_retries = v[i++];
    stats.num_ooms = v[i++];
    stats.num_sync_all_streams = v[i++];
    stats.num_device_alloc = v[i++];
    stats.num_device_free = v[i++];
    // pinpool has no key without a split limit; PyTorch's allocator then reports SIZE_MAX
    // as int64, -1.
    stats.max_split_size = v[i] != 0 ? v[i] : -1;
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    if (reset_accumulated_impl(device) != 0) failed("resetAccumulatedStats", device);
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    if (reset_peak_impl(device) != 0) failed("resetPeakStats", device);
  }

  // The largest block a request could get now (cuDNN tries workspaces up to it). PyTorch's
  // own allocator answers at least what `*largest` held; so does this.
  // PyTorch calls this before its first direct copy between two GPUs (get_p2p_access).
  // The pluggable front only enables the contexts' peer access; memory pinpool mapped
  // before the call is opened to `dev` too (mapped memory is reachable only by the devices
  // its mapping names), as PyTorch's expandable segments are.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    Base::enablePeerAccess(dev, dev_to_access);
    if (peer_impl(dev, dev_to_access) != 0) failed("enablePeerAccess", dev);
  }

  // As PyTorch's own allocator: between two GPUs without peer access, mapped memory is
  // copied only by the driver's peer copy (cudaMemcpyAsync fails there).
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    int64_t n = largest_impl(device);
    if (n < 0) failed("cacheInfo", device);
    if (static_cast<size_t>(n) > *largest) *largest = static_cast<size_t>(n);
  }

#ifdef PINPOOL_FRONT_SNAPSHOT
  using SnapshotInfo = c10::cuda::CUDACachingAllocator::SnapshotInfo;
  using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;

  // The snapshot PyTorch's Python calls read (torch.cuda.memory._snapshot): segments with
  // their blocks tiling them, and each device's trace with its times in microseconds since
  // the epoch (what PyTorch's own snapshot converts its entries' clock readings to); the
  // call sites of allocated blocks and allocations where history recorded them (frees get
  // none).
  SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    Collect c;
    c.info.device_traces.resize(static_cast<size_t>(c10::cuda::device_count()));
    c.now_us = c10::getTime() / 1000;
    if (snapshot_impl(mempool_id.first, mempool_id.second, include_traces ? 1 : 0, &c,
                      on_segment, on_trace) != 0 ||
        c.failed) {
      failed("snapshot", -1);
    }
    std::lock_guard<std::mutex> g(call_sites.mu);
    for (auto& seg : c.info.segments) {
      uint64_t at = seg.address;
      for (auto& b : seg.blocks) {
        if (b.allocated) b.context_when_allocated = call_sites.latest(at);
        at += b.size;
      }
    }
    call_sites.attach(c.info.device_traces);
    return std::move(c.info);
  }

  // PyTorch's _record_memory_history: pinpool keeps the trace in a ring of
  // `alloc_trace_max_entries` (cleared first with `clear_history` when turned on, and
  // without the `skip_actions`), the front the call sites of allocations, and of frees for
  // RecordContext ALL (pinpool's own, Rust frames, are not recorded).
  void recordHistory(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder,
                     size_t alloc_trace_max_entries,
                     c10::CachingDeviceAllocator::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    std::string skip;
    for (const auto& action : skip_actions) {
      skip += (skip.empty() ? "" : ",") + action;
    }
    if (history_impl(enabled ? 1 : 0, alloc_trace_max_entries, 0, clear_history ? 1 : 0,
                     skip.c_str()) != 0) {
      failed("recordHistory", -1);
    }
    call_sites.set(enabled ? recorder : nullptr,
                   enabled ? when : c10::CachingDeviceAllocator::RecordContext::NEVER,
                   alloc_trace_max_entries);
    history_on_ = enabled;
  }

  bool isHistoryEnabled() override { return history_on_; }

 private:
  struct Collect {
    SnapshotInfo info{};
    c10::time_t now_us{};
    bool failed = false;
  };

  static void on_segment(void* ctx, const SegmentRecord* r) {
    auto* c = static_cast<Collect*>(ctx);
    try {
      c10::CachingDeviceAllocator::SegmentInfo s;
      s.device = static_cast<c10::DeviceIndex>(r->device);
      s.address = r->address;
      s.total_size = r->total_size;
      s.requested_size = r->requested_size;
      s.allocated_size = r->allocated_size;
      s.active_size = r->active_size;
      s.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(r->stream));
      s.is_large = r->is_large != 0;
      s.is_expandable = r->is_expandable != 0;
      s.owner_private_pool_id = {r->pool[0], r->pool[1]};
      for (size_t i = 0; i < r->n_blocks; i++) {
        c10::CachingDeviceAllocator::BlockInfo b;
        b.size = r->blocks[i].size;
        b.requested_size = r->blocks[i].requested_size;
        b.allocated = r->blocks[i].allocated != 0;
        b.active = r->blocks[i].active != 0;
        s.blocks.push_back(std::move(b));
      }
      c->info.segments.push_back(std::move(s));
    } catch (...) {
      c->failed = true;  // nothing unwinds into pinpool
    }
  }

  static void on_trace(void* ctx, const TraceRecord* r) {
    static const TraceEntry::Action actions[] = {
        TraceEntry::ALLOC,       TraceEntry::FREE_REQUESTED, TraceEntry::FREE_COMPLETED,
        TraceEntry::SEGMENT_ALLOC, TraceEntry::SEGMENT_FREE, TraceEntry::SEGMENT_MAP,
        TraceEntry::SEGMENT_UNMAP, TraceEntry::SNAPSHOT,     TraceEntry::OOM};
    auto* c = static_cast<Collect*>(ctx);
    if (r->action < 0 || r->action > 8 || r->device < 0) return;
    try {
      auto d = static_cast<size_t>(r->device);
      if (c->info.device_traces.size() <= d) c->info.device_traces.resize(d + 1);
      auto& e = c->info.device_traces[d].emplace_back(
          actions[r->action], static_cast<c10::DeviceIndex>(r->device), r->addr, r->size,
          reinterpret_cast<void*>(static_cast<uintptr_t>(r->stream)),
          MempoolId_t{r->pool[0], r->pool[1]}, c10::approx_time_t{});
      e.time_.t_ = c->now_us - static_cast<c10::time_t>(r->age_us);
    } catch (...) {
      c->failed = true;
    }
  }

  std::atomic<bool> history_on_{false};
#endif
};

std::shared_ptr<Front> front;

}  // namespace
#endif

extern "C" {
// Takes pinpool's entry points (in[0..16]: alloc, free, last_error, begin, end, release,
// record_stream, empty_cache, memory_fraction, stats_values, largest_block,
// reset_peak_stats, reset_accumulated_stats, last_error_is_oom, snapshot, record_history,
// enable_peer_access);
// writes the addresses of the graph-pool hooks
// to hand PyTorch (out[0..3]); returns 2 when built with the allocator front, 1 when built
// against PyTorch's headers, else 0.
int pinpool_shim_install(void* const* in, uint64_t* out) {
  alloc_impl = reinterpret_cast<alloc_fn>(in[0]);
  free_impl = reinterpret_cast<free_fn>(in[1]);
  last_error_impl = reinterpret_cast<last_error_fn>(in[2]);
  begin_impl = reinterpret_cast<begin_fn>(in[3]);
  end_impl = reinterpret_cast<pool_fn>(in[4]);
  release_impl = reinterpret_cast<pool_fn>(in[5]);
  record_impl = reinterpret_cast<record_fn>(in[6]);
  empty_impl = reinterpret_cast<reset_fn>(in[7]);
  fraction_impl = reinterpret_cast<fraction_fn>(in[8]);
  stats_impl = reinterpret_cast<stats_fn>(in[9]);
  largest_impl = reinterpret_cast<device_fn>(in[10]);
  reset_peak_impl = reinterpret_cast<device_status_fn>(in[11]);
  reset_accumulated_impl = reinterpret_cast<device_status_fn>(in[12]);
  oom_impl = reinterpret_cast<flag_fn>(in[13]);
  snapshot_impl = reinterpret_cast<snapshot_fn>(in[14]);
  history_impl = reinterpret_cast<history_fn>(in[15]);
  peer_impl = reinterpret_cast<peer_fn>(in[16]);
  out[0] = reinterpret_cast<uint64_t>(&begin_hook);
  out[1] = reinterpret_cast<uint64_t>(&end_hook);
  out[2] = reinterpret_cast<uint64_t>(&release_hook);
#if defined(PINPOOL_WITH_FRONT)
  return 2;
#elif defined(PINPOOL_WITH_C10)
  return 1;
#else
  return 0;
#endif
}

#ifdef PINPOOL_WITH_FRONT
// Makes the allocator front PyTorch's CUDA allocator (what
// torch.cuda.memory.change_current_allocator does with a pluggable allocator): 0, or -1
// with the reason in `what` (`cap` bytes, NUL-terminated) when PyTorch refuses (its CUDA
// allocator already initialised).
int pinpool_shim_enable(char* what, size_t cap) {
  try {
    auto f = std::make_shared<Front>(
        [](size_t size, int device, cudaStream_t stream) {
          void* p = pinpool_shim_alloc(size, device, stream);
#ifdef PINPOOL_FRONT_SNAPSHOT
          call_sites.note(p);
#endif
          return p;
        },
        [](void* ptr, size_t size, int device, cudaStream_t stream) {
#ifdef PINPOOL_FRONT_SNAPSHOT
          call_sites.note_free(ptr);
#endif
          pinpool_shim_free(ptr, size, device, stream);
        });
    f->set_record_stream_fn([](void* ptr, cudaStream_t stream) { record_impl(ptr, stream); });
    f->set_reset_fn([] { empty_impl(); });
    f->set_memory_fraction_fn([](double fraction, int device) { fraction_impl(fraction, device); });
    f->set_begin_allocate_to_pool(begin_hook);
    f->set_end_allocate_to_pool_fn(end_hook);
    f->set_release_pool(release_hook);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(f);
    front = f;
    return 0;
  } catch (const std::exception& e) {
    if (cap > 0) {
      std::string msg = e.what();
      size_t n = msg.size() < cap - 1 ? msg.size() : cap - 1;
      msg.copy(what, n);
      what[n] = 0;
    }
    return -1;
  }
}
#endif
}

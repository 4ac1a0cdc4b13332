//! The exported C symbols (listed in `docs/torch.md`), each a thin adapter over the
//! crate's `abi` module and the process's plugin. Every symbol's whole body runs inside
//! [`entry`] (the thread's context kept, the plugin made or found, the call, the context put
//! back): no panic crosses the boundary, errors become null or -1 and a last-error string.
//! Without the `cuda` feature they exist too, and every call fails with
//! [`Error::DeviceUnavailable`] (and alloc returns null); `pinpool_cuda_support` says which
//! build this is.

use std::ffi::{c_char, c_int, c_void, CStr};

use pinpool::{Error, HistoryContext, TraceAction};

use crate::snapshot::{SegmentFn, TraceFn};

use crate::abi::{self, guarded};
use crate::call_times;
#[cfg(feature = "cuda")]
mod backend {
    pub(super) use crate::cuda::{block_on, plugin, pointer_device, KeepContext};
}

#[cfg(not(feature = "cuda"))]
mod backend {
    use pinpool::sim::SimRuntime;
    use pinpool::Error;

    use crate::plugin::Plugin;

    fn absent() -> Error {
        Error::DeviceUnavailable {
            message: "pinpool-torch was built without its `cuda` feature".to_string(),
        }
    }

    /// The tests make every call of this backend panic, to check that no panic leaves an
    /// entry point.
    #[cfg(test)]
    pub(crate) static PANIC: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);

    fn maybe_panic(what: &str) {
        #[cfg(test)]
        if PANIC.load(std::sync::atomic::Ordering::Relaxed) {
            panic!("injected panic in {what}");
        }
        let _ = what;
    }

    pub(super) fn plugin() -> Result<&'static Plugin<SimRuntime>, Error> {
        maybe_panic("plugin");
        Err(absent())
    }

    pub(super) fn block_on<T>(_: impl std::future::Future<Output = T>) -> Result<T, Error> {
        maybe_panic("block_on");
        Err(absent())
    }

    pub(super) fn pointer_device(_: *mut std::ffi::c_void) -> Result<i32, Error> {
        maybe_panic("pointer_device");
        Err(absent())
    }

    pub(super) struct KeepContext;

    impl KeepContext {
        pub(super) fn new() -> Self {
            maybe_panic("KeepContext::new");
            KeepContext
        }
    }
}

#[cfg(all(test, not(feature = "cuda")))]
pub(crate) use backend::PANIC;
use backend::{block_on, plugin, pointer_device, KeepContext};

/// Runs an entry point's body `f` under the C boundary's rules ([`abi::guarded`]), with the
/// calling thread's current context kept as it was.
fn entry<T: Copy, E: std::fmt::Display>(op: &str, fail: T, f: impl FnOnce() -> Result<T, E>) -> T {
    guarded(op, fail, || {
        let _keep = KeepContext::new();
        f()
    })
}

/// [`entry`] for a call that answers 0 on success and -1 on failure.
fn status<E: std::fmt::Display>(op: &str, f: impl FnOnce() -> Result<(), E>) -> c_int {
    entry(op, -1, || f().map(|()| 0))
}

/// `void* alloc(size_t size, int device, cudaStream_t stream)`: null for size 0 and on
/// failure (out of memory, no such device; the reason in `pinpool_last_error`, and whether
/// it was out of memory in `pinpool_last_error_is_oom`).
#[no_mangle]
pub extern "C" fn pinpool_alloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let stream = stream as usize;
    let p = entry("alloc", 0, || {
        call_times::ALLOC
            .time(|| plugin()?.alloc(size, device, stream))
            .inspect_err(|e| {
                if matches!(e, Error::OutOfMemory { .. }) {
                    abi::note_out_of_memory();
                }
            })
    });
    p as *mut c_void
}

/// 1 when the calling thread's last call failed for want of memory (a null from
/// `pinpool_alloc` that is an out-of-memory, not a missing device, a failed start or a
/// forked child), else 0.
#[no_mangle]
pub extern "C" fn pinpool_last_error_is_oom() -> c_int {
    c_int::from(abi::last_was_out_of_memory())
}

/// `void free(void* ptr, size_t size, int device, cudaStream_t stream)`: `stream` is the
/// allocation's. Freeing null does nothing; an unknown pointer is reported and ignored.
#[no_mangle]
pub extern "C" fn pinpool_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    let _ = size;
    let (ptr, stream) = (ptr as usize, stream as usize);
    entry("free", (), || {
        call_times::FREE.time(|| plugin()?.free(ptr, device, stream))
    })
}

/// `void record_stream(void* ptr, cudaStream_t stream)` (`Tensor.record_stream`). Null (an
/// empty tensor's storage) does nothing, as PyTorch's allocator does.
#[no_mangle]
pub extern "C" fn pinpool_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    entry("record_stream", (), || {
        if ptr.is_null() {
            return Ok(());
        }
        let device = pointer_device(ptr)?;
        plugin()?.record_stream(ptr as usize, device, stream as usize)
    })
}

/// `void empty_cache(void)`: what `torch.cuda.empty_cache()` calls.
#[no_mangle]
pub extern "C" fn pinpool_empty_cache() {
    status("empty_cache", || plugin()?.empty_cache());
}

/// `void memory_fraction(double fraction, int device)`.
#[no_mangle]
pub extern "C" fn pinpool_memory_fraction(fraction: f64, device: c_int) {
    status("memory_fraction", || {
        plugin()?.set_memory_fraction(fraction, device)
    });
}

/// `int enable_peer_access(int device, int peer)`: PyTorch's `enablePeerAccess`, made
/// before its first direct copy between two GPUs: `device` may access `peer`'s memory,
/// including what `peer`'s pools mapped before the call. 0, or -1 (no such device, no peer
/// path between the two, a driver failure).
#[no_mangle]
pub extern "C" fn pinpool_enable_peer_access(device: c_int, peer: c_int) -> c_int {
    status("enable_peer_access", || {
        plugin()?.enable_peer_access(device, peer)
    })
}

/// Makes the allocator now (it is otherwise made by the first call): 0, or -1 with the
/// reason in `pinpool_last_error`. A failed start is tried again by the next call.
#[no_mangle]
pub extern "C" fn pinpool_init() -> c_int {
    status("init", || plugin().map(drop))
}

/// 1 when the library was built with CUDA support (the `cuda` feature), 0 when every call
/// fails (a build for tests and tools).
#[no_mangle]
pub extern "C" fn pinpool_cuda_support() -> c_int {
    c_int::from(cfg!(feature = "cuda"))
}

/// The settings the allocator starts (or started) with, in `PINPOOL_DEVICE_CONF`'s form: the
/// plug-in's defaults with the variable's keys over them. Copied as `pinpool_memory_stats`
/// copies; -1 (the error, which names every valid key of an unknown one, stored) when the
/// variable is malformed. Starts nothing: it checks a setting before `enable`.
///
/// # Safety
///
/// `buf` is null or valid for writes of `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn pinpool_settings(buf: *mut c_char, cap: usize) -> i64 {
    entry("settings", -1, || {
        let env = match std::env::var(pinpool::config::DEVICE_ENV_VAR) {
            Ok(text) => Some(text),
            Err(std::env::VarError::NotPresent) => None,
            Err(e) => return Err(e.to_string()),
        };
        let config = crate::plugin::settings(env.as_deref()).map_err(|e| e.to_string())?;
        // SAFETY: this function's contract.
        Ok(unsafe { abi::copy_out(&config.to_string(), buf, cap) } as i64)
    })
}

/// How many devices the allocator serves (-1 on failure).
#[no_mangle]
pub extern "C" fn pinpool_device_count() -> c_int {
    entry("device_count", -1, || {
        Ok::<_, Error>(plugin()?.allocator().device_count() as c_int)
    })
}

/// Statistics of `device` as JSON with the keys of `torch.cuda.memory_stats()`, copied into
/// `buf` (`cap` bytes, NUL-terminated) if they fit; returns their length (retry with a larger
/// buffer when it is `cap` or more), or -1 on failure.
///
/// # Safety
///
/// `buf` is null or valid for writes of `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn pinpool_memory_stats(device: c_int, buf: *mut c_char, cap: usize) -> i64 {
    entry("memory_stats", -1, || {
        let json = plugin()?.memory_stats_json(device)?;
        // SAFETY: this function's contract.
        Ok::<_, Error>(unsafe { abi::copy_out(&json, buf, cap) } as i64)
    })
}

/// Fills `out[i]` with the statistic of `device` named `keys[i]` (the keys of
/// [`pinpool_memory_stats`]; 0 for one it does not have), for `i < n`: 0, or -1.
///
/// # Safety
///
/// `keys` holds `n` NUL-terminated strings and `out` is valid for writes of `n` values.
#[no_mangle]
pub unsafe extern "C" fn pinpool_stats_values(
    device: c_int,
    keys: *const *const c_char,
    n: usize,
    out: *mut i64,
) -> c_int {
    status("stats_values", || {
        if n == 0 {
            return Ok(());
        }
        if keys.is_null() || out.is_null() {
            return Err("null keys or values".to_string());
        }
        // SAFETY: this function's contract.
        let names = unsafe { std::slice::from_raw_parts(keys, n) };
        let names: Vec<&str> = names
            .iter()
            // SAFETY: this function's contract (a null entry is no key).
            .map(|&k| (!k.is_null()).then(|| unsafe { CStr::from_ptr(k) }))
            .map(|k| k.and_then(|k| k.to_str().ok()).unwrap_or(""))
            .collect();
        let values = plugin()
            .and_then(|p| p.stats_values(device, &names))
            .map_err(|e| e.to_string())?;
        // SAFETY: this function's contract.
        unsafe { std::slice::from_raw_parts_mut(out, n) }.copy_from_slice(&values);
        Ok(())
    })
}

/// The largest request `device` could serve now (PyTorch's `cacheInfo`, asked by cuDNN's
/// algorithm search), or -1 on failure.
#[no_mangle]
pub extern "C" fn pinpool_largest_block(device: c_int) -> i64 {
    entry("largest_block", -1, || {
        Ok::<_, Error>(plugin()?.largest_block(device)? as i64)
    })
}

/// Bytes the allocator holds of `device` (-1 on failure).
#[no_mangle]
pub extern "C" fn pinpool_reserved_bytes(device: c_int) -> i64 {
    entry("reserved_bytes", -1, || {
        Ok::<_, Error>(plugin()?.reserved_bytes(device)? as i64)
    })
}

/// Sets the peaks of `device`'s statistics to their current values: 0, or -1.
#[no_mangle]
pub extern "C" fn pinpool_reset_peak_stats(device: c_int) -> c_int {
    status("reset_peak_stats", || plugin()?.reset_peak_stats(device))
}

/// Zeroes `device`'s accumulated statistics: 0, or -1.
#[no_mangle]
pub extern "C" fn pinpool_reset_accumulated_stats(device: c_int) -> c_int {
    status("reset_accumulated_stats", || {
        plugin()?.reset_accumulated_stats(device)
    })
}

/// Turns the allocation history on (non-zero `enabled`, keeping `max_entries`) or off;
/// `context` 1 records each allocation's call site (a Rust backtrace), 2 also each free's,
/// 0 none; as PyTorch's `clear_history` and `skip_actions`, non-zero `clear` forgets the
/// entries recorded so far, and `skip` (null, or a comma-separated list of action names:
/// `alloc`, `free_requested`, ...) leaves those actions out of the history: 0, or -1 (an
/// unknown action is an error naming the valid ones; nothing changes).
///
/// # Safety
///
/// `skip` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pinpool_record_history(
    enabled: c_int,
    max_entries: usize,
    context: c_int,
    clear: c_int,
    skip: *const c_char,
) -> c_int {
    let context = match context {
        1 => HistoryContext::Alloc,
        2 => HistoryContext::All,
        _ => HistoryContext::None,
    };
    status("record_history", || {
        let skip = match skip.is_null() {
            true => String::new(),
            // SAFETY: this function's contract.
            false => unsafe { CStr::from_ptr(skip) }
                .to_string_lossy()
                .into_owned(),
        };
        let skip = skip
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::parse)
            .collect::<Result<Vec<TraceAction>, _>>()?;
        // `torch.cuda.memory._record_memory_history`.
        let alloc = plugin()?.allocator();
        alloc.record_history_with(enabled != 0, max_entries, context, clear != 0, &skip)
    })
}

/// The snapshot as PyTorch's allocator front answers `snapshot(mempool_id, include_traces)`:
/// calls `on_segment(ctx, ..)` for each segment of PyTorch pool `(pool_a, pool_b)` (every
/// segment for `(0, 0)`), then, where `traces` is non-zero, `on_trace(ctx, ..)` for each
/// device's trace entries, oldest first: 0, or -1. The records are valid during the call.
///
/// # Safety
///
/// The callbacks are safe to call with `ctx` from this thread, and do not unwind.
#[no_mangle]
pub unsafe extern "C" fn pinpool_snapshot(
    pool_a: u64,
    pool_b: u64,
    traces: c_int,
    ctx: *mut c_void,
    on_segment: Option<SegmentFn>,
    on_trace: Option<TraceFn>,
) -> c_int {
    status("snapshot", || {
        let plugin = plugin()?;
        let (snap, histories) = block_on(plugin.torch_snapshot(traces != 0))??;
        crate::snapshot::walk(
            &snap,
            &histories,
            (pool_a, pool_b),
            // SAFETY: this function's contract.
            |s| on_segment.map_or((), |f| unsafe { f(ctx, s) }),
            // SAFETY: as above.
            |t| on_trace.map_or((), |f| unsafe { f(ctx, t) }),
        );
        Ok::<_, Error>(())
    })
}

/// Writes the snapshot and histories to the file `path` in the pickle layout of
/// `torch.cuda.memory._dump_snapshot` (for `pytorch.org/memory_viz`): 0, or -1.
///
/// # Safety
///
/// `path` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pinpool_dump_snapshot(path: *const c_char) -> c_int {
    status("dump_snapshot", || {
        if path.is_null() {
            return Err("null path".to_string());
        }
        // SAFETY: this function's contract.
        let path = unsafe { CStr::from_ptr(path) }
            .to_str()
            .map_err(|e| format!("path is not UTF-8: {e}"))?
            .to_string();
        let plugin = plugin().map_err(|e| e.to_string())?;
        let bytes = block_on(plugin.pickle_snapshot())
            .and_then(|r| r)
            .map_err(|e| e.to_string())?;
        std::fs::write(&path, bytes).map_err(|e| format!("writing {path}: {e}"))
    })
}

/// A stream filter from C: `filter(ctx, stream)` answers non-zero for the streams whose
/// requests go to the pool; `drop_ctx(ctx)`, if not null, runs once the allocator no longer
/// needs the filter.
pub type FilterFn = unsafe extern "C" fn(ctx: *mut c_void, stream: *mut c_void) -> c_int;
/// Releases a filter's context.
pub type DropFn = unsafe extern "C" fn(ctx: *mut c_void);

struct ForeignFilter {
    call: FilterFn,
    ctx: *mut c_void,
    drop_ctx: Option<DropFn>,
}

// SAFETY: `pinpool_begin_allocate_to_pool`'s contract: the filter and its context may be
// called and released from any thread.
unsafe impl Send for ForeignFilter {}
// SAFETY: as above; the filter is called concurrently only through a shared reference.
unsafe impl Sync for ForeignFilter {}

impl ForeignFilter {
    fn accepts(&self, handle: usize) -> bool {
        // SAFETY: `pinpool_begin_allocate_to_pool`'s contract: `call` takes this context
        // and any stream handle, and does not unwind.
        unsafe { (self.call)(self.ctx, handle as *mut c_void) != 0 }
    }
}

impl Drop for ForeignFilter {
    fn drop(&mut self) {
        if let Some(d) = self.drop_ctx {
            // SAFETY: the contract: `drop_ctx` releases this context, once; nothing calls
            // the filter after this.
            unsafe { d(self.ctx) }
        }
    }
}

/// PyTorch's `beginAllocateToPool(device, (pool_a, pool_b), filter)`: 0, or -1.
///
/// # Safety
///
/// `filter` takes `ctx` and any stream handle from any thread and does not unwind;
/// `drop_ctx`, if not null, releases `ctx` once and is called at most once (also when the
/// call fails).
#[no_mangle]
pub unsafe extern "C" fn pinpool_begin_allocate_to_pool(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    filter: Option<FilterFn>,
    ctx: *mut c_void,
    drop_ctx: Option<DropFn>,
) -> c_int {
    status("begin_allocate_to_pool", || {
        let Some(call) = filter else {
            if let Some(d) = drop_ctx {
                // SAFETY: the contract above.
                unsafe { d(ctx) }
            }
            return Err(Error::NotSupported {
                operation: "begin_allocate_to_pool",
                reason: "a null stream filter: pass one that accepts the capturing stream"
                    .to_string(),
            });
        };
        let f = ForeignFilter {
            call,
            ctx,
            drop_ctx,
        };
        plugin()?.begin_allocate_to_pool(device, (pool_a, pool_b), move |h| f.accepts(h))
    })
}

/// PyTorch's `endAllocateToPool(device, (pool_a, pool_b))`: 0, or -1.
#[no_mangle]
pub extern "C" fn pinpool_end_allocate_to_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    status("end_allocate_to_pool", || {
        plugin()?.end_allocate_to_pool(device, (pool_a, pool_b))
    })
}

/// PyTorch's `releasePool(device, (pool_a, pool_b))`: 0, or -1.
#[no_mangle]
pub extern "C" fn pinpool_release_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    status("release_pool", || {
        plugin()?.release_pool(device, (pool_a, pool_b))
    })
}

/// The calling thread's last error, copied as `pinpool_memory_stats` copies; its length.
///
/// # Safety
///
/// `buf` is null or valid for writes of `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn pinpool_last_error(buf: *mut c_char, cap: usize) -> usize {
    // Not `entry`: a failure here must not become the last error. Nothing below panics but
    // a failed allocation of the copy, and that is caught all the same.
    std::panic::catch_unwind(|| {
        // SAFETY: this function's contract.
        unsafe { abi::copy_out(&abi::last_error(), buf, cap) }
    })
    .unwrap_or_else(|panic| {
        std::mem::forget(panic);
        0
    })
}

/// How many calls have failed in this process.
#[no_mangle]
pub extern "C" fn pinpool_failures() -> usize {
    abi::failures()
}

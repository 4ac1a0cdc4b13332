//! The CUDA side of the library: the process's one [`Plugin`] on the CUDA runtime, and
//! PyTorch's stream handles as cudarc streams.
//!
//! Owns the plugin (made at the first call that can make it, with a small tokio runtime of
//! its own for the allocator's actors: PyTorch's threads are in none), a retained primary
//! context per device used (PyTorch works in the primary contexts too; a device no call
//! names gets none), and each thread's cache of wrapped
//! stream handles. Every entry point keeps the calling thread's current context as it found
//! it ([`KeepContext`]): the allocator binds the contexts it needs, and PyTorch's current
//! device must not move under it.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use pinpool::config::DEVICE_ENV_VAR;
use pinpool::cuda::CudaRuntime;
use pinpool::{DeviceAllocator, Error, RuntimeError};

use crate::fork;
use crate::plugin::{self, Plugin, StreamMap, LEGACY_STREAM, PER_THREAD_STREAM};
use crate::start::Started;

/// The environment variable that, set to `1`, gives every GPU access to the memory the
/// others map (for every pair with a peer path), before any memory is taken. PyTorch enables
/// peer access for a copy between two GPUs behind an external allocator's back, and mapped
/// memory is reachable only by the devices its mapping names; without this, such a copy
/// fails with CUDA's invalid-argument error. Off by default: with it, every map call on a
/// host of several GPUs also sets the peers' access, which costs several times as much.
pub(crate) const PEER_ENV_VAR: &str = "PINPOOL_TORCH_PEER_ACCESS";

/// The plugin with the runtime its actors run on.
struct Backend {
    plugin: Plugin<CudaRuntime>,
    runtime: tokio::runtime::Runtime,
}

/// The process's backend, made at the first call that can make it (a failed start is tried
/// again at the next call).
static BACKEND: Started<Backend> = Started::new();

fn build() -> Result<Backend, Error> {
    // From here on, a forked child is told apart from this process.
    fork::arm();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pinpool-torch")
        .enable_all()
        .build()
        .map_err(|e| Error::DeviceUnavailable {
            message: format!("starting the allocator's threads: {e}"),
        })?;
    let invalid = |message: String| Error::InvalidConfig {
        message: format!("{DEVICE_ENV_VAR}: {message}"),
    };
    let env = match std::env::var(DEVICE_ENV_VAR) {
        Ok(text) => Some(text),
        Err(std::env::VarError::NotPresent) => None,
        Err(e) => return Err(invalid(e.to_string())),
    };
    let config = plugin::settings(env.as_deref()).map_err(|e| invalid(e.to_string()))?;
    // The runtime of the device the first call came from (PyTorch's current device): no
    // other device's context is retained until that device is used.
    let cuda = CudaRuntime::new(current_device()).map_err(Error::from)?;
    let alloc = DeviceAllocator::builder()
        .handle(runtime.handle().clone())
        .config(&config)
        .runtime(Arc::new(cuda))
        .build()?;
    if std::env::var_os(PEER_ENV_VAR).is_some_and(|v| v == "1") {
        let n = alloc.device_count();
        for (device, peer) in (0..n).flat_map(|d| (0..n).map(move |p| (d, p))) {
            match alloc.enable_peer_access(device, peer) {
                Ok(()) | Err(Error::PeerAccessUnsupported { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let streams = CudaStreams::new(alloc.device_count());
    Ok(Backend {
        plugin: Plugin::new(alloc, Arc::new(streams)),
        runtime,
    })
}

/// The device of the calling thread's current context (0 when it has none).
fn current_device() -> usize {
    if !driver_present() || result::ctx::get_current().ok().flatten().is_none() {
        return 0;
    }
    let mut device: sys::CUdevice = 0;
    // SAFETY: `device` is valid for the write; a context is current on this thread.
    let r = unsafe { sys::cuCtxGetDevice(&mut device) };
    match r {
        sys::CUresult::CUDA_SUCCESS => usize::try_from(device).unwrap_or(0),
        _ => 0,
    }
}

fn backend() -> Result<&'static Backend, Error> {
    BACKEND.get_or_start(build)
}

/// The process's plugin, made on first use.
pub(crate) fn plugin() -> Result<&'static Plugin<CudaRuntime>, Error> {
    backend().map(|b| &b.plugin)
}

/// Runs `f` to completion on the plugin's runtime (for the async calls, from a thread
/// outside any runtime).
pub(crate) fn block_on<T>(f: impl std::future::Future<Output = T>) -> Result<T, Error> {
    Ok(backend()?.runtime.block_on(f))
}

/// The device whose memory holds `ptr` (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`).
pub(crate) fn pointer_device(ptr: *mut c_void) -> Result<i32, Error> {
    plugin()?;
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: `ordinal` is a writable int, the size this attribute writes; the driver only
    // looks the address up.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut std::ffi::c_int).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr as sys::CUdeviceptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::UnknownPointer { ptr: ptr as u64 });
    }
    Ok(ordinal)
}

/// While alive, remembers the calling thread's current context, and makes it current again
/// when dropped if a call in between changed it.
pub(crate) struct KeepContext {
    previous: Option<sys::CUcontext>,
}

/// Whether the driver library can be loaded (asked once): without it, cudarc's calls panic.
fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` tries to `dlopen` the driver under its usual names, running
    // its initialisers: what loading the CUDA driver means.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

impl KeepContext {
    /// Remembers the current context (none without a driver, or before it is initialised).
    pub(crate) fn new() -> Self {
        Self {
            previous: if driver_present() {
                result::ctx::get_current().ok().flatten()
            } else {
                None
            },
        }
    }
}

impl Default for KeepContext {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepContext {
    fn drop(&mut self) {
        if !driver_present() {
            return;
        }
        let now = result::ctx::get_current().ok().flatten();
        if now != self.previous {
            let previous = self.previous.unwrap_or(std::ptr::null_mut());
            // SAFETY: `previous` was current on this thread when the guard was made, and
            // PyTorch keeps its primary contexts alive; a null context unbinds.
            let _ = unsafe { result::ctx::set_current(previous) };
        }
    }
}

/// Wrapped streams a thread keeps, at most (the cache is cleared when it is full).
const CACHED_STREAMS: usize = 64;

thread_local! {
    /// (device, handle) → the wrapped stream: an allocation for a stream seen before makes
    /// no `Arc`.
    static STREAMS: RefCell<Vec<(usize, usize, Arc<CudaStream>)>> = const { RefCell::new(Vec::new()) };
}

/// PyTorch's stream handles as borrowed cudarc streams of each device's primary context.
pub(crate) struct CudaStreams {
    contexts: Box<[OnceLock<Arc<CudaContext>>]>,
}

impl CudaStreams {
    fn new(devices: usize) -> Self {
        Self {
            contexts: (0..devices).map(|_| OnceLock::new()).collect(),
        }
    }

    fn context(&self, device: usize) -> Result<&Arc<CudaContext>, Error> {
        let slot = self.contexts.get(device).ok_or(Error::NoSuchDevice {
            ordinal: device,
            count: self.contexts.len(),
        })?;
        if let Some(ctx) = slot.get() {
            return Ok(ctx);
        }
        let ctx = CudaContext::new(device).map_err(|e| {
            Error::Runtime(RuntimeError::new(
                "cuDevicePrimaryCtxRetain",
                format!("{e:?}"),
            ))
        })?;
        // A racing thread may have set it first: either is the same primary context.
        Ok(slot.get_or_init(|| ctx))
    }
}

impl StreamMap<CudaRuntime> for CudaStreams {
    fn stream(&self, device: usize, handle: usize) -> Result<Arc<CudaStream>, Error> {
        // At thread exit the cache may be gone: the stream is then wrapped afresh.
        let cached = STREAMS
            .try_with(|c| {
                c.borrow()
                    .iter()
                    .find(|(d, h, _)| *d == device && *h == handle)
                    .map(|(_, _, s)| s.clone())
            })
            .ok()
            .flatten();
        if let Some(s) = cached {
            return Ok(s);
        }
        let ctx = self.context(device)?;
        let stream = match handle {
            LEGACY_STREAM => ctx.default_stream(),
            PER_THREAD_STREAM => ctx.per_thread_stream(),
            // SAFETY: PyTorch hands over streams of this device's primary context (the one
            // `ctx` holds), and keeps them alive while work on them may use the memory; the
            // wrapper never destroys the stream. Work is ordered by PyTorch's own calls.
            other => unsafe { ctx.wrap_borrowed_stream(other as sys::CUstream) },
        };
        let _ = STREAMS.try_with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= CACHED_STREAMS {
                c.clear();
            }
            c.push((device, handle, stream.clone()));
        });
        Ok(stream)
    }

    fn handle(&self, stream: &Arc<CudaStream>) -> usize {
        stream.cu_stream() as usize
    }
}

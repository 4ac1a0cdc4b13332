//! [`CudaRuntime`]: the [`Runtime`] trait on a real GPU, through cudarc's driver API.
//!
//! Owns the device's primary context (retained for the runtime's lifetime), the pinning
//! settings, and the per-context event pools. Keeps the trait's contract: host calls bind the
//! context and run in relaxed capture mode on the calling (blocking) thread; events are
//! recorded with `cuEventRecord` on the caller's thread, queried with `cuEventQuery`, and
//! pooled. It never calls CUDA from a host callback.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUresult, CUstreamCaptureStatus};
use cudarc::driver::{result, CudaContext, CudaStream, DriverError};

use super::context::{bind, KeepCurrent, RelaxedCaptureMode};
use super::error::{runtime_error, CudaInitError};
use super::events::{EventPools, PooledEvent};
use super::host::{self, RegisterLayout};
use super::vmm;
use crate::actors::RangeCall;
use crate::config::{Config, PinStrategy};
use crate::{MemoryKind, MemorySource, Origin, Region, Runtime, RuntimeError, StreamId};

/// Driver entry points the runtime uses. cudarc resolves each on first use and panics when
/// one is missing, so [`CudaRuntime::new`] checks them all up front.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuStreamIsCapturing",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuCtxSynchronize",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuDeviceCanAccessPeer",
    "cuCtxEnablePeerAccess",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
];

/// Whether a CUDA driver and at least one device are present. Never panics; the answer is
/// worked out once per process.
///
/// ```
/// if pinpool::cuda::cuda_available() {
///     let runtime = pinpool::cuda::CudaRuntime::new(0)?;
///     # let _ = runtime;
/// }
/// # Ok::<(), pinpool::cuda::CudaInitError>(())
/// ```
pub fn cuda_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| device_count().is_ok_and(|n| n > 0))
}

/// How many CUDA devices the driver reports; [`CudaInitError::NoDriver`] without a driver.
///
/// ```
/// match pinpool::cuda::device_count() {
///     Ok(count) => println!("{count} CUDA device(s)"),
///     Err(error) => println!("no CUDA: {error}"),
/// }
/// ```
pub fn device_count() -> Result<usize, CudaInitError> {
    load_driver()?;
    match result::init() {
        Ok(()) => {}
        Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => return Ok(0),
        Err(error) => return Err(CudaInitError::driver("cuInit", error)),
    }
    let count =
        result::device::get_count().map_err(|e| CudaInitError::driver("cuDeviceGetCount", e))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Checks that libcuda can be loaded and has every entry point the runtime calls, so that
/// no later call can make cudarc panic.
fn load_driver() -> Result<(), CudaInitError> {
    // SAFETY: `is_culib_present` tries to `dlopen` the driver library under its usual names,
    // running its initialisers; that is what loading the CUDA driver means.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaInitError::NoDriver);
    }
    // SAFETY: the library is present (checked just above), so `culib` loads it instead of
    // panicking.
    let lib = unsafe { sys::culib() };
    for symbol in REQUIRED_SYMBOLS {
        // SAFETY: the symbol is only looked up, not called; `*const ()` makes no claim about
        // its signature.
        if unsafe { lib.get::<*const ()>(symbol.as_bytes()) }.is_err() {
            return Err(CudaInitError::UnsupportedDriver { symbol });
        }
    }
    Ok(())
}

/// The real CUDA runtime: pinned host memory, events and capture state for one device,
/// through the CUDA driver API (loaded at run time, so the crate builds without CUDA).
///
/// Host memory is pinned with [`PinStrategy::HostAlloc`] (`cuMemHostAlloc`, portable) or
/// [`PinStrategy::Register`] (`mmap` + pre-fault + `cuMemHostRegister`, portable) as the
/// [`Config`] says; either is usable from every device's streams. Events are pooled per
/// context and created in the context of the stream they are recorded on.
///
/// ```no_run
/// use pinpool::{config::Config, cuda::CudaRuntime, Runtime};
///
/// let runtime = CudaRuntime::with_config(0, Config::from_env()?)?;
/// let memory = runtime.host_alloc(1 << 20)?;
/// let stream = runtime.context().new_stream()?;
/// let event = runtime.record_event(&stream)?;
/// stream.synchronize()?;
/// assert!(runtime.query_event(&event)?);
/// runtime.release_event(event);
/// runtime.host_free(memory)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaRuntime {
    ctx: Arc<CudaContext>,
    config: Config,
    layout: RegisterLayout,
    events: EventPools,
    /// The granule of expandable host memory, when the driver has it.
    vmm_granule: Option<usize>,
    /// Which devices may access each device's mapped memory (see
    /// [`crate::DeviceAllocator::enable_peer_access`]).
    mapped_access: Arc<crate::device::MappedAccess>,
}

impl std::fmt::Debug for CudaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaRuntime")
            .field("ordinal", &self.ctx.ordinal())
            .field("config", &self.config)
            .field("register_page", &self.layout.page)
            .finish_non_exhaustive()
    }
}

impl CudaRuntime {
    /// The runtime for device `ordinal` with the default [`Config`] (not read from the
    /// environment; see [`CudaRuntime::with_config`] and [`Config::from_env`]).
    ///
    /// Never panics: no driver, no such device and driver failures are [`CudaInitError`]s.
    pub fn new(ordinal: usize) -> Result<Self, CudaInitError> {
        Self::with_config(ordinal, Config::default())
    }

    /// The runtime for device `ordinal` with `config`.
    pub fn with_config(ordinal: usize, config: Config) -> Result<Self, CudaInitError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaInitError::NoSuchDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| CudaInitError::driver("CudaContext::new", e))?;
        let layout = RegisterLayout::new(config.huge_pages, config.prefault_threads);
        let device = ctx.ordinal() as std::ffi::c_int;
        let vmm_granule = bind(&ctx)
            .ok()
            .and_then(|()| vmm::granularity(vmm::Location::Host { device }));
        Ok(Self {
            ctx,
            config,
            layout,
            events: EventPools::new(),
            vmm_granule,
            mapped_access: Arc::new(crate::device::MappedAccess::new(count)),
        })
    }

    /// The grants of access to each device's mapped memory, and its mapped spans.
    pub(crate) fn mapped_access(&self) -> Arc<crate::device::MappedAccess> {
        self.mapped_access.clone()
    }

    /// A new non-blocking stream on this runtime's device (the call that makes a stream on
    /// every runtime: [`crate::sim::SimRuntime::new_stream`] on the sim).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, RuntimeError> {
        self.context()
            .new_stream()
            .map_err(|e| super::error::runtime_error("cuStreamCreate", e))
    }

    /// The device's primary context, e.g. to make streams with.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The configuration the runtime was made with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The granule `register` allocations of at least one huge page are rounded to (the huge
    /// page size when huge pages are on, else the base page size); smaller ones use base pages.
    pub fn register_granule(&self) -> usize {
        self.layout.page
    }

    /// Gets `size` bytes of pinned memory the way `strategy` says, whatever the
    /// configuration. [`CudaRuntime::host_alloc`] is this with the configured strategy.
    pub fn host_alloc_with(
        &self,
        size: usize,
        strategy: PinStrategy,
    ) -> Result<Region, RuntimeError> {
        let op = match strategy {
            PinStrategy::HostAlloc => "cuMemHostAlloc",
            PinStrategy::Register => "cuMemHostRegister",
        };
        if size == 0 {
            return Err(RuntimeError::new(op, "cannot pin 0 bytes"));
        }
        bind(&self.ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        let _relaxed = RelaxedCaptureMode::enter()
            .map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))?;
        match strategy {
            PinStrategy::HostAlloc => host::alloc_host(size),
            PinStrategy::Register => host::alloc_registered(size, &self.layout),
        }
    }

    /// The granule of expandable host memory, with the context bound.
    fn vmm_call(&self, op: &'static str) -> Result<usize, RuntimeError> {
        let granule = self
            .vmm_granule
            .ok_or_else(|| RuntimeError::new(op, "expandable host memory is not supported"))?;
        bind(&self.ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        Ok(granule)
    }

    /// [`Self::vmm_call`] for whole granules of a reserved range.
    fn vmm_range(
        &self,
        op: &'static str,
        range: &Region,
        offset: usize,
        size: usize,
    ) -> Result<usize, RuntimeError> {
        vmm::whole_granules(op, range, offset, size, self.vmm_call(op)?, Origin::Mapped)
    }

    /// Idle events held in the pools (all contexts).
    pub fn idle_events(&self) -> usize {
        self.events.idle()
    }
}

/// Pinned host memory: the runtime's own calls.
impl CudaRuntime {
    /// Gets `size` bytes of pinned memory the configured way (`pin_method`).
    pub fn host_alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        self.host_alloc_with(size, self.config.pin_method)
    }

    /// Gives back pinned memory from `host_alloc` or `host_alloc_with`.
    pub fn host_free(&self, memory: Region) -> Result<(), RuntimeError> {
        if memory.method == Origin::Simulated {
            return Err(RuntimeError::new(
                "host_free",
                "simulated memory was not allocated by the CUDA runtime",
            ));
        }
        bind(&self.ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        let _relaxed = RelaxedCaptureMode::enter()
            .map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))?;
        // SAFETY: the engine hands back each `Region` it got from `host_alloc` exactly
        // once, when nothing uses it any more, with the `method` and `size` it was given.
        unsafe { host::free(memory) }
    }

    /// The granule of expandable host memory, where the driver can map host memory
    /// (CUDA 12.2 and later).
    pub fn host_granularity(&self) -> Option<usize> {
        self.vmm_granule
    }

    /// Reserves an address range for expandable host memory.
    pub(crate) fn host_reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        let granule = self.vmm_call("cuMemAddressReserve")?;
        vmm::reserve(size, granule, Origin::Mapped)
    }

    /// Maps pinned granules into a reserved range.
    pub(crate) fn host_map(
        &self,
        range: &Region,
        offset: usize,
        size: usize,
    ) -> Result<(), RuntimeError> {
        let granule = self.vmm_range("cuMemMap", range, offset, size)?;
        let _relaxed = RelaxedCaptureMode::enter()
            .map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))?;
        let device = self.ctx.ordinal() as std::ffi::c_int;
        // SAFETY: the engine maps only whole, unmapped granules of a range it reserved here
        // (checked for shape above).
        unsafe {
            vmm::map(
                range,
                offset,
                size,
                granule,
                vmm::Location::Host { device },
                None,
            )
        }
    }

    /// Unmaps granules of a reserved range and gives their memory back.
    pub(crate) fn host_unmap(
        &self,
        range: &Region,
        offset: usize,
        size: usize,
    ) -> Result<(), RuntimeError> {
        let granule = self.vmm_range("cuMemUnmap", range, offset, size)?;
        let _relaxed = RelaxedCaptureMode::enter()
            .map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))?;
        // SAFETY: the engine unmaps only granules it mapped, once no block touches them.
        unsafe { vmm::unmap(range, offset, size, granule) }
    }

    /// Moves the pinned memory of the granule mapped at `from` of a reserved range to the
    /// unmapped granule at `to`, without pinning memory again (see `RangeCall::Move`).
    pub(crate) fn host_remap(
        &self,
        range: &Region,
        from: usize,
        to: usize,
    ) -> Result<(), RuntimeError> {
        let granule = self.vmm_call("cuMemMap")?;
        for at in [from, to] {
            vmm::whole_granules("cuMemMap", range, at, granule, granule, Origin::Mapped)?;
        }
        let _relaxed = RelaxedCaptureMode::enter()
            .map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))?;
        let device = self.ctx.ordinal() as std::ffi::c_int;
        // SAFETY: both granules are whole granules of a range reserved here (checked above);
        // the engine moves only a granule it mapped and no block touches, to one unmapped.
        unsafe { vmm::remap(range, from, to, granule, vmm::Location::Host { device }) }
    }

    /// Gives back a reserved range, none of it mapped.
    pub(crate) fn host_unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        self.vmm_range("cuMemAddressFree", &range, 0, 0)?;
        // SAFETY: the engine gives back a range it reserved here once nothing is mapped.
        unsafe { vmm::unreserve(range) }
    }
}

// The allocators\' side of the runtime: hidden from the runtime\'s page, whose users call the
// runtime\'s own methods.
#[doc(hidden)]
impl MemorySource for CudaRuntime {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Pinned
    }

    fn alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        let _keep = KeepCurrent::new();
        self.host_alloc(size)
    }

    fn free(&self, region: Region) -> Result<(), RuntimeError> {
        let _keep = KeepCurrent::new();
        self.host_free(region)
    }

    fn granularity(&self) -> Option<usize> {
        self.host_granularity()
    }

    fn reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        let _keep = KeepCurrent::new();
        self.host_reserve(size)
    }

    fn range_call(&self, range: &Region, call: RangeCall) -> Result<(), RuntimeError> {
        let _keep = KeepCurrent::new();
        call.by_granules(
            self.host_granularity(),
            |at, len| self.host_map(range, at, len),
            |at, len| self.host_unmap(range, at, len),
            |from, to| self.host_remap(range, from, to),
        )
    }

    fn remaps(&self) -> bool {
        self.host_granularity().is_some()
    }

    fn unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        let _keep = KeepCurrent::new();
        self.host_unreserve(range)
    }
}

/// The calling thread in relaxed capture mode for a query of a stream or an event that is
/// not captured: under a capture in global mode (any thread's) the driver refuses such a query
/// otherwise, and the refusal invalidates the capture (measured:
/// `gpu_tests::asking_an_idle_stream_during_a_global_capture_leaves_the_capture_valid`).
fn relaxed() -> Result<RelaxedCaptureMode, RuntimeError> {
    RelaxedCaptureMode::enter().map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))
}

impl Runtime for CudaRuntime {
    type Stream = Arc<CudaStream>;
    type Event = PooledEvent;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn new_stream(&self) -> Result<Arc<CudaStream>, RuntimeError> {
        CudaRuntime::new_stream(self)
    }

    fn stream_id(&self, stream: &Self::Stream) -> StreamId {
        stream_id(stream)
    }

    fn is_capturing(&self, stream: &Self::Stream) -> Result<bool, RuntimeError> {
        bind(stream.context()).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        // SAFETY: the `Arc<CudaStream>` keeps the stream (and its context) alive for the call.
        match unsafe { result::stream::is_capturing(stream.cu_stream()) } {
            Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => Ok(false),
            // An invalidated capture is still a capture: its events must not be queried.
            Ok(_) => Ok(true),
            // The legacy default stream while another stream captures in global mode.
            Err(DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)) => Ok(true),
            Err(error) => Err(runtime_error("cuStreamIsCapturing", error)),
        }
    }

    fn record_event(&self, stream: &Self::Stream) -> Result<Self::Event, RuntimeError> {
        self.record_event_reusing(stream, None)
    }

    fn record_event_reusing(
        &self,
        stream: &Self::Stream,
        spare: Option<Self::Event>,
    ) -> Result<Self::Event, RuntimeError> {
        let ctx = stream.context();
        bind(ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        let event = match spare {
            // An event can be recorded only on streams of its own context.
            Some(event) if event.context().cu_ctx() == ctx.cu_ctx() => event,
            other => {
                drop(other); // back to its context's free list
                self.events
                    .for_context(ctx)
                    .take()
                    .map_err(|e| runtime_error("cuEventCreate", e))?
            }
        };
        // SAFETY: the event belongs to the stream's context (a spare of another context went
        // back above; a new one comes from the pool keyed by it), and the `Arc<CudaStream>`
        // keeps the stream alive for the call.
        unsafe { result::event::record(event.cu_event(), stream.cu_stream()) }
            .map_err(|e| runtime_error("cuEventRecord", e))?;
        Ok(event)
    }

    fn stream_idle(&self, stream: &Self::Stream) -> Result<bool, RuntimeError> {
        bind(stream.context()).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        let _relaxed = relaxed()?;
        // SAFETY: the `Arc<CudaStream>` keeps the stream (and its context) alive for the call.
        match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            error => Err(runtime_error("cuStreamQuery", DriverError(error))),
        }
    }

    fn stream_wait_event(
        &self,
        stream: &Self::Stream,
        event: &Self::Event,
    ) -> Result<(), RuntimeError> {
        bind(stream.context()).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        // SAFETY: the `Arc<CudaStream>` keeps the stream alive and `event` is a live event
        // owned by its `PooledEvent`; the driver orders the stream's later work after it.
        let r = unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), event.cu_event(), 0) };
        match r {
            CUresult::CUDA_SUCCESS => Ok(()),
            error => Err(runtime_error("cuStreamWaitEvent", DriverError(error))),
        }
    }

    fn query_event(&self, event: &Self::Event) -> Result<bool, RuntimeError> {
        let _relaxed = relaxed()?;
        // SAFETY: `event` is a live event owned by its `PooledEvent`.
        match unsafe { result::event::query(event.cu_event()) } {
            Ok(()) => Ok(true),
            Err(DriverError(CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(error) => Err(runtime_error("cuEventQuery", error)),
        }
    }

    fn release_event(&self, event: Self::Event) {
        drop(event); // back to its context's free list
    }
}

/// A stream's identity: its handle for created streams. The handles of the legacy default
/// stream (0), `CU_STREAM_LEGACY` (1) and `CU_STREAM_PER_THREAD` (2) are the same in every
/// context, so for those the context's address is mixed in, with the top bit set: user-space
/// addresses never have it set, so these ids cannot equal a created stream's.
///
/// ```no_run
/// let runtime = pinpool::cuda::CudaRuntime::new(0)?;
/// let ctx = runtime.context();
/// let (default, created) = (ctx.default_stream(), ctx.new_stream()?);
/// assert_ne!(pinpool::cuda::stream_id(&default), pinpool::cuda::stream_id(&created));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn stream_id(stream: &CudaStream) -> StreamId {
    let handle = stream.cu_stream() as usize as u64;
    if handle > 2 {
        StreamId(handle)
    } else {
        let ctx = stream.context().cu_ctx() as usize as u64;
        StreamId((1 << 63) | (ctx << 2) | handle)
    }
}

//! Device memory on a real GPU: [`CudaDeviceMemory`], the memory source of one device for
//! the device allocator, and [`DeviceRuntime`] for [`CudaRuntime`] (its devices, and which
//! device a stream runs on).
//!
//! Owns a retained primary context per device memory source. Memory comes two ways, as the
//! size policy asks: whole segments from `cuMemAlloc` / `cuMemFree`, or runs mapped into one
//! reserved device address range per pool with CUDA's virtual memory calls (`cuMemCreate`
//! and `cuMemMap` for a whole run at once, `cuMemSetAccess` for this device; a run is
//! unmapped whole, so `unmaps_granules` is false, and can be moved whole to another place of
//! its range with `RangeCall::Move`, its handle mapped again). Memory goes back, or moves, only
//! after the device
//! is synchronised: a block freed on its own stream is reusable by that stream at once, but
//! work queued on it may still run. Every call binds the device's context
//! and runs in relaxed capture mode on the calling (blocking) thread, so that it neither
//! fails nor breaks a capture underway on another thread (invariant 6 keeps these calls off
//! the cached path).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use super::context::{bind, KeepCurrent, RelaxedCaptureMode};
use super::error::runtime_error;
use super::ipc;
use super::runtime::{device_count, stream_id, CudaRuntime};
use super::vmm::{self, Location};
use crate::actors::RangeCall;
use crate::device::{
    DeviceBuffer, DeviceBuilder, DeviceOps, DeviceRuntime, IpcExport, MappedAccess,
    IPC_HANDLE_BYTES,
};
#[cfg(target_os = "linux")]
use crate::device::{DeviceCopy, IpcHandle, IpcMappedExport};
use crate::{Error, MemoryKind, MemorySource, Origin, Region, RuntimeError};

/// The memory of one CUDA device, as the device allocator's memory source (`cuMemAlloc`,
/// `cuMemFree`, and the virtual memory calls where the driver has them).
pub(crate) struct CudaDeviceMemory {
    ctx: Arc<CudaContext>,
    /// The granule of the device's mapped memory, where the driver has the virtual memory
    /// calls.
    granule: Option<usize>,
    /// Whether mapped memory is created exportable as a POSIX file descriptor (for
    /// `ipc_handle`): probed once here, cleared if `cuMemCreate` refuses it.
    shareable: AtomicBool,
    /// The devices given access to this device's memory (peer access enabled for them), and
    /// the spans mapped here: what is mapped, before or after a grant, is accessible to
    /// them too, as `cuMemAlloc`'s memory is.
    access: Arc<MappedAccess>,
}

impl std::fmt::Debug for CudaDeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDeviceMemory")
            .field("device", &self.ctx.ordinal())
            .field("granule", &self.granule)
            .field("shareable", &self.shareable.load(Ordering::Relaxed))
            .finish()
    }
}

impl CudaDeviceMemory {
    /// The memory of the device whose (primary) context is `ctx`.
    pub(crate) fn new(ctx: Arc<CudaContext>, access: Arc<MappedAccess>) -> Self {
        let _keep = KeepCurrent::new();
        let location = Location::device(ctx.ordinal() as std::ffi::c_int);
        let granule = bind(&ctx).ok().and_then(|()| vmm::granularity(location));
        let shareable = granule.is_some() && vmm::fd_handles_supported(ctx.cu_device());
        Self {
            access,
            ctx,
            granule,
            shareable: AtomicBool::new(shareable),
        }
    }

    /// This device's mapped memory, open to no peer.
    fn closed(&self) -> Location {
        Location::device(self.ctx.ordinal() as std::ffi::c_int)
    }

    /// This device's mapped memory, open to the devices granted access to it so far.
    fn location(&self) -> Location {
        Location::Device {
            device: self.ctx.ordinal() as std::ffi::c_int,
            peers: self.access.granted(self.ctx.ordinal()),
        }
    }

    /// Notes `[offset, offset + len)` of `range`, just mapped open to what `location`
    /// named, opening it to the peers granted since (see `MappedAccess`).
    fn note_mapped(&self, range: &Region, offset: usize, len: usize, location: Location) {
        let Location::Device { device, peers } = location else {
            return;
        };
        let at = range.addr() + offset;
        self.access
            .mapped(device as usize, at, len, peers, |granted| {
                let peers = Location::Device {
                    device,
                    peers: granted,
                };
                vmm::set_access(at as sys::CUdeviceptr, len, peers)
            });
    }

    /// Forgets `[offset, offset + len)` of `range` as mapped: called before it is unmapped.
    fn note_unmapped(&self, range: &Region, offset: usize, len: usize) {
        self.access
            .unmapped(self.ctx.ordinal(), range.addr() + offset, len);
    }

    /// Binds the device's context and relaxes the thread's capture mode for one call.
    fn enter(&self) -> Result<RelaxedCaptureMode, RuntimeError> {
        bind(&self.ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        RelaxedCaptureMode::enter()
            .map_err(|e| runtime_error("cuThreadExchangeStreamCaptureMode", e))
    }

    /// Waits for all work queued on the device (with the context bound). A block freed on
    /// its own stream is reusable by that stream at once, but its memory may go back to the
    /// driver only once the work queued on it has run: `cuMemFree` would wait by itself, and
    /// `cuMemUnmap` does not (PyTorch synchronises before it, too).
    fn synchronize(&self, op: &'static str) -> Result<(), RuntimeError> {
        result::ctx::synchronize().map_err(|e| runtime_error(op, e))
    }

    /// The granule, or why `op` cannot map memory here.
    fn granule(&self, op: &'static str) -> Result<usize, RuntimeError> {
        self.granule
            .ok_or_else(|| RuntimeError::new(op, "this device cannot map memory"))
    }

    /// The granule, after checking that `[offset, offset + size)` is whole granules of a
    /// range this device reserved.
    fn granules_of(
        &self,
        op: &'static str,
        range: &Region,
        offset: usize,
        size: usize,
    ) -> Result<usize, RuntimeError> {
        vmm::whole_granules(
            op,
            range,
            offset,
            size,
            self.granule(op)?,
            Origin::DeviceMapped,
        )
    }
}

/// The calls on a reserved range (`RangeCall`), each checking its granules, with the
/// device's context bound and the thread's capture mode relaxed.
impl CudaDeviceMemory {
    /// `RangeCall::Map`: one mapping per unit, access granted once for the span (a range
    /// of whole mappings): one driver call instead of one per unit.
    fn map_units(
        &self,
        r: &Region,
        offset: usize,
        size: usize,
        unit: usize,
    ) -> Result<(), RuntimeError> {
        self.granules_of("cuMemMap", r, offset, size)?;
        self.granules_of("cuMemMap", r, offset, unit)?;
        if unit == 0 || size % unit != 0 {
            let what = format!("{size} bytes are not whole units of {unit}");
            return Err(RuntimeError::new("cuMemMap", what));
        }
        let _relaxed = self.enter()?;
        let location = self.location();
        // SAFETY: the engine maps only whole, unmapped granules of a range reserved here
        // (checked for shape above), one mapping per unit.
        unsafe { vmm::map(r, offset, size, unit, location, Some(&self.shareable)) }?;
        self.note_mapped(r, offset, size, location);
        Ok(())
    }

    /// `RangeCall::Unmap` (`wait`), `UnmapUnused` and `Unalias`: ends exactly one mapping
    /// (a unit of a map call, or what an alias left behind), after the device's queued work
    /// where `wait` says so.
    fn unmap_run(&self, r: &Region, at: usize, len: usize, wait: bool) -> Result<(), RuntimeError> {
        self.granules_of("cuMemUnmap", r, at, len)?;
        let _relaxed = self.enter()?;
        if wait {
            self.synchronize("cuMemUnmap")?;
        }
        self.note_unmapped(r, at, len);
        // SAFETY: the engine ends exactly one mapping made here, once no block touches it
        // and no queued work uses it any more: synchronised just above, or the caller knows
        // (no work used it since it was mapped, or an event it recorded completed). An alias
        // ends with its handle still mapped where the memory moved to.
        unsafe { vmm::unmap(r, at, len, len) }
    }

    /// `RangeCall::Move`: the memory leaves `from` once the device's queued work has run.
    fn move_run(&self, r: &Region, from: usize, to: usize, len: usize) -> Result<(), RuntimeError> {
        self.granules_of("cuMemMap", r, from, len)?;
        self.granules_of("cuMemMap", r, to, len)?;
        let _relaxed = self.enter()?;
        self.synchronize("cuMemUnmap")?;
        let location = self.location();
        self.note_unmapped(r, from, len);
        // SAFETY: the engine moves exactly one mapping made here (one handle of `len` bytes),
        // once no block touches it and its queued work has run (synchronised just above), to
        // whole unmapped granules of the same reserved range (shapes checked above).
        let moved = unsafe { vmm::remap(r, from, to, len, location) };
        // Where it stayed, it is noted again as open to no peer: noting opens it to all.
        let (at, location) = match moved {
            Ok(()) => (to, location),
            Err(_) => (from, self.closed()),
        };
        self.note_mapped(r, at, len, location);
        moved
    }

    /// `RangeCall::Alias`: the memory at `from` mapped at `to` too; `from` stays mapped.
    fn alias_run(
        &self,
        r: &Region,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), RuntimeError> {
        self.granules_of("cuMemMap", r, from, len)?;
        self.granules_of("cuMemMap", r, to, len)?;
        let _relaxed = self.enter()?;
        let location = self.location();
        // SAFETY: the engine aliases exactly one mapping made here (one handle of `len`
        // bytes) to whole unmapped granules of the same reserved range (shapes checked).
        unsafe { vmm::alias(r, from, to, len, location) }?;
        self.note_mapped(r, to, len, location);
        Ok(())
    }
}

impl MemorySource for CudaDeviceMemory {
    fn kind(&self) -> MemoryKind {
        MemoryKind::Device(self.ctx.ordinal())
    }

    fn alloc(&self, size: usize) -> Result<Region, RuntimeError> {
        let _keep = KeepCurrent::new();
        if size == 0 {
            return Err(RuntimeError::new("cuMemAlloc", "cannot allocate 0 bytes"));
        }
        let _relaxed = self.enter()?;
        // SAFETY: the device's context is current; the memory is only handed out as a
        // region, and freed once through `free`.
        let ptr =
            unsafe { result::malloc_sync(size) }.map_err(|e| runtime_error("cuMemAlloc", e))?;
        let ptr = NonNull::new(ptr as usize as *mut u8)
            .ok_or_else(|| RuntimeError::new("cuMemAlloc", "returned a null address"))?;
        Ok(Region {
            ptr,
            size,
            method: Origin::Device,
        })
    }

    fn free(&self, region: Region) -> Result<(), RuntimeError> {
        let _keep = KeepCurrent::new();
        if region.method != Origin::Device {
            return Err(RuntimeError::new(
                "cuMemFree",
                format!(
                    "memory obtained as {} is not freed with cuMemFree",
                    region.method
                ),
            ));
        }
        let _relaxed = self.enter()?;
        self.synchronize("cuMemFree")?;
        // SAFETY: the engine gives back each region it got from `alloc` exactly once, when
        // no work uses it any more (the device was synchronised just above).
        unsafe { result::free_sync(region.addr() as u64) }
            .map_err(|e| runtime_error("cuMemFree", e))
    }

    fn granularity(&self) -> Option<usize> {
        self.granule
    }

    fn reserve(&self, size: usize) -> Result<Region, RuntimeError> {
        let _keep = KeepCurrent::new();
        let granule = self.granule("cuMemAddressReserve")?;
        bind(&self.ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        vmm::reserve(size, granule, Origin::DeviceMapped)
    }

    fn range_call(&self, range: &Region, call: RangeCall) -> Result<(), RuntimeError> {
        let _keep = KeepCurrent::new();
        match call {
            RangeCall::Map { offset, len, unit } => self.map_units(range, offset, len, unit),
            RangeCall::Unmap { at, len } => self.unmap_run(range, at, len, true),
            RangeCall::UnmapUnused { at, len } => self.unmap_run(range, at, len, false),
            RangeCall::Move { from, to, len } => self.move_run(range, from, to, len),
            RangeCall::Alias { from, to, len } => self.alias_run(range, from, to, len),
            RangeCall::Unalias { at, len, wait } => self.unmap_run(range, at, len, wait),
        }
    }

    fn unmaps_granules(&self) -> bool {
        false
    }

    fn remaps(&self) -> bool {
        true
    }

    fn aliases(&self) -> bool {
        true
    }

    fn free_bytes(&self) -> Option<usize> {
        bind(&self.ctx).ok()?;
        result::mem_get_info().ok().map(|(free, _)| free)
    }

    fn unreserve(&self, range: Region) -> Result<(), RuntimeError> {
        let _keep = KeepCurrent::new();
        self.granules_of("cuMemAddressFree", &range, 0, 0)?;
        bind(&self.ctx).map_err(|e| runtime_error("cuCtxSetCurrent", e))?;
        // SAFETY: the engine gives back a range it reserved here once nothing is mapped.
        unsafe { vmm::unreserve(range) }
    }
}

impl CudaRuntime {
    /// The context of device `device`: the runtime's own, or that device's primary context.
    fn device_context(&self, device: usize) -> Result<Arc<CudaContext>, Error> {
        let count = DeviceOps::device_count(self);
        if device >= count {
            return Err(Error::NoSuchDevice {
                ordinal: device,
                count,
            });
        }
        if device == self.ordinal() {
            return Ok(self.context().clone());
        }
        CudaContext::new(device).map_err(|e| Error::Runtime(runtime_error("CudaContext::new", e)))
    }
}

/// The driver's devices, for [`DeviceAllocator`](crate::DeviceAllocator) on the GPU.
impl DeviceOps for CudaRuntime {
    fn device_count(&self) -> usize {
        device_count().unwrap_or(0)
    }

    fn device_memory(&self, device: usize) -> Result<Arc<dyn MemorySource>, Error> {
        let memory: Arc<dyn MemorySource> = Arc::new(CudaDeviceMemory::new(
            self.device_context(device)?,
            self.mapped_access(),
        ));
        Ok(memory)
    }

    fn stream_device(&self, stream: &Self::Stream) -> usize {
        stream.context().ordinal()
    }

    fn device_memory_info(&self, device: usize) -> Result<(usize, usize), Error> {
        let ctx = self.device_context(device)?;
        let _keep = KeepCurrent::new();
        bind(&ctx).map_err(|e| Error::Runtime(runtime_error("cuCtxSetCurrent", e)))?;
        result::mem_get_info().map_err(|e| Error::Runtime(runtime_error("cuMemGetInfo", e)))
    }

    fn ipc_export(&self, device: usize, ptr: u64) -> Result<IpcExport, Error> {
        ipc::export(&self.device_context(device)?, ptr)
    }

    fn ipc_open(
        &self,
        device: usize,
        handle: &[u8; IPC_HANDLE_BYTES],
    ) -> Result<(u64, usize), Error> {
        ipc::open(&self.device_context(device)?, handle)
    }

    unsafe fn ipc_close(&self, device: usize, base: u64) -> Result<(), Error> {
        ipc::close(&self.device_context(device)?, base)
    }

    #[cfg(target_os = "linux")]
    fn ipc_export_mapped(
        &self,
        device: usize,
        ptr: u64,
        len: usize,
    ) -> Result<IpcMappedExport, Error> {
        ipc::export_mapped(&self.device_context(device)?, ptr, len)
    }

    #[cfg(target_os = "linux")]
    fn ipc_open_mapped(&self, device: usize, handle: &IpcHandle) -> Result<(u64, usize), Error> {
        ipc::open_mapped(&self.device_context(device)?, handle)
    }

    #[cfg(target_os = "linux")]
    unsafe fn ipc_close_mapped(
        &self,
        device: usize,
        base: u64,
        handle: &IpcHandle,
    ) -> Result<(), Error> {
        // SAFETY: this function's contract: `base` is an open of `handle` nothing uses.
        unsafe { ipc::close_mapped(&self.device_context(device)?, base, handle) }
    }

    fn enable_peer_access(&self, device: usize, peer: usize) -> Result<(), Error> {
        let owner = self.device_context(peer)?;
        ipc::enable_peer(&self.device_context(device)?, &owner)?;
        // Memory `peer` mapped before this call is opened to `device` too.
        let _keep = KeepCurrent::new();
        bind(&owner).map_err(|e| Error::Runtime(runtime_error("cuCtxSetCurrent", e)))?;
        let on = owner.ordinal() as std::ffi::c_int;
        self.mapped_access()
            .grant(peer, device, |at, len, peers| {
                let location = Location::Device { device: on, peers };
                vmm::set_access(at as sys::CUdeviceptr, len, location)
            })
            .map_err(Error::Runtime)
    }

    unsafe fn copy_device_async(
        &self,
        stream: &Self::Stream,
        copy: DeviceCopy,
    ) -> Result<(), Error> {
        let (dst_ctx, src_ctx) = (
            self.device_context(copy.dst_device)?,
            self.device_context(copy.src_device)?,
        );
        // SAFETY: this function's contract: both ranges lie in device memory that stays
        // allocated and unused by unordered work until the copy has run.
        unsafe {
            ipc::copy(
                stream,
                (copy.dst, &dst_ctx),
                (copy.src, &src_ctx),
                copy.len,
                copy.p2p || copy.dst_device == copy.src_device,
            )
        }
    }
}

impl<R: DeviceRuntime> DeviceBuilder<R> {
    /// Switches to the GPU: every device the driver reports, with the layout settings of
    /// the `PINPOOL_DEVICE_CONF` environment variable
    /// ([`DeviceConfig::from_env`](crate::config::DeviceConfig::from_env)) unless
    /// [`DeviceBuilder::config`] gave them; the other settings are kept. Never panics:
    /// without a driver it is [`Error::DeviceUnavailable`], and with a malformed
    /// `PINPOOL_DEVICE_CONF` [`Error::InvalidConfig`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::{DeviceAllocator, Error};
    ///
    /// match DeviceAllocator::builder().cuda() {
    ///     Ok(builder) => {
    ///         let allocator = builder.build()?;
    ///         let stream = allocator.runtime().context().new_stream().expect("a stream");
    ///         let buf = allocator.alloc(1 << 20, &stream).await?;
    ///         assert_eq!(buf.len(), 1 << 20);
    ///     }
    ///     Err(Error::DeviceUnavailable { message }) => println!("no GPU: {message}"),
    ///     Err(other) => return Err(other),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn cuda(self) -> Result<DeviceBuilder<CudaRuntime>, Error> {
        let config = self.resolved_config()?;
        let runtime = CudaRuntime::new(0)?;
        Ok(self.runtime(Arc::new(runtime)).config(&config))
    }
}

/// cudarc's view of a [`DeviceBuffer`]: its length in bytes and the stream that owns it.
impl DeviceSlice<u8> for DeviceBuffer<CudaRuntime> {
    fn len(&self) -> usize {
        DeviceBuffer::len(self)
    }

    fn stream(&self) -> &Arc<CudaStream> {
        DeviceBuffer::stream(self)
    }
}

impl DeviceBuffer<CudaRuntime> {
    /// The address for work on `stream`, ordered the way cudarc orders its own slices. On
    /// the buffer's own stream, or one recorded on it, nothing more is needed: stream order
    /// (or the event recorded at the free) keeps the memory from reuse until the work has
    /// run. On any other stream, the stream first waits for the work enqueued so far on the
    /// buffer's own stream, and cudarc synchronises it once the work is enqueued, so that
    /// dropping the buffer afterwards is safe: forgetting `record_stream` costs speed, never
    /// correctness.
    fn ordered_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let own = DeviceBuffer::stream(self);
        let id = stream_id(stream);
        if stream_id(own) == id || self.recorded_streams().contains(&id) {
            return (self.device_ptr(), SyncOnDrop::Sync(None));
        }
        stream.context().record_err(stream.join(own));
        (self.device_ptr(), SyncOnDrop::sync_stream(stream))
    }
}

/// Lets cudarc read the buffer: `stream.memcpy_dtoh(&buf, ..)`, `memcpy_dtod(&buf, ..)`.
/// For kernel arguments pass the address itself: `let p = buf.device_ptr(); args.arg(&p)`.
impl DevicePtr<u8> for DeviceBuffer<CudaRuntime> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.ordered_ptr(stream)
    }
}

/// Lets cudarc write the buffer: `stream.memcpy_htod(&src, &mut buf)`, `memset_zeros(&mut buf)`.
impl DevicePtrMut<u8> for DeviceBuffer<CudaRuntime> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.ordered_ptr(stream)
    }
}

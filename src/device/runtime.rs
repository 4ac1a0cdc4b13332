//! What the device allocator needs of a runtime beside events: its devices, each device's
//! memory as a memory source, which device a stream runs on, inter-process handles of
//! device memory, peer access between devices, and device-to-device copies.
//!
//! Implemented by the simulated runtime (its simulated devices) and, with the `cuda`
//! feature, by the CUDA runtime (the driver's devices).

use std::sync::Arc;

use crate::actors::{Error, MemorySource, Runtime};

use super::ipc_handle::{IpcHandle, MappedHandle, IPC_HANDLE_BYTES};
use crate::sim::{SimError, SimRuntime};

/// A segment exported for another process: the driver's handle and where the segment
/// starts (a block's offset inside it is its address less `base`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// The driver's handle (`CUipcMemHandle`).
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// The device address of the segment's start.
    pub base: u64,
}

/// A block of an expandable range exported for another process: the file descriptors of
/// the memory handles it touches (kept open here by `keep_open`), and where it starts.
pub struct IpcMappedExport {
    /// The granule the handles' sizes are multiples of (the importer's address alignment).
    pub granule: u64,
    /// Each handle the block touches, in address order: its file descriptor in this process
    /// and its bytes. Together they are contiguous.
    pub handles: Vec<MappedHandle>,
    /// Where the block starts inside the first handle's memory.
    pub offset: u64,
    /// What keeps the file descriptors open: dropped once another process cannot need them
    /// any more (the allocator keeps it with the exported buffer).
    pub keep_open: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for IpcMappedExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMappedExport")
            .field("granule", &self.granule)
            .field("handles", &self.handles)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

/// A runtime with devices whose memory the device allocator caches: the simulated runtime
/// ([`SimRuntime`]) and, with the `cuda` feature, the CUDA runtime. Its calls (devices,
/// their memory, inter-process handles, peer access, device copies) are the allocator's to
/// make: the trait is sealed, and users reach them through
/// [`DeviceAllocator`](crate::DeviceAllocator).
pub trait DeviceRuntime: Runtime + DeviceOps {}

impl<R: Runtime + DeviceOps> DeviceRuntime for R {}

/// What the device allocator asks of a [`DeviceRuntime`]. Public in this private module
/// only: nothing outside the crate names it, so no runtime outside it is a `DeviceRuntime`.
pub trait DeviceOps: Runtime {
    /// How many devices there are.
    fn device_count(&self) -> usize;

    /// The memory of device `device`, as a memory source ([`Error::NoSuchDevice`] past the
    /// last device).
    fn device_memory(&self, device: usize) -> Result<Arc<dyn MemorySource>, Error>;

    /// The device whose work `stream` runs.
    fn stream_device(&self, stream: &Self::Stream) -> usize;

    /// Free and total bytes of device `device`, as the driver reports them.
    fn device_memory_info(&self, device: usize) -> Result<(usize, usize), Error>;

    /// Exports the segment that holds device address `ptr` of device `device` for another
    /// process (`cuIpcGetMemHandle` of the segment's start). [`Error::NotSupported`] where
    /// the runtime has no inter-process memory (the default).
    fn ipc_export(&self, device: usize, ptr: u64) -> Result<IpcExport, Error> {
        let _ = (device, ptr);
        Err(no_ipc(self.name(), "ipc_handle"))
    }

    /// Opens a segment another process exported, on device `device`: its start here and its
    /// size (`cuIpcOpenMemHandle`). A handle the driver refuses is
    /// [`Error::InvalidIpcHandle`].
    fn ipc_open(
        &self,
        device: usize,
        handle: &[u8; IPC_HANDLE_BYTES],
    ) -> Result<(u64, usize), Error> {
        let _ = (device, handle);
        Err(no_ipc(self.name(), "open_ipc"))
    }

    /// Closes a segment `ipc_open` opened (`cuIpcCloseMemHandle`).
    ///
    /// # Safety
    ///
    /// `base` was returned by this runtime's `ipc_open` for `device`, is not closed yet, and
    /// nothing uses the memory any more (the allocator's registry of opened segments calls
    /// this once the last `IpcMemory` of the segment is gone).
    unsafe fn ipc_close(&self, device: usize, base: u64) -> Result<(), Error> {
        let _ = (device, base);
        Err(no_ipc(self.name(), "ipc_close"))
    }

    /// Exports the block of `len` bytes at `ptr`, in an expandable range of device `device`,
    /// for another process: the file descriptors of the memory handles it touches
    /// (`cuMemExportToShareableHandle`). [`Error::NotSupported`] where the runtime cannot
    /// (the default; on CUDA, memory created without a file-descriptor handle type).
    fn ipc_export_mapped(
        &self,
        device: usize,
        ptr: u64,
        len: usize,
    ) -> Result<IpcMappedExport, Error> {
        let _ = (device, ptr, len);
        Err(Error::NotSupported {
            operation: "ipc_handle",
            reason: format!(
                "the {} runtime cannot export a block of an expandable segment: build the \
                 allocator with expandable_segments:false",
                self.name()
            ),
        })
    }

    /// Opens, on device `device`, the memory handles of a block `ipc_export_mapped`
    /// exported in another process (`handle` is of that kind): maps them, in order, into a
    /// fresh address range; its start here and its size. A handle whose process has exited
    /// or denies access is [`Error::InvalidIpcHandle`].
    fn ipc_open_mapped(&self, device: usize, handle: &IpcHandle) -> Result<(u64, usize), Error> {
        let _ = (device, handle);
        Err(no_ipc(self.name(), "open_ipc"))
    }

    /// Unmaps and gives back what `ipc_open_mapped` opened for `handle` at `base`.
    ///
    /// # Safety
    ///
    /// `base` was returned by this runtime's `ipc_open_mapped` for `device` and `handle`,
    /// is not closed yet, and nothing uses the memory any more (the registry of opened
    /// memory calls this once the last `IpcMemory` of it is gone).
    unsafe fn ipc_close_mapped(
        &self,
        device: usize,
        base: u64,
        handle: &IpcHandle,
    ) -> Result<(), Error> {
        let _ = (device, base, handle);
        Err(no_ipc(self.name(), "ipc_close"))
    }

    /// Lets device `device` access the memory of device `peer` (both exist and differ:
    /// the caller checked). [`Error::PeerAccessUnsupported`] where there is no path (the
    /// default).
    fn enable_peer_access(&self, device: usize, peer: usize) -> Result<(), Error> {
        Err(Error::PeerAccessUnsupported { device, peer })
    }

    /// Enqueues `copy` on `stream`: directly where `copy.p2p` (or on one device), else
    /// staged by the driver (`cuMemcpyPeerAsync`). [`Error::NotSupported`] by default.
    ///
    /// # Safety
    ///
    /// The copy's source and destination ranges lie in device memory of their devices that
    /// stays allocated, and is not used by other work unordered with `stream`, until the
    /// copy has run (`DeviceAllocator::memcpy_async` checks the ranges against its buffers
    /// and records `stream` on both before calling this).
    unsafe fn copy_device_async(
        &self,
        stream: &Self::Stream,
        copy: DeviceCopy,
    ) -> Result<(), Error> {
        let _ = (stream, copy);
        Err(Error::NotSupported {
            operation: "memcpy_async",
            reason: format!("the {} runtime has no device copies", self.name()),
        })
    }
}

/// A copy between device ranges, on one device or two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCopy {
    /// Destination address, on `dst_device`.
    pub dst: u64,
    /// The destination's device.
    pub dst_device: usize,
    /// Source address, on `src_device`.
    pub src: u64,
    /// The source's device.
    pub src_device: usize,
    /// Bytes to copy.
    pub len: usize,
    /// Copy directly between the devices (peer access enabled), not staged by the driver.
    pub p2p: bool,
}

/// [`Error::NotSupported`] for a runtime without inter-process memory.
fn no_ipc(runtime: &str, operation: &'static str) -> Error {
    Error::NotSupported {
        operation,
        reason: format!("the {runtime} runtime has no inter-process device memory"),
    }
}

fn sim_error(e: SimError) -> Error {
    match e {
        SimError::NoSuchDevice { ordinal, count } => Error::NoSuchDevice { ordinal, count },
        other => Error::Runtime(other.into_runtime("device")),
    }
}

impl DeviceOps for SimRuntime {
    fn device_count(&self) -> usize {
        SimRuntime::device_count(self)
    }

    fn device_memory(&self, device: usize) -> Result<Arc<dyn MemorySource>, Error> {
        let memory: Arc<dyn MemorySource> =
            SimRuntime::device_memory(self, device).map_err(sim_error)?;
        Ok(memory)
    }

    fn stream_device(&self, stream: &Self::Stream) -> usize {
        stream.device()
    }

    fn device_memory_info(&self, device: usize) -> Result<(usize, usize), Error> {
        let count = SimRuntime::device_count(self);
        match (self.device_capacity(device), self.device_used(device)) {
            (Some(total), Some(used)) => Ok((total.saturating_sub(used), total)),
            _ => Err(Error::NoSuchDevice {
                ordinal: device,
                count,
            }),
        }
    }

    fn enable_peer_access(&self, device: usize, peer: usize) -> Result<(), Error> {
        if !self.peer_access() {
            return Err(Error::PeerAccessUnsupported { device, peer });
        }
        let opened = |_, _, _| Ok::<(), Error>(());
        self.mapped_access().grant(peer, device, opened)
    }

    unsafe fn copy_device_async(
        &self,
        stream: &Self::Stream,
        copy: DeviceCopy,
    ) -> Result<(), Error> {
        // Both ways are one copy on the stream's worker (early reuse of either range is
        // caught when it runs).
        self.check_stream(stream).map_err(sim_error)?;
        if copy.p2p {
            self.check_peer_reach(stream.device(), &copy)?;
        }
        stream
            .copy_dtod(copy.src, copy.dst, copy.len)
            .map_err(sim_error)
    }
}

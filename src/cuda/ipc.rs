//! The driver calls behind inter-process handles and peer devices, for
//! [`DeviceRuntime`](crate::DeviceRuntime) on [`CudaRuntime`]: `cuIpcGetMemHandle` of a
//! segment's start (found with `cuMemGetAddressRange`), `cuIpcOpenMemHandle` /
//! `cuIpcCloseMemHandle`; for blocks of expandable ranges `cuMemExportToShareableHandle`
//! (POSIX file descriptors) of each memory handle a block touches, and `pidfd_getfd`,
//! `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap` and `cuMemSetAccess`
//! to open them (`cuMemUnmap` / `cuMemAddressFree` to close); `cuCtxEnablePeerAccess` after
//! `cuDeviceCanAccessPeer`, and copies between devices (`cuMemcpyDtoDAsync` directly,
//! `cuMemcpyPeerAsync` staged).
//!
//! Owns no state: each call binds the context it needs (the device's primary context, or
//! the stream's) on the calling thread. Driver failures become typed errors: a handle the
//! driver will not open is [`Error::InvalidIpcHandle`] (its exporting process has exited,
//! it is this process's own, or it came from elsewhere), memory it will not export is
//! [`Error::NotSupported`], and devices with no peer path are
//! [`Error::PeerAccessUnsupported`].

use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{result, CudaContext, CudaStream, DriverError};

use super::context::bind;
use super::error::{describe, runtime_error};
use crate::device::{IpcExport, IPC_HANDLE_BYTES};
use crate::Error;

fn driver(op: &'static str, e: DriverError) -> Error {
    Error::Runtime(runtime_error(op, e))
}

/// Binds `ctx` to the calling thread.
fn enter(ctx: &Arc<CudaContext>) -> Result<(), Error> {
    bind(ctx).map_err(|e| driver("cuCtxSetCurrent", e))
}

/// Exports the segment that holds `ptr` (with `ctx`, its device's context, bound).
pub(crate) fn export(ctx: &Arc<CudaContext>, ptr: u64) -> Result<IpcExport, Error> {
    enter(ctx)?;
    let (mut base, mut size) = (0 as sys::CUdeviceptr, 0usize);
    // SAFETY: both out-pointers are valid locals; the driver only reads `ptr` as a number.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| driver("cuMemGetAddressRange", e))?;
    let mut handle = MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: `handle` is a valid, zeroed out-location of the handle's type; `base` is the
    // start of a live allocation of this context (the buffer being exported is alive).
    match unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base) }.result() {
        Ok(()) => {}
        Err(e @ DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
            return Err(driver("cuIpcGetMemHandle", e))
        }
        Err(e) => {
            return Err(Error::NotSupported {
                operation: "ipc_handle",
                reason: format!(
                    "cuIpcGetMemHandle refused the segment ({}): only cuMemAlloc memory can be \
                     exported (expandable_segments:false)",
                    describe(e)
                ),
            })
        }
    }
    // SAFETY: the call succeeded and wrote the handle (it was zeroed before anyway).
    let handle = unsafe { handle.assume_init() };
    let mut bytes = [0u8; IPC_HANDLE_BYTES];
    bytes
        .iter_mut()
        .zip(handle.reserved.iter())
        .for_each(|(b, c)| *b = *c as u8);
    Ok(IpcExport {
        handle: bytes,
        base,
    })
}

/// Opens an exported segment on the device of `ctx`; its start in this process.
pub(crate) fn open(
    ctx: &Arc<CudaContext>,
    handle: &[u8; IPC_HANDLE_BYTES],
) -> Result<(u64, usize), Error> {
    enter(ctx)?;
    let mut raw = sys::CUipcMemHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    raw.reserved
        .iter_mut()
        .zip(handle.iter())
        .for_each(|(c, b)| *c = *b as std::ffi::c_char);
    let mut ptr: sys::CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
    // SAFETY: `ptr` is a valid out-location; the handle is passed by value, and the driver
    // checks it (a bad one is an error, not undefined behaviour).
    match unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags) }.result() {
        Ok(()) => {
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: valid out-locations; `ptr` is the start of the segment just opened.
            let range = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
            match range.result() {
                Ok(()) => Ok((ptr, size)),
                Err(e) => {
                    // SAFETY: opened just above, used by nothing yet, closed once here.
                    let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
                    Err(driver("cuMemGetAddressRange", e))
                }
            }
        }
        Err(e @ DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
            Err(driver("cuIpcOpenMemHandle", e))
        }
        Err(e) => Err(Error::InvalidIpcHandle {
            reason: format!(
                "cuIpcOpenMemHandle on device {}: {} (has the exporting process exited, or is \
                 this its own handle?)",
                ctx.ordinal(),
                describe(e)
            ),
        }),
    }
}

/// Closes a segment `open` opened.
pub(crate) fn close(ctx: &Arc<CudaContext>, base: u64) -> Result<(), Error> {
    enter(ctx)?;
    // SAFETY: `base` came from `open` in this context and is closed once (the registry
    // counts its users).
    unsafe { sys::cuIpcCloseMemHandle(base) }
        .result()
        .map_err(|e| driver("cuIpcCloseMemHandle", e))
}

/// Lets the device of `ctx` access the memory of the device of `peer`.
pub(crate) fn enable_peer(ctx: &Arc<CudaContext>, peer: &Arc<CudaContext>) -> Result<(), Error> {
    let (device, other) = (ctx.ordinal(), peer.ordinal());
    let mut can: std::ffi::c_int = 0;
    // SAFETY: `can` is a valid out-location; both devices exist (their contexts do).
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), peer.cu_device()) }
        .result()
        .map_err(|e| driver("cuDeviceCanAccessPeer", e))?;
    if can == 0 {
        return Err(Error::PeerAccessUnsupported {
            device,
            peer: other,
        });
    }
    enter(ctx)?;
    // SAFETY: `peer` is a live primary context of another device; flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) }.result() {
        Ok(()) | Err(DriverError(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)) => Ok(()),
        Err(DriverError(
            CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED | CUresult::CUDA_ERROR_TOO_MANY_PEERS,
        )) => Err(Error::PeerAccessUnsupported {
            device,
            peer: other,
        }),
        Err(e) => Err(driver("cuCtxEnablePeerAccess", e)),
    }
}

/// Enqueues a copy between device memory of the contexts `dst_ctx` and `src_ctx` on
/// `stream`: directly (`cuMemcpyDtoDAsync`, unified addressing) when `direct`, else staged
/// (`cuMemcpyPeerAsync`).
///
/// # Safety
/// `len` bytes at `dst` and at `src` must be live device memory of those contexts until the
/// copy has run (the allocator records the stream on both buffers).
pub(crate) unsafe fn copy(
    stream: &Arc<CudaStream>,
    (dst, dst_ctx): (u64, &Arc<CudaContext>),
    (src, src_ctx): (u64, &Arc<CudaContext>),
    len: usize,
    direct: bool,
) -> Result<(), Error> {
    enter(stream.context())?;
    if direct {
        // SAFETY: by the caller's promise; the stream is alive (the `Arc`).
        unsafe { result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
            .map_err(|e| driver("cuMemcpyDtoDAsync", e))
    } else {
        // SAFETY: as above; both contexts are live primary contexts.
        unsafe {
            result::memcpy_peer_async(
                dst_ctx.cu_ctx(),
                dst,
                src_ctx.cu_ctx(),
                src,
                len,
                stream.cu_stream(),
            )
        }
        .map_err(|e| driver("cuMemcpyPeerAsync", e))
    }
}

/// Blocks of expandable ranges: each memory handle exported as a POSIX file descriptor,
/// duplicated into the importing process with `pidfd_open` + `pidfd_getfd` (Linux 5.6 and
/// later; the importer needs ptrace-like access to the exporter, which the same user
/// normally has), imported, and mapped into a fresh address range.
#[cfg(target_os = "linux")]
mod mapped {
    use std::ffi::{c_int, c_void};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::Arc;

    use cudarc::driver::sys::{self, CUresult};
    use cudarc::driver::{result, CudaContext, DriverError};

    use super::{driver, enter};
    use crate::cuda::error::describe;
    use crate::cuda::vmm::{self, Location};
    use crate::device::{IpcHandle, IpcMappedExport, MappedHandle, MAX_MAPPED_HANDLES};
    use crate::Error;

    const FD: sys::CUmemAllocationHandleType =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

    /// A retained (or imported) memory handle, released when dropped.
    struct Retained(sys::CUmemGenericAllocationHandle);

    impl Drop for Retained {
        fn drop(&mut self) {
            // SAFETY: the handle was retained or imported once and is released once here.
            unsafe { sys::cuMemRelease(self.0) };
        }
    }

    fn retain(at: u64) -> Option<Retained> {
        vmm::retain(at).map(Retained)
    }

    fn not_exportable(reason: String) -> Error {
        Error::NotSupported {
            operation: "ipc_handle",
            reason: format!(
                "{reason}: build the allocator with expandable_segments:false to export \
                 blocks with cuIpcGetMemHandle"
            ),
        }
    }

    /// Exports the block of `len` bytes at `ptr`, mapped in a range of the device of `ctx`:
    /// finds each memory handle it touches (the granules that
    /// `cuMemRetainAllocationHandle` answers with one handle value: the driver gives back
    /// the value the memory was mapped with) and exports it as a file descriptor.
    pub(crate) fn export_mapped(
        ctx: &Arc<CudaContext>,
        ptr: u64,
        len: usize,
    ) -> Result<IpcMappedExport, Error> {
        enter(ctx)?;
        let granule = vmm::granularity(Location::device(ctx.ordinal() as c_int))
            .ok_or_else(|| not_exportable("this device cannot map memory".into()))?
            as u64;
        let end = ptr
            .checked_add(len as u64)
            .ok_or_else(|| not_exportable("the block's end overflows".into()))?;
        let first_granule = ptr - ptr % granule;
        let missing = || {
            Error::Runtime(crate::RuntimeError::new(
                "cuMemRetainAllocationHandle",
                "a granule of the block is not mapped",
            ))
        };
        let mut current = retain(first_granule).ok_or_else(missing)?;
        let mut start = mapping_start(&current, first_granule, granule);
        let offset = ptr - start;
        let mut handles = Vec::new();
        let mut fds: Vec<OwnedFd> = Vec::new();
        loop {
            // Forward to the end of the current handle's mapping.
            let mut next = start + granule;
            let following = loop {
                match retain(next) {
                    Some(h) if h.0 == current.0 => next += granule,
                    other => break other,
                }
            };
            let (fd, raw) = export_fd(&current)?;
            fds.push(fd);
            handles.push(MappedHandle {
                fd: raw,
                size: next - start,
            });
            if next >= end {
                break;
            }
            if handles.len() >= MAX_MAPPED_HANDLES {
                return Err(not_exportable(format!(
                    "the block spans more than {MAX_MAPPED_HANDLES} memory handles"
                )));
            }
            current = following.ok_or_else(missing)?;
            start = next;
        }
        Ok(IpcMappedExport {
            granule,
            handles,
            offset,
            keep_open: Box::new(fds),
        })
    }

    /// The first granule of the mapping `current` (retained at `granule_at`) belongs to:
    /// back from `granule_at` while the granule before has the same handle.
    fn mapping_start(current: &Retained, granule_at: u64, granule: u64) -> u64 {
        let mut start = granule_at;
        while let Some(before) = start.checked_sub(granule) {
            match retain(before) {
                Some(h) if h.0 == current.0 => start = before,
                _ => break,
            }
        }
        start
    }

    /// Exports the memory handle `current` as a file descriptor: the descriptor, owned, and
    /// its number.
    fn export_fd(current: &Retained) -> Result<(OwnedFd, c_int), Error> {
        let mut raw: c_int = -1;
        // SAFETY: `raw` is valid for the write of one `int` (what the driver writes for a
        // POSIX file descriptor); `current` is a live, retained handle.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                &mut raw as *mut c_int as *mut c_void,
                current.0,
                FD,
                0,
            )
        };
        if let Err(e) = r.result() {
            return Err(not_exportable(format!(
                "the driver cannot export this memory as a file descriptor \
                 (cuMemExportToShareableHandle: {}; the device or driver does not \
                 support the handle type)",
                describe(e)
            )));
        }
        if raw < 0 {
            return Err(not_exportable(
                "the driver exported no file descriptor".into(),
            ));
        }
        // SAFETY: the driver just opened this descriptor for this call; nothing else owns
        // it.
        Ok((unsafe { OwnedFd::from_raw_fd(raw) }, raw))
    }

    /// `errno` of the last failed call.
    fn errno() -> std::io::Error {
        std::io::Error::last_os_error()
    }

    /// A descriptor a raw syscall returned, or its error.
    fn owned(ret: std::ffi::c_long) -> Result<OwnedFd, std::io::Error> {
        if ret < 0 {
            return Err(errno());
        }
        let fd = c_int::try_from(ret).map_err(|_| std::io::Error::other("descriptor range"))?;
        // SAFETY: the kernel just opened `fd` for this process; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn syscall_error(what: &str, pid: u32, e: std::io::Error) -> Error {
        if e.raw_os_error() == Some(libc::ENOSYS) {
            return Error::NotSupported {
                operation: "open_ipc",
                reason: format!(
                    "the kernel has no {what} (Linux 5.6 or later is needed to open a block \
                     of an expandable segment)"
                ),
            };
        }
        Error::InvalidIpcHandle {
            reason: format!(
                "{what} on process {pid}: {e} (has the exporting process exited, freed the \
                 buffer, or does it deny this process access?)"
            ),
        }
    }

    /// Mappings made so far in a fresh range; undone when dropped unless `done`.
    struct Mapping {
        base: u64,
        total: usize,
        mapped: Vec<(u64, usize)>,
        done: bool,
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            if self.done {
                return;
            }
            for &(at, size) in &self.mapped {
                // SAFETY: mapped by `open_mapped` just before, used by nothing yet.
                unsafe { sys::cuMemUnmap(at, size) };
            }
            // SAFETY: reserved by `open_mapped`; nothing of it is mapped any more.
            unsafe { sys::cuMemAddressFree(self.base, self.total) };
        }
    }

    /// Opens the memory handles of `handle` (a block of an expandable range) on the device
    /// of `ctx`: its start here and its size.
    pub(crate) fn open_mapped(
        ctx: &Arc<CudaContext>,
        handle: &IpcHandle,
    ) -> Result<(u64, usize), Error> {
        let (Some(granule), pieces) = (handle.granule(), handle.mapped_handles()) else {
            return Err(Error::InvalidIpcHandle {
                reason: "not a handle of an expandable range".into(),
            });
        };
        let pid = handle.exporter_pid();
        let pid_arg = libc::pid_t::try_from(pid)
            .map_err(|_| syscall_error("pidfd_open", pid, std::io::Error::other("bad pid")))?;
        // SAFETY: pidfd_open takes a pid and flags (0) and returns a new descriptor or -1.
        let pidfd = owned(unsafe { libc::syscall(libc::SYS_pidfd_open, pid_arg, 0) })
            .map_err(|e| syscall_error("pidfd_open", pid, e))?;
        enter(ctx)?;
        // Import every handle first: each duplicated descriptor is closed once imported.
        let (imported, total) = import_handles(&pidfd, pid, pieces)?;
        drop(pidfd);
        let range = vmm::reserve(total, granule as usize, crate::Origin::DeviceMapped)
            .map_err(Error::Runtime)?;
        let base = range.ptr.as_ptr() as usize as u64;
        let mut mapping = Mapping {
            base,
            total,
            mapped: Vec::with_capacity(imported.len()),
            done: false,
        };
        map_imported(&mut mapping, &imported, pieces)?;
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx.ordinal() as c_int,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped just above; `desc` is valid for the call.
        unsafe { sys::cuMemSetAccess(base, total, &desc, 1) }
            .result()
            .map_err(|e| driver("cuMemSetAccess", e))?;
        // The mappings hold the memory now: the imported handles are released as they drop.
        mapping.done = true;
        Ok((base, total))
    }

    /// Imports each of `pieces` (descriptors of process `pid`, reached through `pidfd`) as a
    /// memory handle; returns the handles and their bytes in all. Each duplicated
    /// descriptor is closed once imported.
    fn import_handles(
        pidfd: &OwnedFd,
        pid: u32,
        pieces: &[MappedHandle],
    ) -> Result<(Vec<Retained>, usize), Error> {
        let mut imported = Vec::with_capacity(pieces.len());
        let mut total = 0usize;
        for piece in pieces {
            // SAFETY: pidfd_getfd takes a pidfd, a descriptor number of that process and
            // flags (0), and returns a new descriptor of this process or -1.
            let ret =
                unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), piece.fd, 0) };
            let fd = owned(ret).map_err(|e| syscall_error("pidfd_getfd", pid, e))?;
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `h` is valid for the write; for a POSIX descriptor the driver takes
            // the descriptor number as the pointer's value (it reads no memory there), and
            // `fd` is open for the call.
            let r = unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut h,
                    fd.as_raw_fd() as usize as *mut c_void,
                    FD,
                )
            };
            drop(fd);
            match r.result() {
                Ok(()) => imported.push(Retained(h)),
                Err(e @ DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
                    return Err(driver("cuMemImportFromShareableHandle", e))
                }
                Err(e) => {
                    return Err(Error::InvalidIpcHandle {
                        reason: format!(
                            "cuMemImportFromShareableHandle of descriptor {} of process \
                             {pid}: {}",
                            piece.fd,
                            describe(e)
                        ),
                    })
                }
            }
            // The sizes fit a usize together (checked when the handle was read).
            total += piece.size as usize;
        }
        Ok((imported, total))
    }

    /// Maps the `imported` handles of `pieces` one after another from the start of the
    /// range of `mapping`, entering each mapping there (undone if a later step fails).
    fn map_imported(
        mapping: &mut Mapping,
        imported: &[Retained],
        pieces: &[MappedHandle],
    ) -> Result<(), Error> {
        let mut at = mapping.base;
        for (h, piece) in imported.iter().zip(pieces) {
            let size = piece.size as usize;
            // SAFETY: `[at, at + size)` is unmapped space of the range reserved by
            // `open_mapped` (the pieces follow each other); `h` is a live imported handle of
            // at least `size` bytes (the driver checks the size against the allocation's).
            unsafe { sys::cuMemMap(at, size, 0, h.0, 0) }
                .result()
                .map_err(|e| driver("cuMemMap", e))?;
            mapping.mapped.push((at, size));
            at += piece.size;
        }
        Ok(())
    }

    /// Unmaps and gives back what `open_mapped` opened for `handle` at `base`, after the
    /// device's queued work (`cuMemUnmap` does not wait for it).
    ///
    /// # Safety
    /// `base` came from `open_mapped` for `handle` in this context, is closed once, and
    /// nothing enqueued later uses it.
    pub(crate) unsafe fn close_mapped(
        ctx: &Arc<CudaContext>,
        base: u64,
        handle: &IpcHandle,
    ) -> Result<(), Error> {
        enter(ctx)?;
        result::ctx::synchronize().map_err(|e| driver("cuCtxSynchronize", e))?;
        let mut first_error = None;
        let mut at = base;
        for piece in handle.mapped_handles() {
            // SAFETY: each piece was mapped at `at` by `open_mapped` (caller's promise);
            // the device has run the work queued on it.
            if let Err(e) = unsafe { sys::cuMemUnmap(at, piece.size as usize) }.result() {
                first_error.get_or_insert(driver("cuMemUnmap", e));
            }
            at += piece.size;
        }
        let total = (at - base) as usize;
        // SAFETY: reserved by `open_mapped` with this size; unmapped above.
        if let Err(e) = unsafe { sys::cuMemAddressFree(base, total) }.result() {
            first_error.get_or_insert(driver("cuMemAddressFree", e));
        }
        first_error.map_or(Ok(()), Err)
    }
}

#[cfg(target_os = "linux")]
pub(crate) use mapped::{close_mapped, export_mapped, open_mapped};

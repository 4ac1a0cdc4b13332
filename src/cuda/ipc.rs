//! The driver calls behind inter-process handles and peer devices, for
//! [`DeviceRuntime`](crate::DeviceRuntime) on [`CudaRuntime`]: `cuIpcGetMemHandle` of a
//! segment's start (found with `cuMemGetAddressRange`), `cuIpcOpenMemHandle` /
//! `cuIpcCloseMemHandle`, `cuCtxEnablePeerAccess` after `cuDeviceCanAccessPeer`, and copies
//! between devices (`cuMemcpyDtoDAsync` directly, `cuMemcpyPeerAsync` staged).
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

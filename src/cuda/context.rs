//! Binding a context to the calling thread, and relaxing the thread's stream-capture mode.
//!
//! Owns no state. The engine calls the runtime from tokio blocking threads and from the
//! threads that free buffers, none of which has a context bound; every entry point of the
//! runtime binds the context it needs first.

use std::marker::PhantomData;

use cudarc::driver::sys::{self, CUstreamCaptureMode};
use cudarc::driver::{result, CudaContext, DriverError};

/// Makes `ctx` current on the calling thread unless it already is.
///
/// Unlike [`CudaContext::bind_to_thread`], this does not take (and so clear) the errors that
/// cudarc's destructors stored in the context: those belong to cudarc's own callers.
pub(crate) fn bind(ctx: &CudaContext) -> Result<(), DriverError> {
    let wanted = ctx.cu_ctx();
    if result::ctx::get_current()? != Some(wanted) {
        // SAFETY: `wanted` is the live context owned by `ctx`, which the caller borrows for
        // the duration of the call; making a live context current is always sound.
        unsafe { result::ctx::set_current(wanted) }?;
    }
    Ok(())
}

/// While alive, the calling thread's stream-capture mode is `RELAXED`, so that host
/// allocation and release calls (which are "unsafe" during capture in the driver's sense)
/// neither fail nor invalidate a capture underway on another stream. Dropping it restores
/// the previous mode. PyTorch does the same around `cudaHostAlloc`.
pub(crate) struct RelaxedCaptureMode {
    previous: CUstreamCaptureMode,
    /// The mode is per thread: the guard must be dropped where it was made (!Send, !Sync).
    _same_thread: PhantomData<*const ()>,
}

impl RelaxedCaptureMode {
    /// Switches the calling thread to relaxed capture mode.
    pub(crate) fn enter() -> Result<Self, DriverError> {
        let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid, writable `CUstreamCaptureMode`; the call exchanges it
        // with the calling thread's mode and touches nothing else.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result()?;
        Ok(Self {
            previous: mode,
            _same_thread: PhantomData,
        })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; this restores the mode `enter` saved on this same thread
        // (the guard is neither Send nor Sync).
        let restored = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result();
        if let Err(error) = restored {
            tracing::warn!(?error, "could not restore the thread's stream capture mode");
        }
    }
}

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

/// While alive, remembers the calling thread's current context; dropping it makes that
/// context current again (or none, if none was). The memory source's calls bind the
/// context they need, and the pools may run them on a user's thread (a blocking request
/// that needs fresh memory runs the calls itself), whose current context must not change
/// under it.
pub(crate) struct KeepCurrent {
    previous: Option<sys::CUcontext>,
    /// The current context is per thread: the guard must be dropped where it was made.
    _same_thread: PhantomData<*const ()>,
}

impl KeepCurrent {
    /// Remembers the calling thread's current context.
    pub(crate) fn new() -> Self {
        Self {
            previous: result::ctx::get_current().ok().flatten(),
            _same_thread: PhantomData,
        }
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        let now = result::ctx::get_current().ok().flatten();
        if now == self.previous {
            return;
        }
        let previous = self.previous.unwrap_or(std::ptr::null_mut());
        // SAFETY: `previous` was current on this thread when the guard was made, and the
        // contexts the calls in between bound stay alive while their owners are borrowed;
        // a context destroyed meanwhile makes the call fail, which is only logged. A null
        // context unbinds.
        if let Err(error) = unsafe { result::ctx::set_current(previous) } {
            tracing::warn!(?error, "could not restore the thread's current context");
        }
    }
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

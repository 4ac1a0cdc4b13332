//! The C ABI's rules, apart from any runtime: no panic and no error crosses the boundary.
//!
//! Owns the last error: each failed call stores its message for the calling thread (read it
//! with `pinpool_last_error`), and the first [`LOUD_ERRORS`] failures of the process are
//! also written to stderr, so that a NULL that becomes PyTorch's out-of-memory error, or a
//! free whose failure PyTorch never sees, still says what went wrong. A panic inside a call
//! is caught and is one more error. The entry points' bodies are the `*_with` functions
//! here, generic over the runtime, so that the simulated runtime tests what the exported
//! symbols do.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use pinpool::{DeviceRuntime, Error};

use crate::plugin::Plugin;

/// How many failures of the process are written to stderr besides being stored.
pub(crate) const LOUD_ERRORS: usize = 16;

static FAILURES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Stores `message` as the calling thread's last error (and writes it to stderr while the
/// process has had fewer than [`LOUD_ERRORS`] failures).
pub(crate) fn set_last_error(op: &str, message: &str) {
    let text = format!("pinpool: {op}: {message}");
    let n = FAILURES.fetch_add(1, Ordering::Relaxed);
    if n < LOUD_ERRORS {
        eprintln!("{text}");
        if n + 1 == LOUD_ERRORS {
            eprintln!("pinpool: further errors are only kept for pinpool_last_error");
        }
    }
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// The calling thread's last error ("" if none).
pub(crate) fn last_error() -> String {
    LAST_ERROR.with(|e| e.borrow().clone())
}

/// How many calls have failed in this process.
pub(crate) fn failures() -> usize {
    FAILURES.load(Ordering::Relaxed)
}

/// Runs `f`; an error or a panic is stored as the last error and gives `fail`.
pub(crate) fn guarded<T, E: std::fmt::Display>(
    op: &str,
    fail: T,
    f: impl FnOnce() -> Result<T, E>,
) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_last_error(op, &e.to_string());
            fail
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            set_last_error(op, &format!("panicked: {what}"));
            fail
        }
    }
}

/// Copies `text` into `buf` (`cap` bytes) NUL-terminated if it fits, and returns its length
/// without the NUL: the caller retries with a larger buffer when the length is `cap` or
/// more. A null `buf` only asks for the length.
///
/// # Safety
///
/// `buf` is null or valid for writes of `cap` bytes.
pub(crate) unsafe fn copy_out(text: &str, buf: *mut c_char, cap: usize) -> usize {
    let bytes = text.as_bytes();
    if !buf.is_null() && bytes.len() < cap {
        // SAFETY: the caller's contract: `buf` holds `cap` > `bytes.len()` bytes, and
        // `bytes` is a separate Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
            *buf.add(bytes.len()) = 0;
        }
    }
    bytes.len()
}

/// The body of `pinpool_alloc`: the address, or null (the error stored) on failure.
pub(crate) fn alloc_with<R: DeviceRuntime>(
    plugin: Result<&Plugin<R>, Error>,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let handle = stream as usize;
    guarded("alloc", 0, || plugin?.alloc(size, device, handle)) as *mut c_void
}

/// The body of `pinpool_free`.
pub(crate) fn free_with<R: DeviceRuntime>(
    plugin: Result<&Plugin<R>, Error>,
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) {
    let (ptr, handle) = (ptr as usize, stream as usize);
    guarded("free", (), || plugin?.free(ptr, device, handle))
}

/// The body of `pinpool_record_stream`, for a block of device `device`.
pub(crate) fn record_stream_with<R: DeviceRuntime>(
    plugin: Result<&Plugin<R>, Error>,
    ptr: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) {
    let (ptr, handle) = (ptr as usize, stream as usize);
    guarded("record_stream", (), || {
        plugin?.record_stream(ptr, device, handle)
    })
}

/// A status for C: 0 on success, -1 (the error stored) on failure.
pub(crate) fn status<E: std::fmt::Display>(op: &str, f: impl FnOnce() -> Result<(), E>) -> c_int {
    guarded(op, -1, || f().map(|()| 0))
}

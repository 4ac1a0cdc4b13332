//! The C ABI's rules, apart from any runtime: no panic and no error crosses the boundary.
//!
//! Owns the last error: each failed call stores its message for the calling thread (read it
//! with `pinpool_last_error`), and the first [`LOUD_ERRORS`] failures of the process are
//! also written to stderr, so that a NULL that becomes PyTorch's out-of-memory error, or a
//! free whose failure PyTorch never sees, still says what went wrong. Every entry point runs
//! whole inside [`guarded`]: a panic anywhere in it (making the allocator, keeping the
//! thread's context, the call itself) is caught and is one more error, and reporting an
//! error cannot panic either: stderr is written with one `write` call whose failure (a
//! closed pipe: `python train.py 2>&1 | head`) is ignored, and the thread's last error is
//! skipped when the thread is exiting and its storage is gone. In a child forked from the
//! process that started the allocator, every call fails at once (see [`crate::fork`]).

use std::cell::{Cell, RefCell};
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::fork;

/// How many failures of the process are written to stderr besides being stored.
pub(crate) const LOUD_ERRORS: usize = 16;

static FAILURES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// Whether the thread's last call failed for want of memory (see [`note_out_of_memory`]).
    static OUT_OF_MEMORY: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread's current call as failed for want of memory (an allocation
/// PyTorch should raise `torch.OutOfMemoryError` for, rather than another error); cleared
/// when the thread's next call begins.
pub(crate) fn note_out_of_memory() {
    let _ = OUT_OF_MEMORY.try_with(|o| o.set(true));
}

/// Whether the calling thread's last call failed for want of memory.
pub(crate) fn last_was_out_of_memory() -> bool {
    OUT_OF_MEMORY.try_with(Cell::get).unwrap_or(false)
}

/// Writes `text` to the process's stderr (file descriptor 2) as it is, bypassing Rust's
/// stderr handle (its lock, and `eprintln!`'s panic when the write fails); a failed or short
/// write is given up.
fn write_stderr(text: &str) {
    #[cfg(unix)]
    {
        // SAFETY: `text` is valid for reads of its length; `write` touches nothing else.
        let _ = unsafe { libc::write(2, text.as_ptr().cast(), text.len()) };
    }
    #[cfg(not(unix))]
    {
        use std::io::Write;
        let _ = std::io::stderr().write_all(text.as_bytes());
    }
}

/// Stores `message` as the calling thread's last error (and writes it to stderr while the
/// process has had fewer than [`LOUD_ERRORS`] failures, unless `quiet`).
fn store_error(op: &str, message: &str, quiet: bool) {
    let text = format!("pinpool: {op}: {message}");
    let n = FAILURES.fetch_add(1, Ordering::Relaxed);
    if n < LOUD_ERRORS && !quiet {
        let mut line = format!("{text}\n");
        if n + 1 == LOUD_ERRORS {
            line.push_str("pinpool: further errors are only kept for pinpool_last_error\n");
        }
        write_stderr(&line);
    }
    // At thread exit the storage may be gone already: the message is then only counted.
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            *e = text;
        }
    });
}

/// Stores `message` as the calling thread's last error (and writes it to stderr while the
/// process has had fewer than [`LOUD_ERRORS`] failures).
pub(crate) fn set_last_error(op: &str, message: &str) {
    store_error(op, message, false)
}

/// The calling thread's last error ("" if none).
pub(crate) fn last_error() -> String {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map(|e| e.clone()).unwrap_or_default())
        .unwrap_or_default()
}

/// How many calls have failed in this process.
pub(crate) fn failures() -> usize {
    FAILURES.load(Ordering::Relaxed)
}

/// What a panic's payload says.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

/// Runs `f`, an entry point's whole body; an error or a panic is stored as the last error
/// and gives `fail`. In a forked child `f` does not run (see [`fork`]): the call fails at
/// once, quietly (a child that drops an inherited tensor frees nothing of the parent's).
/// Nothing here unwinds: a panic while reporting (or dropping a panic's payload) gives
/// `fail` too.
pub(crate) fn guarded<T: Copy, E: std::fmt::Display>(
    op: &str,
    fail: T,
    f: impl FnOnce() -> Result<T, E>,
) -> T {
    let _ = OUT_OF_MEMORY.try_with(|o| o.set(false));
    if fork::in_child() {
        store_error(op, fork::REFUSAL, true);
        return fail;
    }
    let outcome = catch_unwind(AssertUnwindSafe(f));
    let reported = catch_unwind(AssertUnwindSafe(|| match outcome {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            set_last_error(op, &e.to_string());
            fail
        }
        Err(panic) => {
            set_last_error(op, &format!("panicked: {}", panic_message(&*panic)));
            // The payload is dropped inside this guard.
            drop(panic);
            fail
        }
    }));
    match reported {
        Ok(v) => v,
        Err(panic) => {
            // Its drop could panic again: it is leaked instead.
            std::mem::forget(panic);
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

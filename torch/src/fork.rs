//! `fork`: a child process of the one whose allocator started.
//!
//! A forked child has the parent's memory but none of its threads: the allocator's actors
//! and the workers of its runtime are not there, a lock another thread held at the fork
//! stays held, and the CUDA context cannot be used. A call into the parent's allocator
//! there could wait for ever for an actor's reply. So the first plugin of the process arms a
//! `pthread_atfork` handler that marks the child, and every entry point of a marked process
//! fails at once, touching nothing (see [`crate::abi::guarded`]): an allocation gives null
//! with [`REFUSAL`] as its error, a free leaks the block (its memory belongs to the parent,
//! which frees it), and the call is only counted, not written to stderr. Checking the mark is
//! one relaxed load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

/// The error of every call in a forked child.
pub(crate) const REFUSAL: &str = "this process was forked from the one whose pinpool allocator \
     started: the allocator (and CUDA) cannot be used after fork; start worker processes with \
     the 'spawn' or 'forkserver' method to use CUDA in them";

static FORKED: AtomicBool = AtomicBool::new(false);
static ARMED: Once = Once::new();

#[cfg(unix)]
extern "C" fn mark_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Arms the handler that marks a forked child (once per process; later calls do nothing).
pub(crate) fn arm() {
    ARMED.call_once(|| {
        #[cfg(unix)]
        {
            // SAFETY: `mark_child` is async-signal-safe (one atomic store) and lives for the
            // process; registering a handler has no other effect. It fails only for want of
            // memory, and a child is then not told apart (as before this module).
            let _ = unsafe { libc::pthread_atfork(None, None, Some(mark_child)) };
        }
    });
}

/// Whether this process is a child forked after the allocator's first plugin was made.
#[inline]
pub(crate) fn in_child() -> bool {
    FORKED.load(Ordering::Relaxed)
}

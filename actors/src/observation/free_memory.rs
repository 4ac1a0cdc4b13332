//! Free-memory callbacks: user code that may give memory back when a request finds none
//! (PyTorch's `FreeMemoryCallback` registry).
//!
//! Owns the registry of an allocator's callbacks and its counters. Each callback answers
//! whether it freed anything (PyTorch's `Execute() -> bool`). The miss path (`miss`) runs
//! them when a request found no cached block that fits and there is no room for fresh
//! memory (the device, or the cap, is full), before it empties the caches and gives up with
//! `OutOfMemory`. They run on a blocking thread, never on an executor thread or in an actor,
//! and hold nothing of the allocator's while they run; a callback that panics counts as
//! having freed nothing, and the panic is counted.
//!
//! Each refused request runs the list once, so requests refused at the same moment on
//! several threads run the callbacks concurrently (they are `Sync`: guard what they share).
//! A request made from inside a callback (on its thread) does not run them again: nested
//! runs would recurse, and the outer run is still freeing.
//!
//! The registry is an `ArcSwap` of an immutable list: attaching is rare, and running loads
//! the list once.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

/// A free-memory callback: frees what it can, and says whether it freed anything.
pub type FreeMemoryCallback = Arc<dyn Fn() -> bool + Send + Sync>;

/// The registry of an allocator's free-memory callbacks.
pub(crate) struct FreeMemoryCallbacks {
    list: ArcSwap<Vec<FreeMemoryCallback>>,
    /// Callback calls made (each callback of each run counts once).
    calls: AtomicU64,
    /// Calls that panicked.
    panics: AtomicU64,
}

impl Default for FreeMemoryCallbacks {
    fn default() -> Self {
        Self {
            list: ArcSwap::from_pointee(Vec::new()),
            calls: AtomicU64::new(0),
            panics: AtomicU64::new(0),
        }
    }
}

impl FreeMemoryCallbacks {
    /// Adds a callback; it runs after those attached before it.
    pub(crate) fn attach(&self, f: FreeMemoryCallback) {
        self.list.rcu(|list| {
            let mut list = Vec::clone(list);
            list.push(f.clone());
            list
        });
    }

    /// Whether no callback is attached (one load).
    pub(crate) fn is_empty(&self) -> bool {
        self.list.load().is_empty()
    }

    /// Runs every callback once, in the order they were attached; whether any of them freed
    /// something. Call it only where blocking is allowed (user code runs here).
    pub(crate) fn run(&self) -> bool {
        thread_local! {
            /// Set while this thread runs the callbacks.
            static RUNNING: Cell<bool> = const { Cell::new(false) };
        }
        struct Running;
        impl Drop for Running {
            fn drop(&mut self) {
                RUNNING.with(|r| r.set(false));
            }
        }
        if RUNNING.with(|r| r.replace(true)) {
            return false; // a request from inside a callback
        }
        let _running = Running;
        let list = self.list.load_full();
        let mut freed = false;
        for (i, f) in list.iter().enumerate() {
            self.calls.fetch_add(1, Ordering::Relaxed);
            match catch_unwind(AssertUnwindSafe(|| f())) {
                Ok(said) => freed |= said,
                Err(_) => {
                    self.panics.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        callback = i,
                        "a free-memory callback panicked; counted as freeing nothing"
                    );
                }
            }
        }
        tracing::debug!(callbacks = list.len(), freed, "free-memory callbacks ran");
        freed
    }

    /// Callback calls made so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Callback calls that panicked so far.
    pub(crate) fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_callback_runs_in_order_and_any_true_means_freed() {
        let reg = FreeMemoryCallbacks::default();
        assert!(reg.is_empty());
        assert!(!reg.run(), "no callback frees nothing");
        let order = Arc::new(AtomicUsize::new(0));
        let o = order.clone();
        reg.attach(Arc::new(move || {
            assert_eq!(o.fetch_add(1, Ordering::SeqCst), 0);
            false
        }));
        let o = order.clone();
        reg.attach(Arc::new(move || {
            assert_eq!(o.fetch_add(1, Ordering::SeqCst), 1);
            true
        }));
        assert!(reg.run());
        assert_eq!(order.load(Ordering::SeqCst), 2);
        assert_eq!(reg.calls(), 2);
    }

    #[test]
    fn a_panicking_callback_is_counted_and_the_others_still_run() {
        let reg = FreeMemoryCallbacks::default();
        reg.attach(Arc::new(|| panic!("callback failed")));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        reg.attach(Arc::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
            false
        }));
        assert!(!reg.run(), "a panic frees nothing");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(reg.panics(), 1);
        assert_eq!(reg.calls(), 2);
    }

    #[test]
    fn a_request_from_inside_a_callback_does_not_run_the_callbacks_again() {
        let reg = Arc::new(FreeMemoryCallbacks::default());
        let nested = Arc::downgrade(&reg);
        reg.attach(Arc::new(move || {
            let again = nested.upgrade().map(|r| r.run());
            assert_eq!(again, Some(false), "a nested run frees nothing");
            true
        }));
        assert!(reg.run());
        assert_eq!(reg.calls(), 1, "the nested run called nothing");
        assert!(reg.run(), "the next request runs them again");
        assert_eq!(reg.calls(), 2);
    }
}

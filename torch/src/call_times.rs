//! Time spent inside the alloc and free entry points, to tell the allocator's share of a
//! model's step from the rest of it.
//!
//! Counted only where the environment variable [`CALL_TIMES_ENV_VAR`] is `1` when the
//! library first asks (two clock reads per call then; one load of a flag otherwise), and
//! reported by `pinpool_memory_stats` as `alloc_calls`, `alloc_call_ns`, `free_calls` and
//! `free_call_ns` (absent when off). The time is the whole call as PyTorch sees it: the
//! context kept, the stream resolved, the cached path or the miss, the table of pointers.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

/// Set to `1`, the library times its alloc and free calls.
pub(crate) const CALL_TIMES_ENV_VAR: &str = "PINPOOL_TORCH_CALL_TIMES";

/// Calls of one entry point, and the nanoseconds they took.
pub(crate) struct Calls {
    count: AtomicI64,
    ns: AtomicI64,
}

impl Calls {
    const fn new() -> Self {
        Self {
            count: AtomicI64::new(0),
            ns: AtomicI64::new(0),
        }
    }

    /// Runs `f`, timed where `on` says so.
    fn time_if<T>(&self, on: bool, f: impl FnOnce() -> T) -> T {
        if !on {
            return f();
        }
        let t0 = Instant::now();
        let out = f();
        let ns = t0.elapsed().as_nanos().min(i64::MAX as u128) as i64;
        self.ns.fetch_add(ns, Relaxed);
        self.count.fetch_add(1, Relaxed);
        out
    }

    /// Runs `f`, timed where the environment asks for it.
    pub(crate) fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        self.time_if(enabled(), f)
    }
}

/// `pinpool_alloc`'s calls.
pub(crate) static ALLOC: Calls = Calls::new();
/// `pinpool_free`'s calls.
pub(crate) static FREE: Calls = Calls::new();

/// Whether the calls are timed (the environment, read once).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os(CALL_TIMES_ENV_VAR).is_some_and(|v| v == "1"))
}

/// The counts as statistics' keys and values; none when the calls are not timed.
pub(crate) fn report() -> Vec<(&'static str, i64)> {
    if !enabled() {
        return Vec::new();
    }
    vec![
        ("alloc_calls", ALLOC.count.load(Relaxed)),
        ("alloc_call_ns", ALLOC.ns.load(Relaxed)),
        ("free_calls", FREE.count.load(Relaxed)),
        ("free_call_ns", FREE.ns.load(Relaxed)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_calls_are_counted_with_their_time_and_untimed_ones_are_not() {
        let calls = Calls::new();
        assert_eq!(calls.time_if(false, || 3), 3);
        assert_eq!(calls.count.load(Relaxed), 0);
        let out = calls.time_if(true, || {
            std::thread::sleep(std::time::Duration::from_millis(2));
            4
        });
        assert_eq!(out, 4);
        assert_eq!(calls.count.load(Relaxed), 1);
        assert!(calls.ns.load(Relaxed) >= 2_000_000);
    }
}

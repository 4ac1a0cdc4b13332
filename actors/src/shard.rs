//! Per-thread shard selection: each thread gets a small number, fixed for its lifetime,
//! that picks its ready queues and its stats counters. Threads that share nothing on the
//! cached path touch different cache lines (invariant 5).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_NUMBER: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's number, handed out in order of first use.
#[inline]
pub(crate) fn thread_number() -> usize {
    THREAD_NUMBER.with(|n| {
        let v = n.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        n.set(v);
        v
    })
}

/// How many shards to make: the machine's parallelism rounded up to a power of two, capped.
pub(crate) fn default_shard_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(4)
        .next_power_of_two()
        .clamp(1, 64)
}

/// Pads a value to its own pair of cache lines (the adjacent-line prefetcher pulls in two).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

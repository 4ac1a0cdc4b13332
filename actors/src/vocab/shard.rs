//! Per-thread shard selection: each thread gets a small number, fixed for its lifetime,
//! that picks its ready slots and its stats counters. Threads that share nothing on the
//! cached path touch different cache lines (invariant 5).
//!
//! Numbers are handed out lowest-free-first and given back when the thread exits, so the
//! threads alive at one time hold distinct numbers. A thread whose number is below a pool's
//! shard count is therefore the only thread writing that shard: it may update its own
//! counters and fill its own slots with plain loads and stores instead of atomic
//! read-modify-writes (see [`ThreadSlot::owns`]). Other threads use atomic operations.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Numbers below this are recycled; beyond it (more live threads than that), numbers are
/// handed out once and never own a shard.
const RECYCLED: usize = 1024;
static IN_USE: [AtomicU64; RECYCLED / 64] = [const { AtomicU64::new(0) }; RECYCLED / 64];
static BEYOND: AtomicUsize = AtomicUsize::new(RECYCLED);

/// A thread's number; gives it back when the thread exits.
struct Held(usize);

impl Drop for Held {
    fn drop(&mut self) {
        // From now on this thread uses a number that owns nothing (`NUMBER` has no
        // destructor, so it stays usable while other thread-locals are destroyed).
        NUMBER.with(|n| n.set(BEYOND.fetch_add(1, Ordering::Relaxed)));
        if self.0 < RECYCLED {
            // Release: this thread's plain stores to its shards happen before the next
            // holder's claim (an acquiring read-modify-write of the same word).
            IN_USE[self.0 / 64].fetch_and(!(1u64 << (self.0 % 64)), Ordering::Release);
        }
    }
}

thread_local! {
    static NUMBER: Cell<usize> = const { Cell::new(usize::MAX) };
    static HELD: Held = Held(claim());
}

fn claim() -> usize {
    for (w, word) in IN_USE.iter().enumerate() {
        let mut bits = word.load(Ordering::Relaxed);
        while bits != u64::MAX {
            let bit = (!bits).trailing_zeros() as usize;
            match word.fetch_or(1 << bit, Ordering::Acquire) {
                prev if prev & (1 << bit) == 0 => return w * 64 + bit,
                prev => bits = prev,
            }
        }
    }
    BEYOND.fetch_add(1, Ordering::Relaxed)
}

/// This thread's number: distinct among live threads (below 1024 of them).
#[inline]
pub(crate) fn thread_number() -> usize {
    let v = NUMBER.with(|n| n.get());
    if v != usize::MAX {
        return v;
    }
    thread_number_slow()
}

#[cold]
fn thread_number_slow() -> usize {
    // `HELD` gives the number back at thread exit. During thread-local destruction (a buffer
    // dropped from another thread-local's destructor) it may be gone: such a thread gets a
    // number that never owns a shard.
    let v = HELD
        .try_with(|h| h.0)
        .unwrap_or_else(|_| BEYOND.fetch_add(1, Ordering::Relaxed));
    NUMBER.with(|n| n.set(v));
    v
}

/// Where this thread stands in a pool with `mask + 1` shards.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ThreadSlot {
    /// The shard it uses.
    pub(crate) shard: usize,
    /// Whether no other live thread uses that shard.
    pub(crate) owns: bool,
}

impl ThreadSlot {
    #[inline]
    pub(crate) fn current(mask: usize) -> Self {
        let n = thread_number();
        Self {
            shard: n & mask,
            owns: n <= mask,
        }
    }
}

/// How many shards to make: twice the machine's parallelism, rounded up to a power of two,
/// capped. Numbers go to every thread that touches a pool (actors, the poller, tokio
/// workers, blocking threads) as well as to the application's, so one shard per core would
/// leave some of a full set of application threads sharing shards.
pub(crate) fn default_shard_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(4)
        .saturating_mul(2)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_threads_hold_distinct_numbers_and_exited_threads_give_theirs_back() {
        let mine = thread_number();
        let theirs: Vec<usize> = (0..8)
            .map(|_| std::thread::spawn(thread_number))
            .map(|h| h.join().unwrap())
            .collect();
        assert!(theirs.iter().all(|&n| n != mine));
        // Each thread exited before the next began, so numbers were recycled: at most a
        // few distinct ones (other tests' threads may come and go at the same time).
        let mut distinct = theirs.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() < theirs.len(), "{theirs:?}");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let b = barrier.clone();
                std::thread::spawn(move || {
                    let n = thread_number();
                    b.wait();
                    n
                })
            })
            .collect();
        let mut together: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        together.sort_unstable();
        together.dedup();
        assert_eq!(
            together.len(),
            4,
            "threads alive together never share a number"
        );
    }
}

//! Who took a buffer: the tokio task that asked for it or, outside any task, the thread.
//!
//! Owns the numbering. Each block lent carries its taker's number in its record
//! ([`crate::statistics::meta::BlockMeta::held_by`]) until its buffer is dropped, so that a
//! request that waits long under a cap can tell the memory its own task (or thread) took
//! from what others took (see `long_wait`). The number of a task is its tokio task id; a
//! thread gets one from a counter the first time it asks. Finding it costs a read of
//! tokio's thread-local and, on a thread outside any task, of one of ours.

use std::cell::Cell;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// The number of nobody: a block not lent.
pub(crate) const NOBODY: u64 = 0;

/// Source of the threads' numbers.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's number (0: none yet).
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

/// The number of the calling task or, outside any task, of the calling thread: never
/// [`NOBODY`], and never a task's and a thread's alike (tasks' are even, threads' odd).
#[inline]
pub(crate) fn current() -> u64 {
    match tokio::task::try_id() {
        Some(task) => task_number(task) << 1,
        None => (thread_number() << 1) | 1,
    }
}

/// The task id as a number (tokio gives it out only through `Hash`; ids start at 1).
#[inline]
fn task_number(task: tokio::task::Id) -> u64 {
    /// A hasher that keeps the one number written to it.
    struct Keep(u64);
    impl Hasher for Keep {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = self.0.rotate_left(8) ^ u64::from(b);
            }
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = n;
        }
    }
    let mut h = Keep(0);
    task.hash(&mut h);
    h.0.max(1)
}

#[cold]
fn new_thread_number() -> u64 {
    let n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
    THREAD.with(|c| c.set(n));
    n
}

#[inline]
fn thread_number() -> u64 {
    match THREAD.with(Cell::get) {
        0 => new_thread_number(),
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_and_tasks_have_numbers_of_their_own_that_stay_the_same() {
        let me = current();
        assert_ne!(me, NOBODY);
        assert_eq!(me, current());
        let other = std::thread::spawn(current).join().unwrap();
        assert_ne!(other, me);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (a, a_again, b) = rt.block_on(async {
            let a = tokio::spawn(async { (current(), current()) });
            let b = tokio::spawn(async { current() });
            let (a, a_again) = a.await.unwrap();
            (a, a_again, b.await.unwrap())
        });
        assert_eq!(a, a_again);
        assert!(a != b && a != me && b != me);
        assert_eq!(a & 1, 0, "a task's number is even");
        assert_eq!(me & 1, 1, "a thread's number is odd");
        // Outside any task, the runtime's block_on is its thread's.
        assert_eq!(rt.block_on(async { current() }), me);
    }
}

//! Keeps a pool's shared state alive across a free on the cached path without touching its
//! reference count.
//!
//! A freed block moves into its pool's ready holder; once it is there another thread may take
//! it, and after the allocator is dropped the pool actor may free it and let the pool's
//! shared state go. The freeing thread must not be left holding a dangling reference in the
//! middle of the send. Cloning the `Arc` on every free would make every thread write one
//! shared cache line (against invariant 5), so each thread keeps its own strong reference to
//! each pool it frees into, taken once, and lets it go when the pool has been dropped by
//! everyone else or the thread exits.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::Arc;

type Held = Arc<dyn Any + Send + Sync>;

thread_local! {
    static LAST: Cell<usize> = const { Cell::new(0) };
    static HELD: RefCell<Vec<(usize, Held)>> = const { RefCell::new(Vec::new()) };
}

/// How many pools a thread holds before it drops the ones nobody else holds.
const PRUNE_AT: usize = 8;

/// Makes sure this thread holds a strong reference to `arc` until at least its next call of
/// `ensure` for another value; returns immediately when it already does.
#[inline]
pub(crate) fn ensure<T: Send + Sync + 'static>(arc: &Arc<T>) {
    let key = Arc::as_ptr(arc) as *const () as usize;
    if LAST.with(|l| l.get()) == key {
        return;
    }
    ensure_slow(arc, key);
}

#[cold]
fn ensure_slow<T: Send + Sync + 'static>(arc: &Arc<T>, key: usize) {
    HELD.with(|held| {
        let mut held = held.borrow_mut();
        if !held.iter().any(|(k, _)| *k == key) {
            if held.len() >= PRUNE_AT {
                // Only entries that nobody else holds can go: their pools are finished.
                held.retain(|(_, h)| Arc::strong_count(h) > 1);
            }
            held.push((key, arc.clone() as Held));
        }
    });
    LAST.with(|l| l.set(key));
}

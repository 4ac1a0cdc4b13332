//! The memory limit's books: one budget of reserved bytes shared by every pool of an
//! allocator, and the registry of those pools.
//!
//! Owns the cap, the bytes reserved, how many requests wait for room, how many captures are
//! underway, the registry of the allocator's pools (as [`Member`]s, so that this module knows nothing of pools), and the
//! allocator's free-memory callbacks (run by `miss` before it gives up). A pool
//! reserves a block's bytes here, atomically, before it asks for fresh memory, and gives them
//! back when the memory goes back (invariant 2: the budget's reserved bytes are the pools'
//! reserved bytes). While any request waits for room anywhere, every member's pressure flag
//! is set: frees go to the pool actors instead of the ready holder, so that a returned block
//! is handed straight to a queued request or freed to make room (see `miss` and the pool actor's
//! `queue`). Without queued requests the cached path reads the flag it always read and does nothing
//! more (invariant 5).
//!
//! Also owns what requests for several buffers at once (`engine::many`) wait on: the
//! budget's turn (a fair FIFO queue of such requests; the one at its head is the only one
//! that tries and waits for room under this budget) and the count of blocks that came home
//! under pressure, with the notification that wakes the head when it grows.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::observation::free_memory::FreeMemoryCallbacks;
use crate::vocab::loom::{fence, AtomicUsize};

/// What `empty_cache` did to one pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmptyReport {
    /// Blocks given back to their memory source.
    pub freed_blocks: usize,
    /// Bytes given back to their memory source.
    pub freed_bytes: usize,
    /// Bytes the pool still holds afterwards.
    pub reserved_after: usize,
}

impl EmptyReport {
    /// Adds another pool's report into this one.
    pub fn merge(&mut self, other: &EmptyReport) {
        self.freed_blocks += other.freed_blocks;
        self.freed_bytes += other.freed_bytes;
        self.reserved_after += other.reserved_after;
    }
}

/// A pool as the budget sees it.
pub(crate) trait Member: Send + Sync {
    /// Sets (or clears) the pool's pressure flag: while it is set, frees go to its actor.
    fn set_pressure(&self, on: bool);
    /// Asks the pool to look at its queued requests again (room was made somewhere).
    fn nudge(&self);
    /// Asks the pool to give back up to `upto` bytes of its cache (`usize::MAX`: all of
    /// it); the reply comes on the receiver (`None`: the pool has stopped).
    fn ask_to_empty(&self, upto: usize) -> Option<flume::Receiver<EmptyReport>>;
    /// The pool itself, for a pool of the same allocator that knows its concrete type (a
    /// stream's pool borrowing memory from another's).
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

/// The cap value that means "no limit".
const NO_LIMIT: usize = usize::MAX;

/// The allocator-wide budget of reserved bytes and the registry of its pools.
pub(crate) struct Budget {
    limit: AtomicUsize,
    reserved: AtomicUsize,
    /// Requests queued in any pool.
    queued: AtomicUsize,
    /// How long `alloc` waits for room by default (`None`: as long as it takes).
    pub(crate) default_timeout: Option<Duration>,
    /// Thread shards of the ready holder and stats (reported by snapshots).
    pub(crate) shards: usize,
    /// Name of the size policy (reported by snapshots).
    pub(crate) policy: &'static str,
    pools: ArcSwap<Vec<Weak<dyn Member>>>,
    /// The most bytes reserved at once since the last `reset_peak` (exact: every pool
    /// reserves here before it takes memory, off the cached path).
    peak: AtomicUsize,
    /// What a request runs when no cached block fits and there is no room (see `miss`).
    pub(crate) free_memory: FreeMemoryCallbacks,
    /// This budget's place in the order in which a request for several buffers takes the
    /// turns of the budgets it spans (unique in the process).
    pub(crate) id: u64,
    /// The turn of requests for several buffers: one permit, handed out first come first
    /// served (tokio's semaphore is fair); its holder is the head of the queue. It guards no
    /// state: it only orders the queued requests.
    pub(crate) turn: tokio::sync::Semaphore,
    /// Blocks that came home to a pool actor (`take_back`), and changes of the cap: what a
    /// waiting head counts to know that room may have been made.
    returns: AtomicU64,
    /// Wakes the waiting heads when `returns` grows.
    changed: tokio::sync::Notify,
    /// Captures underway on the allocator's memory (`begin_allocate_to_pool` without its
    /// `end_allocate_to_pool` yet), as the router last published them.
    captures: AtomicUsize,
    /// Set once a buffer was dropped by another task or thread than the one that took it:
    /// buffers move between holders here, so what a task took is not known to be what it
    /// holds (see `long_wait`).
    handed_over: AtomicBool,
}

/// Source of [`Budget::id`].
static NEXT_BUDGET: AtomicU64 = AtomicU64::new(0);

impl Budget {
    pub(crate) fn new(
        limit: Option<usize>,
        default_timeout: Option<Duration>,
        shards: usize,
        policy: &'static str,
    ) -> Self {
        Self {
            limit: AtomicUsize::new(limit.unwrap_or(NO_LIMIT)),
            reserved: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            default_timeout,
            shards,
            policy,
            pools: ArcSwap::from_pointee(Vec::new()),
            peak: AtomicUsize::new(0),
            free_memory: FreeMemoryCallbacks::default(),
            id: NEXT_BUDGET.fetch_add(1, Ordering::Relaxed),
            turn: tokio::sync::Semaphore::new(1),
            returns: AtomicU64::new(0),
            changed: tokio::sync::Notify::new(),
            captures: AtomicUsize::new(0),
            handed_over: AtomicBool::new(false),
        }
    }

    /// The router's count of captures underway.
    pub(crate) fn set_captures(&self, n: usize) {
        self.captures.store(n, Ordering::SeqCst);
    }

    /// Whether a capture is underway: no cache is emptied to make room meanwhile, since
    /// giving device memory back synchronises the device, which would invalidate the
    /// capture (see `miss`).
    pub(crate) fn capturing(&self) -> bool {
        self.captures.load(Ordering::SeqCst) > 0
    }

    /// A buffer was dropped by another task or thread than the one that took it.
    #[cold]
    pub(crate) fn note_handed_over(&self) {
        if !self.handed_over.load(Ordering::Relaxed) {
            self.handed_over.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a buffer was ever dropped by another task or thread than the one that took
    /// it.
    pub(crate) fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::Relaxed)
    }

    /// The cap on reserved bytes, if any.
    pub(crate) fn limit(&self) -> Option<usize> {
        match self.limit.load(Ordering::Relaxed) {
            NO_LIMIT => None,
            l => Some(l),
        }
    }

    /// Changes the cap; queued requests are looked at again (a higher cap may let them in).
    pub(crate) fn set_limit(&self, limit: Option<usize>) {
        self.limit
            .store(limit.unwrap_or(NO_LIMIT), Ordering::SeqCst);
        self.nudge();
        self.came_home();
    }

    /// A block came home to a pool actor (or the cap changed): a waiting head may find room
    /// now.
    pub(crate) fn came_home(&self) {
        self.returns.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// How many blocks came home (and cap changes) so far.
    pub(crate) fn returns(&self) -> u64 {
        self.returns.load(Ordering::SeqCst)
    }

    /// The notification [`Budget::came_home`] sends (enable it before reading
    /// [`Budget::returns`], so that no wake-up is lost).
    pub(crate) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Bytes reserved by all pools together.
    pub(crate) fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` if the cap allows it.
    pub(crate) fn try_reserve(&self, bytes: usize) -> bool {
        let limit = self.limit.load(Ordering::Relaxed);
        match self
            .reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| {
                r.checked_add(bytes).filter(|&t| t <= limit)
            }) {
            Ok(before) => {
                self.peak.fetch_max(before + bytes, Ordering::Relaxed);
                true
            }
            Err(_) => false,
        }
    }

    /// Reserves `bytes` whatever the cap (the runtime rounded an allocation up).
    pub(crate) fn force_reserve(&self, bytes: usize) {
        let before = self.reserved.fetch_add(bytes, Ordering::SeqCst);
        self.peak
            .fetch_max(before.saturating_add(bytes), Ordering::Relaxed);
    }

    /// The most bytes reserved at once since the last [`Budget::reset_peak`].
    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed).max(self.reserved())
    }

    /// Starts the peak over from the bytes reserved now.
    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.reserved(), Ordering::Relaxed);
    }

    /// Gives back `bytes`; wakes the pools whose requests wait.
    pub(crate) fn release(&self, bytes: usize) {
        self.reserved.fetch_sub(bytes, Ordering::SeqCst);
        if self.under_pressure() {
            self.nudge();
        }
    }

    /// Requests queued for room, in all pools together.
    pub(crate) fn waiting(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether some request waits for room in some pool.
    pub(crate) fn under_pressure(&self) -> bool {
        self.queued.load(Ordering::SeqCst) > 0
    }

    /// A pool queued a request.
    pub(crate) fn queued_added(&self) {
        if self.queued.fetch_add(1, Ordering::SeqCst) == 0 {
            self.sync_flags();
        }
    }

    /// A pool served, failed or dropped a queued request.
    pub(crate) fn queued_removed(&self) {
        if self.queued.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.sync_flags();
        }
    }

    /// Adds a pool to the registry (dropping pools that are gone).
    pub(crate) fn register<M: Member + 'static>(&self, pool: &Arc<M>) {
        let weak: Weak<dyn Member> = Arc::downgrade(pool) as Weak<dyn Member>;
        self.pools.rcu(|pools| {
            let mut v: Vec<_> = pools
                .iter()
                .filter(|p| p.strong_count() > 0)
                .cloned()
                .collect();
            v.push(weak.clone());
            v
        });
        self.sync_flags();
    }

    /// Every pool alive, in the order they were made (the default pool first).
    pub(crate) fn pools(&self) -> Vec<Arc<dyn Member>> {
        self.pools.load().iter().filter_map(Weak::upgrade).collect()
    }

    /// Makes every pool's pressure bit say whether requests wait. Whoever changes the count
    /// of queued requests from or to zero calls this; each call checks after writing that the count
    /// still agrees with what it wrote, so the last writer always writes the truth.
    fn sync_flags(&self) {
        loop {
            // The fences order each writer's count change, flag writes and re-check in one
            // total order with the other writers' (sequentially consistent loads and stores
            // alone are not enough under the C++ model as loom checks it: a re-check could
            // read a stale count, and the last flag written be the wrong one).
            fence(Ordering::SeqCst);
            let on = self.under_pressure();
            for p in self.pools() {
                p.set_pressure(on);
            }
            fence(Ordering::SeqCst);
            if self.under_pressure() == on {
                break;
            }
        }
    }

    /// Asks every pool with queued requests to look at them again.
    pub(crate) fn nudge(&self) {
        for p in self.pools() {
            p.nudge();
        }
    }
}

/// Models of the budget under loom (`scripts/loom.sh`).
#[cfg(all(test, pinpool_loom))]
mod loom_models {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    #[test]
    fn two_reservations_that_together_pass_the_cap_never_both_succeed() {
        loom::model(|| {
            let budget = Arc::new(Budget::new(Some(100), None, 1, "test"));
            let b1 = budget.clone();
            let other = thread::spawn(move || b1.try_reserve(60));
            let mine = budget.try_reserve(60);
            let theirs = other.join().unwrap();
            assert!(
                mine ^ theirs,
                "exactly one of two 60-byte reservations fits in 100"
            );
            assert_eq!(budget.reserved(), 60);
            assert!(budget.peak() <= 100);
            budget.release(60);
            assert_eq!(budget.reserved(), 0);
        });
    }

    struct Flag(AtomicBool);

    impl Member for Flag {
        fn set_pressure(&self, on: bool) {
            self.0.store(on, Ordering::SeqCst);
        }
        fn nudge(&self) {}
        fn ask_to_empty(&self, _upto: usize) -> Option<flume::Receiver<EmptyReport>> {
            None
        }
        fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
            self
        }
    }

    #[test]
    fn the_pressure_flag_ends_on_exactly_while_a_request_still_waits() {
        loom::model(|| {
            let budget = Arc::new(Budget::new(Some(100), None, 1, "test"));
            let pool = Arc::new(Flag(AtomicBool::new(false)));
            budget.register(&pool);
            let b1 = budget.clone();
            let other = thread::spawn(move || {
                b1.queued_added();
                b1.queued_removed();
            });
            budget.queued_added();
            other.join().unwrap();
            assert!(
                pool.0.load(Ordering::SeqCst),
                "a request still waits: frees must go to the actors"
            );
            budget.queued_removed();
            assert!(!pool.0.load(Ordering::SeqCst));
        });
    }
}

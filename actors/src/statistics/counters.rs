//! Counters: the plain statistics reports are made of ([`Stat`], [`DurationStat`]), and the
//! atomic cells that keep them — written by one actor ([`AtomicStat`], [`AtomicDuration`]),
//! summed from any thread ([`AtomicNanos`]), or
//! on the cached path by one thread shard each ([`ShardStat`], whose peaks the ledger in
//! [`crate::statistics::peaks`] keeps).

use std::sync::atomic::{
    AtomicI64,
    Ordering::{Relaxed, SeqCst},
};
use std::time::{Duration, Instant};

/// One statistic: its current value, its peak, and the totals added and removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last `reset_peak_stats`.
    pub peak: i64,
    /// Total added since the last `reset_accumulated_stats`.
    pub allocated: i64,
    /// Total removed since the last `reset_accumulated_stats`.
    pub freed: i64,
}

impl Stat {
    pub(crate) fn add(&mut self, o: &Stat) {
        self.current += o.current;
        self.peak += o.peak;
        self.allocated += o.allocated;
        self.freed += o.freed;
    }
}

/// Timing of slow calls, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DurationStat {
    /// Sum of all durations.
    pub total: i64,
    /// Longest duration.
    pub max: i64,
    /// Shortest duration (0 when `count` is 0).
    pub min: i64,
    /// Number of calls timed.
    pub count: i64,
    /// `total / count` (0 when `count` is 0).
    pub avg: i64,
}

impl DurationStat {
    pub(crate) fn merge(&mut self, o: &DurationStat) {
        if o.count == 0 {
            return;
        }
        self.min = if self.count == 0 {
            o.min
        } else {
            self.min.min(o.min)
        };
        self.max = self.max.max(o.max);
        self.total += o.total;
        self.count += o.count;
        self.avg = self.total / self.count;
    }
}

/// A statistic kept in atomics.
#[derive(Debug, Default)]
pub(crate) struct AtomicStat {
    current: AtomicI64,
    peak: AtomicI64,
    allocated: AtomicI64,
    freed: AtomicI64,
}

impl AtomicStat {
    #[inline]
    pub(crate) fn increase(&self, n: i64) {
        self.allocated.fetch_add(n, Relaxed);
        let now = self.current.fetch_add(n, Relaxed) + n;
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
    }

    #[inline]
    pub(crate) fn decrease(&self, n: i64) {
        self.freed.fetch_add(n, Relaxed);
        self.current.fetch_sub(n, Relaxed);
    }

    pub(crate) fn read(&self) -> Stat {
        Stat {
            current: self.current.load(Relaxed),
            peak: self.peak.load(Relaxed),
            allocated: self.allocated.load(Relaxed),
            freed: self.freed.load(Relaxed),
        }
    }

    pub(crate) fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }

    pub(crate) fn reset_accumulated(&self) {
        self.allocated.store(0, Relaxed);
        self.freed.store(0, Relaxed);
    }
}

/// A statistic of the cached path, kept in one thread shard (a leaf of
/// [`crate::statistics::peaks::Ledger`]). The thread that owns the shard (see
/// [`crate::vocab::shard::ThreadSlot`]) changes `allocated` and `freed` with plain loads and stores;
/// other threads add to `remote_allocated`/`remote_freed` atomically. `current` is derived,
/// and `reset_accumulated` records baselines instead of writing the owner's counters. Its
/// peak is kept by the ledger's books, from its allowances: one for the owner's side of the
/// count and one for the other threads' side, so that each side checks only what its own
/// writers wrote (an owner's plain store and another thread's add to the same count do not
/// see each other at once).
#[derive(Debug, Default)]
pub(crate) struct ShardStat {
    allocated: AtomicI64,
    freed: AtomicI64,
    remote_allocated: AtomicI64,
    remote_freed: AtomicI64,
    /// What the ledger lets the owner's side reach without asking it.
    owner_allowance: AtomicI64,
    /// What the ledger lets the other threads' side reach without asking it.
    remote_allowance: AtomicI64,
    base_allocated: AtomicI64,
    base_freed: AtomicI64,
}

impl ShardStat {
    /// One side of the count now (`owner`: the owner's). Removals are read first: each total
    /// only grows, so a change made while it reads can make the result too high, never too
    /// low.
    #[inline]
    fn side(&self, owner: bool) -> i64 {
        if owner {
            let f = self.freed.load(Relaxed);
            self.allocated.load(Relaxed) - f
        } else {
            let f = self.remote_freed.load(SeqCst);
            self.remote_allocated.load(SeqCst) - f
        }
    }

    /// All added and all removed, both sides.
    #[inline]
    fn totals(&self) -> (i64, i64) {
        (
            self.allocated.load(Relaxed) + self.remote_allocated.load(Relaxed),
            self.freed.load(Relaxed) + self.remote_freed.load(Relaxed),
        )
    }

    fn side_allowance(&self, owner: bool) -> &AtomicI64 {
        if owner {
            &self.owner_allowance
        } else {
            &self.remote_allowance
        }
    }

    /// Adds `n`; `owner` says whether the calling thread owns the shard.
    #[inline]
    pub(crate) fn increase(&self, n: i64, owner: bool) {
        if owner {
            self.allocated
                .store(self.allocated.load(Relaxed) + n, Relaxed);
        } else {
            // Sequentially consistent: the adds of the other threads are in one order, and
            // each comes before the looks at the ledger's marks that follow (see
            // `crate::statistics::peaks`).
            self.remote_allocated.fetch_add(n, SeqCst);
        }
    }

    /// Removes `n`; `owner` says whether the calling thread owns the shard.
    #[inline]
    pub(crate) fn decrease(&self, n: i64, owner: bool) {
        if owner {
            self.freed.store(self.freed.load(Relaxed) + n, Relaxed);
        } else {
            self.remote_freed.fetch_add(n, SeqCst);
        }
    }

    /// Takes back an add of `n` whose removal was already counted (a block lent and taken
    /// back before its requester saw it): both totals lose `n`, as if neither had happened.
    /// The removal goes first, so that a read meanwhile sees the count too high, never too
    /// low (see [`ShardStat::side`]).
    #[inline]
    pub(crate) fn retract(&self, n: i64, owner: bool) {
        self.decrease(-n, owner);
        self.increase(-n, owner);
    }

    /// Whether the `owner`'s (or the other threads') side of the count is within its
    /// allowance.
    #[inline]
    pub(crate) fn covered(&self, owner: bool) -> bool {
        self.side(owner) <= self.side_allowance(owner).load(Relaxed)
    }

    /// How far one side of the count is above its allowance (negative: slack).
    pub(crate) fn excess(&self, owner: bool) -> i64 {
        self.side(owner) - self.side_allowance(owner).load(Relaxed)
    }

    /// Both allowances together.
    pub(crate) fn allowance(&self) -> i64 {
        self.owner_allowance.load(Relaxed) + self.remote_allowance.load(Relaxed)
    }

    /// Adds `d` to one side's allowance.
    pub(crate) fn grant(&self, owner: bool, d: i64) {
        let a = self.side_allowance(owner);
        a.store(a.load(Relaxed) + d, Relaxed);
    }

    /// Sets both allowances to 0 (the count leaves the books).
    pub(crate) fn clear_allowances(&self) {
        self.owner_allowance.store(0, Relaxed);
        self.remote_allowance.store(0, Relaxed);
    }

    /// The statistic, with no peak (the ledger's books have it).
    pub(crate) fn read(&self) -> Stat {
        let (a, f) = self.totals();
        Stat {
            current: a - f,
            peak: 0,
            allocated: a - self.base_allocated.load(Relaxed),
            freed: f - self.base_freed.load(Relaxed),
        }
    }

    pub(crate) fn reset_accumulated(&self) {
        let (a, f) = self.totals();
        self.base_allocated.store(a, Relaxed);
        self.base_freed.store(f, Relaxed);
    }
}

/// Timings kept in atomics (microseconds).
#[derive(Debug)]
pub(crate) struct AtomicDuration {
    total: AtomicI64,
    max: AtomicI64,
    min: AtomicI64,
    count: AtomicI64,
}

impl Default for AtomicDuration {
    fn default() -> Self {
        Self {
            total: AtomicI64::new(0),
            max: AtomicI64::new(0),
            min: AtomicI64::new(i64::MAX),
            count: AtomicI64::new(0),
        }
    }
}

impl AtomicDuration {
    pub(crate) fn record(&self, d: Duration) {
        let us = d.as_micros().min(i64::MAX as u128) as i64;
        self.total.fetch_add(us, Relaxed);
        self.max.fetch_max(us, Relaxed);
        self.min.fetch_min(us, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    pub(crate) fn read(&self) -> DurationStat {
        let count = self.count.load(Relaxed);
        let total = self.total.load(Relaxed);
        DurationStat {
            total,
            max: self.max.load(Relaxed),
            min: if count == 0 {
                0
            } else {
                self.min.load(Relaxed)
            },
            count,
            avg: if count == 0 { 0 } else { total / count },
        }
    }

    pub(crate) fn reset(&self) {
        self.total.store(0, Relaxed);
        self.max.store(0, Relaxed);
        self.min.store(i64::MAX, Relaxed);
        self.count.store(0, Relaxed);
    }
}

/// A sum of elapsed times in nanoseconds, added to from any thread.
#[derive(Debug, Default)]
pub(crate) struct AtomicNanos(AtomicI64);

/// Adds the time from its making (`AtomicNanos::time`) to its drop to its sum: a piece of
/// work that returns early, fails or is cancelled counts alike.
pub(crate) struct Timed<'a> {
    total: &'a AtomicNanos,
    start: Instant,
}

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        let ns = self.start.elapsed().as_nanos().min(i64::MAX as u128) as i64;
        self.total.0.fetch_add(ns, Relaxed);
    }
}

impl AtomicNanos {
    /// Times from now until the returned guard is dropped.
    pub(crate) fn time(&self) -> Timed<'_> {
        Timed {
            total: self,
            start: Instant::now(),
        }
    }

    pub(crate) fn read(&self) -> i64 {
        self.0.load(Relaxed)
    }

    pub(crate) fn reset(&self) {
        self.0.store(0, Relaxed);
    }
}

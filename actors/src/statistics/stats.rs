//! Statistics with the meaning of `torch.cuda.host_memory_stats()`.
//!
//! Host allocations (`allocations`, `allocated_bytes`, timings) are written only by their
//! pool actor. Active requests and bytes change on the cached path, so they live in
//! per-thread shards: a block's counters are charged to the shard of the thread that took it,
//! and credited back to the same shard when it becomes reusable. `current` is exact at
//! quiescent points; `peak` is the most the shards held at once, kept by the engine's
//! [`crate::statistics::peaks::Ledger`] for each group of pools (a capture pool, the default pool with
//! the stream pools, the whole engine).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use std::sync::Arc;

use crate::statistics::counters::{AtomicDuration, AtomicNanos, AtomicStat, DurationStat, Stat};
use crate::statistics::device_stats::{Detail, DeviceStats};
use crate::statistics::peaks::{Group, Leaves, Ledger, ACTIVE, ACTIVE_BYTES, ALL, BYTES, REQUESTS};
use crate::vocab::shard::ThreadSlot;

/// A statistics report for one pool or for the whole allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Host allocations (segments of pinned memory) held.
    pub allocations: Stat,
    /// Bytes of pinned memory held.
    pub allocated_bytes: Stat,
    /// Blocks handed out and not yet reusable (in use, or waiting on events). Its
    /// `allocated` count is the buffers requesters received: buffers a `BufferSet` took and
    /// gave back, because another of its buffers found no room, are not counted.
    pub active_requests: Stat,
    /// Bytes of the blocks counted by `active_requests`.
    pub active_bytes: Stat,
    /// Calls that took fresh pinned memory.
    pub num_host_alloc: i64,
    /// Calls that gave pinned memory back.
    pub num_host_free: i64,
    /// Pieces of pinned memory moved to another place of the allocator's reserved range
    /// instead of being given back and taken again (pinpool's own count; not in
    /// `num_host_alloc`).
    pub num_host_remaps: i64,
    /// Time spent taking fresh pinned memory.
    pub host_alloc_time: DurationStat,
    /// Time spent giving pinned memory back.
    pub host_free_time: DurationStat,
    /// Blocks freed by their users that wait for recorded events to complete.
    pub waiting_blocks: i64,
    /// Bytes of `waiting_blocks`.
    pub waiting_bytes: i64,
    /// Blocks used by captured work and kept for graph replays while their pool lives.
    pub kept_blocks: i64,
    /// Bytes of `kept_blocks`.
    pub kept_bytes: i64,
    /// Fresh allocations retried after emptying the cache.
    pub num_alloc_retries: i64,
    /// Requests that failed for want of memory.
    pub num_ooms: i64,
    /// Requests the cache could not serve at once (misses), counted again when one asked
    /// anew after room was made (pinpool's own count).
    pub num_misses: i64,
    /// Nanoseconds requests spent on misses, from the miss to holding the buffer (or the
    /// error), each request once however often it asked; making room and waiting under the
    /// cap included (pinpool's own count).
    pub miss_wait_ns: i64,
    /// Nanoseconds the allocator's actors spent serving those misses, from taking each
    /// request until it is answered, queued for room or refused (pinpool's own count): what
    /// `miss_wait_ns` has over it is the hand-offs between threads and the time queued.
    pub miss_serve_ns: i64,
    /// The cap on reserved bytes of the whole allocator, if one is set.
    pub limit_bytes: Option<i64>,
}

impl HostStats {
    /// Adds another report into this one (for the aggregate over pools).
    pub fn merge(&mut self, o: &HostStats) {
        self.allocations.add(&o.allocations);
        self.allocated_bytes.add(&o.allocated_bytes);
        self.active_requests.add(&o.active_requests);
        self.active_bytes.add(&o.active_bytes);
        self.num_host_alloc += o.num_host_alloc;
        self.num_host_free += o.num_host_free;
        self.num_host_remaps += o.num_host_remaps;
        self.num_misses += o.num_misses;
        self.miss_wait_ns += o.miss_wait_ns;
        self.miss_serve_ns += o.miss_serve_ns;
        self.host_alloc_time.merge(&o.host_alloc_time);
        self.host_free_time.merge(&o.host_free_time);
        self.waiting_blocks += o.waiting_blocks;
        self.waiting_bytes += o.waiting_bytes;
        self.kept_blocks += o.kept_blocks;
        self.kept_bytes += o.kept_bytes;
        self.num_alloc_retries += o.num_alloc_retries;
        self.num_ooms += o.num_ooms;
        self.limit_bytes = self.limit_bytes.or(o.limit_bytes);
    }

    /// Sets the peaks of the active counts to those of `group`'s books, kept under `kinds`
    /// (see [`PoolStats::active_kinds`]).
    pub(crate) fn set_peaks(&mut self, group: &Group, kinds: (usize, usize)) {
        let (requests, bytes) = kinds;
        self.active_requests.peak = group.peak(requests, ALL).max(self.active_requests.current);
        self.active_bytes.peak = group.peak(bytes, ALL).max(self.active_bytes.current);
    }

    /// Bytes cached: reserved, but neither active nor kept.
    pub fn cached_bytes(&self) -> i64 {
        self.allocated_bytes.current - self.active_bytes.current - self.kept_bytes
    }

    /// A flat view whose keys match `torch.cuda.host_memory_stats()`
    /// (`allocations.current`, `host_alloc_time.avg`, …), plus pinpool's own counts.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        for (name, s) in [
            ("allocations", &self.allocations),
            ("allocated_bytes", &self.allocated_bytes),
            ("active_requests", &self.active_requests),
            ("active_bytes", &self.active_bytes),
        ] {
            m.insert(format!("{name}.current"), s.current);
            m.insert(format!("{name}.peak"), s.peak);
            m.insert(format!("{name}.allocated"), s.allocated);
            m.insert(format!("{name}.freed"), s.freed);
        }
        for (name, t) in [
            ("host_alloc_time", &self.host_alloc_time),
            ("host_free_time", &self.host_free_time),
        ] {
            m.insert(format!("{name}.total"), t.total);
            m.insert(format!("{name}.max"), t.max);
            m.insert(format!("{name}.min"), t.min);
            m.insert(format!("{name}.count"), t.count);
            m.insert(format!("{name}.avg"), t.avg);
        }
        for (k, v) in [
            ("num_host_alloc", self.num_host_alloc),
            ("num_host_free", self.num_host_free),
            ("num_host_remaps", self.num_host_remaps),
            ("waiting_blocks", self.waiting_blocks),
            ("waiting_bytes", self.waiting_bytes),
            ("kept_blocks", self.kept_blocks),
            ("kept_bytes", self.kept_bytes),
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_misses", self.num_misses),
            ("miss_wait_ns", self.miss_wait_ns),
            ("miss_serve_ns", self.miss_serve_ns),
        ] {
            m.insert(k.to_string(), v);
        }
        if let Some(l) = self.limit_bytes {
            m.insert("limit_bytes".to_string(), l);
        }
        m
    }
}

/// The books of one pool.
#[derive(Debug)]
pub(crate) struct PoolStats {
    pub(crate) allocations: AtomicStat,
    pub(crate) allocated_bytes: AtomicStat,
    pub(crate) host_alloc_time: AtomicDuration,
    pub(crate) host_free_time: AtomicDuration,
    pub(crate) waiting_blocks: AtomicI64,
    pub(crate) waiting_bytes: AtomicI64,
    pub(crate) kept_blocks: AtomicI64,
    pub(crate) kept_bytes: AtomicI64,
    pub(crate) num_alloc_retries: AtomicI64,
    pub(crate) num_ooms: AtomicI64,
    /// Granules moved within the expandable range (see `RangeCall::Move`).
    pub(crate) remaps: AtomicI64,
    /// Requests the pool actor answered.
    pub(crate) misses: AtomicI64,
    /// Time spent by requests on the miss path.
    pub(crate) miss_wait: AtomicNanos,
    /// Time the pool actor spent serving misses.
    pub(crate) miss_serve: AtomicNanos,
    /// The counts of the cached path, shard by shard, registered with `ledger`.
    leaves: Arc<Leaves>,
    ledger: Arc<Ledger>,
    mask: usize,
    /// Device statistics, for pools built with them (`None`: host statistics only).
    detail: Option<Detail>,
}

impl Drop for PoolStats {
    fn drop(&mut self) {
        self.ledger.unregister(&self.leaves);
    }
}

impl PoolStats {
    /// The books of a pool with `shards` thread shards, counted in `group` of `ledger`; with
    /// `device`, device statistics too, blocks above `device` bytes counting as oversize.
    pub(crate) fn new(
        shards: usize,
        device: Option<usize>,
        ledger: Arc<Ledger>,
        group: Arc<Group>,
    ) -> Self {
        Self {
            allocations: AtomicStat::default(),
            allocated_bytes: AtomicStat::default(),
            host_alloc_time: AtomicDuration::default(),
            host_free_time: AtomicDuration::default(),
            waiting_blocks: AtomicI64::new(0),
            waiting_bytes: AtomicI64::new(0),
            kept_blocks: AtomicI64::new(0),
            kept_bytes: AtomicI64::new(0),
            num_alloc_retries: AtomicI64::new(0),
            num_ooms: AtomicI64::new(0),
            remaps: AtomicI64::new(0),
            misses: AtomicI64::new(0),
            miss_wait: AtomicNanos::default(),
            miss_serve: AtomicNanos::default(),
            leaves: ledger.register(shards, group),
            ledger,
            mask: shards - 1,
            detail: device.map(Detail::new),
        }
    }

    /// A block of `bytes` was lent for a request of `requested` bytes: it became active,
    /// charged to the calling thread's shard; returns the shard, to be credited when the
    /// block is freed and when it becomes reusable.
    #[inline]
    pub(crate) fn lend(&self, bytes: usize, requested: usize) -> usize {
        let me = ThreadSlot::current(self.mask);
        let s = &self.leaves.shards[me.shard];
        // A device pool's active blocks are its host counts too (see `active_kinds`).
        let class = self
            .detail
            .as_ref()
            .map(|d| d.lent(s, me.owns, bytes, requested));
        if class.is_none() {
            s.leaf[REQUESTS][0].increase(1, me.owns);
            s.leaf[BYTES][0].increase(bytes as i64, me.owns);
        }
        let open = if me.owns {
            self.ledger.open()
        } else {
            self.ledger.open_shared(s)
        };
        let covered = match (&self.detail, class) {
            (Some(d), Some(c)) => open && d.covered(s, c, bytes, me.owns),
            _ => open && s.covered(REQUESTS, 0, me.owns) && s.covered(BYTES, 0, me.owns),
        };
        if !covered {
            self.ledger.settle(&self.leaves, me);
        }
        me.shard
    }

    /// The user of a block of `bytes` charged to `shard` freed it (device statistics only:
    /// it stays active until it is reusable).
    #[inline]
    pub(crate) fn freed(&self, shard: usize, bytes: usize, requested: usize) {
        if let Some(d) = &self.detail {
            let me = ThreadSlot::current(self.mask);
            let s = &self.leaves.shards[shard];
            d.freed(s, me.owns && me.shard == shard, bytes, requested);
            self.leaves.note_slack(shard);
        }
    }

    /// A block of `bytes` charged to `shard` became reusable (or kept).
    #[inline]
    pub(crate) fn deactivate(&self, shard: usize, bytes: usize) {
        let me = ThreadSlot::current(self.mask);
        let owner = me.owns && me.shard == shard;
        let s = &self.leaves.shards[shard];
        match &self.detail {
            Some(d) => d.deactivated(s, owner, bytes),
            None => {
                s.leaf[REQUESTS][0].decrease(1, owner);
                s.leaf[BYTES][0].decrease(bytes as i64, owner);
            }
        }
        self.leaves.note_slack(shard);
    }

    /// A block of `bytes` charged to `shard`, lent for a request of `requested` bytes, was
    /// taken back before its requester saw it (one buffer of a request for several that did
    /// not get them all), freed and made reusable as usual: its counts go back as if it had
    /// never been lent, so that `allocated` counts what requesters received.
    pub(crate) fn roll_back(&self, shard: usize, bytes: usize, requested: usize) {
        let me = ThreadSlot::current(self.mask);
        let owner = me.owns && me.shard == shard;
        let s = &self.leaves.shards[shard];
        match &self.detail {
            Some(d) => d.rolled_back(s, owner, bytes, requested),
            None => {
                s.leaf[REQUESTS][0].retract(1, owner);
                s.leaf[BYTES][0].retract(bytes as i64, owner);
            }
        }
        self.leaves.note_slack(shard);
    }

    /// A segment of `bytes` was taken from the memory source (`taken`) or given back
    /// (device statistics only; the host books count segments where they are made).
    pub(crate) fn segment(&self, bytes: usize, taken: bool) {
        if let Some(d) = &self.detail {
            d.segment(bytes, taken);
        }
    }

    /// Free ranges inside segments that lend blocks, as the pool actor counted them.
    pub(crate) fn set_free_ranges(&self, n: usize) {
        if let Some(d) = &self.detail {
            d.free_ranges.store(n as i64, Relaxed);
        }
    }

    /// Device statistics (`None` for a pool built without them), with the peaks of the
    /// pool's group.
    pub(crate) fn read_device(&self) -> Option<DeviceStats> {
        let d = self.detail.as_ref()?;
        let mut s = d.read(
            &self.leaves.shards,
            self.allocated_bytes.read(),
            self.allocations.read(),
        );
        s.set_peaks(&self.leaves.group);
        s.num_alloc_retries = self.num_alloc_retries.load(Relaxed);
        s.num_ooms = self.num_ooms.load(Relaxed);
        let allocations = self.allocations.read();
        s.num_device_alloc = allocations.allocated;
        s.num_device_free = allocations.freed;
        s.num_device_remaps = self.remaps.load(Relaxed);
        s.num_misses = self.misses.load(Relaxed);
        s.miss_wait_ns = self.miss_wait.read();
        s.miss_serve_ns = self.miss_serve.read();
        Some(s)
    }

    /// The counts that hold the host statistics' active requests and bytes: the device's
    /// active blocks and bytes (both classes) in a pool with device statistics, which count
    /// the same blocks, else the host's own.
    pub(crate) fn active_kinds(&self) -> (usize, usize) {
        if self.detail.is_some() {
            (ACTIVE, ACTIVE_BYTES)
        } else {
            (REQUESTS, BYTES)
        }
    }

    /// Count `kind` now, both classes, summed over the shards.
    fn count(&self, kind: usize) -> Stat {
        let mut total = Stat::default();
        for s in self.leaves.shards.iter() {
            s.leaf[kind].iter().for_each(|l| total.add(&l.read()));
        }
        total
    }

    /// Bytes of active blocks now, summed over the shards.
    pub(crate) fn active_bytes_now(&self) -> i64 {
        self.count(self.active_kinds().1).current
    }

    /// Host statistics, with the peaks of the pool's group.
    pub(crate) fn read(&self) -> HostStats {
        let (requests, bytes) = self.active_kinds();
        let (active_requests, active_bytes) = (self.count(requests), self.count(bytes));
        let allocations = self.allocations.read();
        let allocated_bytes = self.allocated_bytes.read();
        let mut s = HostStats {
            allocations,
            allocated_bytes,
            active_requests,
            active_bytes,
            num_host_alloc: allocations.allocated,
            num_host_free: allocations.freed,
            num_host_remaps: self.remaps.load(Relaxed),
            host_alloc_time: self.host_alloc_time.read(),
            host_free_time: self.host_free_time.read(),
            waiting_blocks: self.waiting_blocks.load(Relaxed),
            waiting_bytes: self.waiting_bytes.load(Relaxed),
            kept_blocks: self.kept_blocks.load(Relaxed),
            kept_bytes: self.kept_bytes.load(Relaxed),
            num_alloc_retries: self.num_alloc_retries.load(Relaxed),
            num_ooms: self.num_ooms.load(Relaxed),
            num_misses: self.misses.load(Relaxed),
            miss_wait_ns: self.miss_wait.read(),
            miss_serve_ns: self.miss_serve.read(),
            limit_bytes: None,
        };
        s.set_peaks(&self.leaves.group, self.active_kinds());
        s
    }

    /// Starts the peaks of the pool's own books over (the counts' peaks are the ledger's).
    pub(crate) fn reset_peak(&self) {
        self.allocations.reset_peak();
        self.allocated_bytes.reset_peak();
        if let Some(d) = &self.detail {
            d.reset_peak();
        }
    }

    pub(crate) fn reset_accumulated(&self) {
        self.allocations.reset_accumulated();
        self.allocated_bytes.reset_accumulated();
        self.host_alloc_time.reset();
        self.host_free_time.reset();
        self.num_alloc_retries.store(0, Relaxed);
        self.num_ooms.store(0, Relaxed);
        self.misses.store(0, Relaxed);
        self.miss_wait.reset();
        self.miss_serve.reset();
        for s in self.leaves.shards.iter() {
            s.leaf.iter().flatten().for_each(|l| l.reset_accumulated());
        }
        if let Some(d) = &self.detail {
            d.reset_accumulated();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
    use std::sync::Barrier;

    use super::*;
    use crate::statistics::peaks::Group;

    /// What the threads saw held: counted just after each lend and just before each return
    /// (a lower bound of the most held at once), and just before each lend and just after each
    /// return (an upper bound).
    #[derive(Default)]
    struct Bracket {
        lower: AtomicI64,
        lower_max: AtomicI64,
        upper: AtomicI64,
        upper_max: AtomicI64,
    }

    impl Bracket {
        fn before_lend(&self, n: i64) {
            let now = self.upper.fetch_add(n, SeqCst) + n;
            self.upper_max.fetch_max(now, SeqCst);
        }
        fn after_lend(&self, n: i64) {
            let now = self.lower.fetch_add(n, SeqCst) + n;
            self.lower_max.fetch_max(now, SeqCst);
        }
        fn before_return(&self, n: i64) {
            self.lower.fetch_sub(n, SeqCst);
        }
        fn after_return(&self, n: i64) {
            self.upper.fetch_sub(n, SeqCst);
        }
        fn holds(&self, peak: i64) -> bool {
            self.lower_max.load(SeqCst) <= peak && peak <= self.upper_max.load(SeqCst)
        }
    }

    /// Three pools of one ledger (two in the default group, one a group of its own), fewer
    /// shards than threads (so some threads share shards and never use slack), blocks of
    /// random sizes lent and returned by threads at random, and returned by other threads
    /// than those that took them: every group's peak (bytes and requests) and the engine's
    /// lie between what the threads saw held, and the books match the allowances.
    #[test]
    fn peaks_are_what_the_threads_held_at_once_across_pools_groups_and_shared_shards() {
        const THREADS: usize = 8;
        for round in 0..20u64 {
            let ledger = Arc::new(Ledger::new());
            let own = Arc::new(Group::new());
            let pools = [
                PoolStats::new(4, None, ledger.clone(), ledger.default_group().clone()),
                PoolStats::new(4, None, ledger.clone(), ledger.default_group().clone()),
                PoolStats::new(4, None, ledger.clone(), own.clone()),
            ];
            // Brackets of bytes: the default group, the own group, the engine; then of
            // requests of the engine.
            let brackets: [Bracket; 4] = Default::default();
            let handoff = crossbeam_queue::SegQueue::<(usize, usize, usize)>::new();
            let barrier = Barrier::new(THREADS);
            std::thread::scope(|s| {
                for t in 0..THREADS as u64 {
                    let (pools, brackets, handoff, barrier) =
                        (&pools, &brackets, &handoff, &barrier);
                    s.spawn(move || {
                        let mut rng = (round * 131 + t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        let mut next = move || {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng
                        };
                        let touched = |p: usize| [usize::from(p == 2), 2];
                        let give_back = |(p, shard, bytes): (usize, usize, usize)| {
                            for b in touched(p) {
                                brackets[b].before_return(bytes as i64);
                            }
                            brackets[3].before_return(1);
                            pools[p].deactivate(shard, bytes);
                            for b in touched(p) {
                                brackets[b].after_return(bytes as i64);
                            }
                            brackets[3].after_return(1);
                        };
                        let mut held = Vec::new();
                        barrier.wait();
                        for _ in 0..3000 {
                            let r = next();
                            if held.len() < 4 && r % 3 != 0 {
                                let p = (r >> 8) as usize % 3;
                                let bytes = 512 << ((r >> 16) % 8);
                                for b in touched(p) {
                                    brackets[b].before_lend(bytes as i64);
                                }
                                brackets[3].before_lend(1);
                                let shard = pools[p].lend(bytes, bytes);
                                for b in touched(p) {
                                    brackets[b].after_lend(bytes as i64);
                                }
                                brackets[3].after_lend(1);
                                held.push((p, shard, bytes));
                            } else if !held.is_empty() {
                                let i = (r >> 24) as usize % held.len();
                                let block = held.swap_remove(i);
                                if r & 1 == 0 {
                                    handoff.push(block);
                                } else {
                                    give_back(block);
                                }
                                if let Some(b) = handoff.pop() {
                                    give_back(b);
                                }
                            }
                        }
                        held.into_iter().for_each(give_back);
                        barrier.wait();
                        while let Some(b) = handoff.pop() {
                            give_back(b);
                        }
                    });
                }
            });
            let (default, mine, engine) = (
                ledger.default_group().peak(BYTES, ALL),
                own.peak(BYTES, ALL),
                ledger.engine().peak(BYTES, ALL),
            );
            assert!(brackets[0].holds(default), "default group: {default}");
            assert!(brackets[1].holds(mine), "own group: {mine}");
            assert!(brackets[2].holds(engine), "engine: {engine}");
            let requests = ledger.engine().peak(REQUESTS, ALL);
            assert!(brackets[3].holds(requests), "engine requests: {requests}");
            for p in &pools {
                let s = p.read();
                assert_eq!(s.active_bytes.current, 0);
                assert_eq!(s.active_requests.current, 0);
            }
            // After a reset, the peaks are what is held now: nothing.
            ledger.reset_peaks();
            assert_eq!(ledger.engine().peak(BYTES, ALL), 0);
            assert_eq!(own.peak(REQUESTS, ALL), 0);
        }
    }

    /// Four threads alive at once, each holding a block alone in its own phase: the peak is
    /// the largest block (the most held at once), not the sum of each shard's own peak.
    #[test]
    fn a_peak_is_the_most_held_at_once_not_the_sum_of_the_threads_peaks() {
        let ledger = Arc::new(Ledger::new());
        let pool = PoolStats::new(8, None, ledger.clone(), ledger.default_group().clone());
        let barrier = Barrier::new(4);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (pool, barrier) = (&pool, &barrier);
                s.spawn(move || {
                    for phase in 0..4 {
                        if phase == t {
                            let shard = pool.lend(1 << (20 + phase), 1);
                            pool.deactivate(shard, 1 << (20 + phase));
                        }
                        barrier.wait();
                    }
                });
            }
        });
        assert_eq!(pool.read().active_bytes.peak, 8 << 20);
        assert_eq!(pool.read().active_requests.peak, 1);
    }
}

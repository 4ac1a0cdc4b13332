//! Statistics with the meaning of `torch.cuda.host_memory_stats()`.
//!
//! Host allocations (`allocations`, `allocated_bytes`, timings) are written only by their
//! pool actor. Active requests and bytes change on the cached path, so they live in
//! per-thread shards: a block's counters are charged to the shard of the thread that took it,
//! and credited back to the same shard when it becomes reusable. `current` is exact at
//! quiescent points; `peak` is the sum of the shards' peaks (for bytes, capped by the reserved
//! peak), an upper bound of the true peak
//! that is exact when one thread does the work (PyTorch sums per-bucket peaks the same way).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use crate::counters::{AtomicDuration, AtomicStat, DurationStat, ShardStat, Stat};
use crate::device_stats::{Detail, DeviceStats};
use crate::shard::{CachePadded, ThreadSlot};

/// A statistics report for one pool or for the whole allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Host allocations (segments of pinned memory) held.
    pub allocations: Stat,
    /// Bytes of pinned memory held.
    pub allocated_bytes: Stat,
    /// Blocks handed out and not yet reusable (in use, or waiting on events).
    pub active_requests: Stat,
    /// Bytes of the blocks counted by `active_requests`.
    pub active_bytes: Stat,
    /// Calls that took fresh pinned memory.
    pub num_host_alloc: i64,
    /// Calls that gave pinned memory back.
    pub num_host_free: i64,
    /// Granules of pinned memory moved to another place of the expandable range instead of
    /// being given back and taken again (pinpool's own count; not in `num_host_alloc`).
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
    /// Times a request asked the pool actor for a block, the cached path having found none
    /// (again after room was made; pinpool's own count).
    pub num_misses: i64,
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
        ] {
            m.insert(k.to_string(), v);
        }
        if let Some(l) = self.limit_bytes {
            m.insert("limit_bytes".to_string(), l);
        }
        m
    }
}

/// One thread shard's active counters.
#[derive(Debug, Default)]
pub(crate) struct ActiveShard {
    pub(crate) requests: ShardStat,
    pub(crate) bytes: ShardStat,
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
    /// Granules moved within the expandable range (see `MemorySource::remap`).
    pub(crate) remaps: AtomicI64,
    /// Requests the pool actor answered.
    pub(crate) misses: AtomicI64,
    active: Box<[CachePadded<ActiveShard>]>,
    mask: usize,
    /// Device statistics, for pools built with them (`None`: host statistics only).
    detail: Option<Detail>,
}

impl PoolStats {
    /// The books of a pool with `shards` thread shards; with `device`, device statistics
    /// too, blocks above `device` bytes counting as oversize.
    pub(crate) fn new(shards: usize, device: Option<usize>) -> Self {
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
            active: (0..shards).map(|_| CachePadded::default()).collect(),
            mask: shards - 1,
            detail: device.map(|max_split| Detail::new(shards, max_split)),
        }
    }

    /// A block of `bytes` was lent for a request of `requested` bytes: it became active,
    /// charged to the calling thread's shard; returns the shard, to be credited when the
    /// block is freed and when it becomes reusable.
    #[inline]
    pub(crate) fn lend(&self, bytes: usize, requested: usize) -> usize {
        let me = ThreadSlot::current(self.mask);
        let s = &self.active[me.shard];
        s.requests.increase(1, me.owns);
        s.bytes.increase(bytes as i64, me.owns);
        if let Some(d) = &self.detail {
            d.lent(me.shard, me.owns, bytes, requested);
        }
        me.shard
    }

    /// The user of a block of `bytes` charged to `shard` freed it (device statistics only:
    /// it stays active until it is reusable).
    #[inline]
    pub(crate) fn freed(&self, shard: usize, bytes: usize, requested: usize) {
        if let Some(d) = &self.detail {
            let me = ThreadSlot::current(self.mask);
            d.freed(shard, me.owns && me.shard == shard, bytes, requested);
        }
    }

    /// A block of `bytes` charged to `shard` became reusable (or kept).
    #[inline]
    pub(crate) fn deactivate(&self, shard: usize, bytes: usize) {
        let me = ThreadSlot::current(self.mask);
        let owner = me.owns && me.shard == shard;
        let s = &self.active[shard];
        s.requests.decrease(1, owner);
        s.bytes.decrease(bytes as i64, owner);
        if let Some(d) = &self.detail {
            d.deactivated(shard, owner, bytes);
        }
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

    /// Device statistics (`None` for a pool built without them).
    pub(crate) fn read_device(&self) -> Option<DeviceStats> {
        let d = self.detail.as_ref()?;
        let mut s = d.read();
        s.num_alloc_retries = self.num_alloc_retries.load(Relaxed);
        s.num_ooms = self.num_ooms.load(Relaxed);
        let allocations = self.allocations.read();
        s.num_device_alloc = allocations.allocated;
        s.num_device_free = allocations.freed;
        s.num_device_remaps = self.remaps.load(Relaxed);
        s.num_misses = self.misses.load(Relaxed);
        Some(s)
    }

    /// Bytes of active blocks now, summed over the shards.
    pub(crate) fn active_bytes_now(&self) -> i64 {
        self.active.iter().map(|s| s.bytes.read().current).sum()
    }

    pub(crate) fn read(&self) -> HostStats {
        let mut active_requests = Stat::default();
        let mut active_bytes = Stat::default();
        for s in self.active.iter() {
            active_requests.add(&s.requests.read());
            active_bytes.add(&s.bytes.read());
        }
        let allocations = self.allocations.read();
        let allocated_bytes = self.allocated_bytes.read();
        // Active bytes never exceed reserved bytes: a tighter bound on the summed peaks.
        active_bytes.peak = active_bytes
            .peak
            .min(allocated_bytes.peak.max(active_bytes.current));
        HostStats {
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
            limit_bytes: None,
        }
    }

    pub(crate) fn reset_peak(&self) {
        self.allocations.reset_peak();
        self.allocated_bytes.reset_peak();
        for s in self.active.iter() {
            s.requests.reset_peak();
            s.bytes.reset_peak();
        }
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
        for s in self.active.iter() {
            s.requests.reset_accumulated();
            s.bytes.reset_accumulated();
        }
        if let Some(d) = &self.detail {
            d.reset_accumulated();
        }
    }
}

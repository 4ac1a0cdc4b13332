//! Statistics with the meaning of `torch.cuda.memory_stats()` (PyTorch's `DeviceStats`), and
//! the per-pool counters behind them.
//!
//! PyTorch splits each statistic over its two pools: the small pool (blocks up to 1 MiB, cut
//! from 2 MiB segments) and the large pool. A [`StatArray`] holds the aggregate and both
//! parts. Here a block is small when it is at most 1 MiB. Segments (allocations from the
//! memory source, or runs of granules mapped by one call) have no pool of their own: one
//! range of a stream's pool serves blocks of both sizes. Reserved bytes and segments are
//! therefore apportioned when read ([`apportion`]): the small pool holds its active blocks'
//! bytes rounded up to whole 2 MiB segments, as far as the large pool's active bytes leave
//! room, and the large pool the rest. So, for both parts, what is allocated is at most what
//! is active, which is at most what is reserved, and the parts add up to the whole.
//!
//! The counters a request changes (allocations and active blocks, their bytes, the bytes
//! requested) live in per-thread shards like the host statistics, so that a device pool's
//! cached path writes only its own thread's cache lines (invariant 5); their peaks are the
//! engine ledger's (see [`crate::statistics::peaks`]). Segment counters are written by the pool actor
//! (and by blocking threads it waits for). Only pools built with device statistics pay for
//! them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use arc_swap::ArcSwap;

use crate::statistics::counters::{AtomicStat, Stat};
use crate::statistics::peaks::{
    Group, ShardLeaves, ACTIVE, ACTIVE_BYTES, ALL, ALLOCATED_BYTES, ALLOCATION, OVERSIZE,
    REQUESTED_BYTES,
};
use crate::vocab::shard::CachePadded;

/// Blocks up to this size are in PyTorch's small pool.
pub(crate) const SMALL_BLOCK: usize = 1 << 20;
/// Segments up to this size are small-pool segments.
pub(crate) const SMALL_SEGMENT: usize = 2 << 20;

/// One statistic over PyTorch's pools: the aggregate, the small pool and the large pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools.
    pub all: Stat,
    /// Blocks up to 1 MiB (segments up to 2 MiB).
    pub small_pool: Stat,
    /// The rest.
    pub large_pool: Stat,
}

impl StatArray {
    fn from_parts(parts: [Stat; 2]) -> Self {
        let mut all = parts[0];
        all.add(&parts[1]);
        Self {
            all,
            small_pool: parts[0],
            large_pool: parts[1],
        }
    }

    /// Caps every peak at `bound` (and at least the current value).
    fn cap_peaks(&mut self, bound: i64) {
        for s in [&mut self.all, &mut self.small_pool, &mut self.large_pool] {
            s.peak = s.peak.min(bound).max(s.current);
        }
    }

    fn merge(&mut self, o: &StatArray) {
        self.all.add(&o.all);
        self.small_pool.add(&o.small_pool);
        self.large_pool.add(&o.large_pool);
    }
}

/// Statistics of one device (or one of its pools), with the keys of
/// `torch.cuda.memory_stats()`.
///
/// Each statistic is split over PyTorch's two pools: `small_pool` (blocks up to 1 MiB) and
/// `large_pool`, which add up to `all`. A block's pool is its size's. Reserved memory has no
/// pool of its own here (a stream's memory serves blocks of both sizes), so reserved bytes
/// and segments are apportioned when the statistics are read: the small pool reserves its
/// active blocks' bytes rounded up to whole 2 MiB segments, as far as the large pool's active
/// bytes leave room, and the large pool the rest (cached memory, once no small block is
/// active, is the large pool's). So in each pool, as in PyTorch, `allocated_bytes` ≤
/// `active_bytes` ≤ `reserved_bytes`, and `inactive_split_bytes` is the difference. The
/// apportioned parts' `peak` is the highest value a read saw, and their `freed` counts what a
/// part lost between reads.
///
/// `allocated` counts (`allocation.all.allocated`, …) are the buffers requesters received:
/// buffers a `BufferSet` took and gave back, because another of its buffers found no room,
/// are not counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceStats {
    /// Blocks handed out and not yet freed by their users.
    pub allocation: StatArray,
    /// Segments: allocations from the device (or runs of granules mapped by one call),
    /// apportioned to the pools by their reserved bytes (see above).
    pub segment: StatArray,
    /// Blocks handed out and not yet reusable (in use, or freed and waiting on events).
    pub active: StatArray,
    /// Free ranges inside segments that still hold blocks.
    pub inactive_split: StatArray,
    /// Bytes of `allocation`.
    pub allocated_bytes: StatArray,
    /// Bytes of `segment`: what the allocator holds of the device (apportioned to the pools:
    /// see above).
    pub reserved_bytes: StatArray,
    /// Bytes of `active`.
    pub active_bytes: StatArray,
    /// Bytes of reserved memory that no active block uses, in each pool its reserved less
    /// its active bytes (a value now: no accumulated counts).
    pub inactive_split_bytes: StatArray,
    /// Bytes the users asked for, of the blocks in `allocation`.
    pub requested_bytes: StatArray,
    /// Requests that had to empty the caches and try again.
    pub num_alloc_retries: i64,
    /// Requests that failed for want of memory.
    pub num_ooms: i64,
    /// Blocks larger than `max_split_size` handed out and not yet freed.
    pub oversize_allocations: Stat,
    /// Segments larger than `max_split_size`.
    pub oversize_segments: Stat,
    /// Calls that took memory from the device (`cuMemAlloc`, or a map call).
    pub num_device_alloc: i64,
    /// Calls that gave memory back.
    pub num_device_free: i64,
    /// Map calls moved whole to other places of the expandable range instead of memory
    /// given back and taken again (pinpool's own; not among `torch.cuda.memory_stats()`'s
    /// keys).
    pub num_device_remaps: i64,
    /// Requests the cache could not serve at once (misses), counted again when one asked
    /// anew after room was made (pinpool's own, not among `torch.cuda.memory_stats()`'s
    /// keys).
    pub num_misses: i64,
    /// Nanoseconds requests spent on misses, from the miss to holding the buffer (or the
    /// error), each request once however often it asked (pinpool's own, not among
    /// `torch.cuda.memory_stats()`'s keys).
    pub miss_wait_ns: i64,
    /// Nanoseconds the allocator's actors spent serving those misses, from taking each
    /// request until it is answered, queued for room or refused (pinpool's own): what
    /// `miss_wait_ns` has over it is the hand-offs between threads and the time queued.
    pub miss_serve_ns: i64,
    /// Times every stream was synchronized to free cached blocks (PyTorch's count; 0 here:
    /// blocks wait on events instead, and the wait for the device's queued work before
    /// memory goes back to the driver is part of each of `num_device_free`'s calls).
    pub num_sync_all_streams: i64,
    /// The `max_split_size` in force (`None`: unlimited).
    pub max_split_size: Option<i64>,
    /// The cap on reserved bytes of the device, if one is set.
    pub limit_bytes: Option<i64>,
}

impl DeviceStats {
    /// Sets the reserved peak of a device's total to `reserved_peak` (all pools together,
    /// counted where memory is taken), and caps the peaks summed over pools by it (those of
    /// segments' parts and of inactive bytes: upper bounds, each part peaking at its own
    /// time). A part's reserved peak is at least its active peak: its active bytes were
    /// reserved when they peaked.
    pub(crate) fn set_reserved_peak(&mut self, reserved_peak: i64) {
        let r = &mut self.reserved_bytes;
        r.all.peak = reserved_peak.max(r.all.current);
        let bound = r.all.peak;
        for (part, active) in [
            (&mut r.small_pool, &self.active_bytes.small_pool),
            (&mut r.large_pool, &self.active_bytes.large_pool),
        ] {
            part.peak = part.peak.max(active.peak);
        }
        r.cap_peaks(bound);
        self.inactive_split_bytes.cap_peaks(bound);
    }

    /// Sets the peaks of the counts kept in shards to those of `group`'s books.
    pub(crate) fn set_peaks(&mut self, group: &Group) {
        for (kind, s) in [
            (ALLOCATION, &mut self.allocation),
            (ALLOCATED_BYTES, &mut self.allocated_bytes),
            (REQUESTED_BYTES, &mut self.requested_bytes),
            (ACTIVE, &mut self.active),
            (ACTIVE_BYTES, &mut self.active_bytes),
        ] {
            for (class, stat) in [
                (0, &mut s.small_pool),
                (1, &mut s.large_pool),
                (ALL, &mut s.all),
            ] {
                stat.peak = group.peak(kind, class).max(stat.current);
            }
        }
        let o = &mut self.oversize_allocations;
        o.peak = group.peak(OVERSIZE, ALL).max(o.current);
    }

    /// Every statistic of the report with a peak.
    pub(crate) fn stats_mut(&mut self) -> impl Iterator<Item = &mut Stat> {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
        .into_iter()
        .flat_map(|a| [&mut a.all, &mut a.small_pool, &mut a.large_pool])
        .chain([&mut self.oversize_allocations, &mut self.oversize_segments])
    }

    /// Adds another pool's report into this one (for a device's total over its pools).
    pub fn merge(&mut self, o: &DeviceStats) {
        for (a, b) in [
            (&mut self.allocation, &o.allocation),
            (&mut self.segment, &o.segment),
            (&mut self.active, &o.active),
            (&mut self.inactive_split, &o.inactive_split),
            (&mut self.allocated_bytes, &o.allocated_bytes),
            (&mut self.reserved_bytes, &o.reserved_bytes),
            (&mut self.active_bytes, &o.active_bytes),
            (&mut self.inactive_split_bytes, &o.inactive_split_bytes),
            (&mut self.requested_bytes, &o.requested_bytes),
        ] {
            a.merge(b);
        }
        self.num_alloc_retries += o.num_alloc_retries;
        self.num_ooms += o.num_ooms;
        self.oversize_allocations.add(&o.oversize_allocations);
        self.oversize_segments.add(&o.oversize_segments);
        self.num_device_alloc += o.num_device_alloc;
        self.num_device_free += o.num_device_free;
        self.num_device_remaps += o.num_device_remaps;
        self.num_misses += o.num_misses;
        self.miss_wait_ns += o.miss_wait_ns;
        self.miss_serve_ns += o.miss_serve_ns;
        self.num_sync_all_streams += o.num_sync_all_streams;
        self.max_split_size = self.max_split_size.or(o.max_split_size);
        self.limit_bytes = self.limit_bytes.or(o.limit_bytes);
    }

    /// A flat view with the keys of `torch.cuda.memory_stats()`: `allocated_bytes.all.current`,
    /// `segment.small_pool.peak`, `num_alloc_retries`, …
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        for (name, a) in [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ] {
            for (pool, s) in [
                ("all", &a.all),
                ("small_pool", &a.small_pool),
                ("large_pool", &a.large_pool),
            ] {
                m.insert(format!("{name}.{pool}.current"), s.current);
                m.insert(format!("{name}.{pool}.peak"), s.peak);
                m.insert(format!("{name}.{pool}.allocated"), s.allocated);
                m.insert(format!("{name}.{pool}.freed"), s.freed);
            }
        }
        for (name, s) in [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ] {
            m.insert(format!("{name}.current"), s.current);
            m.insert(format!("{name}.peak"), s.peak);
            m.insert(format!("{name}.allocated"), s.allocated);
            m.insert(format!("{name}.freed"), s.freed);
        }
        for (k, v) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("num_sync_all_streams", self.num_sync_all_streams),
        ] {
            m.insert(k.to_string(), v);
        }
        if let Some(v) = self.max_split_size {
            m.insert("max_split_size".to_string(), v);
        }
        if let Some(v) = self.limit_bytes {
            m.insert("limit_bytes".to_string(), v);
        }
        m
    }
}

/// Which pool a block of `bytes` is in: 0 small, 1 large.
#[inline]
fn block_pool(bytes: usize) -> usize {
    usize::from(bytes > SMALL_BLOCK)
}

/// The small pool's part of `reserved` bytes now, given the active bytes of each pool:
/// its active bytes rounded up to whole small segments (2 MiB), as far as the large pool's
/// active bytes leave room. The large pool's part is the rest, so each part holds at least
/// its active bytes (when they fit at all: counts read while blocks move may not) and the
/// parts add up to `reserved`.
pub(crate) fn small_share(reserved: i64, active: [i64; 2]) -> i64 {
    let reserved = reserved.max(0);
    let large = active[1].clamp(0, reserved);
    let small = active[0].clamp(0, reserved - large);
    let seg = SMALL_SEGMENT as i64;
    let rounded = (small as u64).div_ceil(seg as u64) as i64 * seg;
    rounded.min(reserved - large).max(small)
}

/// The small pool's part of `segments` now, given each pool's reserved bytes: all of them
/// while the large pool reserves nothing, none while the small pool reserves nothing, else
/// enough for the small pool's bytes in whole small segments (2 MiB), leaving at least one to
/// the large pool (a single segment that holds both counts in the large pool).
fn small_segments(segments: i64, small: i64, large: i64) -> i64 {
    let segments = segments.max(0);
    if large <= 0 {
        return segments;
    }
    if small <= 0 || segments < 2 {
        return 0;
    }
    let needed = (small as u64).div_ceil(SMALL_SEGMENT as u64) as i64;
    needed.clamp(1, segments - 1)
}

/// What the reads of an apportioned statistic remember of its small part: its last value,
/// what it lost since the last reset of the accumulated counts, and each part's highest value
/// seen at a read since the last reset of the peaks.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    small_last: i64,
    small_freed: i64,
    peaks: [i64; 2],
}

/// Splits `total` into the two pools, the small part being `small` now: the parts' current
/// values add up to the total's, and so do their accumulated counts (each part's `allocated`
/// less its `freed` is its current value; the small part's `freed` is what it lost between
/// reads, the large part's the rest of the total's). Peaks are the highest values reads saw,
/// capped by the total's.
fn apportion(total: Stat, small: i64, seen: &mut Seen) -> StatArray {
    let small = small.clamp(0, total.current.max(0));
    let large = total.current - small;
    seen.small_freed += (seen.small_last - small).max(0);
    seen.small_last = small;
    seen.peaks[0] = seen.peaks[0].max(small);
    seen.peaks[1] = seen.peaks[1].max(large);
    let freed = seen.small_freed.clamp(0, total.freed.max(0));
    let part = |current: i64, freed: i64, peak: i64| Stat {
        current,
        peak: peak.max(current).min(total.peak.max(current)),
        allocated: freed + current,
        freed,
    };
    StatArray {
        all: total,
        small_pool: part(small, freed, seen.peaks[0]),
        large_pool: part(large, total.freed - freed, seen.peaks[1]),
    }
}

/// The device counters of one engine pool that its actor writes (the counts of the cached
/// path are leaves of the engine's ledger: see [`crate::statistics::peaks`]).
#[derive(Debug)]
pub(crate) struct Detail {
    oversize_segments: AtomicStat,
    /// What reads saw of the apportioned statistics: reserved bytes, then segments. Each read
    /// and reset publishes what it saw with a compare-and-swap, redoing its work when another
    /// published first (reads are rare; nothing on the allocation path touches this).
    seen: ArcSwap<[Seen; 2]>,
    /// Free ranges inside segments that lend blocks, as the pool actor last counted them.
    pub(crate) free_ranges: AtomicI64,
    /// Blocks above this are oversize.
    max_split: usize,
}

impl Detail {
    pub(crate) fn new(max_split: usize) -> Self {
        Self {
            oversize_segments: AtomicStat::default(),
            seen: ArcSwap::from_pointee(Default::default()),
            free_ranges: AtomicI64::new(0),
            max_split,
        }
    }

    /// A block of `bytes` for a request of `requested` was handed out (charged to `shard`);
    /// returns its class (0 small, 1 large).
    #[inline]
    pub(crate) fn lent(
        &self,
        shard: &ShardLeaves,
        owner: bool,
        bytes: usize,
        requested: usize,
    ) -> usize {
        let c = block_pool(bytes);
        let p = &shard.leaf;
        p[ALLOCATION][c].increase(1, owner);
        p[ALLOCATED_BYTES][c].increase(bytes as i64, owner);
        p[REQUESTED_BYTES][c].increase(requested as i64, owner);
        p[ACTIVE][c].increase(1, owner);
        p[ACTIVE_BYTES][c].increase(bytes as i64, owner);
        if bytes > self.max_split {
            p[OVERSIZE][c].increase(1, owner);
        }
        c
    }

    /// Whether the counts a block of `bytes` of class `c` raised are within the allowances
    /// of the side `owner` writes.
    #[inline]
    pub(crate) fn covered(&self, shard: &ShardLeaves, c: usize, bytes: usize, owner: bool) -> bool {
        [
            ALLOCATION,
            ALLOCATED_BYTES,
            REQUESTED_BYTES,
            ACTIVE,
            ACTIVE_BYTES,
        ]
        .iter()
        .all(|&k| shard.covered(k, c, owner))
            && (bytes <= self.max_split || shard.covered(OVERSIZE, c, owner))
    }

    /// Its user freed it (it may still wait on events).
    #[inline]
    pub(crate) fn freed(&self, shard: &ShardLeaves, owner: bool, bytes: usize, requested: usize) {
        let c = block_pool(bytes);
        let p = &shard.leaf;
        p[ALLOCATION][c].decrease(1, owner);
        p[ALLOCATED_BYTES][c].decrease(bytes as i64, owner);
        p[REQUESTED_BYTES][c].decrease(requested as i64, owner);
        if bytes > self.max_split {
            p[OVERSIZE][c].decrease(1, owner);
        }
    }

    /// It became reusable (or kept).
    #[inline]
    pub(crate) fn deactivated(&self, shard: &ShardLeaves, owner: bool, bytes: usize) {
        let c = block_pool(bytes);
        shard.leaf[ACTIVE][c].decrease(1, owner);
        shard.leaf[ACTIVE_BYTES][c].decrease(bytes as i64, owner);
    }

    /// A block of `bytes` lent for a request of `requested` was taken back before its
    /// requester saw it (one buffer of a request for several that did not get them all),
    /// and freed and made reusable as usual ([`Detail::freed`], [`Detail::deactivated`]):
    /// every count it changed goes back as if it had never been lent, so that `allocated`
    /// counts what requesters received.
    pub(crate) fn rolled_back(
        &self,
        shard: &ShardLeaves,
        owner: bool,
        bytes: usize,
        requested: usize,
    ) {
        let c = block_pool(bytes);
        let p = &shard.leaf;
        for (kind, n) in [
            (ACTIVE, 1),
            (ACTIVE_BYTES, bytes as i64),
            (ALLOCATION, 1),
            (ALLOCATED_BYTES, bytes as i64),
            (REQUESTED_BYTES, requested as i64),
        ] {
            p[kind][c].retract(n, owner);
        }
        if bytes > self.max_split {
            p[OVERSIZE][c].retract(1, owner);
        }
    }

    /// A segment of `bytes` was taken (`taken`) or given back (the reserved bytes and
    /// segments themselves are the pool's host books: see [`Detail::read`]).
    pub(crate) fn segment(&self, bytes: usize, taken: bool) {
        if bytes > self.max_split {
            if taken {
                self.oversize_segments.increase(1);
            } else {
                self.oversize_segments.decrease(1);
            }
        }
    }

    /// The statistics, summed over `shards`, with no peaks for the counts kept there (see
    /// [`DeviceStats::set_peaks`]); `reserved` and `segments` are the pool's bytes and
    /// segments held, apportioned to the two pools here.
    pub(crate) fn read(
        &self,
        shards: &[CachePadded<ShardLeaves>],
        reserved: Stat,
        segments: Stat,
    ) -> DeviceStats {
        let mut parts: [[Stat; 2]; 6] = Default::default();
        const KINDS: [usize; 6] = [
            ALLOCATION,
            ALLOCATED_BYTES,
            REQUESTED_BYTES,
            ACTIVE,
            ACTIVE_BYTES,
            OVERSIZE,
        ];
        for shard in shards.iter() {
            for (part, kind) in parts.iter_mut().zip(KINDS) {
                for (stat, leaf) in part.iter_mut().zip(&shard.leaf[kind]) {
                    stat.add(&leaf.read());
                }
            }
        }
        let active = [parts[4][0].current, parts[4][1].current];
        let small = small_share(reserved.current, active);
        let large = reserved.current - small;
        let small_segs = small_segments(segments.current, small, large);
        let mut parted = None;
        self.seen.rcu(|seen| {
            let mut seen = **seen;
            parted = Some((
                apportion(reserved, small, &mut seen[0]),
                apportion(segments, small_segs, &mut seen[1]),
            ));
            seen
        });
        let (reserved, segment) = parted.expect("rcu runs its closure at least once");
        // Reserved bytes that no active block uses, now (peaks are not tracked).
        let mut inactive = [Stat::default(); 2];
        inactive[0].current = (reserved.small_pool.current - active[0]).max(0);
        inactive[1].current = (reserved.large_pool.current - active[1]).max(0);
        let ranges = self.free_ranges.load(Relaxed);
        let mut oversize = parts[5][0];
        oversize.add(&parts[5][1]);
        DeviceStats {
            allocation: StatArray::from_parts(parts[0]),
            segment,
            active: StatArray::from_parts(parts[3]),
            inactive_split: StatArray {
                all: Stat {
                    current: ranges,
                    ..Stat::default()
                },
                ..StatArray::default()
            },
            allocated_bytes: StatArray::from_parts(parts[1]),
            reserved_bytes: reserved,
            active_bytes: StatArray::from_parts(parts[4]),
            inactive_split_bytes: StatArray::from_parts(inactive),
            requested_bytes: StatArray::from_parts(parts[2]),
            oversize_allocations: oversize,
            oversize_segments: self.oversize_segments.read(),
            max_split_size: (self.max_split < usize::MAX).then_some(self.max_split as i64),
            ..DeviceStats::default()
        }
    }

    /// Starts the peaks over. The apportioned parts' peaks start from their values at the
    /// last read (the next read raises them to the values then).
    pub(crate) fn reset_peak(&self) {
        self.seen
            .rcu(|seen| seen.map(|s| Seen { peaks: [0; 2], ..s }));
        self.oversize_segments.reset_peak();
    }

    pub(crate) fn reset_accumulated(&self) {
        self.seen.rcu(|seen| {
            seen.map(|s| Seen {
                small_freed: 0,
                ..s
            })
        });
        self.oversize_segments.reset_accumulated();
    }
}

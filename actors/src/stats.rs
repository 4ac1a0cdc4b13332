//! Statistics with the meaning of `torch.cuda.host_memory_stats()`, and the exact books of
//! what requests hold.
//!
//! Host allocations (`allocations`, `allocated_bytes`, timings) are written only by their
//! pool actor. What requests hold (active blocks and bytes; with device statistics also
//! allocations, allocated and requested bytes, oversize blocks, each over PyTorch's small
//! and large pools) changes on the cached path, and is kept in the allocator's [`Tally`]:
//! one book for the whole allocator, one for the default pool with its stream pools, one for
//! each capture pool. A change is applied by the thread whose turn it is, in one order for
//! every book, so `current` and `peak` are exact (as under PyTorch's allocator mutex): a
//! peak is the most held at once, not a sum of parts that peaked at different times.
//!
//! The turn is one flag taken with one compare-and-swap; a thread that finds it taken does
//! not wait: it queues its change, and whoever takes the turn next applies the queued changes
//! first, in the order they were queued. So a change is ordered after every change completed
//! before it began, and nothing ever waits on the cached path. The price is that the flag's
//! cache line is written by every thread that allocates or frees, so threads of one
//! allocator no longer keep entirely to their own lines there (see invariant 5 in the design
//! document). Readers take the turn (waiting for it) and apply what is queued before they
//! read.
//!
//! The tally also keeps each pool's own bytes in use, for its actor's heuristics and
//! out-of-memory reports.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering, Ordering::Relaxed};
use std::sync::Arc;

use crossbeam_queue::SegQueue;

use crate::counters::{AtomicDuration, AtomicStat, DurationStat, Stat};
use crate::device_stats::{block_pool, Detail, DeviceStats, StatArray};
use crate::shard::CachePadded;

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
        ] {
            m.insert(k.to_string(), v);
        }
        if let Some(l) = self.limit_bytes {
            m.insert("limit_bytes".to_string(), l);
        }
        m
    }
}

/// What a request changed, as the books apply it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change {
    kind: Kind,
    /// Size of the block.
    bytes: i64,
    /// Bytes the user asked for.
    requested: i64,
    /// Whether the block is above `max_split_size`.
    oversize: bool,
    /// Whether the pool keeps device statistics (allocations, requested bytes, oversize).
    detail: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Lent: allocated and active.
    Lend,
    /// Freed by its user; active until reusable.
    Free,
    /// Reusable (or kept) again.
    Deactivate,
    /// Freed by its user and reusable at once (the cached path's free).
    FreeIdle,
}

/// The quantities a book keeps, each over all blocks, small-pool and large-pool blocks.
const ALLOCATION: usize = 0;
const ALLOCATED_BYTES: usize = 1;
const REQUESTED_BYTES: usize = 2;
const ACTIVE: usize = 3;
const ACTIVE_BYTES: usize = 4;
/// Blocks above `max_split_size` (kept over all blocks only).
const OVERSIZE: usize = 5;
const QUANTITIES: usize = 6;

/// One quantity's counters in a book. Written only by the thread whose turn it is (plain
/// loads and stores in atomics: the turn orders them).
#[derive(Debug, Default)]
struct Cell {
    current: AtomicI64,
    peak: AtomicI64,
    allocated: AtomicI64,
    freed: AtomicI64,
}

impl Cell {
    #[inline]
    fn add(&self, n: i64) {
        let now = self.current.load(Relaxed) + n;
        self.current.store(now, Relaxed);
        self.allocated
            .store(self.allocated.load(Relaxed) + n, Relaxed);
        if now > self.peak.load(Relaxed) {
            self.peak.store(now, Relaxed);
        }
    }

    #[inline]
    fn remove(&self, n: i64) {
        self.current.store(self.current.load(Relaxed) - n, Relaxed);
        self.freed.store(self.freed.load(Relaxed) + n, Relaxed);
    }

    fn read(&self) -> Stat {
        Stat {
            current: self.current.load(Relaxed),
            peak: self.peak.load(Relaxed),
            allocated: self.allocated.load(Relaxed),
            freed: self.freed.load(Relaxed),
        }
    }

    fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }

    fn reset_accumulated(&self) {
        self.allocated.store(0, Relaxed);
        self.freed.store(0, Relaxed);
    }
}

/// The exact counters of one group of pools (see [`Tally`]): for each quantity, over all
/// blocks (`[0]`), the small pool (`[1]`) and the large pool (`[2]`).
#[derive(Debug, Default)]
pub(crate) struct Book {
    cells: [[Cell; 3]; QUANTITIES],
}

impl Book {
    #[inline]
    fn up(&self, q: usize, part: usize, n: i64) {
        self.cells[q][0].add(n);
        self.cells[q][part].add(n);
    }

    #[inline]
    fn down(&self, q: usize, part: usize, n: i64) {
        self.cells[q][0].remove(n);
        self.cells[q][part].remove(n);
    }

    #[inline]
    fn apply(&self, c: &Change) {
        if !c.detail {
            // Host statistics: active blocks and bytes over all blocks only.
            let [blocks, bytes] = [&self.cells[ACTIVE][0], &self.cells[ACTIVE_BYTES][0]];
            match c.kind {
                Kind::Lend => {
                    blocks.add(1);
                    bytes.add(c.bytes);
                }
                Kind::Deactivate | Kind::FreeIdle => {
                    blocks.remove(1);
                    bytes.remove(c.bytes);
                }
                Kind::Free => {}
            }
            return;
        }
        let part = 1 + block_pool(c.bytes as usize);
        match c.kind {
            Kind::Lend => {
                self.up(ACTIVE, part, 1);
                self.up(ACTIVE_BYTES, part, c.bytes);
                self.up(ALLOCATION, part, 1);
                self.up(ALLOCATED_BYTES, part, c.bytes);
                self.up(REQUESTED_BYTES, part, c.requested);
                if c.oversize {
                    self.cells[OVERSIZE][0].add(1);
                }
            }
            Kind::Free | Kind::FreeIdle => {
                self.down(ALLOCATION, part, 1);
                self.down(ALLOCATED_BYTES, part, c.bytes);
                self.down(REQUESTED_BYTES, part, c.requested);
                if c.oversize {
                    self.cells[OVERSIZE][0].remove(1);
                }
                if c.kind == Kind::FreeIdle {
                    self.down(ACTIVE, part, 1);
                    self.down(ACTIVE_BYTES, part, c.bytes);
                }
            }
            Kind::Deactivate => {
                self.down(ACTIVE, part, 1);
                self.down(ACTIVE_BYTES, part, c.bytes);
            }
        }
    }

    fn array(&self, q: usize) -> StatArray {
        StatArray {
            all: self.cells[q][0].read(),
            small_pool: self.cells[q][1].read(),
            large_pool: self.cells[q][2].read(),
        }
    }

    /// Active blocks and their bytes (`active_requests`, `active_bytes` of [`HostStats`]).
    fn host(&self) -> (Stat, Stat) {
        (
            self.cells[ACTIVE][0].read(),
            self.cells[ACTIVE_BYTES][0].read(),
        )
    }

    /// Writes what requests hold into a device report; the inactive bytes follow from the
    /// report's reserved bytes.
    fn device(&self, s: &mut DeviceStats) {
        s.allocation = self.array(ALLOCATION);
        s.allocated_bytes = self.array(ALLOCATED_BYTES);
        s.requested_bytes = self.array(REQUESTED_BYTES);
        s.active = self.array(ACTIVE);
        s.active_bytes = self.array(ACTIVE_BYTES);
        s.oversize_allocations = self.cells[OVERSIZE][0].read();
        s.derive_inactive();
    }

    fn reset_peak(&self) {
        self.cells.iter().flatten().for_each(Cell::reset_peak);
    }

    fn reset_accumulated(&self) {
        self.cells
            .iter()
            .flatten()
            .for_each(Cell::reset_accumulated);
    }

    /// Makes this book a copy of `o`.
    fn copy_from(&self, o: &Book) {
        for (a, b) in self.cells.iter().flatten().zip(o.cells.iter().flatten()) {
            for (x, y) in [
                (&a.current, &b.current),
                (&a.peak, &b.peak),
                (&a.allocated, &b.allocated),
                (&a.freed, &b.freed),
            ] {
                x.store(y.load(Relaxed), Relaxed);
            }
        }
    }
}

/// What the tally keeps of one pool: its bytes in use, and for a capture pool its own
/// group book (written, like the tally's books, only by the thread whose turn it is).
#[derive(Debug, Default)]
pub(crate) struct PoolBook {
    live: AtomicI64,
    own: Option<Book>,
}

/// A change waiting for the turn, with its pool.
struct Queued {
    pool: Arc<PoolBook>,
    change: Change,
}

/// The allocator's exact books of what requests hold: the whole allocator, the default
/// pool with its stream pools, and (in each capture pool's [`PoolBook`]) each capture pool.
/// Every change goes to the allocator's book and its group's, one at a time: by the thread
/// that takes the turn, or, when the turn is taken, queued for the next taker.
pub(crate) struct Tally {
    turn: CachePadded<AtomicBool>,
    queued: SegQueue<Queued>,
    /// Whether a capture pool was ever made: until then the default group is the whole
    /// allocator, and `total` is not written (it is a copy of `default_group` from then on).
    split: AtomicBool,
    total: Book,
    default_group: Book,
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tally")
            .field("queued", &self.queued.len())
            .finish_non_exhaustive()
    }
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            turn: CachePadded(AtomicBool::new(false)),
            queued: SegQueue::new(),
            split: AtomicBool::new(false),
            total: Book::default(),
            default_group: Book::default(),
        }
    }
}

impl Tally {
    #[inline]
    fn try_turn(&self) -> bool {
        !self.turn.load(Relaxed)
            && self
                .turn
                .compare_exchange(false, true, Ordering::Acquire, Relaxed)
                .is_ok()
    }

    #[inline]
    fn end_turn(&self) {
        self.turn.store(false, Ordering::Release);
    }

    /// Applies the queued changes, in the order they were queued (the turn is held).
    #[inline]
    fn settle(&self) {
        if self.queued.is_empty() {
            return;
        }
        while let Some(q) = self.queued.pop() {
            self.apply(&q.pool, &q.change);
        }
    }

    /// Applies a change of `pool` (the turn is held).
    #[inline]
    fn apply(&self, pool: &PoolBook, c: &Change) {
        let live = match c.kind {
            Kind::Lend => c.bytes,
            Kind::Deactivate | Kind::FreeIdle => -c.bytes,
            Kind::Free => 0,
        };
        pool.live.store(pool.live.load(Relaxed) + live, Relaxed);
        match &pool.own {
            Some(own) => {
                own.apply(c);
                self.total.apply(c);
            }
            None => {
                self.default_group.apply(c);
                if self.split.load(Relaxed) {
                    self.total.apply(c);
                }
            }
        }
    }

    /// Books a change of `pool`. Never waits.
    #[inline]
    pub(crate) fn record(&self, pool: &Arc<PoolBook>, change: Change) {
        if self.try_turn() {
            // What was queued before this change began comes first.
            self.settle();
            self.apply(pool, &change);
            self.end_turn();
            return;
        }
        self.queue(pool, change);
    }

    /// Queues a change for the thread whose turn it is.
    #[cold]
    #[inline(never)]
    fn queue(&self, pool: &Arc<PoolBook>, change: Change) {
        self.queued.push(Queued {
            pool: pool.clone(),
            change,
        });
        // The holder may have ended its turn before it saw this change.
        if self.try_turn() {
            self.settle();
            self.end_turn();
        }
    }

    /// Runs `f` with the turn held, after every queued change is applied (waits for the
    /// turn: for readers and the pool actors, never for the cached path).
    fn with_turn<T>(&self, f: impl FnOnce(&Self) -> T) -> T {
        let mut spins = 0u32;
        while !self.try_turn() {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        self.settle();
        let out = f(self);
        self.end_turn();
        out
    }

    /// The book of the whole allocator (the turn is held).
    fn total(&self) -> &Book {
        if self.split.load(Relaxed) {
            &self.total
        } else {
            &self.default_group
        }
    }

    /// The book of a capture pool, made now; from now on the allocator's book is kept apart
    /// from the default group's.
    fn capture_pool(&self) -> Arc<PoolBook> {
        self.with_turn(|t| {
            if !t.split.load(Relaxed) {
                t.total.copy_from(&t.default_group);
                t.split.store(true, Relaxed);
            }
        });
        Arc::new(PoolBook {
            live: AtomicI64::new(0),
            own: Some(Book::default()),
        })
    }

    /// The allocator's active blocks and bytes.
    pub(crate) fn host_total(&self) -> (Stat, Stat) {
        self.with_turn(|t| t.total().host())
    }

    /// Writes the allocator's totals of what requests hold into a device report.
    pub(crate) fn device_total(&self, s: &mut DeviceStats) {
        self.with_turn(|t| t.total().device(s))
    }

    /// Starts the peaks of the allocator's book and the default group's over from the
    /// values now.
    pub(crate) fn reset_peak(&self) {
        self.with_turn(|t| {
            t.total.reset_peak();
            t.default_group.reset_peak();
        })
    }

    /// Zeroes the accumulated counts of the allocator's book and the default group's.
    pub(crate) fn reset_accumulated(&self) {
        self.with_turn(|t| {
            t.total.reset_accumulated();
            t.default_group.reset_accumulated();
        })
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
    /// Granules moved within the expandable range (see `MemorySource::remap`).
    pub(crate) remaps: AtomicI64,
    /// The allocator's exact books.
    tally: Arc<Tally>,
    /// What the tally keeps of this pool.
    book: Arc<PoolBook>,
    /// Device statistics, for pools built with them (`None`: host statistics only).
    detail: Option<Detail>,
}

impl PoolStats {
    /// The books of a pool, booking what requests hold in `tally` (in its default group, or
    /// with `own_group` in a book of the pool's own); with `device`, device statistics too,
    /// blocks above `device` bytes counting as oversize.
    pub(crate) fn new(device: Option<usize>, tally: Arc<Tally>, own_group: bool) -> Self {
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
            book: if own_group {
                tally.capture_pool()
            } else {
                Arc::default()
            },
            tally,
            detail: device.map(Detail::new),
        }
    }

    #[inline]
    fn change(&self, kind: Kind, bytes: usize, requested: usize) -> Change {
        Change {
            kind,
            bytes: bytes as i64,
            requested: requested as i64,
            oversize: self.detail.as_ref().is_some_and(|d| bytes > d.max_split),
            detail: self.detail.is_some(),
        }
    }

    /// A block of `bytes` was lent for a request of `requested` bytes: it became active.
    #[inline]
    pub(crate) fn lend(&self, bytes: usize, requested: usize) {
        self.tally
            .record(&self.book, self.change(Kind::Lend, bytes, requested));
    }

    /// The user of a block of `bytes` freed it (device statistics only: it stays active
    /// until it is reusable).
    #[inline]
    pub(crate) fn freed(&self, bytes: usize, requested: usize) {
        if self.detail.is_some() {
            self.tally
                .record(&self.book, self.change(Kind::Free, bytes, requested));
        }
    }

    /// A block of `bytes` became reusable (or kept).
    #[inline]
    pub(crate) fn deactivate(&self, bytes: usize) {
        self.tally
            .record(&self.book, self.change(Kind::Deactivate, bytes, 0));
    }

    /// The user of a block of `bytes` freed it and it is reusable at once: [`Self::freed`]
    /// and [`Self::deactivate`] in one change.
    #[inline]
    pub(crate) fn freed_idle(&self, bytes: usize, requested: usize) {
        self.tally
            .record(&self.book, self.change(Kind::FreeIdle, bytes, requested));
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

    /// Device statistics of this pool's memory (segments, reserved bytes and counts; what
    /// requests hold is the group's, filled in by [`Self::fill_group_device`] or the
    /// allocator's by [`Tally::device_total`]). `None` for a pool built without them.
    pub(crate) fn read_device(&self) -> Option<DeviceStats> {
        let d = self.detail.as_ref()?;
        let mut s = d.read();
        s.num_alloc_retries = self.num_alloc_retries.load(Relaxed);
        s.num_ooms = self.num_ooms.load(Relaxed);
        let allocations = self.allocations.read();
        s.num_device_alloc = allocations.allocated;
        s.num_device_free = allocations.freed;
        Some(s)
    }

    /// Writes what the requests of this pool's group hold into a device report.
    pub(crate) fn fill_group_device(&self, s: &mut DeviceStats) {
        self.tally
            .with_turn(|t| self.book.own.as_ref().unwrap_or(&t.default_group).device(s))
    }

    /// The active blocks and bytes of this pool's group.
    pub(crate) fn group_host(&self) -> (Stat, Stat) {
        self.tally
            .with_turn(|t| self.book.own.as_ref().unwrap_or(&t.default_group).host())
    }

    /// The allocator's exact books.
    pub(crate) fn tally(&self) -> &Tally {
        &self.tally
    }

    /// Bytes of this pool's active blocks now.
    pub(crate) fn active_bytes_now(&self) -> i64 {
        self.tally.with_turn(|_| self.book.live.load(Relaxed))
    }

    /// This pool's host books, without what requests hold (zero here: it is kept by group,
    /// see [`Self::group_host`] and [`Tally::host_total`]).
    pub(crate) fn read(&self) -> HostStats {
        let allocations = self.allocations.read();
        let allocated_bytes = self.allocated_bytes.read();
        HostStats {
            allocations,
            allocated_bytes,
            active_requests: Stat::default(),
            active_bytes: Stat::default(),
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
            limit_bytes: None,
        }
    }

    /// Starts this pool's peaks over (a capture pool's group book's too; the allocator's and
    /// the default group's are [`Tally::reset_peak`]'s).
    pub(crate) fn reset_peak(&self) {
        self.allocations.reset_peak();
        self.allocated_bytes.reset_peak();
        if let Some(g) = &self.book.own {
            self.tally.with_turn(|_| g.reset_peak());
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
        if let Some(g) = &self.book.own {
            self.tally.with_turn(|_| g.reset_accumulated());
        }
        if let Some(d) = &self.detail {
            d.reset_accumulated();
        }
    }
}

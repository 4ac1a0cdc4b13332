//! Exact peaks of the counts the cached path keeps in thread shards: the ledger of
//! allowances.
//!
//! A count of the cached path (active bytes, blocks handed out, bytes requested, …) is a sum
//! over thread shards, each written by its thread with plain stores (invariant 5). Its peak
//! is the most that sum held at once, which no shard sees alone, and which a sum of the
//! shards' own peaks overstates. So every shard's count (a *leaf*) has an *allowance*: its
//! thread adds to the count without asking anyone while the count stays within the
//! allowance, and asks the [`Ledger`] for more when it does not. A *book* is one count of
//! one group of pools (its small blocks, its large blocks, or all of them); it keeps the sum
//! of the allowances granted to its leaves and its peak.
//!
//! Rules (each book, at every moment):
//!
//! 1. The sum of its leaves' counts is at most the sum of their allowances, except by the
//!    increases of threads on their way into the ledger (an increase is written first, then
//!    checked).
//! 2. The sum of its allowances is at most its peak.
//! 3. Its peak rises only when no leaf of it holds unused allowance (*slack*), and then to
//!    the sum of the allowances: a sum the leaves held (give or take the requests in flight
//!    at that moment, counted either way).
//!
//! How:
//!
//! - One thread at a time changes allowances and books (the ledger's turn).
//! - A leaf's slack is taken back by anyone while increases are frozen: the taker sets
//!   `frozen`, then makes every thread of the process pass a full barrier
//!   (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`), so that every owner either made its
//!   increase visible before, or sees `frozen` after its increase and comes to the ledger.
//!   Where that call is missing, owners pay a full fence on each increase instead.
//! - A leaf has two sides, each with its own allowance: what its owner thread adds (plain
//!   stores), and what threads sharing the shard add (more live threads than shards). Each
//!   side checks only what its own writers wrote: an owner's store and another thread's add
//!   to the same count are not seen by each other at once, and one allowance for both would
//!   let each spend the same slack.
//! - A thread sharing a shard adds with a sequentially consistent read-modify-write, then
//!   looks at `frozen` and at the shard's `reclaiming` mark: the owner takes its own shard's
//!   slack back without a freeze, marked.
//! - A decrease marks its shard as holding slack; the ledger looks for marks before it
//!   raises a peak, and freezes to take the slack back only where it finds one.

use std::sync::atomic::{
    compiler_fence, fence, AtomicBool, AtomicI64, AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst},
};
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::statistics::counters::ShardStat;
use crate::vocab::shard::{CachePadded, ThreadSlot};

/// Active requests (host statistics).
pub(crate) const REQUESTS: usize = 0;
/// Bytes of active requests (host statistics).
pub(crate) const BYTES: usize = 1;
/// Blocks handed out and not yet freed by their users (device statistics).
pub(crate) const ALLOCATION: usize = 2;
/// Bytes of `ALLOCATION`.
pub(crate) const ALLOCATED_BYTES: usize = 3;
/// Bytes the users asked for, of `ALLOCATION`.
pub(crate) const REQUESTED_BYTES: usize = 4;
/// Blocks handed out and not yet reusable.
pub(crate) const ACTIVE: usize = 5;
/// Bytes of `ACTIVE`.
pub(crate) const ACTIVE_BYTES: usize = 6;
/// Oversize blocks handed out and not yet freed.
pub(crate) const OVERSIZE: usize = 7;
/// How many counts a shard keeps.
pub(crate) const KINDS: usize = 8;
/// The book of both classes of a count (classes 0 and 1 are PyTorch's small and large pools;
/// host counts use class 0 only).
pub(crate) const ALL: usize = 2;
const BOOKS: usize = KINDS * 3;

fn book(kind: usize, class: usize) -> usize {
    kind * 3 + class
}

/// One count of a group: the allowances granted to its leaves, and its peak.
#[derive(Debug, Default)]
struct Book {
    peak: AtomicI64,
    granted: AtomicI64,
}

/// The books of a group of pools: one capture pool, the default pool with the stream pools,
/// or every pool of an engine.
#[derive(Debug)]
pub(crate) struct Group {
    books: [Book; BOOKS],
}

impl Group {
    pub(crate) fn new() -> Self {
        Self {
            books: std::array::from_fn(|_| Book::default()),
        }
    }

    /// The peak of count `kind` in `class` (0, 1 or [`ALL`]).
    pub(crate) fn peak(&self, kind: usize, class: usize) -> i64 {
        self.books[book(kind, class)].peak.load(Relaxed)
    }

    /// Room left under the peaks for `want` (per book).
    fn fits(&self, want: &[i64; BOOKS]) -> bool {
        self.books
            .iter()
            .zip(want)
            .all(|(b, &w)| w <= 0 || b.peak.load(Relaxed) - b.granted.load(Relaxed) >= w)
    }

    /// Grants `want`, raising peaks where it goes above them.
    fn grant(&self, want: &[i64; BOOKS]) {
        for (b, &w) in self.books.iter().zip(want) {
            if w != 0 {
                let granted = b.granted.load(Relaxed) + w;
                b.granted.store(granted, Relaxed);
                if granted > b.peak.load(Relaxed) {
                    b.peak.store(granted, Relaxed);
                }
            }
        }
    }

    fn take_back(&self, kind: usize, class: usize, n: i64) {
        for i in [book(kind, class), book(kind, ALL)] {
            let b = &self.books[i];
            b.granted.store(b.granted.load(Relaxed) - n, Relaxed);
        }
    }

    fn reset_peaks(&self) {
        for b in &self.books {
            b.peak.store(b.granted.load(Relaxed), Relaxed);
        }
    }
}

/// One thread shard's counts in one pool.
#[derive(Debug, Default)]
pub(crate) struct ShardLeaves {
    /// Count `kind` of class `class`: `leaf[kind][class]`.
    pub(crate) leaf: [[ShardStat; 2]; KINDS],
    /// Set by a decrease: some count of this shard may be below its allowance.
    slack: AtomicBool,
    /// Set while the owner takes the shard's slack back (see the module's rules).
    reclaiming: AtomicBool,
}

impl ShardLeaves {
    /// Whether the side of count `kind` of class `class` that `owner` writes is within its
    /// allowance.
    #[inline]
    pub(crate) fn covered(&self, kind: usize, class: usize, owner: bool) -> bool {
        self.leaf[kind][class].covered(owner)
    }
}

/// One pool's counts, shard by shard, and the group it is counted in.
#[derive(Debug)]
pub(crate) struct Leaves {
    pub(crate) shards: Box<[CachePadded<ShardLeaves>]>,
    /// A bit per shard whose mark was set since the ledger last cleared it: where to look.
    marked: Box<[AtomicU64]>,
    pub(crate) group: Arc<Group>,
}

impl Leaves {
    /// Notes a decrease of a count of `shard` (called after it).
    #[inline]
    pub(crate) fn note_slack(&self, shard: usize) {
        let s = &self.shards[shard];
        // The other half of the barrier in `Ledger::steal`: the decrease is seen by its
        // reads, or this look sees the mark it cleared.
        compiler_fence(SeqCst);
        if !s.slack.load(SeqCst) {
            s.slack.store(true, Release);
            self.marked[shard / 64].fetch_or(1 << (shard % 64), Release);
        }
    }
}

/// The allowances and books of one engine (see the module's rules).
#[derive(Debug)]
pub(crate) struct Ledger {
    /// What every increase reads, on a line of its own (away from `busy` and the books).
    gate: CachePadded<Gate>,
    /// One thread at a time changes allowances and books.
    busy: AtomicBool,
    /// Every pool of the engine.
    engine: Group,
    /// The default pool and the stream pools.
    default_group: Arc<Group>,
    /// The pools alive.
    pools: ArcSwap<Vec<Arc<Leaves>>>,
}

/// What an increase looks at after it is written.
#[derive(Debug)]
struct Gate {
    /// Set while slack is taken back from other threads' shards.
    frozen: AtomicBool,
    /// Owners fence each increase (no process-wide barrier is available).
    fenced: bool,
}

/// The ledger's turn, given back on drop.
struct Turn<'a>(&'a AtomicBool);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Release);
    }
}

impl Ledger {
    pub(crate) fn new() -> Self {
        Self {
            gate: CachePadded(Gate {
                frozen: AtomicBool::new(false),
                fenced: !barrier::available(),
            }),
            busy: AtomicBool::new(false),
            engine: Group::new(),
            default_group: Arc::new(Group::new()),
            pools: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// The books of every pool.
    pub(crate) fn engine(&self) -> &Group {
        &self.engine
    }

    /// The books of the default pool and the stream pools.
    pub(crate) fn default_group(&self) -> &Arc<Group> {
        &self.default_group
    }

    /// Registers a pool's counts, with `shards` shards, counted in `group`.
    pub(crate) fn register(&self, shards: usize, group: Arc<Group>) -> Arc<Leaves> {
        let leaves = Arc::new(Leaves {
            shards: (0..shards).map(|_| CachePadded::default()).collect(),
            marked: (0..shards.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            group,
        });
        let _turn = self.turn();
        let mut pools = Vec::clone(&self.pools.load());
        // A thread's shard in one pool is its shard in every other: one shard count.
        debug_assert!(pools.iter().all(|p| p.shards.len() == shards));
        pools.push(leaves.clone());
        self.pools.store(Arc::new(pools));
        leaves
    }

    /// Takes a pool's counts out of the books (the pool is gone).
    pub(crate) fn unregister(&self, leaves: &Arc<Leaves>) {
        let _turn = self.turn();
        let mut pools = Vec::clone(&self.pools.load());
        pools.retain(|p| !Arc::ptr_eq(p, leaves));
        self.pools.store(Arc::new(pools));
        for shard in leaves.shards.iter() {
            for (kind, classes) in shard.leaf.iter().enumerate() {
                for (class, leaf) in classes.iter().enumerate() {
                    let a = leaf.allowance();
                    if a != 0 {
                        leaf.clear_allowances();
                        self.engine.take_back(kind, class, a);
                        leaves.group.take_back(kind, class, a);
                    }
                }
            }
        }
    }

    /// After the increases of a thread that shares `shard` (made with sequentially
    /// consistent read-modify-writes): whether it may go on without the ledger (then it
    /// still checks that its counts are covered).
    #[inline]
    pub(crate) fn open_shared(&self, shard: &ShardLeaves) -> bool {
        !self.gate.frozen.load(SeqCst) && !shard.reclaiming.load(SeqCst)
    }

    /// After an owner's increases: whether its thread may go on without the ledger (then it
    /// still checks that its counts are covered).
    #[inline]
    pub(crate) fn open(&self) -> bool {
        if self.gate.fenced {
            fence(SeqCst);
        } else {
            // The other half of the barrier is the process-wide one in `freeze`.
            compiler_fence(SeqCst);
        }
        !self.gate.frozen.load(Acquire)
    }

    fn turn(&self) -> Turn<'_> {
        let mut spins = 0u32;
        while self
            .busy
            .compare_exchange_weak(false, true, Acquire, Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        Turn(&self.busy)
    }

    /// Covers the counts of `me`'s shard in `pool` that went above their allowances.
    #[cold]
    #[inline(never)]
    pub(crate) fn settle(&self, pool: &Leaves, me: ThreadSlot) {
        let _turn = self.turn();
        let shard = &pool.shards[me.shard];
        let (mut reclaimed, mut stolen) = (false, false);
        loop {
            // Each excess is read once: other threads may add to this shard meanwhile, and
            // what is granted must be what the books count.
            let mut want = [0i64; BOOKS];
            let mut excess = [[0i64; 2]; KINDS];
            let mut short = [false; KINDS];
            for (kind, classes) in shard.leaf.iter().enumerate() {
                for (class, leaf) in classes.iter().enumerate() {
                    // Only the caller's side: the other side's writers settle their own.
                    let e = leaf.excess(me.owns);
                    if e > 0 {
                        excess[kind][class] = e;
                        want[book(kind, class)] += e;
                        want[book(kind, ALL)] += e;
                        short[kind] = true;
                    }
                }
            }
            if !short.contains(&true) {
                return;
            }
            let fits = pool.group.fits(&want) && self.engine.fits(&want);
            if !fits && me.owns && !reclaimed {
                reclaimed = true;
                for p in self.pools.load().iter() {
                    let mine = &p.shards[me.shard];
                    // Threads sharing the shard look at the mark after adding: each either
                    // sees it (and comes here) or added before the counts are read.
                    mine.reclaiming.store(true, SeqCst);
                    fence(SeqCst);
                    // Only the counts that are short: the others keep their slack (taking
                    // it would only send their next increases here).
                    self.reclaim(p, mine, &short);
                    mine.reclaiming.store(false, Release);
                }
                continue;
            }
            if !fits && !stolen && self.slack_elsewhere(me) {
                stolen = true;
                self.steal();
                continue;
            }
            // Within the peaks, or every other leaf is tight: the sum is what was held.
            for (leaf, &e) in shard.leaf.iter().flatten().zip(excess.iter().flatten()) {
                if e > 0 {
                    leaf.grant(me.owns, e);
                }
            }
            pool.group.grant(&want);
            self.engine.grant(&want);
            if !me.owns {
                // Read while others change it, the count may have come out high: whatever
                // was granted beyond it is slack.
                pool.note_slack(me.shard);
            }
            return;
        }
    }

    /// Sets every peak of the engine's groups to what is held now.
    pub(crate) fn reset_peaks(&self) {
        let _turn = self.turn();
        self.steal();
        self.engine.reset_peaks();
        self.default_group.reset_peaks();
        for p in self.pools.load().iter() {
            p.group.reset_peaks();
        }
    }

    /// Whether a shard other than `me`'s own (when it owns it) may hold slack.
    fn slack_elsewhere(&self, me: ThreadSlot) -> bool {
        self.pools.load().iter().any(|p| {
            p.marked.iter().enumerate().any(|(w, bits)| {
                let mut bits = bits.load(Acquire);
                if me.owns && me.shard / 64 == w {
                    bits &= !(1 << (me.shard % 64));
                }
                bits != 0
            })
        })
    }

    /// Takes back every leaf's slack, increases frozen meanwhile. Holds the turn.
    fn steal(&self) {
        self.gate.frozen.store(true, SeqCst);
        let pools = self.pools.load();
        // Unmark before the barrier, the bits before the marks: a decrease that finds its
        // shard marked was made before the barrier (seen by the reads below); one after it
        // finds the mark cleared and marks again (mark, then bit). At worst a bit outlives
        // its mark, and one more freeze finds nothing.
        for p in pools.iter() {
            p.marked.iter().for_each(|w| {
                w.swap(0, AcqRel);
            });
            p.shards.iter().for_each(|s| {
                s.slack.swap(false, AcqRel);
            });
        }
        fence(SeqCst);
        if !self.gate.fenced {
            barrier::process_wide();
        }
        for p in pools.iter() {
            for s in p.shards.iter() {
                self.reclaim(p, s, &[true; KINDS]);
            }
        }
        self.gate.frozen.store(false, Release);
    }

    /// Takes back the slack of one shard's leaves of the `kinds` marked: by the shard's
    /// owner, or while frozen. Holds the turn.
    fn reclaim(&self, pool: &Leaves, shard: &ShardLeaves, kinds: &[bool; KINDS]) {
        for (kind, classes) in shard.leaf.iter().enumerate() {
            if !kinds[kind] {
                continue;
            }
            for (class, leaf) in classes.iter().enumerate() {
                for side in [true, false] {
                    let e = leaf.excess(side);
                    if e < 0 {
                        leaf.grant(side, e);
                        self.engine.take_back(kind, class, -e);
                        pool.group.take_back(kind, class, -e);
                    }
                }
            }
        }
    }
}

impl Default for Ledger {
    fn default() -> Self {
        Self::new()
    }
}

/// The process-wide barrier: `membarrier(2)` on Linux.
#[cfg(all(target_os = "linux", not(miri), not(pinpool_loom)))]
mod barrier {
    use std::sync::OnceLock;

    const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;
    const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    const GLOBAL: libc::c_int = 1;

    /// Whether the barrier works in this process (registers the process once).
    pub(super) fn available() -> bool {
        static REGISTERED: OnceLock<bool> = OnceLock::new();
        *REGISTERED.get_or_init(|| {
            // SAFETY: membarrier takes two integers and a flag word; registration changes
            // nothing but the process's membarrier state.
            let r =
                unsafe { libc::syscall(libc::SYS_membarrier, REGISTER_PRIVATE_EXPEDITED, 0, 0) };
            r == 0
        })
    }

    /// Makes every running thread of the process pass a full memory barrier.
    pub(super) fn process_wide() {
        // SAFETY: as above; the process registered in `available`, which returned true
        // before any ledger relied on this call.
        if unsafe { libc::syscall(libc::SYS_membarrier, PRIVATE_EXPEDITED, 0, 0) } == 0 {
            return;
        }
        // Refused after a registration that worked (a seccomp filter installed since): the
        // global barrier, which needs no registration, is slower but as strong.
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_membarrier, GLOBAL, 0, 0) } == 0 {
            return;
        }
        // No barrier at all: peaks may come out low by what owners added meanwhile. Said
        // once; statistics are not worth a hang or an abort.
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::error!("membarrier refused: exact peaks may come out low from now on");
        }
    }
}

#[cfg(not(all(target_os = "linux", not(miri), not(pinpool_loom))))]
mod barrier {
    pub(super) fn available() -> bool {
        false
    }

    pub(super) fn process_wide() {}
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Waits until `count` threads have arrived (spinning, then yielding).
    fn meet(arrived: &AtomicUsize, count: usize) {
        arrived.fetch_add(1, AcqRel);
        let mut spins = 0u32;
        while arrived.load(Acquire) < count {
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// The owner of a shard and a thread sharing it add to one count at the same moment,
    /// each past half of the count's slack: whichever goes on without the ledger must be
    /// covered by allowances the ledger granted, so the two never pass together over the
    /// count's total allowance. (With one allowance for both sides, each read the other's
    /// side as it was and both passed, about one round in 800 on two cores.)
    #[test]
    fn an_owner_and_a_thread_sharing_its_shard_never_both_spend_the_same_slack() {
        const ROUNDS: usize = 20_000;
        let ledger = Ledger::new();
        let leaves = ledger.register(1, ledger.default_group().clone());
        let owner = ThreadSlot {
            shard: 0,
            owns: true,
        };
        let leaf = &leaves.shards[0].leaf[BYTES][0];
        // Slack of 10 on the owner's side.
        leaf.increase(10, true);
        ledger.settle(&leaves, owner);
        leaf.decrease(10, true);
        let arrived = AtomicUsize::new(0);
        let passed = [AtomicBool::new(false), AtomicBool::new(false)];
        let over = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..2usize {
                let (arrived, passed, over, leaves, ledger) =
                    (&arrived, &passed, &over, &leaves, &ledger);
                s.spawn(move || {
                    let shard = &leaves.shards[0];
                    let leaf = &shard.leaf[BYTES][0];
                    for i in 0..ROUNDS {
                        meet(arrived, 5 * i + 2);
                        let ok = if t == 0 {
                            leaf.increase(6, true);
                            ledger.open() && leaf.covered(true)
                        } else {
                            leaf.increase(6, false);
                            ledger.open_shared(shard) && leaf.covered(false)
                        };
                        passed[t].store(ok, Relaxed);
                        meet(arrived, 5 * i + 4);
                        if t == 0 {
                            let both = passed[0].load(Relaxed) && passed[1].load(Relaxed);
                            if both && leaf.allowance() < 12 {
                                over.fetch_add(1, Relaxed);
                            }
                            leaf.decrease(6, true);
                            leaf.decrease(6, false);
                            arrived.fetch_add(1, AcqRel);
                        }
                    }
                });
            }
        });
        assert_eq!(over.load(Relaxed), 0, "rounds where both passed uncovered");
    }
}

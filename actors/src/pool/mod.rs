//! The pool actor: one per pool (the default pool, and one per private capture pool).
//!
//! It owns the pool's books and every block of the pool that is not lent out, queued as
//! ready, or waiting on events: it answers misses (first noticing blocks whose events have
//! completed — invariant 3 — then taking fresh memory on a blocking thread — invariant 6),
//! keeps blocks used by captured work (invariant 4), empties the cache, and on shutdown gives
//! every block back to the runtime as it comes home (invariant 2).
//!
//! Under a memory limit it also queues the requests that wait for room, first come first
//! served (see [`crate::limit`]), and serves them as blocks come back or room is made.
//!
//! Under a policy whose layout carves blocks out of shared segments ([`BlockLayout::Carved`])
//! it also owns the free ranges of those segments (see `segments`).
//!
//! This file holds the pool's shared part, its messages and its loop; `cache`, `fresh`,
//! `segments`, `waiters` and `books` hold what the actor does.

mod arena;
mod books;
mod cache;
mod fresh;
mod segments;
mod waiters;

pub(crate) use segments::Segment;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flume::{Receiver, Sender};

use crate::block::{Block, BlockState};
use crate::limit::{Ask, Budget, MissReply};
use crate::policy::{BlockLayout, SizeClass};
use crate::poller::PollerMsg;
use crate::pool_id::PoolId;
use crate::ready::ReadyQueues;
use crate::runtime::{HostMemory, Runtime, RuntimeError};
use crate::snapshot::BlockMeta;
use crate::spawn::spawn_named;
use crate::stats::PoolStats;

/// A one-shot reply: `recv_async` from tasks, `recv` from plain threads.
pub(crate) type Reply<T> = Sender<T>;

/// Messages a pool actor answers.
pub(crate) enum PoolMsg<R: Runtime> {
    /// No ready block of `class`: find one or get fresh memory (or queue the request when
    /// it must wait for room).
    Miss {
        class: SizeClass,
        ask: Ask,
        reply: Reply<MissReply<R>>,
    },
    /// A block used by captured work: keep it while the pool lives.
    Keep(Box<Block<R>>),
    /// A block coming home outside the ready queues (closing pool, cancelled reply).
    Home(Box<Block<R>>),
    /// Free every cached block (and the kept ones when the pool is released).
    EmptyCache {
        include_kept: bool,
        reply: Reply<EmptyReport>,
    },
    /// Count what the pool holds (for checking invariant 2 at quiescent points).
    Inventory { reply: Reply<Inventory> },
    /// List the pool's segments and its cached and kept blocks (for snapshots).
    Describe { reply: Reply<PoolView> },
    /// Look at the queued requests again: room was made, or one was cancelled.
    Wake,
    /// The pool's owner is gone: give everything back as it comes home, then stop.
    Close,
}

/// What `empty_cache` did to one pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmptyReport {
    /// Blocks given back to the runtime.
    pub freed_blocks: usize,
    /// Bytes given back to the runtime.
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

/// Where a pool's reserved bytes are, at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inventory {
    /// The pool.
    pub pool: PoolId,
    /// Bytes of pinned memory held.
    pub reserved_bytes: usize,
    /// Host allocations held.
    pub segments: usize,
    /// Blocks in the ready queues, and their bytes.
    pub cached_blocks: usize,
    /// Bytes of `cached_blocks`.
    pub cached_bytes: usize,
    /// Blocks freed by users that wait on events.
    pub waiting_blocks: usize,
    /// Bytes of `waiting_blocks`.
    pub waiting_bytes: usize,
    /// Blocks kept for graph replays.
    pub kept_blocks: usize,
    /// Bytes of `kept_blocks`.
    pub kept_bytes: usize,
    /// Blocks lent out: the rest.
    pub in_use_blocks: usize,
    /// Bytes of `in_use_blocks`.
    pub in_use_bytes: usize,
}

/// A segment of the pool, as its registry knows it.
#[derive(Clone)]
pub(crate) struct SegmentView {
    pub(crate) memory: HostMemory,
    /// The record of the segment's block, when the segment is one whole block.
    pub(crate) meta: Arc<BlockMeta>,
    /// The segment's pieces in address order, when blocks are carved out of it (filled in by
    /// `describe`; empty for a whole block).
    pub(crate) pieces: Vec<PieceView>,
}

/// One piece of a carved segment: a block cut out of it, or a free range.
#[derive(Clone)]
pub(crate) struct PieceView {
    pub(crate) addr: usize,
    pub(crate) size: usize,
    /// The block's record; `None` for a free range.
    pub(crate) meta: Option<Arc<BlockMeta>>,
}

impl SegmentView {
    pub(crate) fn addr(&self) -> usize {
        self.memory.ptr.as_ptr() as usize
    }
}

/// What a pool holds, by address, at one moment (for snapshots).
pub(crate) struct PoolView {
    pub(crate) pool: PoolId,
    pub(crate) segments: Vec<SegmentView>,
    pub(crate) cached: Vec<usize>,
    pub(crate) kept: Vec<usize>,
}

/// `divert` bit: the pool is closing.
pub(crate) const DIVERT_CLOSING: u8 = 1;
/// `divert` bit: requests wait for room somewhere in the allocator.
pub(crate) const DIVERT_PRESSURE: u8 = 2;

/// The part of a pool every handle and block can reach.
pub(crate) struct PoolShared<R: Runtime> {
    pub(crate) id: PoolId,
    pub(crate) runtime: Arc<R>,
    pub(crate) ready: ReadyQueues<R>,
    pub(crate) mailbox: Sender<PoolMsg<R>>,
    pub(crate) poller: Sender<PollerMsg<R>>,
    pub(crate) stats: PoolStats,
    /// Non-zero when frees must go to the actor, not the ready queues: the pool is closing
    /// ([`DIVERT_CLOSING`]), or requests wait for room ([`DIVERT_PRESSURE`]).
    pub(crate) divert: AtomicU8,
    /// The allocator's budget of reserved bytes, shared by all its pools.
    pub(crate) budget: Arc<Budget<R>>,
    /// Requests queued in this pool.
    pub(crate) queued: AtomicUsize,
    /// A `Wake` is on its way to the actor.
    woken: AtomicBool,
    /// Addresses of segments freed, for the actor to strike from its registry.
    forgotten: (Sender<usize>, Receiver<usize>),
    pub(crate) history: Arc<crate::history::Recorder>,
    /// Freed blocks larger than this go to the actor, not the ready queues.
    pub(crate) max_cached_size: usize,
    /// Freed carved blocks larger than this that do not fill their segment go to the actor,
    /// to be coalesced at once.
    pub(crate) absorb_above: usize,
}

impl<R: Runtime> PoolShared<R> {
    /// Whether a freed block goes to the actor rather than the ready queues: too large to
    /// cache, or a large piece of a segment (coalesced at once).
    #[inline]
    pub(crate) fn wants_home(&self, block: &Block<R>) -> bool {
        block.size > self.max_cached_size || self.large_piece(block)
    }

    /// Whether the block is a large piece that fills less than 3/4 of its carved segment: on
    /// free it goes back into its segment at once, to coalesce with its neighbours. Larger
    /// pieces, and pieces recalled to the range their class just gave back, stay on the
    /// cached path like whole segments: a request of their class that comes back again and
    /// again is served without the pool actor.
    #[inline]
    pub(crate) fn large_piece(&self, block: &Block<R>) -> bool {
        block.size > self.absorb_above
            && !block.recalled
            && block
                .segment
                .as_ref()
                .is_some_and(|s| (block.size as u128) * 4 < (s.size() as u128) * 3)
    }
}

impl<R: Runtime> PoolShared<R> {
    /// Gives a block's memory back to the runtime on this thread and keeps the books
    /// (stats, the budget, and the registry of segments). When the runtime refuses, the
    /// block is handed back, still reserved and still counted.
    ///
    /// A block carved out of a segment is not a host allocation: it lets go of its segment,
    /// which goes back to the runtime with its last piece (see `segments`).
    pub(crate) fn free_block_now(&self, mut block: Box<Block<R>>) -> Result<(), Box<Block<R>>> {
        if let Some(segment) = block.segment.take() {
            block.freed = true;
            drop(segment);
            return Ok(());
        }
        match self.free_memory_now(block.memory) {
            Ok(()) => {
                block.freed = true;
                Ok(())
            }
            Err(_) => Err(block),
        }
    }

    /// Gives a host allocation back to the runtime on this thread and keeps the books (stats,
    /// history, the budget, and the registry of segments).
    pub(crate) fn free_memory_now(&self, memory: HostMemory) -> Result<(), RuntimeError> {
        let t0 = Instant::now();
        let res = self.runtime.host_free(memory);
        self.stats.host_free_time.record(t0.elapsed());
        match res {
            Ok(()) => {
                crate::history::on_segment_free(self, &memory);
                self.stats.allocations.decrease(1);
                self.stats.allocated_bytes.decrease(memory.size as i64);
                // The actor awaits its frees before it takes fresh memory, so the address is
                // struck before the runtime can hand it back to this pool.
                let _ = self.forgotten.0.send(memory.ptr.as_ptr() as usize);
                self.budget.release(memory.size);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, bytes = memory.size, "freeing pinned memory failed");
                Err(e)
            }
        }
    }

    /// Asks the actor to look at its queued requests again (once per look).
    pub(crate) fn nudge(&self) {
        if self.queued.load(Ordering::SeqCst) > 0 && !self.woken.swap(true, Ordering::SeqCst) {
            let _ = self.mailbox.send(PoolMsg::Wake);
        }
    }
}

/// Everything needed to start a pool.
pub(crate) struct PoolSpec<R: Runtime> {
    pub(crate) id: PoolId,
    pub(crate) runtime: Arc<R>,
    pub(crate) classes: usize,
    pub(crate) shards: usize,
    pub(crate) poller: Sender<PollerMsg<R>>,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) budget: Arc<Budget<R>>,
    pub(crate) history: Arc<crate::history::Recorder>,
    pub(crate) layout: BlockLayout,
}

/// Starts a pool actor and returns the pool's shared part.
pub(crate) fn start_pool<R: Runtime>(spec: PoolSpec<R>) -> Arc<PoolShared<R>> {
    let (tx, rx) = flume::unbounded();
    let shared = Arc::new(PoolShared {
        id: spec.id,
        runtime: spec.runtime,
        ready: ReadyQueues::new(spec.classes, spec.shards),
        mailbox: tx,
        poller: spec.poller,
        stats: PoolStats::new(spec.shards),
        divert: AtomicU8::new(0),
        budget: spec.budget,
        queued: AtomicUsize::new(0),
        woken: AtomicBool::new(false),
        forgotten: flume::unbounded(),
        history: spec.history,
        max_cached_size: match spec.layout {
            BlockLayout::Whole => usize::MAX,
            BlockLayout::Carved(c) => c.max_cached_size,
        },
        absorb_above: match spec.layout {
            BlockLayout::Whole => usize::MAX,
            BlockLayout::Carved(c) => c.small_limit,
        },
    });
    shared.budget.register(&shared);
    let actor = PoolActor {
        shared: shared.clone(),
        rx,
        kept: Vec::new(),
        closing: false,
        finished: false,
        waiters: VecDeque::new(),
        segments: BTreeMap::new(),
        carved: segments::Segments::for_layout(spec.layout),
        refused: Vec::new(),
    };
    let name = if spec.id.is_default() {
        "pinpool::pool(default)".to_string()
    } else {
        format!("pinpool::pool({})", spec.id)
    };
    spawn_named(&name, &spec.handle, actor.run());
    shared
}

pub(crate) struct PoolActor<R: Runtime> {
    shared: Arc<PoolShared<R>>,
    rx: Receiver<PoolMsg<R>>,
    kept: Vec<Box<Block<R>>>,
    closing: bool,
    /// Set when the loop ended on its own; unset when the task is dropped by its runtime.
    finished: bool,
    /// Requests waiting for room, oldest first.
    waiters: VecDeque<waiters::Waiter<R>>,
    /// Every segment the pool holds, by address.
    segments: BTreeMap<usize, SegmentView>,
    /// Free ranges of the pool's segments, when the layout carves blocks out of them.
    carved: Option<segments::Segments<R>>,
    /// Carved segments whose free the runtime refused: never reused, tried again with the
    /// kept blocks (counted as kept).
    refused: Vec<Arc<Segment<R>>>,
}

impl<R: Runtime> Drop for PoolActor<R> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // The task was dropped with its tokio runtime: from now on frees cannot reach the
        // actor, so they free on the spot; what is cached now is freed here.
        self.shared
            .divert
            .fetch_or(DIVERT_CLOSING, Ordering::SeqCst);
        // Blocks already in the mailbox would keep the pool (and the mailbox) alive forever.
        let mut homeless = self.shared.ready.drain();
        for msg in self.rx.try_iter() {
            match msg {
                PoolMsg::Home(b) | PoolMsg::Keep(b) => match b.state {
                    BlockState::Kept | BlockState::Waiting => self.kept.push(b),
                    _ => homeless.push(b),
                },
                _ => {} // replies dropped: their callers get `Error::Shutdown`
            }
        }
        // So would parked blocks, should the poller that watches them be gone too: those
        // whose events have completed are freed, the others kept (leaked below).
        for mut b in self.shared.ready.unpark_drain() {
            if b.events_completed() {
                b.leave_waiting();
                homeless.push(b);
            } else {
                self.kept.push(b);
            }
        }
        for b in homeless {
            if let Err(mut b) = self.shared.free_block_now(b) {
                b.freed = true;
            }
        }
        for s in self.refused.drain(..) {
            s.leak();
        }
        for mut b in self.kept.drain(..) {
            if let Some(s) = &b.segment {
                s.leak();
            }
            // Kept for graph replays (or refused by the runtime): never safe to reuse, and
            // nobody is left to say when it is safe to free.
            tracing::warn!(
                bytes = b.memory.size,
                "pool torn down with its runtime; kept block leaked"
            );
            b.freed = true;
        }
    }
}

/// How often a closing pool looks for blocks that slipped into its ready queues (doubling
/// up to the maximum while buffers stay out).
const CLOSING_SWEEP: Duration = Duration::from_millis(5);
const MAX_CLOSING_SWEEP: Duration = Duration::from_secs(1);
/// How often a pool looks at its waiters and ready queues while requests wait for room
/// (a free that raced with the raising of the pressure flag lands in a ready queue).
const PRESSURE_SWEEP: Duration = Duration::from_millis(2);

impl<R: Runtime> PoolActor<R> {
    async fn run(mut self) {
        let mut sweep = CLOSING_SWEEP;
        loop {
            if self.closing {
                if self.shared.stats.allocations.read().current <= 0 {
                    break;
                }
                match tokio::time::timeout(sweep, self.rx.recv_async()).await {
                    Ok(Ok(msg)) => self.handle(msg).await,
                    Ok(Err(_)) => break,
                    Err(_) => {
                        // Blocks that slipped into the ready queues as the pool closed, and
                        // blocks whose free the runtime refused, are tried again; blocks
                        // parked by freeing threads go to the poller.
                        self.shared.ready.unpark_all(&self.shared.poller);
                        let blocks = self.shared.ready.drain();
                        self.free_blocks(blocks).await;
                        self.free_kept().await;
                        sweep = (sweep * 2).min(MAX_CLOSING_SWEEP);
                    }
                }
            } else if self.shared.budget.under_pressure() || !self.waiters.is_empty() {
                let sweep = tokio::time::Instant::now() + PRESSURE_SWEEP;
                match tokio::time::timeout_at(sweep, self.rx.recv_async()).await {
                    Ok(Ok(msg)) => {
                        self.handle(msg).await;
                        if tokio::time::Instant::now() >= sweep {
                            self.relieve().await;
                        }
                    }
                    Ok(Err(_)) => break,
                    Err(_) => self.relieve().await,
                }
            } else {
                match self.rx.recv_async().await {
                    Ok(msg) => self.handle(msg).await,
                    Err(_) => break,
                }
            }
        }
        self.drop_waiters();
        self.finished = true;
        tracing::debug!(pool = %self.shared.id, "pool actor stopped");
    }

    async fn handle(&mut self, msg: PoolMsg<R>) {
        match msg {
            PoolMsg::Miss { class, ask, reply } => self.on_miss(class, ask, reply).await,
            PoolMsg::Keep(block) => {
                // Counted as kept by the thread that freed it.
                self.kept.push(block);
                if self.closing {
                    self.free_kept().await;
                }
            }
            PoolMsg::Home(block) => self.take_back(block).await,
            PoolMsg::EmptyCache {
                include_kept,
                reply,
            } => {
                let report = self.empty_cache(include_kept).await;
                let _ = reply.send(report);
            }
            PoolMsg::Inventory { reply } => {
                let _ = reply.send(self.inventory());
            }
            PoolMsg::Describe { reply } => {
                let _ = reply.send(self.describe());
            }
            PoolMsg::Wake => {
                self.shared.woken.store(false, Ordering::SeqCst);
                self.serve_waiters().await;
            }
            PoolMsg::Close => {
                self.closing = true;
                self.shared
                    .divert
                    .fetch_or(DIVERT_CLOSING, Ordering::Release);
                self.drop_waiters();
                self.empty_cache(true).await;
            }
        }
    }
}

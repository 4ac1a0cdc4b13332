//! The pool actor: one per pool (the default pool, and one per private capture pool).
//!
//! It owns the pool's books and every block of the pool that is not lent out, queued as
//! ready, or waiting on events: it answers misses (first noticing blocks whose events have
//! completed — invariant 3 — then taking fresh memory on a blocking thread — invariant 6),
//! keeps blocks used by captured work (invariant 4), empties the cache, and on shutdown gives
//! every block back to the runtime as it comes home (invariant 2).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flume::{Receiver, Sender};

use crate::block::{Block, BlockState};
use crate::error::Error;
use crate::policy::SizeClass;
use crate::poller::PollerMsg;
use crate::pool_id::PoolId;
use crate::ready::ReadyQueues;
use crate::runtime::{HostMemory, Runtime, RuntimeError};
use crate::spawn::spawn_named;
use crate::stats::PoolStats;

/// A one-shot reply: `recv_async` from tasks, `recv` from plain threads.
pub(crate) type Reply<T> = Sender<T>;

/// Messages a pool actor answers.
pub(crate) enum PoolMsg<R: Runtime> {
    /// No ready block of `class`: find one or get fresh memory.
    Miss {
        class: SizeClass,
        reply: Reply<Result<Box<Block<R>>, Error>>,
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

/// The part of a pool every handle and block can reach.
pub(crate) struct PoolShared<R: Runtime> {
    pub(crate) id: PoolId,
    pub(crate) runtime: Arc<R>,
    pub(crate) ready: ReadyQueues<R>,
    pub(crate) mailbox: Sender<PoolMsg<R>>,
    pub(crate) poller: Sender<PollerMsg<R>>,
    pub(crate) stats: PoolStats,
    /// Set when the pool is closing: frees go to the actor, not the ready queues.
    pub(crate) closed: AtomicBool,
}

impl<R: Runtime> PoolShared<R> {
    /// Gives a block's memory back to the runtime on this thread and keeps the books.
    pub(crate) fn free_block_now(self: Arc<Self>, mut block: Box<Block<R>>) {
        block.freed = true;
        let t0 = Instant::now();
        let res = self.runtime.host_free(block.memory);
        self.account_free(&block.memory, t0.elapsed(), res);
    }

    fn account_free(&self, memory: &HostMemory, took: Duration, res: Result<(), RuntimeError>) {
        self.stats.host_free_time.record(took);
        if let Err(e) = res {
            tracing::error!(error = %e, bytes = memory.size, "freeing pinned memory failed");
        }
        self.stats.allocations.decrease(1);
        self.stats.allocated_bytes.decrease(memory.size as i64);
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
        closed: AtomicBool::new(false),
    });
    let actor = PoolActor {
        shared: shared.clone(),
        rx,
        kept: Vec::new(),
        closing: false,
    };
    let name = if spec.id.is_default() {
        "pinpool::pool(default)".to_string()
    } else {
        format!("pinpool::pool({})", spec.id)
    };
    spawn_named(&name, &spec.handle, actor.run());
    shared
}

struct PoolActor<R: Runtime> {
    shared: Arc<PoolShared<R>>,
    rx: Receiver<PoolMsg<R>>,
    kept: Vec<Box<Block<R>>>,
    closing: bool,
}

/// How often a closing pool looks for blocks that slipped into its ready queues.
const CLOSING_SWEEP: Duration = Duration::from_millis(5);

impl<R: Runtime> PoolActor<R> {
    async fn run(mut self) {
        loop {
            if self.closing {
                if self.shared.stats.allocations.read().current <= 0 {
                    break;
                }
                match tokio::time::timeout(CLOSING_SWEEP, self.rx.recv_async()).await {
                    Ok(Ok(msg)) => self.handle(msg).await,
                    Ok(Err(_)) => break,
                    Err(_) => {
                        let blocks = self.shared.ready.drain();
                        self.free_blocks(blocks).await;
                    }
                }
            } else {
                match self.rx.recv_async().await {
                    Ok(msg) => self.handle(msg).await,
                    Err(_) => break,
                }
            }
        }
        tracing::debug!(pool = %self.shared.id, "pool actor stopped");
    }

    async fn handle(&mut self, msg: PoolMsg<R>) {
        match msg {
            PoolMsg::Miss { class, reply } => {
                let result = self.miss(class).await;
                if let Err(flume::SendError(Ok(block))) = reply.send(result) {
                    // The request was cancelled: the block is ready for someone else.
                    self.home(block).await;
                }
            }
            PoolMsg::Keep(mut block) => {
                let stats = &self.shared.stats;
                stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
                stats
                    .kept_bytes
                    .fetch_add(block.size as i64, Ordering::Relaxed);
                block.state = BlockState::Kept;
                self.kept.push(block);
                if self.closing {
                    self.free_kept().await;
                }
            }
            PoolMsg::Home(block) => self.home(block).await,
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
            PoolMsg::Close => {
                self.closing = true;
                self.shared.closed.store(true, Ordering::Release);
                self.empty_cache(true).await;
            }
        }
    }

    /// A block back outside the ready queues: kept blocks stay kept, others are reusable.
    async fn home(&mut self, mut block: Box<Block<R>>) {
        if block.state == BlockState::Waiting {
            // Its events were lost with the poller: never reuse it.
            let stats = &self.shared.stats;
            stats.waiting_blocks.fetch_sub(1, Ordering::Relaxed);
            stats
                .waiting_bytes
                .fetch_sub(block.size as i64, Ordering::Relaxed);
            stats.kept_blocks.fetch_add(1, Ordering::Relaxed);
            stats
                .kept_bytes
                .fetch_add(block.size as i64, Ordering::Relaxed);
            block.state = BlockState::Kept;
        }
        if block.state == BlockState::Kept {
            self.kept.push(block);
            return;
        }
        if self.closing {
            self.free_blocks(vec![block]).await;
        } else {
            block.state = BlockState::Cached;
            self.shared.ready.put(block);
        }
    }

    async fn miss(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        if let Some(b) = self.shared.ready.take(class.index) {
            return Ok(b);
        }
        // Invariant 3: notice completed events before taking fresh memory.
        if self.shared.stats.waiting_blocks.load(Ordering::Relaxed) > 0 {
            self.flush_events().await;
            if let Some(b) = self.shared.ready.take(class.index) {
                return Ok(b);
            }
        }
        self.fresh(class).await
    }

    async fn flush_events(&self) {
        let (tx, rx) = flume::bounded(1);
        if self
            .shared
            .poller
            .send(PollerMsg::Flush { reply: tx })
            .is_ok()
        {
            let _ = rx.recv_async().await;
        }
    }

    async fn fresh(&mut self, class: SizeClass) -> Result<Box<Block<R>>, Error> {
        let first = self.host_alloc(class.size).await;
        let memory = match first {
            Ok(m) => m,
            Err(e) if e.out_of_memory => {
                // Out of memory from the runtime itself: empty the cache and retry once.
                self.shared
                    .stats
                    .num_alloc_retries
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    bytes = class.size,
                    "host allocation out of memory; emptying the cache and retrying"
                );
                self.empty_cache(false).await;
                match self.host_alloc(class.size).await {
                    Ok(m) => m,
                    Err(e) => return Err(self.oom(class.size, e)),
                }
            }
            Err(e) => return Err(Error::Runtime(e)),
        };
        Ok(Block::new(memory, class.index, self.shared.clone()))
    }

    fn oom(&self, requested: usize, e: RuntimeError) -> Error {
        self.shared.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
        if e.out_of_memory {
            Error::OutOfMemory {
                requested,
                reserved: self.shared.stats.allocated_bytes.read().current.max(0) as usize,
                limit: None,
            }
        } else {
            Error::Runtime(e)
        }
    }

    async fn host_alloc(&self, size: usize) -> Result<HostMemory, RuntimeError> {
        let span = tracing::debug_span!("host_alloc", pool = %self.shared.id, bytes = size);
        let _enter = span.enter();
        let rt = self.shared.runtime.clone();
        let t0 = Instant::now();
        let res = tokio::task::spawn_blocking(move || rt.host_alloc(size))
            .await
            .unwrap_or_else(|e| {
                Err(RuntimeError::new(
                    "host_alloc",
                    format!("blocking task failed: {e}"),
                ))
            });
        let stats = &self.shared.stats;
        stats.host_alloc_time.record(t0.elapsed());
        match &res {
            Ok(m) => {
                stats.allocations.increase(1);
                stats.allocated_bytes.increase(m.size as i64);
                tracing::debug!(
                    bytes = m.size,
                    took_us = t0.elapsed().as_micros() as u64,
                    "fresh pinned memory"
                );
            }
            Err(e) => tracing::warn!(error = %e, "host allocation failed"),
        }
        res
    }

    /// Frees blocks on a blocking thread and keeps the books.
    async fn free_blocks(&self, blocks: Vec<Box<Block<R>>>) -> (usize, usize) {
        if blocks.is_empty() {
            return (0, 0);
        }
        let n = blocks.len();
        let bytes = blocks.iter().map(|b| b.memory.size).sum();
        let shared = self.shared.clone();
        let job = tokio::task::spawn_blocking(move || {
            for b in blocks {
                shared.clone().free_block_now(b);
            }
        });
        if let Err(e) = job.await {
            tracing::error!(error = %e, "freeing pinned memory failed");
        }
        (n, bytes)
    }

    async fn free_kept(&mut self) -> (usize, usize) {
        let kept = std::mem::take(&mut self.kept);
        let stats = &self.shared.stats;
        for b in &kept {
            stats.kept_blocks.fetch_sub(1, Ordering::Relaxed);
            stats.kept_bytes.fetch_sub(b.size as i64, Ordering::Relaxed);
        }
        self.free_blocks(kept).await
    }

    async fn empty_cache(&mut self, include_kept: bool) -> EmptyReport {
        let span = tracing::info_span!("empty_cache", pool = %self.shared.id);
        let _enter = span.enter();
        if self.shared.stats.waiting_blocks.load(Ordering::Relaxed) > 0 {
            self.flush_events().await;
        }
        let blocks = self.shared.ready.drain();
        let (mut n, mut bytes) = self.free_blocks(blocks).await;
        if include_kept {
            let (kn, kb) = self.free_kept().await;
            n += kn;
            bytes += kb;
        }
        let reserved_after = self.shared.stats.allocated_bytes.read().current.max(0) as usize;
        tracing::debug!(
            freed_blocks = n,
            freed_bytes = bytes,
            reserved_after,
            "cache emptied"
        );
        EmptyReport {
            freed_blocks: n,
            freed_bytes: bytes,
            reserved_after,
        }
    }

    fn inventory(&self) -> Inventory {
        let s = self.shared.stats.read();
        let (cached_blocks, cached_bytes) = self.shared.ready.census();
        let reserved_bytes = s.allocated_bytes.current.max(0) as usize;
        let segments = s.allocations.current.max(0) as usize;
        let kept_blocks = self.kept.len();
        let kept_bytes: usize = self.kept.iter().map(|b| b.memory.size).sum();
        let waiting_blocks = s.waiting_blocks.max(0) as usize;
        let waiting_bytes = s.waiting_bytes.max(0) as usize;
        Inventory {
            pool: self.shared.id,
            reserved_bytes,
            segments,
            cached_blocks,
            cached_bytes,
            waiting_blocks,
            waiting_bytes,
            kept_blocks,
            kept_bytes,
            in_use_blocks: segments.saturating_sub(cached_blocks + waiting_blocks + kept_blocks),
            in_use_bytes: reserved_bytes.saturating_sub(cached_bytes + waiting_bytes + kept_bytes),
        }
    }
}

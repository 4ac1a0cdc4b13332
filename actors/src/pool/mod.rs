//! The pool actor: one per pool (the default pool, and one per private capture pool).
//!
//! It owns the pool's books and every block of the pool that is not lent out, queued as
//! ready, or waiting on events: it answers misses (first noticing blocks whose events have
//! completed — invariant 3 — then taking fresh memory on a blocking thread — invariant 6),
//! keeps blocks used by captured work (invariant 4), empties the cache, and on shutdown gives
//! every block back to the runtime as it comes home (invariant 2).
//!
//! This file holds the pool's shared part, its messages and its loop; `cache`, `fresh` and
//! `books` hold what the actor does.

mod books;
mod cache;
mod fresh;

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

pub(crate) struct PoolActor<R: Runtime> {
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
                        self.shared.ready.unpark_all(&self.shared.poller);
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
}

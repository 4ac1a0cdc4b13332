//! The router actor: owns the capture registry and the stream pools, and publishes the
//! routing table.
//!
//! In a stream-ordered engine (device memory), every stream that allocates gets a pool of its
//! own, made here at its first miss: its blocks are reusable by that stream without events.
//!
//! `begin_allocate_to_pool` registers a capture (a capture pool and a stream filter),
//! `end_allocate_to_pool` removes it (the budget's count of captures underway follows),
//! `release_pool` drops a use of the pool; a pool whose uses are all released is freed by
//! the next `empty_cache`, kept blocks included (its graphs are gone, so invariant 4 no
//! longer binds). `empty_cache` also retires every stream's pool that holds nothing and
//! served no request since the call before: its actor and thread stop, its address range
//! goes back, the stream is let go, and its counts are kept in [`Routes::retired`]; the
//! stream's next request gets a new pool. After each change the router publishes an
//! immutable [`RoutingTable`] through `ArcSwap`: a handle routes with one atomic load, and
//! when no capture is underway that load is all routing costs. Each publication also counts
//! one more [`Routes::epoch`], so a thread that remembers a route (`route_cache`, the
//! routing read the engine's requests use) checks it with one plain load instead of loading
//! the table.
//!
//! This file holds the actor, its messages and the table it publishes; `route_cache` holds
//! each thread's remembered routes.

pub(crate) mod route_cache;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;
use flume::Receiver;

use crate::actors::pool::start_pool;
use crate::blocks::block::{Block, Home};
use crate::books::budget::{Budget, EmptyReport};
use crate::books::home::PoolSettings;
use crate::books::messages::{Inventory, PoolMsg, Reply};
use crate::statistics::retired::Retired;
use crate::vocab::error::Error;
use crate::vocab::mailbox::{leftovers, Mailbox};
use crate::vocab::pool_id::PoolId;
use crate::vocab::runtime::{Runtime, StreamId};
use crate::vocab::spawn::spawn_named;

/// Decides whether an allocation made for a stream goes to a capture pool.
pub(crate) type StreamFilter<R> = Arc<dyn Fn(&<R as Runtime>::Stream) -> bool + Send + Sync>;

/// A capture underway: allocations for streams the filter accepts go to `pool`.
pub(crate) struct Capture<R: Runtime> {
    pub(crate) filter: StreamFilter<R>,
    pub(crate) pool: Arc<Home<R>>,
}

/// The published routing state: captures underway, in the order they began, every capture
/// pool alive, and the stream pools of a stream-ordered engine (sorted by stream).
pub(crate) struct RoutingTable<R: Runtime> {
    pub(crate) captures: Vec<Capture<R>>,
    pub(crate) pools: Vec<(PoolId, Arc<Home<R>>)>,
    pub(crate) streams: Vec<(StreamId, Arc<Home<R>>)>,
}

impl<R: Runtime> RoutingTable<R> {
    pub(crate) fn empty() -> Self {
        Self {
            captures: Vec::new(),
            pools: Vec::new(),
            streams: Vec::new(),
        }
    }

    /// The pool of `stream`, if it has one.
    #[inline]
    pub(crate) fn stream_pool(&self, stream: StreamId) -> Option<&Arc<Home<R>>> {
        self.streams
            .binary_search_by_key(&stream, |(s, _)| *s)
            .ok()
            .map(|i| &self.streams[i].1)
    }
}

/// What the router publishes: the routing table, how many tables have been published, and
/// the counts of the stream pools it retired.
pub(crate) struct Routes<R: Runtime> {
    table: ArcSwap<RoutingTable<R>>,
    epoch: AtomicU64,
    pub(crate) retired: Retired,
}

impl<R: Runtime> Routes<R> {
    pub(crate) fn new() -> Self {
        Self {
            table: ArcSwap::from_pointee(RoutingTable::empty()),
            epoch: AtomicU64::new(0),
            retired: Retired::default(),
        }
    }

    /// The table in force.
    #[inline]
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<RoutingTable<R>>> {
        self.table.load()
    }

    /// Tables published so far. Read before [`Self::load`], an unchanged epoch later means
    /// no table published since was seen by a handle that received a router reply after it
    /// (the router counts a publication before it replies).
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Publishes `table`, then counts it.
    fn publish(&self, table: RoutingTable<R>) {
        self.table.store(Arc::new(table));
        self.epoch.fetch_add(1, Ordering::Release);
    }
}

/// Messages the router answers.
pub(crate) enum RouterMsg<R: Runtime> {
    Begin {
        id: PoolId,
        filter: StreamFilter<R>,
        reply: Reply<Result<(), Error>>,
    },
    End {
        id: PoolId,
        reply: Reply<Result<(), Error>>,
    },
    Release {
        id: PoolId,
        reply: Reply<Result<(), Error>>,
    },
    /// Empty the released pools, and stop those left with nothing; retire the stream pools
    /// that hold nothing.
    EmptyReleased { reply: Reply<EmptyReport> },
    /// Inventories of every capture pool and every stream pool.
    Inventory { reply: Reply<Vec<Inventory>> },
    /// The pool of a stream (made now if it has none yet). `keep` is the stream itself,
    /// held while its pool lives: a stream's id may be its handle, which the driver hands
    /// to a new stream once the old one is destroyed, and the new stream must not inherit
    /// the old one's pool (whose blocks may still be used by the old stream's queued work).
    /// A pool is retired only once it holds nothing, and the stream let go with it.
    StreamPool {
        stream: StreamId,
        keep: R::Stream,
        reply: Reply<Arc<Home<R>>>,
    },
    /// The allocator is gone: close every capture pool and stop.
    Close,
}

/// A stream's pool (whose home holds the stream itself: see `RouterMsg::StreamPool`), and
/// the count of requests the pool had answered at the last `empty_cache` (see
/// `retire_idle_streams`).
struct StreamPool<R: Runtime> {
    pool: Arc<Home<R>>,
    misses_seen: i64,
}

struct CapturePool<R: Runtime> {
    shared: Arc<Home<R>>,
    uses: usize,
}

/// Starts the router; it counts the captures underway in `budget`. Returns its mailbox.
pub(crate) fn start_router<R: Runtime>(
    table: Arc<Routes<R>>,
    budget: Arc<Budget>,
    settings: PoolSettings<R, Block<R>>,
) -> Arc<Mailbox<RouterMsg<R>>> {
    let handle = settings.handle.clone();
    let (tx, rx) = flume::unbounded();
    let mailbox = Arc::new(Mailbox::new(tx));
    let actor = Router {
        table,
        budget,
        mailbox: Arc::downgrade(&mailbox),
        rx,
        settings,
        captures: Vec::new(),
        pools: BTreeMap::new(),
        streams: BTreeMap::new(),
    };
    spawn_named("pinpool::router", &handle, actor.run());
    mailbox
}

struct Router<R: Runtime> {
    table: Arc<Routes<R>>,
    /// Where the count of captures underway is published (see [`Budget::capturing`]).
    budget: Arc<Budget>,
    mailbox: Weak<Mailbox<RouterMsg<R>>>,
    rx: Receiver<RouterMsg<R>>,
    /// What its new pools are built from.
    settings: PoolSettings<R, Block<R>>,
    captures: Vec<(PoolId, StreamFilter<R>)>,
    pools: BTreeMap<PoolId, CapturePool<R>>,
    /// Each stream's pool (see `RouterMsg::StreamPool`).
    streams: BTreeMap<StreamId, StreamPool<R>>,
}

/// The router is gone (its loop ended, or its task was dropped with its runtime): the
/// messages it did not read are dropped, so that their callers hear `Error::Shutdown`
/// instead of waiting for ever.
impl<R: Runtime> Drop for Router<R> {
    fn drop(&mut self) {
        drop(leftovers(&self.mailbox, &self.rx));
    }
}

impl<R: Runtime> Router<R> {
    async fn run(mut self) {
        while let Ok(msg) = self.rx.recv_async().await {
            match msg {
                RouterMsg::Begin { id, filter, reply } => {
                    let r = self.begin(id, filter);
                    let _ = reply.send(r);
                }
                RouterMsg::End { id, reply } => {
                    let r = self.end(id);
                    let _ = reply.send(r);
                }
                RouterMsg::Release { id, reply } => {
                    let r = self.release(id);
                    let _ = reply.send(r);
                }
                RouterMsg::EmptyReleased { reply } => {
                    let r = self.empty_released().await;
                    let _ = reply.send(r);
                }
                RouterMsg::Inventory { reply } => {
                    let mut all = Vec::new();
                    let pools = self.pools.values().map(|p| &p.shared);
                    for p in pools.chain(self.streams.values().map(|s| &s.pool)) {
                        let (tx, rx) = flume::bounded(1);
                        if p.mailbox.send(PoolMsg::Inventory { reply: tx }).is_ok() {
                            if let Ok(inv) = rx.recv_async().await {
                                all.push(inv);
                            }
                        }
                    }
                    let _ = reply.send(all);
                }
                RouterMsg::StreamPool {
                    stream,
                    keep,
                    reply,
                } => {
                    let pool = self.stream_pool(stream, keep);
                    let _ = reply.send(pool);
                }
                RouterMsg::Close => break,
            }
        }
        for (_, p) in std::mem::take(&mut self.pools) {
            let _ = p.shared.mailbox.send(PoolMsg::Close);
        }
        for (_, s) in std::mem::take(&mut self.streams) {
            let _ = s.pool.mailbox.send(PoolMsg::Close);
        }
        self.captures.clear();
        self.publish();
        tracing::debug!("router stopped");
    }

    fn begin(&mut self, id: PoolId, filter: StreamFilter<R>) -> Result<(), Error> {
        if id.is_default() {
            return Err(Error::DefaultPoolId);
        }
        if self.captures.iter().any(|(c, _)| *c == id) {
            return Err(Error::PoolAlreadyCapturing(id));
        }
        match self.pools.get_mut(&id) {
            Some(p) => p.uses += 1,
            None => {
                let shared = start_pool(&self.settings, id, None);
                self.pools.insert(id, CapturePool { shared, uses: 1 });
            }
        }
        self.captures.push((id, filter));
        tracing::info!(pool = %id, "capture begins allocating to pool");
        if let Some(p) = self.pools.get(&id) {
            p.shared.history.on_capture(id, true)
        }
        self.publish();
        Ok(())
    }

    fn stream_pool(&mut self, stream: StreamId, keep: R::Stream) -> Arc<Home<R>> {
        if let Some(s) = self.streams.get(&stream) {
            return s.pool.clone();
        }
        let pool = start_pool(&self.settings, PoolId::DEFAULT, Some((stream, keep)));
        let misses_seen = pool.stats.misses.load(Ordering::Relaxed);
        let entry = StreamPool {
            pool: pool.clone(),
            misses_seen,
        };
        self.streams.insert(stream, entry);
        tracing::debug!(stream = stream.0, "stream pool made");
        self.publish();
        pool
    }

    fn end(&mut self, id: PoolId) -> Result<(), Error> {
        let Some(i) = self.captures.iter().position(|(c, _)| *c == id) else {
            return Err(Error::PoolNotCapturing(id));
        };
        self.captures.remove(i);
        tracing::info!(pool = %id, "capture ends allocating to pool");
        if let Some(p) = self.pools.get(&id) {
            p.shared.history.on_capture(id, false)
        }
        self.publish();
        Ok(())
    }

    fn release(&mut self, id: PoolId) -> Result<(), Error> {
        if id.is_default() {
            return Err(Error::DefaultPoolId);
        }
        let capturing = self.captures.iter().any(|(c, _)| *c == id);
        let Some(p) = self.pools.get_mut(&id) else {
            return Err(Error::UnknownPool(id));
        };
        if p.uses == 0 {
            return Err(Error::PoolAlreadyReleased(id));
        }
        if capturing && p.uses == 1 {
            return Err(Error::PoolCapturing(id));
        }
        p.uses -= 1;
        tracing::info!(pool = %id, uses = p.uses, "capture pool released");
        Ok(())
    }

    async fn empty_released(&mut self) -> EmptyReport {
        let mut total = EmptyReport::default();
        let released: Vec<PoolId> = self
            .pools
            .iter()
            .filter(|(_, p)| p.uses == 0)
            .map(|(id, _)| *id)
            .collect();
        let mut changed = false;
        for id in released {
            let shared = self.pools[&id].shared.clone();
            let (tx, rx) = flume::bounded(1);
            if shared
                .mailbox
                .send(PoolMsg::EmptyCache {
                    include_kept: true,
                    forget: true,
                    upto: usize::MAX,
                    reply: tx,
                })
                .is_err()
            {
                continue;
            }
            let Ok(report) = rx.recv_async().await else {
                continue;
            };
            total.freed_blocks += report.freed_blocks;
            total.freed_bytes += report.freed_bytes;
            if report.reserved_after == 0 {
                let _ = shared.mailbox.send(PoolMsg::Close);
                self.pools.remove(&id);
                changed = true;
            } else {
                total.reserved_after += report.reserved_after;
            }
        }
        if changed {
            self.publish();
        }
        self.retire_idle_streams().await;
        total
    }

    /// Retires every stream pool that holds nothing and answered no request since the last
    /// `empty_cache` (see `PoolMsg::Retire`): a stream used between two calls keeps its pool
    /// (its next request would make a new one), one left unused is retired at the second.
    /// Its actor stops, and with it its thread and its address range; the stream kept alive
    /// for it is let go; its counts go to [`Routes::retired`] once no table names it. A
    /// request already on its way to a retired pool finds its mailbox closed and asks here
    /// for the stream's pool again (see the engine's `serve`), which this actor answers only
    /// after the retirement is published: with a new pool.
    async fn retire_idle_streams(&mut self) {
        if !self.captures.is_empty() {
            // A capture underway may record any stream's work; nothing changes under it.
            return;
        }
        let mut asked = Vec::new();
        for (stream, s) in self.streams.iter_mut() {
            let misses = s.pool.stats.misses.load(Ordering::Relaxed);
            if std::mem::replace(&mut s.misses_seen, misses) != misses {
                continue;
            }
            let (tx, rx) = flume::bounded(1);
            if s.pool.mailbox.send(PoolMsg::Retire { reply: tx }).is_ok() {
                asked.push((*stream, rx));
            }
        }
        let mut gone = Vec::new();
        for (stream, rx) in asked {
            if rx.recv_async().await == Ok(true) {
                gone.extend(self.streams.remove(&stream));
            }
        }
        if gone.is_empty() {
            return;
        }
        self.publish();
        for s in gone {
            self.table.retired.absorb(&s.pool.stats);
            tracing::debug!(stream = ?s.pool.owner, "stream pool retired");
        }
    }

    fn publish(&self) {
        self.budget.set_captures(self.captures.len());
        let captures = self
            .captures
            .iter()
            .filter_map(|(id, filter)| {
                self.pools.get(id).map(|p| Capture {
                    filter: filter.clone(),
                    pool: p.shared.clone(),
                })
            })
            .collect();
        let pools = self
            .pools
            .iter()
            .map(|(id, p)| (*id, p.shared.clone()))
            .collect();
        // A BTreeMap iterates in key order: the table's streams are sorted.
        let streams = self
            .streams
            .iter()
            .map(|(s, p)| (*s, p.pool.clone()))
            .collect();
        self.table.publish(RoutingTable {
            captures,
            pools,
            streams,
        });
    }
}

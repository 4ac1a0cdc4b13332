//! The engine handle: what an allocator is. Cheap to clone; every clone talks to the same
//! actors. The last clone to go closes the pools, which give every block back to the runtime
//! as it comes home.
//!
//! The cached path is here and in [`crate::ready`]: size class, route (no table load unless a
//! stream is given), take a ready block, charge this thread's stats shard. A miss is one round
//! trip to the pool actor.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use flume::Sender;

use crate::error::Error;
use crate::lease::Lease;
use crate::limit::{miss_async, miss_blocking, Budget, Wait};
use crate::policy::{SizeClass, SizePolicy, TieredPowerOfTwo};
use crate::poller::{start_poller, PollerMsg};
use crate::pool::{start_pool, EmptyReport, Inventory, PoolMsg, PoolShared, PoolSpec, Reply};
use crate::pool_id::PoolId;
use crate::router::{start_router, RouterMsg, RoutingTable, StreamFilter};
use crate::runtime::Runtime;
use crate::shard::default_shard_count;
use crate::stats::HostStats;

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// Configures and starts an [`Engine`].
pub struct EngineBuilder<R: Runtime> {
    runtime: Arc<R>,
    policy: Arc<dyn SizePolicy>,
    handle: Option<tokio::runtime::Handle>,
    shards: Option<usize>,
    max_bytes: Option<usize>,
    alloc_timeout: Option<Duration>,
}

impl<R: Runtime> EngineBuilder<R> {
    /// An engine over `runtime`, with the power-of-two size policy.
    pub fn new(runtime: Arc<R>) -> Self {
        Self {
            runtime,
            policy: Arc::new(TieredPowerOfTwo::default()),
            handle: None,
            shards: None,
            max_bytes: None,
            alloc_timeout: None,
        }
    }

    /// Caps the pinned bytes reserved by all pools together (default: no cap). A request
    /// that would pass the cap first has every cache emptied; if it still does not fit,
    /// `alloc` waits for buffers to come back and `try_alloc` fails. `build` refuses 0.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = Some(bytes);
        self
    }

    /// How long `alloc` waits for room under the cap before failing with
    /// [`Error::Timeout`] (default: as long as it takes).
    pub fn alloc_timeout(mut self, timeout: Duration) -> Self {
        self.alloc_timeout = Some(timeout);
        self
    }

    /// The size policy (default: [`TieredPowerOfTwo`]).
    pub fn policy(mut self, policy: Arc<dyn SizePolicy>) -> Self {
        self.policy = policy;
        self
    }

    /// The tokio runtime the actors run on (default: the one this is called in).
    pub fn handle(mut self, handle: tokio::runtime::Handle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Number of thread shards for ready queues and stats (rounded up to a power of two;
    /// default: twice the machine's parallelism, at most 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards.clamp(1, 1024).next_power_of_two());
        self
    }

    /// Spawns the actors.
    pub fn build(self) -> Result<Engine<R>, Error> {
        let handle = match self.handle {
            Some(h) => h,
            None => tokio::runtime::Handle::try_current().map_err(|_| Error::NoTokioRuntime)?,
        };
        if self.max_bytes == Some(0) {
            return Err(Error::InvalidLimit {
                reason: "a cap of 0 bytes leaves no room for any request".into(),
            });
        }
        let id = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
        let shards = self.shards.unwrap_or_else(default_shard_count);
        let budget = Arc::new(Budget::new(
            self.max_bytes,
            self.alloc_timeout,
            shards,
            self.policy.name(),
        ));
        let classes = self.policy.num_classes();
        let layout = self.policy.layout();
        let history = crate::history::start(&handle);
        let (poller_tx, poller_rx) = flume::unbounded();
        start_poller(poller_rx, &handle);
        let spec = {
            let runtime = self.runtime.clone();
            let poller = poller_tx.clone();
            let handle = handle.clone();
            let history = history.clone();
            move |id: PoolId| PoolSpec {
                id,
                runtime: runtime.clone(),
                classes,
                shards,
                poller: poller.clone(),
                handle: handle.clone(),
                budget: budget.clone(),
                history: history.clone(),
                layout,
            }
        };
        let default = start_pool(spec(PoolId::DEFAULT));
        let table = Arc::new(ArcSwap::from_pointee(RoutingTable::empty()));
        let (router_tx, router_rx) = flume::unbounded();
        start_router(table.clone(), router_rx, Box::new(spec), &handle);
        tracing::debug!(
            engine = id,
            runtime = self.runtime.name(),
            policy = self.policy.name(),
            shards,
            max_bytes = self.max_bytes,
            "allocator started"
        );
        Ok(Engine {
            inner: Arc::new(EngineInner {
                id,
                runtime: self.runtime,
                policy: self.policy,
                default,
                table,
                router: router_tx,
                poller: poller_tx,
                history,
            }),
        })
    }
}

struct EngineInner<R: Runtime> {
    id: u64,
    runtime: Arc<R>,
    policy: Arc<dyn SizePolicy>,
    default: Arc<PoolShared<R>>,
    table: Arc<ArcSwap<RoutingTable<R>>>,
    router: Sender<RouterMsg<R>>,
    #[allow(dead_code)]
    poller: Sender<PollerMsg<R>>,
    history: Arc<crate::history::Recorder>,
}

impl<R: Runtime> Drop for EngineInner<R> {
    fn drop(&mut self) {
        let _ = self.default.mailbox.send(PoolMsg::Close);
        let _ = self.router.send(RouterMsg::Close);
    }
}

/// A handle on a running allocator engine.
pub struct Engine<R: Runtime> {
    inner: Arc<EngineInner<R>>,
}

impl<R: Runtime> Clone for Engine<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

/// The outcome of the cached path.
enum Step<R: Runtime> {
    Ready(Lease<R>),
    Miss {
        pool: Arc<PoolShared<R>>,
        class: SizeClass,
        during_capture: bool,
    },
}

impl<R: Runtime> Engine<R> {
    /// This allocator's identity (leases carry it).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<R> {
        &self.inner.runtime
    }

    /// The history recorder (see [`crate::history`]).
    pub(crate) fn recorder(&self) -> &Arc<crate::history::Recorder> {
        &self.inner.history
    }

    /// The size policy in force.
    pub fn policy(&self) -> &dyn SizePolicy {
        &*self.inner.policy
    }

    /// The cached path: everything short of asking a pool actor.
    #[inline]
    fn step(&self, size: usize, stream: Option<&R::Stream>) -> Result<Step<R>, Error> {
        let inner = &*self.inner;
        if size == 0 {
            return Ok(Step::Ready(Lease::empty(inner.id)));
        }
        let Some(class) = inner.policy.class_of(size) else {
            return Err(Error::SizeTooLarge {
                requested: size,
                max: inner.policy.max_request(),
            });
        };
        let table;
        let (pool, during_capture) = match stream {
            None => (&inner.default, false),
            Some(s) => {
                table = inner.table.load();
                if table.captures.is_empty() {
                    (&inner.default, false)
                } else {
                    let capturing = inner.runtime.is_capturing(s)?;
                    let pool = table
                        .captures
                        .iter()
                        .find(|c| (c.filter)(s))
                        .map_or(&inner.default, |c| &c.pool);
                    (pool, capturing)
                }
            }
        };
        if let Some(block) = pool.ready.take_mine(class.index) {
            return Ok(Step::Ready(Lease::new(
                block,
                size,
                during_capture,
                inner.id,
            )));
        }
        Ok(Self::miss_here(pool, class, size, during_capture, inner.id))
    }

    /// Before asking the pool actor: a block this thread freed after a stream used it may
    /// have completed its events by now (one inline query; invariant 1); failing that, a
    /// ready block in another thread's shard, or a block another thread parked whose events
    /// have completed.
    #[cold]
    fn miss_here(
        pool: &Arc<PoolShared<R>>,
        class: SizeClass,
        size: usize,
        during_capture: bool,
        engine: u64,
    ) -> Step<R> {
        let ready = &pool.ready;
        let found = ready
            .take_parked(class.index, &pool.poller)
            .or_else(|| ready.steal(ready.my_shard(), class.index))
            .or_else(|| ready.steal_parked(class.index, &pool.poller));
        match found {
            Some(block) => Step::Ready(Lease::new(block, size, during_capture, engine)),
            None => Step::Miss {
                pool: pool.clone(),
                class,
                during_capture,
            },
        }
    }

    async fn alloc_inner(
        &self,
        size: usize,
        stream: Option<&R::Stream>,
        wait: Wait,
    ) -> Result<Lease<R>, Error> {
        match self.step(size, stream)? {
            Step::Ready(lease) => Ok(lease),
            Step::Miss {
                pool,
                class,
                during_capture,
            } => {
                let block = miss_async(&pool, class, size, wait)
                    .await
                    .map_err(|e| crate::history::on_oom(&pool, e))?;
                Ok(Lease::new(block, size, during_capture, self.inner.id))
            }
        }
    }

    fn alloc_blocking_inner(
        &self,
        size: usize,
        stream: Option<&R::Stream>,
        wait: Wait,
    ) -> Result<Lease<R>, Error> {
        match self.step(size, stream)? {
            Step::Ready(lease) => Ok(lease),
            Step::Miss {
                pool,
                class,
                during_capture,
            } => {
                let block = miss_blocking(&pool, class, size, wait)
                    .map_err(|e| crate::history::on_oom(&pool, e))?;
                Ok(Lease::new(block, size, during_capture, self.inner.id))
            }
        }
    }

    /// Allocates `size` bytes in the default pool. Under a memory cap, waits for room (up
    /// to the builder's `alloc_timeout`) when even an emptied cache leaves none. Cancel-safe:
    /// dropping the future leaves nothing queued and loses no memory.
    pub async fn alloc(&self, size: usize) -> Result<Lease<R>, Error> {
        self.alloc_inner(size, None, Wait::Default).await
    }

    /// [`Engine::alloc`], waiting at most `timeout` for room ([`Error::Timeout`] after).
    pub async fn alloc_timeout(&self, size: usize, timeout: Duration) -> Result<Lease<R>, Error> {
        self.alloc_inner(size, None, Wait::Upto(timeout)).await
    }

    /// [`Engine::alloc`] that never waits for room: fails with [`Error::OutOfMemory`] where
    /// `alloc` would wait.
    pub async fn try_alloc(&self, size: usize) -> Result<Lease<R>, Error> {
        self.alloc_inner(size, None, Wait::Never).await
    }

    /// [`Engine::try_alloc`] for work on `stream` (see [`Engine::alloc_on`]).
    pub async fn try_alloc_on(&self, size: usize, stream: &R::Stream) -> Result<Lease<R>, Error> {
        self.alloc_inner(size, Some(stream), Wait::Never).await
    }

    /// [`Engine::alloc_blocking`], waiting at most `timeout` for room.
    pub fn alloc_blocking_timeout(
        &self,
        size: usize,
        timeout: Duration,
    ) -> Result<Lease<R>, Error> {
        self.alloc_blocking_inner(size, None, Wait::Upto(timeout))
    }

    /// The cap on reserved bytes, if any.
    pub fn max_bytes(&self) -> Option<usize> {
        self.inner.default.budget.limit()
    }

    /// Sets or lifts the cap. Lowering it frees nothing by itself (the next request that
    /// does not fit empties the caches); raising it lets waiting requests in.
    pub fn set_max_bytes(&self, bytes: Option<usize>) -> Result<(), Error> {
        if bytes == Some(0) {
            return Err(Error::InvalidLimit {
                reason: "a cap of 0 bytes leaves no room for any request".into(),
            });
        }
        self.inner.default.budget.set_limit(bytes);
        Ok(())
    }

    /// Pinned bytes reserved by all pools together (what the cap limits).
    pub fn reserved_bytes(&self) -> usize {
        self.inner.default.budget.reserved()
    }

    /// The default pool's shared part (its budget reaches every pool).
    pub(crate) fn default_pool(&self) -> &Arc<PoolShared<R>> {
        &self.inner.default
    }

    /// Allocates `size` bytes for work on `stream`: in a capture's private pool when a
    /// capture's filter accepts the stream, in the default pool otherwise.
    pub async fn alloc_on(&self, size: usize, stream: &R::Stream) -> Result<Lease<R>, Error> {
        self.alloc_inner(size, Some(stream), Wait::Default).await
    }

    /// [`Engine::alloc`] for threads outside the tokio runtime. It blocks the calling thread
    /// on a miss (and while it waits for room, up to the builder's `alloc_timeout`); do not
    /// call it from async code on a current-thread runtime.
    pub fn alloc_blocking(&self, size: usize) -> Result<Lease<R>, Error> {
        self.alloc_blocking_inner(size, None, Wait::Default)
    }

    /// [`Engine::alloc_on`] for threads outside the tokio runtime.
    pub fn alloc_blocking_on(&self, size: usize, stream: &R::Stream) -> Result<Lease<R>, Error> {
        self.alloc_blocking_inner(size, Some(stream), Wait::Default)
    }

    /// Records `stream` on a lease, after checking that this allocator lent it.
    pub fn record_stream(&self, lease: &mut Lease<R>, stream: &R::Stream) -> Result<(), Error> {
        if lease.allocator_id() != self.inner.id {
            return Err(Error::ForeignBuffer);
        }
        lease.record_stream(stream);
        Ok(())
    }

    /// Frees every cached block of the default pool and of released capture pools (kept
    /// blocks of released pools too); blocks in use or waiting on events are untouched.
    pub async fn empty_cache(&self) -> Result<EmptyReport, Error> {
        let (tx, rx) = flume::bounded(1);
        self.send_pool(PoolMsg::EmptyCache {
            include_kept: false,
            reply: tx,
        })?;
        let mut report = rx.recv_async().await.map_err(|_| Error::Shutdown)?;
        let released = self
            .call_router(|reply| RouterMsg::EmptyReleased { reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?;
        report.merge(&released);
        Ok(report)
    }

    /// [`Engine::empty_cache`] for threads outside the tokio runtime.
    pub fn empty_cache_blocking(&self) -> Result<EmptyReport, Error> {
        let (tx, rx) = flume::bounded(1);
        self.send_pool(PoolMsg::EmptyCache {
            include_kept: false,
            reply: tx,
        })?;
        let mut report = rx.recv().map_err(|_| Error::Shutdown)?;
        let released = self
            .call_router(|reply| RouterMsg::EmptyReleased { reply })?
            .recv()
            .map_err(|_| Error::Shutdown)?;
        report.merge(&released);
        Ok(report)
    }

    fn send_pool(&self, msg: PoolMsg<R>) -> Result<(), Error> {
        self.inner
            .default
            .mailbox
            .send(msg)
            .map_err(|_| Error::Shutdown)
    }

    fn call_router<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> RouterMsg<R>,
    ) -> Result<flume::Receiver<T>, Error> {
        let (tx, rx) = flume::bounded(1);
        self.inner
            .router
            .send(make(tx))
            .map_err(|_| Error::Shutdown)?;
        Ok(rx)
    }

    /// Statistics over every pool.
    pub fn stats(&self) -> HostStats {
        let mut s = self.inner.default.stats.read();
        for (_, p) in self.inner.table.load().pools.iter() {
            s.merge(&p.stats.read());
        }
        s.limit_bytes = self.max_bytes().map(|l| l as i64);
        s
    }

    /// Statistics of one pool (`None` for a pool that does not exist or is gone).
    pub fn pool_stats(&self, id: PoolId) -> Option<HostStats> {
        let limit = self.max_bytes().map(|l| l as i64);
        if id.is_default() {
            let mut s = self.inner.default.stats.read();
            s.limit_bytes = limit;
            return Some(s);
        }
        let table = self.inner.table.load();
        table.pools.iter().find(|(p, _)| *p == id).map(|(_, p)| {
            let mut s = p.stats.read();
            s.limit_bytes = limit;
            s
        })
    }

    /// Ids of the capture pools alive.
    pub fn pools(&self) -> Vec<PoolId> {
        self.inner
            .table
            .load()
            .pools
            .iter()
            .map(|(id, _)| *id)
            .collect()
    }

    fn each_pool(&self, f: impl Fn(&PoolShared<R>)) {
        f(&self.inner.default);
        for (_, p) in self.inner.table.load().pools.iter() {
            f(p);
        }
    }

    /// Sets every peak to the current value.
    pub fn reset_peak_stats(&self) {
        self.each_pool(|p| p.stats.reset_peak());
    }

    /// Zeroes the accumulated counts (`allocated`, `freed`, timings, retries, OOMs).
    pub fn reset_accumulated_stats(&self) {
        self.each_pool(|p| p.stats.reset_accumulated());
    }

    /// Where every pool's reserved bytes are (default pool first). Meant for checks at
    /// quiescent points: it briefly takes the ready blocks out of their queues to count them.
    pub async fn inventory(&self) -> Result<Vec<Inventory>, Error> {
        let (tx, rx) = flume::bounded(1);
        self.send_pool(PoolMsg::Inventory { reply: tx })?;
        let mut all = vec![rx.recv_async().await.map_err(|_| Error::Shutdown)?];
        let private = self
            .call_router(|reply| RouterMsg::Inventory { reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?;
        all.extend(private);
        Ok(all)
    }

    /// Routes allocations for streams that `filter` accepts into the private pool `id`
    /// (creating it, or adding a use to it) until [`Engine::end_allocate_to_pool`].
    pub async fn begin_allocate_to_pool(
        &self,
        id: PoolId,
        filter: StreamFilter<R>,
    ) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::Begin { id, filter, reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?
    }

    /// Stops routing allocations into pool `id`.
    pub async fn end_allocate_to_pool(&self, id: PoolId) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::End { id, reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?
    }

    /// Drops one use of pool `id`; once none is left, the next `empty_cache` frees it.
    pub async fn release_pool(&self, id: PoolId) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::Release { id, reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?
    }

    /// [`Engine::begin_allocate_to_pool`] for threads outside the tokio runtime.
    pub fn begin_allocate_to_pool_blocking(
        &self,
        id: PoolId,
        filter: StreamFilter<R>,
    ) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::Begin { id, filter, reply })?
            .recv()
            .map_err(|_| Error::Shutdown)?
    }

    /// [`Engine::end_allocate_to_pool`] for threads outside the tokio runtime.
    pub fn end_allocate_to_pool_blocking(&self, id: PoolId) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::End { id, reply })?
            .recv()
            .map_err(|_| Error::Shutdown)?
    }

    /// [`Engine::release_pool`] for threads outside the tokio runtime.
    pub fn release_pool_blocking(&self, id: PoolId) -> Result<(), Error> {
        self.call_router(|reply| RouterMsg::Release { id, reply })?
            .recv()
            .map_err(|_| Error::Shutdown)?
    }
}

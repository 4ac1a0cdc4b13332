//! The engine handle: what an allocator is. Cheap to clone; every clone talks to the same
//! actors. The last clone to go closes the pools, which give every block back to its memory
//! source as it comes home.
//!
//! The cached path is here and in [`crate::holders::ready`]: size class, route (no table
//! load unless a stream is given, and none for a stream this thread routed since the router
//! last published: the router's `route_cache`), take a ready block, charge this thread's
//! stats shard. A miss is one round trip to the pool actor (see [`crate::requests::miss`]).
//!
//! The rest of the handle's calls live beside it: `build` (the builder, which starts the
//! actors), `capture` (capture pools, through the router), `checkpoint` (checkpoints of
//! capture pools), `free_memory` (the free-memory callbacks), `inspect` (stats, inventories,
//! snapshots) and `history` (history and observers).

mod build;
mod capture;
mod checkpoint;
mod free_memory;
mod history;
mod inspect;
mod many;

pub use build::EngineBuilder;
pub use many::{alloc_many, alloc_many_blocking, Want};

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::actors::router::{route_cache, RouterMsg, Routes};
use crate::blocks::block::{Block, Home};
use crate::blocks::lease::Lease;
use crate::books::budget::Budget;
use crate::books::budget::EmptyReport;
use crate::books::messages::{PollerMsg, PoolMsg, Reply};
use crate::observation::history::Recorder;
use crate::requests::miss::{miss, miss_once, Tried, Wait, Who};
use crate::statistics::peaks::Ledger;
use crate::vocab::blocking::{may_block, run_here};
use crate::vocab::error::Error;
use crate::vocab::mailbox::Mailbox;
use crate::vocab::memory::MemorySource;
use crate::vocab::policy::{SizeClass, SizePolicy};
use crate::vocab::runtime::{Runtime, StreamId};

struct EngineInner<R: Runtime> {
    id: u64,
    /// Every stream gets a pool of its own (device memory): see [`EngineBuilder::stream_ordered`].
    stream_ordered: bool,
    runtime: Arc<R>,
    memory: Arc<dyn MemorySource>,
    policy: Arc<dyn SizePolicy>,
    default: Arc<Home<R>>,
    table: Arc<Routes<R>>,
    router: Arc<Mailbox<RouterMsg<R>>>,
    #[allow(dead_code)]
    poller: Arc<Mailbox<PollerMsg<Block<R>>>>,
    history: Arc<Recorder>,
    /// The peaks of the counts its pools keep in thread shards.
    ledger: Arc<Ledger>,
    /// The tokio runtime the actors run on.
    handle: tokio::runtime::Handle,
}

impl<R: Runtime> Drop for EngineInner<R> {
    fn drop(&mut self) {
        let _ = self.default.mailbox.send(PoolMsg::Close);
        let _ = self.router.send(RouterMsg::Close);
        // Pools whose actors went with their runtime: frees that raced the teardown.
        self.default.free_stranded();
        let table = self.table.load();
        let pools = table.pools.iter().map(|(_, p)| p);
        for p in pools.chain(table.streams.iter().map(|(_, p)| p)) {
            p.free_stranded();
        }
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
        pool: Arc<Home<R>>,
        class: SizeClass,
        during_capture: bool,
    },
    /// A stream-ordered engine's first request on a stream: its pool is still to be made.
    NewStream {
        stream: StreamId,
        /// The stream, for the router to keep alive.
        keep: R::Stream,
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

    /// Where the engine's fresh memory comes from.
    pub fn memory(&self) -> &Arc<dyn MemorySource> {
        &self.inner.memory
    }

    /// The history recorder (see [`crate::observation::history`]).
    pub(crate) fn recorder(&self) -> &Arc<Recorder> {
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
                let id = inner.runtime.stream_id(s);
                let epoch = inner.table.epoch();
                // SAFETY: `self` is a handle of engine `inner.id`, of runtime `R`.
                if let Some(known) = unsafe { route_cache::lookup::<R>(inner.id, id, epoch) } {
                    if let Some(block) = known.pool().ready.take_mine(class) {
                        return Ok(Step::Ready(Lease::new(block, size, false, inner.id)));
                    }
                    let pool = known.shared();
                    return Ok(Self::serve_here(&pool, class, size, false, inner.id));
                }
                table = inner.table.load();
                let capturing = !table.captures.is_empty() && inner.runtime.is_capturing(s)?;
                let pool = match table.captures.iter().find(|c| (c.filter)(s)) {
                    Some(capture) => &capture.pool,
                    None if inner.stream_ordered => match table.stream_pool(id) {
                        Some(pool) => pool,
                        // A stream of another runtime would own a pool whose order nothing
                        // here can follow.
                        None if !inner.runtime.owns_stream(s) => {
                            return Err(Error::ForeignStream {
                                stream: id.0,
                                runtime: inner.runtime.name(),
                            })
                        }
                        None => {
                            return Ok(Step::NewStream {
                                stream: id,
                                keep: s.clone(),
                                class,
                                during_capture: capturing,
                            })
                        }
                    },
                    None => &inner.default,
                };
                if table.captures.is_empty() {
                    route_cache::remember(inner.id, id, epoch, pool);
                }
                (pool, capturing)
            }
        };
        if let Some(block) = pool.ready.take_mine(class) {
            return Ok(Step::Ready(Lease::new(
                block,
                size,
                during_capture,
                inner.id,
            )));
        }
        Ok(Self::serve_here(
            pool,
            class,
            size,
            during_capture,
            inner.id,
        ))
    }

    /// Before asking the pool actor: a large block this thread holds of exactly the size
    /// (see `ReadyHolder::put_held`); a block this thread freed after a stream used it may
    /// have completed its events by now (one inline query; invariant 1); failing that, this
    /// thread's block of the next class up (carving layouts, see [`Self::split_next`]), a
    /// ready block in another thread's shard, a larger ready block split in two (carving
    /// layouts), or a block another thread parked whose events have completed. A miss sends
    /// the large blocks this thread holds home first.
    #[cold]
    fn serve_here(
        pool: &Arc<Home<R>>,
        class: SizeClass,
        size: usize,
        during_capture: bool,
        engine: u64,
    ) -> Step<R> {
        let ready = &pool.ready;
        let found = ready
            .take_held(class.size)
            .or_else(|| pool.parked.take_mine(class))
            .or_else(|| Self::split_next(pool, class))
            .or_else(|| ready.steal(ready.my_shard(), class))
            .or_else(|| Self::split_ready(pool, class))
            .or_else(|| pool.parked.steal(class));
        match found {
            Some(block) => Step::Ready(Lease::new(block, size, during_capture, engine)),
            None => {
                pool.send_held_home();
                Step::Miss {
                    pool: pool.clone(),
                    class,
                    during_capture,
                }
            }
        }
    }

    /// The block in this thread's slot of the next class up, cut for the request as
    /// [`Self::split_ready`] would cut it (most often taken whole: the rest is a sliver),
    /// when nothing in this thread's shard is filed under the class below (see
    /// `ReadyHolder::take_above_mine`). It is the block `split_ready` would take then, but
    /// without first looking at the other shards and at the class below, whose blocks a
    /// look takes out and puts back into its queue when they are too small. In the mixed
    /// sizes loop (4 KiB to 1 MiB, `BestFit`) about half the requests find their class
    /// empty, and four in five of those are served by the next class up.
    #[inline]
    fn split_next(pool: &Home<R>, class: SizeClass) -> Option<Box<Block<R>>> {
        // The classes `split_ready` takes from: above the request's, up to the split limit.
        let larger = pool
            .split_classes_upto
            .is_some_and(|upto| upto > class.index);
        if class.size >= pool.split_up_to || !larger {
            return None;
        }
        let block = pool.ready.take_above_mine(class)?;
        Some(Self::cut_for(pool, block, class))
    }

    /// A ready block of a larger class (up to the pool's split limit), split: the request
    /// keeps its first `class.size` bytes, the rest goes back to the ready holder as a block
    /// of its own. A request whose class is empty is served without a round trip to the pool
    /// actor, which coalesces the parts again when it next drains the ready holder.
    fn split_ready(pool: &Arc<Home<R>>, class: SizeClass) -> Option<Box<Block<R>>> {
        if class.size >= pool.split_up_to {
            return None;
        }
        let upto = pool.split_classes_upto?;
        let block = pool
            .ready
            .take_from_below(class)
            .or_else(|| pool.ready.take_larger(class.index, upto))?;
        Some(Self::cut_for(pool, block, class))
    }

    /// A ready block cut for a request of `class`: the request keeps its first `class.size`
    /// bytes, the rest goes back to the ready holder as a block of its own, unless it is a
    /// sliver (see `Carving::keep_rest_under`) that the request takes along.
    fn cut_for(pool: &Home<R>, mut block: Box<Block<R>>, class: SizeClass) -> Box<Block<R>> {
        let rest = block.size - class.size;
        let sliver =
            pool.keep_rest_under > 0 && rest.saturating_mul(pool.keep_rest_under) < block.size;
        let rest_class = if sliver {
            None
        } else {
            pool.policy.class_served_by(rest)
        };
        match rest_class {
            Some(rest_class) => {
                if let Some(tail) = block.split_off(class.size, class.index, rest_class) {
                    pool.ready.put(tail);
                }
            }
            // Too small a rest to serve any request, or a sliver: the request takes it
            // along, and the block goes back to the request's class when freed.
            None => block.class = class.index,
        }
        block
    }

    /// Allocates `size` bytes for work on `stream` (`None`: the default pool), waiting for
    /// room under the cap as `wait` says. What every `alloc*` call comes down to.
    #[doc(hidden)]
    pub async fn alloc_with(
        &self,
        size: usize,
        stream: Option<&R::Stream>,
        wait: Wait,
    ) -> Result<Lease<R>, Error> {
        match self.step(size, stream)? {
            Step::Ready(lease) => Ok(lease),
            step => self.serve(step, size, wait, Who::Task).await,
        }
    }

    /// Serves a request past the cached path's step, `who` waiting: a hit is the lease; a
    /// miss goes to its pool (started first for a new stream), waiting for room as `wait`
    /// says.
    async fn serve(
        &self,
        step: Step<R>,
        size: usize,
        wait: Wait,
        who: Who,
    ) -> Result<Lease<R>, Error> {
        let mut routed = self.route(step, who).await?;
        loop {
            let (pool, class, during_capture) = match routed {
                Ok(lease) => return Ok(lease),
                Err(miss) => miss,
            };
            // Boxed: the miss's state (the loop, both kinds of waiting, the timeout) is
            // large, and held inline it would make every request's future, hits included,
            // that large.
            match Box::pin(miss(&pool, class, size, wait, who)).await {
                Ok(block) => return Ok(Lease::new(block, size, during_capture, self.inner.id)),
                Err(Error::Shutdown) => {
                    routed = self.reroute(&pool, class, during_capture, who).await?
                }
                Err(e) => return Err(pool.oom(e)),
            }
        }
    }

    /// After a miss that found its pool gone: the stream's pool asked of the router again
    /// when the pool was a stream's pool retired while the request was on its way to it
    /// (see the router's `retire_idle_streams`); only retirement closes a stream pool's
    /// mailbox while a handle of its engine lives (the request holds one) and its runtime
    /// runs. The router answers once the retirement is published, with a new pool. Any
    /// other pool, or a router gone with its runtime: [`Error::Shutdown`].
    async fn reroute(
        &self,
        pool: &Home<R>,
        class: SizeClass,
        during_capture: bool,
        who: Who,
    ) -> Result<Result<Lease<R>, (Arc<Home<R>>, SizeClass, bool)>, Error> {
        match (pool.owner, &pool.owner_stream) {
            (Some(stream), Some(keep)) if pool.mailbox.is_closed() => {
                let step = Step::NewStream {
                    stream,
                    keep: keep.clone(),
                    class,
                    during_capture,
                };
                self.route(step, who).await
            }
            _ => Err(Error::Shutdown),
        }
    }

    /// The cached path's answer for a request: a lease, or the pool (started first, for a
    /// stream-ordered engine's first request on a stream, `who` waiting for the router),
    /// class and capture flag its miss goes to.
    async fn route(
        &self,
        step: Step<R>,
        who: Who,
    ) -> Result<Result<Lease<R>, (Arc<Home<R>>, SizeClass, bool)>, Error> {
        Ok(Err(match step {
            Step::Ready(lease) => return Ok(Ok(lease)),
            Step::Miss {
                pool,
                class,
                during_capture,
            } => (pool, class, during_capture),
            Step::NewStream {
                stream,
                keep,
                class,
                during_capture,
            } => {
                let rx = self.call_router(|reply| RouterMsg::StreamPool {
                    stream,
                    keep,
                    reply,
                })?;
                let pool = who.recv(&rx).await.ok_or(Error::Shutdown)?;
                (pool, class, during_capture)
            }
        }))
    }

    /// One try for one buffer of a request for several (see [`many`]): the cached path, then
    /// the pool actor, never queued; `empty`: make room (free-memory callbacks, every cache
    /// emptied) before giving up. No room under the cap is [`Tried::NoRoom`], not an error.
    pub(crate) async fn try_once(
        &self,
        size: usize,
        stream: Option<&R::Stream>,
        empty: bool,
    ) -> Result<Lease<R>, Tried> {
        let step = self.step(size, stream).map_err(Tried::Failed)?;
        let mut routed = self.route(step, Who::Task).await.map_err(Tried::Failed)?;
        loop {
            let (pool, class, during_capture) = match routed {
                Ok(lease) => return Ok(lease),
                Err(miss) => miss,
            };
            match miss_once(&pool, class, size, empty).await {
                Ok(block) => return Ok(Lease::new(block, size, during_capture, self.inner.id)),
                Err(Tried::Failed(Error::Shutdown)) => {
                    let rerouted = self.reroute(&pool, class, during_capture, Who::Task);
                    routed = rerouted.await.map_err(Tried::Failed)?
                }
                Err(Tried::Failed(e)) => return Err(Tried::Failed(pool.oom(e))),
                Err(Tried::NoRoom) => return Err(Tried::NoRoom),
            }
        }
    }

    /// The budget every pool of this engine reserves from.
    pub(crate) fn budget(&self) -> &Arc<Budget> {
        &self.inner.default.budget
    }

    /// The tokio runtime the actors run on.
    pub(crate) fn handle(&self) -> &tokio::runtime::Handle {
        &self.inner.handle
    }

    /// [`Engine::alloc_with`] for threads outside the tokio runtime: blocks the calling
    /// thread on a miss (and while it waits for room, as `wait` says). Where a thread that
    /// runs a current-thread runtime's tasks would block, it fails with
    /// [`Error::WouldDeadlock`] naming `call` (the public blocking call, and the async call
    /// to use instead); on a multi-thread runtime's threads it blocks inside
    /// `block_in_place` (see [`crate::vocab::blocking`]). The thread is looked at first, so a
    /// request the cached path would serve is refused where a miss would be: a call behaves
    /// the same whether or not the cache is warm.
    #[doc(hidden)]
    pub fn alloc_blocking_with(
        &self,
        size: usize,
        stream: Option<&R::Stream>,
        wait: Wait,
        call: (&'static str, &'static str),
    ) -> Result<Lease<R>, Error> {
        let blocking = may_block(call.0, call.1)?;
        let step = match self.step(size, stream)? {
            Step::Ready(lease) => return Ok(lease),
            step => step,
        };
        blocking.run(|| run_here(self.serve(step, size, wait, Who::Thread)))
    }

    /// The cap on reserved bytes, if any.
    #[doc(hidden)]
    pub fn max_bytes(&self) -> Option<usize> {
        self.inner.default.budget.limit()
    }

    /// Sets or lifts the cap. Lowering it frees nothing by itself (the next request that
    /// does not fit empties the caches); raising it lets waiting requests in.
    #[doc(hidden)]
    pub fn set_max_bytes(&self, bytes: Option<usize>) -> Result<(), Error> {
        if bytes == Some(0) {
            return Err(Error::InvalidLimit {
                reason: "a cap of 0 bytes leaves no room for any request".into(),
            });
        }
        self.inner.default.budget.set_limit(bytes);
        Ok(())
    }

    /// Books `err`, a request refused for want of memory before it reached the engine (a
    /// size larger than the device, say): counted in `num_ooms` and reported to the OOM
    /// observers like the engine's own failures. Returns `err`.
    #[doc(hidden)]
    pub fn refused(&self, err: Error) -> Error {
        let pool = self.default_pool();
        pool.stats.num_ooms.fetch_add(1, Ordering::Relaxed);
        pool.oom(err)
    }

    /// Pinned bytes reserved by all pools together (what the cap limits).
    pub fn reserved_bytes(&self) -> usize {
        self.inner.default.budget.reserved()
    }

    /// Requests for one buffer queued for room under the cap, in all pools together (they
    /// are served first come first served as memory comes back).
    pub fn waiting_requests(&self) -> usize {
        self.inner.default.budget.waiting()
    }

    /// The default pool's shared part (its budget reaches every pool).
    pub(crate) fn default_pool(&self) -> &Arc<Home<R>> {
        &self.inner.default
    }

    /// Records `stream` on a lease, after checking that this allocator lent it.
    #[doc(hidden)]
    pub fn record_stream(&self, lease: &mut Lease<R>, stream: &R::Stream) -> Result<(), Error> {
        if lease.engine_id() != self.inner.id {
            return Err(Error::ForeignBuffer);
        }
        lease.record_stream(stream)
    }

    /// Frees every cached block of the default pool, the stream pools and released capture
    /// pools (kept blocks of released pools too); blocks in use or waiting on events are
    /// untouched. The pools forget what their layouts learned from requests. Stream pools
    /// left holding nothing, unused since the call before, are retired (see the router's
    /// `retire_idle_streams`).
    pub async fn empty_cache(&self) -> Result<EmptyReport, Error> {
        let ask = |pool: &Home<R>| {
            let (tx, rx) = flume::bounded(1);
            let msg = PoolMsg::EmptyCache {
                include_kept: false,
                forget: true,
                upto: usize::MAX,
                reply: tx,
            };
            pool.mailbox.send(msg).is_ok().then_some(rx)
        };
        // The default pool and every stream pool empty their caches at once.
        let default = ask(&self.inner.default).ok_or(Error::Shutdown)?;
        let streams: Vec<_> = {
            let table = self.inner.table.load();
            table.streams.iter().filter_map(|(_, p)| ask(p)).collect()
        };
        let mut report = default.recv_async().await.map_err(|_| Error::Shutdown)?;
        for rx in streams {
            // A stream's pool retired meanwhile holds nothing: no reply, nothing to count.
            if let Ok(r) = rx.recv_async().await {
                report.merge(&r);
            }
        }
        let released = self
            .call_router(|reply| RouterMsg::EmptyReleased { reply })?
            .recv_async()
            .await
            .map_err(|_| Error::Shutdown)?;
        report.merge(&released);
        Ok(report)
    }

    /// The default pool, and in a stream-ordered engine every stream's pool (together they
    /// are the default pool, split by stream).
    pub(crate) fn default_pools(&self) -> Vec<Arc<Home<R>>> {
        let table = self.inner.table.load();
        std::iter::once(self.inner.default.clone())
            .chain(table.streams.iter().map(|(_, p)| p.clone()))
            .collect()
    }

    fn send_pool(&self, msg: PoolMsg<Block<R>>) -> Result<(), Error> {
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
}

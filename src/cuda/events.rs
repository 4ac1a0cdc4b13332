//! Pooled CUDA events, one free list per context.
//!
//! Owns every event the runtime has created. An event belongs to the context it was created
//! in and can only be recorded on that context's streams, so there is one [`ContextEvents`]
//! per context, found through a copy-on-write list behind an [`ArcSwap`]. Each keeps its idle
//! events in a bounded flume channel used as a lock-free free list. A [`PooledEvent`] goes
//! back to its free list when dropped (which is all `release_event` does); events beyond the
//! list's capacity, and the whole list once the runtime and every outstanding event are gone,
//! are destroyed. Nothing here takes a lock; and since events are only needed once a stream
//! has used a buffer, none of this is on the cached path (invariant 5).

use std::sync::Arc;

use arc_swap::ArcSwap;
use cudarc::driver::{result, sys, CudaContext, DriverError};

use super::context::bind;

/// Idle events kept per context; more than this many released at once are destroyed.
const FREE_LIST_CAPACITY: usize = 4096;

/// A raw event handle moved through the free list.
struct RawEvent(sys::CUevent);

// SAFETY: a `CUevent` is a driver handle that may be used from any thread; the free list
// hands each one to exactly one owner at a time.
unsafe impl Send for RawEvent {}

/// The idle events of one context.
pub(crate) struct ContextEvents {
    ctx: Arc<CudaContext>,
    free_tx: flume::Sender<RawEvent>,
    free_rx: flume::Receiver<RawEvent>,
}

impl ContextEvents {
    fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        let (free_tx, free_rx) = flume::bounded(FREE_LIST_CAPACITY);
        Arc::new(Self {
            ctx,
            free_tx,
            free_rx,
        })
    }

    /// An idle event of this context, or a new one (`CU_EVENT_DISABLE_TIMING`). The caller
    /// has bound this context to the calling thread.
    pub(crate) fn take(self: &Arc<Self>) -> Result<PooledEvent, DriverError> {
        let raw = match self.free_rx.try_recv() {
            Ok(RawEvent(raw)) => raw,
            Err(_) => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?,
        };
        Ok(PooledEvent {
            raw,
            pool: Arc::clone(self),
        })
    }

    /// How many idle events the free list holds.
    pub(crate) fn idle(&self) -> usize {
        self.free_rx.len()
    }

    fn give_back(&self, raw: sys::CUevent) {
        if let Err(flume::TrySendError::Full(RawEvent(raw))) = self.free_tx.try_send(RawEvent(raw))
        {
            destroy(&self.ctx, raw);
        }
    }
}

impl Drop for ContextEvents {
    fn drop(&mut self) {
        for RawEvent(raw) in self.free_rx.drain() {
            destroy(&self.ctx, raw);
        }
    }
}

fn destroy(ctx: &CudaContext, raw: sys::CUevent) {
    let destroyed = bind(ctx).and_then(|()| {
        // SAFETY: `raw` was created in `ctx` by `ContextEvents::take`, is idle (it came off
        // the free list or from a dropped `PooledEvent`), and nothing else holds it.
        unsafe { result::event::destroy(raw) }
    });
    if let Err(error) = destroyed {
        tracing::warn!(?error, "could not destroy a pooled CUDA event");
    }
}

/// An event taken from a context's pool and recorded on one of its streams: the
/// runtime's [`Runtime::Event`](crate::Runtime::Event). Dropping it returns it to the pool.
pub struct PooledEvent {
    raw: sys::CUevent,
    pool: Arc<ContextEvents>,
}

// SAFETY: the event handle may be queried, recorded and destroyed from any thread; the
// `PooledEvent` is its only owner until it goes back to the free list.
unsafe impl Send for PooledEvent {}

// SAFETY: a shared `PooledEvent` only lends its handle (`raw`), and the driver's calls on an
// event handle (`cuEventQuery`, `cuStreamWaitEvent`) are safe from several threads at once;
// recording, destroying and returning it to the pool take the event by value or `&mut`.
unsafe impl Sync for PooledEvent {}

impl PooledEvent {
    /// The raw driver handle. It stays owned by the pool: do not destroy it.
    pub fn cu_event(&self) -> sys::CUevent {
        self.raw
    }

    /// The context the event was created in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.pool.ctx
    }
}

impl std::fmt::Debug for PooledEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledEvent")
            .field("event", &self.raw)
            .field("context", &self.pool.ctx.cu_ctx())
            .finish()
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        self.pool.give_back(self.raw);
    }
}

/// The per-context pools of one runtime.
pub(crate) struct EventPools {
    pools: ArcSwap<Vec<Arc<ContextEvents>>>,
}

impl EventPools {
    pub(crate) fn new() -> Self {
        Self {
            pools: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// The pool of `ctx`, made on first use.
    pub(crate) fn for_context(&self, ctx: &Arc<CudaContext>) -> Arc<ContextEvents> {
        let key = ctx.cu_ctx();
        if let Some(pool) = self.pools.load().iter().find(|p| p.ctx.cu_ctx() == key) {
            return Arc::clone(pool);
        }
        let fresh = ContextEvents::new(Arc::clone(ctx));
        let mut chosen = Arc::clone(&fresh);
        self.pools.rcu(|pools| {
            if let Some(existing) = pools.iter().find(|p| p.ctx.cu_ctx() == key) {
                chosen = Arc::clone(existing);
                Arc::clone(pools)
            } else {
                chosen = Arc::clone(&fresh);
                let mut grown = Vec::clone(pools);
                grown.push(Arc::clone(&fresh));
                Arc::new(grown)
            }
        });
        chosen
    }

    /// Idle events across all contexts (for tests and statistics).
    pub(crate) fn idle(&self) -> usize {
        self.pools.load().iter().map(|p| p.idle()).sum()
    }
}

//! `PinnedAllocator`: the public face of the engine, and its builder.
//!
//! A cheap `Clone + Send + Sync` handle. Building it spawns the actors on the current tokio
//! runtime (or the one given to the builder); dropping the last handle closes them, and every
//! block goes back to the runtime as its buffer comes home.

use std::sync::Arc;

use pinpool_actors::{
    EmptyReport, Engine, EngineBuilder, Error, HostStats, Inventory, PoolId, Runtime, SizePolicy,
};

use crate::buffer::PinnedBuffer;
use crate::sim::SimRuntime;

/// A caching allocator for pinned host memory.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use pinpool::PinnedAllocator;
///
/// let pool = PinnedAllocator::builder().build()?;
/// let buf = pool.alloc(1 << 20).await?; // fresh memory
/// let ptr = buf.as_ptr();
/// drop(buf); // cached
/// let again = pool.alloc(1 << 20).await?; // the cached path: no actor, no runtime call
/// assert_eq!(again.as_ptr(), ptr);
/// assert_eq!(pool.stats().num_host_alloc, 1);
/// # Ok(()) }
/// ```
pub struct PinnedAllocator<R: Runtime = SimRuntime> {
    engine: Engine<R>,
}

impl<R: Runtime> Clone for PinnedAllocator<R> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
        }
    }
}

impl PinnedAllocator<SimRuntime> {
    /// A builder, on the simulated runtime until told otherwise.
    pub fn builder() -> Builder<SimRuntime> {
        Builder::new(Arc::new(SimRuntime::new()))
    }
}

/// Configures a [`PinnedAllocator`].
pub struct Builder<R: Runtime> {
    inner: EngineBuilder<R>,
}

impl<R: Runtime> Builder<R> {
    /// A builder over `runtime`.
    pub fn new(runtime: Arc<R>) -> Self {
        Self {
            inner: EngineBuilder::new(runtime),
        }
    }

    /// Use `runtime` instead.
    pub fn runtime<R2: Runtime>(self, runtime: Arc<R2>) -> Builder<R2> {
        Builder::new(runtime)
    }

    /// The size policy (default: powers of two, as PyTorch).
    pub fn policy(self, policy: Arc<dyn SizePolicy>) -> Self {
        Self {
            inner: self.inner.policy(policy),
        }
    }

    /// The tokio runtime for the actors (default: the current one).
    pub fn handle(self, handle: tokio::runtime::Handle) -> Self {
        Self {
            inner: self.inner.handle(handle),
        }
    }

    /// Thread shards for the cached path (default: the machine's parallelism).
    pub fn shards(self, shards: usize) -> Self {
        Self {
            inner: self.inner.shards(shards),
        }
    }

    /// Spawns the actors.
    pub fn build(self) -> Result<PinnedAllocator<R>, Error> {
        Ok(PinnedAllocator {
            engine: self.inner.build()?,
        })
    }
}

impl<R: Runtime> PinnedAllocator<R> {
    /// The engine underneath (for tools that need its lower-level calls).
    pub fn engine(&self) -> &Engine<R> {
        &self.engine
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<R> {
        self.engine.runtime()
    }

    /// Allocates `size` bytes from the default pool. A size seen before is served from the
    /// cache without a round trip to any actor; 0 gives an empty buffer.
    pub async fn alloc(&self, size: usize) -> Result<PinnedBuffer<R>, Error> {
        self.engine.alloc(size).await.map(PinnedBuffer::new)
    }

    /// Allocates `size` bytes for work on `stream`: from a capture's private pool when a
    /// capture under way accepts the stream, from the default pool otherwise.
    pub async fn alloc_on(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_on(size, stream)
            .await
            .map(PinnedBuffer::new)
    }

    /// Allocates without ever waiting for other buffers to come back: where `alloc` would
    /// wait at a memory limit, this fails at once with [`Error::OutOfMemory`].
    pub async fn try_alloc(&self, size: usize) -> Result<PinnedBuffer<R>, Error> {
        self.engine.alloc(size).await.map(PinnedBuffer::new)
    }

    /// [`PinnedAllocator::alloc`] for threads outside the tokio runtime: blocks the calling
    /// thread on a cache miss. Do not call it from async code.
    pub fn alloc_blocking(&self, size: usize) -> Result<PinnedBuffer<R>, Error> {
        self.engine.alloc_blocking(size).map(PinnedBuffer::new)
    }

    /// [`PinnedAllocator::alloc_on`] for threads outside the tokio runtime.
    pub fn alloc_blocking_on(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_blocking_on(size, stream)
            .map(PinnedBuffer::new)
    }

    /// Records `stream` on `buf` after checking that this allocator lent it
    /// ([`Error::ForeignBuffer`] otherwise, and nothing changes).
    pub fn record_stream(
        &self,
        buf: &mut PinnedBuffer<R>,
        stream: &R::Stream,
    ) -> Result<(), Error> {
        self.engine.record_stream(buf.lease_mut(), stream)
    }

    /// Frees every cached block of the default pool and of released capture pools.
    pub async fn empty_cache(&self) -> Result<EmptyReport, Error> {
        self.engine.empty_cache().await
    }

    /// [`PinnedAllocator::empty_cache`] for threads outside the tokio runtime.
    pub fn empty_cache_blocking(&self) -> Result<EmptyReport, Error> {
        self.engine.empty_cache_blocking()
    }

    /// Statistics over all pools, with the meaning of `torch.cuda.host_memory_stats()`.
    pub fn stats(&self) -> HostStats {
        self.engine.stats()
    }

    /// Statistics of one pool.
    pub fn pool_stats(&self, pool: PoolId) -> Option<HostStats> {
        self.engine.pool_stats(pool)
    }

    /// Ids of the capture pools alive.
    pub fn pools(&self) -> Vec<PoolId> {
        self.engine.pools()
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        self.engine.reset_peak_stats()
    }

    /// Zeroes the accumulated statistics.
    pub fn reset_accumulated_stats(&self) {
        self.engine.reset_accumulated_stats()
    }

    /// Where every pool's reserved bytes are; for checks at quiescent points.
    pub async fn inventory(&self) -> Result<Vec<Inventory>, Error> {
        self.engine.inventory().await
    }

    /// A capture pool id that no other call returns (like `torch.cuda.graph_pool_handle()`).
    pub fn new_pool_id(&self) -> PoolId {
        PoolId::fresh()
    }

    /// Routes allocations made with `alloc_on` for streams that `filter` accepts into the
    /// private pool `pool` until [`PinnedAllocator::end_allocate_to_pool`]. Blocks used by
    /// captured work are never reused while the pool lives.
    pub async fn begin_allocate_to_pool(
        &self,
        pool: PoolId,
        filter: impl Fn(&R::Stream) -> bool + Send + Sync + 'static,
    ) -> Result<(), Error> {
        self.engine
            .begin_allocate_to_pool(pool, Arc::new(filter))
            .await
    }

    /// Stops routing allocations into `pool`.
    pub async fn end_allocate_to_pool(&self, pool: PoolId) -> Result<(), Error> {
        self.engine.end_allocate_to_pool(pool).await
    }

    /// Drops one use of `pool`; once none is left, `empty_cache` frees it, kept blocks
    /// included. Call it only once the graphs that read the pool are gone.
    pub async fn release_pool(&self, pool: PoolId) -> Result<(), Error> {
        self.engine.release_pool(pool).await
    }

    /// [`PinnedAllocator::begin_allocate_to_pool`] for threads outside the tokio runtime.
    pub fn begin_allocate_to_pool_blocking(
        &self,
        pool: PoolId,
        filter: impl Fn(&R::Stream) -> bool + Send + Sync + 'static,
    ) -> Result<(), Error> {
        self.engine
            .begin_allocate_to_pool_blocking(pool, Arc::new(filter))
    }

    /// [`PinnedAllocator::end_allocate_to_pool`] for threads outside the tokio runtime.
    pub fn end_allocate_to_pool_blocking(&self, pool: PoolId) -> Result<(), Error> {
        self.engine.end_allocate_to_pool_blocking(pool)
    }

    /// [`PinnedAllocator::release_pool`] for threads outside the tokio runtime.
    pub fn release_pool_blocking(&self, pool: PoolId) -> Result<(), Error> {
        self.engine.release_pool_blocking(pool)
    }
}

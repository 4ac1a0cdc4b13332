//! `PinnedAllocator`: the public face of the engine, and its builder.
//!
//! A cheap `Clone + Send + Sync` handle. Building it spawns the actors on the current tokio
//! runtime (or the one given to the builder); dropping the last handle closes them, and every
//! block goes back to the runtime as its buffer comes home.
//!
//! The memory limit (`max_bytes`, `memory_fraction`) is one budget for the whole allocator:
//! the default pool and every capture pool reserve from it before they take fresh memory.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::actors::{
    blocking, BaseAllocation, CacheInfo, EmptyReport, Engine, Error, HostStats, MemorySnapshot,
    PoolId, Runtime, Wait,
};

mod builder;

use builder::fraction_of_host;
pub use builder::{host_memory_bytes, Builder};

use crate::buffer::PinnedBuffer;
use crate::sim::SimRuntime;

/// A caching allocator for pinned host memory.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use pinpool::PinnedAllocator;
///
/// let allocator = PinnedAllocator::builder().build()?;
/// let buf = allocator.alloc(1 << 20).await?; // fresh memory
/// let ptr = buf.as_ptr();
/// drop(buf); // cached
/// let again = allocator.alloc(1 << 20).await?; // the cached path: no actor, no runtime call
/// assert_eq!(again.as_ptr(), ptr);
/// assert_eq!(allocator.stats().num_host_alloc, 1);
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

impl<R: Runtime> PinnedAllocator<R> {
    /// The engine underneath ([`crate::tuning::engine`] for tools).
    pub(crate) fn engine(&self) -> &Engine<R> {
        &self.engine
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<R> {
        self.engine.runtime()
    }

    /// Allocates `size` bytes from the default pool. A size seen before is served from the
    /// cache without a round trip to any actor; 0 gives an empty buffer.
    ///
    /// Under a memory cap ([`Builder::max_bytes`]) a request that does not fit waits, first
    /// come first served, until buffers come back (up to [`Builder::alloc_timeout`], then
    /// [`Error::Timeout`]). A wait that could end only once buffers this task holds come back
    /// is refused ([`crate::OomCause::HeldByRequester`]); see
    /// [waiting under a cap](crate#waiting-under-a-cap). Cancel-safe: dropping the future
    /// leaves nothing queued and loses no memory.
    pub async fn alloc(&self, size: usize) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_with(size, None, Wait::Default)
            .await
            .map(PinnedBuffer::new)
    }

    /// [`PinnedAllocator::alloc`], waiting at most `timeout` for room under the cap.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use std::time::Duration;
    ///
    /// let allocator = pinpool::PinnedAllocator::builder().max_bytes(1 << 20).build()?;
    /// let held = allocator.alloc(1 << 20).await?;
    /// let err = allocator.alloc_timeout(1 << 20, Duration::from_millis(10)).await.unwrap_err();
    /// assert!(matches!(err, pinpool::Error::Timeout { .. }));
    /// drop(held);
    /// # Ok(()) }
    /// ```
    pub async fn alloc_timeout(
        &self,
        size: usize,
        timeout: Duration,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_with(size, None, Wait::Upto(timeout))
            .await
            .map(PinnedBuffer::new)
    }

    /// Allocates `size` bytes for work on `stream`: from a capture pool when a
    /// capture under way accepts the stream, from the default pool otherwise.
    pub async fn alloc_on(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_with(size, Some(stream), Wait::Default)
            .await
            .map(PinnedBuffer::new)
    }

    /// Allocates without ever waiting for other buffers to come back: where `alloc` would
    /// wait at a memory limit, this fails at once with [`Error::OutOfMemory`] (after
    /// emptying the caches, as `alloc` does).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// let allocator = pinpool::PinnedAllocator::builder().max_bytes(1 << 20).build()?;
    /// let held = allocator.alloc(1 << 20).await?;
    /// let err = allocator.try_alloc(4096).await.unwrap_err();
    /// assert!(matches!(err, pinpool::Error::OutOfMemory { limit: Some(_), .. }));
    /// drop(held);
    /// # Ok(()) }
    /// ```
    pub async fn try_alloc(&self, size: usize) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_with(size, None, Wait::Never)
            .await
            .map(PinnedBuffer::new)
    }

    /// [`PinnedAllocator::try_alloc`] for work on `stream` (see [`PinnedAllocator::alloc_on`]).
    pub async fn try_alloc_on(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_with(size, Some(stream), Wait::Never)
            .await
            .map(PinnedBuffer::new)
    }

    /// [`PinnedAllocator::alloc`] for threads outside the tokio runtime: blocks the calling
    /// thread on a cache miss, and while it waits for room under the cap (up to
    /// [`Builder::alloc_timeout`]).
    ///
    /// From async code use `alloc(..).await`. Where blocking would deadlock — on a thread that
    /// runs a current-thread runtime's tasks, which include the actors that answer a miss —
    /// this and every other `*_blocking` call fails at once with [`Error::WouldDeadlock`],
    /// whether or not the request would have missed. On a multi-thread runtime's threads it
    /// blocks inside [`tokio::task::block_in_place`], which moves the worker's other tasks
    /// elsewhere first. The rule is in [blocking calls](crate#blocking-calls).
    ///
    /// ```
    /// # use pinpool::{Error, PinnedAllocator};
    /// #[tokio::main(flavor = "current_thread")]
    /// async fn main() {
    ///     let allocator = PinnedAllocator::builder().build().unwrap();
    ///     assert!(matches!(
    ///         allocator.alloc_blocking(1 << 20),
    ///         Err(Error::WouldDeadlock { .. })
    ///     ));
    ///     // A thread of its own may block; the runtime's thread goes on running the actors.
    ///     let allocator2 = allocator.clone();
    ///     let thread = std::thread::spawn(move || allocator2.alloc_blocking(1 << 20).map(|b| b.len()));
    ///     let len = tokio::task::spawn_blocking(move || thread.join().unwrap()).await;
    ///     assert_eq!(len.unwrap().unwrap(), 1 << 20);
    /// }
    /// ```
    pub fn alloc_blocking(&self, size: usize) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_blocking_with(
                size,
                None,
                Wait::Default,
                ("alloc_blocking", "alloc(..).await"),
            )
            .map(PinnedBuffer::new)
    }

    /// [`PinnedAllocator::alloc_blocking`], waiting at most `timeout` for room.
    pub fn alloc_blocking_timeout(
        &self,
        size: usize,
        timeout: Duration,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_blocking_with(
                size,
                None,
                Wait::Upto(timeout),
                ("alloc_blocking_timeout", "alloc_timeout(..).await"),
            )
            .map(PinnedBuffer::new)
    }

    /// The cap on reserved bytes, if any.
    pub fn max_bytes(&self) -> Option<usize> {
        self.engine.max_bytes()
    }

    /// Sets (`Some`) or lifts (`None`) the cap while running. Lowering it frees nothing by
    /// itself; raising it lets waiting requests in. [`Error::InvalidLimit`] for 0.
    pub fn set_max_bytes(&self, bytes: Option<usize>) -> Result<(), Error> {
        self.engine.set_max_bytes(bytes)
    }

    /// Sets the cap to `fraction` of host RAM ([`Error::InvalidLimit`] unless `fraction` is
    /// in (0, 1]; nothing changes then).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        self.engine.set_max_bytes(Some(fraction_of_host(fraction)?))
    }

    /// Pinned bytes reserved by all pools together (what the cap limits).
    pub fn reserved_bytes(&self) -> usize {
        self.engine.reserved_bytes()
    }

    /// Every segment and block (address, size, requested size, state, streams) and the
    /// configuration in force; serializable with serde.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::BlockStatus;
    ///
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let buf = allocator.alloc(1000).await?;
    /// let snap = allocator.snapshot().await?;
    /// // The mapped memory is one segment, tiled by its blocks: the one lent, the rest free.
    /// assert_eq!(snap.segments.len(), 1);
    /// let (segment, block) = snap.blocks().find(|(_, b)| b.state == BlockStatus::InUse).unwrap();
    /// assert_eq!(block.address, buf.as_ptr() as usize);
    /// assert_eq!((block.size, block.requested_size), (1024, 1000));
    /// assert!(segment.address <= block.address);
    /// assert!(block.address + block.size <= segment.address + segment.total_size);
    /// assert_eq!(snap.config.runtime, "sim");
    /// # Ok(()) }
    /// ```
    pub async fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        self.engine.snapshot().await
    }

    /// The largest cached block and the bytes cached, over all pools.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// drop(allocator.alloc(4096).await?);
    /// drop(allocator.alloc(100).await?);
    /// let info = allocator.cache_info().await?;
    /// // The first request mapped one 2 MiB granule of pinned memory: all of it is cached now.
    /// assert_eq!(info.total_cached, 2 << 20);
    /// assert!(info.largest_block >= 4096 && info.largest_block <= info.total_cached);
    /// # Ok(()) }
    /// ```
    pub async fn cache_info(&self) -> Result<CacheInfo, Error> {
        self.engine.cache_info().await
    }

    /// The segment that holds `ptr` (base address, size, pool), or `None` when this
    /// allocator holds no segment containing it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let buf = allocator.alloc(4096).await?;
    /// let inside = buf.as_ptr().wrapping_add(100);
    /// let base = allocator.base_allocation(inside).await?.unwrap();
    /// // The mapped run of pinned memory the block was cut from.
    /// assert!(base.base <= buf.as_ptr() as usize);
    /// assert!(buf.as_ptr() as usize + 4096 <= base.base + base.size);
    /// assert_eq!(allocator.base_allocation(&0u8 as *const u8).await?, None);
    /// # Ok(()) }
    /// ```
    pub fn base_allocation(
        &self,
        ptr: *const u8,
    ) -> impl Future<Output = Result<Option<BaseAllocation>, Error>> + Send + '_ {
        self.engine.base_allocation(ptr)
    }

    /// Whether the blocks in use in `pool` start exactly at the `expected` pointers.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use pinpool::PoolId;
    ///
    /// let allocator = pinpool::PinnedAllocator::builder().build()?;
    /// let a = allocator.alloc(64).await?;
    /// let b = allocator.alloc(64).await?;
    /// assert!(allocator.check_pool_live_allocations(PoolId::DEFAULT, &[a.as_ptr(), b.as_ptr()]).await?);
    /// drop(b);
    /// assert!(allocator.check_pool_live_allocations(PoolId::DEFAULT, &[a.as_ptr()]).await?);
    /// # Ok(()) }
    /// ```
    pub fn check_pool_live_allocations(
        &self,
        pool: PoolId,
        expected: &[*const u8],
    ) -> impl Future<Output = Result<bool, Error>> + Send + '_ {
        self.engine.check_pool_live_allocations(pool, expected)
    }

    /// [`PinnedAllocator::alloc_on`] for threads outside the tokio runtime.
    pub fn alloc_blocking_on(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<PinnedBuffer<R>, Error> {
        self.engine
            .alloc_blocking_with(
                size,
                Some(stream),
                Wait::Default,
                ("alloc_blocking_on", "alloc_on(..).await"),
            )
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

    /// Frees every cached block of the default pool and of released capture pools. The pools
    /// also forget what they learned from requests (the peak of live bytes that caps
    /// reserved memory, the ranges sizes last used): the requests that follow take memory as
    /// they would from fresh pools.
    pub async fn empty_cache(&self) -> Result<EmptyReport, Error> {
        self.engine.empty_cache().await
    }

    /// [`PinnedAllocator::empty_cache`] for threads outside the tokio runtime.
    pub fn empty_cache_blocking(&self) -> Result<EmptyReport, Error> {
        blocking::call(
            ("empty_cache_blocking", "empty_cache().await"),
            self.engine.empty_cache(),
        )?
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

    /// Routes allocations made with `alloc_on` for streams that `filter` accepts into the
    /// capture pool `pool` until [`PinnedAllocator::end_allocate_to_pool`]. Blocks used by
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
        blocking::call(
            (
                "begin_allocate_to_pool_blocking",
                "begin_allocate_to_pool(..).await",
            ),
            self.engine.begin_allocate_to_pool(pool, Arc::new(filter)),
        )?
    }

    /// [`PinnedAllocator::end_allocate_to_pool`] for threads outside the tokio runtime.
    pub fn end_allocate_to_pool_blocking(&self, pool: PoolId) -> Result<(), Error> {
        blocking::call(
            (
                "end_allocate_to_pool_blocking",
                "end_allocate_to_pool(..).await",
            ),
            self.engine.end_allocate_to_pool(pool),
        )?
    }

    /// [`PinnedAllocator::release_pool`] for threads outside the tokio runtime.
    pub fn release_pool_blocking(&self, pool: PoolId) -> Result<(), Error> {
        blocking::call(
            ("release_pool_blocking", "release_pool(..).await"),
            self.engine.release_pool(pool),
        )?
    }
}

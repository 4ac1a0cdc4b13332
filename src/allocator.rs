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
    blocking, BaseAllocation, CacheInfo, EmptyReport, Engine, EngineBuilder, Error, HostStats,
    MemorySnapshot, MemorySource, PoolId, Runtime, SizePolicy, Wait,
};

use crate::buffer::PinnedBuffer;
use crate::config::Config;
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

/// Bytes of host RAM (`MemTotal` in `/proc/meminfo`), what
/// [`Builder::memory_fraction`] takes a fraction of.
///
/// ```
/// # fn main() -> Result<(), pinpool::Error> {
/// # if !std::path::Path::new("/proc/meminfo").exists() { return Ok(()); }
/// let ram = pinpool::host_memory_bytes()?;
/// assert!(ram > 0);
/// # Ok(()) }
/// ```
pub fn host_memory_bytes() -> Result<usize, Error> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| Error::InvalidLimit {
        reason: format!("cannot read /proc/meminfo: {e}"),
    })?;
    parse_mem_total(&text).ok_or_else(|| Error::InvalidLimit {
        reason: "no MemTotal line in /proc/meminfo".into(),
    })
}

/// `MemTotal:       131891740 kB` → bytes.
fn parse_mem_total(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let n: usize = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// The cap that `fraction` of host RAM gives.
fn fraction_of_host(fraction: f64) -> Result<usize, Error> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(Error::InvalidLimit {
            reason: format!("memory fraction {fraction} is not in (0, 1]"),
        });
    }
    let bytes = (host_memory_bytes()? as f64 * fraction) as usize;
    if bytes == 0 {
        return Err(Error::InvalidLimit {
            reason: format!("memory fraction {fraction} of host memory is 0 bytes"),
        });
    }
    Ok(bytes)
}

/// Configures a [`PinnedAllocator`].
///
/// Every setting given is kept until `build`, whatever is called after it: switching the
/// runtime ([`Builder::runtime`], `cuda`, `best_available`) keeps the others. The allocator
/// settings of `PINPOOL_CONF` ([`Config::from_env`](crate::config::Config::from_env)) apply
/// on every runtime unless [`Builder::config`] gives a configuration; a malformed one makes
/// `build` fail with [`Error::InvalidConfig`]. An explicit [`Builder::policy`] wins over the
/// configuration's `size_policy`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use std::time::Duration;
///
/// let pool = pinpool::PinnedAllocator::builder()
///     .max_bytes(64 << 20) // at most 64 MiB pinned
///     .alloc_timeout(Duration::from_secs(5)) // `alloc` waits at most 5 s for room
///     .build()?;
/// assert_eq!(pool.max_bytes(), Some(64 << 20));
/// # Ok(()) }
/// ```
pub struct Builder<R: Runtime> {
    runtime: Arc<R>,
    memory: Arc<dyn MemorySource>,
    cap: Cap,
    alloc_timeout: Option<Duration>,
    policy: Option<Arc<dyn SizePolicy>>,
    config: Option<Config>,
    handle: Option<tokio::runtime::Handle>,
    shards: Option<usize>,
}

/// How the cap is set.
#[derive(Debug, Clone, Copy)]
enum Cap {
    None,
    Bytes(usize),
    Fraction(f64),
}

impl<R: Runtime + MemorySource> Builder<R> {
    /// A builder over `runtime`, which orders reuse with its events and gives the pinned
    /// memory.
    pub fn new(runtime: Arc<R>) -> Self {
        Self {
            memory: runtime.clone(),
            runtime,
            cap: Cap::None,
            alloc_timeout: None,
            policy: None,
            config: None,
            handle: None,
            shards: None,
        }
    }
}

impl<R: Runtime> Builder<R> {
    /// Caps the pinned bytes the allocator reserves, over all its pools (default: no cap).
    /// A request that would pass the cap first has every pool's cache emptied; if it still
    /// does not fit, [`PinnedAllocator::alloc`] waits, first come first served, for buffers
    /// to come back, and [`PinnedAllocator::try_alloc`] fails with [`Error::OutOfMemory`]. A
    /// request larger than the cap fails at once. `build` refuses a cap of 0. Replaces a
    /// [`Builder::memory_fraction`] given before.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.cap = Cap::Bytes(bytes);
        self
    }

    /// Caps the pinned bytes at `fraction` of host RAM (`MemTotal` of `/proc/meminfo`), as
    /// `torch.cuda.set_per_process_memory_fraction` does for device memory. `build` fails
    /// with [`Error::InvalidLimit`] unless `fraction` is in (0, 1]. Replaces a
    /// [`Builder::max_bytes`] given before.
    pub fn memory_fraction(mut self, fraction: f64) -> Self {
        self.cap = Cap::Fraction(fraction);
        self
    }

    /// How long [`PinnedAllocator::alloc`] and `alloc_blocking` wait for room under the cap
    /// before failing with [`Error::Timeout`] (default: as long as it takes; a wait that
    /// lasts a second is logged, or refused when it waits on the requester's own buffers:
    /// see [waiting under a cap](crate#waiting-under-a-cap)).
    pub fn alloc_timeout(mut self, timeout: Duration) -> Self {
        self.alloc_timeout = Some(timeout);
        self
    }

    /// Use `runtime` instead, keeping the other settings.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pinpool::Error> {
    /// use std::sync::Arc;
    /// use pinpool::sim::SimRuntime;
    ///
    /// let sim = SimRuntime::new();
    /// sim.set_memory_limit(Some(1 << 30));
    /// let pool = pinpool::PinnedAllocator::builder()
    ///     .max_bytes(64 << 20)
    ///     .runtime(Arc::new(sim))
    ///     .build()?;
    /// assert_eq!(pool.max_bytes(), Some(64 << 20));
    /// # Ok(()) }
    /// ```
    pub fn runtime<R2: Runtime + MemorySource>(self, runtime: Arc<R2>) -> Builder<R2> {
        Builder {
            memory: runtime.clone(),
            runtime,
            cap: self.cap,
            alloc_timeout: self.alloc_timeout,
            policy: self.policy,
            config: self.config,
            handle: self.handle,
            shards: self.shards,
        }
    }

    /// The size policy (default: the configuration's `size_policy`, [`crate::tuning::BestFit`]
    /// unless `PINPOOL_CONF` or [`Builder::config`] names another).
    pub fn policy(mut self, policy: Arc<dyn SizePolicy>) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Uses `config` instead of `PINPOOL_CONF`: its `size_policy` (unless
    /// [`Builder::policy`] is given), and, for a runtime chosen afterwards with `cuda` or
    /// `best_available`, its pinning settings.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let config: pinpool::config::Config = "size_policy:bestfit".parse()?;
    /// let pool = pinpool::PinnedAllocator::builder().config(&config).build()?;
    /// assert_eq!(pool.snapshot().await?.config.policy, "bestfit");
    /// # Ok(()) }
    /// ```
    pub fn config(mut self, config: &Config) -> Self {
        self.config = Some(config.clone());
        self
    }

    /// The tokio runtime for the actors (default: the current one).
    pub fn handle(mut self, handle: tokio::runtime::Handle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Thread shards for the cached path (default: twice the machine's parallelism, rounded up
    /// to a power of two, at most 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// The configuration in force: the one given, or `PINPOOL_CONF`'s.
    pub(crate) fn resolved_config(&self) -> Result<Config, Error> {
        match &self.config {
            Some(c) => Ok(c.clone()),
            None => Config::from_env().map_err(config_error),
        }
    }

    /// Spawns the actors.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a malformed `PINPOOL_CONF` (when no configuration was
    /// given), [`Error::InvalidLimit`] for a cap of 0 or a bad fraction,
    /// [`Error::NoTokioRuntime`] outside a tokio runtime without a handle.
    pub fn build(self) -> Result<PinnedAllocator<R>, Error> {
        let config = self.resolved_config()?;
        let policy = self.policy.unwrap_or_else(|| config.size_policy.policy());
        let mut inner = EngineBuilder::new(self.runtime, self.memory).policy(policy);
        match self.cap {
            Cap::None => {}
            Cap::Bytes(b) => inner = inner.max_bytes(b),
            Cap::Fraction(f) => inner = inner.max_bytes(fraction_of_host(f)?),
        }
        if let Some(t) = self.alloc_timeout {
            inner = inner.alloc_timeout(t);
        }
        if let Some(h) = self.handle {
            inner = inner.handle(h);
        }
        if let Some(s) = self.shards {
            inner = inner.shards(s);
        }
        Ok(PinnedAllocator {
            engine: inner.build()?,
        })
    }
}

/// A malformed `PINPOOL_CONF` as the crate's error.
pub(crate) fn config_error(error: crate::config::ConfigError) -> Error {
    Error::InvalidConfig {
        message: format!("{}: {error}", crate::config::ENV_VAR),
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
    /// let pool = pinpool::PinnedAllocator::builder().max_bytes(1 << 20).build()?;
    /// let held = pool.alloc(1 << 20).await?;
    /// let err = pool.alloc_timeout(1 << 20, Duration::from_millis(10)).await.unwrap_err();
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

    /// Allocates `size` bytes for work on `stream`: from a capture's private pool when a
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
    /// let pool = pinpool::PinnedAllocator::builder().max_bytes(1 << 20).build()?;
    /// let held = pool.alloc(1 << 20).await?;
    /// let err = pool.try_alloc(4096).await.unwrap_err();
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
    ///     let pool = PinnedAllocator::builder().build().unwrap();
    ///     assert!(matches!(
    ///         pool.alloc_blocking(1 << 20),
    ///         Err(Error::WouldDeadlock { .. })
    ///     ));
    ///     // A thread of its own may block; the runtime's thread goes on running the actors.
    ///     let pool2 = pool.clone();
    ///     let thread = std::thread::spawn(move || pool2.alloc_blocking(1 << 20).map(|b| b.len()));
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
    /// let pool = pinpool::PinnedAllocator::builder().build()?;
    /// let buf = pool.alloc(1000).await?;
    /// let snap = pool.snapshot().await?;
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
    /// let pool = pinpool::PinnedAllocator::builder().build()?;
    /// drop(pool.alloc(4096).await?);
    /// drop(pool.alloc(100).await?);
    /// let info = pool.cache_info().await?;
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
    /// let pool = pinpool::PinnedAllocator::builder().build()?;
    /// let buf = pool.alloc(4096).await?;
    /// let inside = buf.as_ptr().wrapping_add(100);
    /// let base = pool.base_allocation(inside).await?.unwrap();
    /// // The mapped run of pinned memory the block was cut from.
    /// assert!(base.base <= buf.as_ptr() as usize);
    /// assert!(buf.as_ptr() as usize + 4096 <= base.base + base.size);
    /// assert_eq!(pool.base_allocation(&0u8 as *const u8).await?, None);
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
    /// let pool = pinpool::PinnedAllocator::builder().build()?;
    /// let a = pool.alloc(64).await?;
    /// let b = pool.alloc(64).await?;
    /// assert!(pool.check_pool_live_allocations(PoolId::DEFAULT, &[a.as_ptr(), b.as_ptr()]).await?);
    /// drop(b);
    /// assert!(pool.check_pool_live_allocations(PoolId::DEFAULT, &[a.as_ptr()]).await?);
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

//! `Builder`: the settings of a [`PinnedAllocator`] (runtime, memory limit, timeout, policy,
//! configuration, tokio handle, shards) kept until `build`, and the host memory a fraction
//! of which is a limit.

use std::sync::Arc;
use std::time::Duration;

use super::PinnedAllocator;
use crate::actors::{EngineBuilder, Error, MemorySource, Runtime, SizePolicy};
use crate::config::Config;

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
pub(super) fn fraction_of_host(fraction: f64) -> Result<usize, Error> {
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
/// let allocator = pinpool::PinnedAllocator::builder()
///     .max_bytes(64 << 20) // at most 64 MiB pinned
///     .alloc_timeout(Duration::from_secs(5)) // `alloc` waits at most 5 s for room
///     .build()?;
/// assert_eq!(allocator.max_bytes(), Some(64 << 20));
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
    /// let allocator = pinpool::PinnedAllocator::builder()
    ///     .max_bytes(64 << 20)
    ///     .runtime(Arc::new(sim))
    ///     .build()?;
    /// assert_eq!(allocator.max_bytes(), Some(64 << 20));
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
    /// let allocator = pinpool::PinnedAllocator::builder().config(&config).build()?;
    /// assert_eq!(allocator.snapshot().await?.config.policy, "bestfit");
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

//! `DeviceBuilder`: the settings of a [`DeviceAllocator`], and the start of one engine per
//! device (each with its own actors, budget, statistics and history, as PyTorch keeps one
//! allocator per device).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::actors::{DeviceFit, EngineBuilder, Error, SizePolicy};

use super::allocator::{DeviceAllocator, Inner};
use super::peer::PeerTable;
use super::raw::RawTable;
use super::runtime::DeviceRuntime;
use crate::config::{DeviceConfig, DEVICE_ENV_VAR};

/// How the cap of each device is set.
#[derive(Debug, Clone, Copy)]
enum Cap {
    None,
    Bytes(usize),
    Fraction(f64),
}

/// Configures a [`DeviceAllocator`].
///
/// Every setting given is kept until `build`, whatever is called after it (switching the
/// runtime with [`DeviceBuilder::runtime`] or `cuda` keeps the others). The layout settings
/// of `PINPOOL_DEVICE_CONF` ([`DeviceConfig::from_env`]) apply on every runtime unless
/// [`DeviceBuilder::config`] gives them; a malformed one makes `build` fail with
/// [`Error::InvalidConfig`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use std::time::Duration;
///
/// let pool = pinpool::DeviceAllocator::builder()
///     .memory_fraction(0.5) // at most half of each device
///     .alloc_timeout(Duration::from_secs(5))
///     .build()?;
/// assert_eq!(pool.max_bytes(0)?, Some(8 << 30)); // half of the simulated 16 GiB
/// # Ok(()) }
/// ```
pub struct DeviceBuilder<R: DeviceRuntime> {
    runtime: Arc<R>,
    config: Option<DeviceConfig>,
    cap: Cap,
    alloc_timeout: Option<Duration>,
    handle: Option<tokio::runtime::Handle>,
    shards: Option<usize>,
    policy: Option<Arc<dyn SizePolicy>>,
    lend_between_streams: bool,
}

impl<R: DeviceRuntime> DeviceBuilder<R> {
    /// A builder over `runtime`'s devices.
    pub fn new(runtime: Arc<R>) -> Self {
        Self {
            runtime,
            config: None,
            cap: Cap::None,
            alloc_timeout: None,
            handle: None,
            shards: None,
            policy: None,
            lend_between_streams: true,
        }
    }

    /// Use `runtime` instead, keeping the other settings.
    pub fn runtime<R2: DeviceRuntime>(self, runtime: Arc<R2>) -> DeviceBuilder<R2> {
        DeviceBuilder {
            runtime,
            config: self.config,
            cap: self.cap,
            alloc_timeout: self.alloc_timeout,
            handle: self.handle,
            shards: self.shards,
            policy: self.policy,
            lend_between_streams: self.lend_between_streams,
        }
    }

    /// The device settings, used instead of `PINPOOL_DEVICE_CONF`'s: every key of
    /// [`DeviceConfig::KEYS`] (`max_split_size_mb`, `roundup_power2_divisions`,
    /// `garbage_collection_threshold`, `expandable_segments`, `thread_cache_mb`,
    /// `reserve_cap`, `linger_us`, `per_process_memory_fraction`, and PyTorch's keys that
    /// take no effect here: `backend`, `release_lock_on_cudamalloc`,
    /// `graph_capture_record_stream_reuse`, `pinned_use_cuda_host_register`,
    /// `pinned_use_host_register`, `pinned_num_register_threads`,
    /// `pinned_use_background_threads`, `pinned_reserve_segment_size_mb`,
    /// `max_non_split_rounding_mb`; each [`DeviceConfig`] field says what its key takes).
    /// See [`DeviceConfig::merged_with_env`] to have the variable override some of them. A
    /// cap given to this builder wins over the configuration's memory fraction.
    pub fn config(mut self, config: &DeviceConfig) -> Self {
        self.config = Some(config.clone());
        self
    }

    /// The layout settings in force: the ones given, or `PINPOOL_DEVICE_CONF`'s.
    pub(crate) fn resolved_config(&self) -> Result<DeviceConfig, Error> {
        match &self.config {
            Some(c) => Ok(c.clone()),
            None => DeviceConfig::from_env().map_err(|e| Error::InvalidConfig {
                message: format!("{DEVICE_ENV_VAR}: {e}"),
            }),
        }
    }

    /// Caps the bytes each device's pools reserve (default: no cap). A request that would
    /// pass it first has the device's caches emptied; if it still does not fit,
    /// [`DeviceAllocator::alloc`] waits, first come first served, for buffers to come back,
    /// and [`DeviceAllocator::try_alloc`] fails with [`Error::OutOfMemory`].
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.cap = Cap::Bytes(bytes);
        self
    }

    /// Caps each device at `fraction` of its memory (PyTorch's
    /// `set_per_process_memory_fraction`); `build` fails with [`Error::InvalidLimit`] unless
    /// `fraction` is in (0, 1].
    pub fn memory_fraction(mut self, fraction: f64) -> Self {
        self.cap = Cap::Fraction(fraction);
        self
    }

    /// Under the cap (or with the device out of memory), a stream's request first borrows
    /// memory another stream's pool holds, before every cache is emptied (default: on):
    /// no driver call and no waiting, the requesting stream ordered after the lender's
    /// queued work with an event (`cuStreamWaitEvent`), and the block back in its own pool
    /// once the borrower's work on it has run. Off, stream pools make room for each other
    /// by giving memory back to the driver and taking it again.
    pub fn lend_between_streams(mut self, on: bool) -> Self {
        self.lend_between_streams = on;
        self
    }

    /// How long `alloc` waits for room under the cap before [`Error::Timeout`] (default: as
    /// long as it takes; a wait that lasts a second is logged, or refused when it waits on
    /// the requester's own buffers: see [waiting under a cap](crate#waiting-under-a-cap)).
    pub fn alloc_timeout(mut self, timeout: Duration) -> Self {
        self.alloc_timeout = Some(timeout);
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

    /// A size policy other than the one the configuration describes (for comparisons).
    pub fn policy(mut self, policy: Arc<dyn SizePolicy>) -> Self {
        self.policy = Some(policy);
        self
    }

    /// The policy the configuration `c` describes: [`DeviceFit`] with its keys applied, its
    /// expandable range no larger than the device.
    fn device_policy(c: &DeviceConfig, total: usize) -> DeviceFit {
        let mut p = match c.roundup_power2_divisions_by_size {
            Some(table) => DeviceFit::default().roundup_power2_divisions_by_size(table),
            None => DeviceFit::default().roundup_power2_divisions(c.roundup_power2_divisions),
        }
        .arena_reserve(total.next_multiple_of(2 << 20).max(2 << 20));
        if !c.expandable_segments {
            p = p.separate_segments();
        }
        if let Some(m) = c.max_split_size {
            p = p.max_split_size(m);
        }
        if let Some(t) = c.garbage_collection_threshold {
            p = p.garbage_collection_threshold(t);
        }
        p = match c.reserve_cap {
            Some(x) => p.reserve_cap(x),
            None => p.keep_free_memory(),
        };
        p.thread_cache(c.thread_cache)
    }

    /// Builds the allocator: for each device, its actors (on the tokio runtime), its cap,
    /// statistics and history.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a malformed `PINPOOL_DEVICE_CONF` (when no
    /// configuration was given), [`Error::InvalidLimit`] for a bad cap or fraction,
    /// [`Error::NoTokioRuntime`] outside a tokio runtime without a handle.
    pub fn build(self) -> Result<DeviceAllocator<R>, Error> {
        let config = self.resolved_config()?;
        let handle = match &self.handle {
            Some(h) => h.clone(),
            None => tokio::runtime::Handle::try_current().map_err(|_| Error::NoTokioRuntime)?,
        };
        let count = self.runtime.device_count();
        let mut devices = Vec::with_capacity(count);
        let mut totals = Vec::with_capacity(count);
        for d in 0..count {
            let (_, total) = self.runtime.device_memory_info(d)?;
            totals.push(total);
            let limit = match self.cap {
                Cap::None => match config.memory_fraction {
                    Some(f) => Some(super::allocator::fraction_of(f, total)?),
                    None => None,
                },
                Cap::Bytes(b) => Some(b),
                Cap::Fraction(f) => Some(super::allocator::fraction_of(f, total)?),
            };
            let policy: Arc<dyn SizePolicy> = match &self.policy {
                Some(p) => p.clone(),
                None => Arc::new(Self::device_policy(&config, total)),
            };
            let mut b = EngineBuilder::new(self.runtime.clone(), self.runtime.device_memory(d)?)
                .policy(policy)
                .stream_ordered(true)
                .lend_between_streams(self.lend_between_streams)
                .device_stats(config.max_split_size.unwrap_or(usize::MAX))
                .linger(config.linger)
                .handle(handle.clone());
            if let Some(l) = limit {
                b = b.max_bytes(l);
            }
            if let Some(t) = self.alloc_timeout {
                b = b.alloc_timeout(t);
            }
            if let Some(s) = self.shards {
                b = b.shards(s);
            }
            devices.push(b.build()?);
        }
        Ok(DeviceAllocator::from_inner(Inner {
            runtime: self.runtime,
            devices: devices.into_boxed_slice(),
            totals: totals.into_boxed_slice(),
            raw: RawTable::new(),
            config,
            ipc: OnceLock::new(),
            peers: PeerTable::new(count),
        }))
    }
}

#[cfg(test)]
mod tests {
    /// The documentation of `DeviceBuilder::config` names every key the parser takes (it
    /// named four of seven).
    #[test]
    fn the_config_call_documents_every_device_key() {
        let source = include_str!("builder.rs");
        let at = source.find("pub fn config(").expect("the config call");
        let doc_start = source[..at].rfind("\n\n").expect("the doc before it");
        let doc = &source[doc_start..at];
        for key in crate::config::DeviceConfig::KEYS {
            assert!(
                doc.contains(&format!("`{key}`")),
                "{key} missing from: {doc}"
            );
        }
    }
}

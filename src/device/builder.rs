//! `DeviceBuilder`: the settings of a [`DeviceAllocator`], checked when it is built; each
//! device's engine (its own actors, budget, statistics and history, as PyTorch keeps one
//! allocator per device) starts at the device's first use (see `devices`).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::actors::{Error, SizePolicy};

use super::allocator::{fraction_of, DeviceAllocator, Inner};
use super::devices::{Cap, Devices, Recipe};
use super::peer::PeerTable;
use super::raw::RawTable;
use super::runtime::DeviceRuntime;
use crate::config::{DeviceConfig, DEVICE_ENV_VAR};

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
/// let allocator = pinpool::DeviceAllocator::builder()
///     .memory_fraction(0.5) // at most half of each device
///     .alloc_timeout(Duration::from_secs(5))
///     .build()?;
/// assert_eq!(allocator.max_bytes(0)?, Some(8 << 30)); // half of the simulated 16 GiB
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

    /// Builds the allocator. Each device's engine (its actors on the tokio runtime, its cap,
    /// statistics and history) starts at the device's first use: a process that uses one
    /// device of several touches no other (on CUDA, retains no other device's context).
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
        if let Cap::Fraction(f) = self.cap {
            // Refused here, not at the device's start.
            fraction_of(f, usize::MAX)?;
        }
        let count = self.runtime.device_count();
        let devices = Devices::new(Recipe {
            runtime: self.runtime.clone(),
            config: config.clone(),
            cap: self.cap,
            policy: self.policy,
            lend_between_streams: self.lend_between_streams,
            alloc_timeout: self.alloc_timeout,
            shards: self.shards,
            handle,
        });
        Ok(DeviceAllocator::from_inner(Inner {
            runtime: self.runtime,
            devices,
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

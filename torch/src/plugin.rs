//! [`Plugin`]: what PyTorch's pluggable-allocator hooks ask, on one [`DeviceAllocator`].
//!
//! Owns the translation from PyTorch's terms (a device index as a C `int`, a stream as a raw
//! handle, a graph pool as a pair of integers) to pinpool's (a device ordinal, a runtime
//! stream, a [`PoolId`]), and the rules that PyTorch's callers rely on: size 0 gives a null
//! pointer and freeing null does nothing; an allocation freed from the per-thread default
//! stream waits for the legacy default stream before its reuse (see [`Plugin::free`]).
//! Everything else — caching, stream-ordered pools, capture pools, statistics — is the
//! allocator's. Generic over the runtime, so that the simulated one tests it.

use std::sync::Arc;

use pinpool::config::{ConfigError, DeviceConfig};
use pinpool::{DeviceAllocator, DeviceRuntime, Error, PoolId};

/// The plug-in's settings: the device allocator's defaults (the library and the plug-in
/// share one), with the keys `env` (the value of `PINPOOL_DEVICE_CONF`, if set) names set
/// over them, each key alone.
pub(crate) fn settings(env: Option<&str>) -> Result<DeviceConfig, ConfigError> {
    let defaults = DeviceConfig::default();
    match env {
        Some(text) => defaults.merged(text),
        None => Ok(defaults),
    }
}

/// The legacy default stream's handle (`cudaStreamLegacy` reads the same).
pub(crate) const LEGACY_STREAM: usize = 0;
/// `cudaStreamLegacy` / `CU_STREAM_LEGACY`: the legacy default stream, named explicitly.
pub(crate) const LEGACY_STREAM_NAMED: usize = 1;
/// `cudaStreamPerThread` / `CU_STREAM_PER_THREAD`: the calling thread's default stream.
pub(crate) const PER_THREAD_STREAM: usize = 2;

/// How raw stream handles become the runtime's streams, and back.
pub(crate) trait StreamMap<R: DeviceRuntime>: Send + Sync + 'static {
    /// The stream whose handle is `handle` on device `device` (an ordinal below the
    /// allocator's device count). Handles 0 and 2 name the legacy and the per-thread
    /// default streams of the device.
    fn stream(&self, device: usize, handle: usize) -> Result<R::Stream, Error>;

    /// The raw handle of `stream` (what a capture's stream filter is asked about).
    fn handle(&self, stream: &R::Stream) -> usize;
}

/// PyTorch's allocator hooks over a [`DeviceAllocator`]: alloc and free by raw pointer,
/// record_stream, empty_cache, the memory fraction, statistics, snapshots and graph pools.
pub(crate) struct Plugin<R: DeviceRuntime> {
    alloc: DeviceAllocator<R>,
    streams: Arc<dyn StreamMap<R>>,
}

impl<R: DeviceRuntime> Plugin<R> {
    /// The hooks over `alloc`, with `streams` to resolve stream handles (made by the CUDA
    /// plugin, and by the tests on the simulated runtime).
    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
    pub(crate) fn new(alloc: DeviceAllocator<R>, streams: Arc<dyn StreamMap<R>>) -> Self {
        // A child forked from now on is told apart (the allocator's threads are not there).
        crate::fork::arm();
        Self { alloc, streams }
    }

    /// The allocator underneath.
    pub(crate) fn allocator(&self) -> &DeviceAllocator<R> {
        &self.alloc
    }

    /// Device `device` as an ordinal of the allocator ([`Error::NoSuchDevice`] for a
    /// negative index or one past the last device).
    pub(crate) fn device(&self, device: i32) -> Result<usize, Error> {
        let count = self.alloc.device_count();
        match usize::try_from(device) {
            Ok(d) if d < count => Ok(d),
            _ => Err(Error::NoSuchDevice {
                ordinal: usize::try_from(device).unwrap_or(usize::MAX),
                count,
            }),
        }
    }

    fn stream(&self, device: usize, handle: usize) -> Result<R::Stream, Error> {
        // `cudaStreamLegacy` is the legacy default stream: one pool for both of its names.
        let handle = if handle == LEGACY_STREAM_NAMED {
            LEGACY_STREAM
        } else {
            handle
        };
        self.streams.stream(device, handle)
    }

    /// PyTorch's `alloc(size, device, stream)`: `size` bytes on `device` for work on the
    /// stream `handle`, as an address. Size 0 gives 0 (PyTorch's own allocator returns a
    /// null pointer for it too). A request that does not fit under the cap (the memory
    /// fraction) fails at once instead of waiting for memory to come back, as PyTorch's own
    /// allocator fails it. Errors: [`Error::NoSuchDevice`], [`Error::OutOfMemory`].
    pub(crate) fn alloc(&self, size: usize, device: i32, handle: usize) -> Result<usize, Error> {
        let device = self.device(device)?;
        if size == 0 {
            return Ok(0);
        }
        let stream = self.stream(device, handle)?;
        Ok(self.alloc.try_raw_alloc_with_stream(size, &stream)? as usize)
    }

    /// PyTorch's `free(ptr, size, device, stream)`, with the stream of the allocation.
    /// Null is a no-op; an address [`Plugin::alloc`] did not return (or one already freed)
    /// is [`Error::UnknownPointer`] and changes nothing.
    ///
    /// The per-thread default stream has one handle on every thread, so its blocks share
    /// one pool, though each thread's stream runs on its own: a block freed from it first
    /// records the legacy default stream, whose work waits for all earlier work of every
    /// blocking stream, so that no other thread reuses the block before the work queued
    /// on it has run.
    pub(crate) fn free(&self, ptr: usize, device: i32, handle: usize) -> Result<(), Error> {
        if ptr == 0 {
            return Ok(());
        }
        if handle == PER_THREAD_STREAM {
            let legacy = self.stream(self.device(device)?, LEGACY_STREAM)?;
            self.alloc.raw_record_stream(ptr as u64, &legacy)?;
        }
        self.alloc.raw_delete(ptr as u64)
    }

    /// `Tensor.record_stream`: the block at `ptr` (of device `device`) is not reused before
    /// the work queued on stream `handle` until its free has run.
    pub(crate) fn record_stream(
        &self,
        ptr: usize,
        device: i32,
        handle: usize,
    ) -> Result<(), Error> {
        let stream = self.stream(self.device(device)?, handle)?;
        self.alloc.raw_record_stream(ptr as u64, &stream)
    }

    /// `torch.cuda.empty_cache`: gives every cached block of every device back.
    pub(crate) fn empty_cache(&self) -> Result<(), Error> {
        self.alloc.empty_cache_blocking().map(drop)
    }

    /// `torch.cuda.set_per_process_memory_fraction`: caps `device` at `fraction` of its
    /// memory ([`Error::InvalidLimit`] unless it is in (0, 1]).
    pub(crate) fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), Error> {
        self.alloc
            .set_memory_fraction(fraction, self.device(device)?)
    }

    /// `torch.cuda.memory_stats(device)` as a JSON object with PyTorch's flat keys
    /// (`allocated_bytes.all.current`, `reserved_bytes.all.peak`, `num_ooms`, …), and
    /// pinpool's own counts: `num_device_remaps` (map calls moved within a range) and
    /// `num_misses` (requests that asked a pool actor), `miss_wait_ns` (the time they
    /// spent on it), `miss_serve_ns` (the pool actors' share of it), and the entry points'
    /// call times where they are counted (see `call_times`).
    pub(crate) fn memory_stats_json(&self, device: i32) -> Result<String, Error> {
        let map = self.stats_map(device)?;
        let mut out = String::from("{");
        for (i, (k, v)) in map.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            // The keys are ASCII names with dots: nothing to escape.
            out.push_str(&format!("\"{k}\": {v}"));
        }
        out.push('}');
        Ok(out)
    }

    /// The values of [`Plugin::memory_stats_json`]'s keys named in `keys`, in their order (0
    /// for a key it does not have): what PyTorch's own `torch.cuda.memory_stats` gets through
    /// the shim's allocator front.
    pub(crate) fn stats_values(&self, device: i32, keys: &[&str]) -> Result<Vec<i64>, Error> {
        let map = self.stats_map(device)?;
        Ok(keys
            .iter()
            .map(|k| map.get(*k).copied().unwrap_or(0))
            .collect())
    }

    fn stats_map(&self, device: i32) -> Result<std::collections::BTreeMap<String, i64>, Error> {
        let stats = self.alloc.stats(self.device(device)?)?;
        let mut map = stats.to_map();
        map.insert("num_device_remaps".into(), stats.num_device_remaps);
        map.insert("num_misses".into(), stats.num_misses);
        map.insert("miss_wait_ns".into(), stats.miss_wait_ns);
        map.insert("miss_serve_ns".into(), stats.miss_serve_ns);
        for (k, v) in crate::call_times::report() {
            map.insert(k.into(), v);
        }
        Ok(map)
    }

    /// The largest request `device` could serve now, for PyTorch's `cacheInfo` (cuDNN's
    /// algorithm search tries workspaces up to it): the device's free memory and the bytes
    /// its pools hold unused, within the cap. An estimate from above: a larger workspace
    /// than fits fails as an out-of-memory, which the search catches.
    pub(crate) fn largest_block(&self, device: i32) -> Result<usize, Error> {
        let d = self.device(device)?;
        let stats = self.alloc.stats(d)?;
        let (free, _) = self.alloc.memory_info(d)?;
        let allocated = stats.allocated_bytes.all.current.max(0) as usize;
        let reserved = stats.reserved_bytes.all.current.max(0) as usize;
        let largest = free.saturating_add(reserved.saturating_sub(allocated));
        Ok(match stats.limit_bytes {
            Some(limit) => largest.min((limit.max(0) as usize).saturating_sub(allocated)),
            None => largest,
        })
    }

    /// Bytes device `device`'s pools hold of it (`torch.cuda.memory_reserved`).
    pub(crate) fn reserved_bytes(&self, device: i32) -> Result<usize, Error> {
        self.alloc.reserved_bytes(self.device(device)?)
    }

    /// PyTorch's `enablePeerAccess(device, peer)` (made before its first copy between two
    /// GPUs): `device` may access `peer`'s memory, the memory `peer`'s pools mapped before
    /// the call included.
    pub(crate) fn enable_peer_access(&self, device: i32, peer: i32) -> Result<(), Error> {
        let (device, peer) = (self.device(device)?, self.device(peer)?);
        self.alloc.enable_peer_access(device, peer)
    }

    /// `torch.cuda.reset_peak_memory_stats(device)`.
    pub(crate) fn reset_peak_stats(&self, device: i32) -> Result<(), Error> {
        self.alloc.reset_peak_stats(self.device(device)?)
    }

    /// `torch.cuda.reset_accumulated_memory_stats(device)`.
    pub(crate) fn reset_accumulated_stats(&self, device: i32) -> Result<(), Error> {
        self.alloc.reset_accumulated_stats(self.device(device)?)
    }

    /// `torch.cuda.memory._snapshot()` pickled, as `_dump_snapshot` writes it.
    pub(crate) async fn pickle_snapshot(&self) -> Result<Vec<u8>, Error> {
        self.alloc.pickle_snapshot().await
    }

    /// PyTorch's `beginAllocateToPool(device, mempool_id, filter)`: until
    /// [`Plugin::end_allocate_to_pool`], requests on `device` for streams whose handle
    /// `filter` accepts come from the graph pool `pool`.
    pub(crate) fn begin_allocate_to_pool(
        &self,
        device: i32,
        pool: (u64, u64),
        filter: impl Fn(usize) -> bool + Send + Sync + 'static,
    ) -> Result<(), Error> {
        let device = self.device(device)?;
        let streams = self.streams.clone();
        self.alloc
            .begin_allocate_to_pool_blocking(device, pool_id(pool), move |s| {
                filter(streams.handle(s))
            })
    }

    /// PyTorch's `endAllocateToPool(device, mempool_id)`.
    pub(crate) fn end_allocate_to_pool(&self, device: i32, pool: (u64, u64)) -> Result<(), Error> {
        self.alloc
            .end_allocate_to_pool_blocking(self.device(device)?, pool_id(pool))
    }

    /// PyTorch's `releasePool(device, mempool_id)`; the pool's memory goes back at the next
    /// empty_cache once every use is released.
    pub(crate) fn release_pool(&self, device: i32, pool: (u64, u64)) -> Result<(), Error> {
        self.alloc
            .release_pool_blocking(self.device(device)?, pool_id(pool))
    }
}

/// The pool that PyTorch's `MempoolId_t` `(a, b)` names. PyTorch numbers the pools that
/// graphs make for themselves `(n, 0)` and those of `graph_pool_handle()` / `MemPool`
/// `(0, n)`, each from a counter; both map above `2^62`, clear of [`PoolId::fresh`]'s ids.
/// `(0, 0)` is the default pool (`tests::pool_ids_of_graphs_and_of_user_pools_never_collide`).
/// Bits of the pool ids made from PyTorch's `MempoolId_t`s: every such id has `TOP`; a
/// user pool's (`(0, n)`) also `USER`; a pair with both halves set also `MIXED`.
const TOP: u64 = 1 << 63;
const USER: u64 = 1 << 62;
const MIXED: u64 = 1 << 61;

pub(crate) fn pool_id((a, b): (u64, u64)) -> PoolId {
    const MASK: u64 = USER - 1;
    match (a, b) {
        (0, 0) => PoolId::DEFAULT,
        (0, n) => PoolId(TOP | USER | (n & MASK)),
        (n, 0) => PoolId(TOP | (n & MASK)),
        (a, b) => PoolId(TOP | USER | MIXED | ((a << 30) ^ b) & (MIXED - 1)),
    }
}

/// The `MempoolId_t` that [`pool_id`] made `id` from: exact for the pools PyTorch makes
/// (`(n, 0)` for graphs, `(0, n)` for user pools, below 2^61); `(0, id)` for the rest.
pub(crate) fn torch_pool_id(id: u64) -> (u64, u64) {
    match id {
        0 => (0, 0),
        _ if id & (TOP | USER | MIXED) == TOP | USER => (0, id & (USER - 1)),
        _ if id & (TOP | USER) == TOP => (id & (USER - 1), 0),
        _ => (0, id),
    }
}

//! `DeviceAllocator`: the public face of device-memory caching.
//!
//! A cheap `Clone + Send + Sync` handle on one engine per device (see `builder`). Every
//! request names the stream it is for; the stream's device picks the engine, and within it
//! the stream's own pool (the engine is stream-ordered): a buffer freed with no other stream
//! recorded is reusable by its stream at once, with no event. Dropping the last handle
//! closes the engines; each block goes back to its device once its buffer drops (after its
//! events, if any).

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::actors::{
    BaseAllocation, CacheInfo, DeviceStats, EmptyReport, Engine, Error, History, HistoryContext,
    HistorySetting, Lease, MemorySnapshot, OomCause, OomReport, PoolId, RawLease, TraceAction,
    TraceEntry, Wait,
};

use super::buffer::{tie_to_stream, DeviceBuffer};
use super::builder::DeviceBuilder;
use super::devices::Devices;
use super::ipc::IpcRegistry;
use super::peer::PeerTable;
use super::raw::RawTable;
use super::runtime::DeviceRuntime;
use crate::config::DeviceConfig;
use crate::sim::SimRuntime;

pub(crate) struct Inner<R: DeviceRuntime> {
    pub(crate) runtime: Arc<R>,
    /// Each device's engine, started at the device's first use.
    pub(crate) devices: Devices<R>,
    pub(crate) raw: RawTable<RawLease<R>>,
    pub(crate) config: DeviceConfig,
    /// Segments of other processes opened here (started on the first open).
    pub(crate) ipc: OnceLock<IpcRegistry>,
    /// Which pairs of devices have peer access.
    pub(crate) peers: PeerTable,
}

impl<R: DeviceRuntime> Drop for Inner<R> {
    fn drop(&mut self) {
        // Raw buffers never deleted go back with the allocator.
        drop(self.raw.drain());
    }
}

/// A caching allocator for device memory, one pool per (device, stream), in the manner of
/// PyTorch's `CUDACachingAllocator`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), pinpool::Error> {
/// use pinpool::DeviceAllocator;
///
/// let allocator = DeviceAllocator::builder().build()?; // the simulated device
/// let stream = allocator.runtime().new_stream()?;
/// let buf = allocator.alloc(1 << 20, &stream).await?; // fresh memory the first time
/// let ptr = buf.device_ptr();
/// drop(buf); // no other stream used it: reusable by `stream` at once
/// let again = allocator.alloc(1 << 20, &stream).await?; // the cached path
/// assert_eq!(again.device_ptr(), ptr);
/// assert_eq!(allocator.stats(0)?.num_device_alloc, 1);
/// # Ok(()) }
/// ```
pub struct DeviceAllocator<R: DeviceRuntime = SimRuntime> {
    inner: Arc<Inner<R>>,
}

impl<R: DeviceRuntime> Clone for DeviceAllocator<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl DeviceAllocator<SimRuntime> {
    /// A builder, on a simulated runtime with one 16 GiB device until told otherwise.
    pub fn builder() -> DeviceBuilder<SimRuntime> {
        DeviceBuilder::new(Arc::new(SimRuntime::new()))
    }
}

/// The cap that `fraction` of a device of `total` bytes gives.
pub(crate) fn fraction_of(fraction: f64, total: usize) -> Result<usize, Error> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(Error::InvalidLimit {
            reason: format!("memory fraction {fraction} is not in (0, 1]"),
        });
    }
    let bytes = (total as f64 * fraction) as usize;
    if bytes == 0 {
        return Err(Error::InvalidLimit {
            reason: format!("memory fraction {fraction} of {total} bytes is 0 bytes"),
        });
    }
    Ok(bytes)
}

impl<R: DeviceRuntime> DeviceAllocator<R> {
    pub(crate) fn from_inner(inner: Inner<R>) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }

    pub(crate) fn inner(&self) -> &Inner<R> {
        &self.inner
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<R> {
        &self.inner.runtime
    }

    /// The configuration the allocator was built with.
    pub fn config(&self) -> &DeviceConfig {
        &self.inner.config
    }

    /// How many devices the allocator serves.
    pub fn device_count(&self) -> usize {
        self.inner.devices.count()
    }

    /// The engines of the devices started so far, by ordinal.
    pub(super) fn engines(&self) -> impl Iterator<Item = &Engine<R>> {
        self.inner.devices.engines()
    }

    /// The engine of device `device`, started now if it was not
    /// ([`crate::tuning::device_engine`] for tools).
    pub(crate) fn engine(&self, device: usize) -> Result<&Engine<R>, Error> {
        self.inner.devices.get(device).map(|d| &d.engine)
    }

    /// The engine of device `device` if it has started, without starting it.
    fn started(&self, device: usize) -> Result<Option<&Engine<R>>, Error> {
        Ok(self.inner.devices.started(device)?.map(|d| &d.engine))
    }

    /// The engine of the device `stream` runs on, for a request of `size` bytes: one larger
    /// than the device is refused at once, with nothing touched.
    pub(crate) fn engine_of(
        &self,
        stream: &R::Stream,
        size: usize,
    ) -> Result<(usize, &Engine<R>), Error> {
        let d = self.inner.runtime.stream_device(stream);
        let device = self.inner.devices.get(d)?;
        let engine = &device.engine;
        if size > device.total {
            return Err(engine.refused(Error::OutOfMemory {
                requested: size,
                reserved: engine.reserved_bytes(),
                limit: None,
                cause: OomCause::ExceedsDevice,
            }));
        }
        Ok((d, engine))
    }

    /// Allocates `size` bytes for work on `stream`, on the stream's device. A size that
    /// stream used before is served from its cache without a round trip to any actor; 0
    /// gives an empty buffer. Under a cap ([`DeviceBuilder::max_bytes`]) a request that
    /// does not fit waits, first come first served, until buffers come back (up to
    /// [`DeviceBuilder::alloc_timeout`]); when the device itself is out of memory, the
    /// caches are emptied and the request tried once more before it fails with
    /// [`Error::OutOfMemory`] (and the OOM observers hear of it). Cancel-safe.
    pub async fn alloc(&self, size: usize, stream: &R::Stream) -> Result<DeviceBuffer<R>, Error> {
        self.alloc_with(size, stream, Wait::Default).await
    }

    /// [`DeviceAllocator::alloc`], waiting at most `timeout` for room under the cap.
    pub async fn alloc_timeout(
        &self,
        size: usize,
        stream: &R::Stream,
        timeout: Duration,
    ) -> Result<DeviceBuffer<R>, Error> {
        self.alloc_with(size, stream, Wait::Upto(timeout)).await
    }

    /// Allocates without ever waiting for other buffers to come back: where `alloc` would
    /// wait at the cap, this fails at once with [`Error::OutOfMemory`].
    pub async fn try_alloc(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<DeviceBuffer<R>, Error> {
        self.alloc_with(size, stream, Wait::Never).await
    }

    async fn alloc_with(
        &self,
        size: usize,
        stream: &R::Stream,
        wait: Wait,
    ) -> Result<DeviceBuffer<R>, Error> {
        let (d, engine) = self.engine_of(stream, size)?;
        let lease = engine.alloc_with(size, Some(stream), wait).await?;
        Ok(DeviceBuffer::new(lease, stream.clone(), d))
    }

    /// [`DeviceAllocator::alloc`] for threads outside the tokio runtime: blocks the calling
    /// thread on a miss (and while it waits for room). On a thread that runs a
    /// current-thread runtime's tasks it fails at once with [`Error::WouldDeadlock`],
    /// whether or not the request would have missed; on a multi-thread runtime's threads it
    /// blocks inside `block_in_place` ([blocking calls](crate#blocking-calls)).
    pub fn alloc_blocking(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<DeviceBuffer<R>, Error> {
        self.alloc_blocking_with(size, stream, Wait::Default)
    }

    /// [`DeviceAllocator::alloc_blocking`], waiting at most `timeout` for room.
    pub fn alloc_blocking_timeout(
        &self,
        size: usize,
        stream: &R::Stream,
        timeout: Duration,
    ) -> Result<DeviceBuffer<R>, Error> {
        self.alloc_blocking_with(size, stream, Wait::Upto(timeout))
    }

    /// [`DeviceAllocator::try_alloc`] for threads outside the tokio runtime.
    pub fn try_alloc_blocking(
        &self,
        size: usize,
        stream: &R::Stream,
    ) -> Result<DeviceBuffer<R>, Error> {
        self.alloc_blocking_with(size, stream, Wait::Never)
    }

    /// The blocking request, named in a refusal after the call the user made.
    fn alloc_blocking_with(
        &self,
        size: usize,
        stream: &R::Stream,
        wait: Wait,
    ) -> Result<DeviceBuffer<R>, Error> {
        let call = match wait {
            Wait::Default => ("alloc_blocking", "alloc(..).await"),
            Wait::Upto(_) => ("alloc_blocking_timeout", "alloc_timeout(..).await"),
            Wait::Never => ("try_alloc_blocking", "try_alloc(..).await"),
        };
        let (d, engine) = self.engine_of(stream, size)?;
        let lease = engine.alloc_blocking_with(size, Some(stream), wait, call)?;
        Ok(DeviceBuffer::new(lease, stream.clone(), d))
    }

    /// PyTorch's `raw_alloc_with_stream`: allocates `size` bytes for `stream` and returns
    /// only the device address (0 for `size` 0), for code that holds pointers. Give it back
    /// with [`DeviceAllocator::raw_delete`]; whatever is never given back goes back with
    /// the allocator. Blocks the calling thread on a miss, as `alloc_blocking` does, and
    /// fails with [`Error::WouldDeadlock`] where `alloc_blocking` does (from async code, take
    /// a [`DeviceBuffer`] with `alloc(..).await`: its [`DeviceBuffer::device_ptr`] is the
    /// address).
    pub fn raw_alloc_with_stream(&self, size: usize, stream: &R::Stream) -> Result<u64, Error> {
        let call = (
            "raw_alloc_with_stream",
            "alloc(..).await (its DeviceBuffer's device_ptr() is the address)",
        );
        self.raw_alloc_with(size, stream, Wait::Default, call)
    }

    /// [`DeviceAllocator::raw_alloc_with_stream`] that never waits for other buffers to come
    /// back: where that would wait at the cap, this fails at once with
    /// [`Error::OutOfMemory`] (PyTorch's allocator fails such a request at once too).
    pub fn try_raw_alloc_with_stream(&self, size: usize, stream: &R::Stream) -> Result<u64, Error> {
        let call = (
            "try_raw_alloc_with_stream",
            "try_alloc(..).await (its DeviceBuffer's device_ptr() is the address)",
        );
        self.raw_alloc_with(size, stream, Wait::Never, call)
    }

    fn raw_alloc_with(
        &self,
        size: usize,
        stream: &R::Stream,
        wait: Wait,
        call: (&'static str, &'static str),
    ) -> Result<u64, Error> {
        if size == 0 {
            return Ok(0);
        }
        let (_, engine) = self.engine_of(stream, size)?;
        let lease = engine.alloc_blocking_with(size, Some(stream), wait, call)?;
        // Only a request of 0 bytes gets an empty lease.
        Ok(self.file_raw(lease, stream).unwrap_or(0))
    }

    /// Files `lease`, lent for work on `stream`, in the table of raw pointers, and returns its
    /// address (`None`: an empty lease, which holds nothing to file).
    pub(crate) fn file_raw(&self, mut lease: Lease<R>, stream: &R::Stream) -> Option<u64> {
        tie_to_stream(&mut lease, stream);
        let raw = lease.into_raw().ok()?;
        let ptr = raw.as_ptr() as usize;
        self.inner.raw.insert(ptr, raw);
        Some(ptr as u64)
    }

    /// PyTorch's `raw_delete`: frees what `raw_alloc_with_stream` returned (0 is a no-op).
    /// An address it did not return, or one already deleted, is
    /// [`Error::UnknownPointer`] and changes nothing.
    pub fn raw_delete(&self, ptr: u64) -> Result<(), Error> {
        if ptr == 0 {
            return Ok(());
        }
        // Dropping the raw lease is the free.
        self.inner
            .raw
            .remove(ptr as usize)
            .map(drop)
            .ok_or(Error::UnknownPointer { ptr })
    }

    /// Records `stream` on a raw allocation (PyTorch's `recordStream` for raw pointers):
    /// its reuse waits for the stream's work enqueued before it is deleted. The allocation
    /// stays in the table of raw pointers meanwhile: a `raw_record_stream` or `raw_delete`
    /// of the same address on another thread waits for this one and then finds it.
    pub fn raw_record_stream(&self, ptr: u64, stream: &R::Stream) -> Result<(), Error> {
        self.inner
            .raw
            .with(ptr as usize, |raw| raw.record_stream(stream))
            .ok_or(Error::UnknownPointer { ptr })?
    }

    /// Records `stream` on `buf` after checking that this allocator lent it
    /// ([`Error::ForeignBuffer`] otherwise, and nothing changes).
    pub fn record_stream(
        &self,
        buf: &mut DeviceBuffer<R>,
        stream: &R::Stream,
    ) -> Result<(), Error> {
        let engine = self.engine(buf.device())?;
        engine.record_stream(buf.lease_mut(), stream)
    }

    /// Frees every cached block of every device (blocks in use or waiting on events are
    /// untouched). The pools also forget what they learned from requests (the peak of live
    /// bytes that sizes fresh memory, the ranges sizes last used): the requests that follow
    /// take memory as they would from fresh pools.
    pub async fn empty_cache(&self) -> Result<EmptyReport, Error> {
        let mut total = EmptyReport::default();
        for e in self.engines() {
            total.merge(&e.empty_cache().await?);
        }
        Ok(total)
    }

    /// [`DeviceAllocator::empty_cache`] for threads outside the tokio runtime
    /// ([`Error::WouldDeadlock`] where blocking would deadlock).
    pub fn empty_cache_blocking(&self) -> Result<EmptyReport, Error> {
        crate::actors::blocking::call(
            ("empty_cache_blocking", "empty_cache().await"),
            self.empty_cache(),
        )?
    }

    /// Statistics of device `device`, with the keys of `torch.cuda.memory_stats()`.
    /// Counts all zero for a device not used yet.
    pub fn stats(&self, device: usize) -> Result<DeviceStats, Error> {
        if let Some(stats) = self.started(device)?.and_then(|e| e.device_stats()) {
            return Ok(stats);
        }
        let mut unused = DeviceStats::default();
        unused.max_split_size = self.inner.config.max_split_size.map(|m| m as i64);
        Ok(unused)
    }

    /// Sets every peak statistic of device `device` to its current value.
    pub fn reset_peak_stats(&self, device: usize) -> Result<(), Error> {
        if let Some(e) = self.started(device)? {
            e.reset_peak_stats();
        }
        Ok(())
    }

    /// Zeroes the accumulated statistics of device `device`.
    pub fn reset_accumulated_stats(&self, device: usize) -> Result<(), Error> {
        if let Some(e) = self.started(device)? {
            e.reset_accumulated_stats();
        }
        Ok(())
    }

    /// The cap on device `device`'s reserved bytes, if any.
    pub fn max_bytes(&self, device: usize) -> Result<Option<usize>, Error> {
        Ok(self.engine(device)?.max_bytes())
    }

    /// Sets (`Some`) or lifts (`None`) the cap of device `device` while running; lowering it
    /// frees nothing by itself, raising it lets waiting requests in.
    pub fn set_max_bytes(&self, device: usize, bytes: Option<usize>) -> Result<(), Error> {
        self.engine(device)?.set_max_bytes(bytes)
    }

    /// Sets the cap of device `device` to `fraction` of its memory
    /// ([`Error::InvalidLimit`] unless `fraction` is in (0, 1]; nothing changes then).
    pub fn set_memory_fraction(&self, fraction: f64, device: usize) -> Result<(), Error> {
        let engine = self.engine(device)?;
        let (_, total) = self.inner.runtime.device_memory_info(device)?;
        engine.set_max_bytes(Some(fraction_of(fraction, total)?))
    }

    /// Bytes device `device`'s pools reserve (what the cap limits).
    pub fn reserved_bytes(&self, device: usize) -> Result<usize, Error> {
        Ok(self.started(device)?.map_or(0, |e| e.reserved_bytes()))
    }

    /// Free and total bytes of device `device`, as its driver reports them.
    pub fn memory_info(&self, device: usize) -> Result<(usize, usize), Error> {
        self.started(device)?;
        self.inner.runtime.device_memory_info(device)
    }

    /// Every segment and block of every device (address, size, requested size, state,
    /// stream, device) and the configuration in force; serializable with serde. (Before any
    /// device is used, device 0 starts, for its configuration.)
    pub async fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        if self.engines().next().is_none() {
            self.engine(0)?;
        }
        let mut all: Option<MemorySnapshot> = None;
        for e in self.engines() {
            let s = e.snapshot().await?;
            match &mut all {
                None => all = Some(s),
                Some(a) => {
                    a.segments.extend(s.segments);
                    a.reserved_bytes += s.reserved_bytes;
                }
            }
        }
        let mut all = all.ok_or(Error::Shutdown)?;
        all.segments.sort_by_key(|s| (s.device, s.address));
        Ok(all)
    }

    /// The largest cached block and the bytes cached on device `device`.
    pub async fn cache_info(&self, device: usize) -> Result<CacheInfo, Error> {
        match self.started(device)? {
            Some(e) => e.cache_info().await,
            None => Ok(CacheInfo::default()),
        }
    }

    /// The segment that holds device address `ptr`, on any device, or `None`.
    pub async fn base_allocation(&self, ptr: u64) -> Result<Option<BaseAllocation>, Error> {
        for e in self.engines() {
            if let Some(b) = e.base_allocation(ptr as usize as *const u8).await? {
                return Ok(Some(b));
            }
        }
        Ok(None)
    }

    /// Whether the blocks in use in `pool` of device `device` start exactly at the
    /// `expected` device addresses (PyTorch's `_cuda_checkPoolLiveAllocations`).
    pub fn check_pool_live_allocations(
        &self,
        device: usize,
        pool: PoolId,
        expected: &[u64],
    ) -> impl Future<Output = Result<bool, Error>> + Send + '_ {
        let ptrs: Vec<*const u8> = expected.iter().map(|&p| p as usize as *const u8).collect();
        let check = self
            .engine(device)
            .map(|e| e.check_pool_live_allocations(pool, &ptrs));
        async move { check?.await }
    }

    /// Turns history recording on or off on every device (see
    /// [`PinnedAllocator::record_history`](crate::PinnedAllocator::record_history)).
    pub fn record_history(
        &self,
        enabled: bool,
        max_entries: usize,
        context: HistoryContext,
    ) -> Result<(), Error> {
        let setting = HistorySetting::new(enabled, max_entries, context);
        self.inner.devices.record_history(setting)
    }

    /// [`Self::record_history`], and, as PyTorch's `clear_history` and `skip_actions`: with
    /// `clear`, the entries recorded so far are forgotten; entries of the `skip` actions are
    /// left out of the history (trace trackers still get them) until the next call.
    #[doc(hidden)]
    pub fn record_history_with(
        &self,
        enabled: bool,
        max_entries: usize,
        context: HistoryContext,
        clear: bool,
        skip: &[TraceAction],
    ) -> Result<(), Error> {
        let setting = HistorySetting::new(enabled, max_entries, context).with(clear, skip);
        self.inner.devices.record_history(setting)
    }

    /// Adds a `UserDefined` entry named `name` to every device's history (a device not used
    /// yet records it when it starts).
    pub fn record_annotation(&self, name: &str) {
        self.inner.devices.annotate(name);
    }

    /// The recorded history of device `device` (none for a device not used yet).
    pub async fn history(&self, device: usize) -> Result<History, Error> {
        match self.started(device)? {
            Some(e) => e.history().await,
            None => Ok(self.unused_history()),
        }
    }

    /// The history of a device not used yet: no entries, the setting in force.
    fn unused_history(&self) -> History {
        let mut h = History::default();
        if let Some(HistorySetting {
            enabled,
            max_entries,
            ..
        }) = self.inner.devices.history_setting()
        {
            (h.enabled, h.max_entries) = (enabled, max_entries);
        }
        h
    }

    /// [`DeviceAllocator::history`] for threads outside the tokio runtime.
    pub fn history_blocking(&self, device: usize) -> Result<History, Error> {
        crate::actors::blocking::call(
            ("history_blocking", "history().await"),
            self.history(device),
        )?
    }

    /// The history page of device `device` (see [`crate::report::render_history_html`]).
    pub async fn history_html(&self, device: usize) -> Result<String, Error> {
        let h = self.history(device).await?;
        Ok(crate::report::render_history_html(
            &h,
            &format!("pinpool device {device}"),
        ))
    }

    /// Calls `f` for every trace entry recorded on any device while history is on.
    pub fn attach_trace_tracker(&self, f: impl Fn(&TraceEntry) + Send + Sync + 'static) {
        let f = Arc::new(f);
        self.inner.devices.attach(move |e| {
            let f = f.clone();
            e.attach_trace_tracker(move |t| f(t));
        });
    }

    /// Calls `f` for every request that fails for want of device memory, with the report
    /// (device, bytes requested, reserved and in use, the cap, and what the driver still had
    /// free).
    pub fn attach_oom_observer(&self, f: impl Fn(&OomReport) + Send + Sync + 'static) {
        let f = Arc::new(f);
        self.inner.devices.attach(move |e| {
            let f = f.clone();
            e.attach_oom_observer(move |r| f(r));
        });
    }
}

impl<R: DeviceRuntime> std::fmt::Debug for DeviceAllocator<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceAllocator")
            .field("runtime", &self.inner.runtime.name())
            .field("devices", &self.inner.devices.count())
            .finish_non_exhaustive()
    }
}

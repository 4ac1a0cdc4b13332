//! The simulated CUDA runtime: [`SimRuntime`] is a [`Runtime`] of heap
//! memory, simulated devices ([`SimDeviceBuffer`]) and software streams ([`SimStream`]),
//! whose operations run in order on a thread of their own. It is the default on machines
//! without a GPU, and the runtime the allocators are tested on.
//!
//! Misuse is made detectable: a copy whose host bytes changed between enqueue and execution
//! (early reuse), a kernel or copy that touches device memory another stream wrote after it
//! was enqueued, a `host_free` of memory still referenced by queued work, or of memory the
//! runtime never gave out, is counted in [`SimRuntime::violations`] and described in
//! [`SimRuntime::violation_log`]. [`Faults`] make chosen calls fail, for tests of error
//! paths.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pinpool::Error> {
//! let allocator = pinpool::PinnedAllocator::builder().build()?; // on a SimRuntime
//! let stream = allocator.runtime().new_stream()?;
//! let mut buf = allocator.alloc(4096).await?;
//! buf.fill(1);
//! buf.record_stream(&stream)?;
//! drop(buf); // reused only once the stream's work is done
//! assert_eq!(allocator.runtime().violations(), 0);
//! # Ok(()) }
//! ```

// This module owns the runtime handle and its counters; the parts live in one module per
// concept: `builder` (the machine's shape), `host` (host memory and the runtime as a memory
// source), `device_books` (each device's use and streams), `memory` (zeroed, page-aligned heap allocations and atomic byte
// access), `ledger` (the actor that owns the registry of live allocations and the
// violation log), `stream` and `worker` (streams and the thread that runs each one's
// operations in order), `event` (events as marker operations), `graph` (stream capture and
// graph replay), `device` (simulated device buffers), `fault` (fault injection), `violation`
// (misuse records), `write_map` (which stream last wrote each unit of device memory). No
// locks are used: shared state is atomics, and the allocation registry has a single owner
// thread.

mod builder;
mod device;
mod device_books;
mod device_memory;
mod error;
mod event;
mod expandable;
mod fault;
mod graph;
mod host;
mod ledger;
mod memory;
mod rng;
mod stream;
mod violation;
mod worker;
mod write_map;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::actors::{Origin, Region, Runtime, RuntimeError, StreamId};

pub use builder::{SimRuntimeBuilder, DEFAULT_DEVICE_CAPACITY};
pub use device::SimDeviceBuffer;
pub(crate) use device_books::DeviceState;
pub(crate) use device_memory::SimDeviceMemory;
pub use error::SimError;
pub use event::SimEvent;
pub use fault::{FaultPoint, Faults};
pub use graph::SimGraph;
pub(crate) use host::count_memory_call;
pub use memory::HOST_ALIGN;
pub use stream::{HoldGuard, SimStream};
pub use violation::{Violation, ViolationKind};

use ledger::Ledger;
use memory::{atomic_bytes, HostAllocation};

/// State shared by the runtime handles, its streams and their workers: atomics, and handles
/// to the ledger actor.
pub(crate) struct Shared {
    ledger: Ledger,
    faults: Faults,
    live_allocations: AtomicU64,
    live_bytes: AtomicUsize,
    total_host_allocs: AtomicU64,
    total_host_frees: AtomicU64,
    /// Granules moved by `RangeCall::Move`.
    host_remaps: AtomicU64,
    /// Waits of one stream on another's event (`Runtime::stream_wait_event`).
    stream_waits: AtomicU64,
    events_recorded: AtomicU64,
    events_released: AtomicU64,
    violations: AtomicU64,
    host_alloc_latency_ns: AtomicU64,
    random_delay_seed: AtomicU64,
    random_delay_max_ns: AtomicU64,
    memory_limit: AtomicUsize,
    /// Whether `host_granularity` (and the devices' `granularity`) offer expandable memory.
    expandable: bool,
    /// The simulated devices' books.
    devices: Box<[DeviceState]>,
    /// Whether the devices can access each other's memory (peer access).
    peer_access: bool,
    /// Which peers reach each device's mapped memory (a copy between devices checks it).
    pub(crate) mapped_access: crate::device::MappedAccess,
    /// Never sent on; disconnects when the last `SimRuntime` handle drops, ending hangs.
    lifeline: flume::Receiver<()>,
}

impl Shared {
    /// Counts a violation and logs its description.
    pub(crate) fn report(&self, kind: ViolationKind, stream: Option<StreamId>, message: String) {
        self.violations.fetch_add(1, Ordering::SeqCst);
        tracing::warn!(?kind, stream = stream.map(|s| s.0), %message, "sim violation");
        self.ledger.report(Violation {
            kind,
            stream,
            message,
        });
    }

    /// Takes `region` out of the ledger, for a free made as `op`: the allocation it names
    /// (`None` when it was not obtained as `method`, or is not in the ledger). Host and
    /// device frees both look their memory up here.
    pub(crate) fn remove_freed(
        &self,
        op: &'static str,
        region: &Region,
        method: Origin,
    ) -> Result<Option<Arc<HostAllocation>>, RuntimeError> {
        if region.method != method {
            return Ok(None);
        }
        self.ledger
            .remove(region.addr(), region.size)
            .map_err(|e| e.into_runtime(op))
    }

    /// Records a violation when memory is given back while queued operations or live
    /// graphs still hold `alloc` (the ledger's reference was dropped: any other is a
    /// user). `what` says what was given back and how, as the message starts.
    pub(crate) fn report_freed_in_use(
        &self,
        alloc: &Arc<HostAllocation>,
        what: std::fmt::Arguments<'_>,
    ) {
        let users = Arc::strong_count(alloc) - 1;
        if users > 0 {
            self.report(
                ViolationKind::FreedWhileInUse,
                None,
                format!("{what} while {users} queued operation(s) or graph(s) still use them"),
            );
        }
    }

    /// `(seed, max_nanos)` when random delays are on.
    pub(crate) fn random_delays(&self) -> Option<(u64, u64)> {
        let max = self.random_delay_max_ns.load(Ordering::Relaxed);
        (max > 0).then(|| (self.random_delay_seed.load(Ordering::Relaxed), max))
    }
}

/// The simulated CUDA runtime. Cheap to clone: clones share memory, counters and faults.
///
/// ```
/// use pinpool::sim::{SimDeviceBuffer, SimRuntime};
/// use pinpool::Runtime;
/// use pinpool::tuning::Origin;
///
/// let sim = SimRuntime::new();
/// let mem = sim.host_alloc(1 << 16).unwrap();
/// assert_eq!(mem.method, Origin::Simulated);
/// assert_eq!(sim.live_bytes(), 1 << 16);
///
/// // A buffer overwritten while its copy is still queued is early reuse.
/// let stream = sim.new_stream()?;
/// let dev = SimDeviceBuffer::new(16);
/// let hold = stream.hold();
/// stream.copy_to_device(mem.ptr.as_ptr(), 16, &dev).unwrap();
/// let event = sim.record_event(&stream).unwrap();
/// sim.host_write(mem.ptr.as_ptr(), &[1; 16]).unwrap(); // too early!
/// drop(hold);
/// stream.synchronize().unwrap();
/// assert_eq!(sim.violations(), 1);
///
/// assert_eq!(sim.query_event(&event), Ok(true));
/// sim.release_event(event);
/// sim.host_free(mem).unwrap();
/// assert_eq!(sim.live_allocations(), 0);
/// # Ok::<(), pinpool::RuntimeError>(())
/// ```
#[derive(Clone)]
pub struct SimRuntime {
    shared: Arc<Shared>,
    _lifeline: Arc<flume::Sender<()>>,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Default for SimRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for SimRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimRuntime")
            .field("live_allocations", &self.live_allocations())
            .field("live_bytes", &self.live_bytes())
            .field("violations", &self.violations())
            .finish_non_exhaustive()
    }
}

impl SimRuntime {
    /// A runtime with default options (no latency, no random delays, no memory limit).
    pub fn new() -> Self {
        SimRuntimeBuilder::default().build()
    }

    /// Options for a runtime.
    pub fn builder() -> SimRuntimeBuilder {
        SimRuntimeBuilder::default()
    }

    /// Sets how long each `host_alloc` sleeps.
    pub fn set_host_alloc_latency(&self, latency: Duration) {
        self.shared
            .host_alloc_latency_ns
            .store(nanos(latency), Ordering::Relaxed);
    }

    /// Streams created from now on sleep a random time below `max` before each operation
    /// (zero turns it off). Each stream seeds its generator from `seed` and its id.
    pub fn set_random_delays(&self, seed: u64, max: Duration) {
        self.shared.random_delay_seed.store(seed, Ordering::Relaxed);
        self.shared
            .random_delay_max_ns
            .store(nanos(max), Ordering::Relaxed);
    }

    /// Sets (or with `None` lifts) the limit on live bytes.
    pub fn set_memory_limit(&self, bytes: Option<usize>) {
        self.shared
            .memory_limit
            .store(bytes.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    /// How many simulated devices there are.
    pub fn device_count(&self) -> usize {
        self.shared.devices.len()
    }

    /// The memory of device `ordinal`, as a memory source (`SimError::NoSuchDevice` past
    /// the last device).
    pub(crate) fn device_memory(&self, ordinal: usize) -> Result<Arc<SimDeviceMemory>, SimError> {
        if ordinal >= self.device_count() {
            return Err(SimError::NoSuchDevice {
                ordinal,
                count: self.device_count(),
            });
        }
        self.shared.devices[ordinal]
            .opened
            .store(true, Ordering::SeqCst);
        Ok(Arc::new(SimDeviceMemory {
            shared: self.shared.clone(),
            ordinal,
        }))
    }

    /// Whether device `ordinal`'s memory was asked for (`None` past the last device): as a
    /// GPU's context is retained for it, which a process that does not use the device should
    /// not do.
    pub fn device_opened(&self, ordinal: usize) -> Option<bool> {
        let d = self.shared.devices.get(ordinal)?;
        Some(d.opened.load(Ordering::SeqCst))
    }

    /// Whether the devices can access each other's memory (see
    /// [`SimRuntimeBuilder::without_peer_access`]).
    pub(crate) fn peer_access(&self) -> bool {
        self.shared.peer_access
    }

    /// Which peers reach each device's mapped memory.
    pub(crate) fn mapped_access(&self) -> &crate::device::MappedAccess {
        &self.shared.mapped_access
    }

    /// Refuses a direct copy on a stream of device `on` that touches mapped memory of
    /// another device not opened to `on`, as the driver does (CUDA's invalid-argument error).
    pub(crate) fn check_peer_reach(
        &self,
        on: usize,
        copy: &crate::device::DeviceCopy,
    ) -> Result<(), crate::Error> {
        let ends = [(copy.src_device, copy.src), (copy.dst_device, copy.dst)];
        for (device, addr) in ends {
            let reach = self
                .mapped_access()
                .reaches(device, on, addr as usize, copy.len);
            if reach == Some(false) {
                return Err(crate::Error::Runtime(RuntimeError::new(
                    "cuMemcpyAsync",
                    format!(
                        "invalid argument: {} bytes at {addr:#x}, mapped memory of device \
                         {device}, are not open to device {on}",
                        copy.len
                    ),
                )));
            }
        }
        Ok(())
    }

    /// Bytes allocated or mapped on device `ordinal` (`None` past the last device).
    pub fn device_used(&self, ordinal: usize) -> Option<usize> {
        let d = self.shared.devices.get(ordinal)?;
        Some(d.used.load(Ordering::SeqCst))
    }

    /// Address ranges reserved on device `ordinal` and not given back (`None` past the last
    /// device).
    pub fn device_reservations(&self, ordinal: usize) -> Option<u64> {
        let d = self.shared.devices.get(ordinal)?;
        Some(d.reservations.load(Ordering::SeqCst))
    }

    /// Streams of device `ordinal` not yet dropped by everyone who held them (`None` past
    /// the last device).
    pub fn device_streams(&self, ordinal: usize) -> Option<usize> {
        Some(self.shared.devices.get(ordinal)?.live_streams())
    }

    /// The capacity of device `ordinal` (`None` past the last device).
    pub fn device_capacity(&self, ordinal: usize) -> Option<usize> {
        self.shared.devices.get(ordinal).map(|d| d.capacity)
    }

    /// Allocations and map calls made on device `ordinal`, and given back (`None` past the
    /// last device).
    pub fn device_calls(&self, ordinal: usize) -> Option<(u64, u64)> {
        let d = self.shared.devices.get(ordinal)?;
        Some((
            d.allocs.load(Ordering::SeqCst),
            d.frees.load(Ordering::SeqCst),
        ))
    }

    /// Map calls' memory moved to another place of its range on device `ordinal` (no memory
    /// taken or given back), `None` past the last device.
    pub fn device_remaps(&self, ordinal: usize) -> Option<u64> {
        Some(
            self.shared
                .devices
                .get(ordinal)?
                .remaps
                .load(Ordering::SeqCst),
        )
    }

    /// A new stream on device `ordinal` (`SimError::NoSuchDevice` past the last device).
    pub fn stream_on(&self, ordinal: usize) -> Result<SimStream, SimError> {
        if ordinal >= self.device_count() {
            return Err(SimError::NoSuchDevice {
                ordinal,
                count: self.device_count(),
            });
        }
        SimStream::try_new_on(self, ordinal)
    }

    /// A new stream of this runtime on device 0 (the call that makes a stream on every
    /// runtime: `CudaRuntime::new_stream` on a GPU). An error if the OS cannot start the
    /// stream's worker thread.
    pub fn new_stream(&self) -> Result<SimStream, RuntimeError> {
        self.stream_on(0)
            .map_err(|e| RuntimeError::new("stream", e.to_string()))
    }

    /// A new stream of this runtime on device 0, with its own worker thread. If the OS
    /// cannot start the thread, the stream is created dead: every later call that can fail
    /// reports [`SimError::ThreadGone`] ([`SimRuntime::new_stream`] says so at once).
    pub fn stream(&self) -> SimStream {
        SimStream::new(self)
    }

    /// The fault plan.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// Allocations handed out and not yet freed.
    pub fn live_allocations(&self) -> u64 {
        self.shared.live_allocations.load(Ordering::SeqCst)
    }

    /// Bytes handed out and not yet freed.
    pub fn live_bytes(&self) -> usize {
        self.shared.live_bytes.load(Ordering::SeqCst)
    }

    /// Successful `host_alloc` calls so far.
    pub fn total_host_allocs(&self) -> u64 {
        self.shared.total_host_allocs.load(Ordering::SeqCst)
    }

    /// Successful `host_free` calls so far.
    pub fn total_host_frees(&self) -> u64 {
        self.shared.total_host_frees.load(Ordering::SeqCst)
    }

    /// How often a stream was made to wait for another stream's event
    /// (`Runtime::stream_wait_event`) so far.
    pub fn stream_waits(&self) -> u64 {
        self.shared.stream_waits.load(Ordering::SeqCst)
    }

    /// Granules of expandable host memory moved to another place of their range so far
    /// (no memory taken or given back).
    pub fn total_host_remaps(&self) -> u64 {
        self.shared.host_remaps.load(Ordering::SeqCst)
    }

    /// How many times this thread took memory (an allocation or a map) from a simulated
    /// memory source, host or device: tells on which threads the pools call their sources.
    pub fn memory_calls_on_this_thread() -> u64 {
        host::MEMORY_CALLS.with(|c| c.get())
    }

    /// Events created by `record_event` so far (captured ones included).
    pub fn events_recorded(&self) -> u64 {
        self.shared.events_recorded.load(Ordering::SeqCst)
    }

    /// Events handed back through `release_event` so far.
    pub fn events_released(&self) -> u64 {
        self.shared.events_released.load(Ordering::SeqCst)
    }

    /// Misuse caught so far (see [`ViolationKind`]).
    pub fn violations(&self) -> u64 {
        self.shared.violations.load(Ordering::SeqCst)
    }

    /// Descriptions of the misuse caught so far, oldest first.
    pub fn violation_log(&self) -> Vec<Violation> {
        self.shared.ledger.log().unwrap_or_default()
    }

    /// Writes `bytes` to host memory of this runtime now, from the host (as a user filling
    /// a buffer would).
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`] if the range is not inside a live allocation.
    pub fn host_write(&self, dst: *mut u8, bytes: &[u8]) -> Result<(), SimError> {
        let owner = self.owner(dst as usize, bytes.len())?;
        // SAFETY: the range lies inside `owner`, which stays alive for this call.
        let view = unsafe { atomic_bytes(dst as usize, bytes.len()) };
        view.iter()
            .zip(bytes)
            .for_each(|(d, b)| d.store(*b, Ordering::Relaxed));
        drop(owner);
        Ok(())
    }

    /// Reads `len` bytes of host memory of this runtime now.
    ///
    /// # Errors
    /// [`SimError::ForeignHostMemory`] if the range is not inside a live allocation.
    pub fn host_read(&self, src: *const u8, len: usize) -> Result<Vec<u8>, SimError> {
        let owner = self.owner(src as usize, len)?;
        // SAFETY: the range lies inside `owner`, which stays alive for this call.
        let view = unsafe { atomic_bytes(src as usize, len) };
        let bytes = view.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        drop(owner);
        Ok(bytes)
    }

    fn owner(&self, addr: usize, len: usize) -> Result<Arc<HostAllocation>, SimError> {
        self.shared
            .ledger
            .lookup(addr, len)?
            .ok_or(SimError::ForeignHostMemory { addr, len })
    }

    pub(crate) fn check_stream(&self, stream: &SimStream) -> Result<(), SimError> {
        if Arc::ptr_eq(stream.shared(), &self.shared) {
            Ok(())
        } else {
            Err(SimError::ForeignStream {
                stream: stream.id().0,
            })
        }
    }

    fn reserve_bytes(&self, size: usize) -> Result<(), SimError> {
        let limit = self.shared.memory_limit.load(Ordering::Relaxed);
        self.shared
            .live_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |live| {
                live.checked_add(size).filter(|&total| total <= limit)
            })
            .map(drop)
            .map_err(|_| SimError::OutOfMemory { size })
    }
}

impl Runtime for SimRuntime {
    type Stream = SimStream;
    type Event = SimEvent;

    fn name(&self) -> &'static str {
        "sim"
    }

    fn new_stream(&self) -> Result<SimStream, RuntimeError> {
        SimRuntime::new_stream(self)
    }

    fn stream_id(&self, stream: &SimStream) -> StreamId {
        stream.id()
    }

    /// Only streams of this runtime (or its clones): another runtime's events and streams
    /// are not this one's to record, query or wait for.
    fn owns_stream(&self, stream: &SimStream) -> bool {
        self.check_stream(stream).is_ok()
    }

    fn is_capturing(&self, stream: &SimStream) -> Result<bool, RuntimeError> {
        self.check_stream(stream)
            .map_err(|e| e.into_runtime("is_capturing"))?;
        Ok(stream.is_capturing())
    }

    fn record_event(&self, stream: &SimStream) -> Result<SimEvent, RuntimeError> {
        const OP: &str = "record_event";
        self.check_stream(stream).map_err(|e| e.into_runtime(OP))?;
        self.shared.faults.check(FaultPoint::RecordEvent)?;
        let event = stream.record_event().map_err(|e| e.into_runtime(OP))?;
        self.shared.events_recorded.fetch_add(1, Ordering::SeqCst);
        Ok(event)
    }

    fn stream_idle(&self, stream: &SimStream) -> Result<bool, RuntimeError> {
        self.check_stream(stream)
            .map_err(|e| e.into_runtime("stream_idle"))?;
        self.shared.faults.check(FaultPoint::QueryStream)?;
        Ok(stream.is_idle())
    }

    fn stream_wait_event(&self, stream: &SimStream, event: &SimEvent) -> Result<(), RuntimeError> {
        const OP: &str = "stream_wait_event";
        self.check_stream(stream).map_err(|e| e.into_runtime(OP))?;
        stream.wait_event(event).map_err(|e| e.into_runtime(OP))?;
        self.shared.stream_waits.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn query_event(&self, event: &SimEvent) -> Result<bool, RuntimeError> {
        self.shared.faults.check(FaultPoint::QueryEvent)?;
        event.query().map_err(|e| e.into_runtime("query_event"))
    }

    fn release_event(&self, event: SimEvent) {
        self.shared.events_released.fetch_add(1, Ordering::SeqCst);
        drop(event);
    }
}

//! `SimRuntimeBuilder`: the simulated machine's shape (its devices, their capacity, peer
//! access, expandable memory), fixed when the runtime is built.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use super::device_books::DeviceState;
use super::ledger::Ledger;
use super::{Faults, Shared, SimRuntime};

/// The simulated machine's shape, fixed when it is built: its devices and what the driver
/// offers; start from [`SimRuntime::builder`]. Timing and limits can change at any time:
/// [`SimRuntime::set_host_alloc_latency`], [`SimRuntime::set_random_delays`],
/// [`SimRuntime::set_memory_limit`].
///
/// ```
/// use std::time::Duration;
/// use pinpool::sim::SimRuntime;
///
/// let sim = SimRuntime::builder().devices(2).device_capacity(1 << 30).build();
/// sim.set_host_alloc_latency(Duration::from_micros(50));
/// sim.set_memory_limit(Some(1 << 30));
/// sim.set_random_delays(7, Duration::from_micros(20));
/// assert_eq!((sim.device_count(), sim.live_bytes()), (2, 0));
/// ```
#[derive(Debug, Clone, Default)]
pub struct SimRuntimeBuilder {
    no_expandable: bool,
    devices: Option<usize>,
    device_capacity: Option<usize>,
    no_peer_access: bool,
}

impl SimRuntimeBuilder {
    /// A runtime without expandable host memory (`host_granularity` returns `None`), like
    /// a driver without the virtual memory calls: carving pools use separate segments.
    pub fn without_expandable_memory(mut self) -> Self {
        self.no_expandable = true;
        self
    }

    /// How many simulated devices there are (default 1, at most 64).
    pub fn devices(mut self, count: usize) -> Self {
        self.devices = Some(count.clamp(1, 64));
        self
    }

    /// The memory of each simulated device (default 16 GiB): device allocations and
    /// mappings past it fail as out of memory, as the driver's do.
    pub fn device_capacity(mut self, bytes: usize) -> Self {
        self.device_capacity = Some(bytes);
        self
    }

    /// Devices that cannot access each other's memory, as GPUs without a peer-to-peer
    /// path: enabling peer access between two of them fails (copies between them still
    /// work, staged by the driver).
    pub fn without_peer_access(mut self) -> Self {
        self.no_peer_access = true;
        self
    }

    /// Builds the runtime (starts its ledger thread).
    pub fn build(self) -> SimRuntime {
        let (lifeline_tx, lifeline_rx) = flume::bounded(1);
        SimRuntime {
            shared: Arc::new(Shared {
                ledger: Ledger::spawn(),
                faults: Faults::default(),
                live_allocations: AtomicU64::new(0),
                live_bytes: AtomicUsize::new(0),
                total_host_allocs: AtomicU64::new(0),
                total_host_frees: AtomicU64::new(0),
                host_remaps: AtomicU64::new(0),
                stream_waits: AtomicU64::new(0),
                events_recorded: AtomicU64::new(0),
                events_released: AtomicU64::new(0),
                violations: AtomicU64::new(0),
                host_alloc_latency_ns: AtomicU64::new(0),
                random_delay_seed: AtomicU64::new(0),
                random_delay_max_ns: AtomicU64::new(0),
                memory_limit: AtomicUsize::new(usize::MAX),
                // Under miri a reserved range is materialised and tracked byte by byte: the
                // default policy's 64 GiB range could not be, so pools there use separate
                // segments.
                expandable: !self.no_expandable && cfg!(unix) && !cfg!(miri),
                devices: (0..self.devices.unwrap_or(1))
                    .map(|_| {
                        DeviceState::new(self.device_capacity.unwrap_or(DEFAULT_DEVICE_CAPACITY))
                    })
                    .collect(),
                peer_access: !self.no_peer_access,
                mapped_access: crate::device::MappedAccess::new(self.devices.unwrap_or(1)),
                lifeline: lifeline_rx,
            }),
            _lifeline: Arc::new(lifeline_tx),
        }
    }
}

/// The default capacity of a simulated device: 16 GiB.
pub const DEFAULT_DEVICE_CAPACITY: usize = 16 << 30;

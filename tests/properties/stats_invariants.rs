//! Statistics that add up, over random workloads on both allocators: pinned and device
//! buffers taken and freed one by one and in sets (`BufferSet::try_alloc`, whose failed tries
//! give back what they took) under caps, on several streams, with the caches emptied now and
//! then. After every step, at a quiescent point (the frees of blocks still used by a stream's
//! queued work, such as a block lent by another stream's pool, completed):
//!
//! - device: in the small pool, the large pool and both, allocated ≤ active ≤ reserved bytes,
//!   segments ≥ 0, the parts add up to the whole (`pinpool_testkit::assert_device_stats_add_up`);
//!   `allocation` and `requested_bytes` are those of the buffers held, and `allocation`'s
//!   accumulated count is the number of device buffers requesters received;
//! - pinned: active requests and bytes are those of the buffers held, at most what is
//!   reserved; `active_requests.allocated` is the number of pinned buffers requesters
//!   received; the allocator's totals are its pool's.

use std::sync::Arc;

use pinpool::config::DeviceConfig;
use pinpool::sim::{SimRuntime, SimStream};
use pinpool::tuning::{BestFit, SizePolicy, TieredPowerOfTwo};
use pinpool::{
    BufferSet, DeviceAllocator, DeviceBuffer, DeviceBuilder, PinnedAllocator, PinnedBuffer, PoolId,
};
use pinpool_testkit::{assert_device_stats_add_up, eventually};
use proptest::prelude::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Small blocks, blocks at the small pool's edge (1 MiB and just above), and large ones.
const SIZES: [usize; 8] = [
    512,
    4 * KIB,
    100_000,
    MIB,
    MIB + 1,
    3 * MIB,
    5 * MIB,
    9 * MIB,
];
const STREAMS: usize = 3;
const PINNED_CAP: usize = 24 * MIB;
const DEVICE_CAP: usize = 32 * MIB;

#[derive(Debug, Clone)]
enum Op {
    Pinned {
        size: usize,
    },
    Device {
        size: usize,
        stream: usize,
    },
    Set {
        pinned: Vec<usize>,
        device: Vec<(usize, usize)>,
    },
    Free {
        buf: usize,
    },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop::sample::select(SIZES.to_vec());
    prop_oneof![
        4 => size.clone().prop_map(|size| Op::Pinned { size }),
        4 => (size.clone(), 0..STREAMS).prop_map(|(size, stream)| Op::Device { size, stream }),
        3 => (
            prop::collection::vec(size.clone(), 0..3),
            prop::collection::vec((size, 0..STREAMS), 0..3),
        )
            .prop_map(|(pinned, device)| Op::Set { pinned, device }),
        6 => any::<usize>().prop_map(|buf| Op::Free { buf }),
        1 => Just(Op::EmptyCache),
    ]
}

enum Held {
    Pinned(PinnedBuffer<SimRuntime>),
    Device(DeviceBuffer<SimRuntime>),
}

/// The allocators under test, and what the test knows it received.
struct Run {
    pinned: PinnedAllocator<SimRuntime>,
    device: DeviceAllocator<SimRuntime>,
    streams: Vec<SimStream>,
    held: Vec<Held>,
    pinned_received: i64,
    device_received: i64,
}

impl Run {
    fn new(pinned_policy: Arc<dyn SizePolicy>, device_config: &DeviceConfig) -> Self {
        let sim = Arc::new(SimRuntime::new());
        let pinned = PinnedAllocator::builder()
            .runtime(sim.clone())
            .policy(pinned_policy)
            .max_bytes(PINNED_CAP)
            .build()
            .unwrap();
        let device = DeviceBuilder::new(sim.clone())
            .config(device_config)
            .max_bytes(DEVICE_CAP)
            .build()
            .unwrap();
        let streams = (0..STREAMS).map(|_| sim.stream()).collect();
        Self {
            pinned,
            device,
            streams,
            held: Vec::new(),
            pinned_received: 0,
            device_received: 0,
        }
    }

    async fn step(&mut self, op: Op) {
        match op {
            Op::Pinned { size } => {
                if let Ok(b) = self.pinned.try_alloc(size).await {
                    self.pinned_received += 1;
                    self.held.push(Held::Pinned(b));
                }
            }
            Op::Device { size, stream } => {
                if let Ok(b) = self.device.try_alloc(size, &self.streams[stream]).await {
                    self.device_received += 1;
                    self.held.push(Held::Device(b));
                }
            }
            Op::Set { pinned, device } => {
                let mut set = BufferSet::new();
                for &size in &pinned {
                    set = set.pinned(&self.pinned, size);
                }
                for &(size, stream) in &device {
                    set = set.device(&self.device, size, &self.streams[stream]);
                }
                if let Ok(taken) = set.try_alloc().await {
                    self.pinned_received += taken.pinned.len() as i64;
                    self.device_received += taken.device.len() as i64;
                    self.held.extend(taken.pinned.into_iter().map(Held::Pinned));
                    self.held.extend(taken.device.into_iter().map(Held::Device));
                }
            }
            Op::Free { buf } => {
                if !self.held.is_empty() {
                    let i = buf % self.held.len();
                    drop(self.held.swap_remove(i));
                }
            }
            Op::EmptyCache => {
                self.pinned.empty_cache().await.unwrap();
                self.device.empty_cache().await.unwrap();
            }
        }
    }

    /// Waits until no device block is freed and waiting for a stream's work (a block lent
    /// between streams is marked as used by the borrower's stream, so its free waits for an
    /// event even when the stream has no work queued).
    async fn settle(&self) {
        eventually("pending frees complete", || {
            let d = self.device.stats(0).unwrap();
            d.active.all.current == d.allocation.all.current
        })
        .await;
    }

    fn check(&self) {
        let (mut pinned, mut pinned_bytes, mut device, mut requested) = (0i64, 0i64, 0i64, 0i64);
        for h in &self.held {
            match h {
                Held::Pinned(b) => {
                    pinned += 1;
                    pinned_bytes += b.capacity() as i64;
                }
                Held::Device(b) => {
                    device += 1;
                    requested += b.len() as i64;
                }
            }
        }
        let d = self.device.stats(0).unwrap();
        assert_device_stats_add_up(&d);
        assert_eq!(d.allocation.all.current, device, "{d:?}");
        assert_eq!(d.active.all.current, device, "{d:?}");
        assert_eq!(d.requested_bytes.all.current, requested, "{d:?}");
        assert_eq!(d.allocation.all.allocated, self.device_received, "{d:?}");
        assert_eq!(d.active.all.allocated, self.device_received, "{d:?}");
        assert!(d.reserved_bytes.all.current <= DEVICE_CAP as i64, "{d:?}");

        let p = self.pinned.stats();
        assert_eq!(p.active_requests.current, pinned, "{p:?}");
        assert_eq!(p.active_bytes.current, pinned_bytes, "{p:?}");
        assert_eq!(p.active_requests.allocated, self.pinned_received, "{p:?}");
        assert!(p.active_bytes.current <= p.allocated_bytes.current, "{p:?}");
        assert!(p.allocated_bytes.current <= PINNED_CAP as i64, "{p:?}");
        assert!(p.allocations.current >= 0 && p.cached_bytes() >= 0, "{p:?}");
        let pool = self.pinned.pool_stats(PoolId::DEFAULT).unwrap();
        assert_eq!(pool.active_requests, p.active_requests);
        assert_eq!(pool.allocated_bytes, p.allocated_bytes);
        assert_eq!(pool.allocations, p.allocations);
    }
}

fn run(pinned_policy: Arc<dyn SizePolicy>, device_config: &str, ops: Vec<Op>) {
    let config: DeviceConfig = device_config.parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut run = Run::new(pinned_policy, &config);
        for op in ops {
            run.step(op).await;
            run.settle().await;
            run.check();
        }
        run.held.clear();
        run.settle().await;
        run.check();
        run.pinned.empty_cache().await.unwrap();
        run.device.empty_cache().await.unwrap();
        run.check();
        assert_eq!(run.device.stats(0).unwrap().reserved_bytes.all.current, 0);
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Device blocks cut out of one expandable range per stream (the default layout), pinned
    /// blocks out of an expandable range (`bestfit`).
    #[test]
    fn statistics_add_up_over_random_workloads_on_expandable_ranges(
        ops in prop::collection::vec(op(), 1..48)
    ) {
        run(Arc::new(BestFit::default()), "", ops);
    }

    /// Device blocks out of separate segments, pinned blocks one host allocation each.
    #[test]
    fn statistics_add_up_over_random_workloads_on_separate_segments(
        ops in prop::collection::vec(op(), 1..48)
    ) {
        run(
            Arc::new(TieredPowerOfTwo::default()),
            "expandable_segments:false",
            ops,
        );
    }
}

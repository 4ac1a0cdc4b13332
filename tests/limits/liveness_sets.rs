//! Liveness of device pools and of requests for several buffers at once (`BufferSet`), under
//! a pinned cap and a device cap (the rule in `docs/reliability.md`, "Liveness", and in
//! the engine's `alloc_many`): no request waits for ever while the bytes it needs are
//! free, cached, or held by buffers that will come back.
//!
//! Random sequences of sets (pinned and device buffers on several streams, taken together),
//! single device requests that wait at the cap, and frees of what was served run against a
//! reference model that knows only what is lent. At each settling point the waiting requests
//! must not all stay waiting when what is lent leaves room, under both caps, for the
//! largest of them (a lent block pins every granule it touches); at the end, with
//! everything freed, every waiting request must be served.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::{SimRuntime, SimStream};
use pinpool::tuning::BlockLayout;
use pinpool::tuning::SizePolicy;
use pinpool::{
    BufferSet, Builder, DeviceAllocator, DeviceBuffer, DeviceBuilder, Error, PinnedAllocator,
    TakenBuffers,
};
use proptest::prelude::*;
use tokio::task::JoinHandle;

const PINNED_CAP: usize = 16 << 20;
const DEVICE_CAP: usize = 24 << 20;
const PINNED_SIZES: [usize; 5] = [4096, 100_000, (1 << 20) + 1, 3 << 20, 5 << 20];
const DEVICE_SIZES: [usize; 6] = [512, 70_000, (1 << 20) + 1, 3 << 20, 6 << 20, 9 << 20];
const STREAMS: usize = 3;
/// How long a request that the model says must be served may take to be.
const SERVE_WITHIN: Duration = Duration::from_secs(5);

/// What a request got.
enum Got {
    Set(TakenBuffers<SimRuntime>),
    Device(DeviceBuffer<SimRuntime>),
}

/// A request under way.
type Request = JoinHandle<Result<Got, Error>>;

#[derive(Debug, Clone)]
enum Op {
    Set {
        pinned: Vec<usize>,
        device: Vec<(usize, usize)>,
    },
    Device {
        size: usize,
        stream: usize,
    },
    Free {
        got: usize,
    },
    Settle,
}

fn op() -> impl Strategy<Value = Op> {
    let pinned = prop::collection::vec(prop::sample::select(PINNED_SIZES.to_vec()), 0..3);
    let device = prop::collection::vec(
        (prop::sample::select(DEVICE_SIZES.to_vec()), 0..STREAMS),
        0..4,
    );
    prop_oneof![
        5 => (pinned, device).prop_map(|(pinned, device)| Op::Set { pinned, device }),
        2 => (prop::sample::select(DEVICE_SIZES.to_vec()), 0..STREAMS)
            .prop_map(|(size, stream)| Op::Device { size, stream }),
        5 => any::<usize>().prop_map(|got| Op::Free { got }),
        2 => Just(Op::Settle),
    ]
}

/// What a request needs reserved: pinned bytes and device bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Needs {
    pinned: usize,
    device: usize,
}

/// The unit of memory a lent block of `policy` pins (every granule it touches stays
/// reserved), or 0 for layouts whose blocks are their own allocations.
fn granule_of(policy: &dyn SizePolicy, sim: &SimRuntime) -> usize {
    match policy.layout() {
        BlockLayout::Whole => 0,
        BlockLayout::Carved(c) => c.small_segment().max(sim.host_granularity().unwrap_or(0)),
    }
}

fn rounded(policy: &dyn SizePolicy, granule: usize, size: usize) -> usize {
    if size == 0 {
        return 0;
    }
    let class = policy.class_of(size).expect("sizes are in range").size;
    if granule == 0 {
        class
    } else {
        class.div_ceil(granule) * granule
    }
}

/// Bytes that the lent `ranges` pin: their sizes, or every granule they touch.
fn pinned_by(ranges: impl Iterator<Item = (usize, usize)>, granule: usize) -> usize {
    if granule == 0 {
        return ranges.map(|(_, len)| len).sum();
    }
    let touched: BTreeSet<usize> = ranges
        .filter(|&(_, len)| len > 0)
        .flat_map(|(at, len)| at / granule..=(at + len - 1) / granule)
        .collect();
    touched.len() * granule
}

struct Harness {
    rt: tokio::runtime::Runtime,
    sim: SimRuntime,
    host: PinnedAllocator<SimRuntime>,
    dev: DeviceAllocator<SimRuntime>,
    host_granule: usize,
    dev_granule: usize,
    streams: Vec<SimStream>,
    got: Vec<Got>,
    waiting: VecDeque<(Needs, Request)>,
}

impl Harness {
    fn new() -> Self {
        let rt = pinpool_testkit::multi_thread(2);
        let sim = SimRuntime::new();
        let host = Builder::new(Arc::new(sim.clone()))
            .max_bytes(PINNED_CAP)
            .handle(rt.handle().clone())
            .build()
            .unwrap();
        let dev = DeviceBuilder::new(Arc::new(sim.clone()))
            .max_bytes(DEVICE_CAP)
            .handle(rt.handle().clone())
            .build()
            .unwrap();
        let host_granule = granule_of(pinpool::tuning::engine(&host).policy(), &sim);
        let dev_granule = granule_of(
            pinpool::tuning::device_engine(&dev, 0).unwrap().policy(),
            &sim,
        );
        let streams = (0..STREAMS).map(|_| sim.stream()).collect();
        Harness {
            rt,
            sim,
            host,
            dev,
            host_granule,
            dev_granule,
            streams,
            got: Vec::new(),
            waiting: VecDeque::new(),
        }
    }

    fn needs(&self, pinned: &[usize], device: &[usize]) -> Needs {
        let hp = pinpool::tuning::engine(&self.host).policy();
        let dp = pinpool::tuning::device_engine(&self.dev, 0)
            .unwrap()
            .policy();
        Needs {
            pinned: pinned
                .iter()
                .map(|&s| rounded(hp, self.host_granule, s))
                .sum(),
            device: device
                .iter()
                .map(|&s| rounded(dp, self.dev_granule, s))
                .sum(),
        }
    }

    /// What the lent buffers keep reserved, by the model.
    fn lent(&self) -> Needs {
        let mut pinned = Vec::new();
        let mut device = Vec::new();
        for g in &self.got {
            match g {
                Got::Set(t) => {
                    pinned.extend(t.pinned.iter().map(|b| (b.as_ptr() as usize, b.capacity())));
                    device.extend(
                        t.device
                            .iter()
                            .map(|b| (b.device_ptr() as usize, b.capacity())),
                    );
                }
                Got::Device(b) => device.push((b.device_ptr() as usize, b.capacity())),
            }
        }
        Needs {
            pinned: pinned_by(pinned.into_iter(), self.host_granule),
            device: pinned_by(device.into_iter(), self.dev_granule),
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Set { pinned, device } => {
                let sizes: Vec<usize> = device.iter().map(|&(s, _)| s).collect();
                let needs = self.needs(&pinned, &sizes);
                if needs.pinned > PINNED_CAP || needs.device > DEVICE_CAP {
                    return; // may never fit (its blocks together are over a cap)
                }
                let (host, dev) = (self.host.clone(), self.dev.clone());
                let device: Vec<(usize, SimStream)> = device
                    .into_iter()
                    .map(|(size, s)| (size, self.streams[s].clone()))
                    .collect();
                let task = self.rt.spawn(async move {
                    let mut set = BufferSet::new();
                    for &size in &pinned {
                        set = set.pinned(&host, size);
                    }
                    for (size, s) in &device {
                        set = set.device(&dev, *size, s);
                    }
                    set.alloc().await.map(Got::Set)
                });
                self.submitted(needs, task);
            }
            Op::Device { size, stream } => {
                let needs = self.needs(&[], &[size]);
                let (dev, s) = (self.dev.clone(), self.streams[stream].clone());
                let task = self
                    .rt
                    .spawn(async move { dev.alloc(size, &s).await.map(Got::Device) });
                self.submitted(needs, task);
            }
            Op::Free { got } if !self.got.is_empty() => {
                drop(self.got.swap_remove(got % self.got.len()));
            }
            Op::Settle => self.settle(),
            _ => {}
        }
    }

    fn submitted(&mut self, needs: Needs, task: Request) {
        self.waiting.push_back((needs, task));
        // Let the request reach its queue before the next one (most of the time: the check
        // below does not rely on it).
        std::thread::sleep(Duration::from_millis(2));
        self.harvest();
    }

    /// Moves every served request's buffers to the lent ones.
    fn harvest(&mut self) {
        let mut still = VecDeque::new();
        for (needs, task) in self.waiting.drain(..) {
            if !task.is_finished() {
                still.push_back((needs, task));
                continue;
            }
            let got = self.rt.block_on(task).expect("task").unwrap_or_else(|e| {
                panic!("a request needing {needs:?} under the caps failed: {e}")
            });
            self.got.push(got);
        }
        self.waiting = still;
    }

    /// The liveness check: the requests must not all stay waiting while what is lent leaves
    /// room under both caps for the largest of them (whichever is first then fits).
    fn settle(&mut self) {
        let start = Instant::now();
        loop {
            self.harvest();
            if self.waiting.is_empty() {
                return;
            }
            let most = self
                .waiting
                .iter()
                .fold(Needs::default(), |m, (n, _)| Needs {
                    pinned: m.pinned.max(n.pinned),
                    device: m.device.max(n.device),
                });
            let lent = self.lent();
            if lent.pinned + most.pinned > PINNED_CAP || lent.device + most.device > DEVICE_CAP {
                return; // they may wait: there may be no room for the first
            }
            assert!(
                start.elapsed() < SERVE_WITHIN,
                "{} requests wait, needing at most {most:?}, while the lent buffers pin {lent:?}; \
                 pinned stats {:?}; device stats {:?}",
                self.waiting.len(),
                self.host.stats(),
                self.dev.stats(0)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Frees everything: every request still waiting must then be served.
    fn finish(mut self) {
        while !self.waiting.is_empty() {
            self.got.clear();
            self.settle();
            assert!(
                self.waiting.is_empty() || !self.got.is_empty(),
                "requests wait with nothing lent"
            );
        }
        self.got.clear();
        for s in &self.streams {
            s.synchronize().unwrap();
        }
        let (host, dev) = (&self.host, &self.dev);
        self.rt.block_on(async {
            pinpool_testkit::eventually_nothing_in_use(host).await;
            pinpool_testkit::eventually("device buffers back", || {
                dev.stats(0).unwrap().active_bytes.all.current == 0
            })
            .await;
        });
        assert!(self.host.stats().allocated_bytes.peak <= PINNED_CAP as i64);
        assert!(self.dev.stats(0).unwrap().reserved_bytes.all.peak <= DEVICE_CAP as i64);
        assert_eq!(self.sim.violations(), 0, "{:?}", self.sim.violation_log());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn waiting_sets_and_device_requests_are_served_once_what_is_lent_leaves_room(
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let mut h = Harness::new();
        for op in ops {
            h.step(op);
        }
        h.finish();
    }
}

/// Many tasks take random sets over and over under tight caps, holding each for a moment:
/// every one of them finishes (none waits for ever, none deadlocks with another).
#[test]
fn tasks_taking_random_sets_under_tight_caps_all_finish() {
    let h = Harness::new();
    let tasks: Vec<JoinHandle<Result<usize, Error>>> = (0..16u64)
        .map(|t| {
            let (host, dev) = (h.host.clone(), h.dev.clone());
            let streams = h.streams.clone();
            h.rt.spawn(async move {
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (t + 1);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut served = 0;
                for _ in 0..60 {
                    let mut set = BufferSet::new();
                    for _ in 0..next() % 3 {
                        set = set.pinned(&host, PINNED_SIZES[next() as usize % 4]);
                    }
                    for _ in 0..1 + next() % 3 {
                        let s = &streams[next() as usize % STREAMS];
                        set = set.device(&dev, DEVICE_SIZES[next() as usize % 5], s);
                    }
                    let taken = set.alloc().await?;
                    for _ in 0..next() % 3 {
                        tokio::task::yield_now().await;
                    }
                    drop(taken);
                    served += 1;
                }
                Ok(served)
            })
        })
        .collect();
    for t in tasks {
        let served =
            h.rt.block_on(async { tokio::time::timeout(Duration::from_secs(120), t).await })
                .expect("every task finishes")
                .unwrap()
                .unwrap();
        assert_eq!(served, 60);
    }
    h.finish();
}

//! Liveness under a memory cap (the rule in `docs/reliability.md`, "Liveness"): a request that
//! waits for room is served, in arrival order, as soon as the bytes lent out (in use, or
//! freed but still needed by queued GPU work) leave room for it under the cap. Cached blocks,
//! wholly free segments and the free granules of partly used expandable ranges never keep a
//! request waiting: the pool gives them back to make room.
//!
//! Random sequences of waiting allocations, frees, frees after a queued copy, and held or
//! released streams run against a reference model that knows only what is lent. At each
//! settling point the waiting requests must not all stay waiting when what is lent leaves
//! room for the largest of them (a lent block pins its own allocation, or under a carved
//! layout every granule it touches); at the end, with everything freed, every waiting
//! request must be served.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::config::SizePolicyChoice;
use pinpool::sim::{HoldGuard, SimDeviceBuffer, SimRuntime, SimStream};
use pinpool::tuning::BlockLayout;
use pinpool::tuning::SizePolicy;
use pinpool::{Builder, Error, PinnedAllocator, PinnedBuffer};
use proptest::prelude::*;
use tokio::task::JoinHandle;

/// The cap every sequence runs under.
const CAP: usize = 16 << 20;
/// Sizes from a page to over a third of the cap (rounded up by the coarse policies).
const SIZES: [usize; 6] = [4096, 100_000, (1 << 20) + 1, 3 << 20, 5 << 20, 6 << 20];
const STREAMS: usize = 2;
/// How long a request that the model says must be served may take to be.
const SERVE_WITHIN: Duration = Duration::from_secs(5);

/// A request under way: the task awaiting `alloc`.
type Request = JoinHandle<Result<PinnedBuffer<SimRuntime>, Error>>;

#[derive(Debug, Clone)]
enum Op {
    Alloc { size: usize },
    Free { buf: usize },
    CopyThenFree { buf: usize, stream: usize },
    Hold { stream: usize },
    Release { stream: usize },
    Settle,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => prop::sample::select(SIZES.to_vec()).prop_map(|size| Op::Alloc { size }),
        4 => any::<usize>().prop_map(|buf| Op::Free { buf }),
        2 => (any::<usize>(), 0..STREAMS).prop_map(|(buf, stream)| Op::CopyThenFree { buf, stream }),
        1 => (0..STREAMS).prop_map(|stream| Op::Hold { stream }),
        1 => (0..STREAMS).prop_map(|stream| Op::Release { stream }),
        2 => Just(Op::Settle),
    ]
}

struct Harness {
    rt: tokio::runtime::Runtime,
    sim: SimRuntime,
    pool: PinnedAllocator<SimRuntime>,
    policy: Arc<dyn SizePolicy>,
    /// For carved layouts, the unit of memory a lent block pins: every granule (of the
    /// expandable range, or a small segment) it touches stays reserved. 0 for layouts whose
    /// blocks are their own allocations.
    granule: usize,
    streams: Vec<SimStream>,
    holds: Vec<Option<HoldGuard>>,
    dev: SimDeviceBuffer,
    held: Vec<PinnedBuffer<SimRuntime>>,
    /// Freed after a copy on a held stream: address and capacity, by stream. Still lent
    /// until the stream is released.
    queued: Vec<Vec<(usize, usize)>>,
    /// Requests not served yet, in arrival order.
    waiting: VecDeque<(usize, Request)>,
}

impl Harness {
    fn new(choice: SizePolicyChoice) -> Self {
        let rt = pinpool_testkit::multi_thread(2);
        let sim = SimRuntime::new();
        let policy = choice.policy();
        let granule = match policy.layout() {
            BlockLayout::Whole => 0,
            BlockLayout::Carved(c) => c.small_segment().max(sim.host_granularity().unwrap_or(0)),
        };
        let pool = Builder::new(Arc::new(sim.clone()))
            .policy(policy.clone())
            .max_bytes(CAP)
            .handle(rt.handle().clone())
            .build()
            .unwrap();
        let streams = (0..STREAMS).map(|_| sim.stream()).collect();
        Harness {
            rt,
            sim,
            pool,
            policy,
            granule,
            streams,
            holds: (0..STREAMS).map(|_| None).collect(),
            dev: SimDeviceBuffer::new(64 << 10),
            held: Vec::new(),
            queued: vec![Vec::new(); STREAMS],
            waiting: VecDeque::new(),
        }
    }

    /// What a request of `size` needs reserved.
    fn needs(&self, size: usize) -> usize {
        let class = self.policy.class_of(size).expect("sizes are in range").size;
        if self.granule == 0 {
            class
        } else {
            class.div_ceil(self.granule) * self.granule
        }
    }

    /// What the lent blocks keep reserved, by the model: their own sizes, or for carved
    /// layouts every granule they touch (each counted once).
    fn lent(&self) -> usize {
        let ranges = self
            .held
            .iter()
            .map(|b| (b.as_ptr() as usize, b.capacity()))
            .chain(self.queued.iter().flatten().copied());
        if self.granule == 0 {
            return ranges.map(|(_, len)| len).sum();
        }
        let g = self.granule;
        let touched: BTreeSet<usize> = ranges
            .flat_map(|(at, len)| at / g..=(at + len - 1) / g)
            .collect();
        touched.len() * g
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Alloc { size } => {
                let pool = self.pool.clone();
                let task = self.rt.spawn(async move { pool.alloc(size).await });
                self.waiting.push_back((size, task));
                // Let the request reach its pool before the next one (most of the time: the
                // check below does not rely on it).
                std::thread::sleep(Duration::from_millis(2));
                self.harvest();
            }
            Op::Free { buf } if !self.held.is_empty() => {
                drop(self.held.swap_remove(buf % self.held.len()));
            }
            Op::CopyThenFree { buf, stream } if !self.held.is_empty() => {
                let mut b = self.held.swap_remove(buf % self.held.len());
                let n = b.len().min(self.dev.len());
                self.streams[stream]
                    .copy_to_device(b.as_ptr(), n, &self.dev)
                    .unwrap();
                b.record_stream(&self.streams[stream]).unwrap();
                if self.holds[stream].is_some() {
                    self.queued[stream].push((b.as_ptr() as usize, b.capacity()));
                }
                drop(b);
            }
            Op::Hold { stream } if self.holds[stream].is_none() => {
                self.holds[stream] = Some(self.streams[stream].hold());
            }
            Op::Release { stream } => {
                if let Some(h) = self.holds[stream].take() {
                    drop(h);
                    self.streams[stream].synchronize().unwrap();
                    self.queued[stream].clear();
                }
            }
            Op::Settle => self.settle(),
            _ => {}
        }
    }

    /// Moves every served request's buffer to the held buffers (a request served while an
    /// earlier one still waits holds memory too).
    fn harvest(&mut self) {
        let mut still = VecDeque::new();
        for (size, task) in self.waiting.drain(..) {
            if !task.is_finished() {
                still.push_back((size, task));
                continue;
            }
            let buf =
                self.rt.block_on(task).expect("task").unwrap_or_else(|e| {
                    panic!("a request of {size} bytes under the cap failed: {e}")
                });
            assert!(buf.len() >= size);
            self.held.push(buf);
        }
        self.waiting = still;
    }

    /// The liveness check. Requests are served first come, first served, and which request
    /// reached its pool first is up to the scheduler, so the model does not know which one
    /// heads the queue: it checks that the requests do not all wait while what is lent leaves
    /// room for the largest of them (then whichever is first fits, and must be served).
    fn settle(&mut self) {
        for (s, h) in self.streams.iter().zip(&self.holds) {
            if h.is_none() {
                s.synchronize().unwrap();
            }
        }
        let start = Instant::now();
        loop {
            self.harvest();
            let Some(size) = self.waiting.iter().map(|&(size, _)| size).max() else {
                return;
            };
            let (lent, needs) = (self.lent(), self.needs(size));
            if lent + needs > CAP {
                return; // they may wait: the model agrees there may be no room for the first
            }
            assert!(
                start.elapsed() < SERVE_WITHIN,
                "{} requests wait, the largest of {size} bytes (needing {needs}), while the lent \
                 blocks pin at most {lent} of the {CAP}-byte cap; stats {:?}",
                self.waiting.len(),
                self.pool.stats()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Frees everything: every request still waiting must then be served.
    fn finish(mut self) {
        for h in &mut self.holds {
            drop(h.take());
        }
        self.queued.iter_mut().for_each(Vec::clear);
        while !self.waiting.is_empty() {
            self.held.clear();
            self.settle();
            assert!(
                self.waiting.is_empty() || !self.held.is_empty(),
                "requests wait with nothing lent"
            );
        }
        self.held.clear();
        for s in &self.streams {
            s.synchronize().unwrap();
        }
        let (pool, sim) = (&self.pool, &self.sim);
        self.rt.block_on(async {
            pinpool_testkit::eventually_nothing_in_use(pool).await;
            pinpool_testkit::assert_books_balance(pool, sim, 0).await;
        });
        assert_eq!(self.sim.violations(), 0, "{:?}", self.sim.violation_log());
    }
}

/// The policies with a liveness guarantee: all but `bestfit_segments`, whose separate
/// segments cannot give back a partly used segment's free bytes (kept for comparison only).
fn live_policies() -> Vec<SizePolicyChoice> {
    SizePolicyChoice::ALL
        .into_iter()
        .filter(|c| *c != SizePolicyChoice::BestFitSegments)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_waiting_request_is_served_once_what_is_lent_leaves_room_for_it(
        policy in prop::sample::select(live_policies()),
        ops in prop::collection::vec(op(), 1..50),
    ) {
        let mut h = Harness::new(policy);
        for op in ops {
            h.step(op);
        }
        h.finish();
    }
}

/// Under `bestfit`, a large request whose bytes are free only as scattered granules of the
/// expandable range (no free stretch large enough, nothing cached that fits) is still
/// served: the pool unmaps the free granules and maps the request anew.
#[test]
fn a_large_request_is_served_from_the_free_granules_of_a_partly_used_range() {
    let mut h = Harness::new(SizePolicyChoice::BestFit);
    let granule = h
        .sim
        .host_granularity()
        .expect("the sim maps host memory in granules");
    // Fill the cap with granule-sized blocks, free every other one, then ask for three
    // granules: the free ones are scattered between lent ones.
    for _ in 0..CAP / granule {
        h.step(Op::Alloc { size: granule });
    }
    h.step(Op::Settle);
    assert_eq!(h.held.len(), CAP / granule);
    let mut i = 0;
    h.held.retain(|_| {
        i += 1;
        i % 2 == 0
    });
    h.step(Op::Alloc { size: 3 * granule });
    let start = Instant::now();
    while !h.waiting.is_empty() {
        assert!(
            start.elapsed() < SERVE_WITHIN,
            "half the cap is lent in single granules, yet three granules wait: {:?}",
            h.pool.stats()
        );
        std::thread::sleep(Duration::from_millis(1));
        h.harvest();
    }
    h.finish();
}

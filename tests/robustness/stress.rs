//! Concurrency stress: many tasks and threads allocate, copy on streams with random delays,
//! record, hold and free, with `empty_cache` running alongside. At the end: no copy ever saw
//! its bytes change (invariant 1), the books balance and every byte goes back (invariant 2).
//!
//! The normal test run does a short version under every size policy (sizes up to 3 MiB, so
//! that best fit cuts large pieces out of shared segments, coalesces and recalls them). The
//! soak version runs a million operations under the default policy:
//! `PINPOOL_SOAK=1 cargo test --release --test robustness soak_a_million_operations -- --ignored`.

use std::sync::Arc;
use std::time::Duration;

use pinpool::config::SizePolicyChoice;
use pinpool::sim::{SimDeviceBuffer, SimRuntime, SimStream};
use pinpool::{Builder, PinnedAllocator, PinnedBuffer};

const SIZES: [usize; 9] = [
    64,
    700,
    4096,
    5000,
    1 << 14,
    1 << 16,
    100_000,
    3 << 19,
    3 << 20,
];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One worker's loop, shared by tasks (async alloc) and threads (blocking alloc).
struct Worker {
    rng: Rng,
    live: Vec<(PinnedBuffer<SimRuntime>, u8)>,
    dev: SimDeviceBuffer,
    streams: Vec<SimStream>,
}

impl Worker {
    fn new(seed: u64, streams: Vec<SimStream>) -> Self {
        Worker {
            rng: Rng(seed | 1),
            live: Vec::new(),
            dev: SimDeviceBuffer::new(1 << 12),
            streams,
        }
    }

    fn use_buffer(&mut self, mut buf: PinnedBuffer<SimRuntime>) {
        let tag = (self.rng.next() % 250 + 1) as u8;
        buf.fill(tag);
        if self.rng.below(3) > 0 {
            let s = self.rng.below(self.streams.len());
            let n = buf.len().min(self.dev.len());
            self.streams[s]
                .copy_to_device(buf.as_ptr(), n, &self.dev)
                .expect("copy");
            buf.record_stream(&self.streams[s]).unwrap();
        }
        self.live.push((buf, tag));
        while self.live.len() > 1 + self.rng.below(6) {
            let i = self.rng.below(self.live.len());
            let (b, tag) = self.live.swap_remove(i);
            assert!(
                pinpool_testkit::all_bytes_are(&b, tag),
                "a live buffer changed under its owner"
            );
            drop(b);
        }
    }

    fn size(&mut self) -> usize {
        SIZES[self.rng.below(SIZES.len())]
    }
}

fn run(ops_per_worker: usize, tasks: usize, threads: usize, seed: u64, policy: SizePolicyChoice) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sim = SimRuntime::new();
    sim.set_random_delays(seed, Duration::from_micros(100));
    let pool: PinnedAllocator<SimRuntime> = Builder::new(Arc::new(sim.clone()))
        .policy(policy.policy())
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    let streams: Vec<SimStream> = (0..4).map(|_| sim.stream()).collect();

    let mut joins = Vec::new();
    for t in 0..tasks {
        let pool = pool.clone();
        let mut w = Worker::new(seed ^ (t as u64 * 7919), streams.clone());
        joins.push(rt.spawn(async move {
            for i in 0..ops_per_worker {
                let size = w.size();
                let buf = pool.alloc(size).await.expect("alloc");
                w.use_buffer(buf);
                if t == 0 && i % 500 == 499 {
                    pool.empty_cache().await.expect("empty_cache");
                }
            }
        }));
    }
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let pool = pool.clone();
            let mut w = Worker::new(seed ^ (0xABCD + t as u64), streams.clone());
            std::thread::spawn(move || {
                for _ in 0..ops_per_worker {
                    let size = w.size();
                    let buf = pool.alloc_blocking(size).expect("alloc_blocking");
                    w.use_buffer(buf);
                }
            })
        })
        .collect();
    for j in joins {
        rt.block_on(j).expect("task");
    }
    for h in handles {
        h.join().expect("thread");
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    rt.block_on(async {
        pinpool_testkit::eventually("events noticed", || pool.stats().waiting_blocks == 0).await;
        pinpool_testkit::eventually_nothing_in_use(&pool).await;
        pinpool_testkit::assert_books_balance(&pool, &sim, 0).await;
    });
    let stats = pool.stats();
    assert_eq!(stats.active_requests.current, 0);
    assert_eq!(
        stats.active_requests.allocated as usize,
        ops_per_worker * (tasks + threads),
        "every request was counted"
    );
    drop(pool);
    pinpool_testkit::eventually_blocking("all memory given back", || sim.live_bytes() == 0);
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
}

#[test]
fn many_tasks_and_threads_with_random_stream_delays_never_reuse_early_or_lose_memory() {
    for policy in SizePolicyChoice::ALL {
        run(1500, 6, 2, 0x5EED, policy);
    }
}

#[test]
#[ignore = "soak: a million operations; run with PINPOOL_SOAK=1 and --ignored"]
fn soak_a_million_operations() {
    if std::env::var_os("PINPOOL_SOAK").is_none() {
        eprintln!("skipped: set PINPOOL_SOAK=1 to run the soak test");
        return;
    }
    run(100_000, 8, 2, 0xC0FFEE, SizePolicyChoice::default());
}

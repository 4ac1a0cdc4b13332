//! The cached path on the simulated runtime: allocate a size seen before and free it, on one
//! thread and on several; the async path; and the record path (allocate, record a stream,
//! free). Runs anywhere; the GPU harness, which prints the figures paired with PyTorch's, is
//! `examples/gpu_bench.rs`.

use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use pinpool::tuning::{BestFit, SizePolicy, TieredPowerOfTwo};
use pinpool::PinnedAllocator;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn pair(c: &mut Criterion) {
    let rt = runtime();
    let policies: [(&str, Arc<dyn SizePolicy>); 2] = [
        ("tiered", Arc::new(TieredPowerOfTwo::default())),
        ("bestfit", Arc::new(BestFit::default())),
    ];
    let mut g = c.benchmark_group("pair");
    for (name, policy) in policies {
        let pool = rt
            .block_on(async { PinnedAllocator::builder().policy(policy).build() })
            .expect("allocator");
        for size in [4096usize, 1 << 20, 64 << 20] {
            drop(pool.alloc_blocking(size).expect("warm"));
            g.throughput(Throughput::Elements(1));
            let id = |how: &str| BenchmarkId::new(format!("{how}/{name}"), size);
            g.bench_with_input(id("blocking"), &size, |b, &size| {
                b.iter(|| drop(pool.alloc_blocking(size).expect("alloc")))
            });
            g.bench_with_input(id("async"), &size, |b, &size| {
                b.to_async(&rt)
                    .iter(|| async { drop(pool.alloc(size).await.expect("alloc")) })
            });
        }
    }
    g.finish();
}

fn threads(c: &mut Criterion) {
    let rt = runtime();
    let pool = rt
        .block_on(async { PinnedAllocator::builder().build() })
        .expect("allocator");
    let mut g = c.benchmark_group("threads");
    let n = std::thread::available_parallelism().map_or(2, |n| n.get());
    for same_class in [true, false] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(
            BenchmarkId::new(
                if same_class {
                    "same_class"
                } else {
                    "own_class"
                },
                n,
            ),
            |b| {
                b.iter_custom(|iters| {
                    let start = Arc::new(std::sync::Barrier::new(n));
                    let t0 = Instant::now();
                    std::thread::scope(|s| {
                        for t in 0..n {
                            let pool = &pool;
                            let start = start.clone();
                            s.spawn(move || {
                                let size = if same_class { 4096 } else { 4096 << t };
                                drop(pool.alloc_blocking(size).expect("warm"));
                                start.wait();
                                for _ in 0..iters {
                                    drop(pool.alloc_blocking(size).expect("alloc"));
                                }
                            });
                        }
                    });
                    t0.elapsed()
                })
            },
        );
    }
    g.finish();
}

/// Allocate, record use on a stream, free. The simulated stream completes its event on a
/// worker thread a little later, so this times the parked-block path and its fallbacks; on a
/// GPU the event of an idle stream is usually complete by the next request.
fn record(c: &mut Criterion) {
    let rt = runtime();
    let sim = Arc::new(pinpool::sim::SimRuntime::new());
    let pool = rt
        .block_on(async { pinpool::Builder::new(sim.clone()).build() })
        .expect("allocator");
    let stream = sim.stream();
    let mut g = c.benchmark_group("record");
    g.throughput(Throughput::Elements(1));
    g.bench_function("alloc_record_free_1MiB", |b| {
        b.iter(|| {
            let mut buf = pool.alloc_blocking(1 << 20).expect("alloc");
            buf.record_stream(&stream).unwrap();
        })
    });
    g.finish();
}

/// Every benchmark of this file, with the settings of the command line.
fn benches() {
    let mut c = Criterion::default().configure_from_args();
    pair(&mut c);
    threads(&mut c);
    record(&mut c);
}

criterion_main!(benches);

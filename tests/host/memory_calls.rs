//! Where the pools take fresh memory: a request made on a plain thread (`alloc_blocking`,
//! `raw_alloc_with_stream`) that needs fresh memory has the memory source called on that
//! thread, which is awake and waiting anyway, instead of on a blocking thread of the runtime;
//! a request from a task, or one with a timeout, never has its thread block on the memory
//! source. Either way the memory is the same: the bytes copy through, nothing is lost.

use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::tuning::TieredPowerOfTwo;
use pinpool::{Builder, DeviceBuilder};
use pinpool_testkit::{best_fit_pool_on, multi_thread, segments_pool};

fn calls_here() -> u64 {
    SimRuntime::memory_calls_on_this_thread()
}

#[test]
fn a_blocking_request_that_needs_fresh_host_memory_maps_it_on_its_own_thread() {
    let rt = multi_thread(2);
    let (pool, sim) = best_fit_pool_on(&rt);
    let before = (calls_here(), sim.live_bytes());
    let mut buf = pool.alloc_blocking(6 << 20).expect("fresh memory");
    assert!(
        calls_here() > before.0,
        "the expandable range was mapped on another thread"
    );
    assert!(sim.live_bytes() >= before.1 + (6 << 20));
    buf.fill(7);
    assert!(pinpool_testkit::all_bytes_are(&buf, 7));
    // A cached request calls nothing.
    drop(buf);
    let cached = calls_here();
    drop(pool.alloc_blocking(6 << 20).expect("cached"));
    assert_eq!(calls_here(), cached);
    assert_eq!(sim.violations(), 0);
}

#[test]
fn a_blocking_request_for_a_segment_of_its_own_allocates_it_on_its_own_thread() {
    let rt = multi_thread(2);
    let _guard = rt.enter();
    for (name, pool) in [
        ("segments", segments_pool().0),
        (
            "tiered",
            Builder::new(Arc::new(SimRuntime::new()))
                .policy(Arc::new(TieredPowerOfTwo::default()))
                .build()
                .expect("allocator builds"),
        ),
    ] {
        let before = calls_here();
        drop(pool.alloc_blocking(3 << 20).expect("fresh memory"));
        assert!(calls_here() > before, "{name}: allocated on another thread");
    }
}

#[test]
fn a_request_from_a_task_never_calls_the_memory_source_on_its_thread() {
    let rt = multi_thread(2);
    let (pool, sim) = best_fit_pool_on(&rt);
    // `block_on` polls the request on this thread: the pool must not call the source here.
    let before = (calls_here(), sim.total_host_allocs());
    let buf = rt.block_on(pool.alloc(6 << 20)).expect("fresh memory");
    assert_eq!(
        calls_here(),
        before.0,
        "a task's thread blocked on the source"
    );
    assert!(sim.live_bytes() >= 6 << 20, "no fresh memory was taken");
    drop(buf);
}

#[test]
fn a_blocking_request_with_a_timeout_keeps_its_deadline_while_the_source_is_slow() {
    let rt = multi_thread(2);
    let _guard = rt.enter();
    let (pool, sim) = pinpool_testkit::sim_pool();
    sim.set_host_alloc_latency(std::time::Duration::from_millis(300));
    let before = calls_here();
    let t0 = std::time::Instant::now();
    let res = pool.alloc_blocking_timeout(1 << 20, std::time::Duration::from_millis(20));
    let took = t0.elapsed();
    assert!(
        matches!(res, Err(pinpool::Error::Timeout { .. })),
        "{:?}",
        res.map(|b| b.len())
    );
    assert!(
        took < std::time::Duration::from_millis(250),
        "the request waited for the slow call: {took:?}"
    );
    assert_eq!(calls_here(), before, "the request ran the source's call");
    // The memory the pool took meanwhile is cached, not lost: the next request gets it.
    sim.set_host_alloc_latency(std::time::Duration::ZERO);
    pinpool_testkit::eventually_blocking("the late allocation came back", || {
        pool.stats().num_host_alloc == 1
    });
    let allocs = sim.total_host_allocs();
    drop(pool.alloc_blocking(1 << 20).expect("cached"));
    assert_eq!(
        sim.total_host_allocs(),
        allocs,
        "the late block was not reused"
    );
}

#[test]
fn a_raw_device_request_that_needs_fresh_memory_maps_it_on_its_own_thread() {
    let rt = multi_thread(2);
    let sim = Arc::new(SimRuntime::new());
    let pool = DeviceBuilder::new(sim.clone())
        .handle(rt.handle().clone())
        .build()
        .expect("device allocator builds");
    let stream = sim.stream();
    for size in [4096usize, 16 << 20, 300 << 20] {
        let before = calls_here();
        let used = sim.device_used(0).unwrap_or(0);
        let p = pool
            .raw_alloc_with_stream(size, &stream)
            .expect("fresh device memory");
        assert!(
            calls_here() > before,
            "{size} bytes: the device memory was mapped on another thread"
        );
        assert!(sim.device_used(0).unwrap_or(0) >= used + size);
        pool.raw_delete(p).expect("known pointer");
        pool.empty_cache_blocking().expect("cache emptied");
    }
    assert_eq!(sim.device_used(0), Some(0), "every granule went back");
    assert_eq!(sim.violations(), 0);
}

//! A stream's pool lives while it is used: `empty_cache` retires every stream pool that
//! holds nothing (no buffer in use, none cached, none waiting on events) and served no
//! request since the call before, which stops its actor, gives its address range back and
//! lets its stream go, while the allocator's statistics keep what the pool counted. The
//! stream's next request gets a new pool, also when it was already on its way to the old
//! one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pinpool_testkit::sim_device_pool as device_pool;

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_cache_retires_an_idle_streams_pool_with_its_range_and_its_stream() {
    let (pool, sim) = device_pool();
    // The stream is used from a thread that ends: a thread remembers the pools of the
    // streams it used last (a few) and holds them until it uses others or ends (joined,
    // its thread-locals are gone).
    let (p, sm) = (pool.clone(), sim.clone());
    std::thread::spawn(move || {
        let s = sm.stream();
        let a = p.alloc_blocking(MIB, &s).unwrap();
        s.fill_device(a.device_ptr(), MIB, 7).unwrap();
        drop(a);
        s.synchronize().unwrap();
    })
    .join()
    .unwrap();
    let before = pool.stats(0).unwrap();
    assert_eq!(
        sim.device_reservations(0),
        Some(1),
        "the stream's pool reserved a range"
    );
    assert_eq!(
        sim.device_streams(0),
        Some(1),
        "the pool keeps its stream alive"
    );

    pool.empty_cache().await.unwrap();
    let kept = sim.device_reservations(0);
    assert_eq!(kept, Some(1), "used since the call before: kept");
    let freed = pool.stats(0).unwrap().num_device_free;
    assert_eq!(freed, before.num_device_free + 1, "its memory went back");
    pool.empty_cache().await.unwrap();

    assert_eq!(sim.device_reservations(0), Some(0), "its range went back");
    // The stream goes with the pool's last holder, its actor as it ends.
    let streams = || sim.device_streams(0) == Some(0);
    pinpool_testkit::eventually("its stream is let go", streams).await;
    let after = pool.stats(0).unwrap();
    assert_eq!(
        after.allocation.all.allocated, 1,
        "what the pool counted stays counted"
    );
    assert_eq!(after.num_device_alloc, before.num_device_alloc);
    assert_eq!(after.num_device_free, before.num_device_free + 1);
    assert_eq!(after.reserved_bytes.all.current, 0);
    assert_eq!(after.allocated_bytes.all.peak, MIB as i64, "peaks stay");
    assert_eq!(sim.violations(), 0);
}

#[tokio::test]
async fn a_stream_used_between_two_calls_keeps_its_pool() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    for round in 0..4u8 {
        let a = pool.alloc(MIB, &s).await.unwrap();
        s.fill_device(a.device_ptr(), MIB, round).unwrap();
        drop(a);
        s.synchronize().unwrap();
        pool.empty_cache().await.unwrap();
        let kept = sim.device_reservations(0);
        assert_eq!(kept, Some(1), "round {round}: kept");
    }
    pool.empty_cache().await.unwrap();
    let kept = sim.device_reservations(0);
    assert_eq!(
        kept,
        Some(0),
        "retired once a call passed with the stream unused"
    );
}

#[tokio::test]
async fn a_streams_pool_that_holds_a_buffer_or_a_pending_free_is_not_retired() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let other = sim.stream();
    let mut a = pool.alloc(MIB, &s).await.unwrap();
    pool.empty_cache().await.unwrap();
    assert_eq!(
        sim.device_reservations(0),
        Some(1),
        "a buffer in use keeps its pool"
    );
    s.fill_device(a.device_ptr(), MIB, 3).unwrap();
    s.synchronize().unwrap();

    // Freed while another stream's work on it has not run: it waits on an event.
    let hold = other.hold();
    other.fill_device(a.device_ptr(), MIB, 4).unwrap();
    a.record_stream(&other).unwrap();
    drop(a);
    pool.empty_cache().await.unwrap();
    assert_eq!(
        sim.device_reservations(0),
        Some(1),
        "a pending free keeps its pool"
    );
    pool.empty_cache().await.unwrap();
    let kept = sim.device_reservations(0);
    assert_eq!(kept, Some(1), "and at the call after");

    drop(hold);
    other.synchronize().unwrap();
    pinpool_testkit::eventually("the pending free completes", || {
        pool.stats(0).unwrap().active.all.current == 0
    })
    .await;
    pool.empty_cache().await.unwrap();
    assert_eq!(
        sim.device_reservations(0),
        Some(0),
        "retired once it holds nothing"
    );
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn a_stream_whose_pool_was_retired_gets_a_new_pool_at_its_next_request() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    for round in 1..=3i64 {
        let a = pool.alloc(MIB, &s).await.unwrap();
        s.fill_device(a.device_ptr(), MIB, round as u8).unwrap();
        drop(a);
        s.synchronize().unwrap();
        // The same thread asks again: the route it remembers names the retired pool.
        pool.empty_cache().await.unwrap();
        pool.empty_cache().await.unwrap();
        assert_eq!(sim.device_reservations(0), Some(0));
        let stats = pool.stats(0).unwrap();
        assert_eq!(stats.allocation.all.allocated, round);
        assert_eq!(stats.num_device_alloc, round, "each round maps anew");
    }
    let b = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(sim.device_reservations(0), Some(1));
    drop(b);
    pool.reset_accumulated_stats(0).unwrap();
    pool.reset_peak_stats(0).unwrap();
    let stats = pool.stats(0).unwrap();
    assert_eq!(
        stats.allocation.all.allocated, 0,
        "resets reach the retired pools' counts"
    );
    assert_eq!(stats.num_device_alloc, 0);
    assert_eq!(sim.violations(), 0);
}

/// Threads allocate, write and free on streams of their own while another empties the
/// cache over and over: every request is served (a request on its way to a pool being
/// retired asks for the stream's new pool), and no block is reused while a stream's work
/// still touches it.
#[test]
fn requests_racing_the_retirement_of_their_streams_pools_are_all_served() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let (pool, sim) = device_pool();
    let stop = Arc::new(AtomicBool::new(false));
    let emptier = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                pool.empty_cache_blocking().unwrap();
                n += 1;
            }
            n
        })
    };
    let workers: Vec<_> = (0..4u8)
        .map(|t| {
            let (pool, sim) = (pool.clone(), sim.clone());
            std::thread::spawn(move || {
                // Each stream serves a few requests with pauses between them, long enough
                // for the emptier to retire its pool now and then, and a new one.
                let mut s = sim.stream();
                for i in 0..200usize {
                    if i % 4 == 0 {
                        s = sim.stream();
                    }
                    let size = (1 + (i * 7 + t as usize) % 8) * 64 * 1024;
                    let a = pool.alloc_blocking(size, &s).expect("served");
                    s.fill_device(a.device_ptr(), size, t).unwrap();
                    drop(a);
                    s.synchronize().unwrap();
                    let pause = std::time::Instant::now();
                    while pause.elapsed() < std::time::Duration::from_micros(20 * (i as u64 % 8)) {
                        std::hint::spin_loop();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = emptier.join().unwrap();
    assert!(rounds > 0);
    pool.empty_cache_blocking().unwrap();
    let stats = pool.stats(0).unwrap();
    assert_eq!(
        stats.allocation.all.allocated, 800,
        "every request counted once"
    );
    assert_eq!(stats.allocation.all.current, 0);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

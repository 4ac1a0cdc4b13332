//! The memory limit: a request that would pass the cap empties every cache, then waits first
//! come first served (or fails at once with `try_alloc`, or after its timeout); a request
//! larger than the cap fails at once; dropped waiting futures leave no trace.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::SimRuntime;
use pinpool::{Builder, Error, OomCause, PinnedAllocator};
use pinpool_testkit::{assert_books_balance, eventually};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn limited(bytes: usize) -> (PinnedAllocator<SimRuntime>, SimRuntime) {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .max_bytes(bytes)
        .build()
        .expect("builds");
    (pool, sim)
}

/// Waits until `n` requests are queued for room: the order in which they arrived.
async fn queued(pool: &PinnedAllocator<SimRuntime>, n: usize) {
    let engine = pinpool::tuning::engine(pool);
    eventually("the request is queued", || engine.waiting_requests() == n).await;
}

#[tokio::test]
async fn alloc_waits_at_the_limit_until_a_buffer_comes_back() {
    let (pool, sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let ptr = held.as_ptr() as usize;
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.alloc(MIB).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!waiter.is_finished(), "no room: the request waits");
    assert_eq!(pool.reserved_bytes(), MIB);

    drop(held);
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter is served once the buffer comes back")
        .unwrap()
        .unwrap();
    assert_eq!(got.as_ptr() as usize, ptr, "handed straight over");
    assert_eq!(sim.total_host_allocs(), 1);
    assert_eq!(sim.live_bytes(), MIB);
    drop(got);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_request_past_the_limit_first_empties_the_cache() {
    // One host allocation per block, so the two cached blocks stay apart.
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .max_bytes(MIB)
        .policy(Arc::new(pinpool::tuning::TieredPowerOfTwo::default()))
        .build()
        .expect("builds");
    drop(pool.alloc(512 * KIB).await.unwrap());
    drop(pool.alloc(256 * KIB).await.unwrap());
    assert_eq!(sim.live_bytes(), 768 * KIB, "both cached");

    let big = pool.try_alloc(MIB).await.expect("the cache made room");
    assert_eq!(sim.live_bytes(), MIB);
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_host_free, 2);
    drop(big);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn emptying_for_room_reaches_capture_pools() {
    let (pool, sim) = limited(MIB);
    let stream = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    let private = pool.alloc_on(512 * KIB, &stream).await.unwrap();
    assert_eq!(private.pool(), Some(id));
    drop(private); // cached in the capture pool
    pool.end_allocate_to_pool(id).await.unwrap();
    assert_eq!(pool.reserved_bytes(), 512 * KIB);

    let big = pool
        .try_alloc(MIB)
        .await
        .expect("the capture pool's cache made room");
    assert_eq!(pool.pool_stats(id).unwrap().allocated_bytes.current, 0);
    assert_eq!(sim.live_bytes(), MIB);
    drop(big);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn try_alloc_fails_at_once_with_the_limit_in_the_error() {
    let (pool, sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let t0 = Instant::now();
    let err = pool.try_alloc(4 * KIB).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert_eq!(
        err,
        Error::OutOfMemory {
            requested: 4 * KIB,
            reserved: MIB,
            limit: Some(MIB),
            cause: OomCause::NoRoomNow,
        }
    );
    assert_eq!(pool.stats().num_ooms, 1);
    assert_eq!(pool.stats().num_alloc_retries, 1);
    drop(held);
    let ok = pool.try_alloc(4 * KIB).await.expect("room again");
    drop(ok);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_request_larger_than_the_limit_fails_at_once() {
    let (pool, sim) = limited(MIB);
    let t0 = Instant::now();
    let err = pool.alloc(MIB + 1).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "no waiting");
    assert!(matches!(
        err,
        Error::OutOfMemory {
            requested,
            limit: Some(l),
            cause: OomCause::ExceedsLimit,
            ..
        } if requested == MIB + 1 && l == MIB
    ));
    assert!(err.never_fits(), "{err}");
    assert!(
        err.to_string().contains("never fit under the limit"),
        "{err}"
    );
    let p = pool.clone();
    assert!(pinpool_testkit::on_plain_thread(move || p.alloc_blocking(3 * MIB).is_err()).await);
    assert_eq!(
        sim.total_host_allocs(),
        0,
        "nothing was asked of the runtime"
    );
    assert_eq!(pool.stats().num_ooms, 2);
}

#[tokio::test]
async fn alloc_timeout_gives_up_and_changes_nothing() {
    let (pool, sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let t0 = Instant::now();
    let err = pool
        .alloc_timeout(512 * KIB, Duration::from_millis(50))
        .await
        .unwrap_err();
    let waited = t0.elapsed();
    assert_eq!(
        err,
        Error::Timeout {
            requested: 512 * KIB,
            timeout: Duration::from_millis(50)
        }
    );
    assert!(waited >= Duration::from_millis(50) && waited < Duration::from_secs(2));
    assert_eq!(pool.stats().num_ooms, 1);
    assert_books_balance(&pool, &sim, 1).await;
    drop(held);
    let next = pool
        .alloc_timeout(512 * KIB, Duration::from_millis(50))
        .await
        .expect("the timed-out waiter is gone; room is there");
    drop(next);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn the_builder_timeout_applies_to_alloc() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .max_bytes(MIB)
        .alloc_timeout(Duration::from_millis(20))
        .build()
        .unwrap();
    // A wait of its own for the first request (a loaded machine must not time it out).
    let held = pool
        .alloc_timeout(MIB, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(matches!(pool.alloc(MIB).await, Err(Error::Timeout { .. })));
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.config.alloc_timeout_ms, Some(20));
    drop(held);
}

#[tokio::test]
async fn waiters_are_served_first_come_first_served() {
    let (pool, sim) = limited(MIB);
    let a = pool.alloc(512 * KIB).await.unwrap();
    let b = pool.alloc(512 * KIB).await.unwrap();
    let (order_tx, order_rx) = flume::unbounded();
    // The first waiter needs the whole budget; the second would fit after one free, but
    // must not overtake the first.
    let mut tasks = Vec::new();
    for (n, size) in [(1, MIB), (2, 512 * KIB)] {
        let (mine, order) = (pool.clone(), order_tx.clone());
        tasks.push(tokio::spawn(async move {
            let buf = mine.alloc(size).await.unwrap();
            order.send(n).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(buf);
        }));
        queued(&pool, n as usize).await;
    }
    drop(a);
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        order_rx.is_empty(),
        "the second waiter fits now but waits behind the first"
    );
    drop(b);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .expect("every waiter is served")
            .unwrap();
    }
    let order: Vec<i32> = order_rx.drain().collect();
    assert_eq!(order, vec![1, 2]);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn same_size_waiters_are_served_in_arrival_order() {
    let (pool, sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let (order_tx, order_rx) = flume::unbounded();
    let mut tasks = Vec::new();
    for n in 0..5 {
        let (mine, order) = (pool.clone(), order_tx.clone());
        tasks.push(tokio::spawn(async move {
            let buf = mine.alloc(MIB).await.unwrap();
            order.send(n).unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
            drop(buf);
        }));
        queued(&pool, n as usize + 1).await;
    }
    drop(held);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(order_rx.drain().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    assert_eq!(
        sim.total_host_allocs(),
        1,
        "one block went from waiter to waiter"
    );
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_block_waiting_on_stream_work_reaches_a_waiter_when_the_work_is_done() {
    let (pool, sim) = limited(MIB);
    let stream = sim.stream();
    let hold = stream.hold();
    let mut used = pool.alloc(MIB).await.unwrap();
    used.record_stream(&stream).unwrap();
    drop(used); // waits on the stream's event
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.alloc(MIB).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!waiter.is_finished(), "the only block waits on stream work");
    drop(hold);
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(sim.total_host_allocs(), 1);
    drop(got);
    assert_eq!(sim.violations(), 0);
}

#[tokio::test]
async fn raising_the_limit_lets_waiters_in() {
    let (pool, sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let waiter = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.alloc(MIB).await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!waiter.is_finished());
    pool.set_max_bytes(Some(2 * MIB)).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(sim.live_bytes(), 2 * MIB);
    assert_eq!(
        pool.set_max_bytes(Some(0)),
        Err(Error::InvalidLimit {
            reason: "a cap of 0 bytes leaves no room for any request".into()
        })
    );
    assert_eq!(
        pool.max_bytes(),
        Some(2 * MIB),
        "a refused cap changes nothing"
    );
    drop((held, got));
}

#[test]
fn alloc_blocking_waits_with_a_timeout() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .max_bytes(MIB)
        .build()
        .unwrap();
    let held = pool.alloc_blocking(MIB).unwrap();
    let t0 = Instant::now();
    let err = pool
        .alloc_blocking_timeout(MIB, Duration::from_millis(30))
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }));
    assert!(t0.elapsed() >= Duration::from_millis(30));

    let waiter = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.alloc_blocking_timeout(MIB, Duration::from_secs(5)))
    };
    std::thread::sleep(Duration::from_millis(30));
    drop(held);
    let got = waiter
        .join()
        .unwrap()
        .expect("served when the buffer came back");
    assert_eq!(sim.total_host_allocs(), 1);
    drop(got);
    drop(pool);
    pinpool_testkit::eventually_blocking("all memory back", || sim.live_bytes() == 0);
}

/// A tiny deterministic generator for the cancellation test.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

#[tokio::test]
async fn a_dropped_waiter_does_not_hold_up_the_one_behind_it() {
    let (pool, sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let first = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.alloc(MIB).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.alloc(512 * KIB).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    first.abort();
    let _ = first.await;
    drop(held);
    let got = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("served although the waiter before it was dropped")
        .unwrap()
        .unwrap();
    assert_eq!(got.capacity(), 512 * KIB);
    drop(got);
    assert_books_balance(&pool, &sim, 0).await;
}

/// Many requests under a tight cap, dropped at random points of their wait (by a timeout
/// around `alloc`, or by aborting their task); returns how many were served.
async fn churn(pool: &PinnedAllocator<SimRuntime>, seed: u64) -> (usize, usize) {
    let mut rng = Lcg(seed);
    let mut tasks = Vec::new();
    for i in 0..60 {
        let pool = pool.clone();
        let size = [64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB][rng.next(4) as usize];
        let give_up = Duration::from_micros(rng.next(3000));
        let hold = Duration::from_micros(rng.next(2000));
        let abort_after = (i % 3 == 0).then(|| Duration::from_micros(rng.next(2000)));
        let task = tokio::spawn(async move {
            match tokio::time::timeout(give_up, pool.alloc(size)).await {
                Ok(Ok(buf)) => {
                    tokio::time::sleep(hold).await;
                    drop(buf);
                    true
                }
                _ => false,
            }
        });
        if let Some(d) = abort_after {
            let abort = task.abort_handle();
            tokio::spawn(async move {
                tokio::time::sleep(d).await;
                abort.abort();
            });
        }
        tasks.push(task);
        if rng.next(4) == 0 {
            tokio::time::sleep(Duration::from_micros(rng.next(500))).await;
        }
    }
    let (mut served, mut dropped) = (0, 0);
    for t in tasks {
        match t.await {
            Ok(true) => served += 1,
            _ => dropped += 1,
        }
    }
    (served, dropped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiting_futures_leave_no_trace() {
    let (pool, sim) = limited(MIB);
    let (mut served, mut dropped) = (0, 0);
    for seed in 1..=4 {
        let (s, d) = churn(&pool, seed).await;
        served += s;
        dropped += d;
        // Everything balances and nothing is left queued.
        eventually("no block in flight", || {
            pool.stats().active_requests.current == 0
        })
        .await;
        assert_books_balance(&pool, &sim, 0).await;
        assert!(pool.reserved_bytes() <= MIB);
        assert_eq!(pool.reserved_bytes(), sim.live_bytes());
        let whole = tokio::time::timeout(Duration::from_secs(5), pool.alloc(MIB))
            .await
            .expect("a later request is not stuck behind dead waiters")
            .unwrap();
        assert_eq!(sim.live_bytes(), MIB);
        drop(whole);
    }
    assert!(
        served > 0 && dropped > 0,
        "served {served}, dropped {dropped}"
    );
    assert_eq!(sim.violations(), 0);
    drop(pool);
    eventually("all memory back", || sim.live_bytes() == 0).await;
}

#[tokio::test]
async fn memory_fraction_outside_zero_to_one_is_refused() {
    for bad in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
        let r = PinnedAllocator::builder().memory_fraction(bad).build();
        assert!(
            matches!(r, Err(Error::InvalidLimit { .. })),
            "fraction {bad} is refused"
        );
    }
    let pool = PinnedAllocator::builder().build().unwrap();
    assert!(matches!(
        pool.set_memory_fraction(1.01),
        Err(Error::InvalidLimit { .. })
    ));
    assert_eq!(pool.max_bytes(), None, "a refused fraction changes nothing");
    if std::path::Path::new("/proc/meminfo").exists() {
        let ram = pinpool::host_memory_bytes().unwrap();
        let pool = PinnedAllocator::builder()
            .memory_fraction(0.5)
            .build()
            .unwrap();
        assert_eq!(pool.max_bytes(), Some(ram / 2));
        pool.set_memory_fraction(0.25).unwrap();
        assert_eq!(pool.max_bytes(), Some((ram as f64 * 0.25) as usize));
    }
    assert!(matches!(
        PinnedAllocator::builder().max_bytes(0).build(),
        Err(Error::InvalidLimit { .. })
    ));
}

#[tokio::test]
async fn the_stats_map_reports_the_limit_and_the_counts() {
    let (pool, _sim) = limited(MIB);
    let held = pool.alloc(MIB).await.unwrap();
    let _ = pool.try_alloc(MIB).await.unwrap_err();
    let m = pool.stats().to_map();
    assert_eq!(m["limit_bytes"], MIB as i64);
    assert_eq!(m["num_ooms"], 1);
    assert_eq!(m["num_alloc_retries"], 1);
    drop(held);
    let (unlimited, _sim) = pinpool_testkit::sim_pool();
    assert!(!unlimited.stats().to_map().contains_key("limit_bytes"));
}

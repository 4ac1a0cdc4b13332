//! Device memory under a cap, and when the device itself runs out: `alloc` waits for room
//! (first come, first served), `try_alloc` fails at once, and driver out-of-memory empties
//! the caches and retries once before a typed error that the OOM observers hear of.

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::{FaultPoint, SimRuntime};
use pinpool::{DeviceBuilder, Error, MemoryKind, OomCause, OomReport};
use pinpool_testkit::{capped_device_pool, eventually};

const MIB: usize = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alloc_waits_at_the_cap_until_a_buffer_comes_back() {
    let (pool, sim) = capped_device_pool(8 * MIB);
    let s = sim.stream();
    let held = pool.alloc(6 * MIB, &s).await.unwrap();
    let waiter = {
        let (pool, s) = (pool.clone(), s.clone());
        tokio::spawn(async move { pool.alloc(6 * MIB, &s).await.map(|b| b.len()) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "no room yet: it waits");
    let err = pool.try_alloc(6 * MIB, &s).await.unwrap_err();
    assert!(matches!(
        err,
        Error::OutOfMemory { limit: Some(l), cause: OomCause::NoRoomNow, .. } if l == 8 * MIB
    ));
    assert!(!err.never_fits(), "it fits once the held buffer comes back");
    drop(held);
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("served once the buffer came back")
        .unwrap()
        .unwrap();
    assert_eq!(got, 6 * MIB);
    assert!(pool.reserved_bytes(0).unwrap() <= 8 * MIB);
}

#[tokio::test]
async fn a_timeout_gives_up_and_changes_nothing() {
    let (pool, sim) = capped_device_pool(4 * MIB);
    let s = sim.stream();
    let held = pool.alloc(4 * MIB, &s).await.unwrap();
    let err = pool
        .alloc_timeout(MIB, &s, Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    drop(held);
    assert!(pool.alloc(MIB, &s).await.is_ok());
}

#[tokio::test]
async fn memory_fraction_caps_each_device_and_bad_fractions_are_refused() {
    let sim = SimRuntime::builder().device_capacity(100 * MIB).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .memory_fraction(0.25)
        .build()
        .unwrap();
    assert_eq!(pool.max_bytes(0).unwrap(), Some(25 * MIB));
    assert!(matches!(
        pool.set_memory_fraction(1.5, 0),
        Err(Error::InvalidLimit { .. })
    ));
    assert_eq!(pool.max_bytes(0).unwrap(), Some(25 * MIB), "unchanged");
    pool.set_memory_fraction(0.5, 0).unwrap();
    assert_eq!(pool.max_bytes(0).unwrap(), Some(50 * MIB));
    assert!(matches!(
        DeviceBuilder::new(Arc::new(sim.clone()))
            .memory_fraction(0.0)
            .build(),
        Err(Error::InvalidLimit { .. })
    ));
    let (free, total) = pool.memory_info(0).unwrap();
    assert_eq!((free, total), (100 * MIB, 100 * MIB));
}

#[tokio::test]
async fn without_lending_device_out_of_memory_empties_the_cache_and_retries_once() {
    let sim = SimRuntime::builder().device_capacity(8 * MIB).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .lend_between_streams(false)
        .build()
        .unwrap();
    let s = sim.stream();
    drop(pool.alloc(5 * MIB, &s).await.unwrap()); // cached: 6 MiB of granules stay mapped
    assert!(sim.device_used(0).unwrap() >= 5 * MIB);
    // Another stream's pool cannot use the cached memory: the device is full, the caches
    // are emptied, and the retry succeeds.
    let other = sim.stream();
    let b = pool.alloc(6 * MIB, &other).await.unwrap();
    assert_eq!(b.len(), 6 * MIB);
    let st = pool.stats(0).unwrap();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 0);
}

#[tokio::test]
async fn device_out_of_memory_after_the_retry_is_a_typed_error_with_a_report() {
    let sim = SimRuntime::builder().device_capacity(8 * MIB).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let (tx, rx) = flume::unbounded::<OomReport>();
    pool.attach_oom_observer(move |r| {
        let _ = tx.send(*r);
    });
    let s = sim.stream();
    let held = pool.alloc(6 * MIB, &s).await.unwrap();
    let err = pool.alloc(4 * MIB, &s).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfMemory { requested, limit: None, cause: OomCause::NoRoomNow, .. }
                if requested == 4 * MIB
        ),
        "{err:?}"
    );
    let report = tokio::time::timeout(Duration::from_secs(5), rx.recv_async())
        .await
        .expect("the OOM observer is told")
        .unwrap();
    assert_eq!(report.memory, MemoryKind::Device(0));
    assert_eq!(report.requested, 4 * MIB);
    assert!(report.allocated >= 6 * MIB);
    assert!(report.reserved >= 6 * MIB);
    assert_eq!(
        report.driver_free,
        Some(8 * MIB - sim.device_used(0).unwrap()),
        "what the device still had"
    );
    let st = pool.stats(0).unwrap();
    assert_eq!((st.num_alloc_retries, st.num_ooms), (1, 1));
    drop(held);
    eventually("room again", || {
        pool.stats(0).unwrap().active.all.current == 0
    })
    .await;
    assert!(pool.alloc(4 * MIB, &s).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_map_that_fails_leaves_its_granules_out_of_the_books_and_the_next_request_maps_them() {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    // The stream's pool and its expandable range exist before the fault.
    drop(pool.alloc(4096, &s).await.unwrap());
    let used = sim.device_used(0).unwrap();
    let reserved = pool.reserved_bytes(0).unwrap();

    // The map fails, and so does the one retry after the caches are emptied.
    sim.faults().fail_next(FaultPoint::DeviceAlloc, 2);
    let err = pool.alloc(64 * MIB, &s).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    assert!(sim.device_used(0).unwrap() <= used, "nothing stayed mapped");
    assert!(pool.reserved_bytes(0).unwrap() <= reserved);

    // The same granules serve the next request: mapped this time, and writable.
    let b = pool.alloc(64 * MIB, &s).await.unwrap();
    assert!(sim.device_used(0).unwrap() >= 64 * MIB);
    assert_eq!(
        sim.device_used(0).unwrap(),
        pool.reserved_bytes(0).unwrap(),
        "the pool's books and the device agree"
    );
    s.fill_device(b.device_ptr(), 64 * MIB, 7).unwrap();
    s.synchronize().unwrap();
    drop(b);
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(0), Some(0));
    assert_eq!(pool.reserved_bytes(0).unwrap(), 0);
}

#[tokio::test]
async fn a_request_larger_than_the_cap_is_refused_at_once_as_one_that_can_never_fit() {
    let (pool, sim) = capped_device_pool(8 * MIB);
    let s = sim.stream();
    let held = pool.alloc(6 * MIB, &s).await.unwrap();
    // Over the cap: never fits, whether the call would wait or not.
    for err in [
        pool.alloc(9 * MIB, &s).await.unwrap_err(),
        pool.try_alloc(9 * MIB, &s).await.unwrap_err(),
    ] {
        assert!(
            matches!(
                err,
                Error::OutOfMemory { requested, limit: Some(l), cause: OomCause::ExceedsLimit, .. }
                    if requested == 9 * MIB && l == 8 * MIB
            ),
            "{err:?}"
        );
        assert!(err.never_fits());
    }
    // Under the cap but not now: full right now, it may fit later.
    let err = pool.try_alloc(4 * MIB, &s).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfMemory {
                cause: OomCause::NoRoomNow,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.never_fits());
    drop(held);
    eventually("room again", || {
        pool.stats(0).unwrap().active.all.current == 0
    })
    .await;
    assert!(pool.try_alloc(4 * MIB, &s).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_lending_room_made_under_the_cap_is_what_the_cap_lacks_and_the_rest_stays_cached() {
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .max_bytes(16 * MIB)
        .lend_between_streams(false)
        .build()
        .unwrap();
    let (a, b) = (sim.stream(), sim.stream());
    // Stream a's pool caches 12 MiB in six blocks.
    let blocks: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..6 {
            v.push(pool.alloc(2 * MIB, &a).await.unwrap());
        }
        v
    };
    drop(blocks);
    assert_eq!(pool.reserved_bytes(0).unwrap(), 12 * MIB);
    let before = pool.stats(0).unwrap();
    // Stream b needs 8 MiB: 4 MiB over the cap, so stream a gives back 4 MiB, not 12.
    let big = pool.alloc(8 * MIB, &b).await.unwrap();
    let after = pool.stats(0).unwrap();
    assert_eq!(pool.reserved_bytes(0).unwrap(), 16 * MIB);
    assert_eq!(after.num_alloc_retries - before.num_alloc_retries, 1);
    // What stream a still caches serves it again without fresh memory.
    let again = pool.alloc(2 * MIB, &a).await.unwrap();
    assert_eq!(
        pool.stats(0).unwrap().num_device_alloc,
        after.num_device_alloc
    );
    drop((big, again));
}

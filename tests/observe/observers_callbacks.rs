//! Observers: trace trackers see every entry while history is on, OOM observers see every
//! out-of-memory failure; both run on the observer task, so that a slow, re-entrant or
//! panicking callback never holds up the allocator.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinpool::sim::SimRuntime;
use pinpool::tuning::TieredPowerOfTwo;
use pinpool::{Builder, Error, HistoryContext, OomReport, TraceAction};
use pinpool_testkit::{eventually, sim_pool};

#[tokio::test]
async fn a_trace_tracker_sees_every_entry_in_order() {
    let (pool, _sim) = sim_pool();
    let (tx, rx) = flume::unbounded();
    pool.attach_trace_tracker(move |e| {
        let _ = tx.send(e.action);
    });
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    drop(pool.alloc(512).await.unwrap());
    pool.record_annotation("done");
    let mut seen = Vec::new();
    while seen.len() < 5 {
        let a = tokio::time::timeout(Duration::from_secs(5), rx.recv_async())
            .await
            .expect("the tracker is called")
            .unwrap();
        seen.push(a);
    }
    use TraceAction::*;
    assert_eq!(
        seen,
        [
            SegmentAlloc,
            Alloc,
            FreeRequested,
            FreeCompleted,
            UserDefined
        ]
    );
}

#[tokio::test]
async fn a_trace_tracker_is_not_called_while_history_is_off() {
    let (pool, _sim) = sim_pool();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    pool.attach_trace_tracker(move |_| {
        c.fetch_add(1, Ordering::Relaxed);
    });
    drop(pool.alloc(512).await.unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(calls.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn an_oom_observer_is_told_the_request_and_what_was_reserved() {
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(1 << 20));
    let pool = Builder::new(Arc::new(sim.clone())).build().unwrap();
    let (tx, rx) = flume::unbounded::<OomReport>();
    pool.attach_oom_observer(move |r| {
        let _ = tx.send(*r);
    });
    let keep = pool.alloc(1 << 19).await.unwrap();
    let err = pool.alloc(1 << 20).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    let r = tokio::time::timeout(Duration::from_secs(5), rx.recv_async())
        .await
        .expect("the observer is called")
        .unwrap();
    assert_eq!(r.requested, 1 << 20);
    assert_eq!(r.reserved, 1 << 19);
    assert!(r.pool.is_default());
    drop(keep);
}

#[tokio::test]
async fn a_callback_that_blocks_does_not_stall_allocations() {
    let sim = SimRuntime::new();
    sim.set_memory_limit(Some(1 << 20));
    let pool = Builder::new(Arc::new(sim.clone())).build().unwrap();
    let (release, blocked) = flume::bounded::<()>(1);
    let entered = Arc::new(AtomicBool::new(false));
    let (e1, b1) = (entered.clone(), blocked.clone());
    pool.attach_trace_tracker(move |_| {
        e1.store(true, Ordering::Relaxed);
        let _ = b1.recv(); // blocks until the test ends
    });
    pool.attach_oom_observer(move |_| {
        let _ = blocked.recv();
    });
    pool.record_history(true, 100, HistoryContext::None)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    eventually("the tracker is running", || entered.load(Ordering::Relaxed)).await;

    let t0 = Instant::now();
    for i in 0..20_000usize {
        let size = 64 << (i % 8); // cached path, and a few misses
        drop(pool.alloc(size).await.unwrap());
    }
    for _ in 0..3 {
        assert!(pool.alloc(4 << 20).await.is_err());
    }
    pool.empty_cache().await.unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "allocations went on while the callbacks were blocked: {:?}",
        t0.elapsed()
    );
    assert!(pool.history().await.unwrap().entries.len() == 100);
    drop(release);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_may_call_back_into_the_allocator() {
    let (pool, _sim) = sim_pool();
    let done = Arc::new(AtomicUsize::new(0));
    let once = Arc::new(AtomicBool::new(false));
    let (p, d, o) = (pool.clone(), done.clone(), once.clone());
    pool.attach_trace_tracker(move |e| {
        let _ = p.stats();
        if e.action == TraceAction::Alloc && !o.swap(true, Ordering::Relaxed) {
            // A miss from inside a callback: a round trip to the pool actor.
            let buf = p.alloc_blocking(1 << 20).expect("alloc from a callback");
            drop(buf);
            let _ = p.history_blocking().expect("history from a callback");
            d.fetch_add(1, Ordering::Relaxed);
        }
    });
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    for _ in 0..100 {
        drop(pool.alloc(4096).await.unwrap());
    }
    eventually("the re-entrant callback finished", || {
        done.load(Ordering::Relaxed) == 1
    })
    .await;
    drop(pool.alloc(8192).await.unwrap());
}

#[tokio::test]
async fn a_panicking_callback_is_contained_and_stays_attached() {
    let (pool, _sim) = sim_pool();
    let calls = Arc::new(AtomicUsize::new(0));
    let after = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    pool.attach_trace_tracker(move |_| {
        c.fetch_add(1, Ordering::Relaxed);
        panic!("a tracker that panics");
    });
    let a = after.clone();
    pool.attach_trace_tracker(move |_| {
        a.fetch_add(1, Ordering::Relaxed);
    });
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    drop(pool.alloc(64).await.unwrap());
    eventually("both trackers saw all four entries", || {
        calls.load(Ordering::Relaxed) == 4 && after.load(Ordering::Relaxed) == 4
    })
    .await;
    drop(pool.alloc(64).await.unwrap());
    eventually("the panicking tracker is still called", || {
        calls.load(Ordering::Relaxed) == 7
    })
    .await;
}

/// Free-memory callbacks on pinned memory: a callback that frees makes room for a request
/// the cap would refuse; one that frees nothing leaves the typed error, called once for it;
/// with room to spare no callback is called. (Whole blocks: under `bestfit` a cap this small
/// gives the pool separate segments, and it gives a wholly free one back before it asks for
/// room.)
#[tokio::test]
async fn a_free_memory_callback_makes_room_for_pinned_memory_and_one_that_frees_nothing_does_not() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .max_bytes(8 << 20)
        .build()
        .unwrap();
    let small = pool.try_alloc(4096).await.unwrap();
    assert_eq!(
        pool.free_memory_callback_calls(),
        0,
        "room to spare: not called"
    );
    drop(small);

    let (spare, spares) = flume::unbounded();
    pool.attach_free_memory_callback(move || spares.drain().count() > 0);
    // The cached 4 KiB block leaves no room for 8 MiB: the callback runs (nothing to give
    // up yet), then the caches are emptied.
    spare.send(pool.alloc(8 << 20).await.unwrap()).unwrap();
    assert_eq!(pool.free_memory_callback_calls(), 1);
    let buf = pool.try_alloc(4 << 20).await.unwrap();
    assert_eq!(
        pool.free_memory_callback_calls(),
        2,
        "it gave up the spare buffer"
    );

    // Nothing left to give up: the request fails as it would without callbacks.
    let held = pool.try_alloc(4 << 20).await.unwrap();
    let err = pool.try_alloc(4 << 20).await.unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { limit: Some(_), .. }),
        "{err:?}"
    );
    assert_eq!(pool.free_memory_callback_calls(), 3);
    assert_eq!(pool.free_memory_callback_panics(), 0);
    drop((buf, held));
}

//! Capture pools for stream capture (invariant 4): allocations for a capturing stream go to
//! the capture's pool; a block used by captured work is never reused while the pool lives,
//! so graph replays read the right bytes; a block never used is reusable.

use pinpool::sim::SimDeviceBuffer;
use pinpool::{Error, PoolId};
use pinpool_testkit::{assert_books_balance, sim_pool};

#[tokio::test]
async fn allocations_for_a_stream_the_filter_accepts_go_to_the_capture_pool() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let other = sim.stream();
    let id = pinpool::PoolId::fresh();
    let cap_id = cap.id();
    pool.begin_allocate_to_pool(id, move |s| s.id() == cap_id)
        .await
        .unwrap();
    cap.begin_capture().unwrap();

    let a = pool.alloc_on(4096, &cap).await.unwrap();
    assert_eq!(a.pool(), Some(id));
    assert!(a.allocated_during_capture());
    let b = pool.alloc_on(4096, &other).await.unwrap();
    assert_eq!(
        b.pool(),
        Some(PoolId::DEFAULT),
        "the filter rejects this stream"
    );
    assert!(!b.allocated_during_capture());
    let c = pool.alloc(4096).await.unwrap();
    assert_eq!(
        c.pool(),
        Some(PoolId::DEFAULT),
        "no stream, no capture pool"
    );

    let d = pool.alloc_on(4096, &cap).await.unwrap();
    assert_ne!(
        a.as_ptr(),
        d.as_ptr(),
        "two live allocations during capture differ"
    );
    cap.end_capture().unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();

    let e = pool.alloc_on(4096, &cap).await.unwrap();
    assert_eq!(
        e.pool(),
        Some(PoolId::DEFAULT),
        "routing stopped at end_allocate_to_pool"
    );
    assert!(pool.pool_stats(id).is_some());
}

#[tokio::test]
async fn a_capture_begun_after_a_stream_was_served_routes_its_next_request_to_the_capture() {
    let (pool, sim) = sim_pool();
    let s = sim.stream();
    // Served from the default pool several times: the thread knows the stream's route.
    for _ in 0..3 {
        let b = pool.alloc_on(4096, &s).await.unwrap();
        assert_eq!(b.pool(), Some(PoolId::DEFAULT));
    }
    let id = pinpool::PoolId::fresh();
    let wanted = s.id();
    pool.begin_allocate_to_pool(id, move |t| t.id() == wanted)
        .await
        .unwrap();
    let a = pool.alloc_on(4096, &s).await.unwrap();
    assert_eq!(a.pool(), Some(id), "the remembered route was not used");
    pool.end_allocate_to_pool(id).await.unwrap();
    let b = pool.alloc_on(4096, &s).await.unwrap();
    assert_eq!(b.pool(), Some(PoolId::DEFAULT), "routing stopped");
}

#[tokio::test]
async fn a_block_freed_during_capture_without_use_is_reused() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    cap.begin_capture().unwrap();
    let a = pool.alloc_on(1 << 16, &cap).await.unwrap();
    let ptr = a.as_ptr();
    drop(a);
    let b = pool.alloc_on(1 << 16, &cap).await.unwrap();
    assert_eq!(b.as_ptr(), ptr);
    assert_eq!(sim.total_host_allocs(), 1);
    drop(b);
    cap.end_capture().unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();
}

#[tokio::test]
async fn a_block_used_by_captured_work_is_kept_and_replays_read_the_right_bytes() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let replay = sim.stream();
    let dev = SimDeviceBuffer::new(4096);
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    cap.begin_capture().unwrap();

    let mut a = pool.alloc_on(4096, &cap).await.unwrap();
    a.fill(0x5A);
    cap.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&cap).unwrap();
    let used = a.as_ptr();
    drop(a);
    assert_eq!(
        sim.events_recorded(),
        0,
        "no event is recorded during capture"
    );

    let mut b = pool.alloc_on(4096, &cap).await.unwrap();
    assert_ne!(
        b.as_ptr(),
        used,
        "a block used by captured work was handed out again"
    );
    b.fill(0xFF);
    let graph = cap.end_capture().unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();

    // More allocations of the same class after capture still never get the kept block.
    let mut later = Vec::new();
    for _ in 0..4 {
        let mut c = pool.alloc_on(4096, &cap).await.unwrap();
        assert_ne!(c.as_ptr(), used);
        c.fill(0xEE);
        later.push(c);
    }
    drop(b);
    pool.empty_cache().await.unwrap();

    for _ in 0..3 {
        dev.fill(0);
        graph.launch(&replay).unwrap();
        replay.synchronize().unwrap();
        assert_eq!(
            dev.to_vec(),
            vec![0x5A; 4096],
            "the replay read the captured bytes"
        );
    }
    assert_eq!(pool.pool_stats(id).unwrap().kept_blocks, 1);
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    drop(later);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn a_block_from_before_capture_used_by_captured_work_is_kept_too() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let dev = SimDeviceBuffer::new(64);
    let mut a = pool.alloc(64).await.unwrap();
    a.fill(3);
    cap.begin_capture().unwrap();
    cap.copy_to_device(a.as_ptr(), 64, &dev).unwrap();
    a.record_stream(&cap).unwrap();
    let ptr = a.as_ptr();
    drop(a);
    let b = pool.alloc(64).await.unwrap();
    assert_ne!(
        b.as_ptr(),
        ptr,
        "recording an event now would become part of the graph"
    );
    assert_eq!(sim.events_recorded(), 0);
    assert_eq!(pool.stats().kept_blocks, 1);
    cap.end_capture().unwrap();
}

#[tokio::test]
async fn a_released_pool_is_freed_by_empty_cache_kept_blocks_included() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    cap.begin_capture().unwrap();
    let mut a = pool.alloc_on(1 << 20, &cap).await.unwrap();
    a.record_stream(&cap).unwrap();
    drop(a);
    let b = pool.alloc_on(1 << 10, &cap).await.unwrap();
    drop(b);
    cap.end_capture().unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();

    // Not released yet: empty_cache leaves the pool alone.
    pool.empty_cache().await.unwrap();
    assert_eq!(
        pool.pool_stats(id).unwrap().allocated_bytes.current,
        (1 << 20) + (1 << 10)
    );

    pool.release_pool(id).await.unwrap();
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_bytes, (1 << 20) + (1 << 10));
    assert!(pool.pool_stats(id).is_none(), "the pool is gone");
    assert!(pool.pools().is_empty());
    assert_eq!(sim.live_bytes(), 0);
}

#[tokio::test]
async fn two_graphs_sharing_a_pool_need_two_releases() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let id = pinpool::PoolId::fresh();
    for _ in 0..2 {
        pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
        cap.begin_capture().unwrap();
        let mut a = pool.alloc_on(4096, &cap).await.unwrap();
        a.record_stream(&cap).unwrap();
        drop(a);
        cap.end_capture().unwrap();
        pool.end_allocate_to_pool(id).await.unwrap();
    }
    assert_eq!(
        pool.pool_stats(id).unwrap().kept_blocks,
        2,
        "each graph keeps its own block"
    );
    pool.release_pool(id).await.unwrap();
    pool.empty_cache().await.unwrap();
    assert_eq!(
        pool.pool_stats(id).unwrap().kept_blocks,
        2,
        "the second graph still uses the pool"
    );
    pool.release_pool(id).await.unwrap();
    pool.empty_cache().await.unwrap();
    assert!(pool.pool_stats(id).is_none());
    assert_eq!(sim.live_bytes(), 0);
}

#[tokio::test]
async fn capture_calls_out_of_order_are_typed_errors() {
    let (pool, _sim) = sim_pool();
    let id = pinpool::PoolId::fresh();
    let unknown = pinpool::PoolId::fresh();
    assert_eq!(
        pool.end_allocate_to_pool(unknown).await,
        Err(Error::PoolNotCapturing(unknown))
    );
    assert_eq!(
        pool.release_pool(unknown).await,
        Err(Error::UnknownPool(unknown))
    );
    assert_eq!(
        pool.begin_allocate_to_pool(PoolId::DEFAULT, |_| true).await,
        Err(Error::DefaultPoolId)
    );

    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    assert_eq!(
        pool.begin_allocate_to_pool(id, |_| true).await,
        Err(Error::PoolAlreadyCapturing(id))
    );
    assert_eq!(pool.release_pool(id).await, Err(Error::PoolCapturing(id)));
    pool.end_allocate_to_pool(id).await.unwrap();
    assert_eq!(
        pool.end_allocate_to_pool(id).await,
        Err(Error::PoolNotCapturing(id))
    );
    pool.release_pool(id).await.unwrap();
    assert_eq!(
        pool.release_pool(id).await,
        Err(Error::PoolAlreadyReleased(id))
    );
    // After all that, capture still works.
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();
}

#[test]
fn capture_calls_work_from_plain_threads() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (pool, sim) = rt.block_on(async { sim_pool() });
    let cap = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool_blocking(id, |_| true).unwrap();
    let a = pool.alloc_blocking_on(128, &cap).unwrap();
    assert_eq!(a.pool(), Some(id));
    drop(a);
    pool.end_allocate_to_pool_blocking(id).unwrap();
    pool.release_pool_blocking(id).unwrap();
    pool.empty_cache_blocking().unwrap();
    assert!(pool.pool_stats(id).is_none());
}

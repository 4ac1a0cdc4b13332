//! Snapshots list every segment and block with its state (in use, cached, waiting on events,
//! kept by a capture pool), requested size and streams, plus the configuration in force;
//! they round-trip through JSON. `cache_info`, `base_allocation` and
//! `check_pool_live_allocations` answer from the same books.

use std::sync::Arc;

use pinpool::sim::SimRuntime;
use pinpool::tuning::Origin;
use pinpool::{BlockStatus, Builder, Error, MemorySnapshot, PoolId};
use pinpool_testkit::sim_pool;

const KIB: usize = 1 << 10;

#[tokio::test]
async fn a_snapshot_shows_each_block_state() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let cap = sim.stream();
    let hold = stream.hold();

    let mut in_use = pool.alloc(3000).await.unwrap();
    in_use.record_stream(&stream).unwrap();
    drop(pool.alloc(8 * KIB).await.unwrap()); // cached
    let mut waiting = pool.alloc(16 * KIB).await.unwrap();
    waiting.record_stream(&stream).unwrap();
    let waiting_ptr = waiting.as_ptr() as usize;
    drop(waiting); // waits on the held stream

    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    cap.begin_capture().unwrap();
    let mut captured = pool.alloc_on(32 * KIB, &cap).await.unwrap();
    captured.record_stream(&cap).unwrap();
    let kept_ptr = captured.as_ptr() as usize;
    drop(captured); // used by captured work: kept
    cap.end_capture().unwrap();
    pool.end_allocate_to_pool(id).await.unwrap();

    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.segments.len(), 4);
    assert_eq!(snap.reserved_bytes, 4 * KIB + 8 * KIB + 16 * KIB + 32 * KIB);
    let by_size = |size: usize| {
        snap.blocks()
            .find(|(_, b)| b.size == size)
            .unwrap_or_else(|| panic!("a block of {size} bytes"))
    };

    let (seg, b) = by_size(4 * KIB);
    assert_eq!(b.state, BlockStatus::InUse);
    assert_eq!(b.requested_size, 3000);
    assert_eq!(b.address, in_use.as_ptr() as usize);
    assert_eq!(b.streams, vec![stream.id().0]);
    assert_eq!((seg.pool, seg.total_size), (0, 4 * KIB));
    assert_eq!(seg.pin_method, Origin::Simulated.to_string());

    let (_, b) = by_size(8 * KIB);
    assert_eq!(b.state, BlockStatus::Cached);
    assert!(b.streams.is_empty());

    let (_, b) = by_size(16 * KIB);
    assert_eq!(b.state, BlockStatus::Waiting);
    assert_eq!(b.address, waiting_ptr);
    assert_eq!(b.streams, vec![stream.id().0]);

    let (seg, b) = by_size(32 * KIB);
    assert_eq!(b.state, BlockStatus::Kept);
    assert_eq!(b.address, kept_ptr);
    assert_eq!(seg.pool, id.0);

    assert_eq!(snap.config.policy, "tiered");
    assert_eq!(snap.config.runtime, "sim");
    assert_eq!(snap.config.max_bytes, None);
    assert!(snap.config.shards.is_power_of_two());

    drop(hold);
    stream.synchronize().unwrap();
    drop(in_use);
    pinpool_testkit::eventually("the waiting block came back", || {
        pool.stats().waiting_blocks == 0
    })
    .await;
    let snap = pool.snapshot().await.unwrap();
    let states: Vec<_> = snap.blocks().map(|(_, b)| (b.size, b.state)).collect();
    assert!(states.contains(&(16 * KIB, BlockStatus::Cached)));
    assert!(states.contains(&(4 * KIB, BlockStatus::Cached)));
}

#[tokio::test]
async fn a_snapshot_forgets_freed_segments_and_reports_the_limit() {
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .max_bytes(1 << 20)
        .shards(2)
        .build()
        .unwrap();
    let keep = pool.alloc(KIB).await.unwrap();
    drop(pool.alloc(2 * KIB).await.unwrap());
    assert_eq!(pool.snapshot().await.unwrap().segments.len(), 2);
    pool.empty_cache().await.unwrap();
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].address, keep.as_ptr() as usize);
    assert_eq!(snap.config.max_bytes, Some(1 << 20));
    assert_eq!(snap.config.shards, 2);
    assert_eq!(snap.reserved_bytes, KIB);
}

#[tokio::test]
async fn a_snapshot_round_trips_through_json() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let mut a = pool.alloc(100).await.unwrap();
    a.record_stream(&stream).unwrap();
    drop(pool.alloc(KIB).await.unwrap());
    let snap = pool.snapshot().await.unwrap();
    let json = serde_json::to_string_pretty(&snap).unwrap();
    assert!(json.contains("\"state\": \"in_use\""));
    assert!(json.contains("\"state\": \"cached\""));
    assert!(json.contains("\"requested_size\": 100"));
    let back: MemorySnapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, snap);
    drop(a);
}

#[tokio::test]
async fn cache_info_reports_the_largest_and_total_cached() {
    let (pool, _sim) = sim_pool();
    let info = pool.cache_info().await.unwrap();
    assert_eq!(
        (info.largest_block, info.total_cached, info.cached_blocks),
        (0, 0, 0)
    );
    let held = pool.alloc(64 * KIB).await.unwrap();
    drop(pool.alloc(16 * KIB).await.unwrap());
    drop(pool.alloc(4 * KIB).await.unwrap());
    let info = pool.cache_info().await.unwrap();
    assert_eq!(info.largest_block, 16 * KIB);
    assert_eq!(info.total_cached, 20 * KIB);
    assert_eq!(info.cached_blocks, 2);
    drop(held);
    let info = pool.cache_info().await.unwrap();
    assert_eq!(info.largest_block, 64 * KIB);
}

#[tokio::test]
async fn base_allocation_finds_the_segment_of_any_interior_pointer() {
    let (pool, _sim) = sim_pool();
    let a = pool.alloc(5000).await.unwrap();
    let start = a.as_ptr();
    for offset in [0, 1, 4999, 8191] {
        let base = pool
            .base_allocation(start.wrapping_add(offset))
            .await
            .unwrap()
            .expect("inside the segment");
        assert_eq!(base.base, start as usize);
        assert_eq!(base.size, 8 * KIB);
        assert_eq!(base.pool, PoolId::DEFAULT);
    }
    assert_eq!(
        pool.base_allocation(start.wrapping_add(8 * KIB))
            .await
            .unwrap(),
        None,
        "one past the end is outside"
    );
    let foreign = [0u8; 16];
    assert_eq!(pool.base_allocation(foreign.as_ptr()).await.unwrap(), None);
    drop(a);
}

#[tokio::test]
async fn check_pool_live_allocations_matches_exactly_the_blocks_in_use() {
    let (pool, sim) = sim_pool();
    let a = pool.alloc(KIB).await.unwrap();
    let b = pool.alloc(KIB).await.unwrap();
    let c = pool.alloc(4 * KIB).await.unwrap();
    let d = PoolId::DEFAULT;
    assert!(pool
        .check_pool_live_allocations(d, &[a.as_ptr(), b.as_ptr(), c.as_ptr()])
        .await
        .unwrap());
    assert!(
        !pool
            .check_pool_live_allocations(d, &[a.as_ptr(), b.as_ptr()])
            .await
            .unwrap(),
        "one missing"
    );
    let c_ptr = c.as_ptr();
    drop(c);
    assert!(
        !pool
            .check_pool_live_allocations(d, &[a.as_ptr(), b.as_ptr(), c_ptr])
            .await
            .unwrap(),
        "a cached block is not live"
    );
    assert!(pool
        .check_pool_live_allocations(d, &[a.as_ptr(), b.as_ptr()])
        .await
        .unwrap());

    let stream = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    let p = pool.alloc_on(KIB, &stream).await.unwrap();
    assert!(pool
        .check_pool_live_allocations(id, &[p.as_ptr()])
        .await
        .unwrap());
    assert!(
        pool.check_pool_live_allocations(d, &[a.as_ptr(), b.as_ptr()])
            .await
            .unwrap(),
        "pools are checked apart"
    );
    drop(p);
    assert!(pool.check_pool_live_allocations(id, &[]).await.unwrap());
    pool.end_allocate_to_pool(id).await.unwrap();
    assert_eq!(
        pool.check_pool_live_allocations(PoolId(12345), &[]).await,
        Err(Error::UnknownPool(PoolId(12345)))
    );
    drop((a, b));
}

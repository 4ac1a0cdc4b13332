//! The `bestfit` policy with blocks carved out of separate shared segments
//! (`BestFit::separate_segments`) under faults and limits: a padded segment that does not fit falls back to the block's own size, running out
//! at every size is a typed error that loses nothing, and every segment goes back once its
//! last piece does, however the allocator is shut down.

use pinpool::sim::{FaultPoint, SimRuntime};
use pinpool::tuning::BestFit;
use pinpool::{Builder, Error};
use pinpool_testkit::{assert_books_balance, eventually, segments_pool};
use std::sync::Arc;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[tokio::test]
async fn a_limit_below_the_small_segment_size_still_serves_requests_that_fit() {
    // Under a limit of fewer than eight granules even the default keeps separate segments.
    let sim = SimRuntime::new();
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(BestFit::default()))
        .max_bytes(MIB)
        .build()
        .unwrap();
    // A small segment (2 MiB) cannot fit under the limit: the block gets its own size.
    let a = pool
        .try_alloc(512 * KIB)
        .await
        .expect("fits under the limit");
    assert_eq!(sim.live_bytes(), 512 * KIB);
    let b = pool
        .try_alloc(512 * KIB)
        .await
        .expect("fits under the limit");
    assert_eq!(sim.live_bytes(), MIB);
    assert!(matches!(
        pool.try_alloc(4 * KIB).await,
        Err(Error::OutOfMemory { .. })
    ));
    drop((a, b));
    // Both cached: a request of the whole limit gets them back first.
    let whole = pool.try_alloc(MIB).await.expect("the cache made room");
    assert_eq!(whole.len(), MIB);
    assert_eq!(sim.live_bytes(), MIB);
    drop(whole);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn out_of_memory_for_a_padded_segment_falls_back_to_the_blocks_own_size() {
    let (pool, sim) = segments_pool();
    sim.faults().fail_next(FaultPoint::HostAlloc, 1);
    let b = pool.alloc(4096).await.unwrap();
    assert_eq!(b.len(), 4096);
    assert_eq!(sim.live_bytes(), 4096, "a segment of the block's own size");
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 0, "no cache emptied for it");
    assert_eq!(s.num_ooms, 0);
    drop(b);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn out_of_memory_at_every_size_is_a_typed_error_that_loses_nothing() {
    let (pool, sim) = segments_pool();
    // A block that fills its own segment, so that the next request needs fresh memory.
    let held = pool.alloc(2 * MIB).await.unwrap();
    let reserved = sim.live_bytes();
    // The padded small segment and the block's own size fail, before and after the retry.
    sim.faults().fail_next(FaultPoint::HostAlloc, 4);
    match pool.alloc(8 * KIB).await {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 8 * KIB),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(pool.stats().num_ooms, 1);
    assert_eq!(sim.live_bytes(), reserved, "the live segment is untouched");
    assert!(pool.alloc(8 * KIB).await.is_ok(), "later requests work");
    drop(held);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn dropping_the_allocator_frees_each_segment_when_its_last_piece_drops() {
    let (pool, sim) = segments_pool();
    let stream = sim.stream();
    let hold = stream.hold();
    let live = pool.alloc(64 * KIB).await.unwrap();
    let mut waiting = pool.alloc(32 * KIB).await.unwrap();
    waiting.record_stream(&stream).unwrap();
    drop(waiting);
    let large = pool.alloc(8 * MIB).await.unwrap();
    drop(pool.alloc(16 * KIB).await.unwrap());
    drop(pool);
    let small_segment = 2 * MIB;
    assert_eq!(sim.live_bytes(), small_segment + 8 * MIB);
    drop(large);
    eventually("the large segment goes back with its only block", || {
        sim.live_bytes() == small_segment
    })
    .await;
    let mut live = live;
    live.fill(1); // still valid memory
    drop(live);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert_eq!(
        sim.live_bytes(),
        small_segment,
        "a piece still waits on its stream: the segment stays"
    );
    drop(hold);
    eventually("the small segment goes back with its last piece", || {
        sim.live_bytes() == 0
    })
    .await;
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

#[tokio::test]
async fn a_refused_segment_free_is_retried_when_the_allocator_closes() {
    let (pool, sim) = segments_pool();
    drop(pool.alloc(4096).await.unwrap());
    sim.faults().fail_next(FaultPoint::HostFree, 1);
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.reserved_after, 2 * MIB, "the segment is still held");
    assert_eq!(sim.live_bytes(), 2 * MIB);
    assert_books_balance(&pool, &sim, 0).await;
    assert!(pool.alloc(4096).await.is_ok());
    drop(pool);
    eventually("retried when the allocator closes", || {
        sim.live_bytes() == 0
    })
    .await;
}

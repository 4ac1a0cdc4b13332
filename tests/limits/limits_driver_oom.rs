//! Out of memory from the runtime itself: every cache is emptied and the allocation retried
//! once; if it still fails, the request gets `OutOfMemory` with no limit, and both counts
//! are kept.

use pinpool::{Error, OomCause};
use pinpool_testkit::{assert_books_balance, sim_pool};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[tokio::test]
async fn runtime_out_of_memory_empties_every_cache_and_retries_once() {
    let (pool, sim) = sim_pool();
    sim.set_memory_limit(Some(MIB));
    drop(pool.alloc(512 * KIB).await.unwrap());
    let stream = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    drop(pool.alloc_on(256 * KIB, &stream).await.unwrap());
    pool.end_allocate_to_pool(id).await.unwrap();
    assert_eq!(sim.live_bytes(), 768 * KIB, "cached in two pools");

    let big = pool
        .alloc(MIB)
        .await
        .expect("the retry after emptying succeeds");
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_host_free, 2, "both pools' caches were emptied");
    drop(big);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn runtime_out_of_memory_after_the_retry_is_reported() {
    let (pool, sim) = sim_pool();
    sim.set_memory_limit(Some(MIB));
    let held = pool.alloc(MIB).await.unwrap();
    let err = pool.alloc(4 * KIB).await.unwrap_err();
    assert_eq!(
        err,
        Error::OutOfMemory {
            requested: 4 * KIB,
            reserved: MIB,
            limit: None,
            cause: OomCause::NoRoomNow,
        }
    );
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 1);
    assert_books_balance(&pool, &sim, 1).await;

    sim.set_memory_limit(None);
    let ok = pool.alloc(4 * KIB).await.expect("nothing was left behind");
    drop((held, ok));
    assert_books_balance(&pool, &sim, 0).await;
}

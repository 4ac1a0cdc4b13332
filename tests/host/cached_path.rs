//! The cached path: sizes, rounding, reuse without fresh memory, and bad sizes.

use pinpool::Error;
use pinpool_testkit::{assert_books_balance, sim_pool};

#[tokio::test]
async fn a_freed_block_is_reused_for_the_same_class_without_fresh_memory() {
    let (pool, sim) = sim_pool();
    let a = pool.alloc(1000).await.unwrap();
    let ptr = a.as_ptr();
    drop(a);
    for _ in 0..10 {
        let b = pool.alloc(1000).await.unwrap();
        assert_eq!(b.as_ptr(), ptr);
    }
    assert_eq!(sim.total_host_allocs(), 1);
    assert_eq!(pool.stats().num_host_alloc, 1);
    assert_books_balance(&pool, &sim, 0).await;
}

#[tokio::test]
async fn sizes_round_up_to_a_power_of_two_and_share_their_class() {
    let (pool, sim) = sim_pool();
    let a = pool.alloc(3000).await.unwrap();
    assert_eq!(a.len(), 3000);
    assert_eq!(a.capacity(), 4096);
    let ptr = a.as_ptr();
    drop(a);
    let b = pool.alloc(4096).await.unwrap();
    assert_eq!(b.as_ptr(), ptr, "4096 is in the class of 3000");
    assert_eq!(sim.total_host_allocs(), 1);
    let c = pool.alloc(4097).await.unwrap();
    assert_eq!(c.capacity(), 8192);
    assert_eq!(sim.total_host_allocs(), 2, "4097 is the next class");
}

#[tokio::test]
async fn live_buffers_never_share_bytes() {
    let (pool, _sim) = sim_pool();
    let mut bufs = Vec::new();
    for i in 0..64usize {
        let mut b = pool.alloc(100 + i * 37).await.unwrap();
        b.fill(i as u8);
        bufs.push(b);
    }
    for (i, b) in bufs.iter().enumerate() {
        assert!(
            b.iter().all(|&x| x == i as u8),
            "buffer {i} was overwritten"
        );
    }
}

#[tokio::test]
async fn size_zero_gives_an_empty_buffer_without_touching_the_pool() {
    let (pool, sim) = sim_pool();
    let mut b = pool.alloc(0).await.unwrap();
    assert!(b.is_empty());
    assert_eq!(b.len(), 0);
    assert_eq!(&*b, &[] as &[u8]);
    b.record_stream(&sim.stream()).unwrap();
    drop(b);
    let s = pool.stats();
    assert_eq!(s.active_requests.allocated, 0);
    assert_eq!(sim.total_host_allocs(), 0);
    assert_eq!(sim.events_recorded(), 0);
}

#[tokio::test]
async fn a_size_too_large_for_any_class_is_a_typed_error_and_changes_nothing() {
    let (pool, sim) = sim_pool();
    let max = pinpool::tuning::engine(&pool).policy().max_request();
    assert_eq!(
        max,
        1 << 40,
        "the default policy takes requests up to 1 TiB"
    );
    for size in [usize::MAX, usize::MAX / 2 + 2, max + 1] {
        match pool.alloc(size).await {
            Err(Error::SizeTooLarge { requested, max: m }) => {
                assert_eq!(requested, size);
                assert_eq!(m, max);
            }
            other => panic!("expected SizeTooLarge, got {other:?}"),
        }
        let p = pool.clone();
        let blocking =
            pinpool_testkit::on_plain_thread(move || p.alloc_blocking(size).map(|_| ())).await;
        assert!(matches!(blocking, Err(Error::SizeTooLarge { .. })));
    }
    assert_eq!(sim.total_host_allocs(), 0);
    assert_eq!(pool.stats(), pinpool::HostStats::default());
    // The allocator still works.
    assert_eq!(pool.alloc(64).await.unwrap().len(), 64);
}

#[tokio::test]
async fn typed_views_see_the_same_bytes() {
    let (pool, _sim) = sim_pool();
    let mut b = pool.alloc(64).await.unwrap();
    b.as_mut_slice_of::<u32>().unwrap().fill(0x0102_0304);
    assert_eq!(b.as_slice_of::<u32>().unwrap().len(), 16);
    assert_eq!(&b[..4], &0x0102_0304u32.to_ne_bytes());
    let odd = pool.alloc(7).await.unwrap();
    assert_eq!(
        odd.as_slice_of::<u32>().unwrap().len(),
        1,
        "whole elements only"
    );
    assert!(matches!(b.as_slice_of::<()>(), Err(Error::BadView { .. })));
}

#[test]
fn alloc_blocking_serves_threads_outside_the_runtime() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (pool, sim) = rt.block_on(async { sim_pool() });
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for i in 0..200 {
                    let mut b = pool.alloc_blocking(512 << (i % 4)).unwrap();
                    b.fill(t as u8);
                    assert!(b.iter().all(|&x| x == t as u8));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(
        sim.total_host_allocs() <= 16,
        "at most one block per class and thread"
    );
    drop(pool);
    pinpool_testkit::eventually_blocking("memory given back", || sim.live_bytes() == 0);
}

#[test]
fn building_outside_a_tokio_runtime_is_a_typed_error() {
    match pinpool::PinnedAllocator::builder().build() {
        Err(Error::NoTokioRuntime) => {}
        other => panic!("expected NoTokioRuntime, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_builder_given_a_handle_works_outside_the_runtime() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = pinpool::PinnedAllocator::builder()
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    let b = pool.alloc_blocking(4096).unwrap();
    assert_eq!(b.len(), 4096);
}

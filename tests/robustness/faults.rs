//! Faults injected into the simulated runtime: each gives the caller a typed error or a
//! documented degradation, loses no block, hands none out early, keeps the stats true, and
//! leaves later requests working. Nothing hangs.

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::{FaultPoint, SimDeviceBuffer, SimRuntime};
use pinpool::tuning::{BestFit, SizePolicy, TieredPowerOfTwo};
use pinpool::{Builder, Error};
use pinpool_testkit::{assert_books_balance, eventually, eventually_blocking, sim_pool};

#[tokio::test]
async fn a_failed_host_allocation_is_a_typed_error_and_loses_nothing() {
    let (pool, sim) = sim_pool();
    sim.faults().set_host_alloc_out_of_memory(false);
    sim.faults().fail_next(FaultPoint::HostAlloc, 1);
    match pool.alloc(4096).await {
        Err(Error::Runtime(e)) => assert_eq!(e.op, "host_alloc"),
        other => panic!("expected a runtime error, got {other:?}"),
    }
    let s = pool.stats();
    assert_eq!(s.allocations.current, 0);
    assert_eq!(s.active_requests.current, 0);
    let b = pool.alloc(4096).await.unwrap();
    assert_eq!(b.len(), 4096);
    assert_books_balance(&pool, &sim, 1).await;
}

#[tokio::test]
async fn out_of_memory_from_the_runtime_empties_the_cache_and_retries_once() {
    let (pool, sim) = sim_pool();
    drop(pool.alloc(1 << 20).await.unwrap()); // cached, of another class
    sim.faults().fail_next(FaultPoint::HostAlloc, 1);
    let b = pool.alloc(4096).await.unwrap();
    assert_eq!(b.len(), 4096);
    assert_eq!(
        sim.live_bytes(),
        4096,
        "the cached block was freed to make room"
    );
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
}

#[tokio::test]
async fn out_of_memory_twice_is_reported_as_a_typed_error() {
    let (pool, sim) = sim_pool();
    sim.faults().fail_next(FaultPoint::HostAlloc, 2);
    match pool.alloc(8192).await {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 8192),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(pool.stats().num_ooms, 1);
    assert!(pool.alloc(8192).await.is_ok(), "later requests work");
}

#[tokio::test]
async fn a_failed_event_record_keeps_the_block_waiting_until_an_event_can_be_recorded() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let dev = SimDeviceBuffer::new(4096);
    let hold = stream.hold();
    let mut a = pool.alloc(4096).await.unwrap();
    a.fill(9);
    stream.copy_to_device(a.as_ptr(), 4096, &dev).unwrap();
    a.record_stream(&stream).unwrap();
    let ptr = a.as_ptr();
    sim.faults().fail_next(FaultPoint::RecordEvent, 1);
    drop(a);
    let st = pool.stats();
    assert_eq!(
        (st.waiting_blocks, st.kept_blocks),
        (1, 0),
        "waiting, not kept"
    );
    for _ in 0..3 {
        let mut b = pool.alloc(4096).await.unwrap();
        assert_ne!(b.as_ptr(), ptr, "a block with no event was reused");
        b.fill(1);
    }
    drop(hold);
    stream.synchronize().unwrap();
    assert_eq!(dev.to_vec(), vec![9; 4096]);
    // The event is recorded once the runtime takes it again; the block comes back.
    eventually("the block comes back", || pool.stats().waiting_blocks == 0).await;
    assert_eq!(pool.stats().kept_blocks, 0, "never kept for ever");
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    assert_books_balance(&pool, &sim, 0).await;
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.live_bytes(), 0, "emptying the cache frees it");
}

#[tokio::test]
async fn a_failing_event_query_delays_reuse_until_it_answers() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    let mut a = pool.alloc(512).await.unwrap();
    a.record_stream(&stream).unwrap();
    let ptr = a.as_ptr();
    sim.faults().fail_next(FaultPoint::QueryEvent, 3);
    // Busy at the free: an event is recorded.
    let hold = stream.hold();
    drop(a);
    drop(hold);
    stream.synchronize().unwrap();
    eventually("the block comes home once queries answer", || {
        pool.stats().waiting_blocks == 0
    })
    .await;
    assert_eq!(sim.faults().injected(FaultPoint::QueryEvent), 3);
    let b = pool.alloc(512).await.unwrap();
    assert_eq!(b.as_ptr(), ptr);
}

#[tokio::test]
async fn a_stream_that_never_completes_holds_only_its_own_block() {
    let (pool, sim) = sim_pool();
    let stuck = sim.stream();
    stuck.hang();
    let mut a = pool.alloc(1 << 16).await.unwrap();
    a.record_stream(&stuck).unwrap();
    drop(a);
    for _ in 0..10 {
        drop(pool.alloc(1 << 12).await.unwrap());
    }
    let b = pool.alloc(1 << 16).await.unwrap();
    drop(b);
    let t0 = std::time::Instant::now();
    drop(pool);
    eventually("everything but the stuck block freed", || {
        sim.live_bytes() == 1 << 16
    })
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "dropping the allocator did not hang"
    );
}

#[tokio::test]
async fn a_refused_free_keeps_the_memory_on_the_books_and_is_retried() {
    let (pool, sim) = sim_pool();
    drop(pool.alloc(4096).await.unwrap());
    sim.faults().fail_next(FaultPoint::HostFree, 1);
    let report = pool.empty_cache().await.unwrap();
    assert_eq!(report.freed_blocks, 0);
    assert_eq!(report.reserved_after, 4096);
    assert_eq!(pool.stats().allocated_bytes.current, 4096, "still reserved");
    assert_eq!(sim.live_bytes(), 4096);
    assert_books_balance(&pool, &sim, 0).await;
    assert!(pool.alloc(4096).await.is_ok());
    drop(pool);
    eventually("retried when the allocator closes", || {
        sim.live_bytes() == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_event_poller_degrades_without_hanging_or_losing_blocks() {
    let (pool, sim) = sim_pool();
    let stream = sim.stream();
    sim.faults().panic_next(FaultPoint::QueryEvent, 1);
    let mut a = pool.alloc(2048).await.unwrap();
    a.record_stream(&stream).unwrap();
    // Busy at the free: an event is recorded.
    let hold = stream.hold();
    drop(a);
    drop(hold);
    stream.synchronize().unwrap();
    // The first query panics and takes the poller down; the block it held still comes home.
    let run = async {
        eventually("the poller's block came home", || {
            pool.stats().waiting_blocks == 0
        })
        .await;
        for _ in 0..20 {
            let mut b = pool.alloc(2048).await.unwrap();
            b.record_stream(&stream).unwrap();
            drop(b);
        }
        stream.synchronize().unwrap();
    };
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("no hang");
    assert_eq!(sim.faults().injected(FaultPoint::QueryEvent), 1);
    assert_eq!(sim.violations(), 0);
    assert_books_balance(&pool, &sim, 0).await;
}

/// Drops the tokio runtime while a buffer is live and another is cached: what the runtime
/// still holds until the live buffer drops is `held_while_live` bytes (the live block's own
/// allocation, or the whole segment it was carved from).
fn drop_runtime_with_a_live_and_a_cached_buffer(
    policy: Arc<dyn SizePolicy>,
    held_while_live: usize,
) {
    let sim = SimRuntime::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pool = Builder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .policy(policy)
        .build()
        .unwrap();
    let live = pool.alloc_blocking(1 << 14).unwrap();
    drop(pool.alloc_blocking(1 << 12).unwrap()); // cached
    drop(rt);
    eventually_blocking("cached memory freed with the runtime", || {
        sim.live_bytes() == held_while_live
    });
    drop(live);
    assert_eq!(
        sim.live_bytes(),
        0,
        "a buffer dropped after the runtime frees on the spot"
    );
    assert_eq!(pool.alloc_blocking(1 << 20).unwrap_err(), Error::Shutdown);
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
}

#[test]
fn dropping_the_tokio_runtime_frees_memory_as_buffers_drop_and_requests_get_errors() {
    drop_runtime_with_a_live_and_a_cached_buffer(Arc::new(TieredPowerOfTwo::default()), 1 << 14);
}

#[test]
fn dropping_the_tokio_runtime_frees_a_carved_segment_when_its_last_piece_drops() {
    // Both buffers are cut from one small segment, which stays until the live one drops.
    let small_segment = 2 << 20;
    drop_runtime_with_a_live_and_a_cached_buffer(Arc::new(BestFit::default()), small_segment);
}

#[test]
fn a_request_waiting_on_a_runtime_that_shuts_down_gets_an_error_not_a_hang() {
    let sim = SimRuntime::new();
    sim.set_host_alloc_latency(Duration::from_millis(300));
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Whole blocks: the fresh block is one host allocation, which the latency slows down.
    let pool = Builder::new(Arc::new(sim.clone()))
        .policy(Arc::new(TieredPowerOfTwo::default()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    let waiter = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.alloc_blocking(4096).map(|_| ()))
    };
    std::thread::sleep(Duration::from_millis(50));
    rt.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(waiter.join().unwrap(), Err(Error::Shutdown));
    eventually_blocking("the in-flight allocation was given back", || {
        sim.total_host_allocs() == sim.total_host_frees()
    });
    assert_eq!(sim.live_bytes(), 0);
}

#[tokio::test]
async fn dropping_the_allocator_with_a_capture_pool_open_gives_memory_back_once() {
    let (pool, sim) = sim_pool();
    let cap = sim.stream();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(id, |_| true).await.unwrap();
    cap.begin_capture().unwrap();
    let mut a = pool.alloc_on(4096, &cap).await.unwrap();
    a.record_stream(&cap).unwrap();
    drop(a);
    let live = pool.alloc_on(1024, &cap).await.unwrap();
    drop(pool);
    let graph = cap.end_capture().unwrap();
    drop(graph);
    drop(live);
    eventually("all memory given back", || sim.live_bytes() == 0).await;
    assert_eq!(sim.total_host_allocs(), sim.total_host_frees());
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

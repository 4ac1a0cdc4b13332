//! Capture pools on the simulated device (invariant 4): between `begin_allocate_to_pool` and
//! `end_allocate_to_pool`, a capturing stream's requests go to the capture pool instead of
//! the stream's own pool; a block the captured work used is never handed to anyone, nor
//! given back to the device, while the pool lives, so replays read and write the right
//! bytes; two graphs may share a pool; once every use is released, `empty_cache` gives the
//! pool's memory back to the device. Bad input is a typed error.

use std::sync::Arc;

use pinpool::sim::{SimRuntime, SimStream};
use pinpool::{DeviceAllocator, DeviceBuilder, Error, PoolId};
use pinpool_testkit::sim_device_pool as device_pool;
use pinpool_testkit::{all_bytes_are, on_plain_thread};

const MIB: usize = 1 << 20;

/// Routes `stream`'s requests on device `device` to `id`, and starts capturing it.
async fn begin(pool: &DeviceAllocator<SimRuntime>, device: usize, s: &SimStream, id: PoolId) {
    let wanted = s.id();
    pool.begin_allocate_to_pool(device, id, move |t| t.id() == wanted)
        .await
        .unwrap();
    s.begin_capture().unwrap();
}

#[tokio::test]
async fn a_capturing_streams_requests_go_to_the_capture_pool_not_to_its_own_pool() {
    let (pool, sim) = device_pool();
    let (s, other) = (sim.stream(), sim.stream());
    let cached = pool.alloc(MIB, &s).await.unwrap();
    let cached_ptr = cached.device_ptr();
    drop(cached); // ready in s's own pool

    let id = pinpool::PoolId::fresh();
    begin(&pool, 0, &s, id).await;
    let a = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(a.pool(), Some(id));
    assert!(a.allocated_during_capture());
    assert_ne!(
        a.device_ptr(),
        cached_ptr,
        "the stream's own cached block is not used for captured work"
    );
    let b = pool.alloc(MIB, &other).await.unwrap();
    assert_eq!(b.pool(), Some(PoolId::DEFAULT), "the filter rejects it");
    assert!(!b.allocated_during_capture());
    s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();

    let c = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(c.pool(), Some(PoolId::DEFAULT), "routing stopped");
    assert_eq!(c.device_ptr(), cached_ptr, "back to its own pool's block");
    assert_eq!(pool.pools(0).unwrap(), vec![id]);
}

#[tokio::test]
async fn a_capture_begun_after_a_stream_was_served_from_its_own_pool_routes_its_next_request_to_the_capture(
) {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    // The stream's pool made, then found again: the thread knows the stream's route, and a
    // ready block of the size waits in the stream's pool.
    for _ in 0..3 {
        drop(pool.alloc(MIB, &s).await.unwrap());
    }
    let id = pinpool::PoolId::fresh();
    begin(&pool, 0, &s, id).await;
    let a = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(a.pool(), Some(id), "the remembered route was not used");
    assert!(a.allocated_during_capture());
    s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    let b = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(b.pool(), Some(PoolId::DEFAULT), "routing stopped");
    assert!(!b.allocated_during_capture());
}

#[tokio::test]
async fn a_buffer_freed_during_capture_is_never_handed_out_again_while_its_pool_lives() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    begin(&pool, 0, &s, id).await;
    let a = pool.alloc(MIB, &s).await.unwrap();
    let used = a.device_ptr();
    s.fill_device(used, MIB, 0x11).unwrap(); // captured, not run
    drop(a);
    let b = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(b.pool(), Some(id));
    assert_ne!(
        b.device_ptr(),
        used,
        "the graph writes this block on every replay"
    );
    assert_eq!(
        sim.events_recorded(),
        0,
        "no event is recorded during capture"
    );
    let _graph = s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    drop(b); // allocated during capture: kept too
    pool.empty_cache().await.unwrap();
    let inventory = pinpool::tuning::device_engine(&pool, 0)
        .unwrap()
        .inventory()
        .await
        .unwrap();
    let kept: usize = inventory.iter().map(|i| i.kept_blocks).sum();
    assert_eq!(kept, 2);
    for _ in 0..4 {
        let x = pool.alloc(MIB, &s).await.unwrap();
        assert_ne!(x.device_ptr(), used);
    }
}

#[tokio::test]
async fn two_graphs_sharing_a_pool_replay_the_right_bytes_while_others_allocate() {
    // A small device: each round ends with a request that fits only once every cache has
    // been emptied, which frees every cached block of every pool, the capture pool's too.
    let sim = SimRuntime::builder().device_capacity(16 * MIB).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    let others = [sim.stream(), sim.stream(), sim.stream()];
    let host = sim.host_alloc(MIB).unwrap();
    let id = pinpool::PoolId::fresh();

    // Graph 1 writes A.
    begin(&pool, 0, &s, id).await;
    let a = pool.alloc(MIB, &s).await.unwrap();
    s.fill_device(a.device_ptr(), MIB, 0x5a).unwrap();
    let g1 = s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();

    // Graph 2, in the same pool, copies A to B and B to the host.
    begin(&pool, 0, &s, id).await;
    let b = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(b.pool(), Some(id));
    assert_ne!(b.device_ptr(), a.device_ptr());
    s.copy_dtod(a.device_ptr(), b.device_ptr(), MIB).unwrap();
    s.copy_dtoh(b.device_ptr(), host.ptr.as_ptr(), MIB).unwrap();
    let g2 = s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    let (pa, pb) = (a.device_ptr(), b.device_ptr());
    drop((a, b)); // the graphs hold on to them
    let outside = |p: u64, len: usize| pa + MIB as u64 <= p || p + len as u64 <= pa;
    let clear =
        |p: u64, len: usize| outside(p, len) && (pb + MIB as u64 <= p || p + len as u64 <= pb);

    for round in 0..3 {
        // Anything allocated meanwhile, on any stream, never gets A's or B's memory.
        let mut churn = Vec::new();
        for t in others.iter().chain([&s]) {
            for _ in 0..2 {
                let x = pool.alloc(MIB, t).await.unwrap();
                assert!(clear(x.device_ptr(), MIB), "round {round}");
                t.fill_device(x.device_ptr(), MIB, 0xee).unwrap();
                churn.push(x);
            }
        }
        drop(churn); // cached in the streams' pools
        let retries = pool.stats(0).unwrap().num_alloc_retries;
        let big_stream = sim.stream();
        let big = pool.alloc(8 * MIB, &big_stream).await.unwrap();
        assert_eq!(
            pool.stats(0).unwrap().num_alloc_retries,
            retries + 1,
            "the caches were emptied to make room"
        );
        assert!(clear(big.device_ptr(), 8 * MIB), "round {round}");
        big_stream
            .fill_device(big.device_ptr(), 8 * MIB, 0xbb)
            .unwrap();
        big_stream.synchronize().unwrap();

        sim.host_write(host.ptr.as_ptr(), &vec![0; MIB]).unwrap();
        g1.launch(&s).unwrap();
        g2.launch(&s).unwrap();
        s.synchronize().unwrap();
        let read = sim.host_read(host.ptr.as_ptr(), MIB).unwrap();
        assert!(
            all_bytes_are(&read, 0x5a),
            "replay {round} read other bytes"
        );
    }
    for t in &others {
        t.synchronize().unwrap();
    }
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    let st = pool.pool_stats(0, id).unwrap();
    assert_eq!(
        st.active_bytes.all.current, 0,
        "nothing of the pool is lent"
    );
    assert!(st.reserved_bytes.all.current >= 2 * MIB as i64);
    sim.host_free(host).unwrap();
}

#[tokio::test]
async fn a_pool_begun_twice_needs_two_releases_and_then_empty_cache_gives_its_memory_back() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    for _ in 0..2 {
        begin(&pool, 0, &s, id).await;
        let x = pool.alloc(4 * MIB, &s).await.unwrap();
        s.fill_device(x.device_ptr(), 4 * MIB, 1).unwrap();
        drop(x);
        s.end_capture().unwrap();
        pool.end_allocate_to_pool(0, id).await.unwrap();
    }
    pool.empty_cache().await.unwrap();
    let held = sim.device_used(0).unwrap();
    assert!(held >= 8 * MIB, "both graphs' blocks are kept: {held}");
    assert_eq!(
        pool.pool_stats(0, id).unwrap().reserved_bytes.all.current,
        held as i64
    );

    pool.release_pool(0, id).await.unwrap();
    pool.empty_cache().await.unwrap();
    assert_eq!(
        sim.device_used(0),
        Some(held),
        "one graph still uses the pool"
    );
    assert_eq!(pool.pools(0).unwrap(), vec![id]);

    pool.release_pool(0, id).await.unwrap();
    let report = pool.empty_cache().await.unwrap();
    assert!(report.freed_bytes >= 8 * MIB);
    assert_eq!(sim.device_used(0), Some(0), "the pool's memory went back");
    assert!(pool.pools(0).unwrap().is_empty());
    assert_eq!(pool.pool_stats(0, id).unwrap_err(), Error::UnknownPool(id));
    let st = pool.stats(0).unwrap();
    assert_eq!(st.reserved_bytes.all.current, 0);
    assert_eq!(st.num_device_alloc, st.num_device_free);
}

#[tokio::test]
async fn capture_pool_calls_with_bad_input_are_typed_errors_and_change_nothing() {
    let sim = SimRuntime::builder().devices(2).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    let no_device = |e: Error| {
        matches!(
            e,
            Error::NoSuchDevice {
                ordinal: 2,
                count: 2
            }
        )
    };
    assert!(no_device(
        pool.begin_allocate_to_pool(2, id, |_| true)
            .await
            .unwrap_err()
    ));
    assert!(no_device(
        pool.end_allocate_to_pool(2, id).await.unwrap_err()
    ));
    assert!(no_device(pool.release_pool(2, id).await.unwrap_err()));
    assert!(no_device(pool.pools(2).unwrap_err()));
    assert!(no_device(pool.pool_stats(2, id).unwrap_err()));
    assert_eq!(
        pool.begin_allocate_to_pool(0, PoolId::DEFAULT, |_| true)
            .await
            .unwrap_err(),
        Error::DefaultPoolId
    );
    assert_eq!(
        pool.end_allocate_to_pool(0, id).await.unwrap_err(),
        Error::PoolNotCapturing(id)
    );
    assert_eq!(
        pool.release_pool(0, id).await.unwrap_err(),
        Error::UnknownPool(id)
    );
    assert_eq!(pool.pool_stats(0, id).unwrap_err(), Error::UnknownPool(id));
    assert_eq!(
        pool.pool_stats(0, PoolId::DEFAULT).unwrap_err(),
        Error::DefaultPoolId
    );
    assert!(pool.pools(0).unwrap().is_empty(), "nothing was made");

    begin(&pool, 0, &s, id).await;
    assert_eq!(
        pool.begin_allocate_to_pool(0, id, |_| true)
            .await
            .unwrap_err(),
        Error::PoolAlreadyCapturing(id)
    );
    assert_eq!(
        pool.release_pool(0, id).await.unwrap_err(),
        Error::PoolCapturing(id)
    );
    assert_eq!(
        pool.release_pool(1, id).await.unwrap_err(),
        Error::UnknownPool(id),
        "pools are per device"
    );
    let a = pool.alloc(MIB, &s).await.unwrap();
    assert_eq!(a.pool(), Some(id), "the capture is undisturbed");
    drop(a);
    s.end_capture().unwrap();
    pool.end_allocate_to_pool(0, id).await.unwrap();
    pool.release_pool(0, id).await.unwrap();
    assert_eq!(
        pool.release_pool(0, id).await.unwrap_err(),
        Error::PoolAlreadyReleased(id)
    );
}

#[tokio::test]
async fn capture_pools_are_per_device() {
    let sim = SimRuntime::builder().devices(2).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s0 = sim.stream();
    let s1 = sim.stream_on(1).unwrap();
    let id = pinpool::PoolId::fresh();
    pool.begin_allocate_to_pool(1, id, |_| true).await.unwrap();
    s1.begin_capture().unwrap();
    s0.begin_capture().unwrap();
    let on1 = pool.alloc(MIB, &s1).await.unwrap();
    let on0 = pool.alloc(MIB, &s0).await.unwrap();
    assert_eq!((on1.pool(), on1.device()), (Some(id), 1));
    assert_eq!(
        on0.pool(),
        Some(PoolId::DEFAULT),
        "device 0 has no capture pool"
    );
    drop((on0, on1));
    s0.end_capture().unwrap();
    s1.end_capture().unwrap();
    pool.end_allocate_to_pool(1, id).await.unwrap();
    assert_eq!(pool.pools(1).unwrap(), vec![id]);
    assert!(pool.pools(0).unwrap().is_empty());
    pool.release_pool(1, id).await.unwrap();
    pool.empty_cache().await.unwrap();
    assert_eq!(sim.device_used(1), Some(0));
}

#[tokio::test]
async fn capture_pool_calls_work_from_plain_threads() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let id = pinpool::PoolId::fresh();
    let (p, s2) = (pool.clone(), s.clone());
    on_plain_thread(move || {
        let wanted = s2.id();
        p.begin_allocate_to_pool_blocking(0, id, move |t| t.id() == wanted)
            .unwrap();
        s2.begin_capture().unwrap();
        let a = p.alloc_blocking(MIB, &s2).unwrap();
        assert_eq!(a.pool(), Some(id));
        drop(a);
        s2.end_capture().unwrap();
        p.end_allocate_to_pool_blocking(0, id).unwrap();
        p.release_pool_blocking(0, id).unwrap();
        p.empty_cache_blocking().unwrap();
        assert_eq!(
            p.release_pool_blocking(0, id).unwrap_err(),
            Error::UnknownPool(id),
            "freed by empty_cache"
        );
    })
    .await;
    assert_eq!(sim.device_used(0), Some(0));
}

/// The waiting and the kept blocks of every pool of device 0.
async fn waiting_and_kept(pool: &DeviceAllocator<SimRuntime>) -> (usize, usize) {
    let engine = pinpool::tuning::device_engine(pool, 0).unwrap();
    let inventory = engine.inventory().await.unwrap();
    let waiting = inventory.iter().map(|i| i.waiting_blocks).sum();
    (waiting, inventory.iter().map(|i| i.kept_blocks).sum())
}

// A stream's block freed while another stream recorded on it captures (a side stream's
// capture, with no capture pool of the block's): an event recorded now would become part of
// the graph, so the free waits for the capture to end and records the event then, as
// PyTorch's allocator defers such frees. The block comes back once that event completes:
// never during the capture, never while the work queued on the recorded stream before it
// still runs, and it is not kept until its pool closes (empty_cache gives it back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_freed_while_a_recorded_stream_captures_comes_back_after_the_capture_once_its_work_ran(
) {
    let (pool, sim) = device_pool();
    let (own, side) = (sim.stream(), sim.stream());
    let mut a = pool.alloc(MIB, &own).await.unwrap();
    let used = a.device_ptr();
    pool.record_stream(&mut a, &side).unwrap();
    let busy = side.hold(); // work queued on `side` before its capture, still to run
    side.begin_capture().unwrap();
    drop(a);
    let not_back = |what: &'static str| {
        let (pool, own) = (pool.clone(), own.clone());
        async move {
            for _ in 0..5 {
                let b = pool.alloc(MIB, &own).await.unwrap();
                let c = pool.alloc(MIB, &own).await.unwrap();
                assert!(b.device_ptr() != used && c.device_ptr() != used, "{what}");
                assert_eq!(waiting_and_kept(&pool).await, (1, 0), "{what}");
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
    };
    not_back("reused during the capture").await;
    assert_eq!(
        sim.events_recorded(),
        0,
        "no event is recorded into the capture"
    );
    let _graph = side.end_capture().expect("the capture stayed valid");
    not_back("reused while the side stream's earlier work still runs").await;
    drop(busy);
    let t0 = std::time::Instant::now();
    while waiting_and_kept(&pool).await != (0, 0) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "the block never came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    pool.empty_cache().await.unwrap();
    assert_eq!(pool.reserved_bytes(0).unwrap(), 0, "nothing kept");
    assert_eq!(sim.device_used(0), Some(0));
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

// Out of memory while a capture is underway: PyTorch's allocator frees no cached block then,
// since giving memory back synchronises the device, and a device-wide synchronisation
// invalidates the capture. The request fails with a clean out-of-memory error, the other
// pools' caches stay, the capture stays valid (the simulated device invalidates a capture
// whose device is synchronised, and records it), and once the capture ends the same request
// empties the caches and fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_during_a_capture_empties_no_cache_and_the_capture_stays_valid() {
    let sim = SimRuntime::builder().device_capacity(64 * MIB).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let (other, s) = (sim.stream(), sim.stream());
    // Memory cached in another stream's pool.
    drop(pool.alloc(48 * MIB, &other).await.unwrap());
    let cached = pool.reserved_bytes(0).unwrap();
    assert!(cached >= 48 * MIB);
    let id = PoolId::fresh();
    begin(&pool, 0, &s, id).await;
    let err = pool.try_alloc(32 * MIB, &s).await.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(
        pool.reserved_bytes(0).unwrap(),
        cached,
        "no cache was emptied during the capture"
    );
    s.end_capture().expect("the capture stays valid");
    pool.end_allocate_to_pool(0, id).await.unwrap();
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
    // No capture underway: the caches are emptied, and the request fits.
    let b = pool.try_alloc(32 * MIB, &s).await.unwrap();
    assert_eq!(b.len(), 32 * MIB);
}

// A device-wide synchronisation while a stream of the device captures (as giving memory back
// does) invalidates the capture on the simulated device, as in CUDA, and is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_device_invalidates_a_capture_when_memory_goes_back_during_it() {
    let (pool, sim) = device_pool();
    let (other, s) = (sim.stream(), sim.stream());
    drop(pool.alloc(8 * MIB, &other).await.unwrap());
    s.begin_capture().unwrap();
    pool.empty_cache().await.unwrap();
    assert!(s.end_capture().is_err(), "the capture was invalidated");
    let log = sim.violation_log();
    assert!(
        log.iter()
            .any(|v| v.kind == pinpool::sim::ViolationKind::SyncDuringCapture
                && v.stream == Some(s.id())),
        "{log:?}"
    );
}

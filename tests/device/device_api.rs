//! The device allocator's calls, as a user of seed 002's interface would make them: typed
//! errors for bad input, raw pointers, statistics by pool, snapshots and the queries built on
//! them, history, and the layout settings of `PINPOOL_DEVICE_CONF`.

use std::sync::Arc;

use pinpool::config::DeviceConfig;
use pinpool::sim::SimRuntime;
use pinpool::{
    BlockStatus, DeviceAllocator, DeviceBuilder, Error, HistoryContext, OomCause, PoolId,
    TraceAction,
};
use pinpool_testkit::eventually;
use pinpool_testkit::sim_device_pool as device_pool;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[tokio::test]
async fn size_zero_gives_an_empty_buffer_at_address_zero_as_raw_alloc_does_and_touches_no_pool() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let b = pool.alloc(0, &s).await.unwrap();
    assert!(b.is_empty());
    assert_eq!(b.pool(), None);
    assert_eq!(b.device_ptr(), 0);
    assert_eq!(b.offset_ptr(0, 0).unwrap(), 0);
    let (p, s2) = (pool.clone(), s.clone());
    let raw = pinpool_testkit::on_plain_thread(move || p.raw_alloc_with_stream(0, &s2)).await;
    assert_eq!(raw.unwrap(), 0);
    pool.raw_delete(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().num_device_alloc, 0);
    assert_eq!(sim.device_used(0), Some(0));
}

#[tokio::test]
async fn a_size_no_device_can_hold_is_a_typed_error_at_once_and_loses_nothing() {
    let sim = SimRuntime::builder().device_capacity(64 * MIB).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    let held = pool.alloc(MIB, &s).await.unwrap();
    let err = pool.alloc(65 * MIB, &s).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::OutOfMemory { requested, limit: None, cause: OomCause::ExceedsDevice, .. }
                if requested == 65 * MIB
        ),
        "{err:?}"
    );
    assert!(err.never_fits());
    assert!(err.to_string().contains("never fit on the device"), "{err}");
    assert!(matches!(
        pool.alloc(usize::MAX, &s).await,
        Err(Error::OutOfMemory { .. }) | Err(Error::SizeTooLarge { .. })
    ));
    assert_eq!(
        pool.stats(0).unwrap().num_alloc_retries,
        0,
        "nothing was tried"
    );
    drop(held);
    assert!(pool.alloc(MIB, &s).await.is_ok());
}

#[tokio::test]
async fn a_device_that_does_not_exist_is_a_typed_error() {
    let sim = SimRuntime::builder().devices(2).build();
    let pool = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    assert_eq!(pool.device_count(), 2);
    assert!(matches!(
        pool.stats(2),
        Err(Error::NoSuchDevice {
            ordinal: 2,
            count: 2
        })
    ));
    assert!(matches!(
        pool.memory_info(7),
        Err(Error::NoSuchDevice { .. })
    ));
    assert!(matches!(
        pool.set_memory_fraction(0.5, 9),
        Err(Error::NoSuchDevice { .. })
    ));
    assert!(sim.stream_on(2).is_err());
    // A stream of device 1 allocates on device 1.
    let s1 = sim.stream_on(1).unwrap();
    let b = pool.alloc(MIB, &s1).await.unwrap();
    assert_eq!(b.device(), 1);
    assert_eq!(sim.device_used(1), Some(pool.reserved_bytes(1).unwrap()));
    assert_eq!(pool.reserved_bytes(0).unwrap(), 0);
}

// The raw calls block the calling thread on a miss: a runtime with worker threads to spare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_pointers_are_freed_once_and_unknown_ones_are_refused() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let p = pool.raw_alloc_with_stream(3000, &s).unwrap();
    let q = pool.raw_alloc_with_stream(MIB, &s).unwrap();
    assert_ne!(p, q);
    assert_eq!(pool.stats(0).unwrap().allocation.all.current, 2);
    pool.raw_delete(p).unwrap();
    assert!(matches!(
        pool.raw_delete(p),
        Err(Error::UnknownPointer { ptr }) if ptr == p
    ));
    assert!(matches!(
        pool.raw_delete(q + 512),
        Err(Error::UnknownPointer { .. })
    ));
    assert_eq!(pool.stats(0).unwrap().allocation.all.current, 1);
    // Raw allocations record streams like buffers do.
    let other = sim.stream();
    let hold = other.hold();
    pool.raw_record_stream(q, &other).unwrap();
    pool.raw_delete(q).unwrap();
    assert_ne!(
        pool.raw_alloc_with_stream(MIB, &s).unwrap(),
        q,
        "q waits for the other stream"
    );
    drop(hold);
    assert!(matches!(
        pool.raw_record_stream(0xdead_0000, &other),
        Err(Error::UnknownPointer { .. })
    ));
}

// A raw pointer is held as its block alone: what was requested must come back with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_pointers_give_back_the_bytes_they_requested_when_deleted() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let p = pool.raw_alloc_with_stream(3000, &s).unwrap();
    let q = pool.raw_alloc_with_stream(MIB + 1, &s).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!(st.requested_bytes.all.current, 3000 + MIB as i64 + 1);
    assert_eq!(st.allocated_bytes.all.current, 3072 + MIB as i64 + 512);
    // Recording a stream works on the pointer where it lies in the table.
    pool.raw_record_stream(q, &sim.stream()).unwrap();
    pool.raw_delete(q).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!(st.requested_bytes.all.current, 3000);
    assert_eq!(st.allocated_bytes.all.current, 3072);
    pool.raw_delete(p).unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!(st.requested_bytes.all.current, 0);
    assert_eq!(st.allocation.all.current, 0);
    assert_eq!(st.requested_bytes.all.freed, 3000 + MIB as i64 + 1);
}

// `record_stream` on one pointer from many threads at once, with its free racing them (as
// PyTorch's threads do with one tensor): every record before the free reaches the block, the
// free always finds the pointer, and the block waits for every stream recorded.
#[test]
fn racing_record_streams_and_a_free_of_one_raw_pointer_lose_neither_a_stream_nor_the_free() {
    let rt = pinpool_testkit::multi_thread(2);
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    let own = sim.stream();
    let threads = 4;
    for round in 0..20 {
        let p = pool.raw_alloc_with_stream(MIB, &own).unwrap();
        let streams: Vec<_> = (0..threads).map(|_| sim.stream()).collect();
        let holds: Vec<_> = streams.iter().map(|s| s.hold()).collect();
        let first = std::sync::Barrier::new(threads + 1);
        let deleting = std::sync::atomic::AtomicBool::new(false);
        let recorded = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for s in &streams {
                let (pool, first, deleting, recorded) = (&pool, &first, &deleting, &recorded);
                scope.spawn(move || {
                    // Every thread records once before the free can start.
                    pool.raw_record_stream(p, s).unwrap();
                    first.wait();
                    for _ in 0..200 {
                        match pool.raw_record_stream(p, s) {
                            Ok(()) => {
                                recorded.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            // The free came first (it had begun by the time the record
                            // failed): the pointer is gone.
                            Err(Error::UnknownPointer { .. })
                                if deleting.load(std::sync::atomic::Ordering::SeqCst) =>
                            {
                                break
                            }
                            Err(e) => panic!("record_stream of round {round} failed: {e}"),
                        }
                    }
                });
            }
            first.wait();
            // The free comes while the threads are in the middle of their records.
            while recorded.load(std::sync::atomic::Ordering::SeqCst) < threads * 50 {
                std::thread::yield_now();
            }
            deleting.store(true, std::sync::atomic::Ordering::SeqCst);
            pool.raw_delete(p)
                .expect("the free finds the pointer while others record streams on it");
        });
        assert_eq!(pool.stats(0).unwrap().allocation.all.current, 0, "leaked");
        // Every stream was recorded: the block waits while any of them is still busy.
        for (i, hold) in holds.into_iter().enumerate() {
            let q = pool.raw_alloc_with_stream(MIB, &own).unwrap();
            assert_ne!(q, p, "reused while stream {i} of {threads} was busy");
            pool.raw_delete(q).unwrap();
            drop(hold);
        }
    }
}

#[tokio::test]
async fn statistics_follow_requests_by_pool_small_and_large() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let small = pool.alloc(1000, &s).await.unwrap(); // 1024 bytes, small pool
    let large = pool.alloc(3 * MIB + 1, &s).await.unwrap(); // large pool
    let st = pool.stats(0).unwrap();
    assert_eq!(st.allocation.all.current, 2);
    assert_eq!(st.allocation.small_pool.current, 1);
    assert_eq!(st.allocation.large_pool.current, 1);
    assert_eq!(st.allocated_bytes.small_pool.current, 1024);
    assert_eq!(
        st.allocated_bytes.large_pool.current as usize,
        3 * MIB + 512
    );
    assert_eq!(st.requested_bytes.all.current as usize, 1000 + 3 * MIB + 1);
    assert_eq!(st.active.all.current, 2);
    assert_eq!(
        st.reserved_bytes.all.current as usize,
        sim.device_used(0).unwrap()
    );
    assert!(st.reserved_bytes.all.current >= st.allocated_bytes.all.current);
    assert_eq!(
        st.inactive_split_bytes.all.current,
        st.reserved_bytes.all.current - st.active_bytes.all.current
    );
    let map = st.to_map();
    for key in [
        "allocated_bytes.all.current",
        "reserved_bytes.small_pool.peak",
        "requested_bytes.large_pool.allocated",
        "num_device_alloc",
        "num_alloc_retries",
    ] {
        assert!(map.contains_key(key), "{key}");
    }
    drop(small);
    let st = pool.stats(0).unwrap();
    assert_eq!(st.allocation.all.current, 1);
    assert_eq!(st.allocation.all.peak, 2);
    assert_eq!(st.allocation.all.freed, 1);
    pool.reset_peak_stats(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().allocation.all.peak, 1);
    pool.reset_accumulated_stats(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().allocation.all.freed, 0);
    drop(large);
}

#[tokio::test]
async fn a_snapshot_lists_segments_with_device_stream_and_block_states() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let a = pool.alloc(10 * KIB, &s).await.unwrap();
    let b = pool.alloc(20 * KIB, &s).await.unwrap();
    let snap = pool.snapshot().await.unwrap();
    assert!(!snap.segments.is_empty());
    for seg in &snap.segments {
        assert_eq!(seg.device, Some(0));
        assert_eq!(seg.stream, Some(s.id().0));
        assert!(seg.pin_method.contains("device"), "{}", seg.pin_method);
    }
    let in_use: Vec<_> = snap
        .blocks()
        .filter(|(_, bl)| bl.state == BlockStatus::InUse)
        .map(|(_, bl)| (bl.address as u64, bl.requested_size))
        .collect();
    assert!(in_use.contains(&(a.device_ptr(), 10 * KIB)));
    assert!(in_use.contains(&(b.device_ptr(), 20 * KIB)));
    let base = pool
        .base_allocation(b.device_ptr() + 100)
        .await
        .unwrap()
        .unwrap();
    assert!(base.base as u64 <= b.device_ptr());
    assert_eq!(pool.base_allocation(8).await.unwrap(), None);
    assert!(pool
        .check_pool_live_allocations(0, PoolId::DEFAULT, &[a.device_ptr(), b.device_ptr()])
        .await
        .unwrap());
    drop(b);
    assert!(pool
        .check_pool_live_allocations(0, PoolId::DEFAULT, &[a.device_ptr()])
        .await
        .unwrap());
    let info = pool.cache_info(0).await.unwrap();
    assert!(info.total_cached >= 20 * KIB, "{info:?}");
    let json = serde_json::to_string(&snap).unwrap();
    assert!(json.contains("\"device\":0"));
}

#[tokio::test]
async fn empty_cache_gives_cached_memory_back_to_the_device() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    let bufs: Vec<_> = futures_join(&pool, &s, &[MIB, 4 * MIB, 300 * MIB]).await;
    let used = sim.device_used(0).unwrap();
    assert!(used >= 305 * MIB);
    drop(bufs);
    let report = pool.empty_cache().await.unwrap();
    assert!(report.freed_bytes > 0);
    assert_eq!(report.reserved_after, 0);
    assert_eq!(sim.device_used(0), Some(0));
    let st = pool.stats(0).unwrap();
    assert_eq!(st.reserved_bytes.all.current, 0);
    assert_eq!(st.num_device_alloc, st.num_device_free);
}

async fn futures_join(
    pool: &DeviceAllocator<SimRuntime>,
    s: &pinpool::sim::SimStream,
    sizes: &[usize],
) -> Vec<pinpool::DeviceBuffer<SimRuntime>> {
    let mut out = Vec::new();
    for &size in sizes {
        out.push(pool.alloc(size, s).await.unwrap());
    }
    out
}

#[tokio::test]
async fn history_records_device_allocations_and_annotations() {
    let (pool, sim) = device_pool();
    let s = sim.stream();
    pool.record_history(true, 1000, HistoryContext::None)
        .unwrap();
    pool.record_annotation("step 1");
    let b = pool.alloc(MIB, &s).await.unwrap();
    drop(b);
    let h = pool.history(0).await.unwrap();
    let actions: Vec<_> = h.entries.iter().map(|e| e.action).collect();
    assert!(actions.contains(&TraceAction::UserDefined));
    assert!(actions.contains(&TraceAction::SegmentMap));
    assert!(actions.contains(&TraceAction::Alloc));
    assert!(actions.contains(&TraceAction::FreeCompleted));
    let page = pool.history_html(0).await.unwrap();
    assert!(page.contains("<svg"));
}

#[tokio::test]
async fn max_split_size_counts_oversize_blocks_and_gives_them_segments_of_their_own() {
    let sim = SimRuntime::new();
    let config: DeviceConfig = "max_split_size_mb:32".parse().unwrap();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .config(&config)
        .build()
        .unwrap();
    let s = sim.stream();
    let big = pool.alloc(40 * MIB, &s).await.unwrap();
    let small = pool.alloc(MIB, &s).await.unwrap();
    let st = pool.stats(0).unwrap();
    assert_eq!(st.oversize_allocations.current, 1);
    assert_eq!(st.oversize_segments.current, 1);
    assert_eq!(st.max_split_size, Some(32 << 20));
    let big_ptr = big.device_ptr();
    drop(big);
    // A small request is never cut out of the free oversize segment.
    let small2 = pool.alloc(2 * MIB, &s).await.unwrap();
    let base = pool.base_allocation(big_ptr).await.unwrap().unwrap();
    assert!(
        small2.device_ptr() < base.base as u64
            || small2.device_ptr() >= (base.base + base.size) as u64
    );
    drop((small, small2));
}

#[tokio::test]
async fn separate_segments_when_expandable_segments_is_off() {
    let sim = SimRuntime::new();
    let config = DeviceConfig::default().with_expandable_segments(false);
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .config(&config)
        .build()
        .unwrap();
    let s = sim.stream();
    let a = pool.alloc(100 * KIB, &s).await.unwrap();
    let snap = pool.snapshot().await.unwrap();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].pin_method, "simulated_device");
    assert_eq!(snap.segments[0].total_size, 2 * MIB, "a small segment");
    drop(a);
    eventually("idle", || pool.stats(0).unwrap().active.all.current == 0).await;
}

#[tokio::test]
async fn a_buffer_from_another_allocator_cannot_be_recorded() {
    let (p1, sim) = device_pool();
    let p2 = DeviceBuilder::new(Arc::new(sim.clone())).build().unwrap();
    let s = sim.stream();
    let mut b = p1.alloc(KIB, &s).await.unwrap();
    assert!(matches!(
        p2.record_stream(&mut b, &sim.stream()),
        Err(Error::ForeignBuffer)
    ));
    assert!(b.recorded_streams().is_empty());
}

#[test]
fn blocking_calls_work_from_plain_threads() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sim = SimRuntime::new();
    let pool = DeviceBuilder::new(Arc::new(sim.clone()))
        .handle(rt.handle().clone())
        .build()
        .unwrap();
    let s = sim.stream();
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                for i in 0..200 {
                    let b = pool.alloc_blocking(KIB * (1 + i % 7), &s).unwrap();
                    drop(b);
                }
            });
        }
    });
    assert_eq!(pool.stats(0).unwrap().allocation.all.current, 0);
    pool.empty_cache_blocking().unwrap();
    assert_eq!(sim.device_used(0), Some(0));
}

#[tokio::test]
async fn the_device_peaks_are_of_all_pools_at_once_not_the_sum_of_each_pools_peak() {
    let (pool, sim) = device_pool();
    let (a, b) = (sim.stream(), sim.stream());
    // Stream A's pool peaks at 64 MiB and gives it all back; then stream B's pool does.
    drop(pool.alloc(64 * MIB, &a).await.unwrap());
    pool.empty_cache().await.unwrap();
    let held = pool.alloc(64 * MIB, &b).await.unwrap();
    let s = pool.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.all.current, 64 * MIB as i64);
    assert_eq!(
        s.reserved_bytes.all.peak,
        64 * MIB as i64,
        "{:?}",
        s.reserved_bytes
    );
    assert!(
        s.allocated_bytes.all.peak <= s.reserved_bytes.all.peak,
        "{s:?}"
    );
    assert!(
        s.active_bytes.all.peak <= s.reserved_bytes.all.peak,
        "{s:?}"
    );
    drop(held);
    // After a reset the peak starts from what is reserved now.
    pool.empty_cache().await.unwrap();
    pool.reset_peak_stats(0).unwrap();
    assert_eq!(pool.stats(0).unwrap().reserved_bytes.all.peak, 0);
}

/// Code generic over the runtime makes its streams with the one call every runtime has.
async fn a_block_on_a_new_stream<R: pinpool::DeviceRuntime>(
    pool: &DeviceAllocator<R>,
) -> Result<(u64, R::Stream), Error> {
    let stream = pool.runtime().new_stream()?;
    let b = pool.alloc(MIB, &stream).await?;
    Ok((b.device_ptr(), stream))
}

#[tokio::test]
async fn the_one_stream_call_makes_a_stream_whose_freed_blocks_it_reuses_at_once() {
    let (pool, sim) = device_pool();
    let (first, stream) = a_block_on_a_new_stream(&pool).await.unwrap();
    // Freed on its own stream: the next request on that stream takes it back at once.
    let again = pool.alloc(MIB, &stream).await.unwrap();
    assert_eq!(again.device_ptr(), first);
    // Inherent and trait calls are the same call.
    let other = sim.new_stream().unwrap();
    assert_ne!(other.id(), stream.id());
    assert_eq!(sim.violations(), 0, "{:?}", sim.violation_log());
}

//! Statistics that add up under PyTorch's keys: in each of the small and large pools, what is
//! allocated is at most what is active, which is at most what is reserved; segment counts are
//! never negative; the parts add up to the whole; and `allocated` counts the buffers
//! requesters received, never the tries a request for several buffers took back.
//!
//! The same rules over random workloads are the property tests in
//! `tests/properties/stats_invariants.rs`.

use std::sync::Arc;
use std::time::Duration;

use pinpool::sim::SimRuntime;
use pinpool::{BufferSet, DeviceBuilder, PinnedAllocator};
use pinpool_testkit::assert_device_stats_add_up;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// The example: with a 4 MiB and a 4 KiB buffer live, the large pool showed 4 MiB
/// allocated and nothing reserved (every 2 MiB granule the range mapped counted as a small
/// segment). Now each pool reserves at least what it holds, and the parts add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_and_a_small_buffer_are_each_reserved_in_their_own_pool() {
    let device = DeviceBuilder::new(Arc::new(SimRuntime::new()))
        .build()
        .unwrap();
    let stream = device.runtime().stream();
    let large = device.alloc(4 * MIB, &stream).await.unwrap();
    let small = device.alloc(4 * KIB, &stream).await.unwrap();
    let s = device.stats(0).unwrap();
    assert_device_stats_add_up(&s);
    assert_eq!(s.allocated_bytes.large_pool.current, 4 * MIB as i64);
    assert_eq!(s.allocated_bytes.small_pool.current, 4 * KIB as i64);
    assert!(
        s.reserved_bytes.large_pool.current >= 4 * MIB as i64,
        "{s:?}"
    );
    assert!(
        s.reserved_bytes.small_pool.current >= 4 * KIB as i64,
        "{s:?}"
    );
    assert!(
        s.segment.large_pool.current >= 1 && s.segment.small_pool.current >= 1,
        "{s:?}"
    );
    drop((large, small));
    let s = device.stats(0).unwrap();
    assert_device_stats_add_up(&s);
    device.empty_cache().await.unwrap();
    let s = device.stats(0).unwrap();
    assert_device_stats_add_up(&s);
    assert_eq!(s.reserved_bytes.all.current, 0);
}

/// The other example: requests for a pinned and a device buffer together, each of
/// which first found the device's cap full, took the pinned buffer, gave it back and waited.
/// The pinned statistics counted every try (241 pinned allocations for 80 requests). Now
/// both allocators count the buffers their requesters received: one pinned buffer and one
/// device buffer a request (and the device buffers the test itself held), whichever budget
/// a request tried first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffer_sets_that_waited_count_only_the_buffers_they_received() {
    const SETS: usize = 80;
    let sim = Arc::new(SimRuntime::new());
    // Pinned first: its budget is taken first, so each try takes the pinned buffer before
    // it finds the device full.
    let pinned = PinnedAllocator::builder()
        .runtime(sim.clone())
        .build()
        .unwrap();
    let device = DeviceBuilder::new(sim).max_bytes(8 * MIB).build().unwrap();
    let stream = device.runtime().stream();
    for _ in 0..SETS {
        let hold = device.alloc(8 * MIB, &stream).await.unwrap();
        let set = {
            let (pinned, device, stream) = (pinned.clone(), device.clone(), stream.clone());
            tokio::spawn(async move {
                BufferSet::new()
                    .pinned(&pinned, MIB)
                    .device(&device, 3 * MIB, &stream)
                    .device(&device, 2 * MIB, &stream)
                    .alloc()
                    .await
                    .map(|t| (t.pinned.len(), t.device.len()))
            })
        };
        // Let it find the cap full (and give back what it took) before room comes.
        tokio::time::sleep(Duration::from_millis(2)).await;
        drop(hold);
        assert_eq!(set.await.unwrap().unwrap(), (1, 2));
    }
    let p = pinned.stats();
    assert_eq!(p.active_requests.allocated, SETS as i64, "{p:?}");
    assert_eq!(p.active_requests.freed, SETS as i64, "{p:?}");
    assert_eq!(p.active_requests.current, 0);
    let d = device.stats(0).unwrap();
    let received = (SETS * 3) as i64;
    assert_eq!(d.allocation.all.allocated, received, "{d:?}");
    assert_eq!(d.active.all.allocated, received, "{d:?}");
    assert_eq!(d.allocation.all.current, 0);
    assert_device_stats_add_up(&d);
}

/// A set whose device buffers are tried first (the device's budget is older) and whose
/// second device buffer finds no room gives the first back: with `try_alloc` the request
/// fails, and nothing it took is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_try_of_a_buffer_set_counts_nothing_it_took() {
    let sim = Arc::new(SimRuntime::new());
    let device = DeviceBuilder::new(sim.clone())
        .max_bytes(8 * MIB)
        .build()
        .unwrap();
    let pinned = PinnedAllocator::builder().runtime(sim).build().unwrap();
    let stream = device.runtime().stream();
    let hold = device.alloc(4 * MIB, &stream).await.unwrap();
    let before = device.stats(0).unwrap();
    for _ in 0..10 {
        let err = BufferSet::new()
            .device(&device, 3 * MIB, &stream)
            .device(&device, 2 * MIB, &stream)
            .pinned(&pinned, MIB)
            .try_alloc()
            .await
            .err()
            .expect("no room for both device buffers");
        assert!(!err.never_fits(), "{err}");
    }
    let after = device.stats(0).unwrap();
    assert_eq!(
        after.allocation.all.allocated,
        before.allocation.all.allocated
    );
    assert_eq!(
        after.allocated_bytes.all.allocated,
        before.allocated_bytes.all.allocated
    );
    assert_eq!(
        after.requested_bytes.all.allocated,
        before.requested_bytes.all.allocated
    );
    assert_eq!(after.active.all.allocated, before.active.all.allocated);
    assert_eq!(pinned.stats().active_requests.allocated, 0);
    assert_device_stats_add_up(&after);
    drop(hold);
}
